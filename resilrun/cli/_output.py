"""The only printer: data to stdout, messages to stderr, rich only on a TTY."""

from __future__ import annotations

import json
import sys
from typing import Any


class Output:
    """One object per command invocation; ``json_mode`` switches data to JSON documents."""

    def __init__(self, *, json_mode: bool = False) -> None:
        self.json_mode = json_mode

    def data(self, text: str) -> None:
        print(text, file=sys.stdout, flush=True)

    def json(self, payload: Any) -> None:
        print(json.dumps({"data": payload}, indent=2, sort_keys=True), file=sys.stdout, flush=True)

    def json_line(self, payload: Any) -> None:
        """One compact document per line (``--watch --json``: a stream a program can read line by line)."""
        print(json.dumps({"data": payload}, sort_keys=True, separators=(",", ":")), file=sys.stdout, flush=True)

    def rich(self, renderable: Any) -> None:
        """A rich renderable on stdout; callers use it only when stdout is a terminal."""
        from rich.console import Console

        Console(file=sys.stdout).print(renderable)

    def live(self) -> Any:
        """A started rich ``Live`` on stdout that redraws in place (``update(renderable)``, ``stop()``)."""
        from rich.console import Console

        return _Live(Console(file=sys.stdout))

    def error(self, message: str, hint: str | None = None, *, code: str = "error") -> None:
        if self.json_mode:
            body = {"error": {"code": code, "message": message, "hint": hint}}
            print(json.dumps(body, indent=2, sort_keys=True), file=sys.stdout, flush=True)
            return
        print(f"resilrun: error: {message}", file=sys.stderr, flush=True)
        if hint:
            print(f"resilrun: hint: {hint}", file=sys.stderr, flush=True)

    def block(self, text: str) -> None:
        """A multi-line message (e.g. a failure report) on stderr."""
        print(text, file=sys.stderr, flush=True)

    def info(self, message: str) -> None:
        print(f"resilrun: {message}", file=sys.stderr, flush=True)


class _Live:
    """A rich ``Live`` that redraws on every update (no timer thread: ``--watch`` sets the pace)."""

    def __init__(self, console: Any) -> None:
        from rich.live import Live

        self._live = Live(console=console, auto_refresh=False, transient=False)
        self._live.start()

    def update(self, renderable: Any) -> None:
        self._live.update(renderable, refresh=True)

    def stop(self) -> None:
        self._live.stop()
