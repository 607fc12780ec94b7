"""The worker store of a round (``MASTER_ADDR:MASTER_PORT``): hosted by node rank 0, found by the others.

A fresh store per round is what keeps a restarted worker from reading the gloo addresses of the
previous attempt (torchrun 2.13's stale-store trap). A node other than node rank 0 waits for the
address, watching node rank 0's heartbeat meanwhile: if it died before hosting the store, its place
goes to a spare node or the job restarts, instead of every node waiting out the join timeout.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from resilrun import keys
from resilrun.agent.liveness.heartbeat import StalenessJudge, read_heartbeats
from resilrun.agent.supervision.node_loss import NodeWatch
from resilrun.agent.supervision.restarts import Restarts
from resilrun.agent.supervision.rounds import Membership, SignalFlag
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.specs import NodeSetup
from resilrun.config import Config
from resilrun.rendezvous.c10d import host_store
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import RdzvState

logger = logging.getLogger(__name__)

# How often a node waiting for the worker store's address reads its key (a store read, no watch yet).
_ADDRESS_POLL_S = 0.02


class RoundMaster:
    """Hosts or finds each round's worker store (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        setup: NodeSetup,
        rdzv: RendezvousClient,
        signals: SignalFlag,
        control: WorkerControl,
        membership: Membership,
        node_watch: NodeWatch,
        restarts: Restarts,
    ) -> None:
        self._config = config
        self._setup = setup
        self._rdzv = rdzv
        self._signals = signals
        self._control = control
        self._membership = membership
        self._node_watch = node_watch
        self._restarts = restarts

    def resolve(self, state: RdzvState, node_rank: int) -> tuple[Any, str | None]:
        """(the store this node hosts or None, its ``host:port``); no address: the round is over."""
        key = keys.round_master(self._rdzv.run_id, state.round)
        if node_rank == 0:
            # An IP literal (--local-addr) is bound exactly; a host name keeps the wildcard.
            store = host_store(self._setup.addr, 0, timedelta(seconds=self._config.rdzv.read_timeout_s))
            master = f"{self._setup.addr}:{store.port}"
            self._rdzv.backend.set(key, master.encode())
            return store, master
        return None, self._await_address(state, key)

    def _await_address(self, state: RdzvState, key: str) -> str | None:
        # Node rank 0 may be dead already (two nodes lost a heartbeat check apart: the generation
        # that replaced the first still names the second): watch it, or this wait lasts the join timeout.
        clock, backend = self._rdzv.clock, self._rdzv.backend
        leader = state.participants[0].node_id
        judge = StalenessJudge(self._config.heartbeat_timeout_s, clock)
        next_check = clock.monotonic()
        deadline = clock.monotonic() + self._rdzv.join_timeout.total_seconds()
        while clock.monotonic() < deadline:
            self._signals.raise_if_set()
            raw = backend.get(key)
            if raw is not None:
                return raw.decode()
            current = self._rdzv.state()
            if current.closed or current.round != state.round:
                return None
            if clock.monotonic() >= next_check:
                judge.observe_reading(leader, read_heartbeats(backend, self._rdzv.run_id, [leader])[leader])
                next_check = clock.monotonic() + self._config.heartbeat_interval_s
                if judge.stale() and self._node_watch.confirm_lost((state, current), (leader,), judge):
                    self._leader_lost(state, leader, judge)
                    return None
            clock.sleep(_ADDRESS_POLL_S)
        return None

    def _leader_lost(self, state: RdzvState, leader: str, judge: StalenessJudge) -> None:
        """Node rank 0 died before hosting this generation's worker store: give its place to a spare
        node if one stands by, else restart the job (whichever decision lands first, every node follows)."""
        failures = self._node_watch.failures(state, (leader,), judge)
        logger.error("node 0 (%s) %s, before it hosted the worker store", failures[0].host, failures[0].message)
        self._restarts.record(state.round, failures)
        failure = failures[0].to_dict()
        current = self._membership.current
        newest = self._control.newest_step([w.pid for w in current.workers] if current is not None else [])
        new = self._rdzv.replace_nodes(
            state.round, (leader,), failure=failure, newest_step=-1 if newest is None else newest
        )
        if not (new.round > state.round and new.recovering) and not new.closed:
            self._rdzv.next_round(state.round, failure=failure, max_restarts=self._config.max_restarts)
