"""Rendezvous: how the nodes of a job agree on rounds, membership and node ranks."""

from resilrun.rendezvous.api import RendezvousBackend
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import NodeInfo, RdzvState

__all__ = ["MemoryBackend", "NodeInfo", "RdzvState", "RendezvousBackend", "RendezvousClient"]
