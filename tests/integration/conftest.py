"""Real launchers as subprocesses on loopback, with deadlines and a reaper that leaves nothing."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.helpers import launch_zygote
from tests.helpers.netns_cluster import Cluster, Host, available, host_command, nft_available

ROOT = Path(__file__).resolve().parents[2]
TRAIN_TINY = ROOT / "tests" / "helpers" / "train_tiny.py"
EXAMPLE = ROOT / "examples" / "train_checkpointless.py"


class Launch:
    """One launcher process (resilrun or torchrun) with its output captured to files. A ``python -m
    resilrun`` launch is forked from the xdist worker's launch server (tests/helpers/launch_zygote.py:
    no new interpreter, no ``import torch`` for the launcher or its template); anything else, or with
    ``RESILRUN_TEST_LAUNCH_SERVER=0``, is a new process."""

    def __init__(
        self, argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = ROOT, host: Host | None = None
    ) -> None:
        """``host``: a network-namespace host to run it on (forked into it, or through ``ip netns exec``)."""
        self.log = log
        self._out = open(log.with_suffix(".out"), "wb")  # noqa: SIM115 - closed in close()
        self._err = open(log.with_suffix(".err"), "wb")  # noqa: SIM115
        # Without pytest's name of the running test, which changes with every test: a launch's
        # processes do not read it, and the launch server's template rule would see a new environment.
        full_env = {**launch_zygote.base_env(), **(env or {})}
        self.popen: subprocess.Popen[bytes] | launch_zygote.LaunchedProcess
        server = launch_zygote.server_for(argv, full_env)
        forked = None
        if server is not None:
            streams = [self._out.fileno(), self._err.fileno()]
            place = (host.ns, host.name) if host is not None else None
            with open(os.devnull, "rb") as null:
                forked = server.start(argv, full_env, str(cwd), [null.fileno(), *streams], place)
        if forked is not None:
            self.popen = forked
        else:
            self.popen = subprocess.Popen(
                argv if host is None else host_command(host, argv),
                stdout=self._out,
                stderr=self._err,
                stdin=subprocess.DEVNULL,
                env=full_env,
                start_new_session=True,
                cwd=cwd,
            )
        self.descendants: set[int] = set()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def remember_descendants(self) -> set[int]:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.descendants |= {p.pid for p in psutil.Process(self.pid).children(recursive=True)}
        return self.descendants

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.remember_descendants()
            code = self.popen.poll()
            if code is not None:
                return code
            time.sleep(0.1)
        raise TimeoutError(f"launcher {self.pid} still running after {timeout} s\n{self.stderr()[-3000:]}")

    def stdout(self) -> str:
        self._out.flush()
        return self.log.with_suffix(".out").read_text(errors="replace")

    def stderr(self) -> str:
        self._err.flush()
        return self.log.with_suffix(".err").read_text(errors="replace")

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in self.remember_descendants():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired, launch_zygote.ServerGone):
            self.popen.wait(10)
        if isinstance(self.popen, launch_zygote.LaunchedProcess):
            self.popen.release()
        self._out.close()
        self._err.close()


def run_resilrun(
    *args: str, timeout: float = 60.0, cwd: Path = ROOT, host: Host | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m resilrun ARGS`` run to its end, as a user runs it from a shell (``resilrun status``
    while a job runs): a process of its own, forked from the launch server as a launch is (its
    ``import torch`` done there once, not paid by every status read a test polls with) unless
    ``env`` sets what is read at start. Its output as ``subprocess.run(..., capture_output=True,
    text=True)`` returns it."""
    argv = [sys.executable, "-m", "resilrun", *args]
    with tempfile.TemporaryDirectory(prefix="resilrun-cli-") as folder:
        run = Launch(argv, Path(folder) / "cli.log", env=env, cwd=cwd, host=host)
        try:
            deadline = time.monotonic() + timeout
            while (code := run.popen.poll()) is None:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(argv, timeout)
                time.sleep(0.02)
            return subprocess.CompletedProcess(argv, code, run.stdout(), run.stderr())
        finally:
            run.close()


def alive(pids: set[int]) -> set[int]:
    """The pids that still run (zombies count as gone)."""
    living = set()
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                living.add(pid)
    return living


def memfd_holders(prefix: str = "resilrun-") -> dict[int, list[str]]:
    """Processes holding resilrun's node-memory memfds (pid -> names): after a job, there must be none."""
    held: dict[int, list[str]] = {}
    for proc_dir in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            for fd in (proc_dir / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith(f"/memfd:{prefix}"):
                        held.setdefault(int(proc_dir.name), []).append(target)
    return held


def assert_nothing_left(launch: Launch, grace_s: float = 10.0) -> None:
    """Every process the launcher ever started exited by itself, and no memfd of the job survives."""
    deadline = time.monotonic() + grace_s
    while alive(launch.descendants) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(launch.descendants), f"orphans: {sorted(alive(launch.descendants))}"
    holders = {pid: names for pid, names in memfd_holders().items() if pid in launch.descendants | {launch.pid}}
    assert not holders, f"node memory still held: {holders}"


def events(*launches: Launch, kind: str | None = None, **match: object) -> list[dict]:
    """The records of the agents' events.jsonl (docs/status.md), oldest first, optionally only those
    of one ``kind`` whose fields equal ``match``: what a recovery did, asserted without log wording."""
    return recorded("".join(launch.stderr() for launch in launches), kind, **match)


def recorded(stderr: str, kind: str | None = None, **match: object) -> list[dict]:
    """``events``, from the launcher's stderr text (what ``train_unmodified`` returns): the agents
    say where their logs are ("logs in DIR"), and the events file is there."""
    records = []
    for root in dict.fromkeys(re.findall(r"logs in (\S+)", stderr)):
        path = Path(root) / "events.jsonl"
        if path.exists():
            records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records.sort(key=lambda r: r["wall"])
    return [r for r in records if (kind is None or r["event"] == kind) and all(r.get(k) == v for k, v in match.items())]


def resumed(*launches: Launch) -> dict[int, tuple[int, str]]:
    """rank -> (step, tier) its state was last restored from (``state_transferred`` events)."""
    return resumed_from("".join(launch.stderr() for launch in launches))


def resumed_from(stderr: str) -> dict[int, tuple[int, str]]:
    """``resumed``, from the launcher's stderr text."""
    return {r["rank"]: (r["step"], r["tier"]) for r in recorded(stderr, "state_transferred")}


def wait_for(predicate, timeout: float, what: str) -> None:  # noqa: ANN001 - any callable
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


def made_once(tmp_path: Path, key: object, make: Callable[[Path], None]) -> Path:
    """The folder ``make`` filled for ``key`` (JSON-able), made once per test session.

    Many tests compare against the same few failure-free reference runs, so each is run once and
    kept in a folder that the pytest-xdist workers share (next to their base temporary
    directories), under a lock: a second worker needing it waits for the first one's run. A run
    that failed leaves no folder behind (the next test to need it runs it again)."""
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    base = tmp_path.parent  # the session's (or this xdist worker's) base temporary directory
    shared = (base.parent if base.name.startswith("popen-gw") else base) / "clean-runs"
    shared.mkdir(exist_ok=True)
    with open(shared / f"{digest}.lock", "w") as lock:  # noqa: PTH123 - held for the block
        fcntl.flock(lock, fcntl.LOCK_EX)
        kept = shared / digest
        if (kept / ".done").exists():
            return kept
        shutil.rmtree(kept, ignore_errors=True)
        kept.mkdir()
        try:
            make(kept)
        except BaseException:
            shutil.rmtree(kept, ignore_errors=True)
            raise
        (kept / ".done").touch()
        return kept


def clean_checksum(launcher, tmp_path: Path, nproc: int, *args: str) -> str:  # noqa: ANN001 - the fixture
    """The checksum of a failure-free ``--standalone`` run of examples/train_checkpointless.py with
    ``nproc`` workers and ``args``: what a recovered run must equal, bit for bit (run once per
    session: ``made_once``). The example's ``--sleep`` only paces its steps (a recovery needs time
    to happen in), so it is left out of the reference run."""
    args = _without_sleep(args)

    def run_it(folder: Path) -> None:
        argv = ["--standalone", "--nproc-per-node", str(nproc), str(EXAMPLE), *args]
        run = launcher("resilrun", *argv, "--checksum-file", str(folder / "checksum"))
        assert run.wait(150) == 0, run.stderr()[-3000:]

    return (made_once(tmp_path, [nproc, *args], run_it) / "checksum").read_text()


def require_modules(*names: str) -> None:
    """Skip (fail under CI, where ``pip install -e '.[test]'`` provides them) without these modules."""
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            if os.environ.get("CI") == "true":
                pytest.fail(f"{name} is required in CI (pip install -e '.[test]'): {exc}")
            pytest.skip(f"{name} not installed: {exc}")


def launch_unmodified(  # noqa: PLR0913 - the launcher fixture, the script, and what varies per test
    launcher,  # noqa: ANN001 - the fixture
    script: Path,
    out: Path,
    faults: str,
    *extra: str,
    env: dict[str, str] | None = None,
    flags: tuple[str, ...] = (),
) -> Launch:
    """Run a framework example (it writes ``out/model.safetensors``) on 2 ranks with a hot spare and
    no restart allowed, with ``RESILRUN_FAULTS=faults`` and the launcher's ``flags``, to its successful end."""
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "0", *flags,
        str(script), "--out", str(out), *extra, env={"RESILRUN_FAULTS": faults, **(env or {})},
    )  # fmt: skip
    assert run.wait(180) == 0, run.stderr()[-4000:]
    assert_nothing_left(run)
    assert "done: " in run.stdout(), run.stdout()[-2000:]
    return run


def train_unmodified(  # noqa: PLR0913 - as launch_unmodified
    launcher,  # noqa: ANN001 - the fixture
    script: Path,
    out: Path,
    faults: str,
    *extra: str,
    env: dict[str, str] | None = None,
    flags: tuple[str, ...] = (),
) -> str:
    """``launch_unmodified``, returning the launcher's stderr."""
    return launch_unmodified(launcher, script, out, faults, *extra, env=env, flags=flags).stderr()


@dataclass(frozen=True)
class NodeLoss:
    """What ``replace_a_lost_node`` saw: the two nodes left, the rank the lost node ran, and the
    step every rank resumed at."""

    survivor: Launch
    spare: Launch
    lost_rank: int
    step: int


def replace_a_lost_node(  # noqa: PLR0913 - the fixture, the command, and how to see it train
    launcher,  # noqa: ANN001 - the fixture
    command: list[str],
    rdzv_id: str,
    training: Callable[[str], bool],
    env: dict[str, str],
    cwd: Path = ROOT,
) -> NodeLoss:
    """``command`` (a script and its arguments, or ``-m module ...``) on 2 nodes x 1 worker
    replicating to each other, a third agent standing by as a spare node; once ``training`` holds
    for a node's stdout, the node that does not host the store loses its agent and its worker
    (SIGKILL). The spare node must take its node rank in-process, the lost rank restoring from its
    peer replica and the survivor from node memory, at the same step, with no restart."""
    from tests.conftest import free_port

    flags = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", rdzv_id,
        "--replicas", "1", "--heartbeat-timeout", "3", "--max-restarts", "0", *command,
    ]  # fmt: skip
    nodes = [launcher("resilrun", *flags, env=env, cwd=cwd) for _ in range(2)]
    wait_for(lambda: any("round 0 formed" in n.stderr() for n in nodes), 150, "the round to form")
    spare = launcher("resilrun", *flags, env=env, cwd=cwd)
    wait_for(lambda: "standing by as a spare node" in spare.stderr(), 150, "the spare node")
    wait_for(lambda: any(training(n.stdout()) for n in nodes), 200, "the script to train")
    doomed = next(n for n in nodes if "hosting store" not in n.stderr())
    survivor = next(n for n in nodes if n is not doomed)
    os.killpg(doomed.pid, signal.SIGKILL)
    for node in (survivor, spare):
        assert node.wait(300) == 0, node.stderr()[-4000:]
        assert_nothing_left(node)
    assert "spare node takes node rank" in spare.stderr()
    assert events(survivor, spare, kind="restart") == []
    found = re.search(r"this node rank \d+ runs ranks? (\d+)", doomed.stderr())
    assert found is not None, doomed.stderr()[-2000:]
    lost = int(found.group(1))
    steps = resumed(survivor, spare)
    step = steps[lost][0]
    assert steps == {lost: (step, "peer"), 1 - lost: (step, "memory")}, steps
    return NodeLoss(survivor, spare, lost, step)


def assert_a_spare_node_replaces_a_lost_one(  # noqa: PLR0913 - the fixtures, the script, and how to see it train
    launcher,  # noqa: ANN001 - the fixture
    tmp_path: Path,
    script: Path,
    script_args: tuple[str, ...],
    training: str,
    rdzv_id: str,
) -> None:
    """An unmodified framework script loses a node to a spare one (``replace_a_lost_node``) once it
    prints ``training``; the saved weights must be bitwise a failure-free run's of 2 ranks (one
    OpenMP thread each, as the launcher gives 2 workers on one node: the thread count changes the
    order of float sums)."""
    out = tmp_path / "faulty"
    command = [str(script), "--out", str(out), *script_args]
    replace_a_lost_node(launcher, command, rdzv_id, lambda text: training in text, {"OMP_NUM_THREADS": "1"})
    train_unmodified(launcher, script, tmp_path / "clean", "", *script_args)
    assert weights(out) == weights(tmp_path / "clean")


def weights(out: Path) -> str:
    """The saved weights' SHA-256 (equal digests, equal bytes; a failed comparison prints two lines)."""
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


def _without_sleep(args: tuple[str, ...]) -> list[str]:
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--sleep":
            skip = True
        elif not arg.startswith("--sleep="):
            kept.append(arg)
    return kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator:
    """Keep each phase's report on the test, so a fixture can tell at teardown that it failed."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


def explain_failure(request: pytest.FixtureRequest, launches: list[Launch]) -> None:
    """After a failed test, print what its launches said and recorded last (into the test's report):
    a launch still running when a timeout ended the test leaves nothing else to read."""
    report = getattr(request.node, "report_call", None)
    if report is None or not report.failed:
        return
    for launch in launches:
        running = launch.popen.poll() is None
        _say(f"--- launch {launch.pid} ({'still running' if running else 'exited'}): {launch.log.name}")
        _say(launch.stdout()[-1500:])
        _say(launch.stderr()[-4000:])
        for record in recorded(launch.stderr())[-25:]:
            _say(json.dumps(record, sort_keys=True)[:400])
        if running:
            _dump_stacks(launch)


def _dump_stacks(launch: Launch) -> None:
    """Where a hung launch's processes are: their states, then each worker's Python stacks."""
    for proc in _tree(launch.pid):
        with contextlib.suppress(psutil.Error):
            _say(f"pid {proc.pid} {proc.status()} {' '.join(proc.cmdline())[:160]}")
    _say(worker_stacks(launch, settle_s=1.5))


def _say(text: str) -> None:
    """To the test's captured output (shown with its failure)."""
    sys.stdout.write(f"{text}\n")


def _tree(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    return []


@pytest.fixture
def launcher(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator:
    """Factory: launcher(kind, *args) with kind 'resilrun' or 'torchrun'; reaps everything."""
    launches: list[Launch] = []

    def start(kind: str, *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> Launch:
        module = "resilrun" if kind == "resilrun" else "torch.distributed.run"
        log = tmp_path / f"{kind}_{len(launches)}.log"
        launch = Launch([sys.executable, "-m", module, *args], log, env, cwd)
        launches.append(launch)
        return launch

    yield start
    explain_failure(request, launches)
    for launch in launches:
        launch.close()


# -- hosts in network namespaces (tests/helpers/netns_cluster.py) -------------------------------
PORT = 29400  # the rendezvous port: every host has a network of its own, no port is taken there


@pytest.fixture
def cluster_of(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator:
    """cluster_of(n) -> (Cluster, start(host, *resilrun_args, env=, cwd=) -> Launch); removes everything after."""
    why = available()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the multi-host tests need network namespaces in CI: {why}")
        pytest.skip(why)
    clusters: list[Cluster] = []
    launches: list[Launch] = []

    def make(count: int) -> tuple[Cluster, object]:
        cluster = Cluster(count).__enter__()
        clusters.append(cluster)

        def start(host: str, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Launch:
            """``cwd``: the host's own working folder (a host without a shared file system)."""
            argv = [sys.executable, "-m", "resilrun", *args]
            launch = Launch(argv, tmp_path / f"{host}_{len(launches)}.log", env, cwd or ROOT, cluster.host(host))
            launches.append(launch)
            return launch

        return cluster, start

    yield make
    explain_failure(request, launches)
    for launch in launches:
        launch.close()
    for cluster in clusters:
        cluster.close()


def needs_nft() -> None:
    """Skip (fail in CI) a test that sets nftables rules where nft is missing."""
    why = nft_available()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the network-fault tests need nftables in CI: {why}")
        pytest.skip(why)


def worker_stacks(*launches: Launch, settle_s: float = 2.0) -> str:
    """Every still-running worker's Python stacks (for a hang's failure message): the worker
    bootstrap enables faulthandler, so SIGABRT makes each print all its threads' stacks to its
    stderr, which its agent copies to its own. Ends those workers."""
    aborted = []
    for launch in launches:
        for pid in alive(launch.remember_descendants()):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if "resilrun.worker_main" in " ".join(psutil.Process(pid).cmdline()):
                    os.kill(pid, signal.SIGABRT)
                    aborted.append(pid)
    time.sleep(settle_s)
    stacks = []
    for launch in launches:
        lines = launch.stderr().splitlines()
        starts = [i for i, line in enumerate(lines) if "Fatal Python error: Aborted" in line]
        for start in starts:
            stacks.append("\n".join(lines[start : start + 60]))
    return f"workers aborted for their stacks: {aborted}\n" + "\n---\n".join(stacks)


def newest_step(node: Launch) -> int:
    """The newest "step N loss" line a node's rank 0 printed (-1: none yet)."""
    steps = re.findall(r"^step (\d+) loss", node.stdout(), re.MULTILINE)
    return max(map(int, steps), default=-1)


def active_workers(node: Launch) -> set[int]:
    """The pids of a node's workers that run ranks (its warm spare workers have RESILRUN_SPARE=1)."""
    found: set[int] = set()
    for proc in psutil.Process(node.pid).children():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("RESILRUN_SPARE") == "0":
                found.add(proc.pid)
    return found


def drop_off(cluster: Cluster, host: str, node: Launch) -> set[int]:
    """Take ``host`` off the network, then SIGKILL ``node``'s processes; returns their pids."""
    tree = node.remember_descendants() | {node.pid}
    cluster.cut(host)
    os.killpg(node.pid, signal.SIGKILL)
    return tree
