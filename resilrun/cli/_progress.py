"""A progress bar on stderr, drawn only on a terminal (pipes and CI logs get no escape codes)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Bar(Protocol):
    def advance(self, amount: int) -> None: ...

    def update(self, done: int, total: int) -> None: ...


class _NullBar:
    def advance(self, amount: int) -> None:
        pass

    def update(self, done: int, total: int) -> None:
        pass


@contextmanager
def progress(label: str, total: int) -> Iterator[Bar]:
    """A rich progress bar on a TTY; otherwise nothing."""
    if not sys.stderr.isatty():
        yield _NullBar()
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)

        class _RichBar:
            def advance(self, amount: int) -> None:
                bar.advance(task, amount)

            def update(self, done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

        yield _RichBar()
