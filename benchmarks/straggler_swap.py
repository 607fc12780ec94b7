"""A straggler swapped for a hot spare, against the same job without a swap and against torchrun (issue 48).

    python benchmarks/straggler_swap.py [--steps 900] [--slow-after-s 15] [--slow-ms 20]
        [--heartbeat-interval 1] [--json out.json]    # about 4 minutes

    python benchmarks/straggler_swap.py --netns    # hosts in network namespaces, a spare host (root)

The same job three times, one after the other on this machine: ``--nproc-per-node 3`` workers of
examples/train_checkpointless.py (DDP over gloo, ``--sleep`` after each step as data loading would),
rank ``--slow-rank``'s process made slow ``--slow-after-s`` seconds after it starts (each of its
``nn.Linear`` forwards takes ``--slow-ms`` longer: a throttled device; tests/helpers/slow_rank.py,
only the first process to run as that rank, so a spare that takes it runs at full speed):

- **swap**: ``resilrun --spares 1 --stragglers swap``;
- **report**: ``resilrun --spares 1`` (the default ``--stragglers report``): named, not swapped, so
  the job runs at the straggler's pace to its end;
- **torchrun**: which cannot tell which rank it waits for.

``--netns``: the same on "hosts" in network namespaces (tests/helpers/netns_cluster.py): two hosts
of one worker each (rank 1's slow), and for resilrun a third host standing by as a spare node and
no spare process (``--spares 0``), so the swap gives the slow host's place to the spare host.

Reported per run: wall time to the end, steps per second before the slow-down, while slowed, and
after the swap; for resilrun the time from the first slowed forward to ``straggler_detected`` and to
``straggler_swapped`` (events.jsonl), the steps redone, and whether the final parameters are
bitwise those of the other runs. Ratios: swap's wall time against report's and torchrun's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.helpers.netns_cluster import Cluster, available  # noqa: E402 - the test suite's fixture

EXAMPLE = ROOT / "examples" / "train_checkpointless.py"
SLOW = ROOT / "tests" / "helpers" / "slow_rank.py"
STEP = re.compile(rb"^step (\d+) ")


def _run(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    mark, once, digest = work / f"{kind}.slowed", work / f"{kind}.once", work / f"{kind}.sha"
    env = {
        **os.environ,
        "SLOW_RANK": str(args.slow_rank),
        "SLOW_S": str(args.slow_ms / 1000),
        "SLOW_AFTER_S": str(args.slow_after_s),
        "SLOW_MARK": str(mark),
        "SLOW_ONCE": str(once),
    }
    script = [str(SLOW), str(EXAMPLE), "--steps", str(args.steps), "--hidden", "256", "--sleep", str(args.sleep)]
    script += ["--progress", "--checksum-file", str(digest)]
    logs = work / kind
    agents = _agents(kind, args, logs, script, env)
    steps: dict[int, float] = {}
    started = time.time()
    jobs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=e, cwd=ROOT) for a, e in agents]

    def read(job: subprocess.Popen[bytes]) -> None:
        assert job.stdout is not None
        for line in job.stdout:
            found = STEP.match(line)
            if found:
                steps.setdefault(int(found.group(1)), time.time())

    readers = [threading.Thread(target=read, args=(job,), daemon=True) for job in jobs]
    for reader in readers:
        reader.start()
    codes = [job.wait(args.steps * 2) for job in jobs]
    code = max(codes, key=abs)
    for reader in readers:
        reader.join(10)
    ended = time.time()
    events = [json.loads(line) for path in logs.glob("*/events.jsonl") for line in path.read_text().splitlines()]
    slowed = float(mark.read_text()) if mark.exists() else None
    return {
        "kind": kind,
        "exit_code": code,
        "wall_s": ended - started,
        "slowed_at": slowed,
        "steps": steps,
        "events": events,
        "checksum": digest.read_text() if digest.exists() else None,
    }


def _agents(
    kind: str, args: argparse.Namespace, logs: Path, script: list[str], env: dict[str, str]
) -> list[tuple[list[str], dict[str, str]]]:
    """The launcher processes of one run: one on this machine, or one per host (``--netns``: two
    hosts of one worker each, and for resilrun a third host standing by as a spare node)."""
    resilrun = [
        sys.executable,
        "-m",
        "resilrun",
        "--log-dir",
        str(logs),
        "--heartbeat-interval",
        str(args.heartbeat_interval),
    ]
    resilrun += ["--stragglers", "swap" if kind == "swap" else "report"]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if args.cluster is None:
        if kind == "torchrun":
            return [([*torchrun, "--standalone", "--nproc-per-node", str(args.nproc), *script], env)]
        return [([*resilrun, "--standalone", "--nproc-per-node", str(args.nproc), "--spares", "1", *script], env)]
    cluster, port = args.cluster, 29400 + ("swap", "report", "torchrun").index(kind)
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"h0:{port}"]
    env = {**env, "OMP_NUM_THREADS": "1"}
    if kind == "torchrun":  # it cannot start on these hosts without both
        return [
            (cluster.command(h, [*torchrun, *common, "--rdzv-backend", "c10d", "--local-addr", h.addr, *script]),
             {**env, "GLOO_SOCKET_IFNAME": "eth0"})
            for h in cluster.hosts[:2]
        ]  # fmt: skip
    return [(cluster.command(h, [*resilrun, *common, "--rdzv-id", kind, *script]), env) for h in cluster.hosts]


def _rate(steps: dict[int, float], start: float, end: float) -> float | None:
    """Steps per second between two wall times (the steps completed in that window)."""
    inside = sorted(t for t in steps.values() if start <= t <= end)
    return (len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) > 2 else None


def _first(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((e for e in sorted(events, key=lambda e: e["wall"]) if e["event"] == kind), None)


def summarize(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    slowed, steps = run["slowed_at"], run["steps"]
    ends = max(steps.values()) if steps else None
    out: dict[str, Any] = {"wall_s": round(run["wall_s"], 2), "exit_code": run["exit_code"]}
    if slowed is None or ends is None:
        return out
    detected, swapped = _first(run["events"], "straggler_detected"), _first(run["events"], "straggler_swapped")
    # (a spare node's own "recovered" has no steps_redone: it held no step before; the others' do)
    recovered = next((e for e in run["events"] if e["event"] == "recovered" and "steps_redone" in e), None)
    slow_until = swapped["wall"] if swapped else ends
    out.update(
        steps_per_s_before=_rate(steps, slowed - 10, slowed),
        steps_per_s_slowed=_rate(steps, slowed + 2, slow_until),
        steps_per_s_after=_rate(steps, swapped["wall"] + 3, ends) if swapped else None,
        detected_after_s=round(detected["wall"] - slowed, 2) if detected else None,
        swapped_after_s=round(swapped["wall"] - slowed, 2) if swapped else None,
        swap_step=swapped["step"] if swapped else None,
        steps_redone=recovered["steps_redone"] if recovered else None,
        checksum=run["checksum"],
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--slow-after-s", type=float, default=15.0, help="seconds after its start the rank slows")
    parser.add_argument("--slow-ms", type=float, default=20.0, help="added to each nn.Linear forward of the rank")
    parser.add_argument("--slow-rank", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=0.03, help="seconds after each step (data loading)")
    parser.add_argument(
        "--heartbeat-interval", type=float, default=1.0, help="resilrun's (its default: a verdict takes 5 of them)"
    )
    parser.add_argument("--netns", action="store_true", help="hosts in network namespaces, a spare host (root)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.netns and (why := available()) is not None:
        parser.error(f"--netns: {why}")
    work = Path(tempfile.mkdtemp(prefix="straggler-swap-"))
    if args.netns:
        args.slow_rank = 1  # one worker per host: the host that runs rank 1 is the slow one
    args.cluster = Cluster(3).__enter__() if args.netns else None
    try:
        results = {kind: summarize(_run(kind, args, work), args) for kind in ("swap", "report", "torchrun")}
    finally:
        if args.cluster is not None:
            args.cluster.close()
    where = "2 hosts in network namespaces (a spare host for resilrun)" if args.netns else f"{args.nproc} ranks"
    print(
        f"{where}, {args.steps} steps, rank {args.slow_rank} slowed by {args.slow_ms:g} ms per nn.Linear "
        f"forward {args.slow_after_s:g} s after it starts (this machine)"
    )
    for kind, r in results.items():
        rates = [r.get(k) for k in ("steps_per_s_before", "steps_per_s_slowed", "steps_per_s_after")]
        shown = " / ".join("-" if v is None else f"{v:.1f}" for v in rates)
        print(f"  {kind:9s} wall {r['wall_s']:6.1f} s  steps/s before / slowed / after swap: {shown}")
        if kind != "torchrun":
            print(
                f"            named {r.get('detected_after_s')} s after the slow-down, swapped "
                f"{r.get('swapped_after_s')} s after it (after step {r.get('swap_step')}), "
                f"steps redone {r.get('steps_redone')}"
            )
    swap, report, torchrun = results["swap"], results["report"], results["torchrun"]
    print(
        f"wall time, swap vs report: {swap['wall_s'] / report['wall_s']:.2f}x; "
        f"swap vs torchrun: {swap['wall_s'] / torchrun['wall_s']:.2f}x"
    )
    sums = {r.get("checksum") for r in results.values()}
    print(f"final parameters bitwise equal across the three runs: {len(sums) == 1 and None not in sums}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    ok = all(r["exit_code"] == 0 for r in results.values()) and swap.get("swapped_after_s") is not None
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
