"""Open a job's rendezvous backend as a read-only observer (``resilrun status``), never as a host.

An observer must not change the job: it never binds the endpoint (a status call on the head node
must not start a store when the job is down), never joins, and fails fast. A plain TCP connect
probes the endpoint first, so a closed port is refused in milliseconds and a silent host costs the
timeout once, before the backend's own client (whose connect retries for its whole timeout) runs.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from resilrun.errors import ConfigError, StoreConnectionError
from resilrun.rendezvous.api import RendezvousBackend

if TYPE_CHECKING:
    from resilrun.rendezvous.etcd import EtcdSecurity

# static jobs keep their rendezvous in a TCPStore too (at --master-addr:--master-port).
BACKENDS = ("c10d", "static", "etcd")


def open_readonly(
    kind: str, endpoint: str, timeout: timedelta, security: EtcdSecurity | None = None
) -> tuple[RendezvousBackend, str]:
    """A client of the backend at ``endpoint`` whose every call is bounded by ``timeout``.

    ``endpoint`` is ``host[:port]`` (c10d, static; port 29400 by default) or etcd's
    ``host[:port][,host[:port]...]``; ``security``: etcd's TLS and user. Returns the backend and
    the endpoint as it was resolved.

    Raises:
        StoreConnectionError: nothing answers at the endpoint within ``timeout``.
        ConfigError: ``kind`` is unknown or ``endpoint`` malformed.
    """
    if kind not in BACKENDS:
        raise ConfigError(f"--rdzv-backend '{kind}' is unknown", hint=f"use one of {', '.join(BACKENDS)}")
    if kind == "etcd":
        from resilrun.rendezvous.etcd import open_etcd

        # reads only: no lease is attached, nothing written
        etcd = open_etcd(endpoint, timeout=timeout, security=security)
        return etcd, etcd.endpoint_list
    from resilrun.option_values import parse_endpoint

    host, port = parse_endpoint(endpoint)
    return _open_tcpstore(host, port, timeout), f"{host}:{port}"


def _open_tcpstore(host: str, port: int, timeout: timedelta) -> RendezvousBackend:
    """The probe and the store client's connect share one deadline, and every read after gets
    ``timeout`` too. TCPStore's own connect retries a refused port with back-off and overshoots its
    timeout by half or more (a job ending between the probe and the connect is refused), so it runs
    under the deadline of :class:`~resilrun.rendezvous.c10d.StoreCalls` rather than on its own."""
    # Imported before the clock starts: importing torch takes seconds of CPU, more on a busy machine,
    # and none of that is the endpoint's time to answer.
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported at run time

    from resilrun.env import quiet_torch_native_logs
    from resilrun.rendezvous.c10d import C10dBackend, StoreCalls, _call

    endpoint = f"{host}:{port}"
    seconds = timeout.total_seconds()
    deadline = time.monotonic() + seconds
    probe(host, port, timeout)
    quiet_torch_native_logs()  # a store going away mid-read must end as our one line, not a C++ trace
    left = max(deadline - time.monotonic(), min(seconds, 1.0))

    def connect() -> object:
        return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=left), wait_for_workers=False)

    try:
        store = StoreCalls(endpoint, left).call(lambda: _call(endpoint, connect))
    except StoreConnectionError as exc:
        raise StoreConnectionError(
            f"{endpoint} accepted a connection but no rendezvous store answered there within "
            f"{timeout.total_seconds():g} s",
            hint="the job may be ending right now; otherwise check --rdzv-endpoint (the job's rendezvous "
            "host:port) and --rdzv-backend",
        ) from exc.__cause__
    return C10dBackend(store, endpoint, timeout)  # type: ignore[arg-type]  # a TCPStore, built lazily above


def probe(host: str, port: int, timeout: timedelta) -> None:
    """Raise StoreConnectionError unless a TCP connection to ``host:port`` opens within ``timeout``."""
    endpoint = f"{host}:{port}"
    seconds = timeout.total_seconds()
    hint = "check --rdzv-endpoint, that the job is running, and firewalls; or raise --timeout"
    try:
        with socket.create_connection((host, port), timeout=seconds):
            return
    except socket.gaierror as exc:
        raise StoreConnectionError(f"{endpoint}: host '{host}' is not known ({exc.strerror})", hint=hint) from exc
    except TimeoutError as exc:
        raise StoreConnectionError(f"{endpoint} did not answer within {seconds:g} s", hint=hint) from exc
    except ConnectionRefusedError as exc:
        raise StoreConnectionError(f"nothing listens at {endpoint} (connection refused)", hint=hint) from exc
    except OSError as exc:
        raise StoreConnectionError(f"{endpoint} is not reachable: {exc.strerror or exc}", hint=hint) from exc
