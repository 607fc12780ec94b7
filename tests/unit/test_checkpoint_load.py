"""``resilrun.checkpoint.load`` and ``resilrun export`` on persisted steps written as workers write
them: whole tensors assembled from every rank's shards (FSDP and HSDP meshes), plain tensors from
one rank, tracked values; forged, truncated and incomplete checkpoints refused with a reason; the
exported files read back by safetensors and by torch.distributed.checkpoint; the command's exit codes.
"""

from __future__ import annotations

import json
import os
import pickle
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import resilrun.checkpoint as checkpoint
from resilrun.checkpoint import export as exporter
from resilrun.cli import main
from resilrun.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ConfigError, ExitCode
from resilrun.job_secret import external_secret
from resilrun.snapshot.sharding import MeshSpec, ShardSpec, local_block
from resilrun.storage import LocalStorage
from resilrun.tiers import _manifest as m
from resilrun.tiers import durable
from resilrun.tiers.authentic import durable_key
from tests.conftest import make_snapshot
from tests.helpers.forgery import forged_keeping_crc32, pickle_payload

WEIGHT = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4) / 7
BIAS = torch.arange(5, dtype=torch.float64)  # 5 over 2 shards: 3 and 2
EXP_AVG = -WEIGHT


def _sharded(name: str, mesh: MeshSpec, placements: tuple[str, ...], whole: torch.Tensor) -> tuple[dict, torch.Tensor]:
    shape, offset = local_block(tuple(whole.shape), mesh.shape, mesh.coordinate, placements)  # type: ignore[misc]
    local = whole
    for dim, (start, size) in enumerate(zip(offset, shape, strict=True)):
        local = local.narrow(dim, start, size)
    spec = ShardSpec(mesh.key(), placements, tuple(whole.shape), offset)
    return {"__dtensor__": name, "spec": spec.to_json()}, local.clone()


def rank_snapshot(rank: int, mesh: MeshSpec, placements: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], Any]:
    """What a worker tracking ``model`` (DDP-wrapped FSDP-style) and ``optimizer`` commits."""
    tensors: dict[str, torch.Tensor] = {}
    w_node, tensors["model/module.w"] = _sharded("model/module.w", mesh, placements, WEIGHT)
    b_node, tensors["model/module.b"] = _sharded("model/module.b", mesh, placements, BIAS)
    m_node, tensors["optimizer/state/0/exp_avg"] = _sharded("optimizer/state/0/exp_avg", mesh, placements, EXP_AVG)
    tensors["model/module.scale"] = torch.tensor([2.5 + rank])  # plain: each rank's own
    tensors["optimizer/state/0/step"] = torch.tensor(7.0)
    objects = {
        "model": {
            "__dict__": [
                ["module.w", w_node],
                ["module.b", b_node],
                ["module.scale", {"__tensor__": "model/module.scale"}],
            ]
        },
        "optimizer": {
            "__dict__": [
                [
                    "state",
                    {
                        "__dict__": [
                            [0, {"__dict__": [["step", {"__tensor__": "optimizer/state/0/step"}], ["exp_avg", m_node]]}]
                        ]
                    },
                ],
                [
                    "param_groups",
                    [{"__dict__": [["lr", 0.01], ["betas", {"__tuple__": [0.9, 0.999]}], ["params", [0]]]}],
                ],
            ]
        },
        "_rng": {"__dict__": [["torch", {"__tensor__": "_rng/torch"}]]},
    }
    tensors["_rng/torch"] = torch.zeros(4, dtype=torch.uint8)
    meta = {
        "format": 1,
        "objects": objects,
        "values": {"epoch": 3},
        "meshes": {mesh.key(): mesh.to_json()},
        "kinds": {"model": "module", "optimizer": "optimizer"},
    }
    return tensors, meta


def _mesh(world: int, replicate: int, rank: int) -> tuple[MeshSpec, tuple[str, ...]]:
    if replicate == 1:
        return MeshSpec("cpu", (world,), tuple(range(world)), ("shard",), (rank,)), ("S0",)
    shape = (replicate, world // replicate)
    coord = (rank // shape[1], rank % shape[1])
    return MeshSpec("cpu", shape, tuple(range(world)), ("replicate", "shard"), coord), ("R", "S0")


def write(  # noqa: ANN001
    root: Path, world: int = 2, replicate: int = 1, step: int = 9, forge=None, commit: bool = True, mac_key=None
) -> Path:
    storage = LocalStorage(root)
    for rank in range(world):
        mesh, placements = _mesh(world, replicate, rank)
        tensors, meta = rank_snapshot(rank, mesh, placements)
        if forge is not None:
            forge(rank, tensors, meta)
        durable.write_rank(storage, step, rank, world, make_snapshot(tensors), meta, mac_key=mac_key)
    if commit:
        durable.commit_step(storage, step, world, mac_key=mac_key)
    return root


@pytest.mark.parametrize(("world", "replicate"), [(2, 1), (4, 2), (3, 1)], ids=["fsdp-2", "hsdp-2x2", "fsdp-3-uneven"])
def test_load_assembles_whole_tensors_from_every_ranks_shards(tmp_path: Path, world: int, replicate: int) -> None:
    root = write(tmp_path / "ckpt", world, replicate)
    state = checkpoint.load(str(root))
    assert list(state) == ["model", "optimizer", "epoch"]  # resilrun's own _rng is not the script's
    model = state["model"]
    assert torch.equal(model["module.w"], WEIGHT) and torch.equal(model["module.b"], BIAS)
    assert model["module.scale"].item() == 2.5  # plain tensors: rank 0's
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], EXP_AVG)
    assert state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert state["epoch"] == 3
    assert checkpoint.load(str(root), names=["model"], rank=1)["model"]["module.scale"].item() == 3.5


def test_module_state_removes_wrapper_prefixes_only_when_every_name_has_them() -> None:
    t = torch.zeros(1)
    assert list(checkpoint.module_state({"module._orig_mod.a": t, "module._orig_mod.b": t})) == ["a", "b"]
    assert list(checkpoint.module_state({"module.a": t, "b": t})) == ["module.a", "b"]


# -- refused, with a reason ------------------------------------------------------------------------
def _shift_offset(rank: int, tensors: dict, meta: Any) -> None:
    if rank == 1:
        meta["objects"]["model"]["__dict__"][0][1]["spec"]["offset"] = [0, 0]  # rank 0's block


def _claim_rank_0s_place(rank: int, tensors: dict, meta: Any) -> None:
    if rank == 1:
        (key,) = meta["meshes"]
        meta["meshes"][key]["coordinate"] = [0]
        meta["objects"]["model"]["__dict__"][0][1]["spec"]["offset"] = [0, 0]


def _other_shape(rank: int, tensors: dict, meta: Any) -> None:
    if rank == 1:
        meta["objects"]["model"]["__dict__"][0][1]["spec"]["shape"] = [6, 5]


def _dangling_tensor(rank: int, tensors: dict, meta: Any) -> None:
    if rank == 0:
        meta["objects"]["model"]["__dict__"][2][1] = {"__tensor__": "model/nowhere"}


def _outside_the_mesh(rank: int, tensors: dict, meta: Any) -> None:
    if rank == 1:
        (key,) = meta["meshes"]
        meta["meshes"][key]["coordinate"] = [5]


@pytest.mark.parametrize(
    ("forge", "message"),
    [
        (_shift_offset, "is not the block its place on the mesh owns"),
        (_claim_rank_0s_place, "claims another rank's place"),
        (_other_shape, "unlike rank 0"),
        (_dangling_tensor, "does not hold"),
        (_outside_the_mesh, "is malformed"),
    ],
)
def test_a_forged_step_is_refused_cleanly(tmp_path: Path, forge, message: str) -> None:  # noqa: ANN001
    root = write(tmp_path / "ckpt", forge=forge)
    with pytest.raises(CheckpointCorruptError, match=message):
        checkpoint.load(str(root))


def test_a_truncated_rank_file_is_refused(tmp_path: Path) -> None:
    root = write(tmp_path / "ckpt")
    data = root / "step_000000000009" / "rank_00001.safetensors"
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(CheckpointCorruptError, match="rank_00001"):
        checkpoint.load(str(root))


def test_a_flipped_byte_fails_its_checksum(tmp_path: Path) -> None:
    root = write(tmp_path / "ckpt")
    data = root / "step_000000000009" / "rank_00001.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match="crc32"):
        checkpoint.load(str(root))


def test_an_incomplete_step_a_missing_name_and_no_checkpoint_are_not_found(tmp_path: Path) -> None:
    root = write(tmp_path / "ckpt")
    write(root, step=12, commit=False)
    with pytest.raises(CheckpointNotFoundError, match="step 12 .* is not complete") as info:
        checkpoint.load(str(root), step=12)
    assert info.value.hint == "the newest complete step is 9"
    assert checkpoint.load(str(root))["epoch"] == 3  # the newest *complete* step by default
    with pytest.raises(CheckpointNotFoundError, match="no tracked object 'weights'") as info:
        checkpoint.load(str(root), names=["weights"])
    assert info.value.hint == "it holds: model, optimizer, epoch"
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
        checkpoint.load(str(tmp_path / "empty"))


def test_partial_sums_cannot_be_consolidated(tmp_path: Path) -> None:
    def partial(rank: int, tensors: dict, meta: Any) -> None:
        meta["objects"]["model"]["__dict__"][0][1]["spec"]["placements"] = ["P:sum"]
        meta["objects"]["model"]["__dict__"][0][1]["spec"].pop("offset")

    root = write(tmp_path / "ckpt", forge=partial)
    with pytest.raises(CheckpointError, match="partial sums"):
        checkpoint.load(str(root))


# -- export ----------------------------------------------------------------------------------------
def test_safetensors_export_has_the_models_own_names_and_loads_into_it(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    root = write(tmp_path / "ckpt")
    step = checkpoint.open_step(str(root))
    assert exporter.choose_names(step, (), "safetensors") == ("model",)
    target = exporter.check_target(tmp_path, "safetensors", force=False)
    assert target == tmp_path / "model.safetensors"
    done = exporter.export(step, ("model",), "safetensors", target)
    loaded = safetensors.load_file(str(target))
    assert sorted(loaded) == ["b", "scale", "w"] and done.tensors == 3
    assert torch.equal(loaded["w"], WEIGHT) and torch.equal(loaded["b"], BIAS)
    with open(target, "rb") as handle:  # the metadata transformers' loader insists on
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    assert header["__metadata__"]["format"] == "pt"
    assert not list(tmp_path.glob(".*.partial"))  # no temporary file left
    module = torch.nn.Module()
    for name in ("w", "b", "scale"):
        module.register_buffer(name, torch.zeros_like(loaded[name]))
    module.load_state_dict(loaded, strict=True)


@pytest.mark.parametrize("umask", [0o077, 0o027, 0o022])
def test_an_exported_file_has_the_mode_the_umask_gives_not_a_forced_one(tmp_path: Path, umask: int) -> None:
    # Issue 43 (F15): a user whose umask keeps files private must not find exported weights 0644.
    root = write(tmp_path / "ckpt")
    step = checkpoint.open_step(str(root))
    target = exporter.check_target(tmp_path / "m.safetensors", "safetensors", force=False)
    previous = os.umask(umask)
    try:
        exporter.export(step, ("model",), "safetensors", target)
    finally:
        os.umask(previous)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    assert not list(tmp_path.glob(".*.partial"))


def test_dcp_export_is_read_back_by_torch_distributed_checkpoint(tmp_path: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    root = write(tmp_path / "ckpt", world=4, replicate=2)
    step = checkpoint.open_step(str(root))
    target = exporter.check_target(tmp_path / "dcp", "dcp", force=False)
    exporter.export(step, exporter.choose_names(step, (), "dcp"), "dcp", target)
    into = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(5, dtype=torch.float64)}}
    dcp.load(into, storage_reader=dcp.FileSystemReader(str(target)), no_dist=True)
    assert torch.equal(into["model"]["w"], WEIGHT) and torch.equal(into["model"]["b"], BIAS)


def test_export_targets_are_checked_before_anything_is_read(tmp_path: Path) -> None:
    (tmp_path / "taken.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match="already exists"):
        exporter.check_target(tmp_path / "taken.safetensors", "safetensors", force=False)
    assert exporter.check_target(tmp_path / "taken.safetensors", "safetensors", force=True)
    with pytest.raises(ConfigError, match="does not exist"):
        exporter.check_target(tmp_path / "no" / "such" / "model.safetensors", "safetensors", force=False)
    with pytest.raises(ConfigError, match="is a file"):
        exporter.check_target(tmp_path / "taken.safetensors", "dcp", force=True)


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(["export", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return int(info.value.code or 0), out, err


def test_the_export_command_writes_and_says_what(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write(tmp_path / "ckpt")
    code, out, err = _cli([str(root), "--to", str(tmp_path / "m.safetensors")], capsys)
    assert code == ExitCode.OK, err
    assert out.startswith("exported step 9 (model: 3 tensors,") and err == ""
    code, out, _ = _cli([str(root), "--to", str(tmp_path / "d"), "--format", "dcp", "--json"], capsys)
    assert code == ExitCode.OK
    assert json.loads(out)["data"]["names"] == ["model", "optimizer", "epoch"]
    # nothing in the DCP directory is read back by resilrun, and its own files were never unpickled
    assert not any(pickle.__name__ in str(p) for p in (tmp_path / "d").iterdir())


def test_the_export_command_draws_its_progress_on_a_terminal_only(tmp_path: Path) -> None:
    """On a TTY the read of every rank's file shows as a bar on stderr (erased when done); the
    piped run above prints nothing there. A real pseudo-terminal, as a user's shell has."""
    root = write(tmp_path / "ckpt", world=3)
    leader, follower = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "100"}
    env.pop("NO_COLOR", None)
    command = [sys.executable, "-m", "resilrun", "export", str(root), "--to", str(tmp_path / "m.safetensors")]
    with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower, env=env) as proc:
        os.close(follower)
        drawn = bytearray()
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            drawn += chunk
        out = proc.stdout.read().decode() if proc.stdout else ""
        assert proc.wait(60) == 0, drawn.decode(errors="replace")
    os.close(leader)
    text = drawn.decode(errors="replace")
    assert "reading step 9" in text and "\x1b[" in text, text  # the bar, drawn with escape codes
    assert out.startswith("exported step 9"), out  # the data still goes to stdout, plain


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--to", "{tmp}/nowhere/m.safetensors"], ExitCode.USAGE, "does not exist"),
        (["--to", "{tmp}/ckpt/step_000000000009/rank_00000.safetensors"], ExitCode.USAGE, "already exists"),
        (["--to", "{tmp}/m.st", "--format", "onnx"], ExitCode.USAGE, "is not one of safetensors, dcp"),
        (["--to", "{tmp}/m.st", "--object", "weights"], ExitCode.CHECKPOINT, "no tracked object 'weights'"),
        (["--to", "{tmp}/m.st", "--object", "model", "--object", "optimizer"], ExitCode.USAGE, "writes one model"),
        (["--to", "{tmp}/m.st", "--step", "3"], ExitCode.CHECKPOINT, "step 3 is not in"),
    ],
)
def test_the_export_command_refuses_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], code: int, message: str
) -> None:
    root = write(tmp_path / "ckpt")
    got, out, err = _cli([str(root), *(a.format(tmp=tmp_path) for a in args)], capsys)
    assert got == code, err
    assert message in err and err.count("resilrun: error:") == 1


# -- with the job secret (issue 19): only an authentic step is loaded or exported ------------------
def _secret_file(tmp_path: Path, root: Path) -> tuple[str, bytes]:
    """The secret file and the durable key of the checkpoint at ``root``."""
    path = tmp_path / "job.secret"
    path.write_text("a job secret of enough characters\n")
    path.chmod(0o600)
    secret = external_secret(str(path), {})
    assert secret is not None
    return str(path), durable_key(secret, str(root))


def test_with_the_secret_an_authentic_step_loads_and_a_forged_or_unsigned_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret_file, key = _secret_file(tmp_path, tmp_path / "ckpt")
    root = write(tmp_path / "ckpt", mac_key=key)
    state = checkpoint.load(str(root), job_secret_file=secret_file)
    assert torch.equal(state["model"]["module.w"], WEIGHT)
    file = root / m.data_key(9, 1)
    data = file.read_bytes()
    file.write_bytes(forged_keeping_crc32(data, len(data) - 40, len(data) - 20))  # in a tensor, crc32 kept
    assert torch.is_tensor(checkpoint.load(str(root))["model"]["module.w"])  # the checksums cannot tell
    with pytest.raises(CheckpointCorruptError, match="rank 1's file is not authentic"):
        checkpoint.load(str(root), job_secret_file=secret_file)
    code, _, err = _cli([str(root), "--to", str(tmp_path / "m.safetensors"), "--job-secret-file", secret_file], capsys)
    assert code == ExitCode.CHECKPOINT and "not authentic" in err and not (tmp_path / "m.safetensors").exists()
    unsigned = write(tmp_path / "unsigned")
    with pytest.raises(CheckpointCorruptError, match="carries no MAC"):
        checkpoint.load(str(unsigned), job_secret_file=secret_file)


def test_a_signed_step_copied_from_another_jobs_checkpoint_is_refused_by_load_and_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 43 (F13): same secret, another job's --checkpoint-uri: its MACs bind where it was written.
    import shutil

    secret_file, key = _secret_file(tmp_path, tmp_path / "job-b")
    source = write(tmp_path / "job-b", mac_key=key)
    assert torch.is_tensor(checkpoint.load(str(source), job_secret_file=secret_file)["model"]["module.w"])
    copy = tmp_path / "job-a"
    shutil.copytree(source, copy)
    with pytest.raises(CheckpointCorruptError, match="COMPLETE.json is not authentic"):
        checkpoint.load(str(copy), job_secret_file=secret_file)
    code, _, err = _cli([str(copy), "--to", str(tmp_path / "m.safetensors"), "--job-secret-file", secret_file], capsys)
    assert code == ExitCode.CHECKPOINT and "not authentic" in err and not (tmp_path / "m.safetensors").exists()


def test_a_pickle_posing_as_a_rank_file_is_refused_by_load_and_export_and_never_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import zlib

    root = write(tmp_path / "ckpt")
    marker = tmp_path / "marker"
    payload = pickle_payload(marker)
    storage = LocalStorage(root)
    # A forger who also rewrites the rank's manifest and COMPLETE.json to match the payload.
    manifest = json.loads(storage.get(m.manifest_key(9, 1)))
    manifest.update(file_bytes=len(payload))
    storage.put(m.data_key(9, 1), payload)
    storage.put(m.manifest_key(9, 1), m.encode(manifest))
    complete = json.loads(storage.get(m.complete_key(9)))
    complete["ranks"]["1"] = {"file_bytes": len(payload), "manifest_crc32": zlib.crc32(m.encode(manifest))}
    storage.put(m.complete_key(9), m.encode(complete))
    with pytest.raises(CheckpointCorruptError):
        checkpoint.load(str(root))
    for fmt, target in (("safetensors", "m.safetensors"), ("dcp", "d")):
        code, _, err = _cli([str(root), "--to", str(tmp_path / target), "--format", fmt], capsys)
        assert code == ExitCode.CHECKPOINT and err.count("resilrun: error:") == 1, err
    assert not marker.exists()
    assert not (tmp_path / "m.safetensors").exists() and not (tmp_path / "d").exists()  # nothing half-written
