"""Checkpointless recovery for training loops that a framework owns, with no change to the script.

Under resilrun, the worker entry point (``resilrun.worker_main``, the layer above this package)
calls ``install_import_hooks()`` before the script runs: when the script imports a supported
framework, the framework is adapted (see each module) so that its state is snapshotted after every
optimizer step and a recovered generation resumes at the same step in-process. Pass
``--no-integrations`` (or set ``RESILRUN_NO_INTEGRATIONS=1``, which the workers inherit) to leave
every framework exactly as it is; a script may also call an integration's ``install()`` itself.

Every private or version-dependent framework internal an integration touches is reached through
``_framework_compat``, behind a feature probe: a framework version that lacks one is left exactly as
it is, with a one-line warning naming what it lacks.

Light on purpose (no torch, no framework): the worker entry point imports it for every worker.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from types import ModuleType

from resilrun.env import integrations_wanted

__all__ = ["enabled", "hook_frameworks", "install_import_hooks", "rank_read_at_import", "refresh_ranks_read_at_import"]

# The framework module whose import triggers each integration, and the integration's function.
_HOOKS: dict[str, tuple[str, str]] = {
    "transformers.training_args": ("resilrun.integrations.transformers", "adapt_training_arguments"),
    "transformers.trainer": ("resilrun.integrations.transformers", "adapt_trainer"),
    "accelerate.accelerator": ("resilrun.integrations.accelerate", "adapt_accelerator"),
    "lightning.pytorch.trainer.trainer": ("resilrun.integrations.lightning", "adapt_trainer"),
    "pytorch_lightning.trainer.trainer": ("resilrun.integrations.lightning", "adapt_trainer"),
    "torchtitan.trainer": ("resilrun.integrations.torchtitan", "adapt_trainer"),
}


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether framework integrations are wanted (``environ``: this process's environment by default):
    only in a worker resilrun started, unless turned off."""
    return integrations_wanted(environ)


def install_import_hooks(environ: Mapping[str, str] | None = None) -> bool:
    """Adapt each supported framework when the script imports it; False when integrations are off."""
    if not enabled(environ):
        return False
    hook_frameworks()
    return True


def hook_frameworks() -> None:
    """Adapt each supported framework when it is imported (or now, if it is), whatever the
    environment says: for the node's worker template, whose environment lacks the workers' own
    (the agent decides for it). Once per process: a worker forked from the template has them."""
    global _FINDER
    if _FINDER is not None and _FINDER in sys.meta_path:
        return
    from resilrun.integrations import import_hooks

    _FINDER = import_hooks.install({module: _deferred(*target) for module, target in _HOOKS.items()})


_FINDER: object | None = None  # the import hook this process installed, while it is installed


def _deferred(module: str, function: str) -> Callable[[ModuleType], None]:
    def hook(framework_module: ModuleType) -> None:
        getattr(importlib.import_module(module), function)(framework_module)

    return hook


# The environment variables Lightning reads its process's rank from, in its order (RANK first: SLURM_PROCID
# may be set when SLURM does not manage the processes).
_LIGHTNING_RANK_KEYS = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def rank_read_at_import() -> bool:
    """Whether a package imported already keeps a rank it read as it was imported
    (``refresh_ranks_read_at_import``): a hot spare that has it gets no head start, since the script's
    rank-zero-only code would run before the spare has its seat."""
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    return hasattr(getattr(rank_zero, "rank_zero_only", None), "rank")


def refresh_ranks_read_at_import() -> None:
    """Set again, from this process's environment as it is now, what a package took from it once,
    as it was imported: ``lightning_utilities``' ``rank_zero_only.rank`` (set by the first of
    Lightning and torchmetrics imported, kept after; each strategy sets it again at its set-up).

    Why: a worker may have its packages imported before it had a rank (forked from the node's
    worker template, or a hot spare), and would otherwise log as rank 0 on every rank until its
    Trainer is set up. Whatever the package set it from, this sets it as Lightning does.
    """
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    only = getattr(rank_zero, "rank_zero_only", None)
    if only is None or not hasattr(only, "rank"):
        return
    found = next((os.environ[key] for key in _LIGHTNING_RANK_KEYS if key in os.environ), None)
    try:
        only.rank = int(found) if found is not None else 0
    except ValueError:
        return  # not a number: as Lightning, which would have failed at import, leave it
