"""One bounded launch for ``recovery.py``: run, watch for stalls, kill the whole tree, keep evidence.

Why more than ``subprocess.run(timeout=...)``:
- a recovery that hangs (plain torchrun waits in gloo's ``connectFullMesh`` for its 30-minute
  default) must cost a bounded minute, not the run timeout, so a run whose event log stops
  growing for ``stall_s`` after training began is declared hung;
- torchrun starts each worker in its own session, so killing the launcher's process group leaves
  workers running (seen alive 20 minutes later): every descendant ever seen is recorded while the
  run is live and killed afterwards if still there (matched by create time, so a reused pid is
  never hit), and counted, since a leftover process is itself a finding;
- when a resilrun run hangs, ``py-spy dump`` of every live descendant is saved first: the stacks
  are the evidence of where it is stuck.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

POLL_S = 0.25
GRACE_S = 3.0


@dataclass
class Launch:
    """What came back from one launch; ``status`` is ok, failed, hung or timeout."""

    status: str
    rc: int | None
    started: float  # time.time() just before Popen
    wall: float
    stderr: list[tuple[float, str]] = field(default_factory=list)  # (arrival time.time(), line)
    leftovers: int = 0  # descendants still alive after the launcher ended (killed by us)
    evidence: str = ""  # py-spy dumps of a hung run


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _alive(seen: dict[tuple[int, float], psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in seen.values():
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


def _py_spy(procs: list[psutil.Process]) -> str:
    """Stacks of every live Python process of the run, for the report of a hang."""
    out = []
    # The one installed into the benchmark's own environment when that is not on PATH (a venv).
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy"
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if "python" not in " ".join(proc.cmdline()[:1]).lower():
                continue
            try:
                res = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=30)
                text = res.stdout + res.stderr
            except (OSError, subprocess.TimeoutExpired) as exc:
                text = f"py-spy failed: {exc}"
            out.append(f"==== pid {proc.pid}: {' '.join(proc.cmdline())[:300]}\n{text}")
    return "\n".join(out)


def _kill(procs: list[psutil.Process]) -> int:
    """SIGKILL those still alive (same pid *and* create time); returns how many were."""
    killed = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
                killed += 1
    return killed


def launch(
    cmd: list[str],
    env: dict[str, str],
    events: Path,
    stderr_file: Path,
    timeout_s: float,
    stall_s: float,
    dump_on_hang: bool,
    cwd: Path | None = None,
) -> Launch:
    """Run ``cmd`` in its own session until it exits, stalls or times out; see the module docstring."""
    lines: list[tuple[float, str]] = []

    def pump(stream: object) -> None:
        with stderr_file.open("w", encoding="utf-8") as sink:
            for line in stream:  # type: ignore[attr-defined]
                lines.append((time.time(), line.rstrip("\n")))
                sink.write(line)

    t0 = time.time()
    with stderr_file.with_suffix(".stdout").open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            cwd=cwd,
        )
    pumper = threading.Thread(target=pump, args=(proc.stderr,), daemon=True)
    pumper.start()
    seen: dict[tuple[int, float], psutil.Process] = {}
    size, grown_at, status, evidence, trained = -1, time.time(), "", "", False
    while True:
        rc = proc.poll()
        if rc is not None:
            status = "ok" if rc == 0 else "failed"
            break
        for child in _descendants(proc.pid):
            with contextlib.suppress(psutil.Error):
                seen.setdefault((child.pid, child.create_time()), child)
        now = time.time()
        current = events.stat().st_size if events.exists() else 0
        if current != size:
            size, grown_at = current, now
        trained = trained or (current > 0 and b"BENCH step" in events.read_bytes())
        if trained and now - grown_at > stall_s:
            status = "hung"
        elif now - t0 > timeout_s:
            status = "timeout"
        if status:
            tree = _descendants(proc.pid)
            with contextlib.suppress(psutil.Error):
                tree.insert(0, psutil.Process(proc.pid))  # the launcher itself, as psutil sees it
            if dump_on_hang:
                evidence = _py_spy(tree)
            _kill(tree)
            proc.wait()
            break
        time.sleep(POLL_S)
    wall = time.time() - t0
    # A launcher that exited has reaped its workers; allow a moment for a dying one to go.
    deadline = time.time() + GRACE_S
    while time.time() < deadline and _alive(seen):
        time.sleep(POLL_S)
    leftovers = _kill(list(seen.values()))
    pumper.join(timeout=10)
    return Launch(
        status=status, rc=proc.returncode, started=t0, wall=wall, stderr=lines, leftovers=leftovers, evidence=evidence
    )
