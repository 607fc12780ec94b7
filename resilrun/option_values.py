"""The grammars of option values that are more than a number: ``--nnodes`` ranges, endpoints,
``--rdzv-conf`` pairs, torchrun's stream selections.

Apart from ``config.Config`` so that the readers of one value (status reads an endpoint and
``--rdzv-conf``, the etcd backend a member list) need not take the whole launch configuration; like
it, nothing here reads the environment or touches the network, and bad text is a ``ConfigError``
with a hint.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from resilrun.errors import ConfigError

DEFAULT_RDZV_PORT = 29400
# etcd's standard client port, as torchrun's etcd backend assumes.
DEFAULT_ETCD_PORT = 2379


class Std(IntEnum):
    """Which worker streams go to log files (torchrun's ``--redirects``/``--tee`` values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclass(frozen=True, slots=True)
class RdzvConf:
    """Typed ``--rdzv-conf`` keys; unknown keys are an error, never silently dropped."""

    # 600 s as torchrun: large clusters take minutes to schedule every node.
    join_timeout_s: float = 600.0
    # Extra wait once MIN nodes joined, so nodes scheduled a little later still make the round.
    last_call_timeout_s: float = 30.0
    close_timeout_s: float = 30.0
    # Store connect / operation timeout; 60 s as torchrun (a cold cluster's DNS and SYN retries).
    read_timeout_s: float = 60.0
    is_host: bool | None = None
    # etcd over TLS and with authentication (rendezvous/etcd.py EtcdSecurity): the CA that signed
    # etcd's certificate (https), a client certificate and key (etcd's --client-cert-auth), and a
    # user whose password is in a private file or RESILRUN_ETCD_PASSWORD.
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password_file: str | None = None

    def etcd_security_keys(self) -> list[str]:
        """The etcd-only keys given (an error on another backend)."""
        names = ("ca_file", "cert_file", "key_file", "user", "password_file")
        return [name for name in names if getattr(self, name) is not None]


# Keys torchrun accepts that have no effect here; accepted so torchrun command lines keep working.
_ACCEPTED_RDZV_KEYS = {
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "heartbeat_timeout",
    "timeout",
    "store_type",
    "use_libuv",
}


def parse_rdzv_conf(value: str) -> RdzvConf:
    """Parse ``k1=v1,k2=v2`` into :class:`RdzvConf`.

    Raises:
        ConfigError: on an unknown key or a value of the wrong type.
    """
    kwargs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ConfigError(
                f"--rdzv-conf entry '{item}' has no '='",
                hint="write key=value pairs separated by commas, e.g. join_timeout=900",
            )
        raw = raw.strip()
        if key in ("join_timeout", "last_call_timeout", "close_timeout", "read_timeout"):
            kwargs[f"{key}_s"] = _positive_float(f"--rdzv-conf {key}", raw)
        elif key == "is_host":
            kwargs["is_host"] = _parse_bool(f"--rdzv-conf {key}", raw)
        elif key in ("ca_file", "cert_file", "key_file", "user", "password_file"):
            if not raw:
                raise ConfigError(f"--rdzv-conf {key} is empty", hint=f"give {key}=VALUE")
            kwargs[key] = raw
        elif key == "store_type" and raw != "tcp":
            raise ConfigError(
                f"--rdzv-conf store_type '{raw}' is not supported",
                hint="resilrun's c10d backend uses a TCPStore (store_type=tcp)",
            )
        elif key not in _ACCEPTED_RDZV_KEYS:
            known = (
                "join_timeout, last_call_timeout, close_timeout, read_timeout, is_host; for etcd: ca_file, "
                "cert_file, key_file, user, password_file"
            )
            raise ConfigError(f"--rdzv-conf key '{key}' is unknown", hint=f"known keys: {known}")
    if ("cert_file" in kwargs) != ("key_file" in kwargs):
        raise ConfigError(
            "--rdzv-conf cert_file and key_file go together", hint="give both (etcd's client certificate and its key)"
        )
    if "password_file" in kwargs and "user" not in kwargs:
        raise ConfigError("--rdzv-conf password_file needs user", hint="give user=NAME too")
    return RdzvConf(**kwargs)


def _positive_float(what: str, raw: str) -> float:
    try:
        number = float(raw)
    except ValueError:
        raise ConfigError(f"{what} '{raw}' is not a number", hint="give seconds, e.g. 30") from None
    if not number > 0:
        raise ConfigError(f"{what} ({raw}) must be > 0")
    return number


def _parse_bool(what: str, raw: str) -> bool:
    lowered = raw.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{what} '{raw}' is not a boolean", hint="use true or false")


def parse_nnodes(value: str) -> tuple[int, int]:
    """Parse ``N`` or ``MIN:MAX`` into ``(min_nodes, max_nodes)``."""
    parts = value.split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isdecimal() for p in parts):
        raise ConfigError(
            f"--nnodes '{value}' is not N or MIN:MAX",
            hint="e.g. --nnodes 4, or --nnodes 2:4 for an elastic job",
        )
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise ConfigError(f"--nnodes min ({low}) must be >= 1")
    if low > high:
        raise ConfigError(f"--nnodes min ({low}) must be <= max ({high})")
    return low, high


def nproc_without_devices(value: str) -> int | None:
    """``--nproc-per-node`` where it can be told without asking torch for devices (a number or
    ``cpu``); None for ``gpu``/``cuda``/``auto``, which need torch's device count."""
    value = value.strip().lower()
    if value.isdecimal():
        return int(value)
    if value == "cpu":
        return os.cpu_count() or 1
    return None


def parse_endpoint(value: str, default_port: int = DEFAULT_RDZV_PORT) -> tuple[str, int]:
    """Parse ``host[:port]`` (IPv6 as ``[addr]:port``) into ``(host, port)``."""
    match = re.fullmatch(r"\[(?P<v6>[^\]]+)\](?::(?P<p6>\d+))?|(?P<host>[^:\[\]]+)(?::(?P<port>\d+))?", value.strip())
    if not match:
        raise ConfigError(
            f"--rdzv-endpoint '{value}' is not host[:port]",
            hint="e.g. --rdzv-endpoint head-node:29400",
        )
    host = match.group("v6") or match.group("host")
    port_text = match.group("p6") or match.group("port")
    port = int(port_text) if port_text else default_port
    if not 0 <= port <= 65535:
        raise ConfigError(f"--rdzv-endpoint port ({port}) must be in 0..65535")
    return host, port


def parse_endpoints(value: str, default_port: int = DEFAULT_ETCD_PORT) -> list[tuple[str, int]]:
    """Parse ``host[:port][,host[:port]...]``: the members of an etcd cluster, tried in order.

    Raises:
        ConfigError: the list is empty, or an entry is not ``host[:port]``.
    """
    entries = [part.strip() for part in value.split(",") if part.strip()]
    if not entries:
        raise ConfigError(f"--rdzv-endpoint '{value}' names no host", hint="e.g. --rdzv-endpoint etcd1:2379,etcd2:2379")
    return [parse_endpoint(entry, default_port) for entry in entries]


def parse_std_map(value: str, flag: str) -> dict[int, Std] | Std:
    """Parse torchrun's ``0..3`` or ``local_rank:0..3,...`` stream selection."""
    value = value.strip() or "0"
    try:
        if ":" not in value:
            return Std(int(value))
        result: dict[int, Std] = {}
        for item in value.split(","):
            rank, _, std = item.partition(":")
            result[int(rank)] = Std(int(std))
        return result
    except ValueError:
        raise ConfigError(
            f"{flag} '{value}' is not 0-3 or a list like 0:1,1:3",
            hint="0 none, 1 stdout, 2 stderr, 3 both",
        ) from None


def resolve_std(spec: dict[int, Std] | Std, local_rank: int) -> Std:
    """The stream selection of one local rank."""
    return spec.get(local_rank, Std.NONE) if isinstance(spec, dict) else spec
