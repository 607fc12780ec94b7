"""The node's worker template: a process that has imported torch once and forks the node's
workers, spares and replacements, so that none of them pays Python's start and ``import torch``
(about 2.5 s of CPU each, the bulk of a replacement's start without a spare).

Why a separate process and not the agent: the agent runs threads (heartbeats, the channel, tees),
and a process forked from a threaded one inherits locks that no thread will ever release. The
template is single-threaded when it forks: it checks so before every fork, and says why not
(the agent then starts that worker as a new process). Libraries that keep thread pools stop them
at fork time (OpenBLAS does, through pthread_atfork), so one throwaway fork after the imports
leaves the template with its one thread. It never touches CUDA: a CUDA context does not survive
a fork, and ``torch.cuda.is_initialized()`` is checked before each one too.

How a worker becomes the agent's own child (its exit status and pidfd are the agent's, as for a
process it spawned itself): the agent marks itself a child subreaper while it asks; the template
forks an intermediate process that forks the worker and exits at once, so the kernel hands the
orphaned worker to the agent. The worker waits until it is the agent's child before it asks to
die with the agent (PR_SET_PDEATHSIG: set earlier, the intermediate's exit would deliver it).

Protocol (a SOCK_SEQPACKET socket pair, one JSON message per packet): the template says
``{"ready": true, "pid": ...}`` once its imports are done; each request
``{"argv": [...], "env": {...}, "cwd": "..."}`` carries the worker's stdin, stdout and stderr as
SCM_RIGHTS descriptors and gets ``{"pid": N}`` or ``{"error": "why"}``. The worker runs what
``python -u -m resilrun.worker_main ARGS`` runs. End of file on the socket ends the template.

Usage: ``python -u -m resilrun.worker_template FD [--script JSON | --without-script REASON] [ROOM]``
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, NoReturn

from resilrun.env import TEMPLATE_ROOM_BYTES, TEMPLATE_ROOM_ENV
from resilrun.prctl import PR_SET_PDEATHSIG, Prctl, resolve_prctl

# What a worker imports before its script's first line: torch (and what torch.distributed's
# tensor package pulls in, about a third of resilrun's worker import) and resilrun's bootstrap.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "resilrun.worker_main", "resilrun.integrations")
_MAX_REQUEST = 1 << 22
# How long a new worker waits to be handed to the agent (the intermediate exits right after forking).
_ADOPTION_TIMEOUT_S = 10.0


# Native threads that a fork cannot hurt: jemalloc's background purger (pyarrow's allocator, loaded
# by datasets and torchtitan), whose library takes every lock of its own before a fork and resets
# them, with its threads stopped, in the child (its pthread_atfork handlers).
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})


def threads() -> int:
    """How many threads this process runs, not counting those in ``FORK_SAFE_THREADS``."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return threading.active_count()
    return sum(1 for task in tasks if _thread_name(task) not in FORK_SAFE_THREADS)


def _thread_name(task: str) -> str | None:
    try:
        with open(f"/proc/self/task/{task}/comm", encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except OSError:  # it ended meanwhile
        return None


@dataclass(frozen=True, slots=True)
class StartAreas:
    """Where the kernel keeps this process's command line and environment (what ``ps``,
    ``/proc/PID/cmdline`` and ``/proc/PID/environ`` show): fixed at exec, so a forked worker would
    show the template's. The agent starts the template with room in both (``TEMPLATE_ROOM_ENV``) and each
    worker writes its own there, as a new process would show them (setproctitle's technique)."""

    arg_start: int
    arg_end: int
    env_start: int
    env_end: int

    @classmethod
    def of_this_process(cls) -> StartAreas | None:
        try:
            with open("/proc/self/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            return None
        fields = stat[stat.rfind(b")") + 2 :].split()  # from field 3 (state) on
        if len(fields) < 49:
            return None
        arg_start, arg_end, env_start, env_end = (int(f) for f in fields[45:49])
        if not (0 < arg_start < arg_end and 0 < env_start < env_end):
            return None
        return cls(arg_start, arg_end, env_start, env_end)

    def show(self, argv: list[str], env: dict[str, str]) -> None:
        """Make the command line read as ``argv`` (one line, as after setproctitle) and the
        environment as ``env``; either is left as it was when it does not fit. Only once libc's
        environment lives elsewhere (the caller replaced os.environ), since this overwrites the
        strings it pointed to."""
        title = " ".join(argv).encode(errors="surrogateescape")
        room = self.arg_end - self.arg_start
        if len(title) + 2 <= room:
            # NUL after the title, a non-NUL last byte: the kernel reads the title up to its NUL.
            ctypes.memmove(self.arg_start, title + b"\0" + b" " * (room - len(title) - 1), room)
        block = b"".join(f"{k}={v}".encode(errors="surrogateescape") + b"\0" for k, v in env.items())
        room = self.env_end - self.env_start
        if len(block) <= room:
            ctypes.memmove(self.env_start, block + b"\0" * (room - len(block)), room)


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without the call has no context either
        return False


def why_not_fork() -> str | None:
    """Why forking now would be unsafe, or None."""
    count = threads()
    if count != 1:
        return f"the template runs {count} threads (a fork would copy locks no thread releases)"
    if _cuda_initialized():
        return "the template holds a CUDA context, which a forked process cannot use"
    return None


@dataclass(frozen=True, slots=True)
class ScriptImports:
    """The job's script, whose top-level imports of installed packages the template imports too
    (``worker_main.script_imports``: what a hot spare preloads), after the import hooks its workers
    install first (the agent decides which: the template's environment lacks the workers' own).

    Why: a framework's import (transformers, torchtitan) costs seconds of CPU beyond torch's, paid
    by every replacement, restarted worker and spare; imported once here, forked workers have it.
    Where it cannot hold (an import started a thread, or queried CUDA: torch then marks every
    forked process unable to use the GPU), the template starts again without them and says why.
    """

    target: str
    as_module: bool
    integrations: bool
    rerun: bool

    def to_arg(self) -> str:
        return json.dumps([self.target, self.as_module, self.integrations, self.rerun])

    @classmethod
    def from_arg(cls, arg: str) -> ScriptImports:
        target, as_module, integrations, rerun = json.loads(arg)
        return cls(str(target), bool(as_module), bool(integrations), bool(rerun))


@dataclass(slots=True)
class Preloaded:
    """What the template imported: ``failed``, left to the workers; ``script``, the script's own
    imports done here; ``unsafe``: why the template may not fork with them loaded (None: it may)."""

    failed: list[str]
    script: list[str]
    unsafe: str | None = None


@dataclass(frozen=True, slots=True)
class EnvChanges:
    """What the script's imports did to the environment (a package that sets a variable as it loads):
    done again in each forked worker after it takes its own environment, as its own import would."""

    set: dict[str, str]
    removed: tuple[str, ...]

    @classmethod
    def between(cls, before: dict[str, str], after: dict[str, str]) -> EnvChanges:
        changed = {key: value for key, value in after.items() if before.get(key) != value}
        return cls(changed, tuple(key for key in before if key not in after))

    def apply(self) -> None:
        os.environ.update(self.set)
        for key in self.removed:
            os.environ.pop(key, None)


_POISONED = 3  # the throwaway fork's exit code when CUDA is unusable in a forked process
_ENV_CHANGES = EnvChanges({}, ())  # what the script's imports did to this template's environment


def _preload(script: ScriptImports | None) -> Preloaded:
    """Imports what every worker imports; what fails is left to the worker (it fails there, with its
    own traceback in its own log)."""
    global _ENV_CHANGES
    failed = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the worker's own import will report it
            failed.append(name)
    done = Preloaded(failed, [])
    attempted = False
    if script is not None and not failed:
        before = dict(os.environ)
        try:
            attempted, done.script, script_failed = _preload_script(script)
            done.failed.extend(script_failed)
        except Exception as exc:  # noqa: BLE001 - the machinery itself (finding them): none kept
            attempted, done.unsafe = True, f"finding them failed: {type(exc).__name__}: {exc}"
        _ENV_CHANGES = EnvChanges.between(before, dict(os.environ))
    # What was imported lives as long as the workers: kept out of their garbage collections, whose
    # visits would otherwise copy every page of it into each worker (copy-on-write).
    gc.freeze()
    # OpenBLAS (numpy's, torch's) starts a thread pool at import and stops it in its fork handler.
    # The child also says whether CUDA would still work in a process forked from here.
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _POISONED if _cuda_unusable_after_fork() else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    # Even imports that failed may have queried CUDA or started a thread before they raised.
    if attempted and done.unsafe is None:
        if os.waitstatus_to_exitcode(status) != 0:
            done.unsafe = "one of them queried CUDA, which a forked worker then cannot use"
        else:
            reason = why_not_fork()
            done.unsafe = f"after them {reason}" if reason else None
    return done


def _preload_script(script: ScriptImports) -> tuple[bool, list[str], list[str]]:
    """The script's imports (whether any was tried, those done, those failed), with the workers'
    import hooks installed first."""
    from resilrun import integrations, worker_main
    from resilrun.worker import _torch_compat

    if _torch_compat.cuda_unusable_after_fork() is None:  # this torch could not tell the template's state
        return False, [], []
    imports = [each for each in worker_main.script_imports(script.target, script.as_module) if not each.done()]
    if not imports:  # torch, the standard library: nothing to import or say
        return False, [], []
    if script.integrations:
        integrations.hook_frameworks()
    if script.rerun:
        worker_main.install_rerun_hook()
    done, failed = [], []
    # A library that checks for a GPU as it is imported asks NVML, not the driver: the template
    # stays fit to fork (the workers check the usual way).
    with _torch_compat.device_checks_through_nvml():
        for each in imports:
            try:
                each.run()
            except (Exception, SystemExit):  # noqa: BLE001 - the worker imports it again, with its rank, and reports it
                failed.append(str(each))
            else:
                done.append(each.module)
    return True, list(dict.fromkeys(done)), failed


def _cuda_unusable_after_fork() -> bool:
    """In the throwaway fork: whether torch marked this process unable to use CUDA."""
    if "resilrun.worker._torch_compat" not in sys.modules:  # only imported once torch imported whole
        return False
    from resilrun.worker import _torch_compat

    return bool(_torch_compat.cuda_unusable_after_fork())


def _exit_code(exc: BaseException) -> int:
    """What the interpreter would exit with after ``exc`` reached the top (its message printed)."""
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        sys.stderr.write(f"{exc.code}\n")
        return 1
    sys.excepthook(type(exc), exc, exc.__traceback__)
    return 1


def _become_worker(
    request: dict[str, Any], fds: list[int], agent_pid: int, prctl: Prctl | None, areas: StartAreas | None
) -> None:
    """In the forked worker: its session, streams, directory and environment, then the bootstrap."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _ENV_CHANGES.apply()
        if areas is not None:
            areas.show(request["argv"], request["env"])
        deadline = time.monotonic() + _ADOPTION_TIMEOUT_S
        while os.getppid() != agent_pid:
            if time.monotonic() > deadline:
                os._exit(1)
            time.sleep(0.001)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != agent_pid:  # the agent died before prctl took effect
            os._exit(1)
        from resilrun import worker_main

        args = list(request["argv"][4:])
        sys.argv = [worker_main.__file__, *args]
        worker_main.main(args)
        code = 0
    except KeyboardInterrupt:
        # As the interpreter does: a Ctrl-C that reached the top ends the process by SIGINT.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException as exc:  # noqa: BLE001 - the top of this process: report as Python would
        try:
            code = _exit_code(exc)
        except BaseException:  # noqa: BLE001
            code = 1
    finally:
        try:
            from resilrun.worker_main import exit_now

            exit_now(code)  # the way the bootstrap leaves, in a new process too
        finally:
            os._exit(code)


def _fork_worker(
    request: dict[str, Any],
    fds: list[int],
    sock: socket.socket,
    agent_pid: int,
    prctl: Prctl | None,
    areas: StartAreas | None,
) -> dict[str, Any]:
    reason = why_not_fork()
    if reason is not None:
        return {"error": reason}
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:  # the intermediate: fork the worker, say its pid, leave it to the agent
        try:
            os.close(read_end)
            pid = os.fork()
            if pid == 0:
                os.close(write_end)
                sock.close()
                _become_worker(request, fds, agent_pid, prctl, areas)
            os.write(write_end, str(pid).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        said = pipe.read()
    os.waitpid(middle, 0)
    return {"pid": int(said)} if said else {"error": "the intermediate process failed to fork"}


def serve(
    sock: socket.socket,
    agent_pid: int,
    areas: StartAreas | None,
    script: ScriptImports | None = None,
    without_script: str | None = None,
) -> None:
    """``script``: the job's script, whose imports the template does too; ``without_script``: why
    this template started again without them (for the agent's log)."""
    prctl = resolve_prctl()
    done = _preload(script)
    if done.unsafe is not None:
        _start_again_without_script(sock, f"the script's imports ({', '.join(done.script)}): {done.unsafe}")
    hello = {"ready": True, "pid": os.getpid(), "not_preloaded": done.failed, "script_imports": done.script}
    if without_script is not None:
        hello["without_script"] = without_script
    try:
        sock.send(json.dumps(hello).encode())
    except OSError:  # the agent is gone, or stopped before its first worker: nothing to serve
        return
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_REQUEST, 3)
        except OSError:
            return
        if not data:
            return
        try:
            request = json.loads(data)
            if len(fds) != 3:
                reply: dict[str, Any] = {"error": f"a request carries 3 descriptors, not {len(fds)}"}
            else:
                reply = _fork_worker(request, fds, sock, agent_pid, prctl, areas)
        except Exception as exc:  # noqa: BLE001 - said to the agent, which starts the worker itself
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        try:
            sock.send(json.dumps(reply).encode())
        except OSError:
            return


def _start_again_without_script(sock: socket.socket, reason: str) -> NoReturn:
    """A new interpreter in this process (its pid, its parent, its socket, its room for the workers'
    command lines, the environment it started with) that imports only what every worker imports:
    what the script's imports did to this one (a thread, CUDA's fork handler) cannot be undone."""
    fd = sock.fileno()
    try:
        os.set_inheritable(fd, True)
        env = {**_START_ENV, TEMPLATE_ROOM_ENV: "." * TEMPLATE_ROOM_BYTES * 8}
        args = [str(fd), _WITHOUT, reason, " " * TEMPLATE_ROOM_BYTES]
        os.execve(sys.executable, [sys.executable, "-u", "-m", "resilrun.worker_template", *args], env)
    except OSError as exc:  # the agent reads the socket's end: workers then start as new processes
        sys.stderr.write(f"resilrun: worker template could not start again without {reason}: {exc}\n")
    os._exit(1)


_START_ENV: dict[str, str] = {}  # this template's environment before any import of the script's
_SCRIPT = "--script"
_WITHOUT = "--without-script"


def command_args(fd: int, script: ScriptImports | None) -> list[str]:
    """The template's arguments after ``-m resilrun.worker_template``, but for the room."""
    return [str(fd), *([_SCRIPT, script.to_arg()] if script is not None else [])]


def main(argv: list[str]) -> None:
    """``argv``: ``FD [--script JSON | --without-script REASON] [ROOM]``."""
    # Started by the agent in a session of its own: a Ctrl-C at the terminal is the agent's to handle.
    areas = StartAreas.of_this_process()  # before anything moves libc's environment
    os.environ.pop(TEMPLATE_ROOM_ENV, None)
    _START_ENV.update(os.environ)
    sock = socket.socket(fileno=int(argv[0]))
    options = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i] in (_SCRIPT, _WITHOUT)}
    script = ScriptImports.from_arg(options[_SCRIPT]) if _SCRIPT in options else None
    serve(sock, os.getppid(), areas, script, options.get(_WITHOUT))
    os._exit(0)  # nothing to tear down: the interpreter's finalisation with torch loaded takes a second


if __name__ == "__main__":
    main(sys.argv[1:])
