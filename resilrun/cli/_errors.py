"""Turns every error resilrun raises into a message, a hint and an exit code (the one renderer)."""

from __future__ import annotations

import traceback

from resilrun.cli._output import Output
from resilrun.env import resilrun_debug
from resilrun.errors import ExitCode, ResilrunError, ShutdownRequested, WorkerGroupFailed


def render(exc: BaseException, out: Output) -> int:
    """Print ``exc`` for a person (or as JSON) and return the process exit code."""
    if resilrun_debug():
        traceback.print_exception(exc)
    if isinstance(exc, ShutdownRequested):
        out.info(f"stopped by signal {exc.signum}; workers were stopped")
        return int(exc.exit_code)
    if isinstance(exc, WorkerGroupFailed):
        out.block(exc.report)
    if isinstance(exc, ResilrunError):
        out.error(exc.message, exc.hint, code=type(exc).__name__)
        return int(exc.exit_code)
    if isinstance(exc, KeyboardInterrupt):
        return int(ExitCode.INTERRUPTED)
    out.error(
        f"internal error: {type(exc).__name__}: {exc}",
        "this is a bug in resilrun; rerun with RESILRUN_DEBUG=1 and report the traceback",
    )
    return int(ExitCode.WORKERS_FAILED)
