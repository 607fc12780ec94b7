"""Getting trained state out of a persisted checkpoint: ``load`` in Python, ``resilrun export`` on disk.

Why: a persisted step is one safetensors file per rank plus JSON, laid out for fast restores, not
for the tools that come after training. ``load`` returns what the script tracked (``job.track``),
as plain nested state dicts with whole tensors: FSDP2/DTensor shards are consolidated from every
rank's file by their saved placements; unsharded tensors come from one rank (rank 0 by default,
which under DDP holds what every rank holds).

Reading never unpickles and never trusts a file beyond its checksums (see ``consolidate``). Given
the job's secret (``job_secret_file``), every file is also checked against the MACs the run wrote
(``tiers.authentic``): a step changed by anyone without the secret, or one carrying no MACs, is refused.

The other way round, ``StorageWriter``/``StorageReader`` (``checkpoint.dcp``) put a script's own
``torch.distributed.checkpoint`` saves on resilrun's tiers.

Example::

    import resilrun.checkpoint

    state = resilrun.checkpoint.load("s3://bucket/run7")          # the newest complete step
    model.load_state_dict(resilrun.checkpoint.module_state(state["model"]))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from resilrun.checkpoint.consolidate import Assembler, RankFile
from resilrun.errors import CheckpointCorruptError, CheckpointNotFoundError

__all__ = [
    "Step",
    "StorageReader",
    "StorageWriter",
    "durable_mac_key",
    "latest",
    "load",
    "module_state",
    "open_step",
]


def __getattr__(name: str) -> Any:
    """The DCP writer and reader (``checkpoint.dcp``), imported on first use: loading
    ``torch.distributed.checkpoint`` is not free, and ``load`` does not need it."""
    if name in ("StorageReader", "StorageWriter", "latest"):
        from resilrun.checkpoint import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Prefixes wrappers add to a module's parameter names: DDP's and torch.compile's.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# Called with (rank files read, rank files to read) as a load goes on.
Progress = Callable[[int, int], None]


class Step:
    """One complete persisted step: its world size and what its ranks tracked."""

    def __init__(
        self, storage: Any, step: int, complete: dict[str, Any], first: RankFile, mac_key: bytes | None = None
    ) -> None:
        self.storage, self.step, self.world_size, self._complete = storage, step, int(complete["world_size"]), complete
        self.mac_key = mac_key
        self.first = first
        meta = first.meta if isinstance(first.meta, dict) else {}
        objects, values = meta.get("objects"), meta.get("values", {})
        if not isinstance(objects, dict) or not isinstance(values, dict):
            raise CheckpointCorruptError(f"step {step} of {storage.uri}: rank 0's snapshot lists no tracked objects")
        self._objects, self._values = objects, values
        kinds = meta.get("kinds", {})
        self.kinds: dict[str, str] = kinds if isinstance(kinds, dict) else {}

    @property
    def names(self) -> list[str]:
        """What the script tracked, in tracking order (resilrun's own entries left out)."""
        return [n for n in [*self._objects, *self._values] if not str(n).startswith("_")]

    def read_rank(self, rank: int) -> RankFile:
        """One rank's file, every checksum (and, with the secret, every MAC) verified."""
        return _read(self.storage, self.step, rank, self._complete, self.mac_key)

    def load(self, names: Sequence[str] | None = None, *, rank: int = 0, progress: Progress | None = None) -> dict:
        """The tracked objects ``names`` (default: all) as nested state dicts of whole tensors.

        Raises:
            CheckpointNotFoundError: a name that was not tracked, or a rank the step does not have.
            CheckpointCorruptError: a file or description that does not hold together.
        """
        wanted = list(self.names if names is None else names)
        for name in wanted:
            if name not in self._objects and name not in self._values or str(name).startswith("_"):
                raise CheckpointNotFoundError(
                    f"step {self.step} of {self.storage.uri} has no tracked object '{name}'",
                    hint=f"it holds: {', '.join(self.names) or 'nothing'}",
                )
        if not 0 <= rank < self.world_size:
            raise CheckpointNotFoundError(f"step {self.step} has ranks 0-{self.world_size - 1}, not rank {rank}")
        source = self.first if rank == 0 else self.read_rank(rank)
        objects = [n for n in wanted if n in self._objects]
        assembler = Assembler(self.first, objects)
        if assembler.whole:
            for other in range(self.world_size):
                assembler.add(self.first if other == 0 else source if other == rank else self.read_rank(other))
                if progress is not None:
                    progress(other + 1, self.world_size)
            assembler.check_complete()
        elif progress is not None:
            progress(1, 1)
        tensors = _Tensors(source, assembler.whole)
        from resilrun.snapshot.tree import unflatten

        result: dict[str, Any] = {}
        for name in wanted:
            tree = self._objects[name] if name in self._objects else self._values[name]
            try:
                result[name] = unflatten(tree, tensors, lambda whole, doc: whole)
            except (KeyError, ValueError, TypeError) as exc:
                raise CheckpointCorruptError(f"the snapshot tree of '{name}' is malformed: {exc}") from None
        return result


class _Tensors(dict[str, torch.Tensor]):
    """Tensors by name: consolidated ones as given, the others copied out of one rank's file on use."""

    def __init__(self, source: RankFile, whole: dict[str, torch.Tensor]) -> None:
        super().__init__(whole)
        self._source = source

    def __missing__(self, name: str) -> torch.Tensor:
        self[name] = tensor = self._source.tensor(name)
        return tensor


def open_step(
    uri: str,
    step: int | None = None,
    *,
    s3_endpoint_url: str | None = None,
    s3_expected_owner: str | None = None,
    job_secret_file: str | None = None,
) -> Step:
    """The complete step ``step`` (default: the newest complete one) of the checkpoint at ``uri``;
    with ``job_secret_file`` (the run's ``--job-secret-file``), only if it is authentic.

    Raises:
        ConfigError: the URI is unusable, or the secret file is (missing, readable by others).
        CheckpointNotFoundError: no checkpoint there, or the step is missing or incomplete.
        CheckpointCorruptError, StorageError: as reading fails; not authentic under the secret.
    """
    from resilrun.storage import create_storage
    from resilrun.tiers import durable

    storage = create_storage(uri, s3_endpoint_url=s3_endpoint_url, s3_expected_owner=s3_expected_owner)
    mac_key = durable_mac_key(job_secret_file, storage.uri)
    steps = durable.list_steps(storage)
    complete = [info.step for info in steps if info.complete]
    if not steps:
        raise CheckpointNotFoundError(
            f"no checkpoint under {storage.uri}",
            hint="check the path or URI; a checkpoint holds step_<12 digits>/ folders",
        )
    newest = f"the newest complete step is {max(complete)}" if complete else "no step is complete yet"
    if step is None:
        if not complete:
            raise CheckpointNotFoundError(f"no step under {storage.uri} is complete", hint="wait for one to persist")
        step = max(complete)
    info = next((s for s in steps if s.step == step), None)
    if info is None:
        raise CheckpointNotFoundError(f"step {step} is not in {storage.uri}", hint=newest)
    if not info.complete:
        raise CheckpointNotFoundError(
            f"step {step} under {storage.uri} is not complete ({len(info.ranks)} rank(s) wrote their files, "
            "no COMPLETE.json)",
            hint=newest,
        )
    record = durable.read_complete(storage, step)
    return Step(storage, step, record, _read(storage, step, 0, record, mac_key), mac_key)


def durable_mac_key(job_secret_file: str | None, uri: str) -> bytes | None:
    """The persistent tier's MAC key for the checkpoint at ``uri`` (where the run wrote it: the key
    is bound to it) from the run's secret file; None without one."""
    if job_secret_file is None:
        return None
    from resilrun.job_secret import external_secret
    from resilrun.tiers.authentic import durable_key

    secret = external_secret(job_secret_file, {})
    assert secret is not None  # (a path was given)
    return durable_key(secret, uri)


def _read(storage: Any, step: int, rank: int, complete: dict[str, Any], mac_key: bytes | None) -> RankFile:
    from resilrun.tiers import durable

    layout, data, manifest = durable.read_rank(
        storage, step, rank, verify=True, complete=complete, mac_key=mac_key, require_mac=mac_key is not None
    )
    return RankFile(rank, layout, data, manifest.get("values"))


def load(
    uri: str,
    step: int | None = None,
    *,
    names: Sequence[str] | None = None,
    rank: int = 0,
    s3_endpoint_url: str | None = None,
    s3_expected_owner: str | None = None,
    job_secret_file: str | None = None,
) -> dict[str, Any]:
    """What a script tracked at ``step`` (default: the newest complete one), as plain state dicts.

    Args:
        uri: the ``--checkpoint-uri`` of the run: a directory or ``s3://bucket/prefix``.
        step: a complete step; the newest complete one when None.
        names: the tracked names to load (``job.track(model=...)`` tracks ``"model"``); all when None.
        rank: the rank whose unsharded tensors are returned (sharded ones are whole regardless).
        job_secret_file: the run's ``--job-secret-file``: every file is then checked against the
            MACs the run wrote, and a step without them is refused.

    Returns:
        ``{name: state}``: each tracked object's state dict (as its ``state_dict()`` returned it,
        with DTensors consolidated into whole tensors), and each tracked JSON value.

    Raises:
        CheckpointNotFoundError: no such checkpoint, step or name.
        CheckpointCorruptError: a file fails its checksums or (with the secret) its MACs, or its
            contents do not hold together.
        StorageError: storage failed.
        ConfigError: the URI is unusable.
    """
    opened = open_step(
        uri,
        step,
        s3_endpoint_url=s3_endpoint_url,
        s3_expected_owner=s3_expected_owner,
        job_secret_file=job_secret_file,
    )
    return opened.load(names, rank=rank)


def module_state(state: dict[str, Any]) -> dict[str, Any]:
    """A module's state dict with the prefixes DDP (``module.``) and torch.compile (``_orig_mod.``)
    add removed, so it loads into the bare model; unchanged when not every name has the prefix."""
    changed = True
    while changed and state:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if all(isinstance(k, str) and k.startswith(prefix) for k in state):
                state = {k[len(prefix) :]: v for k, v in state.items()}
                changed = True
    return state
