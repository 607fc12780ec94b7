"""Opens the rendezvous backend a Config names: c10d/static (a TCPStore) or etcd.

The one place that knows which backend classes exist, so the agent stays backend-agnostic. With
c10d one agent may host the store (and must then leave last); with etcd nobody hosts anything: the
store is an external, replicated service, and every agent attaches its writes to the job's lease.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from resilrun import keys
from resilrun.config import Config
from resilrun.env import agent_secrets
from resilrun.errors import ConfigError
from resilrun.option_values import RdzvConf
from resilrun.private_file import read_private
from resilrun.rendezvous.api import RendezvousBackend

if TYPE_CHECKING:
    from resilrun.rendezvous.etcd import EtcdSecurity

ETCD_PASSWORD_ENV = "RESILRUN_ETCD_PASSWORD"

logger = logging.getLogger(__name__)
_warned_in_clear = False  # the warning below is said once per process, not per backend opened


@dataclass(frozen=True, slots=True)
class OpenedBackend:
    """A connected backend, what to call it in logs, and whether this process hosts it."""

    backend: RendezvousBackend
    endpoint: str
    hosting: bool


def etcd_security(conf: RdzvConf, environ: Mapping[str, str], *, require_auth: bool = False) -> EtcdSecurity | None:
    """TLS and the user for etcd from ``--rdzv-conf`` (None: plain http); the password from
    ``password_file`` (private to the job's user) or ``RESILRUN_ETCD_PASSWORD``.

    A user without TLS sends its password in clear (etcd's gateway takes it in the body of the
    authenticate request, and the token it returns in every request's header): anyone on the path
    reads both. Refused under ``require_auth``, warned about otherwise.

    Raises:
        ConfigError: a user without a password, a lax or missing password file, or a user without
            TLS under ``require_auth``.
    """
    from resilrun.rendezvous.etcd import EtcdSecurity

    if not conf.etcd_security_keys():
        return None
    password = None
    if conf.password_file is not None:
        password = read_private(Path(conf.password_file), "--rdzv-conf password_file").strip()
    elif environ.get(ETCD_PASSWORD_ENV):
        password = environ[ETCD_PASSWORD_ENV]
    if conf.user is not None and not password:
        raise ConfigError(
            f"--rdzv-conf user={conf.user} without a password",
            hint=f"give password_file=PATH (mode 0600) or set {ETCD_PASSWORD_ENV}",
        )
    security = EtcdSecurity(conf.ca_file, conf.cert_file, conf.key_file, conf.user, password)
    if security.user is not None and not security.tls:
        _check_password_in_clear(security.user, require_auth)
    return security


def _check_password_in_clear(user: str, require_auth: bool) -> None:
    global _warned_in_clear
    message = f"--rdzv-conf user={user} without TLS: etcd's password and token would cross the network in clear"
    hint = "give --rdzv-conf ca_file=PATH (the CA of etcd's certificate) so etcd is reached over https"
    if require_auth:
        raise ConfigError(f"--require-auth: {message}", hint=hint)
    if not _warned_in_clear:
        _warned_in_clear = True
        logger.warning("%s; %s", message, hint)


def open_backend(config: Config) -> OpenedBackend:
    """Connect to (or, for c10d on the endpoint's node, host) the job's rendezvous store.

    Raises:
        StoreConnectionError: the store could not be reached (or hosted) within the read timeout.
    """
    timeout = timedelta(seconds=config.rdzv.read_timeout_s)
    if config.rdzv_backend == "etcd":
        from resilrun.rendezvous.etcd import open_etcd

        etcd = open_etcd(
            config.rdzv_endpoint,
            timeout=timeout,
            security=etcd_security(config.rdzv, agent_secrets(), require_auth=config.require_auth),
        )
        etcd.attach_job_lease(keys.job_lease(config.rdzv_id))
        return OpenedBackend(etcd, f"etcd://{etcd.endpoint_list}", hosting=False)
    if config.rdzv.etcd_security_keys():
        raise ConfigError(
            f"--rdzv-conf {', '.join(config.rdzv.etcd_security_keys())}: only for --rdzv-backend etcd",
            hint="c10d's TCPStore has no TLS or users: keep its port on a private network",
        )
    from resilrun.rendezvous.c10d import C10dBackend, open_store

    host, port = config.endpoint
    store, hosting = open_store(host, port, is_host=config.rdzv.is_host, timeout=timeout)
    endpoint = f"{host}:{store.port if hosting else port}"
    return OpenedBackend(C10dBackend(store, endpoint, timeout), endpoint, hosting)
