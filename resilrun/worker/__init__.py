"""The worker library: what training scripts import (never imports the agent or the CLI)."""

from resilrun.worker.job import Job, init

__all__ = ["Job", "init"]
