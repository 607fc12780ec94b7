"""Mechanism for worker processes: spawn, poll, signal, escalate, and route their output.

Invariants: every worker is the leader of its own process group (so signals reach its children,
e.g. data-loader workers) and dies with the agent (PR_SET_PDEATHSIG), so a SIGKILLed agent leaves
no orphans. The agent's handled signals are blocked while forking so a Ctrl-C cannot land between
fork and bookkeeping; children start with them unblocked.

Ownership: a WorkerProcess belongs to the thread that spawned it (the supervisor loop). Only that
thread reaps it, waits on it and closes its pidfd, so a descriptor is never closed (and its number
reused) under a ``wait_any_exit`` that selects on it. Other threads (the status publisher) read
``snapshot()``, which has no side effects.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO

from resilrun.agent.workers.template import AdoptedProcess, WorkerTemplate
from resilrun.env import STATE_LOST_EXIT_CODE, STATE_REFUSED_EXIT_CODE, python_exec
from resilrun.errors import ConfigError
from resilrun.option_values import Std
from resilrun.prctl import PR_SET_PDEATHSIG, Prctl, resolve_prctl
from resilrun.private_file import open_private_output
from resilrun.worker_template import ScriptImports

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# Built before any fork so the child converts nothing (a set of plain ints for pthread_sigmask).
_HANDLED_SIGNUMS = frozenset(int(s) for s in HANDLED_SIGNALS)
_SIGKILL = int(signal.SIGKILL)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How to start one worker and where its output goes."""

    local_rank: int
    global_rank: int
    argv: tuple[str, ...]
    env: dict[str, str]
    log_dir: Path
    to_file: Std  # streams written to files
    to_console: Std  # streams shown on the console (teed when also in files)

    @property
    def error_file(self) -> Path:
        return self.log_dir / "error.json"


def _child_setup(agent_pid: int, prctl: Prctl | None) -> None:
    """Runs in the child between fork and exec: only calls resolved in the parent (no dlopen, no
    imports), each a thin wrapper of an async-signal-safe syscall (sigprocmask, prctl, getppid, _exit)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED_SIGNUMS)
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, _SIGKILL)
    if os.getppid() != agent_pid:  # the agent died before prctl took effect
        os._exit(1)


class _Tee(threading.Thread):
    """Copies a worker's pipe to its log file and, prefixed, to the agent's console."""

    _console_lock = threading.Lock()

    def __init__(self, pipe: IO[bytes], file: IO[bytes] | None, console: IO[bytes] | None, prefix: bytes) -> None:
        super().__init__(daemon=True)
        self.pipe, self.file, self.console, self.prefix = pipe, file, console, prefix

    def run(self) -> None:
        for line in iter(self.pipe.readline, b""):
            if self.file is not None:
                self.file.write(line)
                self.file.flush()
            if self.console is not None:
                with self._console_lock:
                    self.console.write(self.prefix + line)
                    self.console.flush()
        self.pipe.close()
        if self.file is not None:
            self.file.close()


class WorkerState(Enum):
    """Where a worker process is, as the agent judges it from its exit (the one place an exit
    code is read for its meaning).

    A worker is RUNNING from its spawn until its exit is seen; then exactly one of the others,
    for good (a process never runs again: a restart or a spare is another process):

    - SUCCEEDED: exit 0, the script finished;
    - STATE_LOST: the worker's restore found no tier holding a step for every rank (the bootstrap's
      ``STATE_LOST_EXIT_CODE``): the job stops rather than start over from step 0;
    - STATE_REFUSED: a persisted step failed its checks or MACs (``STATE_REFUSED_EXIT_CODE``): the
      job stops rather than train on another step quietly;
    - FAILED: any other code, or a signal (negative): a failure the job recovers from.
    """

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STATE_LOST = "state_lost"
    STATE_REFUSED = "state_refused"

    @classmethod
    def of(cls, exit_code: int | None) -> WorkerState:
        if exit_code is None:
            return cls.RUNNING
        if exit_code == 0:
            return cls.SUCCEEDED
        return {STATE_LOST_EXIT_CODE: cls.STATE_LOST, STATE_REFUSED_EXIT_CODE: cls.STATE_REFUSED}.get(
            exit_code, cls.FAILED
        )

    @property
    def ended(self) -> bool:
        return self is not WorkerState.RUNNING


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """What another thread may know of a worker: copied under its lock, so the fields agree."""

    pid: int
    local_rank: int
    global_rank: int
    started_at: float
    exit_code: int | None  # None: running (as far as the exit can be seen without reaping it)
    exit_observed_at: float | None  # when the owner reaped the exit (None: not yet)

    @property
    def state(self) -> WorkerState:
        return WorkerState.of(self.exit_code)


class WorkerProcess:
    """One running worker and the threads that carry its output; owned by the thread that spawned it."""

    def __init__(
        self,
        spec: WorkerSpec,
        popen: subprocess.Popen[bytes] | AdoptedProcess,
        tees: list[_Tee],
        files: list[IO[bytes]],
    ):
        self._lock = threading.Lock()  # guards _spec, _exit_observed_at, _pidfd against snapshot()
        self._owner = threading.get_ident()
        self._spec = spec
        self.popen = popen
        self.tees = tees
        self._files = files
        self._exit_observed_at: float | None = None
        # Wall clock, like exit_observed_at: a spare started after a failure was seen is not a warm one.
        self.started_at = time.time()
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):  # pidfds need Linux >= 5.3
            self._pidfd = os.pidfd_open(popen.pid)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def spec(self) -> WorkerSpec:
        return self._spec

    @spec.setter
    def spec(self, spec: WorkerSpec) -> None:
        """A promoted spare or a survivor moves to a new generation's spec."""
        with self._lock:
            self._spec = spec

    @property
    def exit_observed_at(self) -> float | None:
        return self._exit_observed_at

    def _require_owner(self, what: str) -> None:
        if threading.get_ident() != self._owner:
            raise RuntimeError(f"WorkerProcess.{what}() belongs to the thread that spawned the worker; use snapshot()")

    def poll(self) -> int | None:
        """Owner only: reaps an exit, notes when it was seen and closes the pidfd.

        Safe to close here: the owner is also the only thread that waits on the pidfd
        (``wait_any_exit``), so no select can hold it meanwhile.
        """
        self._require_owner("poll")
        if self.popen.returncode is None and self._exited_unreaped():
            # What the worker started in its session (DataLoader workers, helper processes) is
            # orphaned now; a dead rank replaced in-process is never stopped as a whole, so end
            # them here, while the unreaped exit still pins the pid: the group id cannot yet be
            # reused by another process.
            self.signal_group(signal.SIGKILL)
        code = self.popen.poll()
        if code is not None:
            with self._lock:
                if self._exit_observed_at is None:
                    self._exit_observed_at = time.time()
                if self._pidfd is not None:
                    with contextlib.suppress(OSError):
                        os.close(self._pidfd)
                    self._pidfd = None
        return code

    def _exited_unreaped(self) -> bool:
        try:
            info = os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere (Popen.wait): nothing pins the pid any more
            return False
        return info is not None

    def snapshot(self) -> WorkerSnapshot:
        """Any thread: the worker as it is now, without reaping it or touching its descriptors."""
        with self._lock:
            spec = self._spec
            return WorkerSnapshot(
                pid=self.popen.pid,
                local_rank=spec.local_rank,
                global_rank=spec.global_rank,
                started_at=self.started_at,
                exit_code=self._peek_exit_locked(),
                exit_observed_at=self._exit_observed_at,
            )

    def _peek_exit_locked(self) -> int | None:
        """The exit code, reaped or not; with the lock held the pidfd stays this worker's."""
        code = self.popen.returncode
        if code is not None or self._pidfd is None:
            return code
        try:  # WNOWAIT: the exit stays for the owner's poll() to reap
            info = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (AttributeError, ChildProcessError, OSError):  # no P_PIDFD, or the owner reaped it just now
            return self.popen.returncode
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def exit_fd(self) -> int | None:
        """Owner only: a descriptor that becomes readable when the worker exits (None: poll instead)."""
        self._require_owner("exit_fd")
        return self._pidfd

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signum)

    def finish_output(self, timeout: float = 2.0) -> None:
        for tee in self.tees:
            tee.join(timeout)
        for handle in self._files:
            with contextlib.suppress(OSError):
                handle.close()
        self.poll()  # closes the pidfd once the worker is gone


def _open_stream(spec: WorkerSpec, bit: Std, name: str) -> tuple[int | IO[bytes] | None, IO[bytes] | None, bool]:
    """(Popen argument, file handle, needs a tee thread) for one stream of one worker."""
    in_file = bool(spec.to_file & bit)
    on_console = bool(spec.to_console & bit)
    if not in_file:
        return (None if on_console else subprocess.DEVNULL), None, False
    # never through a link planted at the path: "wb" would truncate the link's target
    handle = os.fdopen(open_private_output(spec.log_dir / f"{name}.log"), "wb")
    if on_console:
        return subprocess.PIPE, handle, True
    return handle, handle, False


def _make_log_dir(log_dir: Path) -> None:
    """``<round>/<rank>`` under the run's log directory, made 0700; a symbolic link at either is
    refused, since the logs written below it would land wherever it points.

    Raises:
        ConfigError: ``log_dir`` or its parent is a symbolic link.
    """
    for path in (log_dir.parent, log_dir):  # each checked before anything is made below it
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        if path.is_symlink():
            raise ConfigError(
                f"log directory {path} is a symbolic link: refusing to write through it",
                hint="remove it: nothing but resilrun should write in the run's log directory",
            )


def child_setup() -> Callable[[], None]:
    """What a process the agent starts runs between fork and exec: resolved here, in the agent."""
    agent_pid = os.getpid()
    prctl = resolve_prctl()  # before forking: the child must not dlopen
    return lambda: _child_setup(agent_pid, prctl)


def start_template(
    env: Mapping[str, str], *, before_devices: bool = False, script: ScriptImports | None = None
) -> WorkerTemplate:
    """The node's worker template, started as the agent starts its other processes.
    ``before_devices``: the agent has not looked for accelerators yet (template_fork.py);
    ``script``: the job's script, whose imports the template does too."""
    return WorkerTemplate(
        python_exec(),
        env,
        resolve_prctl(),
        child_setup(),
        handled=HANDLED_SIGNALS,
        before_devices=before_devices,
        script=script,
    )


def _new_process(
    argv: tuple[str, ...], env: dict[str, str], out_arg: int | IO[bytes] | None, err_arg: int | IO[bytes] | None
) -> subprocess.Popen[bytes]:
    setup = child_setup()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
    try:
        return subprocess.Popen(
            list(argv),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out_arg,
            stderr=err_arg,
            start_new_session=True,
            preexec_fn=setup,  # noqa: PLW1509 - it calls only what the parent resolved
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _forked(
    template: WorkerTemplate, spec: WorkerSpec, out_arg: int | IO[bytes] | None, err_arg: int | IO[bytes] | None
) -> AdoptedProcess | None:
    """The worker forked from the node's template with the streams Popen would have given it, or
    None (then it is started as a new process)."""
    opened: list[int] = []  # what the agent closes once the template holds its own copies
    readers: list[IO[bytes] | None] = []
    fds = []
    try:
        for console, arg in ((None, subprocess.DEVNULL), (1, out_arg), (2, err_arg)):
            reader = None
            if arg is None and console is not None:
                fd = console
            elif arg == subprocess.DEVNULL or arg is None:
                fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
                opened.append(fd)
            elif arg == subprocess.PIPE:
                read_end, fd = os.pipe2(os.O_CLOEXEC)
                opened.append(fd)
                reader = os.fdopen(read_end, "rb")
            else:
                assert not isinstance(arg, int)
                fd = arg.fileno()
            fds.append(fd)
            if console is not None:
                readers.append(reader)
        process = template.start(spec.argv, spec.env, fds)
    finally:
        for fd in opened:
            os.close(fd)
    if process is None:
        for reader in readers:
            if reader is not None:
                reader.close()
        return None
    process.stdout, process.stderr = readers
    return process


def prepare_log_dir(spec: WorkerSpec) -> None:
    """The folder a worker's logs and error file go to in its generation, made before the worker
    is given the spec (a new process, or one that enters a generation in-process: it writes its
    error file there, and torch's ``@record`` does not make the folder), with no stale error file."""
    _make_log_dir(spec.log_dir)
    with contextlib.suppress(FileNotFoundError):
        spec.error_file.unlink()


def spawn(spec: WorkerSpec, template: WorkerTemplate | None = None) -> WorkerProcess:
    """Start one worker in its own session: forked from the node's ``template`` where it can be,
    else as a new process, with the signals handled by the agent blocked meanwhile."""
    prepare_log_dir(spec)
    out_arg, out_file, out_tee = _open_stream(spec, Std.OUT, "stdout")
    try:
        err_arg, err_file, err_tee = _open_stream(spec, Std.ERR, "stderr")
    except BaseException:
        if out_file is not None:
            out_file.close()
        raise
    popen: subprocess.Popen[bytes] | AdoptedProcess | None = None
    if template is not None:
        popen = _forked(template, spec, out_arg, err_arg)
    if popen is None:
        popen = _new_process(spec.argv, spec.env, out_arg, err_arg)
    prefix = f"[rank {spec.global_rank}]: ".encode()
    tees: list[_Tee] = []
    files = [f for f in (out_file, err_file) if f is not None]
    if out_tee and popen.stdout is not None:
        tees.append(_Tee(popen.stdout, out_file, sys.stdout.buffer, prefix))
    if err_tee and popen.stderr is not None:
        tees.append(_Tee(popen.stderr, err_file, sys.stderr.buffer, prefix))
    for tee in tees:
        tee.start()
    return WorkerProcess(spec, popen, tees, [f for f in files if not any(t.file is f for t in tees)])


def wait_any_exit(workers: Iterable[WorkerProcess], timeout_s: float) -> None:
    """Owner only: sleep up to ``timeout_s``, waking as soon as one of ``workers`` exits.

    Why: a fixed poll interval adds up to one interval to every failure's detection; waking on the
    exit itself takes that out of the recovery time. Falls back to a plain sleep without pidfds.
    The pidfds stay open throughout: only the owner (this thread) closes them, in ``poll()``.
    """
    fds = [fd for fd in (w.exit_fd() for w in workers if w.popen.returncode is None) if fd is not None]
    if not fds:
        time.sleep(timeout_s)
        return
    try:
        select.select(fds, [], [], timeout_s)
    except (OSError, ValueError):  # not expected (the owner closes pidfds only in poll()); poll again soon
        time.sleep(min(timeout_s, 0.01))


def stop(workers: Iterable[WorkerProcess], signum: int, grace_s: float) -> None:
    """Signal every worker's process group, wait up to ``grace_s``, then SIGKILL what is left."""
    workers = list(workers)
    for worker in workers:
        worker.signal_group(signum)
    deadline = time.monotonic() + grace_s
    for worker in workers:
        remaining = max(0.0, deadline - time.monotonic())
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.popen.wait(remaining)
    for worker in workers:
        # The group may hold grandchildren even when the worker itself has exited.
        worker.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.popen.wait(5.0)
        worker.poll()
        worker.finish_output()


class Processes:
    """Starting, waiting on and stopping workers, as one object the supervisor's parts are given.

    Why an object: the recovery decisions are unit-tested against fake processes and a fake clock
    (tests/unit/test_recovery_paths.py); the real ones are the module's functions above, forking
    from the node's ``template`` when there is one.
    """

    def __init__(self, template: WorkerTemplate | None = None) -> None:
        self.template = template

    def spawn(self, spec: WorkerSpec) -> WorkerProcess:
        return spawn(spec, self.template)

    def wait_any_exit(self, workers: Iterable[WorkerProcess], timeout_s: float) -> None:
        wait_any_exit(workers, timeout_s)

    def stop(self, workers: Iterable[WorkerProcess], signum: int, grace_s: float) -> None:
        stop(workers, signum, grace_s)
