"""Workers forked from the node's template (resilrun/worker_template.py): they are the agent's own
children, run the script with their own environment, directory and streams, exit as Python would,
and anything the template cannot do safely is started as a new process instead, with the reason
in the log. The test process plays the agent."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from resilrun import worker_template
from resilrun.agent.workers import procs
from resilrun.agent.workers.template import AdoptedProcess, WorkerTemplate
from resilrun.env import TEMPLATE_ROOM_ENV, python_exec, worker_base_env
from resilrun.option_values import Std
from tests.conftest import wait_until

_BASE = worker_base_env({k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}, 2)


@pytest.fixture(scope="module")
def template() -> Iterator[WorkerTemplate]:
    started = procs.start_template(_BASE)
    yield started
    started.close()


def _spec(tmp_path: Path, script: Path, rank: int, **env: str) -> procs.WorkerSpec:
    return procs.WorkerSpec(
        local_rank=rank,
        global_rank=rank,
        argv=(python_exec(), "-u", "-m", "resilrun.worker_main", str(script)),
        env={**_BASE, "RANK": str(rank), **env},
        log_dir=tmp_path / f"rank{rank}",
        to_file=Std.ALL,
        to_console=Std.NONE,
    )


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(body)
    return path


def _wait(worker: procs.WorkerProcess, timeout_s: float = 60.0) -> int:
    wait_until(lambda: worker.poll() is not None, timeout_s)
    code = worker.poll()
    worker.finish_output()
    assert code is not None
    return code


def test_a_forked_worker_is_the_agents_child_with_its_own_environment_directory_and_streams(
    template: WorkerTemplate, tmp_path: Path
) -> None:
    script = _script(
        tmp_path,
        "import os, random, sys, torch\n"
        "print(os.environ['RANK'], os.getppid(), os.getcwd(), sys.argv[1:], random.random())\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(3)\n",
    )
    workers = [procs.spawn(_spec(tmp_path, script, rank), template) for rank in (0, 1)]
    for worker in workers:
        assert isinstance(worker.popen, AdoptedProcess)  # forked, not a new interpreter
        assert _wait(worker) == 3
    lines = [(tmp_path / f"rank{rank}" / "stdout.log").read_text().split(" ", 4) for rank in (0, 1)]
    assert [line[0] for line in lines] == ["0", "1"]
    assert {line[1] for line in lines} == {str(os.getpid())}  # handed to the agent
    assert {line[2] for line in lines} == {os.getcwd()}
    assert lines[0][4] != lines[1][4]  # random is reseeded in each fork, as in a new process
    assert (tmp_path / "rank0" / "stderr.log").read_text() == "to stderr\n"


def test_a_forked_worker_reports_a_signal_an_exception_and_a_message_exit_as_python_does(
    template: WorkerTemplate, tmp_path: Path
) -> None:
    cases = {
        "raise ValueError('boom')\n": (1, "ValueError: boom"),
        "import sys; sys.exit('bye')\n": (1, "bye"),
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n": (-signal.SIGKILL, ""),
        "import atexit; atexit.register(print, 'atexit ran'); raise SystemExit(0)\n": (0, ""),
    }
    for rank, (body, (code, said)) in enumerate(cases.items()):
        folder = tmp_path / str(rank)
        folder.mkdir()
        worker = procs.spawn(_spec(folder, _script(folder, body), rank), template)
        assert isinstance(worker.popen, AdoptedProcess)
        assert _wait(worker) == code, body
        assert said in (folder / f"rank{rank}" / "stderr.log").read_text()
    assert "atexit ran" in (tmp_path / "3" / "rank3" / "stdout.log").read_text()


def test_the_monitor_wakes_on_a_forked_workers_exit_and_stop_ends_it(template: WorkerTemplate, tmp_path: Path) -> None:
    quick = procs.spawn(_spec(tmp_path, _script(tmp_path, "import time; time.sleep(0.5)\n"), 0), template)
    slow_dir = tmp_path / "slow"
    slow_dir.mkdir()
    slow = procs.spawn(_spec(slow_dir, _script(slow_dir, "import time; time.sleep(60)\n"), 1), template)
    try:
        started = time.monotonic()
        procs.wait_any_exit([quick, slow], timeout_s=30.0)
        assert time.monotonic() - started < 20.0
        wait_until(lambda: quick.poll() is not None)
        assert quick.poll() == 0 and slow.poll() is None
    finally:
        procs.stop([quick, slow], signal.SIGTERM, 5.0)
    assert slow.poll() == -signal.SIGTERM


def test_ps_and_proc_show_a_forked_workers_own_command_line_and_environment(
    template: WorkerTemplate, tmp_path: Path
) -> None:
    # What operators (and pkill -f, psutil) read to find a rank's process: set at exec, so the
    # template's unless the worker rewrites it.
    script = _script(tmp_path, "import time; time.sleep(60)\n")
    worker = procs.spawn(_spec(tmp_path, script, 5, RESILRUN_SPARE="0"), template)
    try:
        assert isinstance(worker.popen, AdoptedProcess)
        seen = psutil.Process(worker.pid)
        wait_until(lambda: seen.environ().get("RANK") == "5", 30)
        assert seen.environ() == {**_BASE, "RANK": "5", "RESILRUN_SPARE": "0"}
        assert seen.cmdline() == [python_exec(), "-u", "-m", "resilrun.worker_main", str(script)]
    finally:
        procs.stop([worker], signal.SIGKILL, 0.0)


def test_an_environment_the_template_did_not_start_with_gets_a_new_process(
    template: WorkerTemplate, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = _script(tmp_path, "import os; print(os.environ['OMP_NUM_THREADS'])\n")
    with caplog.at_level(logging.WARNING):
        worker = procs.spawn(_spec(tmp_path, script, 0, OMP_NUM_THREADS="7"), template)
    assert isinstance(worker.popen, subprocess.Popen)
    assert _wait(worker) == 0
    assert (tmp_path / "rank0" / "stdout.log").read_text() == "7\n"
    assert "OMP_NUM_THREADS" in caplog.text and "new processes" in caplog.text
    # What resilrun sets per process (rank, round, agent socket) is no reason for a new process.
    other = tmp_path / "other"
    other.mkdir()
    worker = procs.spawn(_spec(other, script, 1, RESILRUN_ROUND="4", MASTER_PORT="1"), template)
    assert isinstance(worker.popen, AdoptedProcess)
    assert _wait(worker) == 0


def test_a_template_that_died_is_given_up_and_workers_start_as_new_processes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dying = procs.start_template(_BASE)
    try:
        script = _script(tmp_path, "print('ran')\n")
        first = procs.spawn(_spec(tmp_path, script, 0), dying)
        assert isinstance(first.popen, AdoptedProcess) and _wait(first) == 0
        assert dying._process is not None
        dying._process.kill()
        dying._process.wait()
        with caplog.at_level(logging.WARNING):
            again = procs.spawn(_spec(tmp_path / "again", script, 1), dying)
        assert isinstance(again.popen, subprocess.Popen) and _wait(again) == 0
        assert "worker template not used: the template" in caplog.text
    finally:
        dying.close()


def test_a_template_never_forks_while_it_runs_a_second_thread() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        reason = worker_template.why_not_fork()
        assert reason is not None and "threads" in reason
    finally:
        release.set()
        thread.join()


def test_a_thread_known_to_be_safe_across_a_fork_does_not_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # (a thread named as jemalloc names its background purger: pyarrow's, loaded by datasets)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    renamed, release = threading.Event(), threading.Event()

    def purger() -> None:
        libc.prctl(15, b"jemalloc_bg_thd", 0, 0, 0)  # PR_SET_NAME: this thread's comm
        renamed.set()
        release.wait()

    thread = threading.Thread(target=purger)
    thread.start()
    try:
        assert renamed.wait(10)
        # (against this process's other threads: a test process may run some, pyarrow's purger too)
        tasks = os.listdir("/proc/self/task")
        named = sum(1 for task in tasks if worker_template._thread_name(task) == "jemalloc_bg_thd")
        counted = worker_template.threads()
        monkeypatch.setattr(worker_template, "FORK_SAFE_THREADS", frozenset())
        assert named >= 1 and worker_template.threads() == counted + named
    finally:
        release.set()
        thread.join()


def test_no_python_commands_are_never_forked(template: WorkerTemplate, tmp_path: Path) -> None:
    spec = procs.WorkerSpec(
        local_rank=0,
        global_rank=0,
        argv=(sys.executable, "-c", "print('plain')"),
        env=dict(_BASE),
        log_dir=tmp_path / "rank0",
        to_file=Std.ALL,
        to_console=Std.NONE,
    )
    worker = procs.spawn(spec, template)
    assert isinstance(worker.popen, subprocess.Popen) and _wait(worker) == 0
    assert (tmp_path / "rank0" / "stdout.log").read_text() == "plain\n"


# A launcher that runs jobs from one interpreter with torch imported (the tests' launch server):
# it declares its imports and start environment, starts the node's template, forks one worker from
# it and says where each came from.
_EMBEDDED = """
import importlib, json, logging, os, signal, sys, time
from resilrun import worker_template
from resilrun.agent.workers import procs
from resilrun.agent.workers.template import AdoptedProcess
from resilrun.agent.workers.template_fork import declare_preloaded
from resilrun.env import python_exec
from resilrun.option_values import Std
from dataclasses import replace
from pathlib import Path
for name in worker_template.PRELOAD:
    importlib.import_module(name)
os.environ.pop("RESILRUN_TEMPLATE_ROOM")  # the room its children show their own environment in
if os.fork() == 0:  # OpenBLAS stops its thread pool at a fork: the launcher is single-threaded again
    os._exit(0)
os.wait()
declare_preloaded(dict(os.environ))
# What the agent sets up after: its logging, a handler of its own. Neither may reach the template.
logging.basicConfig(level=logging.INFO, format="%(message)s")
signal.signal(signal.SIGUSR1, lambda *args: None)
env = {**os.environ, **json.loads(sys.argv[2])}
started = time.monotonic()
template = procs.start_template(env, before_devices=True)
spec = procs.WorkerSpec(
    local_rank=0, global_rank=0, argv=(python_exec(), "-u", "-m", "resilrun.worker_main", sys.argv[1]),
    env={**env, "RANK": "0"}, log_dir=Path(sys.argv[3]), to_file=Std.ALL, to_console=Std.NONE,
)
worker = procs.spawn(spec, template)
code = worker.popen.wait(60)
worker.finish_output()
pid = template._process.pid
with open(f"/proc/{pid}/cmdline", "rb") as handle:
    command = handle.read().decode(errors="replace")
status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
print(json.dumps({
    "template_parent": int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]),
    "template_session": os.getsid(pid), "template_pid": pid, "template_fds": sorted(os.listdir(f"/proc/{pid}/fd")),
    "template_blocked": int(status["SigBlk"], 16), "template_caught": int(status["SigCgt"], 16),
    "template_environ": open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace"),
    "template_command": command, "forked_worker": isinstance(worker.popen, AdoptedProcess), "code": code,
    "first_worker_s": time.monotonic() - started, "me": os.getpid(),
}))
template.close()
"""


@pytest.mark.parametrize(
    ("extra", "forked_here"),
    [({"RESILRUN_ROUND": "3"}, True), ({"PYTHONPATH": "/nonexistent"}, False)],
    ids=["same-start-environment", "another-pythonpath"],
)
def test_a_launcher_that_declared_its_imports_forks_its_template_unless_the_start_environment_differs(
    tmp_path: Path, extra: dict[str, str], forked_here: bool
) -> None:
    import json

    script = _script(
        tmp_path,
        "import logging, os, sys\n"
        "print(os.getppid(), 'torch' in sys.modules, os.environ.get('RANK'), len(logging.getLogger().handlers))\n",
    )
    # with room in its environment for its children to show their own there, as the launch server has
    env = {k: v for k, v in _BASE.items() if k != "PYTHONPATH"} | {TEMPLATE_ROOM_ENV: "." * 32768}
    done = subprocess.run(
        [sys.executable, "-c", _EMBEDDED, str(script), json.dumps(extra), str(tmp_path / "rank0")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    said = json.loads(done.stdout.strip().splitlines()[-1])
    # The template is the launcher's own child either way, forked from it only when nothing read at
    # start differs, and shows the template's command line either way (not the launcher's)
    assert said["template_parent"] == said["me"]
    assert ("worker template forked from this process" in done.stderr) is forked_here, done.stderr[-2000:]
    assert "resilrun.worker_template" in said["template_command"], said
    # and is the process a new template is: a session of its own, nothing blocked, no handler of the
    # launcher's (SIGINT's is Python's own), only the standard streams and its socket open, and its
    # own environment in /proc
    assert said["template_session"] == said["template_pid"]
    assert said["template_blocked"] == 0
    assert said["template_caught"] == 1 << (signal.SIGINT - 1), hex(said["template_caught"])
    assert said["template_fds"][:3] == ["0", "1", "2"] and len(said["template_fds"]) == 4, said["template_fds"]
    assert "RESILRUN_ROUND=3" in said["template_environ"] or not forked_here
    # and the worker it forks is the launcher's child, with torch already imported and its own rank
    assert said["forked_worker"] and said["code"] == 0, done.stderr[-2000:]
    # (and the launcher's logging set-up not: a new worker's root logger has no handler)
    assert (tmp_path / "rank0" / "stdout.log").read_text() == f"{said['me']} True 0 0\n"


# Installed packages a script imports at its top (on PYTHONPATH, outside the script's folder), each
# writing the pid of the process that imported it: one that behaves, one that starts a thread as it
# loads, and one that leaves CUDA unusable in forked processes (as torch's fork handler does once a
# library queried a device at import; a CPU build cannot arm it, so the package says so itself).
_PACKAGES = {
    "quiet_pkg": "",
    "threaded_pkg": "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n",
    "cuda_pkg": "import torch\ntorch.cuda._is_in_bad_fork = lambda: True\n",
}


@pytest.mark.parametrize(
    ("package", "unsafe"),
    [("quiet_pkg", None), ("threaded_pkg", "2 threads"), ("cuda_pkg", "queried CUDA")],
    ids=["imported-once", "a-thread-at-import", "cuda-queried-at-import"],
)
def test_the_template_imports_the_scripts_packages_once_unless_they_leave_it_unfit_to_fork(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, package: str, unsafe: str | None
) -> None:
    site = tmp_path / "site"
    (site / package).mkdir(parents=True)
    marks = tmp_path / "imported_by"
    (site / package / "__init__.py").write_text(
        f"import os\nopen({str(marks)!r}, 'a').write(f'{{os.getpid()}}\\n')\nos.environ['SET_BY_PKG'] = 'yes'\n"
        f"{_PACKAGES[package]}"
    )
    # (installed as pip installs it: its distribution's record lists it where it is found)
    record = site / f"{package}-1.0.dist-info"
    record.mkdir()
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
    (record / "RECORD").write_text(f"{package}/__init__.py,,\n")
    printed = "print(os.environ['RANK'], os.environ.get('SET_BY_PKG'))"
    script = _script(tmp_path, f"import os\nimport {package}\n{printed}\n")
    env = {**_BASE, "PYTHONPATH": str(site)}
    imports = worker_template.ScriptImports(str(script), as_module=False, integrations=True, rerun=False)
    template = procs.start_template(env, script=imports)
    try:
        with caplog.at_level(logging.INFO):
            workers = [procs.spawn(replace(_spec(tmp_path, script, rank), env={**env, "RANK": str(rank)}), template)
                       for rank in (0, 1)]  # fmt: skip
            codes = [_wait(worker) for worker in workers]
        assert template._process is not None
        template_pid = template._process.pid
    finally:
        template.close()
    # Every worker was forked from the template and ran the script
    assert codes == [0, 0] and all(isinstance(w.popen, AdoptedProcess) for w in workers), caplog.text
    # with what the package set in the environment as it loaded, as if each had imported it itself
    assert [(tmp_path / f"rank{rank}" / "stdout.log").read_text() for rank in (0, 1)] == ["0 yes\n", "1 yes\n"]
    imported_by = [int(pid) for pid in marks.read_text().split()]
    if unsafe is None:
        # and found the package imported already: only the template imported it
        assert imported_by == [template_pid], imported_by
        assert f"imported the script's packages too: {package}" in caplog.text
    else:
        # or the template started again without it (same process), said why, and each worker imported it
        assert imported_by[0] == template_pid and sorted(imported_by[1:]) == sorted(w.pid for w in workers)
        assert "started again without the script's imports" in caplog.text and unsafe in caplog.text, caplog.text
