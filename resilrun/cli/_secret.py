"""``--job-secret-file`` as the commands that read a job's state take it (status, inspect, export)."""

from __future__ import annotations

from typing import Any

import typer


def secret_file_option(help: str) -> Any:
    """The option, with what the secret is used for in this command as its help."""
    return typer.Option("--job-secret-file", envvar="RESILRUN_JOB_SECRET_FILE", metavar="PATH", help=help)
