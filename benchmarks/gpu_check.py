"""The prepared device check: what only a GPU machine can show, in one bounded run (< 8 minutes).

    python benchmarks/gpu_check.py [--out DIR] [--budget 450]

Run it the moment a session is lent a GPU machine (the ``device`` tool: ``run`` with this command
and ``--out $OUT``); the summary (``gpu_check.json``) and every step's log come back under DIR.
Steps, in order of what matters most, each under its own timeout, skipped once the budget is
spent:

1. ``env``: the GPU, driver, torch, CUDA and NCCL versions (every number below depends on them);
   ``device_check``: the check every process runs before it takes a rank (answer time, GFLOP/s of
   its 2048² multiply, and how long it took: on the recovery's critical path for a spare);
2. ``nccl_inprocess``: a worker SIGKILLed at step 12 under ``--spares 1`` on NCCL: the hot spare
   takes its rank in its process, the job ends bitwise equal to a failure-free run (its checksum);
   the recovery's timeline from the events, and each rank's first collective per generation (the
   spare's bounded hand-off check; NCCL sets up its communicator there); with one GPU the job has
   one rank, so the spare is the only rank: NCCL is initialised again in a new process on the same
   device;
3. ``nccl_restart``: the same kill with ``--spares 0 --max-restarts 1`` (the restart path on NCCL);
4. ``captured_torn_save``: the tutorial-style script (``torch.save`` of its own snapshot) on NCCL with
   one save torn by the writer's death, under ``--capture-dir``: it must finish (torchrun cannot);
5. ``pinned_copy``: ``snapshot_cost.py`` part 2 at 64 and 1,024 MiB: the device-to-host snapshot copy
   into pinned memory, as step time against torchrun's;
6. ``torchtitan``: torchtitan's ``llama3_debugmodel`` (``-m torchtitan.train``) under resilrun with a
   rank killed at step 13 and a hot spare, recovered in-process by the integration (issue 46), if
   torchtitan is installed; else skipped with the reason.

Why one script: device time is lent in minutes, a few times a month; whoever gets it must not
have to decide what to run. Exits 0 when every step that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CPU_SHIM = ROOT / "tests" / "helpers" / "torchtitan_on_cpu"  # a sitecustomize: torchtitan on a CPU


def run(name: str, argv: list[str], out: Path, timeout: float, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> dict:  # fmt: skip
    """One bounded step: its exit code, seconds, and the tail of its output (all of it in a log)."""
    log = out / f"{name}.log"
    started = time.monotonic()
    with open(log, "wb") as sink:
        try:
            proc = subprocess.run(
                argv, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, cwd=cwd or ROOT,
                env={**os.environ, **(env or {})}, start_new_session=True, check=False,
            )  # fmt: skip
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    text = log.read_text(errors="replace")
    return {"name": name, "rc": code, "seconds": round(time.monotonic() - started, 2), "tail": text[-1500:]}


def events_of(text: str) -> list[dict]:
    found = []
    for root in dict.fromkeys(re.findall(r"logs in (\S+)", text)):
        path = Path(root) / "events.jsonl"
        if path.exists():
            found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return found


def _torchtitan(out: Path) -> tuple[Path, dict[str, str]] | str:
    """Where torchtitan runs (a working folder holding its test assets) and its environment, or why
    it cannot: torchtitan from ``build/torchtitan-site`` (``make test-torchtitan``) or the machine's own."""
    sys.path.insert(0, str(ROOT))
    from tests.torchtitan_assets import make, torchtitan_site

    site = torchtitan_site()
    env = {"PYTHONPATH": str(site)} if site is not None else {}
    found = subprocess.run([PY, "-c", "import torchtitan"], env={**os.environ, **env}, capture_output=True)
    if found.returncode != 0:
        return "torchtitan is not installed (make test-torchtitan, or pip install torchtitan==0.3.0)"
    work = out / "torchtitan"
    make(work)
    return work, {**env, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(out / "hf")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", tempfile.mkdtemp(prefix="gpu_check_"))))
    parser.add_argument("--budget", type=float, default=450.0, help="seconds; no step starts after this")
    parser.add_argument("--cpu", action="store_true", help="run the steps without a GPU (gloo): checks the script")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    results: list[dict] = []

    def step(name: str, argv: list[str], timeout: float, **kw: object) -> dict | None:
        if time.monotonic() - began + 10 > args.budget:
            results.append({"name": name, "skipped": "the budget is spent"})
            return None
        result = run(name, argv, out, min(timeout, args.budget - (time.monotonic() - began)), **kw)  # type: ignore[arg-type]
        results.append(result)
        return result

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = torch.cuda.nccl.version() if gpus else None
    results.append({
        "name": "env", "gpus": gpus, "device": torch.cuda.get_device_name(0) if gpus else None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": ".".join(map(str, nccl)) if nccl else None,
    })  # fmt: skip
    if gpus:  # the check every process runs before it takes a rank (resilrun/worker/health.py)
        from resilrun.worker.health import check_device

        started = time.monotonic()
        check = check_device(torch.device("cuda", 0))
        results.append({"name": "device_check", "seconds": round(time.monotonic() - started, 3), **check.to_dict()})
    if not gpus and not args.cpu:
        results.append({"name": "all", "skipped": "no CUDA device visible"})
    else:
        nproc = str(min(gpus, 2) if gpus else 2)
        resilrun = [PY, "-m", "resilrun", "--standalone", "--nproc-per-node", nproc]
        train = [str(ROOT / "examples" / "train_checkpointless.py"), "--steps", "30", "--sleep", "0.05"]
        clean = step("nccl_clean", [*resilrun, *train, "--checksum-file", str(out / "clean.sha")], 120)
        kill = {"RESILRUN_FAULTS": f"kill:rank={int(nproc) - 1},step=12"}
        hot = step("nccl_inprocess", [*resilrun, "--spares", "1", "--max-restarts", "0", *train,
                                      "--checksum-file", str(out / "inprocess.sha")], 150, env=kill)  # fmt: skip
        if hot is not None and clean is not None:
            logged = (out / "nccl_inprocess.log").read_text(errors="replace")
            seen = events_of(logged)
            recovered = [e for e in seen if e.get("event") == "recovered"]
            hot["recovered"] = recovered[-1] if recovered else None
            # The hand-off's first collective per rank and generation (NCCL sets up its communicator there)
            hot["first_collective_s"] = [
                (e.get("round"), e.get("rank"), e.get("first_collective_s"))
                for e in seen
                if e.get("event") == "collectives_rebuilt"
            ]
            hot["bitwise_equal"] = (
                (out / "inprocess.sha").exists()
                and (out / "clean.sha").exists()
                and ((out / "inprocess.sha").read_text() == (out / "clean.sha").read_text())
            )
        step("nccl_restart", [*resilrun, "--spares", "0", "--max-restarts", "1", *train], 150, env=kill)
        folder = out / "captured"
        folder.mkdir(exist_ok=True)
        step("captured_torn_save", [*resilrun, "--max-restarts", "2", "--capture-dir", ".", "--capture-pattern",
                                    "snapshot.pt", str(ROOT / "tests" / "helpers" / "torn_save.py"), "8", "2"],
             150, env={"TORN_SAVE_EPOCH": "4"}, cwd=folder)  # fmt: skip
        step("pinned_copy", [PY, str(ROOT / "benchmarks" / "snapshot_cost.py"), "--skip", "inproc", "--nproc", "1",
                             "--sizes", "64,1024", "--runs", "1", "--steps", "60", "--warmup", "15",
                             "--json", str(out / "pinned_copy.json")], 200)  # fmt: skip
        titan = _torchtitan(out)
        if isinstance(titan, str):
            results.append({"name": "torchtitan", "skipped": titan})
        else:  # torchtitan's own entry point; under --cpu with its CPU shim
            work, env = titan
            if not gpus:  # torchtitan's CPU shim (a sitecustomize) on the path
                env["PYTHONPATH"] = os.pathsep.join([*env.get("PYTHONPATH", "").split(os.pathsep), str(CPU_SHIM)])
            config = [
                "--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", "30",
                "--training.seq_len", "256", "--training.local_batch_size", "2", "--debug.seed", "42",
            ]  # fmt: skip
            if not gpus:  # the CPU's settings (tests/integration/test_framework_torchtitan.py says why)
                config += ["--training.mixed_precision_param", "float32"]
                config += ["--parallelism.spmd_backend", "partial_dtensor"]
            titan_run = [*resilrun, "--spares", "1", "--max-restarts", "0", "-m", "torchtitan.train", *config]
            step("torchtitan", titan_run, 200, env={**kill, **env}, cwd=work)
    summary = {"seconds": round(time.monotonic() - began, 1), "steps": results}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    for item in results:
        state = ("ok" if item["rc"] == 0 else f"rc={item['rc']}") if "rc" in item else item.get("skipped") or "info"
        print(f"{item['name']:<20} {state:<10} {item.get('seconds', '')}", flush=True)
    failed = [r for r in results if "rc" in r and r["rc"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
