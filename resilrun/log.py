"""What log messages share (handlers are attached by the CLI only)."""

from __future__ import annotations


def rank_ranges(ranks: list[int], sep: str = ",") -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (sorted input): messages stay readable for thousands of ranks."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return sep.join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
