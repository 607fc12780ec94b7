"""Counters in the rendezvous store carry no MAC (rendezvous/sealed.py): anyone at the store can
bump them. Readers that walk the records a counter numbers must stay bounded and still find the
real records around a bump (issue 43, F14)."""

from __future__ import annotations

import json

import pytest

from resilrun import keys
from resilrun.agent.workers.failures import FailureLedger, ProcessFailure
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.status import records

RUN = "job-1"


class CountingReads(MemoryBackend):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def get(self, key: str) -> bytes | None:
        self.reads += 1
        return super().get(key)

    def get_many(self, keys: list[str]) -> list[bytes | None]:  # type: ignore[override]
        self.reads += len(keys)
        return [MemoryBackend.get(self, key) for key in keys]


def _failure(rank: int) -> ProcessFailure:
    return ProcessFailure(
        global_rank=rank, local_rank=rank, node_rank=0, host="h", pid=100 + rank, exit_code=1,
        timestamp=float(rank), message=f"rank {rank} failed", traceback=None, error_file=None,
    )  # fmt: skip


@pytest.mark.timeout(20)
def test_a_bumped_failure_counter_neither_stalls_the_reader_nor_hides_the_failures() -> None:
    backend = CountingReads()
    failures = FailureLedger(backend, RUN)
    failures.record(3, [_failure(0)])
    backend.add(keys.round_failure_count(RUN, 3), 10**12)
    failures.record(3, [_failure(1)])  # recorded after the bump, at index 10**12 + 2
    read = failures.read(3)
    assert [f.global_rank for f in read] == [0, 1]
    assert backend.reads < 10_000


@pytest.mark.timeout(20)
def test_a_bumped_node_registry_neither_stalls_status_nor_hides_the_nodes() -> None:
    backend = CountingReads()
    records.register_node(backend, RUN, "a")
    backend.add(keys.status_node_count(RUN), 10**12)
    records.register_node(backend, RUN, "b")
    assert records.node_ids(backend, RUN) == ["a", "b"]
    assert backend.reads < 10_000


def test_records_after_a_short_gap_are_all_read() -> None:
    # a writer that took an index and died before writing it leaves a gap: the rest are read
    backend = MemoryBackend()
    for index, node in ((1, "a"), (3, "c")):
        backend.set(keys.status_node_index(RUN, index), node.encode())
    backend.add(keys.status_node_count(RUN), 3)
    assert records.node_ids(backend, RUN) == ["a", "c"]
    backend.set(keys.round_failure(RUN, 0, 2), json.dumps(_failure(5).to_dict()).encode())
    backend.add(keys.round_failure_count(RUN, 0), 2)
    assert [f.global_rank for f in FailureLedger(backend, RUN).read(0)] == [5]
