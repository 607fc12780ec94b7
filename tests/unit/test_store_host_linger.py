"""The node hosting the c10d store leaves last: it waits (bounded) until every node that reads the
job's state has seen it closed, spare nodes included. A spare node that polls the store after its
host exited reads a reset connection and exits with an error although the job succeeded (seen in
CI once the agent started fast enough: the host left as soon as the two training nodes had acked).
"""

from __future__ import annotations

import threading
import time
import types
from dataclasses import replace

from resilrun.agent.node import _linger_for_peers
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import RdzvState
from tests.unit.test_rendezvous_client import FakeClock, client, node, write_state


def test_the_store_host_waits_for_the_spare_nodes_to_see_the_close() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    running = RdzvState(round=1, complete=True, participants=(node("a"), node("b")), spares=(node("c"),))
    write_state(backend, running)
    rdzv = client(backend, node("a"), clock, lo=2, hi=2)
    write_state(backend, replace(running, closed=True, outcome="succeeded"))
    rdzv.ack_closed()  # the two training nodes saw the close,
    rdzv.ack_closed()
    spare_acked = threading.Timer(0.3, rdzv.ack_closed)  # the spare node reads it a poll later
    spare_acked.start()
    started = time.monotonic()
    _linger_for_peers(rdzv, types.SimpleNamespace(last_state=running), close_timeout_s=5.0)
    waited = time.monotonic() - started
    spare_acked.join()
    assert 0.25 <= waited < 4.0, waited
