"""The replica server's pre-auth stage drops the oldest connection of the busiest source (issue 43, F2)."""

from __future__ import annotations

import socket

import pytest

from resilrun.tiers.peer.admission import PreAuthStage, choose_evictee


@pytest.mark.parametrize(
    ("sources", "dropped"),
    [
        (["a"], 0),
        (["a", "a", "a"], 0),  # one source: oldest first
        (["honest", "flood", "flood", "flood"], 1),  # never the other host's slow handshake
        (["flood", "honest", "flood"], 0),
        (["b", "a", "a", "b"], 0),  # a tie: the oldest of the tied sources
        (["a", "b", "c"], 0),  # a flood spread over addresses: plain oldest-first
    ],
)
def test_choose_evictee_takes_the_oldest_of_the_source_holding_the_most(sources: list[str], dropped: int) -> None:
    assert choose_evictee(sources) == dropped


def test_choose_evictee_refuses_an_empty_stage() -> None:
    with pytest.raises(ValueError, match="no waiting connection"):
        choose_evictee([])


def test_a_full_stage_admits_the_newcomer_and_gives_back_the_connection_it_dropped() -> None:
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        stage = PreAuthStage(2)
        (a, _), (b, _), (c, _) = pairs
        assert stage.admit(a, "flood") is None
        assert stage.admit(b, "honest") is None
        assert stage.admit(c, "flood") == (a, "flood")
        assert len(stage) == 2
        assert not stage.leave(a)  # dropped: its handshake counts for nothing
        assert stage.leave(b) and stage.leave(c) and len(stage) == 0
    finally:
        for left, right in pairs:
            left.close()
            right.close()
