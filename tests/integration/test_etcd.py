"""Jobs on the etcd backend: a plain run, the loss of node rank 0, and the loss of an etcd member.

With c10d, node rank 0's agent hosts the rendezvous store: SIGKILLing it ends the job for everyone.
With etcd the store is elsewhere, so the same loss is an ordinary node loss: the survivors see it
(a failed collective, or its heartbeat stopping), open a new round without it, and the new node
rank 0 hosts the next worker store; with a spare node, the spare takes rank 0's place in-process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration.conftest import TRAIN_TINY, alive, recorded, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _etcd_args(endpoint: str, run_id: str, *extra: str) -> list[str]:
    return ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, *extra]


def test_two_agents_run_a_job_to_completion_on_etcd(launcher, etcd_server: Any, tmp_path: Path) -> None:
    # Given 2 agents x 2 workers whose rendezvous is a single-member etcd
    out = tmp_path / "out"
    args = _etcd_args(etcd_server.endpoint, "etcd-happy", "--nnodes", "2", "--nproc-per-node", "2")
    nodes = [launcher("resilrun", *args, str(TRAIN_TINY), "--out", str(out), "--steps", "5") for _ in range(2)]
    # Then both finish, every rank trained to the same parameters, and nobody hosted the store
    for node in nodes:
        assert node.wait(90) == 0, node.stderr()[-3000:]
    assert len({(out / f"checksum_rank{r}").read_text() for r in range(4)}) == 1
    for node in nodes:
        assert f"using store etcd://{etcd_server.endpoint}" in node.stderr()
    env = json.loads((out / "env_rank3_attempt0.json").read_text())
    assert env["WORLD_SIZE"] == "4" and env["TORCHELASTIC_RUN_ID"] == "etcd-happy"


def _agent_of(worker_pid: int) -> psutil.Process:
    return psutil.Process(worker_pid).parent()


def _take_node_down(agent: psutil.Process, how: signal.Signals) -> set[int]:
    """Signal an agent and everything under it at once: SIGKILL, the machine is gone; SIGSTOP, it hangs."""
    victims = {agent.pid} | {child.pid for child in agent.children(recursive=True)}
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, how)
    return victims


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_losing_node_rank_0_is_survivable_on_etcd(
    launcher, etcd_server: Any, tmp_path: Path, how: signal.Signals
) -> None:
    # Given an elastic job (1:2 nodes) training on two agents, fast heartbeats, one restart allowed
    out = tmp_path / "out"
    args = _etcd_args(
        etcd_server.endpoint, f"etcd-node-loss-{how.name}",
        "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "1",
        "--rdzv-conf", "last_call_timeout=1", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "3",
        "--shutdown-timeout", "2",
    )  # fmt: skip
    nodes = [
        launcher("resilrun", *args, str(TRAIN_TINY), "--out", str(out), "--steps", "100", "--sleep", "0.05")
        for _ in range(2)
    ]
    wait_for(lambda: all((out / f"step_rank{r}").exists() for r in range(4)), 60, "4 ranks to train")
    first = json.loads((out / "env_rank0_attempt0.json").read_text())
    assert first["WORLD_SIZE"] == "4"
    # When node rank 0 (whose agent hosts the round's worker store; with c10d, the rendezvous too)
    # is SIGKILLed, or frozen with SIGSTOP, agent and workers at once
    doomed_agent = _agent_of(int((out / "pid_rank0").read_text()))
    survivor = next(n for n in nodes if n.pid != doomed_agent.pid)
    victims = _take_node_down(doomed_agent, how)
    started = time.monotonic()
    if how is signal.SIGSTOP:
        # Then (frozen: its peers' sockets stay open, so only the heartbeat can tell) the survivor
        # declares it lost within the heartbeat timeout plus one interval and polling slack
        wait_for(lambda: "node lost: no heartbeat" in survivor.stderr(), 30, "the lost node to be detected")
        assert time.monotonic() - started < 3 + 0.5 + 4
    # Then the survivor finishes the job alone, as the new node rank 0 hosting a new worker store
    # (killed: its workers' collectives fail at once, which restarts the job even before the heartbeat)
    assert survivor.wait(100) == 0, survivor.stderr()[-3000:]
    env = json.loads((out / "env_rank0_attempt1.json").read_text())
    assert env["WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "0"
    assert env["MASTER_PORT"] != first["MASTER_PORT"]
    assert (out / "checksum_rank0").exists() and (out / "checksum_rank1").exists()
    assert "restart 1 of 1" in survivor.stderr()
    assert how is signal.SIGSTOP or not alive(victims)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _leader(cluster: Any) -> int:
    """Index of the member that currently leads the etcd cluster."""
    import urllib.request

    for index, member in enumerate(cluster.members):
        with contextlib.suppress(OSError):
            request = urllib.request.Request(
                f"http://{member.endpoint}/v3/maintenance/status", data=b"{}", method="POST"
            )
            with urllib.request.urlopen(request, timeout=2) as response:
                status = json.loads(response.read())
            if status["leader"] == status["header"]["member_id"]:
                return index
    raise AssertionError("no etcd leader")


def test_killing_an_etcd_member_mid_job_does_not_disturb_it(launcher, etcd_cluster: Any, tmp_path: Path) -> None:
    # Given 2 agents x 2 workers on a three-member etcd cluster, every agent listing all members
    out = tmp_path / "out"
    args = _etcd_args(etcd_cluster.endpoint, "etcd-member-loss", "--nnodes", "2", "--nproc-per-node", "2")
    nodes = [
        launcher("resilrun", *args, str(TRAIN_TINY), "--out", str(out), "--steps", "120", "--sleep", "0.05")
        for _ in range(2)
    ]
    wait_for(lambda: all((out / f"step_rank{r}").exists() for r in range(4)), 60, "4 ranks to train")
    # When the etcd leader is SIGKILLed mid-job (an election follows; clients of it fail over)
    victim = _leader(etcd_cluster)
    etcd_cluster.kill(victim)
    # Then the job finishes without a restart and without losing a node
    for node in nodes:
        assert node.wait(100) == 0, node.stderr()[-3000:]
    err = nodes[0].stderr() + nodes[1].stderr()
    assert recorded(err, "node_lost") == [] and recorded(err, "restart") == []
    assert len({(out / f"checksum_rank{r}").read_text() for r in range(4)}) == 1
    assert not any((out / f"env_rank{r}_attempt1.json").exists() for r in range(4))
