"""What measuring each rank's compute time costs a failure-free step (issue 48: within the noise, <= 1 %).

    python benchmarks/straggler_probe_cost.py [--steps 200] [--blocks 10] [--json out.json]

One process, a DDP model over gloo (world size 1, so the all-reduce is real but waits for no one),
trained in blocks of ``--steps`` steps, alternately with the compute probe (worker/_compute_probe.py,
exactly as ``job.steps()`` drives it: ``started()`` before the step, ``ended()`` after it, one
post-accumulate-grad hook) and without, for several model widths (steps from about a millisecond
to tens of milliseconds on a CPU). Alternating blocks keep the comparison fair when the machine's
speed drifts; the figure is the median over blocks of each width's per-step time, and the cost is
their difference as a share of the step without the probe.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from resilrun.worker._compute_probe import ComputeProbe  # noqa: E402


def _block(model: nn.Module, opt: torch.optim.Optimizer, steps: int, probe: ComputeProbe | None) -> float:
    x, y = torch.randn(32, model.module[0].in_features), torch.randn(32, 1)
    started = time.perf_counter()
    for _ in range(steps):
        if probe is not None:
            probe.started()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if probe is not None:
            probe.ended()
    return (time.perf_counter() - started) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per block")
    parser.add_argument("--blocks", type=int, default=10, help="blocks per side and width")
    parser.add_argument("--widths", default="64,512,2048", help="hidden widths (comma-separated)")
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        torch.manual_seed(0)
        layers = [nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)]
        model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        probe = ComputeProbe()
        probe.watch([model])
        _block(model, opt, args.steps, probe)  # warm-up, and the probe keeps its one hook
        _block(model, opt, args.steps, None)
        plain, probed = [], []
        for _ in range(args.blocks):
            plain.append(_block(model, opt, args.steps, None))
            probed.append(_block(model, opt, args.steps, probe))
        base, with_probe = statistics.median(plain), statistics.median(probed)
        spread = (max(plain) - min(plain)) / base
        rows.append(
            {
                "width": width,
                "step_s": base,
                "probed_step_s": with_probe,
                "cost": with_probe / base - 1,
                "noise": spread,
                "compute_s": probe.take(),
            }
        )
        row = rows[-1]
        print(
            f"width {width:5d}: step {base * 1000:7.3f} ms, with the probe {with_probe * 1000:7.3f} ms, "
            f"cost {row['cost'] * 100:+.2f} % (blocks without it spread {spread * 100:.1f} %)",
            flush=True,
        )
    dist.destroy_process_group()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
