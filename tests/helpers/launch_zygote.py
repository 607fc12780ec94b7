"""The tests' launcher server: one Python per xdist worker that has imported torch and resilrun once
and forks each ``resilrun`` launch the tests start (issue 47, part 4: the suite is CPU-bound, and
every launch paid a new interpreter for the launcher and ``import torch`` for its node's template).

What a launch gets is what ``subprocess.Popen([python, "-m", "resilrun", ...], start_new_session=True)``
gives it: its own session, its stdin (/dev/null), stdout and stderr, directory, environment and
command line (shown in ``ps`` and /proc as the launch's own: the server starts with room for them,
as the worker template does), and an interpreter that runs ``python -m resilrun`` and exits as one
does (atexit handlers, non-daemon threads joined). Its agent then forks the node's worker template
from itself (``resilrun.agent.workers.template.declare_preloaded``) when the launch's environment
differs from the server's only in what nothing reads at start; otherwise (a ``PYTHONPATH``, an
``OMP_NUM_THREADS`` of the test's own) it starts the template as a new Python, as without the server.

The server stays single-threaded: it forks only from its one thread, reaps its children itself and
answers their exit status when asked (the tests' ``Launch`` polls it). It dies with its xdist worker.
``RESILRUN_TEST_LAUNCH_SERVER=0`` in the tests' environment starts every launch as a new process.

Protocol (SOCK_SEQPACKET, one JSON message per packet): ``{"ready": true}`` once the imports are
done; ``{"start": {"argv", "env", "cwd"}}`` with stdin, stdout and stderr as SCM_RIGHTS descriptors
-> ``{"pid": N}`` or ``{"error": "why"}``; ``{"poll": N}`` -> ``{"code": exit status or null}``.
Usage: ``python -u -m tests.helpers.launch_zygote FD ROOM``
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
from typing import Any

from resilrun.env import TEMPLATE_ROOM_BYTES, TEMPLATE_ROOM_ENV
from resilrun.prctl import PR_SET_PDEATHSIG, resolve_prctl
from resilrun.worker_template import PRELOAD, StartAreas, threads

# What a launch imports besides the template's: the command line and the agent (the agent imports
# its node module once the template is started).
LAUNCHER = ("resilrun.cli", "resilrun.agent", "resilrun.agent.node", "resilrun.agent.workers.procs")
ENABLED_ENV = "RESILRUN_TEST_LAUNCH_SERVER"
_MAX_REQUEST = 1 << 22


def _become_launch(
    request: dict[str, Any], fds: list[int], areas: StartAreas | None, start_env: dict[str, str]
) -> None:
    """In the forked child: the launch's session, streams, directory, environment and command line,
    then ``python -m resilrun`` as the interpreter runs it. Raises SystemExit to end as Python does."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as ``python -m`` puts it first
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    if areas is not None:
        areas.show(argv, request["env"])
    from resilrun.agent.workers.template import declare_preloaded

    declare_preloaded(start_env)
    sys.argv = [argv[0], *argv[3:]]  # as -m sets it: the module's path replaces "-m resilrun"
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


def _serve(sock: socket.socket, areas: StartAreas | None, start_env: dict[str, str]) -> None:
    codes: dict[int, int | None] = {}
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        with contextlib.suppress(ChildProcessError):
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                codes[pid] = os.waitstatus_to_exitcode(status)
        if not readable:
            continue
        data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_REQUEST, 3)
        if not data:
            return
        request = json.loads(data)
        if "poll" in request:
            reply: dict[str, Any] = {"code": codes.get(int(request["poll"]))}
        elif threads() != 1:
            reply = {"error": f"the launch server runs {threads()} threads"}
        else:
            pid = os.fork()
            if pid == 0:
                sock.close()
                _become_launch(request["start"], fds, areas, start_env)
                raise SystemExit(0)  # run_module returned: the script ended without exiting
            codes[pid] = None
            reply = {"pid": pid}
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps(reply).encode())


def main(argv: list[str]) -> None:
    areas = StartAreas.of_this_process()  # before anything moves libc's environment
    os.environ.pop(TEMPLATE_ROOM_ENV, None)
    start_env = dict(os.environ)
    prctl = resolve_prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))  # gone with the xdist worker that started it
    for name in (*PRELOAD, *LAUNCHER):
        importlib.import_module(name)
    gc.freeze()
    pid = os.fork()  # OpenBLAS stops its thread pool in its fork handler (resilrun/worker_template.py)
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    sock = socket.socket(fileno=int(argv[0]))
    sock.send(json.dumps({"ready": True}).encode())
    _serve(sock, areas, start_env)
    os._exit(0)


class LaunchedProcess:
    """A launch the server forked: the part of Popen's interface the tests use."""

    def __init__(self, server: LaunchServer, pid: int, args: list[str]) -> None:
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.poll(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class LaunchServer:
    """The tests' side: starts the server on first use, forks launches through it. ``omp``: the
    ``OMP_NUM_THREADS`` it starts with (None: unset), which libgomp reads as torch loads: the launcher
    gives workers 1 when two or more share a node, none for one, so launches of each kind have a
    server whose torch their template can be forked from."""

    def __init__(self, omp: str | None) -> None:
        self.start_env = {k: v for k, v in base_env().items() if k != "OMP_NUM_THREADS"}
        if omp is not None:
            self.start_env["OMP_NUM_THREADS"] = omp
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._process: Any = None
        self.broken: str | None = None

    def _ensure(self) -> socket.socket:
        import subprocess

        if self._sock is not None:
            return self._sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**self.start_env, TEMPLATE_ROOM_ENV: "." * TEMPLATE_ROOM_BYTES * 8}
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-u",
                "-m",
                "tests.helpers.launch_zygote",
                str(theirs.fileno()),
                " " * TEMPLATE_ROOM_BYTES,
            ],
            env=env,
            cwd=root,
            stdin=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
        )
        theirs.close()
        hello = self._receive(ours, 120.0)
        if not hello.get("ready"):
            raise RuntimeError(f"the launch server did not start: {hello}")
        self._sock = ours
        return ours

    @staticmethod
    def _receive(sock: socket.socket, timeout_s: float) -> dict[str, Any]:
        readable, _, _ = select.select([sock], [], [], timeout_s)
        if not readable:
            raise RuntimeError(f"the launch server did not answer within {timeout_s:.0f} s")
        data = sock.recv(1 << 16)
        if not data:
            raise RuntimeError("the launch server exited")
        return json.loads(data)

    def start(self, argv: list[str], env: dict[str, str], cwd: str, streams: list[int]) -> LaunchedProcess:
        with self._lock:
            sock = self._ensure()
            request = {"start": {"argv": argv, "env": env, "cwd": cwd}}
            socket.send_fds(sock, [json.dumps(request).encode()], streams)
            reply = self._receive(sock, 60.0)
        if "pid" not in reply:
            raise RuntimeError(f"the launch server could not start {argv}: {reply.get('error')}")
        return LaunchedProcess(self, int(reply["pid"]), argv)

    def poll(self, pid: int) -> int | None:
        with self._lock:
            sock = self._ensure()
            sock.send(json.dumps({"poll": pid}).encode())
            return self._receive(sock, 60.0)["code"]


_SERVERS: dict[str | None, LaunchServer] = {}


def base_env() -> dict[str, str]:
    """The tests' environment for a launch: this process's, without ``PYTEST_CURRENT_TEST`` (pytest
    sets it per test; nothing a launch runs reads it)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def _nproc(args: list[str]) -> int | None:
    for index, arg in enumerate(args):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if arg == flag and index + 1 < len(args):
                value = args[index + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            else:
                continue
            return int(value) if value.isdigit() else None
    return 1


def server_for(argv: list[str], env: dict[str, str]) -> LaunchServer | None:
    """The server that forks this launch, or None (a new process): ``python -m resilrun ...`` with this
    Python, in an environment that differs from the server's in nothing the interpreter reads as it
    starts (``PYTHON*``, ``LD_*``: a test's own ``PYTHONPATH`` must reach a new interpreter). What the
    launch's libraries read at import is the agent's rule for its template, applied in the launch."""
    if os.environ.get(ENABLED_ENV, "1") == "0" or argv[:3] != [sys.executable, "-m", "resilrun"]:
        return None
    omp = env.get("OMP_NUM_THREADS")
    if omp is None:
        nproc = _nproc(argv[3:])
        if nproc is None:
            return None
        omp = "1" if nproc > 1 else None
    server = _SERVERS.get(omp)
    if server is None:
        server = _SERVERS[omp] = LaunchServer(omp)
    start = server.start_env
    differ = {k for k in env.keys() | start.keys() if env.get(k) != start.get(k)}
    if any(k.startswith(("PYTHON", "LD_")) for k in differ):
        return None
    return server


if __name__ == "__main__":
    main(sys.argv[1:])
