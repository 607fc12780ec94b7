"""Writing a persisted step as the files other tools read: a ``model.safetensors`` or a DCP directory.

Why these two: a single safetensors file of the model's own parameter names is what inference
servers, Hugging Face ``from_pretrained`` and ``safetensors.torch.load_file`` take; a DCP directory
is what ``torch.distributed.checkpoint.load`` reshards into any later parallel layout.

Invariants: the safetensors file is written next to its final name and renamed into place only
once complete (a reader never sees half a file), with the mode the umask gives a new file;
nothing existing is replaced without ``force``;
DCP is written by torch itself, in one process (``no_dist``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from resilrun.checkpoint import Progress, Step, module_state
from resilrun.errors import CheckpointError, ConfigError
from resilrun.snapshot.layout import TORCH_TO_CODE, build_layout

FORMATS = ("safetensors", "dcp")


@dataclass(frozen=True, slots=True)
class Exported:
    """What an export wrote."""

    path: str
    format: str
    step: int
    names: tuple[str, ...]
    tensors: int
    bytes: int
    skipped: tuple[str, ...]  # entries of a module's state that are not tensors (not in the file)


def choose_names(step: Step, names: tuple[str, ...], fmt: str) -> tuple[str, ...]:
    """The tracked names to export: as given, else the model (safetensors) or everything (DCP).

    Raises:
        ConfigError: safetensors and no single module to export, or several names for one file.
    """
    if names:
        if fmt == "safetensors" and len(names) > 1:
            raise ConfigError(
                f"--format safetensors writes one model, not {len(names)} objects ({', '.join(names)})",
                hint="give one --object, or use --format dcp for several",
            )
        return names
    if fmt == "dcp":
        return tuple(step.names)
    modules = [n for n in step.names if step.kinds.get(n) == "module"]
    if len(modules) == 1:
        return (modules[0],)
    if not modules and "model" in step.names:
        return ("model",)  # a checkpoint from before kinds were recorded
    raise ConfigError(
        f"step {step.step} holds {len(modules) or 'no'} tracked module(s) ({', '.join(step.names)}): "
        "which one is the model?",
        hint="name it with --object NAME",
    )


def check_target(path: Path, fmt: str, force: bool) -> Path:
    """Where the export goes (a directory given for safetensors means DIR/model.safetensors).

    Raises:
        ConfigError: the parent directory is missing, or the target exists and ``force`` is off.
    """
    if fmt == "safetensors" and (path.is_dir() or str(path).endswith(os.sep)):
        path = path / "model.safetensors"
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"--to {path}: the directory {parent} does not exist", hint="create it first")
    if fmt == "dcp" and path.exists() and not path.is_dir():
        raise ConfigError(f"--to {path} is a file; a DCP checkpoint is a directory", hint="name a new directory")
    exists = path.is_dir() and any(path.iterdir()) if fmt == "dcp" else path.exists()
    if exists and not force:
        raise ConfigError(f"--to {path} already exists", hint="pass --force to replace it, or name another path")
    return path


def export(
    step: Step, names: tuple[str, ...], fmt: str, target: Path, *, force: bool = False, progress: Progress | None = None
) -> Exported:
    """Write ``names`` of ``step`` to ``target`` (checked by ``check_target``) in ``fmt``.

    Raises:
        ConfigError: an unknown format or a target that cannot be written.
        CheckpointNotFoundError, CheckpointCorruptError, StorageError: as reading fails.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    state = step.load(list(names), progress=progress)
    if fmt == "safetensors":
        return _write_safetensors(step, names[0], state[names[0]], target)
    return _write_dcp(step, names, state, target, force)


def _write_safetensors(step: Step, name: str, state: Any, target: Path) -> Exported:
    if not isinstance(state, dict):
        raise CheckpointError(f"'{name}' is not a state dict of named tensors", hint="export it with --format dcp")
    state = module_state(state)
    tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    skipped = tuple(str(k) for k in state if str(k) not in tensors)
    if not tensors:
        raise CheckpointError(f"'{name}' holds no named tensors", hint="export it with --format dcp")
    layout = build_layout([(k, dtype_code(v), tuple(v.shape)) for k, v in tensors.items()], {"format": "pt"})
    handle, temporary = _create_partial(target)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(layout.header)
            for entry in layout.entries:  # in the layout's order: the offsets follow it
                tensor = tensors[entry.name].detach().cpu().contiguous()
                if entry.nbytes:
                    out.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return Exported(str(target), "safetensors", step.step, (name,), len(tensors), layout.total_bytes, skipped)


def _create_partial(target: Path) -> tuple[int, str]:
    """A new file next to ``target`` to write it in, created as any file is (mode 0666 less the
    umask: a user whose umask keeps files private gets a private export; ``mkstemp``'s 0600 would
    need a chmod that overrides it, issue 43, F15), never through a link, never an existing one."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        path = target.parent / f".{target.name}.{secrets.token_hex(8)}.partial"
        try:
            return os.open(path, flags, 0o666), str(path)
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file next to {target}")


def _write_dcp(step: Step, names: tuple[str, ...], state: dict[str, Any], target: Path, force: bool) -> Exported:
    import torch.distributed.checkpoint as dcp

    payload = {n: module_state(state[n]) if step.kinds.get(n) == "module" else state[n] for n in names}
    if force and target.is_dir():
        shutil.rmtree(target)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)  # one process, on purpose
        dcp.save(payload, storage_writer=dcp.FileSystemWriter(str(target)), no_dist=True)
    count, nbytes = 0, 0
    for tensor in _tensors(payload):
        count += 1
        nbytes += tensor.numel() * tensor.element_size()
    return Exported(str(target), "dcp", step.step, names, count, nbytes, ())


def dtype_code(tensor: torch.Tensor) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in TORCH_TO_CODE:
        raise CheckpointError(f"tensors of dtype {tensor.dtype} cannot be written to safetensors")
    return TORCH_TO_CODE[name]


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []
