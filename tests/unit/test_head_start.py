"""A hot spare's head start (worker/pending.py) and ``@resilrun.once`` (worker/once.py), in-process.

The spare runs the script before it has a rank; every read that depends on the rank waits for the
assignment: per-assignment environment variables and whole-environment reads, torch.distributed's
default group, and the rank-dependent members of the ``Job`` that ``resilrun.init()`` returned.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401 - imported by DDP's first build, which a spare does before running ahead
import torch.distributed as dist
from torch import nn

from resilrun.worker import _torch_compat, once, pending
from resilrun.worker.job import Job, Seat
from resilrun.worker_main import uses_resilrun_api


def wait_for(predicate, timeout: float = 10.0) -> None:  # noqa: ANN001 - any callable
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


class _Agent:
    """Stands for the agent: gives the assignment when the test says so, counts who asked."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.asked = 0
        self.go = threading.Event()

    def await_assignment(self) -> dict[str, str]:
        self.asked += 1
        assert self.go.wait(10), "nobody gave the assignment"
        return self.env


@pytest.fixture
def restored_environ() -> Iterator[None]:
    saved = os.environ
    keys = {k: saved.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "RESILRUN_ROUND")}
    yield
    os.environ = saved  # noqa: B003 - the same object the test started with
    for key, value in keys.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _head_start(agent: _Agent, hold=lambda wait, passes: None) -> pending.HeadStart:  # noqa: ANN001
    return pending.HeadStart(agent.await_assignment, os.environ.update, hold)


def test_reading_the_rank_waits_for_the_assignment_and_other_variables_do_not(restored_environ) -> None:  # noqa: ANN001
    # Given a spare running ahead, whose agent has not assigned it yet
    os.environ.pop("RANK", None)
    agent = _Agent({"RANK": "3", "WORLD_SIZE": "4", "RESILRUN_ROUND": "2"})
    head = _head_start(agent)
    head.install()
    # Then it waits for its assignment from the start (the agent sees a spare ready to take a rank)
    wait_for(lambda: agent.asked == 1)
    # When the script reads what does not depend on its rank, nothing waits
    assert os.environ.get("PATH") == os.environ._data[b"PATH"].decode()  # type: ignore[attr-defined]
    assert not head.seated()
    # When it reads RANK (os.environ.get, as scripts do), it waits for the assignment
    seen: list[str | None] = []
    reader = threading.Thread(target=lambda: seen.append(os.environ.get("RANK", "-1")))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and seen == []
    agent.go.set()
    reader.join(10)
    # Then it reads the rank it was given, and os.environ is the plain one again
    assert seen == ["3"] and agent.asked == 1
    assert type(os.environ) is os._Environ  # type: ignore[attr-defined]
    assert os.environ["RESILRUN_ROUND"] == "2"


def test_a_copy_of_the_whole_environment_is_the_ranks(restored_environ) -> None:  # noqa: ANN001
    # Given a spare running ahead, assigned at once
    agent = _Agent({"RANK": "1"})
    agent.go.set()
    _head_start(agent).install()
    # When the script copies its environment (for a subprocess, say)
    copied = dict(os.environ)
    # Then the copy was taken after the assignment
    assert copied["RANK"] == "1" and agent.asked == 1


def test_only_per_assignment_keys_wait() -> None:
    assert pending.waits_for_seat("RANK") and pending.waits_for_seat("MASTER_PORT")
    assert pending.waits_for_seat("TORCHELASTIC_RESTART_COUNT") and pending.waits_for_seat("GLOO_SOCKET_IFNAME")
    assert pending.waits_for_seat("RESILRUN_ROUND")
    assert not pending.waits_for_seat("RESILRUN_AGENT_SOCKET")  # resilrun reads it while waiting
    assert not pending.waits_for_seat("HOME") and not pending.waits_for_seat("OMP_NUM_THREADS")


def test_a_process_forked_during_the_set_up_reads_the_environment_without_waiting(restored_environ) -> None:  # noqa: ANN001
    # Given a spare running ahead that is never assigned
    os.environ.pop("RANK", None)
    _head_start(_Agent({"RANK": "1"})).install()
    # When its set-up forks a process (a DataLoader worker) that reads RANK
    pid = os.fork()
    if pid == 0:  # the child: no thread receives the assignment here, so it must not wait
        os._exit(0 if os.environ.get("RANK") is None else 1)
    # Then the child reads the spare's variables as they are and ends
    deadline = time.monotonic() + 10
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            pytest.fail("the forked child waited for an assignment it can never get")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_an_agent_gone_before_the_assignment_fails_the_first_rank_read(restored_environ) -> None:  # noqa: ANN001
    # Given a spare running ahead whose agent goes away while it waits
    def gone() -> dict[str, str]:
        raise ConnectionError("the agent closed the channel")

    pending.HeadStart(gone, os.environ.update, lambda wait, passes: None).install()
    # When the script reads its rank, then it fails with the reason (the spare exits, says why)
    with pytest.raises(ConnectionError, match="closed the channel"):
        os.environ.get("RANK")


def test_the_default_group_waits_for_the_seat_then_the_hook_is_gone(restored_environ) -> None:  # noqa: ANN001
    # Given a spare running ahead whose seat joins a one-rank gloo group
    assert not dist.is_initialized()
    agent = _Agent({"RANK": "0"})
    agent.go.set()
    head = _head_start(agent, _torch_compat.wait_on_default_group)
    head.on_seat(lambda: dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1))
    registry = type(dist.distributed_c10d._world)
    original = vars(registry)["default_pg"]
    head.install()
    try:
        assert vars(registry)["default_pg"] is not original
        # When the script asks torch.distributed anything (DDP does, as does a DistributedSampler)
        model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        # Then it joined first, and torch reads its registry as before
        assert agent.asked == 1 and dist.get_rank() == 0 and model.process_group is dist.group.WORLD
        assert vars(registry)["default_pg"] is original
    finally:
        setattr(registry, "default_pg", original)  # noqa: B010
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_pending_job_tracks_without_a_seat_and_takes_it_when_asked_for_the_rank() -> None:
    # Given a Job whose seat is still awaited
    taken: list[int] = []

    def seat() -> Seat:
        taken.append(1)
        return Seat(rank=2, world_size=4, local_rank=0, device=torch.device("cpu"), snapshotter=None)

    job = Job(seat)
    # When the set-up tracks its objects and values
    job.track(model=nn.Linear(2, 2), config={"lr": 0.1})
    # Then nothing waited
    assert taken == [] and not job.seated and job["config"] == {"lr": 0.1}
    # When the script asks for its rank, the seat is taken once
    assert job.rank == 2 and job.world_size == 4 and job.seated
    assert job.device == torch.device("cpu") and taken == [1]


def test_a_failed_join_raises_where_the_rank_is_asked_and_joining_again_asks_once() -> None:
    # Given a Job whose first join fails (its generation superseded while it joined, say)
    tries: list[int] = []

    def seat() -> Seat:
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("generation superseded")
        job._seated()  # what the seat's callbacks do while the join reads the rank: no second join
        return Seat(rank=5, world_size=8, local_rank=1, device=torch.device("cpu"), snapshotter=None)

    job = Job(seat)
    # When the script asks for its rank, the join's error is raised there, and the seat stays awaited
    with pytest.raises(RuntimeError, match="superseded"):
        _ = job.rank
    assert not job.seated
    # Then the next ask joins again, once
    assert job.local_rank == 1 and job.rank == 5 and job.seated
    assert len(tries) == 2


_SCRIPT = """
import resilrun

calls = []

@resilrun.once
def build(width, *, seed=0):
    calls.append(width)
    return [width, seed]
"""


def _run_script(namespace: dict) -> dict:
    exec(compile(_SCRIPT, "/script/train.py", "exec"), namespace)  # noqa: S102 - the script's re-run
    return namespace


def test_once_gives_a_rerun_of_the_script_the_first_runs_objects() -> None:
    once.forget()
    # Given a script whose set-up is a @resilrun.once function, run once
    first = _run_script({})
    built = first["build"](8, seed=1)
    # When the script runs again in the same process (a survivor's re-run defines it anew)
    again = _run_script({})
    # Then the same call returns the very object the first run built, without running it
    assert again["build"](8, seed=1) is built and again["calls"] == []
    # and other arguments are another call
    assert again["build"](16, seed=1) == [16, 1] and again["calls"] == [16]
    once.forget()


def test_once_runs_again_where_the_arguments_cannot_be_told_apart() -> None:
    once.forget()
    first = _run_script({})
    first["build"](torch.zeros(3))
    first["build"](object())
    again = _run_script({})
    again["build"](torch.zeros(3))
    again["build"](object())
    assert len(again["calls"]) == 2  # a tensor's repr elides values; an object's shows its address
    once.forget()


def test_once_refuses_what_is_bound_to_a_generation(restored_environ) -> None:  # noqa: ANN001
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:

        @once.once
        def wrapped() -> tuple[nn.Module, int]:
            return nn.parallel.DistributedDataParallel(nn.Linear(2, 2)), 1

        with pytest.raises(TypeError, match="DistributedDataParallel"):
            wrapped()
    finally:
        dist.destroy_process_group()


def test_a_spare_runs_ahead_only_scripts_on_the_api(tmp_path: Path) -> None:
    api = tmp_path / "api.py"
    api.write_text("import os\n\ndef main():\n    from resilrun import init\n    init()\n")
    plain = tmp_path / "plain.py"
    plain.write_text("import torch.distributed as dist\n\ndist.init_process_group()\n")
    assert uses_resilrun_api(str(api), as_module=False)
    assert not uses_resilrun_api(str(plain), as_module=False)
    assert not uses_resilrun_api(str(tmp_path / "missing.py"), as_module=False)
