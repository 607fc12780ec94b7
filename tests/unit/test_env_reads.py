"""The process-environment reads that env.py holds for the agent, the worker channel and the CLI."""

from __future__ import annotations

import pytest

from resilrun.agent.workers.fault_hooks import REPLICATION_DELAY_ENV, delay_s
from resilrun.env import (
    SHELL_COMPLETE_ENV,
    WITHHELD_FROM_WORKERS,
    agent_secrets,
    agent_token,
    fault_hook_setting,
    shell_completion_request,
)
from resilrun.errors import ResilrunError


def test_agent_secrets_holds_only_the_withheld_variables_that_are_set() -> None:
    job_secret, etcd_password = WITHHELD_FROM_WORKERS
    environ = {job_secret: "s" * 32, "PATH": "/bin", "RESILRUN_AGENT_TOKEN": "t"}
    assert agent_secrets(environ) == {job_secret: "s" * 32}
    assert agent_secrets({etcd_password: ""}) == {etcd_password: ""}
    assert agent_secrets({}) == {}


def test_agent_secrets_reads_the_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILRUN_ETCD_PASSWORD", "pw")
    assert agent_secrets() == {"RESILRUN_ETCD_PASSWORD": "pw"}


def test_agent_token_is_empty_outside_the_launcher() -> None:
    assert agent_token({"RESILRUN_AGENT_TOKEN": "abc"}) == "abc"
    assert agent_token({}) == ""


def test_fault_hook_setting_is_stripped_and_empty_when_unset() -> None:
    assert fault_hook_setting(REPLICATION_DELAY_ENV, {REPLICATION_DELAY_ENV: " 0.5\n"}) == "0.5"
    assert fault_hook_setting(REPLICATION_DELAY_ENV, {}) == ""


def test_a_fault_hook_that_is_not_a_number_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPLICATION_DELAY_ENV, "soon")
    with pytest.raises(ResilrunError, match="is not a number of seconds"):
        delay_s(REPLICATION_DELAY_ENV, "every replica push")
    monkeypatch.setenv(REPLICATION_DELAY_ENV, " 0.25 ")
    assert delay_s(REPLICATION_DELAY_ENV, "every replica push") == 0.25
    monkeypatch.delenv(REPLICATION_DELAY_ENV)
    assert delay_s(REPLICATION_DELAY_ENV, "every replica push") == 0.0


def test_shell_completion_request_names_what_the_completion_script_asks() -> None:
    assert shell_completion_request({SHELL_COMPLETE_ENV: "complete_bash"}) == "complete_bash"
    assert shell_completion_request({}) == ""
