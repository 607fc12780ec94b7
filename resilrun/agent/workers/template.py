"""The agent's side of the node's worker template (resilrun/worker_template.py says why a
template and how a forked worker becomes the agent's child).

What may be forked: only the Python bootstrap (``python -u -m resilrun.worker_main ...``) with the
interpreter the template runs, and only an environment that equals the template's except for what
resilrun tells each process or node (its rank, its round, the network interface: ``read_after_start``), because
what the interpreter and the libraries read when they start (``OMP_NUM_THREADS``, ``PYTHON*``,
``LD_PRELOAD``) is fixed in the template. Anything else, or a template that cannot fork safely
(it says why), is started as a new process, and the log says so once. A template that dies or
does not answer is not asked again.

In a process that declared its imports done (``template_fork.declare_preloaded``: a launch server),
the template is forked from the agent itself instead of started as a new Python.
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
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from resilrun.agent.workers import template_fork
from resilrun.config import Config
from resilrun.env import TEMPLATE_ROOM_BYTES, TEMPLATE_ROOM_ENV, integrations_turned_off, read_after_start
from resilrun.prctl import PR_SET_CHILD_SUBREAPER, Prctl
from resilrun.worker_template import ScriptImports, command_args

logger = logging.getLogger(__name__)

ENTRY = ("-u", "-m", "resilrun.worker_main")
# Its imports (torch) take seconds of CPU; on a loaded node much longer. Past this, workers start
# as new processes and the template is given up.
READY_TIMEOUT_S = 120.0
# A fork takes milliseconds; one that has not answered by now is not waited for. Generous because a
# worker forked after the deadline would run untracked (the reply naming it never read).
_FORK_TIMEOUT_S = 60.0


def uses_template(config: Config) -> bool:
    """Whether the node forks its workers from a template: not for --no-python (no Python to
    preload) or --no-worker-template."""
    return not (config.no_python or config.no_worker_template)


def script_imports(config: Config, env: Mapping[str, str]) -> ScriptImports:
    """What the template imports of the job's script, as the workers of ``config`` with ``env``
    would: after the framework integrations' import hooks unless they are off, and after the
    re-run's hook on ``init_process_group`` with --rerun-in-process."""
    return ScriptImports(
        target=config.script,
        as_module=config.module,
        integrations=not config.no_integrations and not integrations_turned_off(env),
        rerun=config.rerun_in_process,
    )


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
        *,
        handled: tuple[signal.Signals, ...] = (),
        before_devices: bool = False,
        script: ScriptImports | None = None,
    ) -> None:
        """``prctl``: libc's, resolved by the caller (None: not Linux, no template);
        ``child_setup``: what runs in the template between its fork and exec (the spawn path's);
        ``handled``: the agent's signals; ``before_devices``: started before the agent looked for
        accelerators (only then may it be forked from the agent: template_fork.py); ``script``: the
        job's script, whose imports the template does too (worker_template.ScriptImports)."""
        self.python = python
        self.env = dict(env)
        self.script = script
        self._prctl = prctl
        self._lock = threading.Lock()
        self._ready = False
        self._broken: str | None = None if prctl is not None else "no prctl (not Linux)"
        self._said: set[str] = set()
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | template_fork.ForkedTemplate | None = None
        if self._broken is None:
            self._start(child_setup, handled, before_devices)

    def _start(
        self, child_setup: Callable[[], None], handled: tuple[signal.Signals, ...], before_devices: bool
    ) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        why_not = template_fork.why_not_fork_here(self.python, self.env, before_devices=before_devices)
        if why_not is None:
            try:
                self._process = template_fork.fork_template(theirs, self.env, child_setup, handled, self.script)
            except OSError as exc:
                logger.info("worker template: could not fork it here (%s); starting it as a new process", exc)
            else:
                logger.info("worker template forked from this process (its imports were done)")
                theirs.close()
                self._sock = ours
                return
        elif template_fork.declared():
            logger.info("worker template started as a new process: %s", why_not)
        try:
            self._process = subprocess.Popen(
                [
                    self.python,
                    *ENTRY[:2],
                    "resilrun.worker_template",
                    *command_args(theirs.fileno(), self.script),
                    " " * TEMPLATE_ROOM_BYTES,
                ],  # fmt: skip
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
            if hello.get("script_imports"):
                said = ", ".join(hello["script_imports"])
                logger.info("worker template: imported the script's packages too: %s", said)
            if hello.get("without_script"):
                logger.warning(
                    "worker template started again without %s; each worker imports them itself", hello["without_script"]
                )
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
