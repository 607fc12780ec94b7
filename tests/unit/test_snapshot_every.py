"""``--snapshot-every N``: which steps are snapshotted, persisted, and how progress still reaches the agent."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from resilrun.agent.persister import persists
from resilrun.config import Config
from resilrun.env import WorkerEnv, read_worker_variables
from resilrun.errors import ConfigError
from resilrun.worker.job import Job


class _Saves:
    """Stands in for the snapshotter: records which steps were saved and whether finish flushed."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.flushed = False

    def save(self, step: int, tensors: Any, meta: Any, replicated: Any) -> None:
        self.steps.append(step)

    def report(self, event: str, **fields: Any) -> None: ...

    def flush(self) -> None:
        self.flushed = True


def _job(every: int) -> tuple[Job, _Saves]:
    saves = _Saves()
    job = Job(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), snapshotter=saves, snapshot_every=every
    )  # type: ignore[arg-type]
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
    assert [s for s in snapshots if persists(s, every, snapshot_every)] == expected


def test_the_interval_reaches_the_workers_and_nonsense_is_refused() -> None:
    base = {
        "global_rank": 0, "local_rank": 0, "world_size": 1, "local_world_size": 1, "node_rank": 0, "num_nodes": 1,
        "role_name": "default", "role_rank": 0, "role_world_size": 1, "master_addr": "127.0.0.1",
        "master_port": 29500, "run_id": "r", "restart_count": 0, "max_restarts": 0, "error_file": "e", "round": 0,
    }  # fmt: skip
    env = WorkerEnv(**base, snapshot_every=5).to_env({})
    assert read_worker_variables(env).snapshot_every == 5
    assert read_worker_variables({}).snapshot_every == 1
    with pytest.raises(ConfigError, match=r"--snapshot-every \(0\) must be >= 1") as raised:
        Config(script="train.py", snapshot_every=0).validate()
    assert raised.value.hint is not None and "redoes at most N-1 steps" in raised.value.hint
