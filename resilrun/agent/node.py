"""The composition root of one node: ``build_node(config)`` wires every part through its
constructor, ``Node.run()`` runs the node's share of the job and says how it ended.

Build order follows the data, so that no part is handed a collaborator after it was made: the
store and its seal, the node's place (``Membership``, which the supervisor moves and replication
and status read), node memory, what is recorded (events, metrics, telemetry), the peer tier (its
server's address goes into this node's rendezvous record), the rendezvous client and heartbeat,
the tiers a restore reads, the worker channel, the supervisor, the persister and the status
publisher. A build that fails part-way closes what it opened, newest first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from resilrun import keys
from resilrun.agent.addressing import choose_address, worker_network_env
from resilrun.agent.liveness.fence import WriteFence
from resilrun.agent.liveness.heartbeat import HeartbeatSender
from resilrun.agent.observability.events import EVENTS_FILE, EventLog
from resilrun.agent.observability.telemetry import AgentTelemetry
from resilrun.agent.state.captured import CapturedFolder
from resilrun.agent.state.channel import AgentChannel, channel_env
from resilrun.agent.state.commits import CommitPipeline
from resilrun.agent.state.persister import Persister
from resilrun.agent.state.replication import PeerTier, job_secret
from resilrun.agent.state.tiers import NodeTiers
from resilrun.agent.status import StatusPublisher
from resilrun.agent.supervision.node_loss import PeerLiveness
from resilrun.agent.supervision.rounds import Membership, SignalFlag
from resilrun.agent.supervision.stragglers import straggler_watch
from resilrun.agent.supervision.supervisor import Supervisor
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.fault_hooks import PERSIST_DELAY_ENV, delay_s
from resilrun.agent.workers.procs import Processes, start_template
from resilrun.agent.workers.specs import NodeSetup, process_env
from resilrun.agent.workers.step_fence import StepFence
from resilrun.agent.workers.template import WorkerTemplate, script_imports, uses_template
from resilrun.config import Config
from resilrun.env import CAPTURE_DIR_ENV, NO_HEAD_START_ENV, RERUN_ENV, agent_environ, agent_secrets
from resilrun.errors import (
    ConfigError,
    RendezvousClosedError,
    ResilrunError,
    ShutdownRequested,
    WorkerGroupFailed,
)
from resilrun.job_secret import SECRET_ENV, choose_secret, external_secret
from resilrun.option_values import nproc_without_devices
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.factory import open_backend
from resilrun.rendezvous.protocol import NodeInfo
from resilrun.rendezvous.sealed import SealedBackend, store_key
from resilrun.storage.api import Storage
from resilrun.tiers.authentic import durable_key
from resilrun.tiers.captured.catalog import Catalog, MemoryBudget
from resilrun.tiers.headroom import HEADROOM_BYTES, available_bytes
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer.wire import PeerKey
from resilrun.tiers.slots import REPLICATED_SLOTS, SLOTS

if TYPE_CHECKING:
    from resilrun.agent.observability.metrics import AgentMetrics

__all__ = ["Node", "Outcome", "RunResult", "build_node", "resolve_nproc"]

logger = logging.getLogger(__name__)

# On a store that cannot push (c10d), agents poll a tiny version counter every monitor tick and re-read
# the O(nodes) rendezvous document only when it moved, or after this long (the net under a writer that
# died mid-update); on etcd the document itself is pushed to each agent by watch, and neither the poll
# nor this re-read happens. See rendezvous/executor.py and docs/benchmarks.md ("Control plane at scale").
_STATE_REFRESH_S = 10.0


# What the first agent seals at keys.secret_check (any constant: only its MAC matters).
_SECRET_CHECK = b"resilrun job secret check"


class Outcome(Enum):
    """How the node's run ended: the ``exit`` event's and the final status document's ``state``.

    A node runs (its ``NodePhase``: joining -> active, or spare -> active, and back to joining
    between rounds) until exactly one of these ends it:

    - SUCCEEDED: every worker of the job exited 0 and the job was closed as such;
    - FAILED: the workers failed with no restart left, or another node closed the job as failed;
    - STOPPED: a signal (here or on another node) stopped the job;
    - ERROR: anything else that ended this node (the store, the join, a refused state).
    """

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    ERROR = "error"

    @classmethod
    def of_close(cls, outcome: str) -> Outcome:
        """The outcome another node closed the job with (an unknown word: ERROR)."""
        try:
            return cls(outcome)
        except ValueError:
            return cls.ERROR


@dataclass(frozen=True, slots=True)
class RunResult:
    """How ``Node.run`` ended: the outcome, a one-line message, and the error that carries the
    exit code and hint (None only when the job succeeded)."""

    outcome: Outcome
    message: str | None = None
    error: ResilrunError | ShutdownRequested | None = None

    def raise_error(self) -> None:
        """Raise the error that ended the run (nothing after a success): the CLI maps it to an exit code."""
        if self.error is not None:
            raise self.error


def resolve_nproc(value: str) -> int:
    """torchrun's ``--nproc-per-node``: a number, ``cpu``, ``gpu`` or ``auto``."""
    known = nproc_without_devices(value)
    if known is not None:
        return known
    value = value.strip().lower()
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if value in ("gpu", "cuda"):
        if gpus == 0:
            raise ConfigError("--nproc-per-node gpu, but no CUDA device is visible", hint="use a number or cpu")
        return gpus
    return gpus or os.cpu_count() or 1


class Node:
    """One node's parts, built and wired; ``run`` once."""

    def __init__(
        self,
        *,
        config: Config,
        backend: SealedBackend,
        endpoint: str,
        hosting: bool,
        rdzv: RendezvousClient,
        memory: NodeMemoryTier,
        events: EventLog,
        metrics: AgentMetrics | None,
        telemetry: AgentTelemetry,
        heartbeat: HeartbeatSender,
        peers: PeerTier | None,
        channel: AgentChannel,
        supervisor: Supervisor,
        persister: Persister | None,
        publisher: StatusPublisher,
        nproc: int,
        captured: CapturedFolder | None = None,
        template: WorkerTemplate | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.endpoint = endpoint
        self.hosting = hosting
        self.rdzv = rdzv
        self.memory = memory
        self.events = events
        self.metrics = metrics
        self.telemetry = telemetry
        self.heartbeat = heartbeat
        self.peers = peers
        self.channel = channel
        self.supervisor = supervisor
        self.persister = persister
        self.publisher = publisher
        self.nproc = nproc
        self.captured = captured
        self.template = template

    def run(self) -> RunResult:
        """Run this node's share of the job to its end, then close every part (in the order their
        dependencies need: the persister while heartbeats still flow, the store last, after the
        store's host waited for the other nodes to read the job's end)."""
        config = self.config
        metrics_at = self.metrics.serve(config.metrics_port or 0, config.metrics_addr) if self.metrics else None
        self.events.record(
            "agent_started",
            run_id=config.rdzv_id,
            endpoint=self.endpoint,
            hosting_store=self.hosting,
            agent_pid=os.getpid(),
            nproc=self.nproc,
            spares=config.spares,
            replica_server=self.peers.address if self.peers is not None else None,
            metrics=f"http://{metrics_at[0]}:{metrics_at[1]}/metrics" if metrics_at else None,
        )
        result = RunResult(Outcome.ERROR)
        try:
            result = self._supervise()
        finally:
            self._close(result)
        return result

    def _supervise(self) -> RunResult:
        try:
            self.supervisor.run()
        except ShutdownRequested as exc:
            return RunResult(Outcome.STOPPED, None, exc)
        except RendezvousClosedError as exc:
            return RunResult(Outcome.of_close(exc.outcome), exc.message, exc)
        except WorkerGroupFailed as exc:
            return RunResult(Outcome.FAILED, exc.message, exc)
        except ResilrunError as exc:
            return RunResult(Outcome.ERROR, exc.message, exc)
        logger.info("job finished: all workers exited 0")
        return RunResult(Outcome.SUCCEEDED)

    def _close(self, result: RunResult) -> None:
        if self.template is not None:  # the workers are stopped: nothing more to fork
            self.template.close()
        self.telemetry.exit(result.outcome.value, result.message)
        self.publisher.close(final_state=result.outcome.value)
        if self.metrics is not None:
            self.metrics.close()
        self.events.close()
        if self.persister is not None:  # while heartbeats still flow: the write fence's lease needs them
            self.persister.close()
        if self.captured is not None:  # (the same: its uploads ask the write fence)
            self.captured.close(workers_failed=result.outcome is not Outcome.SUCCEEDED)
        self.heartbeat.close()
        if self.peers is not None:
            self.peers.close()
        self.channel.close()
        self.memory.close()
        if self.hosting:
            _linger_for_peers(self.rdzv, self.supervisor, self.config.rdzv.close_timeout_s)
        self.backend.close()


def build_node(
    config: Config,
    signals: SignalFlag,
    environ: Mapping[str, str] | None = None,
    template: WorkerTemplate | None = None,
) -> Node:
    """Every part of this node, wired through constructors (the order: the module's docstring).

    ``environ``: the agent's environment less its secrets (default: this process's); the job
    secret is read from ``agent_secrets()`` alone. ``template``: the worker template, when the
    caller started it before importing this module (else one is started here).

    Raises:
        ConfigError: the secret, the log directory or an address is wrong (nothing is left open).
        ResilrunError: the store or storage could not be opened.
    """
    base = agent_environ() if environ is None else dict(environ)
    nproc = resolve_nproc(config.nproc_per_node)
    min_nodes, max_nodes = config.node_range
    outside = external_secret(config.job_secret_file, agent_secrets())
    secret = choose_secret(
        outside, max_nodes=max_nodes, require_auth=config.require_auth, persistent=bool(config.checkpoint_uri)
    )
    with contextlib.ExitStack() as opened_so_far:
        opened = open_backend(config)
        opened_so_far.callback(opened.backend.close)
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
        advertised = choose_address(config.local_addr, [host for host, _ in config.endpoints], max_nodes > 1, base)
        addr = advertised.addr
        if advertised.chosen:
            logger.info(
                "this node's address: %s (%s)%s",
                addr,
                advertised.chosen,
                f"; workers use interface {advertised.ifname}" if advertised.ifname else "",
            )
        node_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        membership = Membership(node_id)
        log_root = _log_root(config)
        storage = _open_storage(config)
        # Only replicas and the persistent tier copy snapshots out of node memory (checked reads).
        replicated = config.replicas > 0 and max_nodes > 1
        memory = NodeMemoryTier(
            config.rdzv_id,
            checksum_commits=replicated or bool(config.checkpoint_uri),
            slots=REPLICATED_SLOTS if replicated else SLOTS,
            replicate_every=config.replicate_every,
        )
        opened_so_far.callback(memory.close)
        events = EventLog(log_root / EVENTS_FILE, node_id=node_id, host=socket.gethostname())
        opened_so_far.callback(events.close)
        metrics = _metrics(config)
        telemetry = AgentTelemetry(events, backend, config.rdzv_id, metrics, finished=memory.finished)
        peer_key = PeerKey(secret, encrypt=config.peer_encryption)
        catalog = _catalog() if config.capture_dir else None
        peers = None
        if replicated:
            peers = PeerTier(
                memory,
                peer_key,
                config.rdzv_id,
                node_id,
                addr,
                targets=lambda: membership.replica_targets(config.replicas),
                peers=membership.peer_addresses,
                world_size=membership.world_size,
                generation=membership.generation,
                on_replicated=telemetry.replicated,
                every=config.replicate_every,
                captured=catalog,
                on_health=telemetry.replica_health,
                on_dropped=telemetry.replica_dropped,
                local_ranks=membership.local_ranks,
            )
            opened_so_far.callback(peers.close)
        me = NodeInfo(
            node_id=node_id,
            addr=addr,
            local_world_size=nproc,
            requested_rank=config.node_rank,
            hostname=socket.gethostname(),
            peer_addr=peers.address if peers is not None else "",
        )
        rdzv = RendezvousClient(
            backend,
            config.rdzv_id,
            me,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            join_timeout=timedelta(seconds=config.rdzv.join_timeout_s),
            last_call_timeout=timedelta(seconds=config.rdzv.last_call_timeout_s),
            refresh_s=_STATE_REFRESH_S,
        )
        heartbeat = HeartbeatSender(
            backend, config.rdzv_id, node_id, config.heartbeat_interval_s, rdzv.clock,
            timeout_s=config.heartbeat_timeout_s,
        )  # fmt: skip
        opened_so_far.callback(heartbeat.close)
        logger.info(
            "resilrun agent: run %s, %s store %s, nnodes %s, %d worker(s) on this node, logs in %s",
            config.rdzv_id,
            "hosting" if hosting else "using",
            endpoint,
            config.nnodes,
            nproc,
            log_root,
        )
        tiers = NodeTiers(
            memory,
            storage,
            peers,
            mac_key=mac_key,
            require_mac=config.require_auth,
            # A bucket whose newest steps were deleted would otherwise restore an older one silently.
            persisted_before=lambda: telemetry.persisted_step,
            on_rollback=lambda now, before: events.record("persistent_rollback", newest=now, known=before),
        )
        fence = WriteFence(lambda: heartbeat.confirmed_at, rdzv.state, node_id, config.heartbeat_timeout_s, rdzv.clock)
        persister = None
        if storage is not None:
            persister = Persister(
                memory,
                storage,
                every=config.persist_every,
                keep_last=config.keep_last,
                count_persisted=lambda step: backend.add(keys.persist_count(config.rdzv_id, step), 1),
                world_size=membership.world_size,
                may_write=fence.allows,
                on_persisted=telemetry.persisted,
                upload_delay_s=delay_s(PERSIST_DELAY_ENV, "every upload to the persistent tier"),
                mac_key=mac_key,
            )
            opened_so_far.callback(persister.close)
        captured = None
        if catalog is not None and config.capture_dir:
            captured = CapturedFolder(
                Path(os.path.abspath(config.capture_dir)),
                catalog,
                node_id,
                pattern=config.capture_pattern,
                secret=peer_key if peers is not None else None,
                targets=lambda: membership.replica_targets(config.replicas),
                peers=membership.peer_addresses,
                storage=storage,
                mac_key=mac_key,
                may_write=fence.allows,
                record=events.record,
            )
            captured.start()
            opened_so_far.callback(captured.close)
        control = WorkerControl()
        step_fence = StepFence()
        commits = CommitPipeline(
            memory,
            control,
            telemetry,
            replicator=peers.replicator if peers is not None else None,
            persister=persister,
            fence=step_fence,
        )
        channel = AgentChannel(memory, tiers, control, telemetry, commits=commits)
        opened_so_far.callback(channel.close)
        setup = NodeSetup(
            nproc=nproc,
            addr=addr,
            log_root=log_root,
            # The channel token reaches only our workers; *_SOCKET_IFNAME only where the user set none.
            base_env={
                **base,
                **worker_network_env(advertised, base),
                **channel_env(channel),
                **({"RESILRUN_NO_INTEGRATIONS": "1"} if config.no_integrations else {}),
                **({CAPTURE_DIR_ENV: str(captured.root)} if captured is not None else {}),
                **({RERUN_ENV: "1"} if config.rerun_in_process else {}),
                **({NO_HEAD_START_ENV: "1"} if config.no_spare_head_start else {}),
            },
            agent_socket=channel.path,
        )
        # A node's silence in the store is confirmed on its replica server before it counts as lost.
        liveness = PeerLiveness(peer_key, config.heartbeat_interval_s) if replicated else None
        if template is None and uses_template(config):
            env = process_env(setup)
            template = start_template(env, script=script_imports(config, env))
        if template is not None:
            opened_so_far.callback(template.close)
        supervisor = Supervisor(
            config,
            setup,
            rdzv,
            signals,
            control,
            telemetry,
            processes=Processes(template),
            liveness=liveness,
            membership=membership,
            captured=captured,
            fence=step_fence if config.stragglers == "swap" else None,
        )
        watch = straggler_watch(config, rdzv, membership, telemetry, supervisor.straggler_swap)
        publisher = StatusPublisher(
            config,
            rdzv,
            membership,
            control,
            memory,
            telemetry,
            replication=peers.replicator.status if peers is not None else None,
            on_published=[listener for listener in (metrics.on_status if metrics else None, watch) if listener],
            captured=captured,
            interval_s=config.heartbeat_interval_s,
        )
        opened_so_far.pop_all()  # built: Node.run closes them, in their order
    return Node(
        config=config,
        backend=backend,
        endpoint=endpoint,
        hosting=hosting,
        rdzv=rdzv,
        memory=memory,
        events=events,
        metrics=metrics,
        telemetry=telemetry,
        heartbeat=heartbeat,
        peers=peers,
        channel=channel,
        supervisor=supervisor,
        persister=persister,
        publisher=publisher,
        nproc=nproc,
        captured=captured,
        template=template,
    )


def _forged_document(key: str) -> None:
    logger.warning(
        "refused a document in the rendezvous store that does not carry this job's MAC (%s): written by "
        "someone without the job secret, or by a job with another secret under the same --rdzv-id; "
        "read as absent",
        key,
    )


def _catalog() -> Catalog:
    """A captured-files catalog that keeps bytes only while the node has memory to spare (the same
    headroom the replica store keeps)."""
    return Catalog(MemoryBudget(available_bytes, HEADROOM_BYTES))


def _metrics(config: Config) -> AgentMetrics | None:
    """The metrics registry when --metrics-port is given (prometheus_client is imported only then:
    it costs the agent's start a tenth of a second)."""
    if config.metrics_port is None:
        return None
    from resilrun.agent.observability.metrics import AgentMetrics

    return AgentMetrics()


def _open_storage(config: Config) -> Storage | None:
    if not config.checkpoint_uri:
        return None
    from resilrun.storage import create_storage

    return create_storage(
        config.checkpoint_uri, s3_endpoint_url=config.s3_endpoint_url, s3_expected_owner=config.s3_expected_owner
    )


def _linger_for_peers(rdzv: RendezvousClient, supervisor: Supervisor, close_timeout_s: float) -> None:
    """The store host leaves last, so other nodes can read the job's end (bounded wait): the nodes
    that trained and the spare nodes standing by, each of which acknowledges the close it reads
    (a spare node that polls after the host left reads a reset connection, an error exit)."""
    state = supervisor.last_state
    deadline = time.monotonic() + close_timeout_s
    try:
        closed = rdzv.state()
        if not closed.closed:
            return
        expected = len(state.participants if state is not None else closed.participants) + len(closed.spares)
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
