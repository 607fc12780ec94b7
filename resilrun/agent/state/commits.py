"""What a worker's commit goes through on the agent, in order: the one place that order is written.

1. **record**: the worker's newest step is noted (its heartbeat's progress) and node memory
   records the snapshot. Node memory then announces every snapshot this commit completed (its
   own, or another local rank's that borrowed bytes from it) to
2. **replicas, then persistence**: the replicator queues the snapshot for the peers, the persister
   copies it out if its step is due (each O(1) or one copy on this thread; the transfers run on
   their own threads). They are node memory's listeners, registered here in this order, because
   node memory also announces snapshots that no worker's commit completes on this call: one
   borrowed from a rank that commits later, one a restore installed;
3. **gates**: the answer waits for the replicas to catch up (the replicator's commit gate): the
   worker reads it only before its next snapshot, so this costs training time only when the
   replicas lag. After step 2, since a gate may wait for this very step;
4. **telemetry**: the commit is counted (steps, bytes, step time, metrics);
5. **fence**: a worker the supervisor asked to stop at a step boundary (a straggler about to be
   swapped, agent/workers/step_fence.py) is stopped here, its step recorded, before the answer.
"""

from __future__ import annotations

from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.state.persister import Persister
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.step_fence import StepFence
from resilrun.channel_protocol import Commit, Committed
from resilrun.snapshot.dedup import parse_borrowed, parse_shared
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer.replicator import Replicator


class CommitPipeline:
    """The stages of a commit (see the module), wired once, in their order."""

    def __init__(
        self,
        memory: NodeMemoryTier,
        control: WorkerControl,
        telemetry: Telemetry,
        *,
        replicator: Replicator | None = None,
        persister: Persister | None = None,
        fence: StepFence | None = None,
    ) -> None:
        self.memory = memory
        self.fence = fence
        self.control = control
        self.telemetry = telemetry
        # Stage 2, in order, then stage 3's gate.
        if replicator is not None:
            memory.add_listener(replicator.on_commit)
        if persister is not None:
            memory.add_listener(persister.on_commit)
        if replicator is not None:
            memory.add_commit_gate(replicator.hold_commit)

    def commit(self, request: Commit) -> Committed:
        """Run ``request`` through every stage; the answer says how the worker writes its next snapshot.

        Raises:
            CheckpointError: the slot is not the worker's to commit (node memory refused it).
        """
        rank, step, nbytes = request.rank, request.step, request.nbytes
        # 1. record (node memory announces to stage 2 from inside)
        if request.pid is not None:
            self.control.report_step(request.pid, step)
        whole = self.memory.commit(
            rank,
            step,
            request.slot,
            nbytes,
            request.values,
            parse_borrowed(request.borrowed, rank, nbytes),
            request.layout,
            parse_shared(request.shared, rank, nbytes),
            request.round,
            previous=request.previous,
            replicate=request.replicate,
        )
        # 3. gates
        self.memory.pass_gates(rank, step)
        # 4. telemetry
        copied = nbytes if request.copied is None else request.copied  # less when the snapshot borrows
        self.telemetry.committed(rank, step, copied, request.copy_s, request.compute_s)
        # 5. fence
        if self.fence is not None and request.pid is not None:
            self.fence.at_commit(request.pid, step)
        return Committed(whole=whole, next=self.memory.next_slot(rank))
