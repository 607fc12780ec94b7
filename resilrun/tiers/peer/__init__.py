"""Tier 2, peer replicas: the one import for everything tier 2.

The agent replicates each local rank's newest committed snapshot to the agents of the next k
nodes (``Replicator``, in ``replicator``), serves what it holds to peers (``ReplicaServer``, in
``server``, with ``refs`` for the bytes a replica shares with the receiver's own node memory), and
keeps what peers sent it in memory (``ReplicaStore``, in ``store``). The wire protocol, with mutual
authentication on the job secret and per-tensor crc32s, is in ``wire`` and ``stream``; the client
calls (``push``, ``fetch``, ``held``, ``alive``) are in ``client``.
"""

from resilrun.tiers.peer.client import alive, fetch, held, inventory, push
from resilrun.tiers.peer.replicator import Replicator
from resilrun.tiers.peer.server import ReplicaServer
from resilrun.tiers.peer.store import Replica, ReplicaStore
from resilrun.tiers.peer.wire import ReplicationError

__all__ = [
    "Replica",
    "ReplicaServer",
    "ReplicaStore",
    "ReplicationError",
    "Replicator",
    "alive",
    "fetch",
    "held",
    "inventory",
    "push",
]
