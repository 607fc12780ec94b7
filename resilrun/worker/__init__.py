"""The worker library: what training scripts import (never imports the agent, the CLI, or the
framework integrations built on it).

Lazy on purpose: the worker entry point (``python -m resilrun.worker_main``) imports from this
package before the user's script runs (a hot spare waits in ``membership``), and the package must
stay light (no torch) so that an import error in the script itself is still recorded in the error
file.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Job", "init"]


def __getattr__(name: str) -> Any:
    if name == "init":
        from resilrun.worker import membership

        return membership.init
    if name == "Job":
        from resilrun.worker import job

        return job.Job
    raise AttributeError(f"module 'resilrun.worker' has no attribute {name!r}")
