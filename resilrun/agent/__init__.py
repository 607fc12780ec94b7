"""The agent: one per node; it joins the job, runs and supervises the node's workers, holds their
state in node memory and recovers them.

``run(config)`` is what ``resilrun run`` calls: it builds the node (``node.build_node``: every
part wired through its constructor) and runs it, with this process's signals turned into a flag
the round loop reads. The parts live in groups, each importing only the groups listed before it:

- ``workers/``: the worker processes, their specs, the control point, their failures;
- ``liveness/``: this node's heartbeat and write lease;
- ``observability/``: events, telemetry, metrics;
- ``state/``: the worker channel, restore sources, replication, persistence;
- ``supervision/``: the round loop and the parts it composes;
- ``node.py`` (the composition root), ``status.py`` (the status publisher, which reads every
  part) and ``addressing.py`` (the node's address, decided once) on top.
"""

from __future__ import annotations

import signal

from resilrun.agent.node import Node, Outcome, RunResult, build_node, resolve_nproc
from resilrun.agent.supervision.rounds import SignalFlag
from resilrun.agent.workers.procs import HANDLED_SIGNALS
from resilrun.config import Config

__all__ = ["Node", "Outcome", "RunResult", "build_node", "resolve_nproc", "run"]


def run(config: Config) -> RunResult:
    """Run this node's part of the job; returns on success.

    Raises:
        ResilrunError: the job failed (the subclass says how); ShutdownRequested on a signal.
    """
    signals = SignalFlag()
    previous = {sig: signal.signal(sig, signals.handler) for sig in HANDLED_SIGNALS}
    try:
        result = build_node(config, signals).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    result.raise_error()
    return result
