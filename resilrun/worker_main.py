"""The entry point of every Python worker process: runs the user's script exactly as ``python -u
script.py`` would.

Why here, above ``worker/`` and ``integrations/``: it installs the framework integrations (built on
``worker/``) and drives ``worker/``'s membership, so it sits above both, and ``worker/`` imports
nothing of ``integrations/``.

Why an entry point (the worker bootstrap) at all:
- it records an uncaught exception into ``TORCHELASTIC_ERROR_FILE`` (what torchrun's ``@record``
  does, without asking the user to decorate anything), so the agent's root-cause report carries
  the worker's own traceback;
- it is how a survivor recovers in-process: when the script (one that joined through
  ``resilrun.init()``) fails because a peer died, the bootstrap asks the agent whether the job
  moved to a new generation; if so it adopts the new environment and runs the script again in
  this same process (torch and the user's imports stay loaded; state comes back from node memory);
- it is where a hot spare waits (``RESILRUN_SPARE=1``): torch and the script's imports are loaded
  and the first-DDP cost paid. A script that imports resilrun runs ahead at once (the head start,
  ``worker/pending.py``): its set-up runs before any failure, and its first read of its rank waits
  for the agent's assignment, so it still sees the complete torchrun environment of the rank it
  replaces. A plain torchrun script runs no line until the spare is given a rank: it might never
  read one and must never run as a world of one beside the real job.

It imports nothing heavy itself: torch is imported by the user's script.

Usage: ``python -u -m resilrun.worker_main [-m] TARGET [ARGS...]``
"""

from __future__ import annotations

import ast
import contextlib
import faulthandler
import functools
import gc
import importlib
import importlib.util
import json
import os
import runpy
import sys
import sysconfig
import time
import traceback
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from resilrun.env import (
    STATE_LOST_EXIT_CODE,
    STATE_REFUSED_EXIT_CODE,
    agent_socket_path,
    apply_assignment,
    current_round,
    error_file,
    head_start_wanted,
    is_spare,
    on_assignment,
    recovery_wait_s,
    rerun_wanted,
)
from resilrun.errors import StateLostError, StateRefusedError


def write_error_file(exc: BaseException) -> None:
    """Write torchrun's error-file format, unless the script already wrote one (it knows better)."""
    path = error_file()
    if path is None or os.path.exists(path):
        return
    record = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                # Sub-second: two ranks failing in one second must still be told apart (root cause).
                "timestamp": f"{time.time():.6f}",
            },
        }
    }
    try:
        tmp = f"{path}.tmp"
        if os.path.lexists(tmp):  # a stale one (a crash mid-write), or a planted link: never followed
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
        os.replace(tmp, path)
    except OSError:
        pass  # the report then falls back to the exit code; never mask the user's exception


def _run(target: str, args: list[str], as_module: bool) -> None:
    sys.argv = [target, *args]
    if as_module:
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


@dataclass(frozen=True)
class TopImport:
    """One import statement at a script's top: the module, and the names it takes from it
    (``from M import a, b``). One per statement, in the script's order: a name that fails (a
    class of a newer version, in a ``try``) fails its statement only, as in the script.

    Why the names too: ``from M import a`` reads ``M.a``, and a package that loads its contents
    lazily (transformers, whose ``Trainer`` and models are submodules imported on first access)
    does most of its importing then: seconds of a replacement's start that the module's own
    import leaves undone."""

    module: str
    names: tuple[str, ...] = ()

    def run(self) -> None:
        """Import as the script's statement would (a name that is a submodule is imported, as
        ``from M import sub`` does); raises what that statement would."""
        importlib.import_module(self.module)
        for name in self.names:
            __import__(self.module, fromlist=(name,))
            module = sys.modules[self.module]
            if not hasattr(module, name) and f"{self.module}.{name}" not in sys.modules:
                raise ImportError(f"cannot import name {name!r} from {self.module!r}")

    def done(self) -> bool:
        """Whether this process has it already: the module imported and every name bound in it
        (read from the module's namespace: reading the attribute could import it)."""
        module = sys.modules.get(self.module)
        bound = getattr(module, "__dict__", {})
        return module is not None and all(name in bound for name in self.names)

    def __str__(self) -> str:
        return f"from {self.module} import {', '.join(self.names)}" if self.names else self.module


def script_imports(target: str, as_module: bool) -> list[TopImport]:
    """The installed packages a script imports at its top level, in order (what a spare preloads).

    Only statements at the top level (also inside top-level ``try``/``if`` blocks), only those
    before the script runs any code of its own, and only absolute imports of modules found outside
    the script's own directory. An import after the script's own code may depend on it (an
    environment variable set, a library patched, a path added): importing it first would run the
    package in a world the script has not made yet, so the script imports it itself. Importing one
    of the script's own modules (a file beside it, a relative import) is running its code: the
    preload stops there too. Only packages a package installer put where they are found (the
    standard library, or a folder holding the distribution's record: site-packages, a ``pip
    --target`` folder): a project's own package, on ``PYTHONPATH``, in the working folder or
    installed editable, is the user's code, and may read the rank as it is imported.
    """
    if as_module and not installed(target.partition(".")[0]):
        return []  # finding it would run its package's __init__: the user's code
    path = _script_path(target) if as_module else target
    if path is None:
        return []
    try:
        with open(path, "rb") as handle:
            tree = ast.parse(handle.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    local_dir = os.path.dirname(os.path.abspath(path))
    statements: list[TopImport] = []

    def add(module: str, taken: list[str]) -> None:
        statement = TopImport(module, tuple(taken))
        if statement not in statements:
            statements.append(statement)

    def own(module: str) -> bool:
        return _is_local(module.partition(".")[0], local_dir)

    def visit(body: list[ast.stmt], collect: bool = True) -> bool:
        """Collect the imports of ``body``; False once a statement may have run the script's own code
        (its own module imported, a call in a condition, anything but an import or a definition)."""
        for node in body:
            if isinstance(node, ast.Import):
                if any(own(alias.name) for alias in node.names):
                    return False
                for alias in node.names if collect else ():
                    add(alias.name, [])
            elif isinstance(node, ast.ImportFrom):
                if node.level or not node.module or own(node.module):
                    return False
                if collect:  # a star import takes what the module says it exports: the module's own import
                    add(node.module, [alias.name for alias in node.names if alias.name != "*"])
            elif isinstance(node, ast.If):
                if any(isinstance(part, ast.Call) for part in ast.walk(node.test)):
                    return False
                if not visit(node.body, collect) or not visit(node.orelse, collect):
                    return False
            elif isinstance(node, ast.Try):
                # A handler runs only when an import failed: what it does is checked, not preloaded.
                if not visit(node.body, collect) or not all(visit(h.body, collect=False) for h in node.handlers):
                    return False
                if not visit(node.orelse, collect) or not visit(node.finalbody, collect):
                    return False
            elif not _runs_nothing(node):
                return False
        return True

    visit(tree.body)
    found = []
    for statement in statements:
        top = statement.module.partition(".")[0]
        if top == "__future__" or _is_local(top, local_dir) or not installed(top):
            continue
        found.append(statement)
    return found


def installed(top: str) -> bool:
    """Whether the top-level module ``top`` is one a package installer put where Python finds it:
    the standard library's, or found in a folder that holds installed distributions' records
    (``*.dist-info``: site-packages, a ``pip --target`` folder). A project's own folder (beside the
    script, on PYTHONPATH, the source of an editable install, whose record lives elsewhere) has none.
    Why not each distribution's file list: reading every record costs a tenth of a second or more of
    CPU per process, paid by every template and spare."""
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return True
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported to find it
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    locations = list(spec.submodule_search_locations or [])
    if len(locations) > 1 or (not locations and not spec.origin):
        return False  # a namespace package spread over folders: whose is not one answer
    return _holds_records(os.path.dirname(os.path.realpath(locations[0] if locations else str(spec.origin))))


@functools.cache
def _holds_records(folder: str) -> bool:
    try:
        return any(name.endswith(".dist-info") for name in os.listdir(folder))
    except OSError:
        return False


def _runs_nothing(node: ast.stmt) -> bool:
    """Whether a statement runs none of the script's code: a docstring, ``pass``, a name bound to a
    literal, or a function defined without decorators (its body runs only when called)."""
    if isinstance(node, ast.Pass):
        return True
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant)
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return all(isinstance(target, ast.Name) for target in targets) and _literal(node.value)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        defaults = [*node.args.defaults, *node.args.kw_defaults]
        return not node.decorator_list and all(_literal(value) for value in defaults)
    return False


def _literal(node: ast.expr | None) -> bool:
    if node is None:
        return True
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def uses_resilrun_api(target: str, as_module: bool) -> bool:
    """Whether the script imports resilrun anywhere (the worker API: ``resilrun.init()``).

    Why a spare runs only such scripts ahead: their training waits for the rank by construction
    (``job.steps()``, the process group), while a script that never reads its rank (a single-process
    one) would run whole in the spare, as a job of its own beside the real one.
    """
    path = _script_path(target) if as_module else target
    if path is None:
        return False
    try:
        with open(path, "rb") as handle:
            tree = ast.parse(handle.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.partition(".")[0] == "resilrun" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").partition(".")[0] == "resilrun":
            return True
    return False


def _script_path(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def _is_local(top: str, directory: str) -> bool:
    return os.path.exists(os.path.join(directory, f"{top}.py")) or os.path.isdir(os.path.join(directory, top))


def _stand_by(target: str, as_module: bool) -> None:
    """A hot spare: load what the script will need, then wait for a rank; returns with it applied.

    Why here and not in ``resilrun.init()``: everything above ``init()`` in the script would run
    without a rank (scripts branch on ``RANK`` at their first line, and a script that never calls
    ``init()`` would run whole, as a job of its own).
    """
    import torch  # noqa: F401 - the import is the point: seconds a replacement then does not pay
    import torch.distributed  # noqa: F401

    from resilrun.worker import membership

    for imported in script_imports(target, as_module):
        try:
            imported.run()
        except BaseException as exc:  # noqa: BLE001 - the script imports it again, with its rank, and reports then
            sys.stderr.write(f"resilrun: spare could not preload {imported}: {type(exc).__name__}: {exc}\n")
    membership.stand_by()


def _run_ahead(target: str, as_module: bool) -> bool:
    """A hot spare with a head start (``worker/pending.py``): the script runs now and its first read
    of a rank-dependent value waits for the assignment. Returns False where it cannot (the script's
    kind, the option, or this torch): the spare then stands by before the script's first line."""
    if not head_start_wanted() or not uses_resilrun_api(target, as_module):
        return False
    from resilrun import integrations

    if integrations.rank_read_at_import():  # imported by the template it was forked from: see there
        return False
    import torch  # noqa: F401 - before the membership module, which needs it anyway
    import torch.distributed  # noqa: F401

    from resilrun.worker import membership

    return membership.run_ahead()


def _ended_without_a_rank() -> bool:
    """Whether this process ran its script to the end as a spare that never took a seat."""
    pending = sys.modules.get("resilrun.worker.pending")
    return pending is not None and pending.current() is not None


def _may_be_a_broken_collective(exc: BaseException) -> bool:
    """Whether ``exc`` could come from a collective that a failed peer broke, judged by type alone.

    Only a RuntimeError can (torch's DistError is one; gloo raises plain ones); a ValueError,
    KeyError, or a CUDA out-of-memory error anywhere in the chain is not. This only spares the rank's
    own obvious errors a short wait: whether a RuntimeError is a peer's failure or this rank's own (an
    NCCL or CUDA error of its own) is decided by the agent, from what the job knows, never from text.
    """
    torch = sys.modules.get("torch")
    own = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),) if isinstance(t, type))
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, RuntimeError) and not (own and isinstance(current, own)):
            return True
        current = current.__cause__ or current.__context__
    return False


def _next_generation(exc: BaseException) -> dict[str, str] | None:
    """The environment of the job's next generation if this failure is being recovered, else None.

    What could be a broken collective waits for the agent's decision: the job's next generation (a
    peer failed first: this rank is a survivor) or "no" (nothing failed before it: its error is the
    failure, and it exits so that it can be replaced). Any other error only takes a generation that
    is already published (then it is part of a recovery already under way).
    """
    membership = sys.modules.get("resilrun.worker.membership")
    socket_path = agent_socket_path()
    if membership is None or not membership.is_active() or not socket_path or isinstance(exc, KeyboardInterrupt):
        return None
    if membership.reruns_plain_script():
        # Judged again now: the script may have started a thread since it set up its group.
        try:
            refused = membership.refuse_rerun(membership.rerun_blockers())
        except Exception as exc2:  # noqa: BLE001 - no agent, no recovery: the original error stands
            sys.stderr.write(f"resilrun: could not ask the agent about recovery: {exc2}\n")
            return None
        if refused:
            return None
    raised = _may_be_a_broken_collective(exc)
    wait_s = recovery_wait_s() if raised else 0.0
    from resilrun.channel_protocol import AwaitGeneration
    from resilrun.worker.agent_client import AgentClient

    try:
        client = AgentClient(socket_path)
        try:
            request = AwaitGeneration(pid=os.getpid(), round=current_round(), timeout_s=wait_s, raised=raised)
            reply, _ = client.call(request)
        finally:
            client.close()
    except Exception as exc2:  # noqa: BLE001 - no agent, no recovery: the original error stands
        sys.stderr.write(f"resilrun: could not ask the agent about recovery: {exc2}\n")
        return None
    return reply.env


def install_rerun_hook() -> None:
    """``--rerun-in-process``: once the plain script's own ``init_process_group`` succeeds, the
    process tells the agent it can re-run the script (``membership.join_for_rerun``).

    Why a wrapper installed when ``torch.distributed`` is imported (during ``import torch``, before
    the script's ``from torch.distributed import init_process_group`` binds the name): the script
    never calls resilrun, and the group must exist before its collectives can be aborted.
    """
    from resilrun.integrations import import_hooks

    import_hooks.install({"torch.distributed": _wrap_init_process_group})


def _wrap_init_process_group(module: ModuleType) -> None:
    original = module.init_process_group
    if getattr(original, "_resilrun_rerun", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        from resilrun.worker import membership  # torch is whole by now: the script calls this

        return membership.set_up_plain_group(lambda: original(*args, **kwargs))

    init_process_group._resilrun_rerun = True  # type: ignore[attr-defined]
    module.init_process_group = init_process_group


def _script_dir(target: str, as_module: bool) -> str:
    if as_module:
        path = _script_path(target)
        return os.path.dirname(path) if path else os.getcwd()
    return os.path.dirname(os.path.abspath(target))


def _drop_script_modules(directory: str) -> int:
    """Forget the script's own modules (files under its folder), so that its re-run imports them
    fresh: their module-level state (a global step counter, a cached group) belongs to the failed run.

    Installed packages and resilrun itself stay loaded (the point of re-running in-process is not
    to pay their import again), even when they live under the folder (a virtual environment there).
    """
    root = os.path.join(os.path.realpath(directory), "")
    keep = {os.path.join(os.path.realpath(p), "") for p in sysconfig.get_paths().values() if p}
    keep |= {os.path.join(os.path.realpath(p), "") for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    keep.add(os.path.join(os.path.realpath(os.path.dirname(os.path.dirname(__file__))), "resilrun", ""))
    inside = [k for k in keep if k.startswith(root) and k != root]  # a prefix above the folder shields nothing
    dropped = 0
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        if name == "__main__" or name.partition(".")[0] == "resilrun" or not isinstance(origin, str):
            continue
        if not os.path.isabs(origin):  # a namespace torch made up (torch.ops: "_ops.py"), not a file
            continue
        path = os.path.realpath(origin)
        if path.startswith(root) and not any(path.startswith(k) for k in inside):
            del sys.modules[name]
            dropped += 1
    return dropped


def exit_now(code: int) -> None:
    """Leave like ``sys.exit(code)`` but skip the C++ teardown after the script is done.

    The user's atexit handlers still run and the streams are flushed; only the destruction of
    native objects is skipped, because torch 2.13's gloo teardown at interpreter exit sometimes
    aborts ("terminate called without an active exception", seen under torchrun as well), which
    would turn a finished job into a failed one.
    """
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _tell_agent_finished() -> None:
    """Interpreter teardown (process groups, CUDA) can take seconds without a heartbeat: say so."""
    socket_path = agent_socket_path()
    if not socket_path or "resilrun.worker.membership" not in sys.modules:
        return
    from resilrun.channel_protocol import Finished
    from resilrun.worker.agent_client import AgentClient

    try:
        client = AgentClient(socket_path)
        try:
            client.call(Finished(pid=os.getpid()))
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - best effort; the exit code says the rest
        pass


def main(argv: list[str]) -> None:
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    target, args = argv[0], argv[1:]
    faulthandler.enable(all_threads=True)
    from resilrun import integrations

    integrations.install_import_hooks()  # before a spare preloads the script's imports, too
    # Packages imported before this process had its environment (in the template it was forked from)
    # take their rank from it again now, and whenever an assignment changes it.
    integrations.refresh_ranks_read_at_import()
    on_assignment(integrations.refresh_ranks_read_at_import)
    rerun = rerun_wanted()
    if rerun:
        install_rerun_hook()
    if is_spare():
        try:
            if not _run_ahead(target, as_module):
                _stand_by(target, as_module)
        except BaseException as exc:
            # A spare that cannot wait any more (its agent gone, an error of its own) says why: the
            # agent logs this traceback and starts another spare.
            write_error_file(exc)
            raise
    while True:
        try:
            _run(target, list(args), as_module)
            if _ended_without_a_rank():
                raise RuntimeError(
                    "the script ran to its end in a hot spare before it read its rank (its head start); "
                    "run it with --no-spare-head-start"
                )
            _tell_agent_finished()
            exit_now(0)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                write_error_file(exc)
                raise
            _tell_agent_finished()
            exit_now(0)
        except StateLostError as exc:
            # Nothing to resume from, and retrying cannot change that: a distinct exit code tells
            # the agent to stop the job now instead of spending restarts.
            write_error_file(exc)
            traceback.print_exception(exc)
            exit_now(STATE_REFUSED_EXIT_CODE if isinstance(exc, StateRefusedError) else STATE_LOST_EXIT_CODE)
        except BaseException as exc:
            env = _next_generation(exc)
            if env is None:
                write_error_file(exc)
                raise
            summary = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        # Out of the except block, so the failed generation's frames (and tensors) can be freed.
        sys.stderr.write(
            f"resilrun: rank {env.get('RANK')} recovering in-process into generation {env.get('RESILRUN_ROUND')} "
            f"after: {summary}\n"
        )
        sys.modules["resilrun.worker.membership"].reset_for_reentry()
        apply_assignment(env)
        if rerun:
            # A plain script runs again from its first line: its own modules too (their globals
            # belong to the failed run), and what they held must be freed before it rebuilds it.
            _drop_script_modules(_script_dir(target, as_module))
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            # The old generation's model and optimizer must leave the GPU before the script
            # builds them again (NVRx's in-process restart leaked it and looped on OOM); on the
            # CPU, reference counting frees most of it and a full collection (about 0.4 s
            # measured here) would only delay the recovery.
            gc.collect()
            torch.cuda.empty_cache()
        elif rerun:
            gc.collect()  # a plain script's reference cycles (a model and its optimizer) go now


if __name__ == "__main__":
    main(sys.argv[1:])
