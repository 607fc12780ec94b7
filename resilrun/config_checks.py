"""What a launch configuration may be: every check of a ``Config``, naming the first bad value.

Why apart from ``config``: that module says what the options are (fields, defaults, flags, help);
this one what combinations of values are allowed, each with the hint a user needs. Nothing here
reads the environment, touches the network or spawns anything (a script's existence is checked on
disk), so every usage error is reported before a socket or a process exists.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from resilrun.env import SNAPSHOT_AUTO
from resilrun.errors import ConfigError

if TYPE_CHECKING:
    from resilrun.config import Config


def check(config: Config) -> None:
    """Check every value; raise :class:`ConfigError` naming the first bad one.

    Raises:
        ConfigError: a value is invalid, the script is missing, or flags conflict.
    """
    min_nodes, max_nodes = config.node_range
    if config.rdzv_backend not in ("c10d", "static", "etcd"):
        raise ConfigError(
            f"--rdzv-backend '{config.rdzv_backend}' is unknown", hint="use c10d (default), static or etcd"
        )
    if config.rdzv_backend == "etcd":
        _etcd(config)
    if config.standalone and max_nodes != 1:
        raise ConfigError(f"--standalone runs one node, but --nnodes is '{config.nnodes}'")
    config.rdzv  # noqa: B018 - parses and validates
    if max_nodes > 1 and not config.rdzv_endpoint and config.rdzv_backend != "static":
        raise ConfigError(
            f"--nnodes {config.nnodes} needs --rdzv-endpoint HOST:PORT",
            hint="every node must point at the same endpoint; or use --standalone for one node",
        )
    host, port = config.endpoint
    if port == 0 and max_nodes > 1:
        raise ConfigError(
            f"--rdzv-endpoint '{config.rdzv_endpoint}' has port 0, which other nodes cannot find",
            hint="give a fixed port for a multi-node job, e.g. --rdzv-endpoint head:29400",
        )
    if config.node_rank is not None and not 0 <= config.node_rank < max_nodes:
        raise ConfigError(f"--node-rank ({config.node_rank}) must be in 0..{max_nodes - 1}")
    if config.node_rank is not None and min_nodes != max_nodes:
        raise ConfigError(
            f"--node-rank needs a fixed --nnodes, not '{config.nnodes}'",
            hint="an elastic job assigns node ranks itself; drop --node-rank",
        )
    if config.rdzv_backend == "static" and config.node_rank is None:
        raise ConfigError("--rdzv-backend static needs --node-rank", hint="give each node its rank")
    if config.rdzv_backend == "static" and min_nodes != max_nodes:
        raise ConfigError(f"--rdzv-backend static needs a fixed --nnodes, not '{config.nnodes}'")
    _processes(config)
    _checkpoints(config)
    _script(config)


def _etcd(config: Config) -> None:
    if not config.rdzv_endpoint:
        raise ConfigError(
            "--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...]",
            hint="name the client URLs of your etcd cluster, e.g. --rdzv-endpoint etcd1:2379,etcd2:2379",
        )
    for host, port in config.endpoints:
        if port == 0:
            raise ConfigError(f"--rdzv-endpoint '{config.rdzv_endpoint}': etcd member {host} has port 0")
    if config.rdzv.is_host is not None:
        raise ConfigError(
            "--rdzv-conf is_host applies to the c10d backend only",
            hint="with --rdzv-backend etcd no node hosts the rendezvous; drop is_host",
        )


def _processes(config: Config) -> None:
    nproc = config.nproc_per_node.strip().lower()
    if nproc not in ("auto", "cpu", "gpu", "cuda") and not (nproc.isdecimal() and int(nproc) > 0):
        raise ConfigError(f"--nproc-per-node '{config.nproc_per_node}' is not a positive number, auto, cpu or gpu")
    if config.max_restarts < 0:
        raise ConfigError(f"--max-restarts ({config.max_restarts}) must be >= 0")
    if not config.monitor_interval_s > 0:
        raise ConfigError(f"--monitor-interval ({config.monitor_interval_s}) must be > 0")
    if not config.shutdown_timeout_s >= 0:
        raise ConfigError(f"--shutdown-timeout ({config.shutdown_timeout_s}) must be >= 0")
    if not config.exit_barrier_timeout_s > 0:
        raise ConfigError(f"--exit-barrier-timeout ({config.exit_barrier_timeout_s}) must be > 0")
    if not config.hang_timeout_s > 0:
        raise ConfigError(f"--hang-timeout ({config.hang_timeout_s}) must be > 0")
    if not config.first_step_timeout_s > 0:
        raise ConfigError(f"--first-step-timeout ({config.first_step_timeout_s}) must be > 0")
    if config.spares < 0:
        raise ConfigError(f"--spares ({config.spares}) must be >= 0")
    if config.rerun_in_process and config.spares < 1:
        raise ConfigError(
            "--rerun-in-process needs --spares 1 or more",
            hint="the failed rank is taken by a hot spare while the survivors re-run the script; add --spares 1",
        )
    if not config.heartbeat_interval_s > 0:
        raise ConfigError(f"--heartbeat-interval ({config.heartbeat_interval_s}) must be > 0")
    if not config.heartbeat_timeout_s > config.heartbeat_interval_s:
        raise ConfigError(
            f"--heartbeat-timeout ({config.heartbeat_timeout_s}) must be > --heartbeat-interval "
            f"({config.heartbeat_interval_s})",
            hint="a timeout of 3 to 5 intervals tolerates a slow store without false alarms",
        )
    if not 0 <= config.master_port <= 65535:
        raise ConfigError(f"--master-port ({config.master_port}) must be in 0..65535")
    if config.metrics_port is not None and not 0 <= config.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port ({config.metrics_port}) must be in 0..65535")
    if not config.metrics_addr.strip():
        raise ConfigError("--metrics-addr is empty", hint="e.g. --metrics-addr 127.0.0.1")
    if config.start_method not in ("spawn", "fork", "forkserver"):
        raise ConfigError(f"--start-method '{config.start_method}' is not spawn, fork or forkserver")
    config.redirects_spec  # noqa: B018 - parses and validates
    config.tee_spec  # noqa: B018
    config.ranks_filter  # noqa: B018


def _checkpoints(config: Config) -> None:
    if config.snapshot_every < 1 and config.snapshot_every != SNAPSHOT_AUTO:
        raise ConfigError(
            f"--snapshot-every ({config.snapshot_every}) must be >= 1 or auto",
            hint="1 snapshots every step; N snapshots every N-th and a failure redoes at most N-1 steps",
        )
    if not 0.1 <= config.max_overhead_pct <= 50:
        raise ConfigError(
            f"--max-overhead ({config.max_overhead_pct:g}) must be between 0.1 and 50 (percent of step time)",
            hint="the default 3 keeps snapshots under 3% of training time",
        )
    if config.replicate_every < 1 and config.replicate_every != SNAPSHOT_AUTO:
        raise ConfigError(f"--replicate-every ({config.replicate_every}) must be >= 1 or auto")
    if config.replicate_every == SNAPSHOT_AUTO and config.snapshot_every != SNAPSHOT_AUTO:
        raise ConfigError(
            "--replicate-every auto needs --snapshot-every auto",
            hint="the replica interval is chosen with the snapshot interval, from the same measurements; "
            "with a fixed --snapshot-every give --replicate-every N",
        )
    if config.replicas < 0:
        raise ConfigError(f"--replicas ({config.replicas}) must be >= 0")
    if config.persist_every < 1:
        raise ConfigError(f"--persist-every ({config.persist_every}) must be >= 1")
    if config.keep_last < 1:
        raise ConfigError(f"--keep-last ({config.keep_last}) must be >= 1")
    if config.checkpoint_uri is not None:
        if not config.checkpoint_uri.strip():
            raise ConfigError("--checkpoint-uri is empty", hint="give s3://bucket/prefix or a directory")
        if config.checkpoint_uri.startswith("s3://"):
            from resilrun.storage import parse_s3_uri

            parse_s3_uri(config.checkpoint_uri)
    elif config.s3_endpoint_url or config.s3_expected_owner:
        raise ConfigError("--s3-endpoint-url and --s3-expected-owner need --checkpoint-uri s3://...")
    if config.capture_dir is not None and not config.capture_dir.strip():
        raise ConfigError("--capture-dir is empty", hint="give the folder the script writes its checkpoints to")
    if not config.capture_pattern.strip():
        raise ConfigError("--capture-pattern is empty", hint="give a glob such as 'snapshot.pt' or '*' (every file)")


def _script(config: Config) -> None:
    if not config.script:
        raise ConfigError("no training script given", hint="usage: resilrun [OPTIONS] SCRIPT [ARGS...]")
    if config.module and config.no_python:
        raise ConfigError("--module and --no-python cannot be combined")
    if config.spares and config.no_python:
        raise ConfigError(
            "--spares cannot be combined with --no-python",
            hint="hot spares wait in resilrun's Python worker bootstrap; run the script with python "
            "(drop --no-python) or use --spares 0",
        )
    if config.module:
        return
    if config.no_python:
        if shutil.which(config.script) is None and not os.path.isfile(config.script):
            raise ConfigError(f"program '{config.script}' was not found", hint="check the path or PATH")
        return
    if not os.path.isfile(config.script):
        raise ConfigError(
            f"training script '{config.script}' does not exist",
            hint="give a path to a .py file, or use -m for a module",
        )
