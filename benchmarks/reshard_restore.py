"""Restore time of a resharded FSDP2 snapshot: resilrun vs DCP's own resharding load, same state.

    python benchmarks/reshard_restore.py [--sizes 64,256] [--resize 2:3,3:2] [--runs 3] [--json out.json]

Not part of the test suite (a few minutes on a quiet 2-core machine at the defaults). Loopback and
a temp directory only. For each state size (MiB of params + AdamW moments, the whole model) and
each resize FROM:TO:

1. One resilrun job of FROM ranks trains an FSDP2 MLP (``_reshard_worker.py --mode save``) and
   persists its last step to a directory; the same script then saves the same state with DCP.
2. Interleaved (the order alternates each round): a resilrun job of TO ranks on that checkpoint
   (``--mode resilrun``: the plan and the resharded restore inside ``job.steps()``) and a torchrun
   job of TO ranks loading the DCP checkpoint (``--mode dcp``: ``get_state_dict``, ``dcp.load``,
   ``set_state_dict``). Each reports its slowest rank's restore seconds, timed inside the workers
   from a barrier, so process start-up and the launchers are not in the figure.
3. Both restored states must digest equal to the saved one (every parameter and moment, whole),
   else the row says so: a fast wrong restore counts for nothing.

Both read files the save just wrote (the page cache is warm for both). Each resilrun rank has its
agent read only the 1 MiB chunks holding the rows it needs of each old rank's file (checked
against the manifest's per-chunk crc32s) into a sparse memfd, and builds its blocks from them; the
last column is what all new ranks brought in together, of the bytes the old files hold. DCP reads
the byte ranges each rank needs.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from launch_overhead import clean_env

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_reshard_worker.py"
ENV = {"OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], timeout: float) -> dict[str, Any]:
    """Run one job; its BENCH_JSON line, or the failure."""
    try:
        proc = subprocess.run(
            cmd, env=clean_env(ENV), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            found = json.loads(line.removeprefix("BENCH_JSON "))
            # resilrun's workers log what they brought in of the old ranks' files (all ranks)
            brought = [int(m) for m in re.findall(r"(\d+) bytes brought in\)", proc.stderr)]
            return {**found, "brought": sum(brought)} if brought else found
    tail = proc.stderr.strip().splitlines()[-6:] or ["no output"]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def _resilrun(nproc: int, ckpt: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "resilrun", "--standalone", "--nproc-per-node", str(nproc), "--replicas", "0",
        "--checkpoint-uri", str(ckpt), *extra,
    ]  # fmt: skip


def measure(mib: float, old: int, new: int, runs: int, steps: int, timeout: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="resilrun-reshard-"))
    ckpt, dcp_dir = work / "ckpt", work / "dcp"
    worker = [str(WORKER), "--mib", str(mib), "--steps", str(steps), "--dcp", str(dcp_dir)]
    row: dict[str, Any] = {"mib": mib, "from": old, "to": new, "resilrun": [], "dcp": [], "errors": []}
    row["brought"], row["files"] = [], 0
    try:
        saved = _run(_resilrun(old, ckpt, ["--persist-every", str(steps), *worker, "--mode", "save"]), timeout)
        if "error" in saved:
            row["errors"].append(f"save: {saved['error']}")
            return row
        row["files"] = sum(f.stat().st_size for f in ckpt.rglob("rank_*.safetensors"))
        commands = {
            "resilrun": _resilrun(new, ckpt, [*worker, "--mode", "resilrun"]),
            "dcp": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(new),
                    *worker, "--mode", "dcp"],
        }  # fmt: skip
        for index in range(runs):
            order = ["resilrun", "dcp"] if index % 2 == 0 else ["dcp", "resilrun"]
            for name in order:
                got = _run(commands[name], timeout)
                if "error" in got:
                    row["errors"].append(f"{name}: {got['error']}")
                elif got["digest"] != saved["digest"]:
                    row["errors"].append(f"{name}: restored state differs from the saved state")
                elif name == "resilrun" and got.get("resumed_at") != steps:
                    row["errors"].append(f"resilrun resumed at step {got.get('resumed_at')}, not {steps}")
                else:
                    row[name].append(got["seconds"])
                    if name == "resilrun" and "brought" in got:
                        row["brought"].append(got["brought"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return row


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"


def _share(row: dict[str, Any]) -> str:
    """What resilrun's new ranks brought in, all together, of the bytes the old ranks' files hold."""
    if not row["brought"] or not row["files"]:
        return "-"
    brought = statistics.median(row["brought"])
    return f"{brought / 2**20:.0f} of {row['files'] / 2**20:.0f} MiB ({brought / row['files']:.0%})"


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| state (MiB) | world size | resilrun restore (median, min-max) | DCP load (median, min-max) "
        "| resilrun / DCP | resilrun read of the old files |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        ratio = "-"
        if row["resilrun"] and row["dcp"]:
            ratio = f"{statistics.median(row['resilrun']) / statistics.median(row['dcp']):.2f}x"
        lines.append(
            f"| {row['mib']:g} | {row['from']} -> {row['to']} | {_cell(row['resilrun'])} | {_cell(row['dcp'])} "
            f"| {ratio} | {_share(row)} |"
        )
    errors = [f"- {r['mib']:g} MiB {r['from']}->{r['to']}: {e}" for r in rows for e in r["errors"]]
    return "\n".join(lines + (["", "Errors:", *errors] if errors else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256", help="MiB of params + moments, comma-separated")
    parser.add_argument("--resize", default="2:3,3:2", help="FROM:TO world sizes, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps the saving job trains")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for mib in (float(s) for s in args.sizes.split(",")):
        for pair in args.resize.split(","):
            old, new = (int(v) for v in pair.split(":"))
            rows.append(measure(mib, old, new, args.runs, args.steps, args.timeout))
            print(report(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(report(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
