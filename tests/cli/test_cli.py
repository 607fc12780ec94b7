"""The command line: parsing, pass-through of script arguments, environment, exit codes, drift.

Nothing here starts an agent: ``resilrun.agent.run`` is replaced by a recorder.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import typer

import resilrun
import resilrun.agent
from resilrun import cli
from resilrun.config import CONFIG_FIELDS, Config
from resilrun.env import SNAPSHOT_AUTO
from resilrun.errors import ExitCode, RendezvousTimeoutError


class Result(NamedTuple):
    code: int
    out: str
    err: str


@pytest.fixture(autouse=True)
def _restore_resilrun_logger() -> Iterator[None]:
    """main() points the 'resilrun' logger at the (captured) stderr; undo that after each test."""
    logger = logging.getLogger("resilrun")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[Config]:
    """Configs that would have been launched; the agent never runs."""
    configs: list[Config] = []
    monkeypatch.setattr(resilrun.agent, "run", configs.append)
    return configs


def invoke(capsys: pytest.CaptureFixture[str], *argv: str) -> Result:
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    captured = capsys.readouterr()
    code = info.value.code
    return Result(code if isinstance(code, int) else (0 if code is None else 1), captured.out, captured.err)


def assert_usage_error(result: Result, *fragments: str) -> None:
    assert result.code == ExitCode.USAGE == 2, result
    errors = [line for line in result.err.splitlines() if line.startswith("resilrun: error:")]
    assert len(errors) == 1, result.err
    assert "Traceback" not in result.err + result.out
    assert "internal error" not in result.err
    for fragment in fragments:
        assert fragment in errors[0]


# -- top level ------------------------------------------------------------------------------------
def test_version_prints_the_package_version_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    result = invoke(capsys, "--version")
    assert result.code == 0
    assert result.out.strip() == f"resilrun {resilrun.__version__}"


def test_help_lists_the_run_command_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    result = invoke(capsys, "--help")
    assert result.code == 0
    assert "run" in result.out
    assert "Usage" in result.out


def test_run_help_lists_torchrun_flags_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    result = invoke(capsys, "run", "--help")
    assert result.code == 0
    for flag in ("--nnodes", "--nproc-per-node", "--rdzv-endpoint", "--max-restarts", "--standalone"):
        assert flag in result.out


def test_run_help_names_what_each_option_takes_and_flags_take_nothing() -> None:
    # Every option that takes a value says which kind (INTEGER, SECONDS, a choice, ...), as man does
    for spec in CONFIG_FIELDS:
        meta = spec.metadata
        takes_value = spec.type not in (bool, "bool")
        assert bool(meta["value"]) == takes_value, meta["flag"]
    wide = subprocess.run(
        [sys.executable, "-m", "resilrun", "run", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        check=True,
    ).stdout
    options = wide.split("Rendezvous", 1)[1]
    assert "<str>" not in options and "<bool>" not in options and "<int>" not in options
    for flag, value in (("--replicas", "INTEGER"), ("--heartbeat-timeout", "SECONDS"), ("--log-dir", "DIR")):
        line = next(line for line in options.splitlines() if flag in line)
        assert value in line, line


def test_short_h_prints_help_like_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    result = invoke(capsys, "-h")
    assert result.code == 0
    assert "Usage" in result.out


def test_importing_the_cli_does_not_import_torch() -> None:
    probe = "import resilrun.cli, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_the_cli_imports_without_the_click_distribution() -> None:
    probe = "import sys; sys.modules['click'] = None; import resilrun.cli"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# -- usage errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--nnodes", "x"], "--nnodes 'x'"),
        (["--nnodes", "3:2"], "min (3) must be <= max (2)"),
        (["--nproc-per-node", "0"], "--nproc-per-node '0'"),
        (["--max-restarts", "abc"], "--max-restarts 'abc'"),
        (["--max-restarts", "-1"], "--max-restarts (-1)"),
        (["--monitor-interval", "fast"], "--monitor-interval 'fast'"),
        (["--shutdown-timeout", "soon"], "--shutdown-timeout 'soon'"),
        (["--node-rank", "one"], "--node-rank 'one'"),
        (["--master-port", "p"], "--master-port 'p'"),
        (["--rdzv-conf", "bogus=1"], "'bogus'"),
        (["--rdzv-backend", "etcd"], "etcd"),
        (["--rdzv-backend", "zk"], "'zk'"),
        (["--rdzv-endpoint", "a:b:c"], "'a:b:c'"),
        (["-r", "9"], "--redirects '9'"),
        (["-t", "x"], "--tee 'x'"),
        (["--local-ranks-filter", "a"], "'a'"),
        (["--standalone", "--nnodes", "2"], "--standalone"),
        (["--snapshot-every", "0"], "--snapshot-every '0' is not a positive integer or auto"),
        (["--snapshot-every", "often"], "--snapshot-every 'often'"),
        (["--max-overhead", "low"], "--max-overhead 'low' is not a percentage"),
        (["--max-overhead", "80"], "--max-overhead (80) must be between 0.1 and 50"),
        (["--replicate-every", "0"], "--replicate-every '0' is not a positive integer or auto"),
        (["--replicate-every", "auto"], "--replicate-every auto needs --snapshot-every auto"),
    ],
)
def test_a_bad_flag_value_is_a_one_line_usage_error(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str, argv: list[str], fragment: str
) -> None:
    assert_usage_error(invoke(capsys, *argv, script), fragment)
    assert launched == []


def test_a_bad_flag_value_after_run_is_a_usage_error_too(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str
) -> None:
    assert_usage_error(invoke(capsys, "run", "--nnodes", "x", script), "--nnodes 'x'")


def test_a_script_that_does_not_exist_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], launched: list[Config], tmp_path: Path
) -> None:
    missing = str(tmp_path / "missing.py")
    result = invoke(capsys, missing)
    assert_usage_error(result, f"'{missing}' does not exist")
    assert "resilrun: hint:" in result.err
    assert launched == []


@pytest.mark.parametrize("option", ["--bogus", "-x", "--nnodes-typo=3"])
def test_an_unknown_option_before_the_script_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str, option: str
) -> None:
    assert_usage_error(invoke(capsys, option, script), f"unknown option '{option}'")
    assert launched == []


@pytest.mark.parametrize(
    "argv",
    [["run"], ["run", "--nnodes"], ["--standalone=3", "train.py"]],
    ids=["missing-script", "missing-option-value", "value-for-a-flag"],
)
def test_click_level_usage_errors_exit_2_without_internal_error(
    capsys: pytest.CaptureFixture[str], launched: list[Config], argv: list[str]
) -> None:
    assert_usage_error(invoke(capsys, *argv))


def test_a_bad_boolean_in_the_environment_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RESILRUN_STANDALONE", "maybe")
    assert_usage_error(invoke(capsys, script), "RESILRUN_STANDALONE")


def test_no_arguments_prints_help_without_an_internal_error(capsys: pytest.CaptureFixture[str]) -> None:
    result = invoke(capsys)
    assert "Usage" in result.out + result.err
    assert "internal error" not in result.err
    assert result.code == ExitCode.USAGE  # cli.main: no arguments is a usage error, help shown instead of a message


def test_a_resilrun_error_from_the_agent_is_rendered_with_its_exit_code(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, script: str
) -> None:
    def fail(config: Config) -> None:
        raise RendezvousTimeoutError("only 1 of 2 nodes joined", hint="start the other node")

    monkeypatch.setattr(resilrun.agent, "run", fail)
    result = invoke(capsys, script)
    assert result.code == ExitCode.RENDEZVOUS
    assert "resilrun: error: only 1 of 2 nodes joined" in result.err
    assert "resilrun: hint: start the other node" in result.err
    assert "Traceback" not in result.err


# -- what reaches the Config -------------------------------------------------------------------------
def test_a_valid_command_line_launches_exactly_once_and_exits_zero(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str
) -> None:
    assert invoke(capsys, script).code == 0
    assert len(launched) == 1
    assert launched[0].script == script
    assert launched[0].script_args == ()


def test_flags_after_the_script_are_passed_to_the_script_untouched(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str
) -> None:
    assert invoke(capsys, script, "--nnodes", "3", "-m", "--lr=0.1", "--", "x").code == 0
    (config,) = launched
    assert config.nnodes == "1:1"
    assert not config.module
    assert config.script_args == ("--nnodes", "3", "-m", "--lr=0.1", "--", "x")


def test_the_explicit_run_command_parses_like_the_default(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str
) -> None:
    assert invoke(capsys, "run", "--nproc-per-node", "2", script, "a").code == 0
    assert (launched[0].nproc_per_node, launched[0].script_args) == ("2", ("a",))


def test_torchrun_flags_reach_the_config(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str, tmp_path: Path
) -> None:
    argv = [
        "--nnodes", "2", "--nproc-per-node", "4", "--node-rank", "1", "--rdzv-endpoint", "head:1234",
        "--rdzv-id", "job7", "--rdzv-conf", "join_timeout=5", "--max-restarts", "3", "--monitor-interval", "0.5",
        "--role", "trainer", "--log-dir", str(tmp_path), "--local-ranks-filter", "0", "--shutdown-timeout", "2",
        "--master-port", "1111", "--local-addr", "10.0.0.2", "--start-method", "fork",
    ]  # fmt: skip
    assert invoke(capsys, *argv, script).code == 0
    (c,) = launched
    assert (c.node_range, c.nproc_per_node, c.node_rank, c.endpoint) == ((2, 2), "4", 1, ("head", 1234))
    assert (c.rdzv_id, c.rdzv.join_timeout_s, c.max_restarts, c.monitor_interval_s) == ("job7", 5.0, 3, 0.5)
    assert (c.role, c.log_dir, c.ranks_filter, c.shutdown_timeout_s) == ("trainer", str(tmp_path), frozenset({0}), 2.0)
    assert (c.master_port, c.local_addr, c.start_method) == (1111, "10.0.0.2", "fork")


@pytest.mark.parametrize(
    ("flag", "field", "value"),
    [
        ("--nproc_per_node", "nproc_per_node", "2"),
        ("--max_restarts", "max_restarts", 2),
        ("--rdzv_id", "rdzv_id", "2"),
        ("--monitor_interval", "monitor_interval_s", 2.0),
    ],
)
def test_torchrun_underscore_spellings_are_accepted(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str, flag: str, field: str, value: object
) -> None:
    assert invoke(capsys, flag, "2", script).code == 0
    assert getattr(launched[0], field) == value and type(getattr(launched[0], field)) is type(value)


def test_short_flags_m_r_and_t_set_module_redirects_and_tee(
    capsys: pytest.CaptureFixture[str], launched: list[Config]
) -> None:
    assert invoke(capsys, "-r", "3", "-t", "0:1,1:2", "-m", "pkg.train", "--epochs", "1").code == 0
    (c,) = launched
    assert c.module and c.script == "pkg.train"
    assert c.redirects == "3" and c.tee == "0:1,1:2"
    assert c.script_args == ("--epochs", "1")


def test_no_python_runs_a_program_whose_name_looks_like_an_option(
    capsys: pytest.CaptureFixture[str], launched: list[Config]
) -> None:
    assert invoke(capsys, "--no-python", "true", "--flag").code == 0
    assert (launched[0].script, launched[0].script_args) == ("true", ("--flag",))


def test_standalone_from_the_cli_gets_a_fresh_run_id(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str
) -> None:
    assert invoke(capsys, "--standalone", "--rdzv-id", "mine", script).code == 0
    assert launched[0].rdzv_id != "mine"
    assert launched[0].endpoint == ("localhost", 0)


# -- environment --------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["RESILRUN_", "PET_"])
def test_environment_variables_set_flags(
    capsys: pytest.CaptureFixture[str],
    launched: list[Config],
    script: str,
    monkeypatch: pytest.MonkeyPatch,
    prefix: str,
) -> None:
    monkeypatch.setenv(f"{prefix}NNODES", "1:2")
    monkeypatch.setenv(f"{prefix}RDZV_ENDPOINT", "head:29400")
    monkeypatch.setenv(f"{prefix}NPROC_PER_NODE", "3")
    monkeypatch.setenv(f"{prefix}MAX_RESTARTS", "4")
    assert invoke(capsys, script).code == 0
    (c,) = launched
    assert (c.nnodes, c.rdzv_endpoint, c.nproc_per_node, c.max_restarts) == ("1:2", "head:29400", "3", 4)


def test_a_flag_beats_the_environment(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RESILRUN_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "5")
    assert invoke(capsys, "--nproc-per-node", "2", script).code == 0
    assert launched[0].nproc_per_node == "2"


def test_resilrun_environment_beats_torchrun_environment(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "5")
    monkeypatch.setenv("RESILRUN_NPROC_PER_NODE", "3")
    assert invoke(capsys, script).code == 0
    assert launched[0].nproc_per_node == "3"


def test_a_bad_value_from_the_environment_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PET_NNODES", "two")
    assert_usage_error(invoke(capsys, script), "--nnodes 'two'")


# -- drift: Config fields <-> run options <-> environment ------------------------------------------
def _run_options() -> list[typer.core.TyperOption]:
    group = typer.main.get_command(cli.app)
    run = group.commands["run"]  # type: ignore[attr-defined]
    return [p for p in run.params if isinstance(p, typer.core.TyperOption)]


def test_every_config_field_has_exactly_one_run_option_with_its_flag_and_env() -> None:
    options = _run_options()
    for field in CONFIG_FIELDS:
        meta = field.metadata
        matching = [o for o in options if o.opts[0] == meta["flag"]]
        assert len(matching) == 1, f"{field.name}: {len(matching)} options declare {meta['flag']}"
        (option,) = matching
        assert list(option.envvar) == list(meta["env"]), field.name
        assert option.help == meta["help"], field.name


def test_every_run_option_belongs_to_a_config_field() -> None:
    flags = {f.metadata["flag"] for f in CONFIG_FIELDS}
    extra = [o.opts[0] for o in _run_options() if o.opts[0] not in flags]
    assert extra == []
    assert len(_run_options()) == len(CONFIG_FIELDS)


def test_every_environment_variable_maps_to_one_option() -> None:
    seen: dict[str, str] = {}
    for option in _run_options():
        for name in option.envvar:
            assert name not in seen, f"{name} used by {seen.get(name)} and {option.opts[0]}"
            seen[name] = option.opts[0]


def test_snapshot_every_auto_with_a_budget_reaches_the_config(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str
) -> None:
    flags = ["--snapshot-every", "AUTO", "--max-overhead", "2%", "--replicate-every", "10"]
    assert invoke(capsys, *flags, script).code == 0
    (config,) = launched
    assert (config.snapshot_every, config.max_overhead_pct, config.replicate_every) == (SNAPSHOT_AUTO, 2.0, 10)


def test_replicate_every_auto_reaches_the_config(
    capsys: pytest.CaptureFixture[str], launched: list[Config], script: str
) -> None:
    assert invoke(capsys, "--snapshot-every", "auto", "--replicate-every", "auto", script).code == 0
    (config,) = launched
    assert (config.snapshot_every, config.replicate_every) == (SNAPSHOT_AUTO, SNAPSHOT_AUTO)
