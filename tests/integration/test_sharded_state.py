"""FSDP2 (2 and 4 ranks), HSDP and tensor-parallel state tracked as it is
(``job.track(model=fsdp_model, optimizer=opt)``, no adapter):
a worker SIGKILLed mid-run is replaced by a hot spare, the survivors keep their processes, every rank
gets its own shards back in place, and the final parameters equal a failure-free run's bit for bit.

HSDP (a 2-D mesh: 2 replicas x 2 shards) also checks that a survivor blocked in a *subgroup*
collective (the all-reduce across replicas) is released when the generation ends: before, only the
default group's connections were cut and such a rank waited forever.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.integration.conftest import resumed_from

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FSDP2 = ROOT / "examples" / "train_fsdp2.py"
TINY = ["--steps", "8", "--hidden", "16", "--layers", "2"]


def _fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def _run(launcher, tmp_path: Path, name: str, nproc: int, flags: list[str], args: list[str], env=None):  # noqa: ANN001, ANN202
    """Run the FSDP2 example under resilrun; returns (the parameters' checksum, the launch)."""
    target = tmp_path / f"{name}.sha"
    log_dir = str(tmp_path / f"logs-{name}")
    argv = ["--standalone", "--nproc-per-node", str(nproc), "--log-dir", log_dir, *flags, str(FSDP2), *TINY, *args]
    run = launcher("resilrun", *argv, "--checksum-file", str(target), env=env)
    code = run.wait(120)
    assert code == 0, f"exited {code}\n{run.stdout()[-2000:]}\n{run.stderr()[-3000:]}"
    checksum = target.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", checksum)
    return checksum, run


def _events(tmp_path: Path, name: str) -> list[dict]:
    (path,) = (tmp_path / f"logs-{name}").glob("*/events.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    ("nproc", "mesh", "victim"),
    [(2, [], 1), (4, [], 2), (4, ["--replicate", "2"], 2), (2, ["--tp", "2"], 1)],
    ids=["fsdp-2-ranks", "fsdp-4-ranks", "hsdp-2x2-mesh", "tensor-parallel-2-ranks"],
)
def test_sharded_state_tracked_directly_recovers_in_process_bitwise(
    launcher, tmp_path: Path, nproc: int, mesh: list[str], victim: int
) -> None:
    if not _fsdp2_available():
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2 needs torch >= 2.6)")
    # Given the failure-free result of the FSDP2 example on this mesh
    clean, _ = _run(launcher, tmp_path, "clean", nproc, [], mesh)
    # When one rank is SIGKILLed as step 5 starts, with a hot spare standing by
    kill = {"RESILRUN_FAULTS": f"kill:rank={victim},step=5"}
    faulty, run = _run(launcher, tmp_path, "faulty", nproc, ["--spares", "1"], mesh, env=kill)
    # Then the spare took the rank without a restart, every rank resumed from step 4 in node memory,
    kinds = [e["event"] for e in _events(tmp_path, "faulty")]
    assert "spare_promoted" in kinds and "restart" not in kinds
    for rank in range(nproc):
        assert resumed_from(run.stderr())[rank] == (4, "memory")
    # and the parameters equal the failure-free run's, bit for bit
    assert faulty == clean


# -- getting the weights out ------------------------------------------------------------------------
def _digest(model) -> str:  # noqa: ANN001 - an nn.Module
    """The examples' own checksum: every state_dict tensor's bytes, in order."""
    import hashlib

    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _zero(model) -> None:  # noqa: ANN001 - an nn.Module
    import torch

    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()


def _export(tmp_path: Path, ckpt: Path, *args: str) -> Path:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "resilrun", "export", str(ckpt), *args],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("exported step 7 (") and "Traceback" not in result.stderr
    return tmp_path


@pytest.mark.parametrize("example", ["train_fsdp2.py", "train_checkpointless.py"], ids=["fsdp2", "ddp"])
def test_an_export_loads_into_a_fresh_model_equal_to_the_trained_one(launcher, tmp_path: Path, example: str) -> None:
    if example == "train_fsdp2.py" and not _fsdp2_available():
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2 needs torch >= 2.6)")
    import torch
    from torch import nn

    import resilrun.checkpoint

    # Given a 2-rank run that persisted its last step (7) to a directory
    ckpt, target = tmp_path / "ckpt", tmp_path / "trained.sha"
    args = ["--steps", "8", "--hidden", "16", "--checksum-file", str(target)]
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--checkpoint-uri", str(ckpt), "--persist-every", "4",
        str(ROOT / "examples" / example), *args, *(["--layers", "2"] if example == "train_fsdp2.py" else []),
    )  # fmt: skip
    assert run.wait(120) == 0, run.stderr()[-3000:]
    trained = target.read_text()
    if example == "train_fsdp2.py":
        fresh = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    else:
        fresh = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    # When the step is exported as model.safetensors and loaded into a fresh, unwrapped model
    from safetensors.torch import load_file

    _export(tmp_path, ckpt, "--to", "model.safetensors")
    fresh.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    # Then its parameters are the trained ones, bit for bit (the FSDP2 shards consolidated)
    assert _digest(fresh) == trained
    # and so are a DCP export read by torch.distributed.checkpoint and resilrun.checkpoint.load's
    import torch.distributed.checkpoint as dcp

    _export(tmp_path, ckpt, "--to", "dcp", "--format", "dcp")
    _zero(fresh)
    into = {"model": {k: torch.zeros_like(v) for k, v in fresh.state_dict().items()}}
    dcp.load(into, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")), no_dist=True)
    fresh.load_state_dict(into["model"])
    assert _digest(fresh) == trained
    state = resilrun.checkpoint.load(str(ckpt))
    _zero(fresh)
    fresh.load_state_dict(resilrun.checkpoint.module_state(state["model"]))
    assert _digest(fresh) == trained
    exp_avg = state["optimizer"]["state"][0]["exp_avg"]
    assert exp_avg.shape == fresh[0].weight.shape  # whole, not one rank's shard
