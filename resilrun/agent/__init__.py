"""The agent: the composition root of one node (store, rendezvous, supervision).

``run(config)`` resolves the node's facts (worker count, advertised address, log directory), opens
the rendezvous store (c10d: hosting it when this node owns the endpoint; etcd: an external cluster),
runs the supervisor, and, when it hosts the store, stays until every other node has seen the job end.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resilrun import keys
from resilrun.agent.addressing import choose_address, worker_network_env
from resilrun.agent.liveness.fence import WriteFence
from resilrun.agent.liveness.heartbeat import HeartbeatSender
from resilrun.agent.observability.events import EVENTS_FILE, EventLog
from resilrun.agent.observability.telemetry import AgentTelemetry
from resilrun.agent.state.channel import AgentChannel, channel_env
from resilrun.agent.state.persister import Persister
from resilrun.agent.state.replication import PeerTier, job_secret
from resilrun.agent.state.tiers import NodeTiers
from resilrun.agent.status import StatusPublisher
from resilrun.agent.supervision.node_loss import PeerLiveness
from resilrun.agent.supervision.supervisor import SignalFlag, Supervisor
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.fault_hooks import PERSIST_DELAY_ENV, delay_s
from resilrun.agent.workers.procs import HANDLED_SIGNALS
from resilrun.agent.workers.specs import NodeSetup
from resilrun.config import Config
from resilrun.env import agent_environ
from resilrun.errors import (
    ConfigError,
    RendezvousClosedError,
    ResilrunError,
    ShutdownRequested,
    WorkerGroupFailed,
)
from resilrun.job_secret import SECRET_ENV, external_secret, random_secret
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.factory import open_backend
from resilrun.rendezvous.protocol import NodeInfo
from resilrun.rendezvous.sealed import SealedBackend, store_key
from resilrun.storage.api import Storage
from resilrun.tiers.authentic import durable_key
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer.wire import PeerKey
from resilrun.tiers.slots import REPLICATED_SLOTS, SLOTS

if TYPE_CHECKING:
    from resilrun.agent.observability.metrics import AgentMetrics

__all__ = ["resolve_nproc", "run"]

logger = logging.getLogger(__name__)

# On a store that cannot push (c10d), agents poll a tiny version counter every monitor tick and re-read
# the O(nodes) rendezvous document only when it moved, or after this long (the net under a writer that
# died mid-update); on etcd the document itself is pushed to each agent by watch, and neither the poll
# nor this re-read happens. See rendezvous/executor.py and docs/benchmarks.md ("Control plane at scale").
_STATE_REFRESH_S = 10.0


def resolve_nproc(value: str) -> int:
    """torchrun's ``--nproc-per-node``: a number, ``cpu``, ``gpu`` or ``auto``."""
    value = value.strip().lower()
    if value.isdecimal():
        return int(value)
    if value == "cpu":
        return os.cpu_count() or 1
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if value in ("gpu", "cuda"):
        if gpus == 0:
            raise ConfigError("--nproc-per-node gpu, but no CUDA device is visible", hint="use a number or cpu")
        return gpus
    return gpus or os.cpu_count() or 1


def _job_secret(config: Config, max_nodes: int) -> bytes | None:
    """The job secret from outside the store, a random one for a job of one node, or None: the
    first agent then keeps one in the store (what that leaves open is said where it is made).

    ``--require-auth`` with a persistent tier needs a secret from outside even on one node: a
    random one cannot sign what later jobs must check, and an unsigned bucket is what a party
    with write access to it plants a step in."""
    secret = external_secret(config.job_secret_file, os.environ)
    if secret is None and config.require_auth and config.checkpoint_uri:
        raise ConfigError(
            "--require-auth with --checkpoint-uri: no job secret given, so persisted steps could be "
            "neither signed nor checked",
            hint=f"give the job a --job-secret-file (mode 0600) or {SECRET_ENV}, the same for every job that "
            "reads these steps",
        )
    if secret is None and max_nodes == 1:
        return random_secret()
    if secret is None and config.require_auth:
        raise ConfigError(
            "--require-auth: no job secret given, and a multi-node job would keep it in the rendezvous store",
            hint=f"give every node the same --job-secret-file (mode 0600) or {SECRET_ENV}",
        )
    return secret


# What the first agent seals at keys.secret_check (any constant: only its MAC matters).
_SECRET_CHECK = b"resilrun job secret check"


def _forged_document(key: str) -> None:
    logger.warning(
        "refused a document in the rendezvous store that does not carry this job's MAC (%s): written by "
        "someone without the job secret, or by a job with another secret under the same --rdzv-id; "
        "read as absent",
        key,
    )


def run(config: Config) -> None:
    """Run this node's part of the job; returns on success.

    Raises:
        ResilrunError: the job failed (the subclass says how); ShutdownRequested on a signal.
    """
    nproc = resolve_nproc(config.nproc_per_node)
    min_nodes, max_nodes = config.node_range
    rdzv_conf = config.rdzv
    outside = external_secret(config.job_secret_file, os.environ)  # (checked again, cheaply, just below)
    secret = _job_secret(config, max_nodes)
    signals = SignalFlag()
    previous = {sig: signal.signal(sig, signals.handler) for sig in HANDLED_SIGNALS}
    try:
        opened = open_backend(config)
        endpoint, hosting = opened.endpoint, opened.hosting
        # The persistent tier's MACs need a key that later jobs have too: only a secret from outside.
        mac_key = durable_key(outside, config.checkpoint_uri) if outside is not None and config.checkpoint_uri else None
        if secret is None:  # a multi-node job without a secret from outside: one kept in the store
            secret = job_secret(opened.backend, config.rdzv_id)
            logger.warning(
                "no job secret given: it is kept in the rendezvous store, where anyone who can reach %s can "
                "read it and then forge this job's rendezvous and status documents%s; give every node the same "
                "--job-secret-file (mode 0600) or %s (docs/security.md)",
                endpoint,
                " and read or forge its replicas" if config.replicas > 0 else "",
                SECRET_ENV,
            )
        # Every document this agent writes is sealed under the secret, and what it reads verified:
        # a party with store access but not the secret cannot join, reassign, declare lost or fake status.
        backend = SealedBackend(opened.backend, store_key(secret), on_forged=_forged_document)
        if not backend.check_key(keys.secret_check(config.rdzv_id), _SECRET_CHECK):
            raise ConfigError(
                f"the job secrets differ: job {config.rdzv_id}'s documents in the rendezvous store at {endpoint} "
                "are sealed under another job secret than this node's",
                hint="give every node the same --job-secret-file (or use another --rdzv-id); if every node has "
                "the same one, someone with access to the store wrote there",
            )
        # As torchrun: the FQDN unless --local-addr says otherwise (workers reach rank 0 there),
        # except where the host name means loopback in a multi-host job (addressing.py).
        advertised = choose_address(
            config.local_addr, [host for host, _ in config.endpoints], max_nodes > 1, os.environ
        )
        addr = advertised.addr
        if advertised.chosen:
            logger.info(
                "this node's address: %s (%s)%s",
                addr,
                advertised.chosen,
                f"; workers use interface {advertised.ifname}" if advertised.ifname else "",
            )
        me = NodeInfo(
            node_id=f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}",
            addr=addr,
            local_world_size=nproc,
            requested_rank=config.node_rank,
            hostname=socket.gethostname(),
        )
        rdzv = RendezvousClient(
            backend,
            config.rdzv_id,
            me,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            join_timeout=_seconds(rdzv_conf.join_timeout_s),
            last_call_timeout=_seconds(rdzv_conf.last_call_timeout_s),
            refresh_s=_STATE_REFRESH_S,
        )
        heartbeat = HeartbeatSender(
            backend, config.rdzv_id, me.node_id, config.heartbeat_interval_s, rdzv.clock,
            timeout_s=config.heartbeat_timeout_s,
        )  # fmt: skip
        log_root = _log_root(config)
        logger.info(
            "resilrun agent: run %s, %s store %s, nnodes %s, %d worker(s) on this node, logs in %s",
            config.rdzv_id,
            "hosting" if hosting else "using",
            endpoint,
            config.nnodes,
            nproc,
            log_root,
        )
        storage = _open_storage(config)
        # Only replicas and the persistent tier copy snapshots out of node memory (checked reads).
        replicated = config.replicas > 0 and max_nodes > 1
        memory = NodeMemoryTier(
            config.rdzv_id,
            checksum_commits=replicated or bool(config.checkpoint_uri),
            slots=REPLICATED_SLOTS if replicated else SLOTS,
            replicate_every=config.replicate_every,
        )
        control = WorkerControl()
        events = EventLog(log_root / EVENTS_FILE, node_id=me.node_id, host=me.hostname)
        publisher: list[StatusPublisher] = []  # set below; the metrics read its latest document
        metrics = _metrics(config, lambda: publisher[0].latest if publisher else None)
        telemetry = AgentTelemetry(events, backend, config.rdzv_id, metrics, finished=memory.finished)
        tiers = NodeTiers(
            memory,
            storage,
            mac_key=mac_key,
            require_mac=config.require_auth,
            # A bucket whose newest steps were deleted would otherwise restore an older one silently.
            persisted_before=lambda: telemetry.persisted_step,
            on_rollback=lambda now, before: events.record("persistent_rollback", newest=now, known=before),
        )
        channel = AgentChannel(memory, tiers, control, telemetry)
        setup = NodeSetup(
            nproc=nproc,
            addr=addr,
            log_root=log_root,
            # The channel token reaches only our workers; *_SOCKET_IFNAME only where the user set none.
            base_env={
                **agent_environ(),
                **worker_network_env(advertised, os.environ),
                **channel_env(channel),
                **({"RESILRUN_NO_INTEGRATIONS": "1"} if config.no_integrations else {}),
            },
            agent_socket=channel.path,
        )
        peer_key = PeerKey(secret, encrypt=config.peer_encryption)
        # A node's silence in the store is confirmed on its replica server before it counts as lost.
        liveness = PeerLiveness(peer_key, config.heartbeat_interval_s) if replicated else None
        supervisor = Supervisor(config, setup, rdzv, signals, control, telemetry, liveness=liveness)
        peers = None
        if replicated:
            peers = PeerTier(
                memory,
                peer_key,
                config.rdzv_id,
                me.node_id,
                addr,
                targets=supervisor.replica_targets,
                peers=supervisor.peer_addresses,
                world_size=supervisor.world_size,
                generation=supervisor.generation,
                on_replicated=telemetry.replicated,
                every=config.replicate_every,
            )
            rdzv.me = rdzv.me._replace(peer_addr=peers.address)
            tiers.peer_held, tiers.peer_fetch, tiers.peer_inventory = peers.held_steps, peers.fetch, peers.inventory
        persister = None
        if storage is not None:
            persister = Persister(
                memory,
                storage,
                every=config.persist_every,
                keep_last=config.keep_last,
                count_persisted=lambda step: backend.add(keys.persist_count(config.rdzv_id, step), 1),
                world_size=supervisor.world_size,
                may_write=WriteFence(
                    lambda: heartbeat.confirmed_at, rdzv.state, me.node_id, config.heartbeat_timeout_s, rdzv.clock
                ).allows,
                on_persisted=telemetry.persisted,
                upload_delay_s=delay_s(PERSIST_DELAY_ENV, "every upload to the persistent tier"),
                mac_key=mac_key,
            )
        publisher.append(
            StatusPublisher(
                supervisor,
                control,
                memory,
                telemetry,
                replication=peers.replicator.status if peers is not None else None,
                interval_s=config.heartbeat_interval_s,
            )
        )
        metrics_at = metrics.serve(config.metrics_port or 0, config.metrics_addr) if metrics is not None else None
        events.record(
            "agent_started",
            run_id=config.rdzv_id,
            endpoint=endpoint,
            hosting_store=hosting,
            agent_pid=os.getpid(),
            nproc=nproc,
            spares=config.spares,
            replica_server=peers.address if peers is not None else None,
            metrics=f"http://{metrics_at[0]}:{metrics_at[1]}/metrics" if metrics_at else None,
        )
        outcome, message = "error", None
        try:
            supervisor.run()
            outcome = "succeeded"
            logger.info("job finished: all workers exited 0")
        except ShutdownRequested:
            outcome = "stopped"
            raise
        except RendezvousClosedError as exc:
            outcome, message = exc.outcome, exc.message
            raise
        except WorkerGroupFailed as exc:
            outcome, message = "failed", exc.message
            raise
        except ResilrunError as exc:
            message = exc.message
            raise
        finally:
            telemetry.exit(outcome, message)
            publisher[0].close(final_state=outcome)
            if metrics is not None:
                metrics.close()
            events.close()
            if persister is not None:  # while heartbeats still flow: the write fence's lease needs them
                persister.close()
            heartbeat.close()
            if peers is not None:
                peers.close()
            channel.close()
            memory.close()
            if hosting:
                _linger_for_peers(rdzv, supervisor, rdzv_conf.close_timeout_s)
            backend.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _metrics(config: Config, snapshot: Callable[[], dict[str, Any] | None]) -> AgentMetrics | None:
    """The metrics registry when --metrics-port is given (prometheus_client is imported only then)."""
    if config.metrics_port is None:
        return None
    from resilrun.agent.observability.metrics import AgentMetrics

    return AgentMetrics(snapshot)


def _open_storage(config: Config) -> Storage | None:
    if not config.checkpoint_uri:
        return None
    from resilrun.storage import create_storage

    return create_storage(
        config.checkpoint_uri, s3_endpoint_url=config.s3_endpoint_url, s3_expected_owner=config.s3_expected_owner
    )


def _linger_for_peers(rdzv: RendezvousClient, supervisor: Supervisor, close_timeout_s: float) -> None:
    """The store host leaves last, so other nodes can read the job's end (bounded wait)."""
    state = supervisor.last_state
    expected = len(state.participants) if state is not None else 1
    deadline = time.monotonic() + close_timeout_s
    try:
        if not rdzv.state().closed:
            return
        while time.monotonic() < deadline and rdzv.closed_acks() < expected:
            time.sleep(0.05)
    except (ResilrunError, ShutdownRequested):
        pass


def _log_root(config: Config) -> Path:
    """The run's log directory, readable by the job's user only: workers' output (what a script
    prints, tracebacks with values) and the events are the job's business.

    Its name is predictable (``<log-dir>/<rdzv-id>``, often a scheduler's job id), so it may exist
    already: made by another agent of this run on this host (ours: used, and made 0700), or by
    someone else, or left writable by others, where links planted in it would turn our log writes
    into overwrites of their targets (refused: ConfigError, exit 2).
    """
    from resilrun.private_file import private_dir

    if config.log_dir:
        root = Path(config.log_dir) / config.rdzv_id
    else:
        root = Path(tempfile.mkdtemp(prefix=f"resilrun_{config.rdzv_id}_"))
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise ConfigError(f"--log-dir '{config.log_dir}' cannot be created: {exc.strerror}") from exc
    private_dir(
        root,
        "--log-dir: the run's directory",
        hint=f"give --log-dir a directory only you can write to, or remove {root} if you know who made it",
    )
    return root


def _seconds(value: float) -> timedelta:
    return timedelta(seconds=value)
