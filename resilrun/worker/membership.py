"""How this process joins, leaves and re-enters the job's generations.

``init()`` joins the current generation (process group, snapshots, heartbeat, the watchdog that
aborts this generation's collectives when the next one is announced); ``reset_for_reentry()``
leaves it so the worker bootstrap can run the script again in-process; ``stand_by()`` is where a
hot spare waits for a rank. Kept apart from ``Job`` (what is snapshotted and restored) because
this is process-wide state that outlives any one ``Job``: one heartbeat thread per process, the
fact that it took part in a generation, and what frameworks must forget between generations.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from resilrun.channel_protocol import AwaitAssignment, AwaitGeneration, Beat, HelloApi, HelloRerun, Report
from resilrun.env import (
    UNHEALTHY_EXIT_CODE,
    WorkerVariables,
    agent_socket_path,
    apply_assignment,
    ensure_rendezvous_defaults,
    read_worker_variables,
)
from resilrun.worker import _ddp_sync, _torch_compat, health, pending
from resilrun.worker._abort import GenerationWatchdog, SetupGuard, opened_since, peer_hosts, shut_down, tcp_sockets
from resilrun.worker.agent_client import AgentClient
from resilrun.worker.faults import isolated, parse_faults, unhealthy
from resilrun.worker.job import Job, Seat
from resilrun.worker.snapshot import Snapshotter

logger = logging.getLogger(__name__)
T = TypeVar("T")

_JOB: Job | None = None
# Set once this process took part in a generation (or was assigned a rank as a spare): from then on a
# failure while it joins a later generation (its process group set up against a worker store that a
# newer generation already replaced) is recovered in-process like a broken collective.
_TOOK_PART = False
# A plain script's worker under --rerun-in-process: the watchdog of the generation it runs in (None
# while it cannot re-run: never registered, or refused with the reason below).
_RERUN_WATCHDOG: GenerationWatchdog | None = None
_RERUN_REFUSED: str | None = None
# Set while init() builds the API's own group: the --rerun-in-process wrapper must leave it alone.
_API_JOINING = False
_DEVICE_CHECKED = False  # this process's device passed its check (once per process: worker/health.py)
# A spare given a rank, until it completed its first collective with the others (health.hand_off).
_PROMOTED = False
# A spare asks again after this long, so a wedged agent shows up as an error, not a silent hang.
_SPARE_POLL_S = 60.0


def init(backend: str | None = None, timeout: timedelta | None = None) -> Job:
    """Join the job: set up torch.distributed's default group and this rank's snapshots.

    A hot spare running the script ahead (``worker/pending.py``) gets a Job that joins when first
    asked for anything that depends on its rank; the set-up between here and that moment runs
    before any rank has failed. A spare without a head start never gets here before it has a rank:
    it waits in resilrun's worker bootstrap, before the script's first line (see ``stand_by``).

    Args:
        backend: ``nccl`` when CUDA is available, else ``gloo``, unless given.
        timeout: collective timeout passed to ``init_process_group``.
    """
    global _JOB
    if _JOB is not None:
        return _JOB
    head_start = pending.current()
    if head_start is not None:
        job = _JOB = Job(lambda: _join(job, backend, timeout))
        head_start.on_seat(job._seated)  # a rank read elsewhere (RANK, DDP(model)) joins it too
        return job
    if read_worker_variables().spare:
        # Spares wait in resilrun's worker bootstrap, before the script runs; getting here means the
        # script was started some other way with a spare's environment.
        raise RuntimeError(
            "resilrun.init() was called in a hot spare that has no rank yet; spares wait in resilrun's "
            "worker bootstrap (python -m resilrun.worker_main SCRIPT), which --no-python skips"
        )
    job = Job(lambda: _join(job, backend, timeout))
    _JOB = job._seated()  # only a job that joined is this process's (a failed join raises here)
    return job


def _join(job: Job, backend: str | None, timeout: timedelta | None) -> Seat:
    """Join this process's generation for ``job``: its process group, snapshots, heartbeat."""
    global _API_JOINING
    variables = read_worker_variables()
    client = AgentClient(variables.agent_socket) if variables.agent_socket else None
    use_cuda = torch.cuda.is_available() and (backend in (None, "nccl"))
    device = torch.device("cuda", variables.local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if client is not None:
        _check_device(client, device, variables)
    group_sockets: dict[int, int] = {}
    before: dict[int, int] = {}
    pg_seconds: float | None = None
    if not dist.is_initialized():
        ensure_rendezvous_defaults()
        kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        before = tcp_sockets()
        guard = _start_setup_guard(variables.agent_socket, variables.round, before) if variables.agent_socket else None
        pg_started = time.monotonic()
        _API_JOINING = True
        try:
            dist.init_process_group(
                backend or ("nccl" if use_cuda else "gloo"),
                rank=variables.rank,
                world_size=variables.world_size,
                **kwargs,
            )
        finally:
            _API_JOINING = False
            if guard is not None:
                guard.finish()
        group_sockets = {fd: inode for fd, inode in tcp_sockets().items() if before.get(fd) != inode}
        pg_seconds = time.monotonic() - pg_started
    snapshotter = None
    if client is not None:
        client.call(HelloApi(pid=os.getpid()))
        first = variables.rank - variables.local_rank
        group = range(first, first + variables.local_world_size)
        snapshotter = Snapshotter(client, variables.rank, group, variables.round)
    else:
        logger.warning("not started by resilrun: training runs, but steps are not snapshotted")
    seat = Seat(
        rank=variables.rank,
        world_size=variables.world_size,
        local_rank=variables.local_rank,
        device=device,
        snapshotter=snapshotter,
        faults=parse_faults(variables.faults),
        attempt=variables.attempt,
        round=variables.round,
        dedup=variables.dedup,
        snapshot_every=variables.snapshot_every,
        max_overhead=variables.max_overhead,
        replicate_auto=variables.replicate_auto,
    )
    first_collective_s = None
    if variables.agent_socket:
        _ddp_sync.install()
        job._watchdog = _follow_generations(
            variables.agent_socket, variables.round, before, group_sockets, variables.heartbeat_interval_s
        )
        if snapshotter is not None:  # the API's own group (a plain script's is its own business)
            try:
                first_collective_s = _hand_off(device, variables)
            except BaseException:
                # This generation is over for this process: the next one has its own watchdog and
                # snapshots. It took part in it (its group was set up): its failure is recovered
                # in-process like a broken collective, from the first generation on.
                job._watchdog.disarm()
                snapshotter.close()
                _took_part()
                raise
    if pg_seconds is not None and snapshotter is not None:
        _report_joined(snapshotter, variables.round, pg_seconds, first_collective_s)
    return seat


def _check_device(client: AgentClient, device: torch.device, variables: WorkerVariables) -> None:
    """Once per process, before it first joins a generation (worker/health.py): a device that fails
    ends the process with ``UNHEALTHY_EXIT_CODE``, after telling its agent why; the agent then gives
    the rank to the next spare."""
    global _DEVICE_CHECKED
    if _DEVICE_CHECKED:
        return
    _DEVICE_CHECKED = True
    plan = parse_faults(variables.faults)
    check = health.check_device(device, fail=unhealthy(plan, rank=variables.rank, round=variables.round))
    reason = health.judge(check, variables.expected_gflops)
    detail = {**check.to_dict(), "reason": reason, "round": variables.round, "check": "device"}
    detail["expected_gflops"] = variables.expected_gflops
    client.call(Report(pid=os.getpid(), rank=variables.rank, event="device_checked", detail=detail))
    if reason:
        _exit_unhealthy(variables.rank, f"its device failed its check: {reason}")


def _hand_off(device: torch.device, variables: WorkerVariables) -> float:
    """The generation's first collective (worker/health.py): bounded for a spare given a rank, which
    ends the process with ``UNHEALTHY_EXIT_CODE`` when it cannot complete it in time."""
    global _PROMOTED
    promoted = _PROMOTED
    budget = (variables.peer_check_s or health.PEER_BUDGET_S) if promoted else None

    def overdue(budget_s: float) -> None:
        reason = f"its first collective with the other ranks did not complete within {budget_s:g} s"
        detail = {"device": str(device), "reason": reason, "round": variables.round, "check": "collective"}
        try:
            client = AgentClient(variables.agent_socket or "")
            client.call(Report(pid=os.getpid(), rank=variables.rank, event="device_checked", detail=detail))
        except Exception as exc:  # noqa: BLE001 - the exit code alone still tells the agent
            logger.debug("could not report the failed collective: %s", exc)
        _exit_unhealthy(variables.rank, reason)

    hang = promoted and isolated(parse_faults(variables.faults), rank=variables.rank, round=variables.round)
    arrive, everyone_here = _arrivals(variables)
    arrive()
    seconds = health.hand_off(device, budget, overdue, hang=hang, everyone_here=everyone_here)
    _PROMOTED = False  # only now: a spare whose hand-off broke (another failure) is still new to the next one
    return seconds


def _arrivals(variables: WorkerVariables) -> tuple[Callable[[], None], Callable[[], None] | None]:
    """Each rank counts itself in the group's store as it reaches the hand-off; a promoted spare's
    budget starts once all have (``everyone_here``), so that it is not charged for the others'
    re-entry (setting up an NCCL group waits for no one). Without the store: both do nothing."""
    store = _torch_compat.default_store()
    if store is None:
        return lambda: None, None
    key = f"resilrun/hand-off/{variables.round}"

    def arrive() -> None:
        if store.add(key, 1) == variables.world_size:
            store.set(f"{key}/all", b"1")

    return arrive, lambda: store.wait([f"{key}/all"])


def _took_part() -> None:
    global _TOOK_PART
    _TOOK_PART = True


def _exit_unhealthy(rank: int, reason: str) -> None:
    logger.error("this process does not take rank %d: %s", rank, reason)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(UNHEALTHY_EXIT_CODE)


def _report_joined(snapshotter: Snapshotter, generation: int, seconds: float, first_collective_s: float | None) -> None:
    """The process group's set-up time, for the agent's recovery timeline (informational)."""
    try:
        extra = {} if first_collective_s is None else {"first_collective_s": round(first_collective_s, 6)}
        snapshotter.report("collectives_rebuilt", round=generation, at=time.time(), seconds=round(seconds, 6), **extra)
    except Exception as exc:  # noqa: BLE001 - the timeline is informational
        logger.debug("could not report collectives_rebuilt to the agent: %s", exc)


def _follow_generations(
    agent_socket: str, round: int, before: dict[int, int], group_sockets: dict[int, int], heartbeat_interval_s: float
) -> GenerationWatchdog:
    """What lets a process that joined generation ``round`` move to the next one in-process (the API's
    ``init()`` and a re-runnable plain script alike): its DataLoader workers are tracked (stopped
    with the generation), a watchdog aborts the generation's collectives once the next one is
    published (a survivor blocked in NCCL or gloo wakes), and the heartbeat runs."""
    _torch_compat.track_dataloader_workers()  # stopped with the generation (reset_for_reentry)
    watchdog = _start_watchdog(agent_socket, round, before, group_sockets)
    _start_heartbeat(agent_socket, heartbeat_interval_s)
    return watchdog


def set_up_plain_group(setup: Callable[[], T]) -> T:
    """Run a plain script's own ``init_process_group`` (``setup``) under ``--rerun-in-process``, then
    register the process as able to re-run the script (``join_for_rerun``).

    A process re-running the script (or a spare given a rank) is guarded while it sets up, as
    ``init()`` is: a generation superseded meanwhile (another rank failed) would leave it waiting on
    a store that is gone; its connections are shut down instead and the setup fails, to be recovered.
    """
    variables = read_worker_variables()
    before = tcp_sockets()
    guarded = _TOOK_PART and _RERUN_REFUSED is None and not variables.spare and not _API_JOINING
    agent_socket = variables.agent_socket
    guard = _start_setup_guard(agent_socket, variables.round, before) if guarded and agent_socket else None
    try:
        result = setup()
    finally:
        if guard is not None:
            guard.finish()
    try:
        join_for_rerun(before)
    except Exception as exc:  # noqa: BLE001 - the script runs on; a failure then restarts the job
        sys.stderr.write(f"resilrun: cannot re-run the script in-process: {type(exc).__name__}: {exc}\n")
    return result


def join_for_rerun(before: dict[int, int]) -> None:
    """A plain script's own ``init_process_group`` just succeeded (``--rerun-in-process``): tell the
    agent whether this process can re-run the script after a failure, and if so follow generations
    as ``init()`` does. ``before``: the process's TCP sockets before the group was built.

    Why only now: the watchdog aborts this group's collectives, so it needs the group; and what
    cannot be reset (below) is judged as late as possible (it is judged again at the failure).
    """
    global _RERUN_WATCHDOG
    variables = read_worker_variables()
    if _API_JOINING or _JOB is not None or variables.spare or not variables.agent_socket:
        return  # the API's own group, a spare's warm-up, or not a resilrun worker
    if _RERUN_WATCHDOG is not None:  # a second group of the script's (a new default after a destroy)
        _RERUN_WATCHDOG.disarm()
        _RERUN_WATCHDOG = None
    if refuse_rerun(rerun_blockers()):
        return
    group_sockets = {fd: inode for fd, inode in tcp_sockets().items() if before.get(fd) != inode}
    _RERUN_WATCHDOG = _follow_generations(
        variables.agent_socket, variables.round, before, group_sockets, variables.heartbeat_interval_s
    )


def rerun_blockers() -> str:
    """What this process holds that re-running the script in it would not reset ("" when nothing
    found): the script's own non-daemon threads would run on beside the new run (and NVRx's
    in-process restart showed that leftovers of the failed run are what breaks the next one), and
    captured CUDA graphs point at the old run's memory. Only what can be detected is listed here;
    docs/captured-checkpoints.md lists the rest."""
    main = threading.main_thread()
    threads = sorted(t.name for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive())
    if threads:
        return f"the script's non-daemon thread(s) {', '.join(threads[:3])} would keep running"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        graph = getattr(torch.cuda, "CUDAGraph", None)
        # type(), not isinstance(): the latter asks each object's __class__, which some proxies warn on.
        if isinstance(graph, type) and any(issubclass(type(obj), graph) for obj in gc.get_objects()):
            return "CUDA graphs were captured (they hold the failed run's memory)"
    return ""


def refuse_rerun(reason: str) -> bool:
    """Tell the agent whether this plain script's process can re-run in-process; True if not (it then
    says why on stderr once, and a failure restarts the job the torchrun way)."""
    global _RERUN_REFUSED, _RERUN_WATCHDOG
    socket_path = agent_socket_path()
    if socket_path:
        client = AgentClient(socket_path)
        try:
            client.call(HelloRerun(pid=os.getpid(), reason=reason))
        finally:
            client.close()
    if not reason:
        _RERUN_REFUSED = None
        return False
    if reason != _RERUN_REFUSED:
        rank = read_worker_variables().rank
        sys.stderr.write(
            f"resilrun: rank {rank} cannot re-run its script in-process: {reason}; a failure restarts the job\n"
        )
    _RERUN_REFUSED = reason
    if _RERUN_WATCHDOG is not None:
        _RERUN_WATCHDOG.disarm()
        _RERUN_WATCHDOG = None
    return True


def reruns_plain_script() -> bool:
    """Whether this process is a plain script's worker registered to re-run it in-process."""
    return _RERUN_WATCHDOG is not None


_HEARTBEAT: threading.Thread | None = None


def _start_heartbeat(agent_socket: str, interval_s: float) -> None:
    """Once per process: a thread that tells the agent this process still runs Python (a frozen one
    cannot). It outlives generations, so a survivor re-entering the script keeps beating."""
    global _HEARTBEAT
    if _HEARTBEAT is not None:
        return
    client = AgentClient(agent_socket)

    def beat() -> None:
        while True:
            job = _JOB
            # The newest finished step rides along: with --snapshot-every N > 1 most steps send
            # nothing else, and the agent's hang detection counts progress, not snapshots.
            step = job.done if job is not None else -1
            try:
                client.call(Beat(pid=os.getpid(), step=step))
            except Exception:  # noqa: BLE001 - the agent is gone; the process will be stopped anyway
                return
            time.sleep(interval_s)

    _HEARTBEAT = threading.Thread(target=beat, name="resilrun-heartbeat", daemon=True)
    _HEARTBEAT.start()


def _start_watchdog(
    agent_socket: str, round: int, before: dict[int, int], group_sockets: dict[int, int]
) -> GenerationWatchdog:
    client = AgentClient(agent_socket)

    def wait_for_next() -> bool:
        reply, _ = client.call(AwaitGeneration(pid=os.getpid(), round=round, timeout_s=_SPARE_POLL_S))
        return bool(reply.env)

    watchdog = GenerationWatchdog(wait_for_next, _abort_for(before, group_sockets), client.interrupt, client.close)
    watchdog.start()
    return watchdog


def _start_setup_guard(agent_socket: str, round: int, before: dict[int, int]) -> SetupGuard:
    client = AgentClient(agent_socket)

    def wait_for_next() -> bool:
        reply, _ = client.call(AwaitGeneration(pid=os.getpid(), round=round, timeout_s=_SPARE_POLL_S))
        return bool(reply.env)

    guard = SetupGuard(wait_for_next, client.interrupt, before, release=client.close)
    guard.start()
    return guard


def _abort_for(before: dict[int, int], group_sockets: dict[int, int]) -> Callable[[], None]:
    """What aborts the collectives of the generation that exists now (and only that one): its
    default group and the subgroups the script builds on it (a DeviceMesh's dimensions)."""
    group = dist.group.WORLD if dist.is_initialized() else None
    nccl = group is not None and dist.get_backend(group) == "nccl"
    hosts = peer_hosts(group_sockets)

    def abort() -> None:
        if nccl and group is not None:
            # Subgroups are found in torch's registry, which holds this generation's groups only
            # while its default group is still the current one.
            current = dist.group.WORLD is group
            for member in (_torch_compat.process_groups(newest_first=True) if current else []) or [group]:
                try:
                    member.abort()
                except Exception as exc:  # noqa: BLE001 - already destroyed: nothing left to abort
                    logger.debug("aborting the previous generation's group: %s", exc)
        else:
            shut_down({**group_sockets, **opened_since(before, hosts)})

    return abort


def stand_by() -> None:
    """A hot spare without a head start: pay the first-DDP cost, then block until the agent gives
    this process a rank and adopt that rank's environment (called by the worker bootstrap before
    the script runs).

    Raises:
        CheckpointError: the agent is gone (the spare then exits; a new agent starts new spares).
    """
    _prewarm()
    _take_assignment(_await_assignment())


def run_ahead() -> bool:
    """A hot spare with a head start: pay the first-DDP cost, then let the script run while every
    read of a rank-dependent value waits for the assignment (``worker/pending.py``). Returns False
    where this torch cannot hold those reads (the caller then stands by instead)."""
    if not _torch_compat.can_wait_on_default_group():
        return False
    _prewarm()
    # What the script builds ahead must be built as the survivors build theirs: a DDP that skips its
    # start-up broadcast (theirs do: a spare broadcasting alone would wait forever), DataLoader
    # iterators that stop with the generation.
    _ddp_sync.install()
    _torch_compat.track_dataloader_workers()
    pending.start(pending.HeadStart(_await_assignment, _take_assignment, _torch_compat.wait_on_default_group))
    return True


def _await_assignment() -> dict[str, str]:
    """Block until the agent gives this spare a rank; that rank's environment."""
    client = AgentClient(agent_socket_path() or "")
    try:
        while True:
            reply, _ = client.call(AwaitAssignment(pid=os.getpid(), timeout_s=_SPARE_POLL_S))
            if reply.env:
                return dict(reply.env)
    finally:
        client.close()


def _take_assignment(env: Mapping[str, str]) -> None:
    global _TOOK_PART, _PROMOTED
    _TOOK_PART = _PROMOTED = True
    apply_assignment(env)


def _prewarm() -> None:
    """Pay the first-DDP import cost (~800 modules, seconds) now, while the spare is idle."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    finally:
        dist.destroy_process_group()


# What frameworks keep process-wide about the generation they ran in (resilrun.integrations).
_REENTRY_HOOKS: list[Callable[[], None]] = []


def on_reentry(hook: Callable[[], None]) -> None:
    """Run ``hook`` whenever this process leaves a generation to run the script again (once per hook).

    Why: a framework that caches its distributed state in singletons (Accelerate's ``PartialState``
    and ``GradientState``) would hand the next run of the script the torn-down generation's."""
    if hook not in _REENTRY_HOOKS:
        _REENTRY_HOOKS.append(hook)


def reset_for_reentry() -> None:
    """Forget this generation's job and process group, so the script can run again in-process."""
    global _JOB, _TOOK_PART, _RERUN_WATCHDOG
    job, _JOB = _JOB, None
    _TOOK_PART = True
    for hook in _REENTRY_HOOKS:
        try:
            hook()
        except Exception as exc:  # noqa: BLE001 - a framework's leftovers must not stop the recovery
            logger.warning("resetting framework state for the next generation failed: %s", exc)
    stopped = _torch_compat.stop_dataloader_workers()
    if stopped:
        logger.info("stopped the worker processes of %d DataLoader iterator(s) of the failed generation", stopped)
    _ddp_sync.uninstall()  # the next generation's init() installs it again
    if job is not None and job._watchdog is not None:
        job._watchdog.disarm()
    if job is not None:
        job._probe.close()  # a model kept across the re-run gets the next job's hook, not one more
    if _RERUN_WATCHDOG is not None:
        _RERUN_WATCHDOG.disarm()
        _RERUN_WATCHDOG = None
    snapshotter = getattr(job, "_snapshotter", None)  # a spare's Job that never took its seat has none
    if snapshotter is not None:
        snapshotter.close()
    if dist.is_initialized():
        for step in (dist.destroy_process_group,):
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - a broken group may fail to tear down; a new one replaces it
                logger.debug("tearing down the broken process group: %s", exc)
    else:
        _forget_failed_group_setup()


def _forget_failed_group_setup() -> None:
    """Undo what a failed ``init_process_group`` left behind: torch counted the group it could not
    build, and names the next one after that count (its keys in the worker store are prefixed by
    it). A process that retried with the count at 1 would wait forever for peers writing under 0.
    ``destroy_process_group`` resets the count, but only for a group that exists."""
    _torch_compat.reset_group_counter()  # without the counter: warned once, nothing to reset


def is_active() -> bool:
    """Whether this process is part of the job through ``resilrun.init()``, now or in an earlier
    generation (or as an assigned spare), or runs a plain script it can re-run
    (``--rerun-in-process``): its failures can be recovered in-process."""
    if pending.current() is not None:
        return False  # a spare running ahead has no generation yet: its own error is the failure
    if _JOB is None and _RERUN_REFUSED is not None:
        return False  # a plain script holding what cannot be reset: it fails the torchrun way
    return _JOB is not None or _TOOK_PART or _RERUN_WATCHDOG is not None
