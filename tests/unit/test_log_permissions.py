"""The run's log directory and events file are the job user's alone (issue 19): 0700 and 0600."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from resilrun.agent import _log_root
from resilrun.agent.events import EventLog
from resilrun.config import Config


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
