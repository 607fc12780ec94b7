"""The write fence: a node writes durable state only within its heartbeat lease and as a participant."""

from __future__ import annotations

import logging

import pytest

from resilrun.agent.liveness.fence import WriteFence
from resilrun.errors import StoreConnectionError
from resilrun.rendezvous.protocol import NodeInfo, RdzvState

ME = "h1:100:abc"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def state(*nodes: str, round: int = 2) -> RdzvState:
    return RdzvState(round=round, complete=True, participants=tuple(NodeInfo(n, "198.18.0.9", 1) for n in nodes))


def test_a_participant_within_its_lease_may_write_and_each_condition_alone_stops_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="resilrun.agent.liveness.fence")
    clock, confirmed = Clock(), [99.0]
    current: list[RdzvState | Exception] = [state("h0:1:x", ME)]

    def read() -> RdzvState:
        if isinstance(current[0], Exception):
            raise current[0]
        return current[0]

    fence = WriteFence(lambda: confirmed[0], read, ME, heartbeat_timeout_s=6.0, clock=clock)
    assert fence.allows()
    # the newest heartbeat that reached the store began more than half the timeout ago: no
    clock.now = 102.5
    assert not fence.allows() and not fence.allows()
    assert caplog.text.count("has not reached the store for 3.5 s") == 1  # said once, not per write
    confirmed[0] = 102.0
    assert fence.allows()
    assert "writing to the persistent tier again" in caplog.text
    # the store cannot confirm the generation: no
    current[0] = StoreConnectionError("rendezvous store at h0:29400 failed: no answer within 10 s")
    assert not fence.allows()
    assert "cannot confirm this node's generation: rendezvous store at h0:29400 failed" in caplog.text
    # the store names a generation this node is not in (a spare took its place): no
    current[0] = state("h0:1:x", "h2:7:y", round=3)
    assert not fence.allows()
    assert "not a participant of generation 3 (it was replaced)" in caplog.text


def test_before_its_first_heartbeat_a_node_may_not_write() -> None:
    fence = WriteFence(lambda: None, lambda: state(ME), ME, heartbeat_timeout_s=6.0, clock=Clock())
    assert not fence.allows()
