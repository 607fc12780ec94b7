"""Run code right after a given module has been imported, whoever imports it and however.

Why an import hook and not a patch at start-up: the worker bootstrap must not import a framework
the script may never use (``transformers`` takes seconds to import), and a framework's classes
must be adapted before the script's first use of them. Hooking the import of the framework's own
module gives both: nothing happens unless the script imports it, and the adaptation is in place
by the time the import statement returns. Lazy packages (``transformers`` loads its submodules on
attribute access) go through the same machinery, so they are covered too.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

logger = logging.getLogger(__name__)

Hook = Callable[[ModuleType], None]


class _HookedLoader(importlib.abc.Loader):
    """The module's own loader, with ``hook`` run once the module has executed."""

    def __init__(self, loader: importlib.abc.Loader, hook: Hook) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _run(self._hook, module)

    def __getattr__(self, name: str) -> object:  # get_source, is_package, ... as the real loader has them
        return getattr(self._loader, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that finds nothing itself: it wraps the loader of hooked modules."""

    def __init__(self, hooks: dict[str, Hook]) -> None:
        self._hooks = dict(hooks)
        self._busy = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        hook = self._hooks.get(fullname)
        if hook is None or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname  # the lookup below comes through here again: let it pass
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.name = None
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader, hook)
        return spec


def install(hooks: dict[str, Hook]) -> PostImportFinder:
    """Hook each named module's import; a module already imported gets its hook now."""
    finder = PostImportFinder({name: hook for name, hook in hooks.items() if name not in sys.modules})
    sys.meta_path.insert(0, finder)
    for name, hook in hooks.items():
        if name in sys.modules:
            _run(hook, sys.modules[name])
    return finder


def _run(hook: Hook, module: ModuleType) -> None:
    """An integration that fails must leave the framework as it was, never break the import."""
    try:
        hook(module)
    except Exception:  # noqa: BLE001 - the script runs without the integration; say so once
        logger.warning(
            "resilrun could not adapt %s; training runs without its integration", module.__name__, exc_info=True
        )
