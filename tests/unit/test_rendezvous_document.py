"""The rendezvous document on the store (rendezvous/document.py): a large job's member list lives
apart from the head, so a recovery decision rewrites O(1) bytes, and agents fetch a member list
once, checked against the head's SHA-256."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta

import pytest

from resilrun import keys
from resilrun.errors import RendezvousError
from resilrun.rendezvous.document import MAX_CHANGES, Documents
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import NodeInfo, RdzvState

RUN = "doc-test"


def node(index: int, prefix: str = "n") -> NodeInfo:
    return NodeInfo(f"{prefix}{index}", f"10.0.{index // 256}.{index % 256}", 8, None, f"host{index}", index, "")


def complete(count: int, spares: int = 0) -> RdzvState:
    return RdzvState(
        round=1,
        complete=True,
        participants=tuple(node(i) for i in range(count)),
        spares=tuple(node(i, "spare") for i in range(spares)),
        seq=3,
    )


class CountingBackend(MemoryBackend):
    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, int] = {}

    def set(self, key: str, value: bytes) -> None:
        self.written[key] = self.written.get(key, 0) + len(value)
        super().set(key, value)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        done = super().compare_set(key, expected, desired)
        if done:
            self.written[key] = self.written.get(key, 0) + len(desired)
        return done


def test_a_small_job_keeps_its_members_in_the_document() -> None:
    backend = CountingBackend()
    documents = Documents(backend, RUN)
    state = complete(8)

    head = documents.encode(state, None)

    assert head == state.to_bytes() and backend.written == {}
    assert Documents(backend, RUN).decode(head) == state


def test_a_large_jobs_members_are_written_once_and_read_once_per_agent() -> None:
    backend = CountingBackend()
    state = complete(1024, spares=2)

    head = Documents(backend, RUN).encode(state, None)
    reader = Documents(backend, RUN)

    assert len(head) < 2_000 < len(state.to_bytes()) // 20
    assert reader.decode(head) == state and reader.decode(head) == state
    assert reader.blobs_read == 1  # the second decode came from its cache
    [(key, _)] = backend.written.items()
    assert key.startswith(keys.rdzv_members(RUN, ""))


def test_a_spare_taking_a_lost_nodes_place_rewrites_a_head_of_a_few_hundred_bytes() -> None:
    backend = CountingBackend()
    writer = Documents(backend, RUN)
    before = complete(1024, spares=1)
    head = writer.encode(before, None)
    members = list(before.participants)
    members[517] = before.spares[0]
    after = replace(before, round=2, participants=tuple(members), spares=(), recovering=True, seq=4)

    recovered = writer.encode(after, head)

    assert len(recovered) - len(head) < 300
    assert len(backend.written) == 1  # no second member list
    reader = Documents(backend, RUN)
    assert reader.decode(recovered) == after and reader.decode(head) == before
    assert reader.blobs_read == 1


def test_past_the_change_limit_a_new_member_list_is_written() -> None:
    backend = CountingBackend()
    writer = Documents(backend, RUN)
    before = complete(256)
    head = writer.encode(before, None)
    members = list(before.participants)
    for index in range(MAX_CHANGES + 1):
        members[index] = node(index, "new")
    after = replace(before, participants=tuple(members), seq=4)

    rewritten = writer.encode(after, head)

    assert len(backend.written) == 2
    assert Documents(backend, RUN).decode(rewritten) == after


def test_a_member_list_swapped_or_deleted_in_the_store_is_refused() -> None:
    backend = MemoryBackend()
    state = complete(128)
    head = Documents(backend, RUN).encode(state, None)
    key = json.loads(head)["participants"]["blob"]
    other = Documents(backend, RUN).encode(replace(state, participants=tuple(node(i, "x") for i in range(128))), None)
    backend.set(key, backend.get(json.loads(other)["participants"]["blob"]) or b"")

    with pytest.raises(RendezvousError, match="not the one it names"):
        Documents(backend, RUN).decode(head)
    del backend._data[key]  # gone from the store (deleted by someone with access to it)
    with pytest.raises(RendezvousError, match="gone"):
        Documents(backend, RUN).decode(head)
    with pytest.raises(RendezvousError, match="outside this job"):
        Documents(backend, "another-job").decode(head)


def test_a_rendezvous_client_recovers_a_large_job_writing_only_the_head(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = CountingBackend()
    state = complete(1024, spares=1)
    seeded = Documents(backend, RUN).encode(state, None)
    backend.set(keys.rdzv_state(RUN), seeded)
    client = RendezvousClient(
        backend,
        RUN,
        state.participants[0],
        min_nodes=1,
        max_nodes=1024,
        join_timeout=timedelta(seconds=5),
        last_call_timeout=timedelta(seconds=1),
        refresh_s=10.0,
    )
    backend.written.clear()

    after = client.replace_nodes(1, ("n517",), failure={"reason": "node lost"})

    assert after.participants[517].node_id == "spare0" and after.round == 2
    assert backend.written[keys.rdzv_state(RUN)] < 2_000  # the head only: no member list written
    assert not any("/members/" in key for key in backend.written)
    assert Documents(backend, RUN).decode(backend.get(keys.rdzv_state(RUN))) == after


@pytest.mark.parametrize("change", [[[5, ["x"]]], [[5000, list(node(0))]], [["5", list(node(0))]], "all"])
def test_malformed_member_changes_are_refused(change: object) -> None:
    backend = MemoryBackend()
    doc = json.loads(Documents(backend, RUN).encode(complete(128), None))
    doc["participants"]["set"] = change
    with pytest.raises(RendezvousError, match="member"):
        Documents(backend, RUN).decode(json.dumps(doc).encode())
