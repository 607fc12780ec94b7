"""Opens the rendezvous backend a Config names: c10d/static (a TCPStore) or etcd.

The one place that knows which backend classes exist, so the agent stays backend-agnostic. With
c10d one agent may host the store (and must then leave last); with etcd nobody hosts anything: the
store is an external, replicated service, and every agent attaches its writes to the job's lease.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from resilrun import keys
from resilrun.config import Config
from resilrun.rendezvous.api import RendezvousBackend


@dataclass(frozen=True, slots=True)
class OpenedBackend:
    """A connected backend, what to call it in logs, and whether this process hosts it."""

    backend: RendezvousBackend
    endpoint: str
    hosting: bool


def open_backend(config: Config) -> OpenedBackend:
    """Connect to (or, for c10d on the endpoint's node, host) the job's rendezvous store.

    Raises:
        StoreConnectionError: the store could not be reached (or hosted) within the read timeout.
    """
    timeout = timedelta(seconds=config.rdzv.read_timeout_s)
    if config.rdzv_backend == "etcd":
        from resilrun.rendezvous.etcd import open_etcd

        etcd = open_etcd(config.rdzv_endpoint, timeout=timeout)
        etcd.attach_job_lease(keys.job_lease(config.rdzv_id))
        return OpenedBackend(etcd, f"etcd://{etcd.endpoint_list}", hosting=False)
    from resilrun.rendezvous.c10d import C10dBackend, open_store

    host, port = config.endpoint
    store, hosting = open_store(host, port, is_host=config.rdzv.is_host, timeout=timeout)
    endpoint = f"{host}:{store.port if hosting else port}"
    return OpenedBackend(C10dBackend(store, endpoint, timeout), endpoint, hosting)
