"""What a commit costs a model of many small tensors: resilrun's per-step snapshot vs a plain copy.

    python benchmarks/commit_overhead.py [--tensors 64,256,1024] [--steps 200] [--runs 3]
    python benchmarks/commit_overhead.py --baseline ../old-checkout     # before/after, same run

Why: ``snapshot_cost.py`` measures large states, where a commit is a memcpy and its bookkeeping
vanishes. A real model is hundreds of tensors (a 7B Llama: 291 parameters, so 873 with AdamW's two
moments, plus a step count each), and what a commit does per tensor (collect it from the state
dicts, find its place, copy it) is paid on every step whatever its size. Here the state is many
small tensors (a stack of 32-wide linear layers with LayerNorm, AdamW), so the per-tensor cost is
all there is to see.

Each run is one process (``resilrun.init()`` is once per process) with a real agent channel in its
threads (``_snapshot_inproc.start_agent``): it times ``next()`` of ``job.steps()`` (collect, copy
into the node-memory slot, commit message: what the training loop waits for between two steps)
and, beside it, the floor: ``copy_`` of the same tensors into preallocated ones, in a loop, as any
snapshot must do. Medians per step over ``--steps`` (the first 20 left out); runs of the checkouts
alternate, and the figures are the medians of the runs. Prints a table and one ``BENCH_JSON`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WARMUP = 20


def _measure(count: int, steps: int) -> dict[str, Any]:
    """In this process: seconds per step of resilrun's commit and of the plain copy, for a state of
    about ``count`` tensors."""
    import torch

    sys.path.insert(0, str(HERE))
    from _snapshot_inproc import start_agent  # this checkout's harness, whichever resilrun it starts

    torch.set_num_threads(1)
    memory, channel = start_agent()
    try:
        import resilrun

        # A layer is a Linear (weight, bias) and a LayerNorm (weight, bias): 4 parameters, 16 tensors
        # with AdamW's state (two moments and a step count per parameter).
        layers = max(1, count // 16)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)) for _ in range(layers)]
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        job = resilrun.init()
        job.track(model=model, optimizer=opt)
        loop = job.steps(total=2**62)
        next(loop)
        tensors = [*model.state_dict().values()]
        tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        copies = [torch.empty_like(t) for t in tensors]
        commit, floor = [], []
        for _ in range(steps):
            begin = time.perf_counter()
            next(loop)
            commit.append(time.perf_counter() - begin)
            begin = time.perf_counter()
            with torch.no_grad():
                for target, source in zip(copies, tensors, strict=True):
                    target.copy_(source)
            floor.append(time.perf_counter() - begin)
        return {
            "resilrun": resilrun.__file__,
            "tensors": float(len(tensors)),
            "commit_s": statistics.median(commit[WARMUP:]),
            "copy_s": statistics.median(floor[WARMUP:]),
        }
    finally:
        channel.close()
        memory.close()


def _run(checkout: Path, count: int, steps: int) -> dict[str, Any]:
    """One measuring process with ``checkout``'s resilrun imported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")])}
    env = {name: value for name, value in env.items() if not name.startswith("RESILRUN_")}
    env["RESILRUN_SNAPSHOT_EVERY"] = "1"  # every step commits, whatever the caller's environment says
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(count), "--steps", str(steps)],
        env=env,
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("CHILD_JSON "):
            result = json.loads(line.removeprefix("CHILD_JSON "))
            if not Path(result["resilrun"]).resolve().is_relative_to(checkout.resolve()):
                raise RuntimeError(f"measured {result['resilrun']}, not {checkout}'s resilrun")
            return result
    raise RuntimeError(f"the measuring process failed ({done.returncode}): {done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", default="64,256,1024", help="state sizes, in tensors, comma-separated")
    parser.add_argument("--steps", type=int, default=200, help="steps timed per run (the first 20 left out)")
    parser.add_argument("--runs", type=int, default=3, help="runs per checkout and size, interleaved")
    parser.add_argument("--baseline", type=Path, default=None, help="also run the resilrun of this checkout")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print("CHILD_JSON " + json.dumps(_measure(args.child, args.steps)), flush=True)
        return
    checkouts = {"resilrun": ROOT}
    if args.baseline is not None:
        checkouts["baseline"] = args.baseline.resolve()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {name: {} for name in checkouts}
    sizes = [int(size) for size in args.tensors.split(",")]
    for run in range(args.runs):
        order = list(checkouts) if run % 2 == 0 else list(reversed(checkouts))
        for count in sizes:
            for name in order:
                results[name].setdefault(str(count), []).append(_run(checkouts[name], count, args.steps))
    print(f"{'checkout':<10} {'tensors':>8} {'commit ms':>10} {'copy ms':>8} {'commit/copy':>12} {'us/tensor':>10}")
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for name, by_size in results.items():
        for count, runs in by_size.items():
            commit = statistics.median(r["commit_s"] for r in runs)
            copy = statistics.median(r["copy_s"] for r in runs)
            tensors = runs[0]["tensors"]
            summary.setdefault(name, {})[count] = {"tensors": tensors, "commit_s": commit, "copy_s": copy}
            print(
                f"{name:<10} {int(tensors):>8} {commit * 1e3:>10.2f} {copy * 1e3:>8.2f} {commit / copy:>11.1f}x "
                f"{commit / tensors * 1e6:>10.1f}"
            )
    if "baseline" in summary:
        for count in summary["resilrun"]:
            ratio = summary["resilrun"][count]["commit_s"] / summary["baseline"][count]["commit_s"]
            print(f"{count} tensors: this checkout's commit is {ratio:.2f}x the baseline's")
    print("BENCH_JSON " + json.dumps({"runs": results, "summary": summary}), flush=True)


if __name__ == "__main__":
    main()
