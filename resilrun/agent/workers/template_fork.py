"""The worker template forked from the agent itself, in a process that has torch imported already.

A program that runs agents from one interpreter that imported torch once (a launch server: the
tests' ``tests/helpers/launch_zygote.py`` forks every launch of the suite) declares it with
``declare_preloaded``; the node's template is then forked from the agent instead of started as a
new Python, which saves its two or more seconds of CPU (``import torch``) per agent. A launcher
started from a shell never declares it and is unchanged.

What the forked template must be is what a new one is (resilrun/worker_template.py): a session of
its own, /dev/null as stdin and stdout, the agent's stderr, only its socket open, default signal
handling, unbuffered stdio (``python -u``), the template's environment (the agent's secrets
withheld) in ``os.environ`` and in what ps and /proc show, logging and warnings as the declaring
process had them (not as the agent configured them since: a worker forked from the template would
print the agent's INFO lines). Where that cannot hold, it is not forked:

- the declaration is missing, a preloaded module is not imported, another interpreter is asked for;
- the process runs a second thread or holds a CUDA context (what a fork cannot copy), or may have
  touched CUDA at all: only the template started before the agent looks for devices is forked;
- the interpreter's start-up flags are not a plain ``python``'s (``-u`` the template sets itself);
- the template's environment differs from the declared start environment in anything but what is
  read after start (``resilrun.env.read_after_start``, the rule for forking workers).

What a fork cannot withhold: the agent's memory. Secrets the agent holds (the job secret) reach the
template's memory, not its environment; a declared launcher is for trusted jobs (the tests).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import io
import logging
import os
import signal
import socket
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from resilrun.env import TEMPLATE_ROOM_ENV, read_after_start

if TYPE_CHECKING:
    from resilrun.worker_template import ScriptImports

# The flags a plain ``python -u`` starts with, where its environment does not say otherwise.
_PLAIN_FLAGS = ("inspect", "interactive", "isolated", "ignore_environment", "no_site", "no_user_site", "safe_path")


@dataclass(frozen=True, slots=True)
class _Declared:
    start_env: dict[str, str]
    loggers: dict[str, tuple[int, bool, bool, tuple[logging.Handler, ...]]]
    warning_filters: tuple[object, ...]


_DECLARED: _Declared | None = None


def declare_preloaded(start_env: Mapping[str, str]) -> None:
    """Say that this process has imported what the template imports (``worker_template.PRELOAD``),
    that its interpreter started with ``start_env`` and plain flags, and that its logging and
    warnings are now as a new Python's would be after those imports. Why a declaration and not a
    guess from ``/proc/self/environ``: a process may rewrite that area (a forked worker shows its
    own there), and only the process's creator knows what its libraries read when they loaded."""
    global _DECLARED
    manager = logging.Logger.manager
    loggers = {"": logging.getLogger()} | {
        name: logger for name, logger in manager.loggerDict.items() if isinstance(logger, logging.Logger)
    }
    _DECLARED = _Declared(
        start_env=dict(start_env),
        loggers={
            name: (logger.level, logger.propagate, logger.disabled, tuple(logger.handlers))
            for name, logger in loggers.items()
        },
        warning_filters=tuple(warnings.filters),
    )


def declared() -> bool:
    """Whether this process declared its imports done (then the agent says why it does not fork)."""
    return _DECLARED is not None


def why_not_fork_here(python: str, env: Mapping[str, str], *, before_devices: bool) -> str | None:
    """Why the template cannot be forked from this process (None: it can). ``before_devices``: the
    agent has not looked for accelerators yet (CUDA's first query breaks it in forked processes)."""
    declared = _DECLARED
    if declared is None:
        return "this process did not declare the template's imports done"
    from resilrun import worker_template

    missing = [name for name in worker_template.PRELOAD if name not in sys.modules]
    if missing:
        return f"{missing[0]} is not imported here"
    if python != sys.executable:
        return "the template runs another interpreter"
    if not before_devices:
        return "the agent has looked for devices (CUDA may not work in a process forked after that)"
    count = worker_template.threads()
    if count != 1:
        return f"the agent runs {count} threads (a fork would copy locks no thread releases)"
    if worker_template.why_not_fork() is not None:
        return "the agent holds a CUDA context"
    odd = [name for name in _PLAIN_FLAGS if getattr(sys.flags, name, 0)]
    if odd or sys._xoptions or (sys.warnoptions and "PYTHONWARNINGS" not in declared.start_env):
        return f"this interpreter did not start with plain flags ({', '.join(odd) or 'its -X/-W options'})"
    start = declared.start_env
    differ = sorted(
        k
        for k in env.keys() | start.keys()
        if k != TEMPLATE_ROOM_ENV and env.get(k) != start.get(k) and not read_after_start(k)
    )
    if differ:
        return f"the template's environment differs from this process's start in {', '.join(differ[:5])}"
    return None


class ForkedTemplate:
    """The template forked from the agent: the part of Popen's interface the agent uses on it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._reaped = False

    def kill(self) -> None:
        if not self._reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> None:
        if not self._reaped:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self._reaped = True


def fork_template(
    sock: socket.socket,
    env: Mapping[str, str],
    child_setup: Callable[[], None],
    handled: tuple[signal.Signals, ...],
    script: ScriptImports | None = None,
) -> ForkedTemplate:
    """Fork this process into the template (``why_not_fork_here`` said it may). ``handled``: the
    agent's signals, blocked across the fork as for every process it starts, so that none is
    delivered to the child before its handlers are the defaults again."""
    for stream in (sys.stdout, sys.stderr):  # nothing of the agent's output is written twice
        with contextlib.suppress(Exception):
            stream.flush()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, handled)
    try:
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        raise
    if pid != 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        return ForkedTemplate(pid)
    try:
        _become_template(sock.fileno(), env, child_setup, script)
    finally:
        os._exit(1)


def _become_template(
    fd: int, env: Mapping[str, str], child_setup: Callable[[], None], script: ScriptImports | None
) -> None:
    """In the forked child: the process a new template would be, then the template's own main."""
    gc.freeze()  # the agent's objects are never collected here: their finalizers would close fds reused below
    declared = _DECLARED
    assert declared is not None
    _default_signals()
    os.setsid()
    if fd < 3:  # keep the socket clear of the standard streams
        fd = fcntl.fcntl(fd, fcntl.F_DUPFD, 3)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.closerange(3, fd)
    os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))
    child_setup()  # unblocks the agent's signals, dies with the agent
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    _unbuffered_stdio()
    _restore_logging_and_warnings(declared)
    os.environ.clear()
    os.environ.update(env)
    from resilrun import worker_template

    # What ps and /proc show of it: its own command line and environment (the agent's secrets
    # withheld, as from a new template), not the agent's it was forked with.
    args = worker_template.command_args(fd, script)
    areas = worker_template.StartAreas.of_this_process()
    if areas is not None:
        areas.show([sys.executable, "-u", "-m", "resilrun.worker_template", *args], dict(env))
    worker_template.main(args)


def _default_signals() -> None:
    """Every handler the agent set back to a new interpreter's (SIGINT raises KeyboardInterrupt)."""
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if sig == signal.SIGINT:
            if handler is not signal.default_int_handler:
                signal.signal(sig, signal.default_int_handler)
        elif callable(handler):
            signal.signal(sig, signal.SIG_DFL)


def _unbuffered_stdio() -> None:
    """As ``python -u``: stdout and stderr written through (the workers forked from the template
    inherit these objects, and their lines must reach their logs as they are printed)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        encoding = getattr(old, "encoding", None) or "utf-8"
        errors = "backslashreplace" if name == "stderr" else getattr(old, "errors", None) or "strict"
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw, encoding=encoding, errors=errors, write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _restore_logging_and_warnings(declared: _Declared) -> None:
    """Logging and warnings as they were when the process declared itself (a new interpreter's after
    the same imports), not as the agent configured them since."""
    manager = logging.Logger.manager
    current = {"": logging.getLogger()} | {
        name: logger for name, logger in manager.loggerDict.items() if isinstance(logger, logging.Logger)
    }
    for name, logger in current.items():
        level, propagate, disabled, handlers = declared.loggers.get(name, (logging.NOTSET, True, False, ()))
        logger.handlers[:] = list(handlers)
        logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled
    warnings.resetwarnings()  # also forgets which "once" warnings the agent has shown
    warnings.filters[:] = list(declared.warning_filters)
