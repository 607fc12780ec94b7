"""typer option aliases, one per Config field, built from the field's metadata.

Flag names, environment spellings (``RESILRUN_*`` then torchrun's ``PET_*``), help text and panels
come from ``resilrun.config``; a test checks that the ``run`` command and ``Config`` stay one-to-one.
Numbers are taken as text and converted by ``Config`` so that a bad value gets our one-line error.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from resilrun.config import CONFIG_FIELDS

_FIELDS = {f.name: f for f in CONFIG_FIELDS}


def _decls(flag: str) -> list[str]:
    decls = [flag]
    if "-" in flag[2:]:
        decls.append("--" + flag[2:].replace("-", "_"))
    return decls


def option(name: str, *short: str, **kwargs: Any) -> Any:
    meta = _FIELDS[name].metadata
    return typer.Option(
        *_decls(meta["flag"]),
        *short,
        envvar=list(meta["env"]),
        help=meta["help"],
        rich_help_panel=meta["panel"],
        metavar=meta["value"] or "",  # a flag takes no value: show none (typer would say <bool>)
        show_default=True,
        **kwargs,
    )


Nnodes = Annotated[str, option("nnodes")]
NprocPerNode = Annotated[str, option("nproc_per_node")]
NodeRank = Annotated[str | None, option("node_rank", show_envvar=True)]
RdzvBackend = Annotated[str, option("rdzv_backend")]
RdzvEndpoint = Annotated[str, option("rdzv_endpoint")]
RdzvId = Annotated[str, option("rdzv_id")]
RdzvConf = Annotated[str, option("rdzv_conf")]
Standalone = Annotated[bool, option("standalone")]
MasterAddr = Annotated[str, option("master_addr")]
MasterPort = Annotated[str, option("master_port")]
LocalAddr = Annotated[str | None, option("local_addr")]
MaxRestarts = Annotated[str, option("max_restarts")]
MonitorInterval = Annotated[str, option("monitor_interval_s")]
Module = Annotated[bool, option("module", "-m")]
NoPython = Annotated[bool, option("no_python")]
Role = Annotated[str, option("role")]
StartMethod = Annotated[str, option("start_method")]
LogDir = Annotated[str | None, option("log_dir")]
Redirects = Annotated[str, option("redirects", "-r")]
Tee = Annotated[str, option("tee", "-t")]
LocalRanksFilter = Annotated[str, option("local_ranks_filter")]
ShutdownTimeout = Annotated[str, option("shutdown_timeout_s")]
ExitBarrierTimeout = Annotated[str, option("exit_barrier_timeout_s")]
Spares = Annotated[str, option("spares")]
HangTimeout = Annotated[str, option("hang_timeout_s")]
FirstStepTimeout = Annotated[str, option("first_step_timeout_s")]
HeartbeatInterval = Annotated[str, option("heartbeat_interval_s")]
HeartbeatTimeout = Annotated[str, option("heartbeat_timeout_s")]
SnapshotEvery = Annotated[str, option("snapshot_every")]
MaxOverhead = Annotated[str, option("max_overhead_pct")]
Replicas = Annotated[str, option("replicas")]
ReplicateEvery = Annotated[str, option("replicate_every")]
CheckpointUri = Annotated[str | None, option("checkpoint_uri")]
PersistEvery = Annotated[str, option("persist_every")]
KeepLast = Annotated[str, option("keep_last")]
NoSnapshotDedup = Annotated[bool, option("no_snapshot_dedup")]
NoIntegrations = Annotated[bool, option("no_integrations")]
S3EndpointUrl = Annotated[str | None, option("s3_endpoint_url")]
S3ExpectedOwner = Annotated[str | None, option("s3_expected_owner")]
MetricsPort = Annotated[str | None, option("metrics_port")]
MetricsAddr = Annotated[str, option("metrics_addr")]
JobSecretFile = Annotated[str | None, option("job_secret_file")]
RequireAuth = Annotated[bool, option("require_auth")]
PeerEncryption = Annotated[bool, option("peer_encryption")]
