"""Every private or version-dependent interface of Accelerate, Lightning and transformers that the
integrations touch, each behind a feature probe.

Why: frameworks rename, re-sign or drop their internals in minor releases without notice (what
``worker/_torch_compat.py`` says of torch). Gathered here, a framework upgrade means checking one
file (and tests/unit/test_framework_compat.py), and a missing or reshaped internal costs that
framework's integration, named in one warning ("accelerate 1.17.0 lacks
GradientState._reset_state as resilrun uses it"), instead of an ``AttributeError`` inside a
training script: the script then runs as under torchrun, and a failure restarts the job.

The rules this module keeps:

- a probe looks for the thing itself with the shape resilrun uses (callable, the parameters it is
  passed, a dataclass field), never at a version number (``_support.outside`` checks the tested
  range first);
- ``*_lacks(module)`` probes run when an integration is installed (the script imported the
  framework): when one names anything, the framework's integration is not installed;
- ``*_instance_lacks(obj)`` probes run when a training starts, for what a framework sets only in a
  constructor: when one names anything, that training runs as the framework has it;
- the integrations read a framework's private attribute, call or replace its private method, or
  subclass its class only through the accessors below; the methods they wrap in place (``fit``,
  ``train``, ``prepare``, a loader's ``__iter__``) are each named by a probe. Nothing here is
  used before the probe that covers it held.

One probe costs less than its whole framework: ``training_arguments_lack`` (transformers'
``TrainingArguments._setup_devices``). Without it Accelerate creates the process group itself, so a
stuck group set-up is not guarded; the Trainer's integration, which does not depend on it, stays.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import ModuleType
from typing import Any, Literal

# What a probe found missing, each named as "Class.method(parameter)"; empty when the probe holds.
Missing = list[str]


def lacks(package: str, missing: Missing) -> str | None:
    """The one line saying why ``package`` is not integrated: its version and what it lacks."""
    if not missing:
        return None
    version = getattr(sys.modules.get(package.partition(".")[0]), "__version__", "(unknown version)")
    return f"{package} {version} lacks {', '.join(missing)} as resilrun uses it"


# -- shapes ------------------------------------------------------------------------------------------
def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _parameters(function: object) -> list[inspect.Parameter] | None:
    if not callable(function):
        return None
    try:
        return list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: its shape cannot be known
        return None


def _takes(function: object, *names: str, at: int | None = None) -> bool:
    """Whether ``function`` is callable and accepts each of ``names`` by keyword (by name or through
    ``**kwargs``); with ``at``, the first of them must be its positional parameter at that index."""
    parameters = _parameters(function)
    if parameters is None:
        return False
    if at is not None:
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) <= at or positional[at].name != names[0]:
            return False
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters)
    return all(name in named or any_keyword for name in names)


def _takes_an_argument(function: object) -> bool:
    """Whether a function on a class takes at least one argument after ``self``."""
    parameters = _parameters(function)
    return parameters is not None and (len(parameters) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters))


def _callables(owner: object, label: str, names: tuple[str, ...]) -> Missing:
    return [f"{label}.{name}" for name in names if not callable(getattr(owner, name, None))]


def _fields(cls: object) -> set[str]:
    return (
        {f.name for f in dataclasses.fields(cls)} if isinstance(cls, type) and dataclasses.is_dataclass(cls) else set()
    )


# -- Accelerate ----------------------------------------------------------------------------------------
PreparedKind = Literal["models", "optimizers", "schedulers", "dataloaders", "custom_objects"]
_PREPARED: tuple[PreparedKind, ...] = ("models", "optimizers", "schedulers", "dataloaders", "custom_objects")


def accelerate_lacks(accelerator_class: type) -> Missing:
    """What of Accelerate's internals this version lacks: the process state's constructor (wrapped
    to join the job first), the state resets, the prepared loaders' iteration, the accelerator's
    ``prepare`` and ``load_state`` (wrapped)."""
    state = _module("accelerate.state")
    loaders = _module("accelerate.data_loader")
    missing: Missing = []
    # Wrapped as __init__(self, cpu=False, **kwargs), reading backend and timeout from kwargs.
    if not _takes(getattr(getattr(state, "PartialState", None), "__init__", None), "cpu", "backend", "timeout", at=1):
        missing.append("PartialState.__init__(cpu, backend, timeout)")
    if not _takes(getattr(getattr(state, "AcceleratorState", None), "_reset_state", None), "reset_partial_state"):
        missing.append("AcceleratorState._reset_state(reset_partial_state)")
    missing += _gradient_state_lacks(state)
    for name in ("DataLoaderShard", "DataLoaderDispatcher"):
        missing += _callables(getattr(loaders, name, None), name, ("__iter__", "set_epoch"))
    missing += _callables(accelerator_class, "Accelerator", ("prepare", "load_state"))
    return missing


def _gradient_state_lacks(state: ModuleType | None) -> Missing:
    return _callables(getattr(state, "GradientState", None), "GradientState", ("_reset_state",))


def accelerator_instance_lacks(accelerator: Any) -> Missing:
    """The accelerator's lists of what ``prepare`` registered, which its loop is snapshotted from."""
    return [
        f"Accelerator._{kind}" for kind in _PREPARED if not isinstance(getattr(accelerator, f"_{kind}", None), list)
    ]


def prepared(accelerator: Any, kind: PreparedKind) -> list[Any]:
    """The objects of one kind that ``accelerator.prepare`` registered, in the order it did."""
    objects: list[Any] = getattr(accelerator, f"_{kind}")
    return objects


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide state, kept in class-level singletons that still describe the
    torn-down generation's process group and data loaders."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def reset_gradient_state() -> None:
    """Forget Accelerate's ``GradientState`` (it points at the last generation's data loaders)."""
    from accelerate.state import GradientState

    GradientState._reset_state()


# -- transformers ----------------------------------------------------------------------------------------
_TRAINING_ARGUMENTS_FIELDS = ("ddp_backend", "use_cpu", "ddp_timeout")
TrainerLoad = Literal["model", "optimizer", "scaler", "rng"]
# The Trainer's readers of a checkpoint directory, by what each restores (each takes the directory first).
_TRAINER_LOADERS: dict[TrainerLoad, str] = {
    "model": "_load_from_checkpoint",
    "optimizer": "_load_optimizer_and_scheduler",
    "scaler": "_load_scaler",
    "rng": "_load_rng_state",
}
_TRAINER_CALLBACK_HOOKS = ("on_train_begin", "on_step_begin", "on_step_end", "on_train_end")
_TRAINER_STATE_FIELDS = ("global_step", "stateful_callbacks")
_TRAINER_ATTRIBUTES = (
    "is_deepspeed_enabled",
    "is_fsdp_enabled",
    "accelerator",
    "callback_handler",
    "control",
    "model_wrapped",
)


def training_arguments_lack(arguments: type) -> Missing:
    """What ``TrainingArguments`` lacks for its device set-up to join the job first."""
    missing: Missing = []
    if not isinstance(arguments.__dict__.get("_setup_devices"), functools.cached_property):
        missing.append("TrainingArguments._setup_devices (a cached_property)")
    fields = _fields(arguments)
    missing += [f"TrainingArguments.{name}" for name in _TRAINING_ARGUMENTS_FIELDS if name not in fields]
    return missing


def wrap_setup_devices(arguments: type, wrap: Callable[[Callable[[Any], Any]], Callable[[Any], Any]]) -> None:
    """Have ``TrainingArguments._setup_devices`` computed by ``wrap(its own function)``, still cached."""
    original = arguments.__dict__["_setup_devices"].func
    adapted = functools.cached_property(wrap(original))
    adapted.__set_name__(arguments, "_setup_devices")
    arguments._setup_devices = adapted  # type: ignore[attr-defined]  # a class attribute, probed above


def trainer_lacks(trainer_module: ModuleType) -> Missing:
    """What of the Trainer's internals this transformers lacks: ``train`` (wrapped), the checkpoint
    readers (redirected on a resume), the callback hooks, the state file and ``TrainerState`` as
    its checkpoints hold them, and Accelerate's ``GradientState`` reset (on re-entry)."""
    trainer = getattr(trainer_module, "Trainer", None)
    missing: Missing = []
    if not _takes(getattr(trainer, "train", None), "resume_from_checkpoint", at=1):
        missing.append("Trainer.train(resume_from_checkpoint)")
    missing += [
        f"Trainer.{name}" for name in _TRAINER_LOADERS.values() if not _takes_an_argument(getattr(trainer, name, None))
    ]
    if not isinstance(getattr(trainer_module, "TRAINER_STATE_NAME", None), str):
        missing.append("transformers.trainer.TRAINER_STATE_NAME")
    callbacks = _module("transformers.trainer_callback")
    missing += _callables(getattr(callbacks, "TrainerCallback", None), "TrainerCallback", _TRAINER_CALLBACK_HOOKS)
    if not isinstance(getattr(callbacks, "ExportableState", None), type):
        missing.append("ExportableState")
    fields = _fields(getattr(callbacks, "TrainerState", None))
    missing += [f"TrainerState.{name}" for name in _TRAINER_STATE_FIELDS if name not in fields]
    missing += [f"accelerate's {name}" for name in _gradient_state_lacks(_module("accelerate.state"))]
    return missing


def trainer_instance_lacks(trainer: Any) -> Missing:
    """What a Trainer sets in its constructor and resilrun reads when ``train`` starts."""
    return [f"Trainer.{name}" for name in _TRAINER_ATTRIBUTES if not hasattr(trainer, name)]


def trainer_state_file() -> str:
    """The name of the Trainer's state file in a checkpoint directory (``trainer_state.json``)."""
    name: str = importlib.import_module("transformers.trainer").TRAINER_STATE_NAME
    return name


def redirect_trainer_loaders(trainer: Any, directory: str, loads: Mapping[TrainerLoad, Callable[[], None]]) -> None:
    """Have this Trainer's checkpoint readers call ``loads[what]`` instead when handed ``directory``
    (and read other checkpoints as before); on this instance only, until ``restore_trainer_loaders``."""
    for what, name in _TRAINER_LOADERS.items():
        setattr(trainer, name, _held(getattr(trainer, name), directory, loads[what]))


def _held(own: Callable[..., Any], directory: str, load: Callable[[], None]) -> Callable[..., Any]:
    def loader(checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
        if checkpoint != directory:
            return own(checkpoint, *args, **kwargs)
        load()
        return None

    return loader


def restore_trainer_loaders(trainer: Any) -> None:
    """The Trainer's own checkpoint readers again (the class's, as before ``redirect_trainer_loaders``)."""
    for name in _TRAINER_LOADERS.values():
        trainer.__dict__.pop(name, None)


def trainer_callback_base() -> type:
    """transformers' ``TrainerCallback``, for resilrun's callback to subclass."""
    base: type = importlib.import_module("transformers.trainer_callback").TrainerCallback
    return base


def exported_callback_states(trainer: Any) -> dict[str, Any]:
    """What the Trainer's own checkpoint records of its stateful callbacks and its control, by class
    name (``TrainerState.stateful_callbacks``)."""
    exportable = importlib.import_module("transformers.trainer_callback").ExportableState
    return {
        type(item).__name__: item.state()
        for item in [*trainer.callback_handler.callbacks, trainer.control]
        if isinstance(item, exportable)
    }


# -- Lightning ---------------------------------------------------------------------------------------------
_LIGHTNING_CALLBACK_HOOKS = ("on_train_start", "on_train_batch_start", "on_train_end")


def lightning_lacks(package: str, trainer_class: type) -> Missing:
    """What of Lightning's internals this version (``lightning.pytorch`` or ``pytorch_lightning``)
    lacks: ``fit(ckpt_path)`` (wrapped, handed the held snapshot's path), the combined loader's
    iteration (wrapped), the callback hooks, the strategy's checkpoint loader (redirected)."""
    missing: Missing = []
    if not _takes(getattr(trainer_class, "fit", None), "ckpt_path"):
        missing.append("Trainer.fit(ckpt_path)")
    combined = getattr(_module(f"{package}.utilities.combined_loader"), "CombinedLoader", None)
    missing += _callables(combined, "CombinedLoader", ("__iter__", "__next__"))
    callback = getattr(_module(f"{package}.callbacks"), "Callback", None)
    if isinstance(callback, type):
        missing += _callables(callback, "Callback", _LIGHTNING_CALLBACK_HOOKS)
    else:
        missing.append(f"{package}.callbacks.Callback")
    missing += _callables(getattr(_module(f"{package}.strategies"), "Strategy", None), "Strategy", ("load_checkpoint",))
    return missing


def lightning_instance_lacks(trainer: Any) -> Missing:
    """What a Lightning Trainer builds in its constructor and resilrun uses during ``fit``."""
    fit_loop = getattr(trainer, "fit_loop", None)
    epoch_loop = getattr(fit_loop, "epoch_loop", None)
    progress = getattr(getattr(epoch_loop, "batch_progress", None), "current", None)
    connector = getattr(trainer, "_checkpoint_connector", None)
    checks = (
        (
            "Trainer._checkpoint_connector.dump_checkpoint(weights_only)",
            _takes(getattr(connector, "dump_checkpoint", None), "weights_only"),
        ),
        ("the training epoch loop's on_advance_end", callable(getattr(epoch_loop, "on_advance_end", None))),
        (
            "the training epoch loop's batch_progress.current.completed",
            isinstance(getattr(progress, "completed", None), int),
        ),
        ("the fit loop's _combined_loader", hasattr(fit_loop, "_combined_loader")),
        (
            "Trainer.strategy.load_checkpoint",
            callable(getattr(getattr(trainer, "strategy", None), "load_checkpoint", None)),
        ),
    )
    return [what for what, holds in checks if not holds]


def lightning_checkpoint(trainer: Any) -> dict[str, Any]:
    """What Lightning would write to a checkpoint file now (its own ``dump_checkpoint``)."""
    state: dict[str, Any] = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    return state


def fit_data(trainer: Any) -> Any:
    """The fit loop's combined training loader; None before Lightning has built it."""
    return getattr(trainer.fit_loop, "_combined_loader", None)


def strategy_timeout(strategy: Any) -> timedelta | None:
    """The process-group timeout the script gave its strategy (None: the strategy's default)."""
    timeout = getattr(strategy, "_timeout", None)
    return timeout if isinstance(timeout, timedelta) else None


def combined_loader_class(package: str) -> type:
    """Lightning's ``CombinedLoader``, whose ``__iter__`` makes each epoch's training iterator."""
    combined: type = importlib.import_module(f"{package}.utilities.combined_loader").CombinedLoader
    return combined


def lightning_callback_base(package: str) -> type:
    """Lightning's ``Callback`` (from the Lightning the script imported), for resilrun's to subclass."""
    base: type = importlib.import_module(f"{package}.callbacks").Callback
    return base


# -- torchtitan --------------------------------------------------------------------------------------
def torchtitan_lacks(trainer_class: type, dist_utils: ModuleType | None) -> Missing:
    """What of torchtitan's trainer this version lacks: ``Trainer.train`` and ``Trainer.train_step``
    (each wrapped), and ``torchtitan.distributed.utils.init_distributed``, during which the
    process group torchtitan asks for is made by resilrun."""
    missing = _callables(trainer_class, "Trainer", ("train", "train_step", "init_distributed"))
    missing += [] if _takes_an_argument(getattr(trainer_class, "train_step", None)) else ["Trainer.train_step(data)"]
    if not callable(getattr(dist_utils, "init_distributed", None)):
        missing.append("torchtitan.distributed.utils.init_distributed")
    return missing


def torchtitan_instance_lacks(trainer: Any) -> Missing:
    """What a torchtitan Trainer builds in its constructor and resilrun snapshots or uses in ``train``."""
    checks = (
        ("Trainer.model_parts", isinstance(getattr(trainer, "model_parts", None), list)),
        ("Trainer.optimizers.optimizers", isinstance(getattr(trainer.optimizers, "optimizers", None), list)),
        ("Trainer.lr_schedulers.schedulers", isinstance(getattr(trainer.lr_schedulers, "schedulers", None), list)),
        ("Trainer.step", isinstance(getattr(trainer, "step", None), int)),
        ("Trainer.state_dict", callable(getattr(trainer, "state_dict", None))),
        ("Trainer.checkpointer.load", callable(getattr(getattr(trainer, "checkpointer", None), "load", None))),
        ("Trainer.parallel_dims.pp_enabled", hasattr(getattr(trainer, "parallel_dims", None), "pp_enabled")),
        ("a StatefulDataLoader as Trainer.dataloader", stateful_loader_class(getattr(trainer, "dataloader", None))),
    )
    return [what for what, holds in checks if not holds]


def stateful_loader_class(loader: Any) -> type | None:
    """The torchdata ``StatefulDataLoader`` class ``loader`` is an instance of, or None. torchtitan's
    own ``state_dict`` pickles the loader's state; resilrun keeps the unpickled one (no pickle in a
    snapshot), through the base class's methods."""
    base = getattr(_module("torchdata.stateful_dataloader"), "StatefulDataLoader", None)
    return base if isinstance(base, type) and isinstance(loader, base) else None
