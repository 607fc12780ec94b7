"""The agent's side of the node's worker template (resilrun/worker_template.py says why a
template and how a forked worker becomes the agent's child).

What may be forked: only the Python bootstrap (``python -u -m resilrun.worker_main ...``) with the
interpreter the template runs, and only an environment that equals the template's except for what
resilrun tells each process or node (its rank, its round, the network interface: ``read_after_start``), because
what the interpreter and the libraries read when they start (``OMP_NUM_THREADS``, ``PYTHON*``,
``LD_PRELOAD``) is fixed in the template. Anything else, or a template that cannot fork safely
(it says why), is started as a new process, and the log says so once. A template that dies or
does not answer is not asked again.

A process that launches jobs from one interpreter with torch already imported (the tests' launcher
does; a launcher started from a shell never does) may declare it with ``declare_preloaded``: the
template is then forked from the agent itself instead of started as a new Python, as long as nothing
the interpreter and its libraries read at start differs (the same rule as for forking workers).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from resilrun.config import Config
from resilrun.env import TEMPLATE_ROOM_BYTES, TEMPLATE_ROOM_ENV, read_after_start
from resilrun.prctl import PR_SET_CHILD_SUBREAPER, Prctl

logger = logging.getLogger(__name__)

ENTRY = ("-u", "-m", "resilrun.worker_main")
# Its imports (torch) take seconds of CPU; on a loaded node much longer. Past this, workers start
# as new processes and the template is given up.
READY_TIMEOUT_S = 120.0
# A fork takes milliseconds; one that has not answered by now is not waited for. Generous because a
# worker forked after the deadline would run untracked (the reply naming it never read).
_FORK_TIMEOUT_S = 60.0


# The environment this process started with, when it declared the template's imports done.
_PRELOADED_START_ENV: dict[str, str] | None = None


def declare_preloaded(start_env: Mapping[str, str]) -> None:
    """Say that this process has imported what the template imports (``worker_template.PRELOAD``)
    and that its interpreter started with ``start_env`` (and ``-u``, as the template's does), so that
    the node's template may be forked from it: two or more seconds of CPU (``import torch``) saved
    each time an agent runs in it. Why a declaration and not a guess from ``/proc/self/environ``: a
    process may rewrite that area (a forked worker shows its own there), and only the process's
    creator knows what its libraries read when they were loaded. The process must be
    single-threaded when the agent starts its template (checked: else a new Python, as always)."""
    global _PRELOADED_START_ENV
    _PRELOADED_START_ENV = dict(start_env)


def why_not_fork_here(python: str, env: Mapping[str, str]) -> str | None:
    """Why the template cannot be forked from this process (None: it can)."""
    from resilrun import worker_template

    if _PRELOADED_START_ENV is None:
        return "this process did not declare the template's imports done"
    missing = [name for name in worker_template.PRELOAD if name not in sys.modules]
    if missing:
        return f"{missing[0]} is not imported here"
    if python != sys.executable:
        return "the template runs another interpreter"
    reason = worker_template.why_not_fork()
    if reason is not None:
        return reason
    start = _PRELOADED_START_ENV
    differ = sorted(
        k
        for k in env.keys() | start.keys()
        if k != TEMPLATE_ROOM_ENV and env.get(k) != start.get(k) and not read_after_start(k)
    )
    if differ:
        return f"the template's environment differs from this process's start in {', '.join(differ[:5])}"
    return None


class _ForkedTemplate:
    """The template forked from the agent: the part of Popen's interface ``_stop`` uses."""

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


def _fork_template(sock: socket.socket, env: Mapping[str, str], child_setup: Callable[[], None]) -> _ForkedTemplate:
    """Fork this process into the template: in the child, what the spawn path gives a new process
    (its session, no stdin or stdout, only the socket open, default signal handling, ``env``), then
    the template's own main. The imports it would do are already here."""
    keep = sock.fileno()
    pid = os.fork()
    if pid != 0:
        return _ForkedTemplate(pid)
    try:  # the child: never returns
        child_setup()
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.closerange(3, keep)
        os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.environ.clear()
        os.environ.update(env)
        from resilrun import worker_template

        # What ps and /proc show of it: its own command line and environment (the agent's secrets
        # withheld, as from a new template), not the agent's it was forked with.
        areas = worker_template.StartAreas.of_this_process()
        if areas is not None:
            areas.show([sys.executable, *ENTRY[:2], "resilrun.worker_template", str(keep)], dict(env))
        worker_template.main([str(keep)])
    finally:
        os._exit(1)


def uses_template(config: Config) -> bool:
    """Whether the node forks its workers from a template: not for --no-python (no Python to
    preload) or --no-worker-template."""
    return not (config.no_python or config.no_worker_template)


class AdoptedProcess:
    """A worker the template forked and the kernel handed to the agent: the part of Popen's
    interface the agent uses (pid, returncode, poll, wait), on the agent's own child."""

    def __init__(self, pid: int, args: Sequence[str], stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid = pid
        self.args = list(args)
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: as Popen, nothing more can be known
                self.returncode = 0
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pidfd = None
        with contextlib.suppress(AttributeError, OSError):
            pidfd = os.pidfd_open(self.pid)
        try:
            while self.poll() is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                if pidfd is not None:
                    select.select([pidfd], [], [], remaining)
                else:
                    time.sleep(0.01 if remaining is None else min(0.01, remaining))
        finally:
            if pidfd is not None:
                os.close(pidfd)
        assert self.returncode is not None
        return self.returncode


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


class WorkerTemplate:
    """One node's template process, asked from the thread that spawns workers (one at a time)."""

    def __init__(
        self,
        python: str,
        env: Mapping[str, str],
        prctl: Prctl | None,
        child_setup: Callable[[], None],
    ) -> None:
        """``prctl``: libc's, resolved by the caller (None: not Linux, no template);
        ``child_setup``: what runs in the template between its fork and exec (the spawn path's)."""
        self.python = python
        self.env = dict(env)
        self._prctl = prctl
        self._lock = threading.Lock()
        self._ready = False
        self._broken: str | None = None if prctl is not None else "no prctl (not Linux)"
        self._said: set[str] = set()
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | _ForkedTemplate | None = None
        if self._broken is None:
            self._start(child_setup)

    def _start(self, child_setup: Callable[[], None]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        why_not = why_not_fork_here(self.python, self.env)
        if why_not is not None and _PRELOADED_START_ENV is not None:
            logger.info("worker template started as a new process: %s", why_not)
        if why_not is None:
            try:
                self._process = _fork_template(theirs, self.env, child_setup)
                logger.info("worker template forked from this process (its imports were done)")
            except OSError as exc:
                ours.close()
                self._broken = f"the template could not be forked: {exc}"
                return
            finally:
                theirs.close()
            self._sock = ours
            return
        try:
            self._process = subprocess.Popen(
                [self.python, *ENTRY[:2], "resilrun.worker_template", str(theirs.fileno()), " " * TEMPLATE_ROOM_BYTES],
                env={**self.env, TEMPLATE_ROOM_ENV: "." * TEMPLATE_ROOM_BYTES * 8},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                preexec_fn=child_setup,  # noqa: PLW1509 - the spawn path's, which calls only resolved functions
            )
        except OSError as exc:
            ours.close()
            self._broken = f"the template did not start: {exc}"
            return
        finally:
            theirs.close()
        self._sock = ours

    def start(self, argv: Sequence[str], env: Mapping[str, str], streams: Sequence[int]) -> AdoptedProcess | None:
        """The worker ``argv`` describes, forked from the template with ``streams`` as its stdin,
        stdout and stderr; None when it must be started as a new process (logged once per reason)."""
        with self._lock:
            reason = self._why_not(argv, env)
            if reason is None:
                try:
                    return self._fork(argv, env, streams)
                except _Unusable as exc:
                    reason = str(exc)
                    self._give_up(reason)
            self._say(reason)
            return None

    def _why_not(self, argv: Sequence[str], env: Mapping[str, str]) -> str | None:
        if self._broken is not None:
            return self._broken
        if tuple(argv[:4]) != (self.python, *ENTRY):
            return "the command is not resilrun's Python bootstrap (--no-python)"
        differ = sorted(
            k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k) and not read_after_start(k)
        )
        if differ:
            return f"its environment differs from the template's in {', '.join(differ[:5])}"
        return None

    def _fork(self, argv: Sequence[str], env: Mapping[str, str], streams: Sequence[int]) -> AdoptedProcess:
        sock = self._sock
        assert sock is not None and self._prctl is not None
        if not self._ready:
            hello = self._receive(sock, READY_TIMEOUT_S, "its imports")
            self._ready = True
            if hello.get("not_preloaded"):
                logger.info("worker template: not preloaded (the workers import them): %s", hello["not_preloaded"])
        request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": os.getcwd()}).encode()
        if self._prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
            raise _Unusable("the agent cannot adopt forked workers (PR_SET_CHILD_SUBREAPER refused)")
        try:
            try:
                socket.send_fds(sock, [request], list(streams))
            except OSError as exc:
                raise _Unusable(f"the template is gone ({exc.strerror})") from exc
            reply = self._receive(sock, _FORK_TIMEOUT_S, "a fork")
        finally:
            self._prctl(PR_SET_CHILD_SUBREAPER, 0)
        if "pid" not in reply:
            raise _Unusable(str(reply.get("error", "the template said nothing")))
        pid = int(reply["pid"])
        if _parent_of(pid) != os.getpid():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            raise _Unusable("a forked worker was not handed to the agent")
        return AdoptedProcess(pid, argv, None, None)

    def _receive(self, sock: socket.socket, timeout_s: float, what: str) -> dict[str, object]:
        readable, _, _ = select.select([sock], [], [], timeout_s)
        if not readable:
            raise _Unusable(f"the template did not answer within {timeout_s:.0f} s ({what})")
        try:
            data = sock.recv(1 << 16)
        except OSError as exc:
            raise _Unusable(f"the template is gone ({exc.strerror})") from exc
        if not data:
            raise _Unusable("the template exited")
        reply = json.loads(data)
        if not isinstance(reply, dict):
            raise _Unusable("the template answered nonsense")
        return reply

    def _give_up(self, reason: str) -> None:
        self._broken = reason
        self._stop()

    def _say(self, reason: str) -> None:
        if reason not in self._said:
            self._said.add(reason)
            logger.warning("worker template not used: %s; starting workers as new processes", reason)

    def _stop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        process = self._process
        if process is not None:
            # Nothing of its own to clean up (the workers are the agent's children), and it may be
            # in the middle of its imports, deaf to the closed socket for seconds: killed at once.
            process.kill()
            process.wait()

    def close(self) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = "closed"
            self._stop()


class _Unusable(Exception):
    """The template cannot be asked (any more): the reason, for the log."""
