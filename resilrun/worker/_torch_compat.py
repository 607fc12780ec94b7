"""Every private torch interface resilrun touches, each behind a probe with a stated fallback.

Why: private attributes change or vanish in any torch release without notice. Gathered here, a
torch upgrade means checking one file (and its tests, tests/unit/test_torch_compat.py), and a
missing attribute costs a feature named in one warning instead of an ``AttributeError`` in the
middle of a recovery. Each probe runs once per process (``forget_probes`` re-runs them, for tests).

What resilrun does when a probe fails:

- ``deferred_ddp_sync``: DDP keeps torch's own start-up broadcast (a recovery pays for it again).
- ``ddp_bucket_rebuild``: DDP rebuilds its buckets after its first step as torch does; a resumed
  job may then sum gradients in another order than the failure-free run (bitwise drift, 3+ ranks).
- ``group_counter``: the counter is left as is; a process whose group setup failed midway may not
  meet its peers when it retries in-process.
- ``cuda_host_register``: snapshot buffers stay pageable; device-to-host copies are synchronous.
- ``group_registry``: with NCCL, only the default group is aborted when a generation ends; a rank
  blocked in a subgroup's collective (HSDP, tensor parallel) waits for NCCL's own timeout.
- ``strided_shard``: a DTensor with a strided shard (FSDP over tensor parallel on one dim) cannot be
  snapshotted (a TypeError at the first commit names it); every other placement is public API.
- ``dataloader_workers``: the DataLoader worker processes of a failed generation end only when the
  iterator that started them is garbage-collected (a framework's reference cycle can delay that).
- ``ddp_hook_removal``: a failed generation's DDP keeps its gradient hooks on the parameters; a
  model kept across a re-run (``@resilrun.once``) then depends on that DDP being garbage-collected.
- ``cuda_fork_state``: the node's worker template does not import the script's packages (each worker
  imports them itself, as before): it could not tell whether one of them touched CUDA, which would
  leave every worker forked from it unable to use the GPU.
- ``nvml_device_check``: a library that checks for a GPU as the worker template imports it
  initialises the CUDA driver there; the template then starts again without the script's packages.
- ``default_group_read``: a hot spare gets no head start (it waits for its rank before the script's
  first line, as it did before the head start existed).

Every probe holds on the torch versions ``pyproject.toml`` declares (``TESTED_TORCH``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)

# The torch release every test runs on; keep in step with the torch pin of pyproject.toml.
TESTED_TORCH = "2.13"


@dataclass(frozen=True)
class Probe:
    """Whether one private interface is there, and what resilrun does when it is not."""

    name: str
    holds: bool
    fallback: str


_FALLBACKS = {
    "deferred_ddp_sync": "DDP keeps torch's own start-up broadcast",
    "ddp_bucket_rebuild": "bucket layout left to DDP: bitwise equality after a recovery not guaranteed with 3+ ranks",
    "group_counter": "group counter not reset: an in-process retry after a failed group setup may not meet its peers",
    "cuda_host_register": "snapshot buffers stay pageable: device-to-host copies are synchronous",
    "group_registry": "only the default NCCL group is aborted: a rank blocked in a subgroup waits for its timeout",
    "strided_shard": "DTensors with strided shards (FSDP over tensor parallel on one dim) cannot be snapshotted",
    "dataloader_workers": "a failed generation's DataLoader workers end only when their iterator is collected",
    "ddp_hook_removal": "a failed generation's DDP keeps its hooks on a model kept across a re-run until collected",
    "default_group_read": "hot spares wait for their rank before the script's first line (no head start)",
    "default_store": "a spare's hand-off budget starts at its group's set-up, not once every rank arrived",
    "cuda_fork_state": "the worker template does not import the script's packages (each worker imports them)",
    "nvml_device_check": "a library checking for a GPU as it loads leaves the worker template unfit to fork",
}
_WARNED: set[str] = set()


@functools.cache
def _sync_helpers() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """torch's own start-up checks and broadcast, as DDP's ``init_sync`` runs them."""
    try:
        from torch.distributed.utils import _sync_module_states, _verify_param_shape_across_processes
    except ImportError:
        return None
    init = DistributedDataParallel.__init__
    if "init_sync" not in inspect.signature(init).parameters:
        return None
    if not hasattr(DistributedDataParallel, "_build_params_for_reducer"):
        return None
    return _sync_module_states, _verify_param_shape_across_processes


@functools.cache
def _bucket_rebuild_probe() -> bool:
    reducer = getattr(dist, "Reducer", None)
    return all(hasattr(reducer, name) for name in ("_rebuild_buckets", "_push_all_rebuilt_params"))


@functools.cache
def _group_counter_probe() -> bool:
    world = getattr(dist.distributed_c10d, "_world", None)
    return world is not None and hasattr(world, "group_count")


@functools.cache
def _host_register_probe() -> bool:
    # torch.cuda.cudart() would initialise CUDA; the module it returns can be looked at without that.
    runtime = getattr(torch._C, "_cudart", None)
    return callable(getattr(torch.cuda, "cudart", None)) and hasattr(runtime, "cudaHostRegister")


@functools.cache
def _group_registry_probe() -> bool:
    world = getattr(dist.distributed_c10d, "_world", None)
    return world is not None and isinstance(getattr(world, "pg_names", None), dict)


@functools.cache
def _strided_shard_probe() -> type | None:
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return None
    if not all(hasattr(_StridedShard, name) for name in ("dim", "split_factor")):
        return None
    return _StridedShard


@functools.cache
def _loader_iterator_probe() -> type | None:
    from torch.utils.data import dataloader

    iterator = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
    if iterator is None or not callable(getattr(iterator, "_shutdown_workers", None)):
        return None
    return iterator


@functools.cache
def _hook_removal_probe() -> bool:
    return callable(getattr(DistributedDataParallel, "_remove_autograd_hooks", None))


@functools.cache
def _default_group_probe() -> property | None:
    """torch reads its default group through one property of its process-group registry."""
    world = getattr(dist.distributed_c10d, "_world", None)
    prop = getattr(type(world), "default_pg", None)
    if world is None or not isinstance(prop, property) or prop.fset is None or not hasattr(world, "_default_pg"):
        return None
    return prop


@functools.cache
def _default_store_probe() -> bool:
    return callable(getattr(dist.distributed_c10d, "_get_default_store", None))


@functools.cache
def _bad_fork_probe() -> bool:
    """torch marks a process forked after CUDA was queried (its fork handler, armed by the first
    device count); a CPU-only build has no such state, and then a function that says False."""
    return callable(getattr(torch.cuda, "_is_in_bad_fork", None))


@functools.cache
def _nvml_check_probe() -> bool:
    """torch.cuda.is_available() asks NVML instead of the driver when this says so (what
    PYTORCH_NVML_BASED_CUDA_CHECK=1 does, without changing the environment)."""
    return callable(getattr(torch.cuda, "_nvml_based_avail", None))


_PROBES: dict[str, Callable[[], Any]] = {
    "deferred_ddp_sync": _sync_helpers,
    "ddp_bucket_rebuild": _bucket_rebuild_probe,
    "group_counter": _group_counter_probe,
    "cuda_host_register": _host_register_probe,
    "group_registry": _group_registry_probe,
    "strided_shard": _strided_shard_probe,
    "dataloader_workers": _loader_iterator_probe,
    "ddp_hook_removal": _hook_removal_probe,
    "default_group_read": _default_group_probe,
    "default_store": _default_store_probe,
    "cuda_fork_state": _bad_fork_probe,
    "nvml_device_check": _nvml_check_probe,
}


def report() -> list[Probe]:
    """Each probe on the running torch (for a debug log line, and for the tests)."""
    return [Probe(name, bool(probe()), _FALLBACKS[name]) for name, probe in _PROBES.items()]


def forget_probes() -> None:
    """Probe again on next use, and warn again (a test that removed an attribute needs both)."""
    for probe in _PROBES.values():
        probe.cache_clear()  # type: ignore[attr-defined]  # every probe is functools.cache'd
    _WARNED.clear()


def _fall_back(name: str) -> None:
    if name not in _WARNED:
        _WARNED.add(name)
        logger.warning(
            "torch %s lacks a private interface resilrun uses (%s; tested with torch %s): %s",
            torch.__version__,
            name,
            TESTED_TORCH,
            _FALLBACKS[name],
        )


def cuda_unusable_after_fork() -> bool | None:
    """In a forked process: whether CUDA can no longer be used here because the parent had queried
    it (torch then raises "Cannot re-initialize CUDA in forked subprocess"); None when this torch
    cannot say."""
    if not _bad_fork_probe():
        _fall_back("cuda_fork_state")
        return None
    return bool(torch.cuda._is_in_bad_fork())


@contextlib.contextmanager
def device_checks_through_nvml() -> Iterator[None]:
    """Within: ``torch.cuda.is_available()`` asks NVML, which leaves no CUDA state that a forked
    process would inherit, instead of initialising the driver. Why not the environment variable
    that does the same: a package imported meanwhile may set it for itself, and keeps it."""
    if not _nvml_check_probe():
        _fall_back("nvml_device_check")
        yield
        return
    original = torch.cuda._nvml_based_avail
    torch.cuda._nvml_based_avail = lambda: True
    try:
        yield
    finally:
        torch.cuda._nvml_based_avail = original


def can_defer_ddp_sync() -> bool:
    """Whether DDP can be built without its start-up sync and synced later by ``sync_ddp_start``."""
    if _sync_helpers() is None:
        _fall_back("deferred_ddp_sync")
        return False
    return True


def sync_ddp_start(ddp: DistributedDataParallel, *, broadcast_buffers: bool) -> None:
    """Run what DDP's ``init_sync`` would have run at construction: same checks, same broadcast.

    Raises:
        RuntimeError: the helpers are missing; only a DDP built after ``can_defer_ddp_sync()``
            said True gets here, so this means torch changed under a running process.
    """
    helpers = _sync_helpers()
    if helpers is None:
        raise RuntimeError(f"torch {torch.__version__} lacks DDP's start-up sync helpers (tested: {TESTED_TORCH})")
    sync_module_states, verify_shapes = helpers
    parameters, _ = ddp._build_params_for_reducer()
    verify_shapes(ddp.process_group, parameters)
    sync_module_states(
        module=ddp.module,
        process_group=ddp.process_group,
        broadcast_bucket_size=ddp.broadcast_bucket_size,
        src=0,
        params_and_buffers_to_ignore=ddp.parameters_to_ignore,
        broadcast_buffers=broadcast_buffers,
    )


def rebuild_ddp_buckets(ddp: DistributedDataParallel) -> bool:
    """Give ``ddp`` its final bucket layout now, as DDP would after its first step.

    The rebuild is a collective (rank 0's layout is broadcast), so every rank must call it; the
    probe answers the same on all of them, as they run the same torch. False: nothing was done
    (already rebuilt, or the interface is missing, which is warned about once).
    """
    if not _bucket_rebuild_probe() or not hasattr(ddp, "_has_rebuilt_buckets"):
        _fall_back("ddp_bucket_rebuild")
        return False
    if ddp._has_rebuilt_buckets:
        return False
    ddp.reducer._push_all_rebuilt_params()
    if ddp.reducer._rebuild_buckets():
        ddp._has_rebuilt_buckets = True
        return True
    return False


def reset_group_counter() -> bool:
    """Set torch's count of process groups built back to 0 (it names the next group); False if absent."""
    if not _group_counter_probe():
        _fall_back("group_counter")
        return False
    dist.distributed_c10d._world.group_count = 0
    return True


def pin_host_memory(data_ptr: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` of host memory at ``data_ptr`` for CUDA; False when it could not be."""
    if not _host_register_probe():
        if torch.version.cuda is not None:  # on a CPU build there is nothing to pin for: no warning
            _fall_back("cuda_host_register")
        return False
    return int(torch.cuda.cudart().cudaHostRegister(data_ptr, nbytes, 0)) == 0


def strided_shard_type() -> type | None:
    """DTensor's strided-shard placement class (``dim``, ``split_factor``); None when it is gone."""
    found = _strided_shard_probe()
    if found is None:
        _fall_back("strided_shard")
    return found


def process_groups(*, newest_first: bool = False) -> list[Any]:
    """Every live process group of this process, the default one included; [] without the registry."""
    if not _group_registry_probe():
        _fall_back("group_registry")
        return []
    groups = list(dist.distributed_c10d._world.pg_names)  # in the order they were built
    return groups[::-1] if newest_first else groups


# Every DataLoader iterator with worker processes made in this process and not yet collected.
_LOADER_ITERATORS: weakref.WeakSet[Any] = weakref.WeakSet()


def track_dataloader_workers() -> bool:
    """Note every multi-process DataLoader iterator made from now on; False without the interface.

    Why: when a generation fails, its DataLoader iterators are still referenced from the failed
    frames, and a framework's reference cycles can keep them long after; their worker processes
    (each with a copy of the dataset) would wait idle beside the next generation's."""
    iterator = _loader_iterator_probe()
    if iterator is None:
        _fall_back("dataloader_workers")
        return False
    if iterator.__dict__.get("__resilrun_tracked__"):
        return True
    made = iterator.__init__

    @functools.wraps(made)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - the method it wraps
        made(self, *args, **kwargs)
        _LOADER_ITERATORS.add(self)

    iterator.__init__ = __init__
    iterator.__resilrun_tracked__ = True
    return True


def stop_dataloader_workers() -> int:
    """Shut down the workers of every tracked DataLoader iterator the way it would itself (its queues
    told to stop, the processes joined, their pids unregistered from torch's SIGCHLD check, which
    would otherwise report a killed worker as a failure); returns how many iterators were stopped."""
    stopped = 0
    for iterator in list(_LOADER_ITERATORS):
        if not getattr(iterator, "_shutdown", True):
            try:
                iterator._shutdown_workers()
                stopped += 1
            except Exception as exc:  # noqa: BLE001 - a broken iterator must not stop the recovery
                logger.debug("shutting down a DataLoader iterator's workers: %s", exc)
    _LOADER_ITERATORS.clear()
    return stopped


def default_store() -> Any | None:
    """The store the default group was set up with (None: not reachable on this torch)."""
    if not _default_store_probe():
        _fall_back("default_store")
        return None
    return dist.distributed_c10d._get_default_store()


def can_wait_on_default_group() -> bool:
    """Whether ``wait_on_default_group`` can hold torch's reads of the default group."""
    if _default_group_probe() is None:
        _fall_back("default_group_read")
        return False
    return True


def wait_on_default_group(wait: Callable[[], None], passes: Callable[[], bool]) -> Callable[[], None] | None:
    """Make every read of torch.distributed's default group call ``wait`` first while none exists
    and ``passes()`` is false; returns what undoes it (None: not possible on this torch).

    Why the registry's property: ``is_initialized``, ``get_rank``, ``_get_default_group`` (DDP,
    DistributedSampler, DeviceMesh, FSDP) all read it, including through names other modules
    imported before this runs, which patching the functions would miss.
    """
    prop = _default_group_probe()
    if prop is None:
        _fall_back("default_group_read")
        return None
    registry = type(dist.distributed_c10d._world)
    original_get = prop.fget
    assert original_get is not None

    def read(world: Any) -> Any:
        if world._default_pg is None and not passes():
            wait()
        return original_get(world)

    setattr(registry, "default_pg", property(read, prop.fset, prop.fdel, prop.__doc__))  # noqa: B010

    def undo() -> None:
        setattr(registry, "default_pg", prop)  # noqa: B010

    return undo


def detach_ddp(ddp: DistributedDataParallel) -> bool:
    """Take a DDP's gradient hooks off its module's parameters (its generation is over); whether it
    could. Why: a module kept across a re-run gets a new DDP, and the old one's hooks would still
    all-reduce on the failed generation's group at every backward until it is collected."""
    if not _hook_removal_probe():
        _fall_back("ddp_hook_removal")
        return False
    ddp._remove_autograd_hooks()
    return True
