"""``--snapshot-every N``: which steps are snapshotted, persisted, and how progress still reaches the agent.

``auto`` has its own file (test_snapshot_interval.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from resilrun.config import Config
from resilrun.env import WorkerEnv, read_worker_variables
from resilrun.errors import ConfigError
from resilrun.tiers.slots import Committed
from resilrun.worker.job import Job, Seat


class _Saves:
    """Stands in for the snapshotter: records which steps were saved and whether finish flushed."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.previous: list[int | None] = []
        self.replicate: list[bool | None] = []
        self.flushed = False

    def save(
        self,
        step: int,
        tensors: Any,
        meta: Any,
        replicated: Any,
        *,
        previous: int | None = None,
        replicate: bool | None = None,
        compute_s: float | None = None,
    ) -> None:
        self.steps.append(step)
        self.previous.append(previous)
        self.replicate.append(replicate)

    def report(self, event: str, **fields: Any) -> None: ...

    def finished(self, step: int) -> None: ...

    def flush(self) -> None:
        self.flushed = True


def _job(every: int, *, replicate_auto: bool = False) -> tuple[Job, _Saves]:
    saves = _Saves()
    seat = Seat(
        rank=0,
        world_size=1,
        local_rank=0,
        device=torch.device("cpu"),
        snapshotter=saves,  # type: ignore[arg-type]
        snapshot_every=every,
        replicate_auto=replicate_auto,
    )
    job = Job(seat)
    job.track(weights=torch.zeros(3))
    return job, saves


def test_every_nth_step_is_snapshotted_and_the_last_one_at_the_end() -> None:
    job, saves = _job(every=3)
    for step in range(8):
        job.begin(step)
        job.commit(step)
        assert job.done == step  # what the heartbeat reports as progress, snapshotted or not
    assert saves.steps == [2, 5]  # steps N-1, 2N-1: the same on every rank, and after a resume
    job.finish()
    assert saves.steps == [2, 5, 7]  # the final state, for the persistent tier and export
    assert saves.previous == [-1, 2, 5]  # what the agent's tiers choose their steps by
    assert saves.flushed


def test_a_resumed_run_keeps_the_same_snapshot_steps() -> None:
    job, saves = _job(every=4)
    for step in range(8, 13):  # resumed after step 7, a snapshot step
        job.commit(step)
    job.finish()
    assert saves.steps == [11, 12]


def test_every_step_is_snapshotted_by_default_and_finish_adds_nothing() -> None:
    job, saves = _job(every=1)
    for step in range(3):
        job.commit(step)
    job.finish()
    assert saves.steps == [0, 1, 2]


@pytest.mark.parametrize(
    ("every", "snapshot_every", "expected"),
    [
        (10, 1, [9, 19, 29, 39]),  # a snapshot every step: the step that ends each interval
        (10, 4, [11, 19, 31, 39]),  # the first snapshot at or past each multiple of 10
        (10, 5, [9, 19, 29, 39]),  # multiples of the snapshot interval: exactly those
        (3, 4, list(range(3, 40, 4))),  # persisting more often than snapshots exist: every snapshot
    ],
)
def test_one_snapshot_is_persisted_per_interval(every: int, snapshot_every: int, expected: list[int]) -> None:
    snapshots = [s for s in range(40) if (s + 1) % snapshot_every == 0]
    assert _crossing(snapshots, every) == expected


def test_unevenly_spaced_snapshots_are_persisted_once_per_interval() -> None:
    # --snapshot-every auto: intervals 6, then 1, then 13 (as decisions change them)
    snapshots = [5, 11, 17, 18, 19, 20, 21, 34, 47, 60]
    assert _crossing(snapshots, 10) == [11, 19, 34, 47, 60]  # the first at or past 9, 19, 29, 39, 49 (and 59)
    assert _crossing(snapshots, 1) == snapshots  # --replicate-every 1: every snapshot


def test_a_commit_that_does_not_say_its_previous_step_counts_from_the_step_before() -> None:
    assert Committed(19, 0, 1, None).crosses(10) and not Committed(18, 0, 1, None).crosses(10)


def _crossing(snapshots: list[int], every: int) -> list[int]:
    previous = [-1, *snapshots[:-1]]
    return [s for s, p in zip(snapshots, previous, strict=True) if Committed(s, 0, 1, None, previous=p).crosses(every)]


def test_the_interval_reaches_the_workers_and_nonsense_is_refused() -> None:
    base = {
        "global_rank": 0, "local_rank": 0, "world_size": 1, "local_world_size": 1, "node_rank": 0, "num_nodes": 1,
        "role_name": "default", "role_rank": 0, "role_world_size": 1, "master_addr": "127.0.0.1",
        "master_port": 29500, "run_id": "r", "restart_count": 0, "max_restarts": 0, "error_file": "e", "round": 0,
    }  # fmt: skip
    env = WorkerEnv(**base, snapshot_every=5).to_env({})
    assert read_worker_variables(env).snapshot_every == 5
    assert read_worker_variables({}).snapshot_every == 1
    assert read_worker_variables(WorkerEnv(**base, snapshot_every=0).to_env({})).snapshot_every == 0  # auto
    replicas_auto = WorkerEnv(**base, snapshot_every=0, replicate_auto=True).to_env({})
    assert read_worker_variables(replicas_auto).replicate_auto
    assert not read_worker_variables(env).replicate_auto and not read_worker_variables({}).replicate_auto
    # the agent decides which snapshots replicate: the variable is absent, even if the agent's own
    # environment (the workers' base) carried one
    assert "RESILRUN_REPLICATE_EVERY" not in WorkerEnv(**base).to_env({"RESILRUN_REPLICATE_EVERY": "auto"})
    with pytest.raises(ConfigError, match=r"--snapshot-every \(-1\) must be >= 1 or auto") as raised:
        Config(script="train.py", snapshot_every=-1).validate()
    assert raised.value.hint is not None and "redoes at most N-1 steps" in raised.value.hint


def test_a_commit_that_says_whether_to_replicate_is_obeyed_whatever_the_fixed_interval() -> None:
    # --replicate-every auto: the workers' schedule decides, the agent's interval (1) does not
    assert not Committed(19, 0, 1, None, previous=14, replicate=False).replicated(1)
    assert Committed(20, 0, 1, None, previous=19, replicate=True).replicated(10)
    assert Committed(19, 0, 1, None, previous=14).replicated(10)  # not said: the interval decides


def test_with_replicate_every_auto_each_commit_says_whether_the_peers_get_it_and_the_last_always() -> None:
    job, saves = _job(0, replicate_auto=True)
    for step in range(20):
        job.commit(step)
    job.finish()
    # the probe interval (6) and every other snapshot replicated until the first decision
    assert saves.steps == [5, 11, 17, 19]
    assert saves.replicate == [True, False, True, True]  # 19: training's last step goes to the peers
    plain, fixed = _job(0)
    for step in range(7):
        plain.commit(step)
    assert fixed.replicate == [None]  # without it the agent's --replicate-every decides
