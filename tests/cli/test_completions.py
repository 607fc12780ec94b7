"""The committed completion scripts work in real shells: bash, zsh and fish load them and complete
flags (also before the default command's script: ``resilrun --nn``) and subcommands.

Each shell runs with a ``resilrun`` on PATH that is this interpreter's ``python -m resilrun``, so the
tests exercise the repository's CLI, not whatever else is installed. A missing shell skips locally
and fails in CI (CI=true).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPLETIONS = ROOT / "completions"
SHELL_TIMEOUT_S = 60  # each completion starts a Python process; a loaded 2-core CI box is slow


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{tool} is required in CI (make test installs it with apt-get when run as root)")
        pytest.skip(f"{tool} is not installed")
    return path


@pytest.fixture
def shell_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``resilrun`` is this checkout's CLI, with a private HOME."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "resilrun"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m resilrun "$@"\n')
    shim.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("_RESILRUN")}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", HOME=str(home), ZDOTDIR=str(home), XDG_CONFIG_HOME=str(home))
    return env


def run_shell(argv: list[str], env: dict[str, str]) -> str:
    result = subprocess.run(
        argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=SHELL_TIMEOUT_S, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 0, f"{argv[0]} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_committed_scripts_are_what_the_cli_prints_for_source(shell_env: dict[str, str]) -> None:
    for shell in ("bash", "zsh", "fish"):
        printed = subprocess.run(
            [sys.executable, "-m", "resilrun"],
            env={**shell_env, "_RESILRUN_COMPLETE": f"source_{shell}"},
            capture_output=True,
            text=True,
            timeout=SHELL_TIMEOUT_S,
            check=True,
        ).stdout
        assert printed == (COMPLETIONS / f"resilrun.{shell}").read_text(), shell


# -- bash --------------------------------------------------------------------------------------------
def bash_complete(env: dict[str, str], *words: str) -> list[str]:
    """Load the script, check ``complete`` registered it, then complete the last word as bash would."""
    script = (
        f"source {COMPLETIONS / 'resilrun.bash'}\n"
        "complete -p resilrun\n"
        f"COMP_WORDS=({' '.join(words)})\n"
        f"COMP_CWORD={len(words) - 1}\n"
        "_resilrun_completion resilrun\n"
        'for reply in "${COMPREPLY[@]}"; do printf "reply:%s\\n" "$reply"; done\n'
    )
    out = run_shell([require("bash"), "--norc", "--noprofile", "-c", script], env)
    assert "complete -o default -F _resilrun_completion resilrun" in out
    return [line.removeprefix("reply:") for line in out.splitlines() if line.startswith("reply:")]


def test_bash_completes_run_flags_before_the_script(shell_env: dict[str, str]) -> None:
    assert bash_complete(shell_env, "resilrun", "--nn") == ["--nnodes"]


def test_bash_completes_run_flags_after_run(shell_env: dict[str, str]) -> None:
    assert bash_complete(shell_env, "resilrun", "run", "--nn") == ["--nnodes"]


def test_bash_completes_run_flags_after_another_run_flag(shell_env: dict[str, str]) -> None:
    assert bash_complete(shell_env, "resilrun", "--standalone", "--max-r") == ["--max-restarts"]


def test_bash_completes_subcommands(shell_env: dict[str, str]) -> None:
    assert bash_complete(shell_env, "resilrun", "ins") == ["inspect-checkpoint"]
    assert bash_complete(shell_env, "resilrun", "r") == ["run"]


def test_bash_offers_top_level_and_run_options_for_a_first_dash(shell_env: dict[str, str]) -> None:
    offered = bash_complete(shell_env, "resilrun", "--")
    assert {"--version", "--help", "--nnodes", "--checkpoint-uri"} <= set(offered)
    assert len(offered) == len(set(offered))


def test_bash_completes_inspect_checkpoint_flags(shell_env: dict[str, str]) -> None:
    assert bash_complete(shell_env, "resilrun", "inspect-checkpoint", "--ver") == ["--verify"]


def test_bash_falls_back_to_files_for_the_script(shell_env: dict[str, str]) -> None:
    # No command starts with "examples/": the reply is empty and `complete -o default` completes paths
    assert bash_complete(shell_env, "resilrun", "examples/") == []


# -- zsh ---------------------------------------------------------------------------------------------
def zsh_complete(env: dict[str, str], tmp_path: Path, *words: str) -> str:
    """compinit, source the script, check compdef registered it, then run its completion function
    with the words zsh would pass; a stand-in ``_arguments`` prints the completion spec it gets."""
    script = (
        f"autoload -U compinit; compinit -u -d {tmp_path / 'zcompdump'}\n"
        f"source {COMPLETIONS / 'resilrun.zsh'}\n"
        'print -r -- "registered:$_comps[resilrun]"\n'
        '_arguments() { print -r -- "spec:$*" }\n'
        '_files() { print -r -- "files" }\n'
        f"words=({' '.join(words)}); CURRENT={len(words)}\n"
        "_resilrun_completion\n"
    )
    out = run_shell([require("zsh"), "-f", "-c", script], env)
    assert "registered:_resilrun_completion" in out
    return out


def test_zsh_loads_the_script_and_completes_run_flags_before_the_script(
    shell_env: dict[str, str], tmp_path: Path
) -> None:
    out = zsh_complete(shell_env, tmp_path, "resilrun", "--nn")
    assert '"--nnodes":"Number of nodes' in out


def test_zsh_completes_subcommands(shell_env: dict[str, str], tmp_path: Path) -> None:
    assert '"inspect-checkpoint"' in zsh_complete(shell_env, tmp_path, "resilrun", "ins")
    assert '"--nnodes"' in zsh_complete(shell_env, tmp_path, "resilrun", "run", "--nn")


def test_zsh_interactive_tab_completes_nnodes(shell_env: dict[str, str], tmp_path: Path) -> None:
    # Given an interactive zsh (on a pseudo-terminal) with compinit and the script loaded
    driver = (
        "zmodload zsh/zpty\n"
        "zpty z 'zsh -f -i'\n"
        f'zpty -w z \'PROMPT="> "; autoload -U compinit; compinit -u -d {tmp_path / "zcompdump"}; '
        f"source {COMPLETIONS / 'resilrun.zsh'}'\n"
        # When the user types `resilrun --nn` and TAB
        "zpty -w -n z $'resilrun --nn\\t'\n"
        # Then the line is completed to --nnodes (zpty -r blocks until it is; the test's timeout bounds it)
        "zpty -r z out '*--nnodes*' && print -r -- completed\n"
        "zpty -d z\n"
    )
    assert "completed" in run_shell([require("zsh"), "-f", "-c", driver], shell_env)


# -- fish --------------------------------------------------------------------------------------------
def fish_complete(env: dict[str, str], line: str) -> list[str]:
    script = f"source {COMPLETIONS / 'resilrun.fish'}; complete -C '{line}'"
    out = run_shell([require("fish"), "--no-config", "-c", script], env)
    return [entry.split("\t")[0] for entry in out.splitlines()]


def test_fish_completes_run_flags_before_the_script(shell_env: dict[str, str]) -> None:
    assert fish_complete(shell_env, "resilrun --nn") == ["--nnodes"]


def test_fish_completes_subcommands_and_flags_after_run(shell_env: dict[str, str]) -> None:
    assert fish_complete(shell_env, "resilrun ins") == ["inspect-checkpoint"]
    assert fish_complete(shell_env, "resilrun run --nn") == ["--nnodes"]
