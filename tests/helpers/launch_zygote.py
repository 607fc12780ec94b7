"""The tests' launch server: a Python per xdist worker (and OpenMP setting) that has imported torch
and resilrun once and forks each ``resilrun`` launch the tests start (issue 47, part 4: the suite is
CPU-bound, and every launch paid a new interpreter for the launcher and ``import torch`` for its
node's worker template).

What a launch gets is what ``subprocess.Popen([python, "-m", "resilrun", ...], start_new_session=True)``
gives it: its own session, its stdin (/dev/null), stdout and stderr, directory, environment, command
line (shown in ``ps`` and /proc as its own: the server starts with room for them, as the worker
template does), ``sys.path[0]`` and ``sys.argv``, and an interpreter that runs ``python -m resilrun``
and ends as one does (atexit handlers, non-daemon threads joined, the exit code of a SystemExit or
an uncaught exception). Only launches whose environment differs from the server's in nothing read as
an interpreter starts or a library loads (``resilrun.env.read_after_start``: what resilrun sets per
process or node) are forked; any other (a test's own ``PYTHONPATH``, ``HF_HOME``) is a new process.
The launch's agent then forks its node's worker template from itself
(``resilrun.agent.workers.template_fork``) by the same rule.

The server stays single-threaded and forks only from its one thread. A launch's exit is read without
reaping it (``waitid(WNOWAIT)``): as with Popen, its pid and process group stay reserved until the
test's ``Launch.close`` has killed what is left and says ``release``. A server that fails or does
not answer is given up and later launches are new processes. It dies with its xdist worker.
``RESILRUN_TEST_LAUNCH_SERVER=0`` in the tests' environment starts every launch as a new process.

Protocol (SOCK_SEQPACKET, one JSON message per packet, each request answered in turn):
``{"ready": true}`` once the imports are done; ``{"start": {"argv", "env", "cwd", "host"}}`` with stdin, stdout
and stderr as SCM_RIGHTS descriptors -> ``{"pid": N}`` or ``{"error": "why"}``; ``{"poll": N}`` ->
``{"code": exit status or null}``; ``{"release": N}`` -> ``{"released": N}``.
Usage: ``python -m tests.helpers.launch_zygote FD ROOM``
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
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from resilrun.env import TEMPLATE_ROOM_BYTES, TEMPLATE_ROOM_ENV, read_after_start
from resilrun.prctl import PR_SET_PDEATHSIG, resolve_prctl
from resilrun.worker_template import PRELOAD, StartAreas, threads
from tests.helpers.netns_cluster import enter_host

# What a launch imports besides the template's: the command line and the agent.
LAUNCHER = ("resilrun.cli", "resilrun.agent", "resilrun.agent.node", "resilrun.agent.workers.procs")
ENABLED_ENV = "RESILRUN_TEST_LAUNCH_SERVER"
_MAX_REQUEST = 1 << 22
_ANSWER_S = 60.0


def _become_launch(
    request: dict[str, Any], fds: list[int], areas: StartAreas | None, start_env: dict[str, str]
) -> None:
    """In the forked child: the launch's host (a network-namespace host's ``[ns, name]``, if given),
    session, streams, directory, environment and command line, then ``python -m resilrun`` as the
    interpreter runs it. Raises SystemExit to end as Python does."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    if request.get("host"):
        try:
            enter_host(*request["host"])
        except OSError as exc:
            os.write(2, f"launch server: cannot put the launch on host {request['host'][1]}: {exc}\n".encode())
            os._exit(1)
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as ``python -m`` puts it first
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    if areas is not None:
        areas.show(argv, request["env"])
    from resilrun.agent.workers.template_fork import declare_preloaded

    declare_preloaded(start_env)
    sys.argv = [argv[0], *argv[3:]]  # run_module puts the module's path first, as -m does
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


class _State:
    """What every launch is forked with, and the launches the tests are done with (to reap)."""

    def __init__(self, areas: StartAreas | None, start_env: dict[str, str]) -> None:
        self.areas, self.start_env = areas, start_env
        self.releasing: set[int] = set()


def _answer(
    request: dict[str, Any], fds: list[int], sock: socket.socket, exited: dict[int, int], state: _State
) -> dict[str, Any]:
    """One request's answer; in a forked launch, never returns (raises SystemExit at its end)."""
    if "poll" in request:
        pid = int(request["poll"])
        if pid not in exited:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None and info.si_pid == pid:
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                exited[pid] = code
        return {"code": exited.get(pid)}
    if "release" in request:
        pid = int(request["release"])
        state.releasing.add(pid)
        return {"released": pid}
    if threads() != 1:
        return {"error": f"the launch server runs {threads()} threads"}
    pid = os.fork()
    if pid == 0:
        sock.close()
        _become_launch(request["start"], fds, state.areas, state.start_env)
        raise SystemExit(0)  # run_module returned: the module ended without exiting
    return {"pid": pid}


def _serve(sock: socket.socket, state: _State) -> None:
    """Answer requests until the tests' end of the socket closes; reap released launches."""
    exited: dict[int, int] = {}
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        for pid in list(state.releasing):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue  # killed, not yet gone: next time
            state.releasing.discard(pid)
            exited.pop(pid, None)
        if not readable:
            continue
        data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_REQUEST, 3)
        if not data:
            return
        try:
            reply = _answer(json.loads(data), fds, sock, exited, state)
        except Exception as exc:  # noqa: BLE001 - said to the tests, which start the launch themselves
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        sock.send(json.dumps(reply).encode())


def main(argv: list[str]) -> None:
    areas = StartAreas.of_this_process()  # before anything moves libc's environment
    os.environ.pop(TEMPLATE_ROOM_ENV, None)
    start_env = dict(os.environ)
    parent = os.getppid()
    prctl = resolve_prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))  # gone with the xdist worker that started it
    if os.getppid() != parent:
        os._exit(1)  # it died before the request took effect
    for name in (*PRELOAD, *LAUNCHER):
        importlib.import_module(name)
    gc.freeze()
    pid = os.fork()  # OpenBLAS stops its thread pool in its fork handler (resilrun/worker_template.py)
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    sock = socket.socket(fileno=int(argv[0]))
    sock.send(json.dumps({"ready": True}).encode())
    _serve(sock, _State(areas, start_env))
    os._exit(0)


class ServerGone(Exception):
    """The launch server failed or did not answer: given up."""


class LaunchedProcess:
    """A launch the server forked: the part of Popen's interface the tests use, and ``release``."""

    def __init__(self, server: LaunchServer, pid: int, args: list[str]) -> None:
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.ask({"poll": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped until released: the pid is still this launch's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def release(self) -> None:
        """The test is done with it (its process group killed): the server may reap it."""
        with contextlib.suppress(ServerGone):
            self._server.ask({"release": self.pid})


class LaunchServer:
    """The tests' side of one server: started on first use. ``omp``: the ``OMP_NUM_THREADS`` it starts
    with (None: unset), which libgomp reads as torch loads: the launcher gives workers 1 when two or
    more share a node and none for one, so launches of each kind have a server whose torch their
    template can be forked from."""

    def __init__(self, omp: str | None) -> None:
        self.start_env = {k: v for k, v in base_env().items() if k != "OMP_NUM_THREADS"}
        if omp is not None:
            self.start_env["OMP_NUM_THREADS"] = omp
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self.broken: str | None = None

    def _ensure(self) -> socket.socket:
        if self.broken is not None:
            raise ServerGone(self.broken)
        if self._sock is not None:
            return self._sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**self.start_env, TEMPLATE_ROOM_ENV: "." * TEMPLATE_ROOM_BYTES * 8}
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        log = os.path.join(tempfile.gettempdir(), f"resilrun-launch-server-{os.getpid()}.log")
        command = [sys.executable, "-m", "tests.helpers.launch_zygote", str(theirs.fileno()), " " * TEMPLATE_ROOM_BYTES]
        try:
            with open(log, "ab") as errors:
                self._process = subprocess.Popen(
                    command,
                    env=env,
                    cwd=root,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=errors,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,
                )
        finally:
            theirs.close()
        self._sock = ours
        try:
            if not self._receive(120.0).get("ready"):
                raise ServerGone("the launch server did not say it was ready")
        except ServerGone as exc:
            self._give_up(str(exc))
            raise
        return ours

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        assert self._sock is not None
        readable, _, _ = select.select([self._sock], [], [], timeout_s)
        if not readable:
            raise ServerGone(f"the launch server did not answer within {timeout_s:.0f} s")
        data = self._sock.recv(1 << 16)
        if not data:
            raise ServerGone("the launch server exited")
        return json.loads(data)

    def _give_up(self, why: str) -> None:
        """A server that failed once is not asked again (its answers could be out of step)."""
        self.broken = why
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._process is not None:
            self._process.kill()
            self._process.wait()

    def ask(self, request: dict[str, Any], streams: list[int] | None = None) -> dict[str, Any]:
        with self._lock:
            sock = self._ensure()
            try:
                socket.send_fds(sock, [json.dumps(request).encode()], streams or [])
                return self._receive(_ANSWER_S)
            except (OSError, ServerGone) as exc:
                self._give_up(str(exc))
                raise ServerGone(str(exc)) from exc

    def start(  # noqa: PLR0913
        self, argv: list[str], env: dict[str, str], cwd: str, streams: list[int], host: tuple[str, str] | None = None
    ) -> LaunchedProcess | None:
        """The launch forked by the server, or None (the caller starts it as a new process). ``host``:
        the network namespace and name of the host to run it on (tests/helpers/netns_cluster.py)."""
        try:
            reply = self.ask({"start": {"argv": argv, "env": env, "cwd": cwd, "host": host}}, streams)
        except ServerGone:
            return None
        if "pid" not in reply:
            return None
        return LaunchedProcess(self, int(reply["pid"]), argv)


_SERVERS: dict[str | None, LaunchServer] = {}


def base_env() -> dict[str, str]:
    """The tests' environment for a launch: this process's, without ``PYTEST_CURRENT_TEST`` (pytest
    sets it per test; nothing a launch runs reads it)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def _nproc(args: list[str]) -> int | None:
    """``--nproc-per-node`` as given (1, resilrun's default, when not), None when not a number."""
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
    """The server that forks this launch, or None (a new process): ``python -m resilrun ...`` with
    this Python, in an environment that differs from the server's only in what resilrun sets per
    process or node (read after start)."""
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
    if server.broken is not None:
        return None
    # OpenMP's setting was matched by choosing the server (the launcher gives its workers that value;
    # the launch itself does not read it): any other difference must be read after start.
    start = server.start_env
    keys = (env.keys() | start.keys()) - {"OMP_NUM_THREADS"}
    if any(env.get(k) != start.get(k) and not read_after_start(k) for k in keys):
        return None
    return server


if __name__ == "__main__":
    main(sys.argv[1:])
