"""Prometheus metrics of one agent, served on ``--metrics-port`` (off by default) in the text format.

Why a registry per agent (not prometheus_client's global one): several agents (and tests) share one
process in simulations, and each must expose only its own node. Two kinds of values:

- event-driven counters and histograms, updated by :class:`~resilrun.agent.observability.telemetry.AgentTelemetry`
  as things happen (failures, recoveries and their seconds, snapshot and restore bytes and seconds
  per tier, step durations);
- point-in-time gauges (step per rank, steps/s, worker and peer heartbeat ages, spares, snapshot
  progress and lag per tier) read at scrape time from the node's latest status document, so a
  scrape costs no store access and the numbers match what ``resilrun status`` shows.

The server binds loopback unless ``--metrics-addr`` says otherwise: metrics reveal the job's shape
and progress, and the endpoint has no authentication.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from resilrun.errors import ConfigError

logger = logging.getLogger(__name__)

_PREFIX = "resilrun"
# Snapshot copies take milliseconds, uploads and transfers seconds, recoveries seconds to minutes.
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

Snapshot = Callable[[], dict[str, Any] | None]


class StatusCollector(Collector):
    """Gauges computed at scrape time from the node's latest status document."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        doc = self._snapshot() or {}
        ranks = doc.get("ranks", [])
        per_rank = {
            "rank_step": ("Newest step the rank committed.", "step"),
            "rank_steps_per_second": ("Steps per second of the rank (smoothed).", "steps_per_s"),
            "rank_step_seconds": ("Seconds per step of the rank (smoothed).", "step_time_s"),
            "rank_compute_seconds": (
                "Seconds per step the rank computes before its last gradient, without waiting (smoothed).",
                "compute_s",
            ),
            "worker_heartbeat_age_seconds": ("Seconds since the worker's last heartbeat.", "heartbeat_age_s"),
        }
        for name, (help_text, field) in per_rank.items():
            family = GaugeMetricFamily(f"{_PREFIX}_{name}", help_text, labels=["rank"])
            for rank in ranks:
                if rank.get(field) is not None:
                    family.add_metric([str(rank["rank"])], float(rank[field]))
            yield family
        peers = GaugeMetricFamily(
            f"{_PREFIX}_node_heartbeat_age_seconds",
            "Seconds since this agent saw the peer node's heartbeat counter move (its own clock).",
            labels=["node"],
        )
        for node, age in sorted(doc.get("peer_ages", {}).items()):
            if age is not None:
                peers.add_metric([node], float(age))
        yield peers
        spares = doc.get("spares", {})
        yield _gauge("spares_ready", "Hot spare processes waiting for a rank.", spares.get("ready"))
        yield _gauge("spares_alive", "Hot spare processes alive (ready or warming up).", spares.get("alive"))
        tiers = doc.get("tiers", {})
        step = GaugeMetricFamily(
            f"{_PREFIX}_snapshot_latest_step", "Newest step every local rank holds, per tier.", labels=["tier"]
        )
        lag = GaugeMetricFamily(
            f"{_PREFIX}_snapshot_lag_steps", "Steps the tier is behind node memory.", labels=["tier"]
        )
        risk = GaugeMetricFamily(
            f"{_PREFIX}_snapshot_at_risk_steps",
            "Finished steps a failure now would redo when restoring from this tier.",
            labels=["tier"],
        )
        for tier, info in sorted(tiers.items()):
            if info.get("step") is not None:
                step.add_metric([tier], float(info["step"]))
            if info.get("lag_steps") is not None:
                lag.add_metric([tier], float(info["lag_steps"]))
            if info.get("at_risk_steps") is not None:
                risk.add_metric([tier], float(info["at_risk_steps"]))
        yield step
        yield lag
        yield risk
        peer = tiers.get("peer") or {}
        yield _gauge(
            "replica_peers_behind",
            "Replica peers the commit gate no longer waits for (failing, or far slower than their usual pace).",
            len(peer["behind"]) if "behind" in peer else None,
        )
        snapshots = doc.get("snapshots", {})
        yield _gauge(
            "snapshot_interval_steps", "Steps between snapshots now (auto: as decided).", snapshots.get("interval")
        )
        yield _gauge(
            "replica_interval_steps",
            "Steps between snapshots copied to peers (--replicate-every auto: about, as decided).",
            snapshots.get("replica_interval")
            if snapshots.get("replicate_every") == "auto"
            else _fixed_replica_interval(snapshots),
        )
        yield _gauge(
            "snapshot_overhead_ratio",
            "Share of step time snapshots took at the last --snapshot-every auto decision.",
            snapshots.get("overhead"),
        )


def _fixed_replica_interval(snapshots: dict[str, Any]) -> int | None:
    """--replicate-every N: the first snapshot at or past each multiple of N, so at least N apart."""
    every, interval = snapshots.get("replicate_every"), snapshots.get("interval")
    if not isinstance(every, int) or interval is None:
        return None
    return max(every, int(interval))


def _gauge(name: str, help_text: str, value: float | None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"{_PREFIX}_{name}", help_text)
    if value is not None:
        family.add_metric([], float(value))
    return family


class AgentMetrics:
    """The node's metrics and, once :meth:`serve` ran, the HTTP endpoint that exposes them."""

    def __init__(self) -> None:
        self._status: dict[str, Any] | None = None  # the newest status document (on_status)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.failures = Counter(f"{_PREFIX}_failures", "Worker failures this agent detected.", registry=r)
        self.recoveries = Counter(
            f"{_PREFIX}_recoveries", "Recoveries completed on this node (in_process or restart).", ["kind"], registry=r
        )
        self.nodes_lost = Counter(f"{_PREFIX}_nodes_lost", "Nodes this agent judged lost.", registry=r)
        self.recovery_seconds = Histogram(
            f"{_PREFIX}_recovery_seconds",
            "From entering the recovered round to this node's last rank finishing a step.",
            ["kind"],
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.steps = Counter(f"{_PREFIX}_steps", "Steps committed by this node's ranks.", ["rank"], registry=r)
        self.step_seconds = Histogram(
            f"{_PREFIX}_step_seconds",
            "Time between a rank's consecutive commits.",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.snapshot_bytes = Counter(
            f"{_PREFIX}_snapshot_bytes", "Snapshot bytes written per tier.", ["tier"], registry=r
        )
        self.snapshot_seconds = Histogram(
            f"{_PREFIX}_snapshot_seconds",
            "Seconds per snapshot write per tier (memory: the worker's copy; peer: one push; persistent: one upload).",
            ["tier"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.restore_bytes = Counter(
            f"{_PREFIX}_restore_bytes", "Bytes restored per source tier.", ["tier"], registry=r
        )
        self.restore_seconds = Histogram(
            f"{_PREFIX}_restore_seconds", "Seconds per rank restore per tier.", ["tier"], buckets=_SECONDS_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.generation = Gauge(f"{_PREFIX}_generation", "Rendezvous round (generation) this node runs.", registry=r)
        self.straggler_ratio = Gauge(
            f"{_PREFIX}_rank_straggler_ratio",
            "While a rank of this node is a straggler: its compute time over the other ranks' median (else 0).",
            ["rank"],
            registry=r,
        )
        self.straggler_swaps = Counter(
            f"{_PREFIX}_straggler_swaps",
            "Stragglers of this node swapped, by a spare process or node.",
            ["by"],
            registry=r,
        )
        r.register(StatusCollector(lambda: self._status))
        self._server: Any = None
        self.address: tuple[str, int] | None = None

    # -- updates --------------------------------------------------------------------------------------
    def on_status(self, document: dict[str, Any]) -> None:
        """The node's newest status document, which the point-in-time gauges are read from at scrape."""
        self._status = document

    def on_commit(self, rank: int, step: int, nbytes: int, copy_s: float | None, step_s: float | None) -> None:
        self.steps.labels(rank=str(rank)).inc()
        self.snapshot_bytes.labels(tier="memory").inc(nbytes)
        if copy_s is not None:
            self.snapshot_seconds.labels(tier="memory").observe(copy_s)
        if step_s is not None:
            self.step_seconds.observe(step_s)

    def on_straggler(self, kind: str, rank: int, evidence: dict[str, Any]) -> None:
        """A straggler verdict on a rank of this node (``kind``: detected, cleared, swapped, swap_skipped)."""
        if kind == "detected":
            self.straggler_ratio.labels(rank=str(rank)).set(float(evidence.get("ratio") or 0.0))
        elif kind in ("cleared", "swapped"):
            self.straggler_ratio.labels(rank=str(rank)).set(0.0)
        if kind == "swapped":
            self.straggler_swaps.labels(by=str(evidence.get("by", "spare process"))).inc()

    def on_snapshot(self, tier: str, nbytes: int, seconds: float) -> None:
        self.snapshot_bytes.labels(tier=tier).inc(nbytes)
        self.snapshot_seconds.labels(tier=tier).observe(seconds)

    def on_restore(self, tier: str, nbytes: int, seconds: float) -> None:
        self.restore_bytes.labels(tier=tier).inc(nbytes)
        self.restore_seconds.labels(tier=tier).observe(seconds)

    # -- endpoint -------------------------------------------------------------------------------------
    def serve(self, port: int, addr: str) -> tuple[str, int]:
        """Start the HTTP endpoint (a daemon thread); returns the bound ``(addr, port)``.

        Raises:
            ConfigError: the address or port cannot be bound.
        """
        try:
            self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise ConfigError(
                f"--metrics-port {port} cannot be bound on {addr}: {exc.strerror}",
                hint="choose a free port (0 picks one) or another --metrics-addr",
            ) from exc
        self.address = (addr, int(self._server.server_port))
        logger.info("metrics on http://%s:%d/metrics", *self.address)
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
