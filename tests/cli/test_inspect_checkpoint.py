"""``resilrun inspect-checkpoint``: output, --json shape, --verify, exit codes, and no tracebacks."""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path

import pytest
import torch

from resilrun.cli import main
from resilrun.errors import ExitCode
from resilrun.job_secret import external_secret
from resilrun.storage import LocalStorage, Storage
from resilrun.tiers import _manifest as m
from resilrun.tiers import durable
from resilrun.tiers.authentic import durable_key
from tests.conftest import FAKE_ACCESS_KEY_ID, FAKE_SECRET_ACCESS_KEY, S3Server, make_snapshot
from tests.helpers.forgery import pickle_payload


def tensors(rank: int) -> dict[str, torch.Tensor]:
    return {"model/w": torch.full((2, 3), float(rank)), "step": torch.tensor([rank], dtype=torch.int64)}


def write_checkpoint(storage: Storage, world_size: int = 2, mac_key: bytes | None = None) -> None:
    """Steps 10 and 20 complete, step 30 partial (rank 0 only)."""
    for step in (10, 20):
        for rank in range(world_size):
            snapshot = make_snapshot(tensors(rank))
            durable.write_rank(storage, step, rank, world_size, snapshot, {"epoch": step}, mac_key=mac_key)
        durable.commit_step(storage, step, world_size, mac_key=mac_key)
    durable.write_rank(storage, 30, 0, world_size, make_snapshot(tensors(0)), {"epoch": 30})


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(["inspect-checkpoint", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return int(info.value.code or 0), out, err


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    write_checkpoint(LocalStorage(root))
    return root


def test_human_output_lists_steps_ranks_tensors_and_totals(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run([str(ckpt)], capsys)
    assert code == ExitCode.OK
    assert "3 step(s), 2 complete" in out
    assert "30    partial" in out and "10    complete  0-1" in out
    assert "step 20: complete, world size 2" in out  # the newest complete step by default
    assert "model/w  F32    [2, 3]  24 B" in out
    assert "total: 2 rank(s), 4 tensor(s)" in out
    assert "values: epoch" in out
    assert err == ""  # nothing on stderr, and no progress bar off a TTY


def test_json_output_has_the_documented_shape(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([str(ckpt), "--json", "--step", "10", "--verify"], capsys)
    assert code == ExitCode.OK
    document = json.loads(out)
    data = document["data"]
    assert set(document) == {"data"}
    assert set(data) == {"uri", "steps", "latest_complete_step", "selected", "captured"}
    assert data["captured"] == []  # no file captured under --capture-dir
    assert data["steps"] == [
        {"step": 10, "complete": True, "ranks": [0, 1]},
        {"step": 20, "complete": True, "ranks": [0, 1]},
        {"step": 30, "complete": False, "ranks": [0]},
    ]
    assert data["latest_complete_step"] == 20
    selected = data["selected"]
    assert set(selected) == {"step", "complete", "world_size", "verified", "authentic", "ranks", "totals"}
    assert (selected["step"], selected["complete"], selected["world_size"], selected["verified"]) == (10, True, 2, True)
    rank = selected["ranks"][1]
    assert set(rank) == {"rank", "file", "file_bytes", "tensor_bytes", "tensors", "values"}
    assert rank["file"] == "rank_00001.safetensors" and rank["values"] == {"epoch": 10}
    assert set(rank["tensors"][0]) == {"name", "dtype", "shape", "bytes", "crc32"}
    assert {t["name"]: (t["dtype"], t["shape"], t["bytes"]) for t in rank["tensors"]} == {
        "model/w": ("F32", [2, 3], 24),
        "step": ("I64", [1], 8),
    }
    assert selected["totals"] == {
        "ranks": 2,
        "tensors": 4,
        "tensor_bytes": 64,
        "file_bytes": sum(r["file_bytes"] for r in selected["ranks"]),
    }


def test_a_partial_step_can_be_shown_and_verified(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([str(ckpt), "--json", "--step", "30", "--verify"], capsys)
    assert code == ExitCode.OK
    selected = json.loads(out)["data"]["selected"]
    assert (selected["complete"], selected["world_size"], [r["rank"] for r in selected["ranks"]]) == (False, 2, [0])


def test_verify_reports_a_corrupt_tensor_in_one_line_with_exit_code_4(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = ckpt / "step_000000000020" / "rank_00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out, _ = run([str(ckpt)], capsys)  # without --verify only headers are read: still fine
    assert code == ExitCode.OK
    code, out, err = run([str(ckpt), "--verify"], capsys)
    assert code == ExitCode.CHECKPOINT
    assert out == ""
    lines = err.strip().splitlines()
    assert lines[0].startswith("resilrun: error: ") and "rank_00001.safetensors" in lines[0]
    assert "fails its crc32" in lines[0]


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """A job secret file as ``--job-secret-file`` accepts it (mode 0600)."""
    path = tmp_path / "job.secret"
    path.write_text("a job secret of enough characters")
    path.chmod(0o600)
    return path


def write_signed_checkpoint(root: Path, secret_file: Path) -> None:
    """``write_checkpoint`` at ``root`` with MACs under the secret in ``secret_file``, bound to ``root``."""
    secret = external_secret(str(secret_file), {})
    assert secret is not None
    write_checkpoint(LocalStorage(root), mac_key=durable_key(secret, str(root)))


def test_with_the_job_secret_verify_says_authentic_unsigned_or_refuses_a_forgery(
    tmp_path: Path, secret_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "signed"
    write_signed_checkpoint(root, secret_file)
    code, out, err = run([str(root), "--job-secret-file", str(secret_file)], capsys)  # implies --verify
    assert code == ExitCode.OK, err
    assert "every checksum verified; authentic: every MAC verifies under the job secret" in out
    code, out, _ = run([str(root), "--verify", "--json"], capsys)
    assert json.loads(out)["data"]["selected"]["authentic"] is None  # no secret: not checked
    code, out, _ = run([str(root), "--job-secret-file", str(secret_file), "--json"], capsys)
    assert json.loads(out)["data"]["selected"]["authentic"] is True
    code, out, _ = run([str(tmp_path_unsigned(tmp_path)), "--job-secret-file", str(secret_file)], capsys)
    assert code == ExitCode.OK and "NOT authenticated: the step carries no MACs" in out
    manifest = root / m.manifest_key(20, 1)
    forged = json.loads(manifest.read_text())
    forged["values"] = {"epoch": 99}
    raw = m.encode(forged)
    complete = json.loads((root / m.complete_key(20)).read_text())
    complete["ranks"]["1"]["manifest_crc32"] = zlib.crc32(raw)  # every checksum redone
    manifest.write_bytes(raw)
    (root / m.complete_key(20)).write_bytes(m.encode(complete))
    assert run([str(root), "--verify"], capsys)[0] == ExitCode.OK
    code, _, err = run([str(root), "--job-secret-file", str(secret_file)], capsys)
    assert code == ExitCode.CHECKPOINT and "not authentic" in err and err.count("\n") <= 2
    secret_file.chmod(0o644)
    code, _, err = run([str(root), "--job-secret-file", str(secret_file)], capsys)
    assert code == ExitCode.USAGE and "can be read by" in err


def test_a_signed_checkpoint_copied_under_another_uri_is_not_authentic_there(
    tmp_path: Path, secret_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 43 (F13): the MACs bind the URI the job wrote to; another spelling of it still verifies.
    import shutil

    root = tmp_path / "job-a"
    write_signed_checkpoint(root, secret_file)
    (tmp_path / "x").mkdir()
    for spelling in (f"{root}/", f"file://{root}", f"{tmp_path}/x/../job-a", f"{tmp_path}/./job-a"):
        code, out, err = run([spelling, "--job-secret-file", str(secret_file)], capsys)
        assert code == ExitCode.OK and "authentic: every MAC verifies" in out, err
    copy = tmp_path / "job-b"
    shutil.copytree(root, copy)
    code, _, err = run([str(copy), "--job-secret-file", str(secret_file)], capsys)
    assert code == ExitCode.CHECKPOINT and "COMPLETE.json is not authentic" in err


def tmp_path_unsigned(tmp_path: Path) -> Path:
    root = tmp_path / "unsigned"
    write_checkpoint(LocalStorage(root))
    return root


def test_json_errors_are_a_single_error_document(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (ckpt / "step_000000000020" / "rank_00000.safetensors").write_bytes(b"\x00" * 3)
    code, out, _ = run([str(ckpt), "--json"], capsys)
    assert code == ExitCode.CHECKPOINT
    error = json.loads(out)["error"]
    assert set(error) == {"code", "message", "hint"}
    assert error["code"] == "CheckpointCorruptError"
    assert "truncated" in error["message"]


def test_a_pickle_posing_as_a_snapshot_is_refused_and_never_runs(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    payload = pickle_payload(marker)
    storage = LocalStorage(ckpt)
    # A forger who also rewrites the manifest and COMPLETE.json to match the payload.
    manifest = json.loads(storage.get(m.manifest_key(20, 0)))
    manifest.update(file_bytes=len(payload), tensors={})
    storage.put(m.data_key(20, 0), payload)
    storage.put(m.manifest_key(20, 0), m.encode(manifest))
    complete = json.loads(storage.get(m.complete_key(20)))
    complete["ranks"]["0"] = {"file_bytes": len(payload), "manifest_crc32": zlib.crc32(m.encode(manifest))}
    storage.put(m.complete_key(20), m.encode(complete))
    for extra in ([], ["--verify"], ["--json", "--verify"]):
        code, out, err = run([str(ckpt), *extra], capsys)
        assert code == ExitCode.CHECKPOINT, out + err
    assert not marker.exists()


def test_an_empty_or_missing_directory_is_checkpoint_not_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run([str(tmp_path / "nothing-here")], capsys)
    assert code == ExitCode.CHECKPOINT
    assert "no checkpoint under" in err and "resilrun: hint:" in err


def test_an_unknown_step_is_not_found_and_the_hint_names_existing_steps(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run([str(ckpt), "--step", "15"], capsys)
    assert code == ExitCode.CHECKPOINT
    assert "step 15 is not in" in err and "10, 20, 30" in err


def test_verify_without_any_complete_step_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    storage = LocalStorage(tmp_path)
    durable.write_rank(storage, 1, 0, 2, make_snapshot(tensors(0)), {})
    code, out, _ = run([str(tmp_path)], capsys)
    assert code == ExitCode.OK and "no complete step" in out
    code, _, err = run([str(tmp_path), "--verify"], capsys)
    assert code == ExitCode.CHECKPOINT and "none can be verified" in err


@pytest.mark.parametrize(
    "args",
    [
        ["gs://bucket/x"],
        ["s3://Bad_Bucket/x"],
        ["s3://bucket/a/../b"],
        ["s3://"],
        ["/some/dir", "--s3-endpoint-url", "http://127.0.0.1:9"],
        ["s3://bucket/x", "--s3-endpoint-url", "ftp://host"],
        ["s3://bucket/x", "--s3-endpoint-url", "http://user:hunter2@host"],
        ["/some/dir", "--step", "-1"],
        ["/some/dir", "--step", "ten"],
        [],
    ],
)
def test_usage_errors_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(args, capsys)
    assert code == ExitCode.USAGE
    assert "hunter2" not in out + err


def test_a_tty_gets_a_progress_bar_on_stderr_and_plain_data_on_stdout(
    ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    monkeypatch.setattr("sys.stderr", tty)
    code, out, _ = run([str(ckpt), "--verify", "--json"], capsys)
    assert code == ExitCode.OK
    assert json.loads(out)["data"]["selected"]["verified"] is True


# -- S3 --------------------------------------------------------------------------------------------
def _s3_checkpoint(server: S3Server, bucket: str) -> str:
    from resilrun.storage.s3 import S3Storage

    write_checkpoint(S3Storage(bucket, "run-1", endpoint_url=server.endpoint_url))
    return f"s3://{bucket}/run-1"


def test_inspect_an_s3_checkpoint(s3_server: S3Server, s3_bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    uri = _s3_checkpoint(s3_server, s3_bucket)
    code, out, _ = run([uri, "--verify", "--json", "--s3-endpoint-url", s3_server.endpoint_url], capsys)
    assert code == ExitCode.OK
    data = json.loads(out)["data"]
    assert data["uri"] == uri and data["latest_complete_step"] == 20 and data["selected"]["verified"]


def test_s3_owner_mismatch_exits_5_without_credentials_in_the_output(
    s3_server: S3Server, s3_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = _s3_checkpoint(s3_server, s3_bucket)
    args = [uri, "--s3-endpoint-url", s3_server.endpoint_url, "--s3-expected-owner", "111122223333"]
    for extra in ([], ["--json"]):
        code, out, err = run([*args, *extra], capsys)
        assert code == ExitCode.STORAGE
        assert "not owned by the expected owner" in out + err
        assert FAKE_ACCESS_KEY_ID not in out + err and FAKE_SECRET_ACCESS_KEY not in out + err
    assert json.loads(out)["error"]["code"] == "StorageAuthError"


def test_a_missing_s3_bucket_exits_5(s3_server: S3Server, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["s3://resilrun-no-such-bucket/x", "--s3-endpoint-url", s3_server.endpoint_url], capsys)
    assert code == ExitCode.STORAGE
    assert "NoSuchBucket" in err and "resilrun: hint:" in err
