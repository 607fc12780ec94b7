"""``resilrun [run] [OPTIONS] SCRIPT [ARGS...]``: launch and supervise this node's workers."""

from __future__ import annotations

from typing import Annotated

import typer

from resilrun.cli import _options as o
from resilrun.env import SNAPSHOT_AUTO
from resilrun.errors import ConfigError

CONTEXT = {
    "allow_extra_args": True,
    "ignore_unknown_options": True,
    "allow_interspersed_args": False,
    "help_option_names": ["-h", "--help"],
}


def _int(flag: str, value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag} '{value}' is not an integer") from None


def _every(flag: str, value: str) -> int:
    """``N`` or ``auto`` (SNAPSHOT_AUTO)."""
    if value.strip().lower() == "auto":
        return SNAPSHOT_AUTO
    number = _int(flag, value)
    if number is None or number < 1:
        raise ConfigError(f"{flag} '{value}' is not a positive integer or auto", hint=f"e.g. {flag} 10 or {flag} auto")
    return number


def _percent(flag: str, value: str) -> float:
    try:
        return float(value.strip().removesuffix("%"))
    except ValueError:
        raise ConfigError(f"{flag} '{value}' is not a percentage", hint=f"e.g. {flag} 3") from None


def _float(flag: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{flag} '{value}' is not a number of seconds") from None


def run(
    script: Annotated[
        str, typer.Argument(metavar="SCRIPT", help="Training script (or module with -m, program with --no-python).")
    ],
    script_args: Annotated[
        list[str] | None, typer.Argument(metavar="ARGS", help="Arguments passed to the script untouched.")
    ] = None,
    nnodes: o.Nnodes = "1:1",
    nproc_per_node: o.NprocPerNode = "1",
    node_rank: o.NodeRank = None,
    rdzv_backend: o.RdzvBackend = "c10d",
    rdzv_endpoint: o.RdzvEndpoint = "",
    rdzv_id: o.RdzvId = "none",
    rdzv_conf: o.RdzvConf = "",
    standalone: o.Standalone = False,
    master_addr: o.MasterAddr = "127.0.0.1",
    master_port: o.MasterPort = "29500",
    local_addr: o.LocalAddr = None,
    max_restarts: o.MaxRestarts = "0",
    monitor_interval: o.MonitorInterval = "0.1",
    module: o.Module = False,
    no_python: o.NoPython = False,
    role: o.Role = "default",
    start_method: o.StartMethod = "spawn",
    log_dir: o.LogDir = None,
    redirects: o.Redirects = "0",
    tee: o.Tee = "0",
    local_ranks_filter: o.LocalRanksFilter = "",
    shutdown_timeout: o.ShutdownTimeout = "30",
    exit_barrier_timeout: o.ExitBarrierTimeout = "300",
    spares: o.Spares = "0",
    hang_timeout: o.HangTimeout = "300",
    first_step_timeout: o.FirstStepTimeout = "1800",
    heartbeat_interval: o.HeartbeatInterval = "1",
    heartbeat_timeout: o.HeartbeatTimeout = "5",
    snapshot_every: o.SnapshotEvery = "1",
    max_overhead: o.MaxOverhead = "3",
    replicas: o.Replicas = "1",
    replicate_every: o.ReplicateEvery = "1",
    checkpoint_uri: o.CheckpointUri = None,
    persist_every: o.PersistEvery = "100",
    keep_last: o.KeepLast = "3",
    no_snapshot_dedup: o.NoSnapshotDedup = False,
    no_integrations: o.NoIntegrations = False,
    s3_endpoint_url: o.S3EndpointUrl = None,
    s3_expected_owner: o.S3ExpectedOwner = None,
    metrics_port: o.MetricsPort = None,
    metrics_addr: o.MetricsAddr = "127.0.0.1",
    job_secret_file: o.JobSecretFile = None,
    require_auth: o.RequireAuth = False,
    peer_encryption: o.PeerEncryption = False,
) -> None:
    """Launch SCRIPT on this node's workers and supervise them (torchrun's flags and semantics)."""
    from resilrun.config import Config

    if script.startswith("-") and not no_python:
        raise ConfigError(f"unknown option '{script}'", hint="run 'resilrun run --help' for the options")
    config = Config.from_cli(
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        node_rank=_int("--node-rank", node_rank),
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        rdzv_conf=rdzv_conf,
        standalone=standalone,
        master_addr=master_addr,
        master_port=_int("--master-port", master_port),
        local_addr=local_addr,
        max_restarts=_int("--max-restarts", max_restarts),
        monitor_interval_s=_float("--monitor-interval", monitor_interval),
        module=module,
        no_python=no_python,
        role=role,
        start_method=start_method,
        log_dir=log_dir,
        redirects=redirects,
        tee=tee,
        local_ranks_filter=local_ranks_filter,
        shutdown_timeout_s=_float("--shutdown-timeout", shutdown_timeout),
        exit_barrier_timeout_s=_float("--exit-barrier-timeout", exit_barrier_timeout),
        spares=_int("--spares", spares),
        hang_timeout_s=_float("--hang-timeout", hang_timeout),
        first_step_timeout_s=_float("--first-step-timeout", first_step_timeout),
        heartbeat_interval_s=_float("--heartbeat-interval", heartbeat_interval),
        heartbeat_timeout_s=_float("--heartbeat-timeout", heartbeat_timeout),
        snapshot_every=_every("--snapshot-every", snapshot_every),
        max_overhead_pct=_percent("--max-overhead", max_overhead),
        replicas=_int("--replicas", replicas),
        replicate_every=_every("--replicate-every", replicate_every),
        checkpoint_uri=checkpoint_uri,
        persist_every=_int("--persist-every", persist_every),
        keep_last=_int("--keep-last", keep_last),
        no_snapshot_dedup=no_snapshot_dedup,
        no_integrations=no_integrations,
        s3_endpoint_url=s3_endpoint_url,
        s3_expected_owner=s3_expected_owner,
        metrics_port=_int("--metrics-port", metrics_port),
        metrics_addr=metrics_addr,
        job_secret_file=job_secret_file,
        require_auth=require_auth,
        peer_encryption=peer_encryption,
        script=script,
        script_args=tuple(script_args or ()),
    )
    from resilrun import agent

    agent.run(config)
