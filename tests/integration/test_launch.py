"""resilrun launches like torchrun: same environment, same results, same failure semantics."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import free_port
from tests.integration.conftest import TRAIN_TINY, alive, wait_for

pytestmark = pytest.mark.integration

# Variables that legitimately differ between two launches (ports, temp paths); RESILRUN_* are
# resilrun's own additions to the contract.
_MAY_DIFFER = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}


# torch 2.13's gloo teardown at interpreter exit sometimes aborts a worker after its script has
# finished ("terminate called without an active exception"); resilrun's bootstrap skips that native
# teardown, torchrun cannot. A torchrun *reference* run whose outputs are all written finished its
# work and still serves as the reference; resilrun's own runs must exit 0.
_TORCH_EXIT_ABORT = "terminate called without an active exception"
# The other way a torchrun reference run ends badly after its work is done: the agent that hosts the
# store exits first, and the other agent's next rendezvous sync fails with a broken pipe.
_TORCH_STORE_GONE = "RendezvousConnectionError: The connection to the C10d store has failed"


def _finished(kind: str, run, outputs: list[Path]) -> bool:
    rc = run.wait(120)
    if rc == 0:
        return True
    teardown = _TORCH_EXIT_ABORT in run.stderr() or _TORCH_STORE_GONE in run.stderr()
    return kind == "torchrun" and teardown and all(p.exists() for p in outputs)


def _two_nodes(launcher, kind: str, out: Path, *extra: str, run_id: str = "job") -> list:
    port = free_port()
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "--max-restarts",
        "0",
        *extra,
    ]
    return [launcher(kind, *common, str(TRAIN_TINY), "--out", str(out)) for _ in range(2)]


def test_two_agents_give_workers_torchrun_environment_and_results(launcher, tmp_path: Path) -> None:
    # Given the same script under torchrun and resilrun, 2 nodes x 2 workers on loopback
    runs = {}
    for kind in ("torchrun", "resilrun"):
        out = tmp_path / kind
        nodes = _two_nodes(launcher, kind, out)
        outputs = [out / f"checksum_rank{r}" for r in range(4)]
        for node in nodes:
            assert _finished(kind, node, outputs), node.stderr()[-3000:]
        runs[kind] = out
    # (with no job secret given, resilrun says what keeping it in the store leaves open)
    assert all("no job secret given: it is kept in the rendezvous store" in n.stderr() for n in nodes)
    # Then every worker variable torchrun sets is set the same way
    for rank in range(4):
        theirs = json.loads((runs["torchrun"] / f"env_rank{rank}_attempt0.json").read_text())
        ours = json.loads((runs["resilrun"] / f"env_rank{rank}_attempt0.json").read_text())
        differing = {
            name
            for name in set(theirs) | set(ours)
            if theirs.get(name) != ours.get(name) and name not in _MAY_DIFFER and not name.startswith("RESILRUN_")
        }
        assert not differing, {n: (theirs.get(n), ours.get(n)) for n in differing}
        assert Path(ours["TORCHELASTIC_ERROR_FILE"]).name == "error.json"
    # And the trained parameters are bitwise the same
    sums = {kind: {(out / f"checksum_rank{r}").read_text() for r in range(4)} for kind, out in runs.items()}
    assert len(sums["torchrun"]) == 1
    assert sums["torchrun"] == sums["resilrun"]


def test_standalone_example_matches_torchrun_checksum(launcher, tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "train_ddp_torchrun.py"
    sums = {}
    for kind in ("torchrun", "resilrun"):
        target = tmp_path / f"{kind}.sha"
        run = launcher(
            kind,
            "--standalone",
            "--nproc-per-node",
            "2",
            str(example),
            "--steps",
            "15",
            "--hidden",
            "64",
            "--checksum-file",
            str(target),
        )
        assert _finished(kind, run, [target]), run.stderr()[-3000:]
        sums[kind] = target.read_text()
    assert sums["resilrun"] == sums["torchrun"]


def test_sigkilled_worker_restarts_the_job_which_then_finishes(launcher, tmp_path: Path) -> None:
    # Given 2 nodes and one restart allowed, rank 1 SIGKILLs itself at step 3 of attempt 0
    port = free_port()
    args = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--max-restarts",
        "1",
        str(TRAIN_TINY),
        "--out",
        str(tmp_path / "out"),
        "--fail-rank",
        "1",
        "--fail-step",
        "3",
        "--fail-mode",
        "kill",
        "--steps",
        "8",
    ]
    nodes = [launcher("resilrun", *args) for _ in range(2)]
    # Then both nodes finish, every rank ran attempt 1, and the result equals a failure-free run
    for node in nodes:
        assert node.wait(150) == 0, node.stderr()[-3000:]
    for rank in range(4):
        assert (tmp_path / "out" / f"env_rank{rank}_attempt1.json").exists()
    assert "restart 1 of 1" in nodes[0].stderr() + nodes[1].stderr()
    clean = launcher(
        "resilrun",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "4",
        "--standalone",
        str(TRAIN_TINY),
        "--out",
        str(tmp_path / "clean"),
        "--steps",
        "8",
    )
    assert clean.wait(120) == 0
    assert (tmp_path / "out" / "checksum_rank0").read_text() == (tmp_path / "clean" / "checksum_rank0").read_text()


def test_failure_without_restarts_reports_the_root_cause_traceback(launcher, tmp_path: Path) -> None:
    run = launcher(
        "resilrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(TRAIN_TINY),
        "--out",
        str(tmp_path / "out"),
        "--fail-rank",
        "1",
        "--fail-step",
        "2",
    )
    assert run.wait(120) == 1
    err = run.stderr()
    assert "Root cause" in err
    assert "RuntimeError: injected failure at step 2" in err
    assert "rank:       1" in err
    assert "Traceback" in err  # the worker's own traceback, from its error file
    assert "resilrun: error:" in err


_LINGERING_ROOT_CAUSE = """
import atexit, os, signal, sys, time
from pathlib import Path
import torch.distributed as dist

rank = int(os.environ["RANK"])
marker = Path(sys.argv[1])
dist.init_process_group("gloo")
if rank == 1:
    # The root cause raises, then lingers in interpreter teardown (as a process group's native
    # teardown can): it is still running when the peer its failure broke has already died.
    atexit.register(lambda: (marker.write_text("raised"), time.sleep(60)))
    raise RuntimeError("the root cause")
while not marker.exists():
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGABRT)
"""


def test_the_root_cause_is_the_rank_that_raised_first_even_if_a_peer_died_before_it_exited(
    launcher, tmp_path: Path
) -> None:
    # Given rank 1 raising and still in its teardown when rank 0, broken by it, aborts
    script = tmp_path / "linger.py"
    script.write_text(_LINGERING_ROOT_CAUSE)
    run = launcher(
        "resilrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        "5",
        str(script),
        str(tmp_path / "marker"),
    )
    # When the job fails
    assert run.wait(120) == 1
    err = run.stderr()
    # Then the report names rank 1's error, which came first, not the abort the agent saw first
    cause = err.split("Root cause", 1)[1]
    assert "rank:       1" in cause.split("Other failures", 1)[0], err
    assert "RuntimeError: the root cause" in cause


def test_sigterm_to_agent_stops_workers_and_exits_143(launcher, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = launcher(
        "resilrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        "5",
        str(TRAIN_TINY),
        "--out",
        str(out),
        "--steps",
        "100000",
        "--sleep",
        "0.05",
    )
    wait_for(lambda: (out / "step_rank1").exists(), 90, "workers to train")
    workers = run.remember_descendants()
    run.popen.send_signal(signal.SIGTERM)
    assert run.wait(30) == 143
    wait_for(lambda: not alive(workers), 10, "workers to exit")


def test_sigkilled_agent_leaves_no_orphan_workers(launcher, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = launcher(
        "resilrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(TRAIN_TINY),
        "--out",
        str(out),
        "--steps",
        "100000",
        "--sleep",
        "0.05",
    )
    wait_for(lambda: (out / "step_rank1").exists(), 90, "workers to train")
    workers = run.remember_descendants()
    assert len(workers) >= 2
    run.popen.send_signal(signal.SIGKILL)
    run.popen.wait(10)
    wait_for(lambda: not alive(workers), 10, "orphaned workers to die")


def test_unreachable_endpoint_fails_within_the_read_timeout(launcher, tmp_path: Path) -> None:
    port = free_port()
    started = time.monotonic()
    run = launcher(
        "resilrun",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-conf",
        "is_host=false,read_timeout=2",
        str(TRAIN_TINY),
        "--out",
        str(tmp_path),
    )
    assert run.wait(60) == 3
    assert time.monotonic() - started < 30
    err = run.stderr()
    assert f"could not reach the rendezvous store at 127.0.0.1:{port}" in err
    assert "Traceback" not in err


def test_missing_script_is_a_usage_error_before_anything_starts(launcher, tmp_path: Path) -> None:
    run = launcher("resilrun", "--standalone", str(tmp_path / "nope.py"))
    assert run.wait(30) == 2
    err = run.stderr()
    assert "does not exist" in err and "Traceback" not in err


def test_tee_prefixes_console_lines_and_filter_hides_other_ranks(launcher, tmp_path: Path) -> None:
    run = launcher(
        "resilrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--tee",
        "3",
        "--local-ranks-filter",
        "0",
        "--log-dir",
        str(tmp_path / "logs"),
        str(TRAIN_TINY),
        "--out",
        str(tmp_path / "out"),
        "--steps",
        "2",
    )
    assert run.wait(120) == 0, run.stderr()[-3000:]
    console = run.stdout()
    assert "[rank 0]: rank 0 finished attempt 0" in console
    assert "rank 1 finished" not in console
    # --standalone picks a fresh run id (as torchrun), which names the log folder
    (run_dir,) = (tmp_path / "logs").iterdir()
    logs = run_dir / "round_0"
    assert "rank 1 finished attempt 0" in (logs / "rank_1" / "stdout.log").read_text()
    assert "rank 0 finished attempt 0" in (logs / "rank_0" / "stdout.log").read_text()


def test_script_arguments_pass_through_untouched(launcher, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = launcher(
        "resilrun", "--standalone", str(TRAIN_TINY), "--out", str(out), "--steps", "1", "--nnodes", "3", "--standalone"
    )
    assert run.wait(120) == 0, run.stderr()[-3000:]
    assert json.loads((out / "args_rank0").read_text()) == ["--nnodes", "3", "--standalone"]


def test_late_node_joins_an_elastic_job_through_a_new_round(launcher, tmp_path: Path) -> None:
    # Given an elastic job (1:2 nodes) already training on one node
    port = free_port()
    out = tmp_path / "out"
    args = [
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-conf",
        "last_call_timeout=0.5",
        str(TRAIN_TINY),
        "--out",
        str(out),
        "--steps",
        "100000",
        "--sleep",
        "0.02",
    ]
    first = launcher("resilrun", *args)
    wait_for(lambda: (out / "step_rank0").exists(), 90, "the first node to train")
    # When a second node arrives
    second = launcher("resilrun", *args)
    # Then the job re-forms with world size 2 (not counted as a restart)
    wait_for(lambda: (out / "step_rank1").exists(), 90, "the second node to train")
    env = json.loads((out / "env_rank1_attempt0.json").read_text())
    assert env["WORLD_SIZE"] == "2"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
    for node in (first, second):
        node.popen.send_signal(signal.SIGTERM)
    for node in (first, second):
        node.wait(60)
    assert not any(psutil.pid_exists(p) and alive({p}) for p in first.descendants | second.descendants)


def test_worker_ignoring_sigterm_is_killed_after_the_grace_period(launcher, tmp_path: Path) -> None:
    helper = Path(__file__).resolve().parents[1] / "helpers" / "ignore_sigterm.py"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "1", str(helper), str(tmp_path)
    )
    wait_for(lambda: len(list(tmp_path.glob("ready_*"))) == 2, 60, "workers to start")
    workers = run.remember_descendants()
    started = time.monotonic()
    run.popen.send_signal(signal.SIGINT)
    assert run.wait(30) == 130
    assert time.monotonic() - started < 15
    wait_for(lambda: not alive(workers), 10, "workers to be SIGKILLed")


def test_redirects_send_worker_output_to_files_only(launcher, tmp_path: Path) -> None:
    run = launcher(
        "resilrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-r",
        "3",
        "--log-dir",
        str(tmp_path / "logs"),
        str(TRAIN_TINY),
        "--out",
        str(tmp_path / "out"),
        "--steps",
        "2",
    )
    assert run.wait(120) == 0, run.stderr()[-3000:]
    assert "finished attempt" not in run.stdout()
    (run_dir,) = (tmp_path / "logs").iterdir()
    for rank in (0, 1):
        assert f"rank {rank} finished attempt 0" in (run_dir / "round_0" / f"rank_{rank}" / "stdout.log").read_text()


def test_static_backend_with_node_ranks_runs_two_nodes(launcher, tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "out"
    nodes = [
        launcher(
            "resilrun",
            "--rdzv-backend",
            "static",
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(TRAIN_TINY),
            "--out",
            str(out),
            "--steps",
            "2",
        )
        for rank in (1, 0)
    ]
    for node in nodes:
        assert node.wait(120) == 0, node.stderr()[-3000:]
    env = json.loads((out / "env_rank1_attempt0.json").read_text())
    assert env["GROUP_RANK"] == "1" and env["WORLD_SIZE"] == "2"


def test_a_frozen_node_is_detected_by_heartbeat_and_the_elastic_job_goes_on(launcher, tmp_path: Path) -> None:
    # Given an elastic job (1:2 nodes) training on two nodes, fast heartbeats
    port = free_port()
    out = tmp_path / "out"
    args = [
        "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-conf", "last_call_timeout=1", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2",
        "--max-restarts", "3", "--shutdown-timeout", "2",
        str(TRAIN_TINY), "--out", str(out), "--steps", "100000", "--sleep", "0.02",
    ]  # fmt: skip
    host = launcher("resilrun", *args)
    wait_for(lambda: (out / "step_rank0").exists(), 90, "the first node to train")
    other = launcher("resilrun", *args)
    wait_for(lambda: (out / "step_rank1").exists(), 90, "both nodes to train")
    # When the second node freezes (agent and workers SIGSTOPped, as a hung machine)
    frozen = other.remember_descendants() | {other.pid}
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    # Then the first node declares it lost within the heartbeat timeout and trains on alone
    wait_for(lambda: "node lost: no heartbeat" in host.stderr(), 30, "the lost node to be detected")
    detected = time.monotonic() - started
    assert detected < 2 + 0.5 + 3  # timeout + one interval + polling and load slack on 2 cores
    wait_for(lambda: any(out.glob("env_rank0_attempt1.json")), 60, "the job to restart without the node")
    env = json.loads((out / "env_rank0_attempt1.json").read_text())
    assert env["WORLD_SIZE"] == "1"
    for pid in frozen:
        os.kill(pid, signal.SIGKILL)
    host.popen.send_signal(signal.SIGTERM)
    assert host.wait(60) == 143
