"""The agent's checkpoint tiers: node memory (tier 1), peer replicas (tier 2), durable storage (tier 3).

Agent side only: a worker reaches them through the agent channel, and shares with them only the
snapshot format (``resilrun.snapshot``).
"""
