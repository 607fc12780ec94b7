"""An unmodified framework script: resilrun's per-step cost and a failure's cost vs torchrun.

    python benchmarks/framework_overhead.py [--framework transformers|lightning|accelerate] [--runs 2] [--steps 60]
        [--kill-step 25] [--snapshot-every 1|N|auto] [--steady-from 5] [--steady-only | --failures-only]
        [--spares-0] [--json out.json]

Why this shape (issue 18): the integration snapshots model, optimizer, scheduler, RNG and the
framework's loop state after every optimizer step, which is what a user pays on every step; and it
is worth paying only if a failure then costs less than torchrun plus the framework's own
checkpoint resume (the Hugging Face Trainer's ``resume_from_checkpoint``, Lightning's
``ckpt_path="last"``, Accelerate's ``load_state`` with ``skip_first_batches``).
So, side by side in one run, interleaved per round (the machine is small and noisy):

- steady state (no fault): mean time per optimizer step over steps --steady-from..N from rank 0's
  step-end stamps (with ``--snapshot-every auto``, start past its first decision, step 46, and one
  window: what a long job pays), for torchrun, torchrun with the framework saving a checkpoint every --save-steps,
  resilrun with integrations off (the launcher alone) and resilrun (the integration on);
- one worker SIGKILLed as step --kill-step starts: torchrun --max-restarts 1 resuming from the
  framework's newest checkpoint (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it, torchrun's
  restarted gloo workers read the dead ones' addresses and fail), against resilrun --spares 1;
  the failure's cost is read from the run's own step stamps (end of the killed step less end of the
  step before, less one ordinary step), and so are the steps redone (the first step finished after
  the kill, against the kill step).

Every run is bounded by --timeout; its process group is killed on expiry.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKERS = {
    "transformers": HERE / "_hf_trainer_worker.py",
    "lightning": HERE / "_lightning_worker.py",
    "accelerate": HERE / "_accelerate_worker.py",
}


def _mean_step(stamps: list[tuple[int, float]], first: int = 5) -> float:
    kept = [(s, t) for s, t in stamps if s >= first]
    return (kept[-1][1] - kept[0][1]) / (kept[-1][0] - kept[0][0])


def _lost(stamps: list[tuple[int, float]], kill_step: int) -> float:
    """Seconds the failure cost: from the end of the last step before the kill to the end of the
    killed step, less one ordinary step (redone steps and the restart or recovery are what is left).

    Read from one run's stamps, so the machine's drift between runs (large on a shared 2-core VM)
    does not enter it, unlike a difference of two jobs' wall times."""
    before = next(t for s, t in stamps if s == kill_step)
    after = next(t for s, t in stamps if s == kill_step + 1)
    intervals = [b[1] - a[1] for a, b in zip(stamps, stamps[1:], strict=False) if b[0] == a[0] + 1]
    return after - before - statistics.median(intervals)


def _redone(stamps: list[tuple[int, float]], kill_step: int) -> int:
    """Steps finished twice: after the kill, the run went back to the first step it stamped again."""
    seen: set[int] = set()
    for step, _ in stamps:
        if step in seen:
            return kill_step - step + 1
        seen.add(step)
    return 0


STEADY = ("torchrun", "torchrun + own checkpoints", "resilrun, integrations off", "resilrun")
SPARES_0 = {
    "resilrun --spares 0, killed": ["--spares", "0"],
    "resilrun --spares 0 --no-worker-template, killed": ["--spares", "0", "--no-worker-template"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=sorted(WORKERS), default="transformers")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--kill-step", type=int, default=25)
    parser.add_argument(
        "--snapshot-every", default="1", help="resilrun's --snapshot-every in its runs: N or auto (1: every step)"
    )
    parser.add_argument("--steady-from", type=int, default=5, help="first step of the steady-state mean")
    parser.add_argument("--steady-only", action="store_true", help="leave out the runs with a worker killed")
    parser.add_argument("--failures-only", action="store_true", help="only the runs with a worker killed")
    parser.add_argument("--spares-0", action="store_true", help="also kill under --spares 0, forked and spawned")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    py = sys.executable
    common = ["--nproc-per-node", str(opts.nproc), "--standalone"]
    size = ["--steps", str(opts.steps), "--layers", str(opts.layers), "--width", str(opts.width)]
    kill = ["--kill-rank", "1", "--kill-step", str(opts.kill_step)]
    saves = ["--save-steps", str(opts.save_steps)]
    torchrun = [py, "-m", "torch.distributed.run", *common]
    resilrun = [py, "-m", "resilrun", *common, "--snapshot-every", opts.snapshot_every]
    off = {"RESILRUN_NO_INTEGRATIONS": "1"}
    unshared = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cases: dict[str, tuple[list[str], dict[str, str]]] = {
        "torchrun": (torchrun, {}),
        "torchrun + own checkpoints": (torchrun, {}),
        "resilrun, integrations off": (resilrun, off),
        "resilrun": (resilrun, {}),
        # plain torchrun's shared rendezvous store breaks its restarts with gloo (stale addresses of the
        # dead workers: ../shared/anchors/measured_here.md); its own switch turns the sharing off
        "torchrun + checkpoints, killed": ([*torchrun, "--max-restarts", "1"], unshared),
        "resilrun --spares 1, killed": ([*resilrun, "--spares", "1", "--max-restarts", "0"], {}),
    }
    extra = {
        "torchrun + own checkpoints": saves,
        "torchrun + checkpoints, killed": [*saves, *kill],
        "resilrun --spares 1, killed": kill,
    }
    if opts.spares_0:
        for name, flags in SPARES_0.items():
            cases[name] = ([*resilrun, *flags, "--max-restarts", "0"], {})
            extra[name] = kill
    if opts.steady_only:
        cases = {name: case for name, case in cases.items() if "killed" not in name}
    if opts.failures_only:
        cases = {name: case for name, case in cases.items() if "killed" in name}
    if not 1 <= opts.steady_from < opts.steps:
        parser.error(f"--steady-from must be in 1..{opts.steps - 1} (--steps {opts.steps})")
    results: dict[str, list[tuple[float, list[tuple[int, float]]]]] = {name: [] for name in cases}
    names = list(cases)
    for round_ in range(opts.runs):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            argv, env = cases[name]
            worker_args = [*size, *extra.get(name, [])]
            wall, stamps = _launch(name, argv, env, WORKERS[opts.framework], worker_args, opts.steps, opts.timeout)
            results[name].append((wall, stamps))
            print(f"round {round_ + 1} {name}: {wall:.1f} s", file=sys.stderr, flush=True)
    report = _report(results, opts.kill_step, opts.steady_from)
    print(report["markdown"])
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2))


def _launch(
    name: str, argv: list[str], env: dict[str, str], worker: Path, worker_args: list[str], steps: int, timeout: float
) -> tuple[float, list[tuple[int, float]]]:
    out = Path(tempfile.mkdtemp(prefix="framework-bench-"))
    stamps = out / "stamps.txt"
    full = [*argv, str(worker), "--out", str(out / "run"), "--stamps", str(stamps), *worker_args]
    started = time.monotonic()
    with open(out / "stderr.txt", "wb") as err:
        proc = subprocess.Popen(
            full, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise SystemExit(f"{name}: still running after {timeout} s (logs: {out})") from None
    wall = time.monotonic() - started
    rows = [line.split() for line in stamps.read_text().splitlines()] if stamps.exists() else []
    done = [(int(step), float(at)) for step, at in rows]
    if code != 0:
        if not done or done[-1][0] != steps:
            raise SystemExit(f"{name}: exited {code} (logs: {out})")
        # Plain torchrun's workers sometimes abort at interpreter exit after their last step (gloo's
        # threads: "terminate called without an active exception"); the training itself was done.
        print(f"{name}: exited {code} after its last step (logs: {out})", file=sys.stderr, flush=True)
    return wall, done


def _report(
    results: dict[str, list[tuple[float, list[tuple[int, float]]]]], kill_step: int, steady_from: int
) -> dict[str, Any]:
    steady = [name for name in STEADY if name in results]
    means = {name: [_mean_step(s, steady_from) for _, s in results[name]] for name in steady}
    step_ms = {name: statistics.median(m) * 1000 for name, m in means.items()}
    # Each round's ratio against that round's torchrun (runs of one round are interleaved, so they
    # share the machine's drift): the spread a single median hides.
    count = len(means.get("torchrun", []))
    rounds = [{name: means[name][i] / means["torchrun"][i] for name in steady} for i in range(count)]
    walls = {name: statistics.median(w for w, _ in runs) for name, runs in results.items()}
    lines = []
    if steady:
        base = step_ms["torchrun"]
        lines = [
            f"| steady state (no fault), steps {steady_from}+ | ms per optimizer step | vs torchrun | rounds |",
            "| --- | ---: | ---: | --- |",
            *(
                f"| {name} | {step_ms[name]:.1f} | {step_ms[name] / base:.3f}x | "
                f"{', '.join(f'{r[name]:.3f}' for r in rounds)} |"
                for name in steady
            ),
        ]
    report: dict[str, Any] = {"step_ms": step_ms, "rounds": rounds, "wall_s": {}, "failure": {}}
    if "resilrun --spares 1, killed" not in results:
        report["markdown"] = "\n".join(lines)
        return report
    lines += [
        "",
        f"| one worker SIGKILLed at step {kill_step} | job wall (s) | failure cost (s, from stamps) | steps redone |",
        "| --- | ---: | ---: | ---: |",
    ]
    cost: dict[str, dict[str, float]] = {}
    for name in ("torchrun + checkpoints, killed", "resilrun --spares 1, killed", *SPARES_0):
        if name not in results:
            continue
        redone = statistics.median(_redone(s, kill_step) for _, s in results[name])
        lost = statistics.median(_lost(s, kill_step) for _, s in results[name])
        cost[name] = {"wall_s": walls[name], "cost_s": lost, "redone": redone}
        lines.append(f"| {name} | {walls[name]:.1f} | {cost[name]['cost_s']:.1f} | {redone:g} |")
    t, r = cost["torchrun + checkpoints, killed"], cost["resilrun --spares 1, killed"]
    lines.append("")
    lines.append(f"failure cost, resilrun / torchrun + the framework's resume: {r['cost_s'] / t['cost_s']:.2f}x")
    for name in SPARES_0:
        if name in cost:
            ratio = cost[name]["cost_s"] / t["cost_s"]
            label = name.removesuffix(", killed")
            lines.append(f"failure cost, {label} / torchrun + the framework's resume: {ratio:.2f}x")
    report.update(wall_s=walls, failure=cost, markdown="\n".join(lines))
    return report


if __name__ == "__main__":
    main()
