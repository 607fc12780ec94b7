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


def rank_ranges(ranks: list[int], sep: str = ",") -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (sorted input): messages stay readable for thousands of ranks."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return sep.join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
