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

Importing this package imports none of them: ``run`` starts the node's worker template first, so
that its ``import torch`` runs while the agent imports its own (node.py pulls in torch).
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from resilrun.config import Config

if TYPE_CHECKING:
    from resilrun.agent.node import RunResult
    from resilrun.agent.workers.template import WorkerTemplate

__all__ = ["Node", "Outcome", "RunResult", "build_node", "resolve_nproc", "run"]


def __getattr__(name: str) -> Any:
    if name in ("Node", "Outcome", "RunResult", "build_node", "resolve_nproc"):
        from resilrun.agent import node

        return getattr(node, name)
    raise AttributeError(f"module 'resilrun.agent' has no attribute '{name}'")


def _early_template(config: Config) -> WorkerTemplate | None:
    """The worker template, started before the agent imports torch, where its environment is
    known without torch (``--nproc-per-node`` a number or ``cpu``); else build_node starts it."""
    from resilrun.agent.workers.procs import start_template
    from resilrun.agent.workers.template import script_imports, uses_template
    from resilrun.env import agent_environ, worker_base_env
    from resilrun.option_values import nproc_without_devices

    nproc = nproc_without_devices(config.nproc_per_node)
    if not uses_template(config) or nproc is None:
        return None
    env = worker_base_env(agent_environ(), nproc)
    return start_template(env, before_devices=True, script=script_imports(config, env))


def run(config: Config) -> RunResult:
    """Run this node's part of the job; returns on success.

    Raises:
        ResilrunError: the job failed (the subclass says how); ShutdownRequested on a signal.
    """
    from resilrun.agent.workers.procs import HANDLED_SIGNALS

    template = _early_template(config)
    try:
        from resilrun.agent.node import build_node
        from resilrun.agent.supervision.rounds import SignalFlag

        signals = SignalFlag()
        previous = {sig: signal.signal(sig, signals.handler) for sig in HANDLED_SIGNALS}
        try:
            result = build_node(config, signals, template=template).run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        if template is not None:
            template.close()
    result.raise_error()
    return result
