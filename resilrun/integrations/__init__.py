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
from collections.abc import Callable, Mapping
from types import ModuleType

from resilrun.env import integrations_wanted

__all__ = ["enabled", "install_import_hooks"]

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
    from resilrun.integrations import import_hooks

    import_hooks.install({module: _deferred(*target) for module, target in _HOOKS.items()})
    return True


def _deferred(module: str, function: str) -> Callable[[ModuleType], None]:
    def hook(framework_module: ModuleType) -> None:
        getattr(importlib.import_module(module), function)(framework_module)

    return hook
