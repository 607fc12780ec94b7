"""The free memory a node keeps for its workers and its agent: what node memory, peer replicas,
fetched snapshots and captured files may never take (one margin for all, so no tier can starve
the training the others protect)."""

from __future__ import annotations

HEADROOM_BYTES = 256 * 1024 * 1024


def available_bytes() -> int:
    """Memory the kernel could give now without swapping (psutil's "available")."""
    import psutil

    return int(psutil.virtual_memory().available)


def fits(nbytes: int) -> bool:
    """Whether ``nbytes`` more would still leave the headroom free."""
    return nbytes + HEADROOM_BYTES <= available_bytes()
