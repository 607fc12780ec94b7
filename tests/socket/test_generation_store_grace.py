"""A superseded generation's worker store stays reachable for a while (RETIRED_STORE_S).

Seen in CI (tests/integration/test_device_check.py, the spare failing its device check): the spare
given rank 1 in generation 1 failed at once, generation 2 replaced generation 1 and its worker store
was closed while the surviving rank 0 was still about to connect to it. torch's store client retries
a refused connection until its timeout, beyond the setup guard's grace, so rank 0 was ended (exit 75)
and another spare took its rank: the survivor lost its process. With the store kept open, the late
client connects, its set-up fails once the guard shuts its sockets, and it follows generation 2.
"""

from __future__ import annotations

import socket
from datetime import timedelta

from resilrun.agent.supervision.rounds import RETIRED_STORE_S, Round
from resilrun.rendezvous.c10d import host_store
from resilrun.rendezvous.document import RdzvState


def _reachable(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except ConnectionRefusedError:
        return False


def test_a_replaced_generations_store_stays_open_for_a_while_and_closes_with_the_round() -> None:
    # Given a round whose generation 1 store this node hosts
    stores = [host_store("127.0.0.1", 0, timedelta(seconds=5)) for _ in range(3)]
    ports = [store.port for store in stores]
    round_ = Round(RdzvState(round=1), 0, [], [], stores[0])
    try:
        # When generation 2 replaces it at once and generation 3 five seconds later (spares failing
        # their checks), a survivor late to connect to either superseded store still reaches it (and
        # fails in its abandoned set-up, instead of retrying a closed port)
        round_.replace_store(stores[1], now=100.0)
        round_.close_retired(now=100.0)
        round_.replace_store(stores[2], now=105.0)
        round_.close_retired(now=105.0)
        assert round_.store is stores[2]
        assert _reachable(ports[0]) and _reachable(ports[1])
        # then each closes once it has been retired for RETIRED_STORE_S
        round_.close_retired(now=100.0 + RETIRED_STORE_S)
        assert not _reachable(ports[0])
        assert _reachable(ports[1])
        # and whatever is left closes when the round ends; the current store is the round's own
        round_.close_retired()
        assert not _reachable(ports[1])
        assert _reachable(ports[2])
    finally:
        for store in stores:
            store.close()


def test_a_node_that_hosts_no_store_replaces_nothing() -> None:
    round_ = Round(RdzvState(round=1), 0, [], [], None)
    round_.replace_store(None, now=1.0)
    round_.replace_store(None, now=2.0)
    round_.close_retired()
    assert round_.store is None
