"""The snapshot format both sides use: tensor layout, state trees, shared buffers, deduplication
across a node's ranks, and restore planning. Imports nothing of the agent or the worker.
"""
