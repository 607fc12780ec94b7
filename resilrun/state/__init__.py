"""State tiers: node memory (tier 1), peer replicas (tier 2), persistent storage (tier 3)."""

__all__: list[str] = []
