"""The launch configuration: one frozen dataclass, its flags, environment names and defaults.

Each field that is a ``run`` option declares its flag, environment names, help and panel with
``options.option_meta``; how command-line text becomes the field's value lives there too, so this
module holds what a value may be and that module how it is spelled; ``config_checks`` holds which
values and combinations are allowed.

Invariants: a ``Config`` that exists has been validated (``from_cli`` is the only way the CLI makes
one); nothing here reads the environment, touches the network or spawns anything, so every usage
error is reported before a socket or a process exists. Seconds are floats with an ``_s`` suffix
here and ``timedelta`` everywhere else.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from resilrun.config_checks import check
from resilrun.errors import ConfigError
from resilrun.option_values import (
    RdzvConf,
    Std,
    parse_endpoint,
    parse_endpoints,
    parse_nnodes,
    parse_rdzv_conf,
    parse_std_map,
)
from resilrun.options import one_of, option_meta, parse_count, parse_every, parse_percent

R, P, H, C, OBS, SEC = "Rendezvous", "Processes", "Health", "Checkpoints", "Observability", "Security"


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Everything one node's agent needs to launch and supervise its share of the job."""

    # Rendezvous
    nnodes: str = field(
        default="1:1", metadata=option_meta("--nnodes", R, "Number of nodes: N or MIN:MAX.", value="N|MIN:MAX")
    )
    nproc_per_node: str = field(
        default="1",
        metadata=option_meta("--nproc-per-node", P, "Workers per node: N, auto, cpu or gpu.", value="N|auto|cpu|gpu"),
    )
    node_rank: int | None = field(
        default=None,
        metadata=option_meta(
            "--node-rank", R, "This node's rank (default: assigned at rendezvous).", show_envvar=True, value="INTEGER"
        ),
    )
    rdzv_backend: str = field(
        default="c10d", metadata=option_meta("--rdzv-backend", R, "c10d, etcd or static.", value="c10d|etcd|static")
    )
    rdzv_endpoint: str = field(
        default="",
        metadata=option_meta(
            "--rdzv-endpoint", R, "Rendezvous host[:port]; etcd: host:2379[,host:2379...].", value="HOST[:PORT][,...]"
        ),
    )
    rdzv_id: str = field(
        default="none", metadata=option_meta("--rdzv-id", R, "Job id shared by all nodes.", value="TEXT")
    )
    rdzv_conf: str = field(
        default="", metadata=option_meta("--rdzv-conf", R, "Extra rendezvous settings k=v,...", value="KEY=VALUE,...")
    )
    standalone: bool = field(
        default=False, metadata=option_meta("--standalone", R, "One node, embedded store on a free port.")
    )
    master_addr: str = field(
        default="127.0.0.1",
        metadata=option_meta("--master-addr", R, "Store host for --rdzv-backend static.", value="HOST"),
    )
    master_port: int = field(
        default=29500, metadata=option_meta("--master-port", R, "Store port for --rdzv-backend static.", value="PORT")
    )
    local_addr: str | None = field(
        default=None,
        metadata=option_meta(
            "--local-addr",
            R,
            "Address this node advertises (default: the FQDN; where it means loopback in a multi-host job, "
            "the address that routes to the endpoint).",
            value="HOST",
        ),
    )
    # Processes
    max_restarts: int = field(
        default=0, metadata=option_meta("--max-restarts", P, "Whole-job restarts before giving up.", value="INTEGER")
    )
    monitor_interval_s: float = field(
        default=0.1, metadata=option_meta("--monitor-interval", P, "Seconds between worker polls.", value="SECONDS")
    )
    module: bool = field(
        default=False, metadata=option_meta("--module", P, "Run SCRIPT as a module (python -m).", short=("-m",))
    )
    no_python: bool = field(
        default=False, metadata=option_meta("--no-python", P, "Execute SCRIPT directly, not with python.")
    )
    role: str = field(
        default="default", metadata=option_meta("--role", P, "Role name of the workers (ROLE_NAME).", value="TEXT")
    )
    start_method: str = field(
        default="spawn",
        metadata=option_meta(
            "--start-method", P, "Accepted for torchrun compatibility.", value="spawn|fork|forkserver"
        ),
    )
    log_dir: str | None = field(
        default=None, metadata=option_meta("--log-dir", P, "Base directory of per-rank logs.", value="DIR")
    )
    redirects: str = field(
        default="0",
        metadata=option_meta(
            "--redirects", P, "Streams to files only: 0-3 or 0:1,1:3.", short=("-r",), value="0-3|RANK:0-3,..."
        ),
    )
    tee: str = field(
        default="0",
        metadata=option_meta(
            "--tee", P, "Streams to files and console: 0-3 or 0:1,1:3.", short=("-t",), value="0-3|RANK:0-3,..."
        ),
    )
    local_ranks_filter: str = field(
        default="",
        metadata=option_meta("--local-ranks-filter", P, "Local ranks shown on the console, e.g. 0,1.", value="RANKS"),
    )
    spares: int = field(
        default=0,
        metadata=option_meta(
            "--spares", H, "Hot spare worker processes per node (in-process recovery).", pet=False, value="INTEGER"
        ),
    )
    # Opt-in: it runs a plain script's module code twice in one process, which most scripts tolerate
    # and some cannot (docs/captured-checkpoints.md says which); anything detected falls back to a restart.
    rerun_in_process: bool = field(
        default=False,
        metadata=option_meta(
            "--rerun-in-process",
            H,
            "Plain torchrun scripts: on a failure, survivors re-run the script in their own processes "
            "and a hot spare takes the failed rank (needs --spares).",
            pet=False,
        ),
    )
    heartbeat_interval_s: float = field(
        default=1.0,
        metadata=option_meta(
            "--heartbeat-interval", H, "Seconds between agent heartbeats.", pet=False, value="SECONDS"
        ),
    )
    # A few seconds, not minutes: a lost node costs the whole job this long before it reacts.
    heartbeat_timeout_s: float = field(
        default=5.0,
        metadata=option_meta(
            "--heartbeat-timeout", H, "Seconds without heartbeat before a node is lost.", pet=False, value="SECONDS"
        ),
    )
    # Minutes, not seconds: a long evaluation or a slow first compile is not a hang.
    hang_timeout_s: float = field(
        default=300.0,
        metadata=option_meta(
            "--hang-timeout", H, "Seconds without a committed step before a hang.", pet=False, value="SECONDS"
        ),
    )
    # Separate from --hang-timeout: imports, compilation and a restore make the first step of a
    # worker (and of every recovered generation) far slower than the steady state.
    first_step_timeout_s: float = field(
        default=1800.0,
        metadata=option_meta(
            "--first-step-timeout",
            H,
            "Seconds a worker may take to its first committed step.",
            pet=False,
            value="SECONDS",
        ),
    )
    shutdown_timeout_s: float = field(
        default=30.0,
        metadata=option_meta("--shutdown-timeout", H, "Seconds from SIGTERM to SIGKILL of workers.", value="SECONDS"),
    )
    # 300 s as torchrun's exit_barrier_timeout: nodes finish minutes apart when the last ones save.
    exit_barrier_timeout_s: float = field(
        default=300.0,
        metadata=option_meta(
            "--exit-barrier-timeout",
            H,
            "Seconds finished nodes wait for the others' workers.",
            pet=False,
            value="SECONDS",
        ),
    )
    # Report by default: a swap replaces a process that still works, which a job opts into; off
    # for jobs whose ranks do unequal work by design (pipeline stages, a rank that also evaluates).
    stragglers: str = field(
        default="report",
        metadata=option_meta(
            "--stragglers",
            H,
            "A rank persistently slower than the others: report it, swap it for a hot spare at a step "
            "boundary (swap), or neither (off).",
            pet=False,
            parse=one_of("report", "swap", "off"),
            value="report|swap|off",
        ),
    )
    # A budget, because a swap costs the job a recovery (about a second) and a spare: a machine
    # whose ranks all turn slow by turns (heat, a shared link) must not spend them all.
    straggler_swaps: int = field(
        default=2,
        metadata=option_meta(
            "--straggler-swaps",
            H,
            "With --stragglers swap: at most this many swaps in any hour, job-wide.",
            pet=False,
            parse=parse_count,
            value="INTEGER",
        ),
    )
    # Checkpoints (resilrun's own: RESILRUN_* only)
    # Every step by default: a failure then redoes none. Larger N divides the steady-state cost of
    # the snapshot (and its replication) by N; a failure redoes up to N - 1 steps. SNAPSHOT_AUTO (0,
    # "auto" on the command line): the interval is measured to keep the cost under --max-overhead.
    snapshot_every: int = field(
        default=1,
        metadata=option_meta(
            "--snapshot-every",
            C,
            "Snapshot every N optimizer steps (a failure redoes at most N-1), or auto: as often as "
            "--max-overhead allows.",
            pet=False,
            parse=parse_every,
            value="N|auto",
        ),
    )
    max_overhead_pct: float = field(
        default=3.0,
        metadata=option_meta(
            "--max-overhead",
            C,
            "With --snapshot-every auto: the share of step time snapshots may take, %.",
            pet=False,
            parse=parse_percent,
            value="PERCENT",
        ),
    )
    replicas: int = field(
        default=1,
        metadata=option_meta(
            "--replicas", C, "Peer nodes holding a copy of each snapshot.", pet=False, value="INTEGER"
        ),
    )
    # Every snapshot by default. Replication traffic shares the memory bus with training; a node
    # loss redoes the steps since the newest replicated snapshot, a worker failure only those since
    # the newest snapshot in node memory.
    replicate_every: int = field(
        default=1,
        metadata=option_meta(
            "--replicate-every",
            C,
            "Replicate a snapshot to peers every N steps, or auto (with --snapshot-every auto): every "
            "k-th snapshot, k chosen with the interval under --max-overhead.",
            pet=False,
            parse=parse_every,
            value="N|auto",
        ),
    )
    checkpoint_uri: str | None = field(
        default=None,
        metadata=option_meta(
            "--checkpoint-uri",
            C,
            "Persistent tier: s3://bucket/prefix or a directory.",
            pet=False,
            value="s3://BUCKET/PREFIX|DIR",
        ),
    )
    # Issue 45: an unmodified script's own checkpoints (torch.save, DCP, ...) kept in node memory, on
    # peers and in storage, and put back before its workers start (agent/state/captured.py).
    capture_dir: str | None = field(
        default=None,
        metadata=option_meta(
            "--capture-dir",
            C,
            "Folder where the script writes its own checkpoints: files are kept on peers and in the "
            "persistent tier, and put back before workers start (e.g. on a host that replaces a lost one).",
            pet=False,
            value="DIR",
        ),
    )
    capture_pattern: str = field(
        default="*",
        metadata=option_meta(
            "--capture-pattern",
            C,
            "Only files of --capture-dir whose path (relative to it) matches this glob, e.g. 'snapshot.pt'.",
            pet=False,
            value="GLOB",
        ),
    )
    persist_every: int = field(
        default=100,
        metadata=option_meta("--persist-every", C, "Persist a snapshot every N steps.", pet=False, value="STEPS"),
    )
    keep_last: int = field(
        default=3,
        metadata=option_meta("--keep-last", C, "Complete persisted steps to keep.", pet=False, value="INTEGER"),
    )
    # Off only for scripts that make DDP's parameters differ between ranks behind its back.
    no_snapshot_dedup: bool = field(
        default=False,
        metadata=option_meta("--no-snapshot-dedup", C, "Each rank snapshots all DDP state (no sharing).", pet=False),
    )
    # Off leaves every framework as it is (docs/integrations.md): a failure then restarts its script.
    no_integrations: bool = field(
        default=False,
        metadata=option_meta(
            "--no-integrations",
            C,
            "Do not adapt frameworks (Hugging Face Trainer and Accelerate, Lightning) for recovery.",
            pet=False,
        ),
    )
    # Off only where forking from a process that imported torch is not wanted (docs/recovery.md, "the worker template").
    no_worker_template: bool = field(
        default=False,
        metadata=option_meta(
            "--no-worker-template",
            P,
            "Start each worker as a new process instead of forking it from the node's template.",
            pet=False,
        ),
    )
    # Off for a script that does what must not run twice before it reads its rank (docs/recovery.md).
    no_spare_head_start: bool = field(
        default=False,
        metadata=option_meta(
            "--no-spare-head-start",
            P,
            "Hot spares wait for a rank before the script's first line instead of running its set-up ahead.",
            pet=False,
        ),
    )
    s3_endpoint_url: str | None = field(
        default=None,
        metadata=option_meta("--s3-endpoint-url", C, "Endpoint of an S3-compatible store.", pet=False, value="URL"),
    )
    s3_expected_owner: str | None = field(
        default=None,
        metadata=option_meta(
            "--s3-expected-owner", C, "Account id that must own the bucket.", pet=False, value="ACCOUNT"
        ),
    )
    # Observability (resilrun's own). Off by default: an open port is a choice, not a side effect.
    metrics_port: int | None = field(
        default=None,
        metadata=option_meta(
            "--metrics-port", OBS, "Serve Prometheus metrics on this port (0: a free one).", pet=False, value="PORT"
        ),
    )
    # Loopback: the endpoint is unauthenticated and shows the job's shape and progress.
    metrics_addr: str = field(
        default="127.0.0.1",
        metadata=option_meta("--metrics-addr", OBS, "Address the metrics endpoint binds.", pet=False, value="HOST"),
    )
    # Security (resilrun's own). The secret itself never goes on a command line: a file, or the
    # environment (RESILRUN_JOB_SECRET, read by the agent; see job_secret.py).
    job_secret_file: str | None = field(
        default=None,
        metadata=option_meta(
            "--job-secret-file",
            SEC,
            "File (mode 0600) holding the job secret every node shares; it is then never kept in the store.",
            pet=False,
            value="PATH",
        ),
    )
    require_auth: bool = field(
        default=False,
        metadata=option_meta(
            "--require-auth",
            SEC,
            "Refuse to run without a secret from outside the store where one is needed (several nodes, "
            "or --checkpoint-uri), and refuse to restore unsigned persisted steps.",
            pet=False,
        ),
    )
    peer_encryption: bool = field(
        default=False,
        metadata=option_meta(
            "--peer-encryption",
            SEC,
            "Encrypt replica and fetch streams (AES-256-GCM) for untrusted networks; every node alike.",
            pet=False,
        ),
    )
    # What to run
    script: str = ""
    script_args: tuple[str, ...] = ()

    # -- derived, pure views ------------------------------------------------------------------
    @property
    def node_range(self) -> tuple[int, int]:
        return parse_nnodes(self.nnodes)

    @property
    def rdzv(self) -> RdzvConf:
        return parse_rdzv_conf(self.rdzv_conf)

    @property
    def endpoint(self) -> tuple[str, int]:
        """The c10d/static store's ``(host, port)``; for etcd, the first member (see ``endpoints``)."""
        if self.rdzv_backend == "static" and not self.rdzv_endpoint:
            return self.master_addr, self.master_port
        if self.rdzv_backend == "etcd":
            return self.endpoints[0]
        return parse_endpoint(self.rdzv_endpoint or "localhost:0")

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        """Every ``(host, port)`` of ``--rdzv-endpoint`` (etcd takes a comma-separated list)."""
        if self.rdzv_backend == "etcd":
            return parse_endpoints(self.rdzv_endpoint)
        return [self.endpoint]

    @property
    def monitor_interval(self) -> timedelta:
        return timedelta(seconds=self.monitor_interval_s)

    @property
    def shutdown_timeout(self) -> timedelta:
        return timedelta(seconds=self.shutdown_timeout_s)

    @property
    def redirects_spec(self) -> dict[int, Std] | Std:
        return parse_std_map(self.redirects, "--redirects")

    @property
    def tee_spec(self) -> dict[int, Std] | Std:
        return parse_std_map(self.tee, "--tee")

    @property
    def ranks_filter(self) -> frozenset[int] | None:
        text = self.local_ranks_filter.strip()
        if not text:
            return None
        try:
            return frozenset(int(part) for part in text.split(","))
        except ValueError:
            raise ConfigError(
                f"--local-ranks-filter '{text}' is not a list of local ranks", hint="e.g. 0 or 0,1"
            ) from None

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_cli(cls, **values: Any) -> Config:
        """Build and validate a Config from parsed CLI values (strings already typed by the CLI).

        ``--standalone`` forces an embedded store on a free loopback port and a fresh run id, as
        torchrun does.
        """
        nullable = (
            "node_rank",
            "log_dir",
            "local_addr",
            "checkpoint_uri",
            "capture_dir",
            "s3_endpoint_url",
            "s3_expected_owner",
            "metrics_port",
            "job_secret_file",
        )
        values = {k: v for k, v in values.items() if v is not None or k in nullable}
        values["rdzv_backend"] = (values.get("rdzv_backend") or "c10d").lower()
        if values.get("standalone"):
            values.update(rdzv_backend="c10d", rdzv_endpoint="localhost:0", rdzv_id=str(uuid.uuid4()))
        if values.get("script_args") is not None:
            values["script_args"] = tuple(values["script_args"])
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Check every value (``config_checks``); raise :class:`ConfigError` naming the first bad one.

        Raises:
            ConfigError: a value is invalid, the script is missing, or flags conflict.
        """
        check(self)

    def with_changes(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


CONFIG_FIELDS: tuple[dataclasses.Field[Any], ...] = tuple(f for f in dataclasses.fields(Config) if "flag" in f.metadata)
