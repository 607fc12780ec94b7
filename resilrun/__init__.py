"""resilrun: a torchrun-compatible launcher for distributed PyTorch training that survives failures.

Importing this package is cheap (no torch): the worker bootstrap and the CLI rely on that. The
worker API (``resilrun.init``, ``resilrun.Job``, ``resilrun.once``) is loaded on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["Job", "__version__", "init", "once"]


def __getattr__(name: str) -> Any:
    if name == "init":
        from resilrun.worker import membership

        return membership.init
    if name == "Job":
        from resilrun.worker import job

        return job.Job
    if name == "once":
        from resilrun.worker.once import once

        return once
    raise AttributeError(f"module 'resilrun' has no attribute {name!r}")
