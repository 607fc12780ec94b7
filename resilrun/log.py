"""Logger naming and context; handlers are attached by the CLI only."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any


class ContextAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]  # generic only in 3.11+ stubs
    """Prefixes messages with the job context (node, round) so interleaved node logs stay legible."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        extra = self.extra or {}
        context = " ".join(f"{k}={v}" for k, v in extra.items() if v is not None)
        return (f"[{context}] {msg}" if context else msg), kwargs


def get_logger(name: str, **context: Any) -> ContextAdapter:
    return ContextAdapter(logging.getLogger(name), context)
