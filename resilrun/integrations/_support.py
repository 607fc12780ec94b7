"""What every framework integration needs the same way: the supported-version check, and which
training of a generation is snapshotted.

Why one place for the latter: the job's snapshots are one sequence of steps, whatever framework
wrote them. A second training in the same run (a second stage, a sweep, a Trainer after an
Accelerate loop) would restore the first one's steps, so only the first one is snapshotted; the
others run as under torchrun, and a failure in them runs the script again, whose first training
is then restored and finishes at once.
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)

Version = tuple[int, int]


def version_of(text: str) -> Version | None:
    """(major, minor) of a version string such as ``2.6.0rc1`` or ``5.1.dev0``; None if unreadable."""
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else None


def outside(name: str, text: str, supported: tuple[Version, Version]) -> str | None:
    """Why ``name`` at version ``text`` is not integrated, or None when it is in ``[low, high)``."""
    version = version_of(text)
    low, high = supported
    if version is not None and low <= version < high:
        return None
    return (
        f"{name} {text} is outside the versions resilrun integrates "
        f"(>={'.'.join(map(str, low))}, <{'.'.join(map(str, high))})"
    )


class Generation:
    """Which training this process snapshots in the generation it is in."""

    def __init__(self) -> None:
        self.owner: str | None = None

    def claim(self, what: str) -> bool:
        """Whether ``what`` (e.g. "Trainer.train()") is the generation's snapshotted training; a
        later one is told why not, once, and runs as under torchrun."""
        if self.owner is None:
            self.owner = what
            return True
        logger.warning(
            "resilrun snapshots the first training of a run only (%s); this %s is not snapshotted", self.owner, what
        )
        return False

    def forget(self) -> None:
        """The process runs the script again: its first training will be snapshotted again."""
        self.owner = None


GENERATION = Generation()


def forget_on_reentry() -> None:
    """Have ``GENERATION`` forgotten whenever this process runs the script again."""
    from resilrun.worker import membership

    membership.on_reentry(GENERATION.forget)
