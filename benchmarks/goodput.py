"""Expected goodput: the share of wall time that trains new steps at torchrun's speed, by MTBF.

    python benchmarks/goodput.py [--snapshot-json auto.json] [--mtbf-hours 1,6,24] [--markdown]

Not a simulation of a cluster: a first-order model fed with figures measured on this machine, so
the trade ``--snapshot-every auto`` makes (steady-state cost vs steps redone per failure) can be
read next to torchrun's (a DCP checkpoint every 30 min, everything since it redone, every worker
restarted). Per failure a job loses its recovery time plus the work redone; between failures it
runs at its steady-state speed relative to torchrun without checkpoints:

    goodput = (1 - lost_per_failure / MTBF) / (step_ratio * (1 + checkpoint_s / checkpoint_every_s))

with lost_per_failure = recovery_s + redone_steps * step_s * step_ratio. Failures are assumed
spread uniformly over a checkpoint interval (on average half of it is redone) and rare next to the
MTBF (lost_per_failure << MTBF).

Inputs, each a measurement on this machine (override any of them):

- ``--snapshot-json``: the JSON ``snapshot_cost.py --auto --json`` wrote. The auto rows give
  resilrun's mean step time over torchrun's (paired by round) and the interval auto picked; a
  failure redoes on average half an interval (the steps since the newest snapshot).
  Without it, ``--resilrun-step-ratio`` and ``--interval``.
- Recovery times and steps redone at a killed worker: ``benchmarks/recovery.py`` (docs/benchmarks.md: resilrun
  0.44 s and 0 steps with a snapshot every step; torchrun 5.7 s plus the steps since its checkpoint).
- dlrover-run (Flash Checkpoint in memory every step) and torchft (live peer recovery, no
  checkpoint): the figures measured on this machine in the same recovery scenario
  (anchors/peers_measured.md, 2026-12-01): their time from kill to training again, their
  steps lost, and their step period next to torchrun's at the same step floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

HOUR_S = 3600.0


@dataclass(frozen=True)
class System:
    name: str
    step_ratio: float  # steady-state mean step time / torchrun's without checkpoints
    recovery_s: float  # a killed worker: detection to training again
    redone_steps: float  # per failure, on average
    checkpoint_s: float = 0.0  # blocking save, every checkpoint_every_s
    checkpoint_every_s: float = 0.0
    note: str = ""

    def lost_s(self, step_s: float) -> float:
        """Wall seconds one failure costs: recovery plus the steps computed again."""
        redone = self.redone_steps * step_s * self.step_ratio
        if self.checkpoint_every_s:
            redone += self.checkpoint_every_s / 2  # on average half an interval since the checkpoint
        return self.recovery_s + redone

    def goodput(self, step_s: float, mtbf_s: float) -> float:
        checkpoint = self.checkpoint_s / self.checkpoint_every_s if self.checkpoint_every_s else 0.0
        return max(0.0, 1 - self.lost_s(step_s) / mtbf_s) / (self.step_ratio * (1 + checkpoint))


@dataclass(frozen=True)
class Measured:
    auto_ratio: float  # resilrun --snapshot-every auto's mean step / torchrun's, paired by round
    auto_ratio_max: float  # the slowest round's
    every_step_ratio: float | None  # the same with a snapshot every step (None: not in the run)
    step_s: float  # torchrun's mean step
    interval: int | None  # the interval auto picked (median over runs)


def measured(path: Path) -> Measured:
    """The figures of ``snapshot_cost.py --auto --json``'s single-node rows."""
    rows = [r for r in json.loads(path.read_text())["jobs"] if "step_mean" in r and r.get("nodes", 1) == 1]
    base = {(r["round"], r["mib"]): r for r in rows if r["variant"] == "torchrun"}

    def ratios(variant: str) -> list[float]:
        paired = [(r, base.get((r["round"], r["mib"]))) for r in rows if r["variant"] == variant]
        return [r["step_mean"] / b["step_mean"] for r, b in paired if b is not None]

    def ratio(variant: str) -> float | None:
        found = ratios(variant)
        return statistics.median(found) if found else None

    auto = ratio("resilrun --snapshot-every auto")
    if auto is None:
        raise SystemExit(f"{path}: no auto row paired with a torchrun row (run snapshot_cost.py --auto --json)")
    intervals = [r["interval"] for r in rows if r["variant"] == "resilrun --snapshot-every auto" and r.get("interval")]
    return Measured(
        auto,
        max(ratios("resilrun --snapshot-every auto")),
        ratio("resilrun"),
        statistics.median(r["step_mean"] for r in base.values()),
        round(statistics.median(intervals)) if intervals else None,
    )


def systems(args: argparse.Namespace, ratio: float, interval: int, slowest: float | None) -> list[System]:
    """The compared systems. A measured step ratio below 1 is this machine's noise (resilrun does
    torchrun's work and more), so the model counts it as 1; ``slowest``: also the slowest round's."""
    every_step = System(
        "resilrun, --snapshot-every 1",
        args.every_step_ratio,
        args.resilrun_recovery_s,
        0.0,
        note="snapshot every step: nothing redone",
    )
    auto = System(
        f"resilrun, --snapshot-every auto (interval {interval})",
        max(1.0, ratio),
        args.resilrun_recovery_s,
        (interval - 1) / 2,
        note=f"measured {ratio:.3f}x torchrun (median of rounds; below 1 counted as 1); redoes the steps "
        "since the newest snapshot: half an interval on average",
    )
    worst = []
    if slowest is not None and slowest > max(1.0, ratio):
        worst = [
            System(
                "... the same at its slowest round",
                slowest,
                args.resilrun_recovery_s,
                (interval - 1) / 2,
                note=f"the slowest round's {slowest:.3f}x: how far this machine's noise moves the answer",
            )
        ]
    torchrun = System(
        "torchrun + DCP every 30 min",
        1.0,
        args.torchrun_recovery_s,
        0.0,
        checkpoint_s=args.dcp_save_s,
        checkpoint_every_s=args.checkpoint_minutes * 60,
        note="all workers restarted, the checkpoint loaded, half an interval redone on average",
    )
    # anchors/peers_measured.md (this machine, 64 MiB, 0.5 s step floor): step period vs torchrun's,
    # kill -> training again, steps lost.
    dlrover = System(
        "dlrover-run + Flash Checkpoint (memory every step)",
        0.5115 / 0.500,
        6.33,
        0.0,
        note="peers_measured.md: step period 0.509-0.514 s vs torchrun's 0.500 s floor; every worker "
        "restarted, 6.3 s; 0 steps lost at 64 MiB",
    )
    torchft = System(
        "torchft (live recovery, no checkpoint)",
        1.0,
        5.24,
        0.0,
        note="peers_measured.md: 5.2 s, nothing redone (the survivors go on without the lost replica's batch, "
        "so the result is not the failure-free run's); its step period was measured at a 0.5 s step floor, "
        "which hides per-step costs (busy time 0.15-0.16 s vs torchrun's 0.13-0.15 s)",
    )
    return [every_step, auto, *worst, torchrun, dlrover, torchft]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--snapshot-json", type=Path, default=None, help="snapshot_cost.py --auto --json output")
    parser.add_argument("--resilrun-step-ratio", type=float, default=1.03, help="without --snapshot-json")
    parser.add_argument("--interval", type=int, default=10, help="auto's interval, without --snapshot-json")
    parser.add_argument("--step-s", type=float, default=0.12, help="torchrun's step time, without --snapshot-json")
    parser.add_argument(
        "--every-step-ratio", type=float, default=1.15, help="resilrun with a snapshot every step (snapshot_cost.py)"
    )
    parser.add_argument("--resilrun-recovery-s", type=float, default=0.44, help="recovery.py: killed worker")
    parser.add_argument("--torchrun-recovery-s", type=float, default=5.7, help="recovery.py: killed worker")
    parser.add_argument(
        "--dcp-save-s", type=float, default=0.08, help="torchrun's blocking DCP save + fsync (snapshot_cost.py, 64 MiB)"
    )
    parser.add_argument("--checkpoint-minutes", type=float, default=30.0)
    parser.add_argument("--mtbf-hours", default="1,6,24")
    parser.add_argument("--json", default="", help="also write the table here")
    args = parser.parse_args()

    ratio, step_s, interval = args.resilrun_step_ratio, args.step_s, args.interval
    slowest: float | None = None
    source = "flags"
    if args.snapshot_json is not None:
        found = measured(args.snapshot_json)
        ratio, step_s, interval = found.auto_ratio, found.step_s, found.interval or interval
        slowest = found.auto_ratio_max
        args.every_step_ratio = found.every_step_ratio or args.every_step_ratio
        source = str(args.snapshot_json)
    mtbfs = [float(h) for h in args.mtbf_hours.split(",")]
    table = systems(args, ratio, interval, slowest)
    print(
        f"Expected goodput (share of wall time training new steps at torchrun's speed); step {step_s * 1e3:.0f} ms, "
        f"resilrun auto: mean step {ratio:.3f}x torchrun, interval {interval} (from {source}).\n"
    )
    print("| system | step ÷ torchrun | lost per failure (s) | " + " | ".join(f"MTBF {h:g} h" for h in mtbfs) + " |")
    print("|---|---|---|" + "---|" * len(mtbfs))
    rows = []
    for system in table:
        cells = [system.goodput(step_s, h * HOUR_S) for h in mtbfs]
        rows.append({"system": system.name, "goodput": dict(zip(args.mtbf_hours.split(","), cells, strict=True))})
        print(
            f"| {system.name} | {system.step_ratio:.3f} | {system.lost_s(step_s):.1f} | "
            + " | ".join(f"{c * 100:.2f} %" for c in cells)
            + " |"
        )
    print()
    for system in table:
        print(f"- {system.name}: {system.note}")
    if args.json:
        Path(args.json).write_text(json.dumps({"step_s": step_s, "ratio": ratio, "interval": interval, "rows": rows}))


if __name__ == "__main__":
    main()
