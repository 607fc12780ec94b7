"""The job secret and etcd's password stay in the agent (issue 43, F10): a worker's environment is
inherited by its DataLoader workers and every subprocess it starts, and printed by crash reporters,
so neither secret is copied into any worker's or spare's environment."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from resilrun.agent.workers.procs import spawn
from resilrun.agent.workers.specs import NodeSetup, spare_spec, worker_specs
from resilrun.config import Config
from resilrun.env import WITHHELD_FROM_WORKERS, agent_environ
from resilrun.job_secret import SECRET_ENV
from resilrun.option_values import Std
from resilrun.rendezvous.factory import ETCD_PASSWORD_ENV
from resilrun.rendezvous.protocol import NodeInfo, RdzvState

SECRETS = {SECRET_ENV: "0123456789abcdef0123456789abcdef", ETCD_PASSWORD_ENV: "etcd-password"}


def test_the_withheld_names_are_the_ones_the_agent_reads() -> None:
    assert set(WITHHELD_FROM_WORKERS) == set(SECRETS)


def test_the_agent_environment_given_to_workers_has_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MY_VARIABLE", "kept")
    env = agent_environ()
    assert env["MY_VARIABLE"] == "kept"
    assert not set(SECRETS) & set(env)


def _setup(tmp_path: Path, base_env: dict[str, str]) -> NodeSetup:
    return NodeSetup(nproc=2, addr="127.0.0.1", log_root=tmp_path, base_env=base_env)


def test_worker_and_spare_specs_never_carry_a_secret(tmp_path: Path) -> None:
    """Even where the base environment was built with them (the specs are the last gate)."""
    config = Config(nproc_per_node="2", script="train.py")
    setup = _setup(tmp_path, {**SECRETS, "MY_VARIABLE": "kept"})
    state = RdzvState(round=1, complete=True, participants=(NodeInfo("n0", "127.0.0.1", 2),))
    specs = [*worker_specs(config, setup, "run", state, 0, "127.0.0.1:29500"), spare_spec(config, setup, 1, 1)]
    for spec in specs:
        assert spec.env["MY_VARIABLE"] == "kept"
        assert not set(SECRETS) & set(spec.env), spec.log_dir


def test_a_launched_worker_does_not_see_the_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    config = Config(nproc_per_node="1", script="train.py")
    setup = NodeSetup(nproc=1, addr="127.0.0.1", log_root=tmp_path, base_env=agent_environ())
    probe = "import json, os; print(json.dumps(sorted(os.environ)))"
    spec = dataclasses.replace(
        spare_spec(config, setup, 0, 1), argv=(sys.executable, "-c", probe), to_file=Std.ALL, to_console=Std.NONE
    )
    worker = spawn(spec)
    assert worker.popen.wait(30) == 0
    worker.finish_output()
    seen = json.loads((spec.log_dir / "stdout.log").read_text())
    assert "RESILRUN_SPARE" in seen and not set(SECRETS) & set(seen)
