"""The run's log directory and events file are the job user's alone (issue 19): 0700 and 0600; a
directory of another user, or one others can write to, is refused, and no link is followed (issue 43)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from resilrun.agent.node import _log_root
from resilrun.agent.observability.events import EVENTS_FILE, EventLog
from resilrun.agent.workers.procs import WorkerSpec, spawn
from resilrun.config import Config
from resilrun.errors import ConfigError, ExitCode
from resilrun.option_values import Std
from resilrun.worker_main import write_error_file


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("existing", [False, True], ids=["new", "made by another agent first"])
def test_the_run_log_directory_is_private(tmp_path: Path, existing: bool) -> None:
    config = Config.from_cli(script=__file__, log_dir=str(tmp_path / "logs"), rdzv_id="job7")
    if existing:
        (tmp_path / "logs" / "job7").mkdir(parents=True, mode=0o755)
        os.chmod(tmp_path / "logs" / "job7", 0o755)
    root = _log_root(config)
    assert root == tmp_path / "logs" / "job7" and _mode(root) == 0o700


def test_the_default_log_directory_is_private_too() -> None:
    root = _log_root(Config.from_cli(script=__file__))
    try:
        assert _mode(root) == 0o700
    finally:
        root.rmdir()


def test_the_events_file_is_created_0600(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", node_id="n", host="h")
    log.record("agent_started", replica_server=None, metrics=None)
    log.close()
    assert _mode(tmp_path / "events.jsonl") == 0o600


# issue 43, F6: `<log-dir>/<rdzv-id>` is a predictable path (a SLURM job id); another user who makes
# it first (mode 0777) and plants symlinks in it would have the agent truncate and overwrite the
# victim's files. We run as root here, so "another user" is made with chown.

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
PRECIOUS = "the victim's data\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text(PRECIOUS)
    return victim


def _config(tmp_path: Path) -> Config:
    return Config.from_cli(script=__file__, log_dir=str(tmp_path / "logs"), rdzv_id="job7")


@needs_root
def test_a_run_directory_made_by_another_user_is_refused_and_its_links_never_followed(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    planted = tmp_path / "logs" / "job7"
    planted.mkdir(parents=True)
    planted.chmod(0o777)
    os.chown(planted, 65534, 65534)
    for name in (EVENTS_FILE, "round_0"):
        (planted / name).symlink_to(victim if name == EVENTS_FILE else tmp_path)
        os.lchown(planted / name, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534") as caught:
        _log_root(_config(tmp_path))
    assert caught.value.exit_code == ExitCode.USAGE and caught.value.hint and "--log-dir" in caught.value.hint
    assert "\n" not in caught.value.message
    assert victim.read_text() == PRECIOUS and _mode(planted) == 0o777  # nothing written, nothing changed


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702], ids=oct)
def test_a_run_directory_others_can_write_to_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "logs" / "job7"
    root.mkdir(parents=True)
    root.chmod(mode)
    with pytest.raises(ConfigError, match=f"can be written by others \\(mode {mode:04o}\\)") as caught:
        _log_root(_config(tmp_path))
    assert caught.value.hint is not None


def test_a_symlink_as_the_run_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "job7").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="symbolic link"):
        _log_root(_config(tmp_path))


def test_a_symlink_planted_at_the_events_file_is_not_followed(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    root = _log_root(_config(tmp_path))
    (root / EVENTS_FILE).symlink_to(victim)
    log = EventLog(root / EVENTS_FILE, node_id="n", host="h")
    log.record("agent_started", replica_server=None, metrics=None)
    log.close()
    assert victim.read_text() == PRECIOUS


def _spec(log_dir: Path) -> WorkerSpec:
    return WorkerSpec(
        local_rank=0,
        global_rank=0,
        argv=(sys.executable, "-c", "print('from the worker')"),
        env={"PATH": os.environ.get("PATH", "")},
        log_dir=log_dir,
        to_file=Std.ALL,
        to_console=Std.NONE,
    )


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_link_planted_at_a_worker_log_is_refused_and_the_target_kept(tmp_path: Path, how: str) -> None:
    victim = _victim(tmp_path)
    log_dir = _log_root(_config(tmp_path)) / "round_0" / "rank_0"
    log_dir.mkdir(parents=True)
    if how == "symlink":
        (log_dir / "stdout.log").symlink_to(victim)
    else:
        os.link(victim, log_dir / "stdout.log")
    with pytest.raises(ConfigError, match="stdout.log"):
        spawn(_spec(log_dir))
    assert victim.read_text() == PRECIOUS


def test_a_symlink_planted_as_a_round_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    root = _log_root(_config(tmp_path))
    (root / "round_0").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="symbolic link"):
        spawn(_spec(root / "round_0" / "rank_0"))
    assert list(elsewhere.iterdir()) == []


def _run(spec: WorkerSpec) -> str:
    worker = spawn(spec)
    assert worker.popen.wait(30) == 0
    worker.finish_output()
    return (spec.log_dir / "stdout.log").read_text()


def test_worker_logs_are_private_and_one_left_by_an_earlier_run_of_the_same_id_starts_afresh(tmp_path: Path) -> None:
    root = _log_root(_config(tmp_path))
    fresh = root / "round_1" / "rank_0"
    assert _run(_spec(fresh)) == "from the worker\n"
    assert _mode(fresh / "stdout.log") == 0o600 and _mode(fresh) == 0o700 and _mode(fresh.parent) == 0o700
    earlier = root / "round_0" / "rank_0"
    earlier.mkdir(parents=True)
    (earlier / "stdout.log").write_text("an earlier run's output, longer than this one's\n")
    (earlier / "stdout.log").chmod(0o644)
    assert _run(_spec(earlier)) == "from the worker\n" and _mode(earlier / "stdout.log") == 0o600


def test_a_symlink_planted_at_the_error_file_is_not_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = _victim(tmp_path)
    error_file = tmp_path / "error.json"
    (tmp_path / "error.json.tmp").symlink_to(victim)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    write_error_file(RuntimeError("boom"))
    assert victim.read_text() == PRECIOUS
    assert "RuntimeError: boom" in error_file.read_text() and not error_file.is_symlink()
