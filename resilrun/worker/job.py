"""The checkpointless worker API: ``init()`` -> ``Job``, ``job.track(...)``, ``job.steps(total)``.

``init()`` and the process's membership in generations live in ``membership``; this module is
what a ``Job`` snapshots and restores.

Why the loop owns snapshots: the end of a step is the one moment at which all tracked state is
consistent, so ``steps()`` commits there, and restores before the first step. Restoring agrees on
a step across all ranks with one small all-gather, so every rank resumes from the same step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from resilrun.errors import CheckpointCorruptError, CheckpointError, StateLostError, StateRefusedError
from resilrun.log import rank_ranges
from resilrun.snapshot.restore import MEMORY_STEPS, PEER_STEPS, ReshardPlan, RestorePlan, Tier, plan_restore
from resilrun.snapshot.tree import Joiner, flatten, unflatten
from resilrun.worker import _ddp_sync, _resize, _torch_compat
from resilrun.worker._abort import GenerationWatchdog
from resilrun.worker._compute_probe import ComputeProbe
from resilrun.worker._dtensor import Sharding
from resilrun.worker._interval import Decision, Schedule
from resilrun.worker._replicated import replicated_names
from resilrun.worker.faults import RESTORE_STEP, Fault, fire
from resilrun.worker.rng import RngState
from resilrun.worker.snapshot import Snapshotter

logger = logging.getLogger(__name__)

_FORMAT = 1


@dataclass(frozen=True)
class Seat:
    """This worker's place in its generation: what a ``Job`` needs that depends on the rank."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    snapshotter: Snapshotter | None
    faults: tuple[Fault, ...] = ()
    attempt: int = 0
    round: int = 0
    dedup: bool = True
    snapshot_every: int = 1
    max_overhead: float = 0.03
    replicate_auto: bool = False


class Job:
    """This worker's handle on the job; see ``resilrun.init``.

    ``seat``: this worker's place, or what waits for it and returns it: a hot spare running the
    script ahead (``worker/pending.py``) gets its Job before it has a rank; the Job takes its seat
    when first asked for anything that depends on it (``rank``, ``device``, ``steps()``, ...).
    ``track()`` and ``job[name]`` do not, so the set-up around them runs ahead.
    """

    def __init__(self, seat: Seat | Callable[[], Seat]) -> None:
        self._tracked: dict[str, Any] = {"_rng": RngState()}
        self._values: dict[str, Any] = {}
        self._step = -1
        self._done = -1  # the newest step finished (committed), snapshotted or not
        self._unsaved: int | None = None  # a finished step left out by --snapshot-every, if newest
        self._reported_first_step = False
        self._watchdog: GenerationWatchdog | None = None
        self._sharding = Sharding()
        self._kinds: dict[str, str] = {}  # what each tracked object is, for export (resilrun.checkpoint)
        self._awaiting: Callable[[], Seat] | None = None
        self._joining = False
        self._probe = ComputeProbe()  # each step's compute time, for straggler detection (issue 48)
        if isinstance(seat, Seat):
            self._bind(seat)
        else:
            self._awaiting = seat

    def _bind(self, seat: Seat) -> None:
        self._rank = seat.rank
        self._world_size = seat.world_size
        self._local_rank = seat.local_rank
        self._device = seat.device
        self._snapshotter = seat.snapshotter
        self._faults = seat.faults
        self._attempt = seat.attempt
        self._round = seat.round
        self._dedup = seat.dedup
        world_size, device = seat.world_size, seat.device
        gather = lambda row: _all_gather_ints(row, world_size, device)  # noqa: E731
        self._schedule = Schedule(
            seat.snapshot_every, budget=seat.max_overhead, replicas=seat.replicate_auto, gather=gather
        )

    def _seated(self) -> Job:
        """Take this worker's seat first if it is still awaited (a spare running ahead).

        Once: joining reads the rank, which (in a spare running ahead) takes the process's seat,
        whose callbacks ask this Job again; that inner call returns at once. A join that fails
        leaves the seat awaited, so the error is raised where the rank was asked for.
        """
        awaiting = self._awaiting
        if awaiting is not None and not self._joining:
            self._joining = True
            try:
                seat = awaiting()
            finally:
                self._joining = False
            self._bind(seat)
            self._awaiting = None
        return self

    @property
    def seated(self) -> bool:
        """Whether this worker has its rank (False only in a hot spare running the script ahead)."""
        return self._awaiting is None

    rank = property(lambda self: self._seated()._rank, doc="Global rank of this worker.")
    world_size = property(lambda self: self._seated()._world_size, doc="Number of workers in the job.")
    local_rank = property(lambda self: self._seated()._local_rank, doc="Rank of this worker on its node.")
    device = property(lambda self: self._seated()._device, doc="The device this worker trains on.")
    step = property(lambda self: self._step, doc="The step in progress (or last finished); -1 before.")
    done = property(lambda self: self._done, doc="The newest finished step (committed); -1 before.")

    def track(self, **objects: Any) -> None:
        """Include objects in every snapshot: anything with state_dict()/load_state_dict(),
        tensors (restored in place), or JSON values (read and written through ``job[name]``).

        Sharded state (FSDP2 modules, optimizers over DTensor parameters, tensor-parallel layers)
        is tracked as it is: each rank keeps only its local shards and gets them back in place."""
        for name, obj in objects.items():
            if name.startswith("_") or "/" in name:
                raise ValueError(f"tracked name {name!r} must not start with '_' or contain '/'")
            if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict") or isinstance(obj, torch.Tensor):
                self._tracked[name] = obj
                self._kinds[name] = _kind(obj)
            else:
                flatten(obj, name)  # raises TypeError now rather than at the first snapshot
                self._values[name] = obj

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __setitem__(self, name: str, value: Any) -> None:
        flatten(value, name)
        self._values[name] = value

    def steps(self, total: int) -> Iterator[int]:
        """Yield the steps still to run, restoring first and committing after each one."""
        self._seated()
        for step in range(self.resume() + 1, total):
            self.begin(step)
            yield step
            self.commit(step)
        self.finish()

    # -- for loops resilrun does not own (resilrun.integrations): what steps() does, in pieces ---
    def resume(self) -> int:
        """Restore the newest step every rank holds into the tracked objects; returns it (-1: a
        fresh start). Every rank must call it at the same point: it agrees through collectives."""
        self._seated()
        fix_bucket_layouts(self._tracked.values())
        last = self._restore()
        _ddp_sync.settle(self._tracked.values() if last >= 0 else ())
        self._schedule.start(last)
        return last

    def begin(self, step: int) -> None:
        """Step ``step`` starts (injected faults fire here)."""
        self._seated()
        self._step = step
        if self._faults:
            fire(self._faults, rank=self._rank, step=step, attempt=self._attempt)
        self._probe.watch(self._tracked.values())
        self._probe.started()

    def commit(self, step: int) -> None:
        """Step ``step`` is done and all tracked state is consistent: snapshot it if the schedule
        says so (``--snapshot-every``: every N-th step, N-1, 2N-1, ..., or ``auto``; all ranks
        snapshot the same steps). Under ``auto`` the last step of a measuring window also agrees
        the next interval with every rank (one small all-gather)."""
        self._seated()
        self._probe.ended()
        self._done = step
        saved = self._schedule.due(step)
        blocked = 0.0
        if saved:
            self._unsaved = None
            started = time.perf_counter()
            self._commit(step)
            blocked = time.perf_counter() - started
        else:
            self._unsaved = step
        if self._snapshotter is not None:
            self._snapshotter.finished(step)
        decision = self._schedule.finished(step, saved, blocked)
        if decision is not None:
            self._report_interval(step, decision)
        if not self._reported_first_step:
            self._reported_first_step = True
            self._report("first_step", step=step)

    @property
    def snapshot_interval(self) -> int:
        """Steps between snapshots now (``auto`` changes it as it measures)."""
        return self._seated()._schedule.interval

    @property
    def replica_interval(self) -> int | None:
        """About how many steps apart the snapshots copied to peers are now, under ``--replicate-every
        auto``; None when the agent's ``--replicate-every N`` chooses them."""
        schedule = self._seated()._schedule
        return schedule.interval * schedule.replicate_every if schedule.replicas else None

    def finish(self) -> None:
        """Training is done: its last step is snapshotted (also when ``--snapshot-every`` left it
        out: it is what the persistent tier and ``resilrun export`` should hold), and acknowledged
        before the script goes on."""
        self._seated()
        if self._unsaved is not None:
            step, self._unsaved = self._unsaved, None
            self._commit(step, last=True)
            self._schedule.saved(step)
        if self._snapshotter is not None:
            self._snapshotter.flush()

    # -- internals -------------------------------------------------------------------------------
    def _report(self, event: str, **fields: Any) -> None:
        """A recovery milestone for the agent's timeline; never fails training over it."""
        if self._snapshotter is None:
            return
        try:
            self._snapshotter.report(event, round=self._round, at=time.time(), **fields)
        except Exception as exc:  # noqa: BLE001 - the timeline is informational
            logger.debug("could not report %s to the agent: %s", event, exc)

    def _report_interval(self, step: int, decision: Decision) -> None:
        if self._rank != 0:
            return  # every rank took the same decision: one report for the job
        overhead = decision.overhead
        self._report(
            "snapshot_interval",
            step=step,
            interval=decision.interval,
            quiet_step_s=None if decision.quiet_s is None else round(decision.quiet_s, 6),
            snapshot_cost_s=None if decision.cost_s is None else round(decision.cost_s, 6),
            overhead=None if overhead is None else round(overhead, 5),
            budget=self._schedule.budget,
            **(
                {
                    "replicate_every": decision.replicate_every,
                    "replica_interval": decision.replica_interval,
                    "replica_cost_s": None if decision.replica_cost_s is None else round(decision.replica_cost_s, 6),
                }
                if self._schedule.replicas
                else {}
            ),
        )

    def _collect(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors: dict[str, torch.Tensor] = {}
        trees: dict[str, Any] = {}
        for name, obj in self._tracked.items():
            state = obj if isinstance(obj, torch.Tensor) else obj.state_dict()
            found, trees[name] = flatten(state, name, self._sharding.split)
            tensors.update(found)
        values = {name: flatten(value, f"_values/{name}")[1] for name, value in self._values.items()}
        meta: dict[str, Any] = {
            "format": _FORMAT,
            "objects": trees,
            "values": values,
            "kinds": self._kinds,
            "world_size": self._world_size,  # a restore at another world size reshards (worker/_resize.py)
        }
        meshes = self._sharding.mesh_table()
        if meshes:
            meta["meshes"] = meshes  # where each sharded tensor's shards sit: for export and resharding
        return tensors, meta

    def _commit(self, step: int, *, last: bool = False) -> None:
        """Snapshot ``step``; ``last``: training's last step, which the peers get whatever the
        replica interval (it is what a node lost at the end would need)."""
        if self._snapshotter is None:
            return
        tensors, meta = self._collect()
        replicated = replicated_names(self._tracked.values(), tensors, self._world_size) if self._dedup else frozenset()
        replicate = self._schedule.replicates()
        if last and replicate is not None:
            replicate = True
        self._snapshotter.save(
            step,
            tensors,
            meta,
            replicated,
            previous=self._schedule.last_saved,
            replicate=replicate,
            compute_s=self._probe.take(),
        )

    def _restore(self) -> int:
        """Restore the newest step every rank holds in some tier; returns it (or -1: fresh start).

        A copy can turn out unusable only when it is fetched (a peer replica failing its crc32s, a
        peer gone, node memory too full to take it). Every rank then learns that (one small
        all-gather) and all plan again: the bad copy is gone from what the tiers report (a peer
        drops a replica that failed its checks), so the new plan falls back to another copy or
        tier, and says so. Bounded: after ``_RESTORE_TRIES`` plans the last error is raised.
        """
        snapshotter = self._snapshotter
        if snapshotter is None:
            return -1
        error: CheckpointError | None = None
        for attempt in range(_RESTORE_TRIES):
            plan = self._plan_restore(snapshotter)
            if plan is None:
                return -1
            if attempt == 0:
                fire(self._faults, rank=self._rank, step=RESTORE_STEP, attempt=self._attempt)
            if isinstance(plan, ReshardPlan):
                restored, error = self._restore_resized(snapshotter, plan)
                if restored:
                    return plan.step
                continue
            tier = plan.sources[self._rank]
            error = None
            started = time.monotonic()
            moved = 0
            try:
                if tier is Tier.MEMORY:
                    snapshotter.borrow(plan.step)
                else:
                    moved = snapshotter.fetch(plan.step, "peer" if tier is Tier.PEER else "persistent").nbytes
            except CheckpointError as exc:
                error = exc
            # 1: restored; 0: plan again; -1: refused for good (a persisted step failing its checks
            # or MACs stays so: the job stops, saying why, rather than train on another step quietly)
            final = tier is Tier.PERSISTENT and isinstance(error, CheckpointCorruptError)
            if error is not None:
                logger.warning(
                    "rank %d could not restore step %d from %s: %s; %s",
                    self._rank,
                    plan.step,
                    _TIER_NAMES[tier],
                    error.message,
                    "the job stops" if final else "planning the restore again",
                )
            outcome = 1 if error is None else -1 if final else 0
            worst = min(row[0] for row in _all_gather_ints([outcome], self._world_size, self._device))
            if worst < 0:
                raise StateRefusedError(
                    error.message
                    if final and error is not None
                    else f"another rank's copy of step {plan.step} was refused (see its log)",
                    hint="resilrun inspect-checkpoint --verify tells which file",
                )
            if worst:
                loaded = self._load(snapshotter, plan.step)
                snapshotter.unborrow()  # the load made its own copies: unmap the other ranks' slots
                logger.warning("rank %d resumed from step %d (%s)", self._rank, plan.step, _TIER_NAMES[tier])
                self._report(
                    "state_restored",
                    step=plan.step,
                    tier=_TIER_KEYS[tier],
                    bytes=moved or loaded,
                    seconds=round(time.monotonic() - started, 6),
                )
                return plan.step
        raise error or CheckpointError(
            f"the restore failed {_RESTORE_TRIES} times on other ranks", hint="see the other ranks' logs"
        )

    def _restore_resized(self, snapshotter: Snapshotter, plan: ReshardPlan) -> tuple[bool, CheckpointError | None]:
        """Restore ``plan.step``, written at another world size (worker/_resize.py); whether every
        rank did, and this rank's error if it did not (every rank then plans again)."""
        error: CheckpointError | None = None
        resized = None
        try:
            resized = _resize.bring_in(
                snapshotter, plan, rank=self._rank, tracked=self._tracked, sharding=self._sharding
            )
        except CheckpointError as exc:
            error = exc
            logger.warning(
                "rank %d could not bring in step %d of world size %d: %s; planning the restore again",
                self._rank,
                plan.step,
                plan.world_size,
                exc.message,
            )
        try:
            if not min(row[0] for row in _all_gather_ints([int(error is None)], self._world_size, self._device)):
                return False, error
            assert resized is not None
            join = self._sharding.joiner(self._tracked.values(), self._device, moved=resized.meshes)
            self._apply(resized.tensors, resized.meta, join, plan.step)
        finally:
            if resized is not None:
                resized.release()  # the load made its own copies: unmap the old ranks' slots
        logger.warning(
            "rank %d resumed from step %d (resharded from world size %d: old rank(s) %s, %d bytes brought in)",
            self._rank,
            plan.step,
            plan.world_size,
            rank_ranges(resized.read),
            resized.nbytes,
        )
        self._report(
            "state_restored",
            step=plan.step,
            tier="persistent" if plan.persistent_only else "resharded",
            bytes=resized.nbytes,
            seconds=round(resized.seconds, 6),
            from_world_size=plan.world_size,
        )
        return True, None

    def _plan_restore(self, snapshotter: Snapshotter) -> RestorePlan | ReshardPlan | None:
        """Agree with every rank on the step to restore and where each rank gets it (None: fresh start).

        When any rank's newest snapshot was written at another world size, all plan a resharded
        restore instead (worker/_resize.py)."""
        info = snapshotter.restore_info(self._world_size)
        mine = _pad(info.memory, MEMORY_STEPS) + _pad(info.peer, PEER_STEPS) + _pad([info.persisted], 1)
        gathered = _all_gather_ints([*mine, int(info.resized)], self._world_size, self._device)
        if any(row[-1] for row in gathered):
            return _resize.plan(snapshotter, lambda ints: _all_gather_ints(ints, self._world_size, self._device))
        gathered = [row[:-1] for row in gathered]
        peer_end = MEMORY_STEPS + PEER_STEPS
        available = [
            {
                Tier.MEMORY: frozenset(s for s in row[:MEMORY_STEPS] if s >= 0),
                Tier.PEER: frozenset(s for s in row[MEMORY_STEPS:peer_end] if s >= 0),
                Tier.PERSISTENT: frozenset(s for s in row[peer_end : peer_end + 1] if s >= 0),
            }
            for row in gathered
        ]
        plan = plan_restore(available)
        newest = max((s for row in gathered for s in row), default=-1)
        if plan is None:
            if newest < 0:
                return None  # a fresh job
            bare = [rank for rank, tiers in enumerate(available) if not any(tiers.values())]
            what = (
                f"rank(s) {rank_ranges(bare, ', ')} have none in node memory, peer replicas or persistent storage"
                if bare
                else f"the ranks hold steps no other rank holds ({_holdings(available)})"
            )
            raise StateLostError(
                f"no snapshot step is held by every rank: {what}, while others reached step {newest}",
                hint="the nodes holding them and their replicas were lost together; use --replicas 2 or a "
                "--checkpoint-uri to survive that; to start over from step 0 on purpose, use a new --rdzv-id",
            )
        if self._rank == 0 and plan.step < newest - 1:
            logger.warning(
                "resuming from step %d (%s): steps %d-%d are lost, the newest step held by every rank is older",
                plan.step,
                _TIER_NAMES[plan.slowest],
                plan.step + 1,
                newest,
            )
        return plan

    def _load(self, snapshotter: Snapshotter, step: int) -> int:
        """Load ``step`` from node memory into the tracked objects; returns the bytes loaded.

        Modules and tensors copy what they load into their own storage, so they get views of node
        memory (one copy in all); everything else (optimizers keep the tensors they are given) gets
        private copies. Halving the copies and page faults matters: this is on the recovery path.
        """
        views, meta = snapshotter.load(step)
        self._apply(views, meta, self._sharding.joiner(self._tracked.values(), self._device), step)
        return sum(t.numel() * t.element_size() for t in views.values())

    def _apply(self, views: dict[str, torch.Tensor], meta: Any, join: Joiner, step: int) -> None:
        """Put ``step`` into the tracked objects, gradients cleared as a rebuilt model has them.

        Why clear them: a survivor's re-run may keep its model (``@resilrun.once``), whose gradients
        hold the failed step's partial backward; snapshots never hold gradients, so the state a
        step starts from is always "none yet", as in a process that built its model afresh.
        """
        copies = _Copies(views, self._device)
        for name, obj in self._tracked.items():
            if isinstance(obj, torch.Tensor):
                with torch.no_grad():
                    obj.copy_(unflatten(meta["objects"][name], views, join))
            elif isinstance(obj, torch.nn.Module):
                obj.load_state_dict(unflatten(meta["objects"][name], views, join))
                obj.zero_grad(set_to_none=True)
            else:
                obj.load_state_dict(unflatten(meta["objects"][name], copies, join))
                if isinstance(obj, torch.optim.Optimizer):
                    obj.zero_grad(set_to_none=True)
        self._values.update({name: unflatten(tree, copies) for name, tree in meta["values"].items()})
        self._step = step


def _kind(obj: Any) -> str:
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    return "tensor" if isinstance(obj, torch.Tensor) else "object"


class _Copies(dict[str, torch.Tensor]):
    """Node-memory views by name, handed out as private copies on ``device`` (made on first use)."""

    def __init__(self, views: dict[str, torch.Tensor], device: torch.device) -> None:
        super().__init__()
        self._views, self._device = views, device

    def __missing__(self, name: str) -> torch.Tensor:
        self[name] = copy = self._views[name].to(self._device, copy=True)
        return copy


# A fetch fails only when a copy went bad or away, and each new plan excludes it: a peer holds two
# replica slots per rank, so both bad plus the persistent copy take three plans; one more allows for
# a peer that drops its bad copy a moment after answering. More would only delay the error.
_RESTORE_TRIES = 4


_TIER_NAMES = {Tier.MEMORY: "node memory", Tier.PEER: "peer replica", Tier.PERSISTENT: "persistent storage"}
_TIER_KEYS = {Tier.MEMORY: "memory", Tier.PEER: "peer", Tier.PERSISTENT: "persistent"}


def _holdings(available: list[dict[Tier, frozenset[int]]]) -> str:
    """``"ranks 0-1: memory 14-16; ranks 2-3: peer 12-13"``: who holds what, ranks with equal holdings merged."""
    groups: dict[str, list[int]] = {}
    for rank, tiers in enumerate(available):
        held = ", ".join(f"{_TIER_KEYS[t]} {rank_ranges(sorted(steps))}" for t, steps in tiers.items() if steps)
        groups.setdefault(held, []).append(rank)
    return "; ".join(f"rank(s) {rank_ranges(ranks)}: {held}" for held, ranks in groups.items())


def _pad(steps: list[int | None], count: int) -> list[int]:
    values = [s if s is not None else -1 for s in steps][:count]
    return values + [-1] * (count - len(values))


def fix_bucket_layouts(objects: Any) -> None:
    """Give every tracked DDP model its final gradient-bucket layout before the first step.

    DDP normally rebuilds its buckets after its first iteration, in the order gradients became
    ready. A job resumed from a snapshot builds a fresh DDP whose first step would then use the
    initial layout, summing gradients in a different order than the failure-free run did at that
    step (bitwise drift with 3+ ranks). Rebuilding up front, the same way on every run, gives every
    step of every run the same layout. The rebuild is a broadcast from rank 0: all ranks get here.
    Trade-off: buckets follow parameter registration order, which overlaps less communication with
    the backward pass than the ready order would.
    """
    for obj in objects:
        if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
            _torch_compat.rebuild_ddp_buckets(obj)  # without the interface: warned once, layout left to DDP


def _all_gather_ints(values: list[int], world_size: int, device: torch.device) -> list[list[int]]:
    if world_size == 1 or not dist.is_initialized():
        return [values]
    mine = torch.tensor(values, dtype=torch.int64, device=device if dist.get_backend() == "nccl" else "cpu")
    out = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]
