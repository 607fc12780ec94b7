"""``resilrun inspect-checkpoint`` on a checkpoint holding files a script saved itself under
``--capture-dir``: listed after the steps, their MACs checked with the job secret, their bytes with
``--verify``, a forged or corrupt one reported by name with exit code 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilrun.errors import ExitCode
from resilrun.job_secret import external_secret
from resilrun.storage import LocalStorage
from resilrun.tiers.authentic import durable_key
from resilrun.tiers.captured import durable
from resilrun.tiers.captured.catalog import FileVersion, digest
from tests.cli.test_inspect_checkpoint import run, write_checkpoint
from tests.helpers.forgery import pickle_payload

CAPTURED_AT_NS = 1_796_000_000_123_000_000
NODE = "host0:4242:ab12cd"
SNAPSHOT = b"PK\x03\x04" + b"s" * 3000  # what the job wrote (not a real zip: nothing here loads it)
EPOCH = b"e" * 100


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.secret"
    path.write_text("a job secret of enough characters")
    path.chmod(0o600)
    return path


def key_of(secret_file: Path, root: Path) -> bytes:
    secret = external_secret(str(secret_file), {})
    assert secret is not None
    return durable_key(secret, str(root))


def put(root: Path, path: str, data: bytes, mac_key: bytes | None) -> FileVersion:
    """A captured file as an agent's ship thread uploads it."""
    version = FileVersion(path, len(data), digest(data), CAPTURED_AT_NS, CAPTURED_AT_NS, NODE)
    durable.write(LocalStorage(root), version, data, mac_key)
    return version


def job_files(root: Path, secret_file: Path) -> None:
    """What a job run with the secret captured, signed; nothing else."""
    key = key_of(secret_file, root)
    put(root, "snapshot.pt", SNAPSHOT, key)
    put(root, "ckpt/epoch_2.pt", EPOCH, key)


def planted(root: Path, tmp_path: Path) -> None:
    """A bucket writer's additions: an unsigned pickle, and one signed under another job's secret."""
    put(root, "planted.pt", pickle_payload(tmp_path / "marker"), None)
    put(root, "forged.pt", b"f" * 10, durable_key(b"another job's secret, long enough", str(root)))


def test_the_captured_files_are_listed_after_the_steps(
    tmp_path: Path, secret_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    write_checkpoint(LocalStorage(root))
    job_files(root, secret_file)
    put(root, "planted.pt", b"p" * 5, None)
    code, out, err = run([str(root)], capsys)
    assert code == ExitCode.OK, err
    lines = out.splitlines()
    start = lines.index("Captured files (3, saved by the script itself under --capture-dir)")
    assert lines[start - 2].startswith("total: 2 rank(s)")  # after the selected step
    assert lines[start + 1].split() == ["PATH", "BYTES", "SHA256", "CAPTURED", "NODE", "CHECK"]
    rows = {line.split()[0]: line.split() for line in lines[start + 2 : start + 5]}
    assert list(rows) == ["ckpt/epoch_2.pt", "planted.pt", "snapshot.pt"]  # by path
    assert rows["snapshot.pt"][1:4] == ["2.9", "KiB", digest(SNAPSHOT)[:12]]
    assert rows["snapshot.pt"][6:] == [NODE, "signed"]
    assert rows["planted.pt"][-1] == "unsigned"
    assert "MACs not checked: give the run's --job-secret-file" in lines[start + 5]
    assert "Traceback" not in err and err == ""


def test_a_checkpoint_of_captured_files_only_is_not_an_error_and_its_json_lists_them(
    tmp_path: Path, secret_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    job_files(root, secret_file)
    code, out, _ = run([str(root)], capsys)
    assert code == ExitCode.OK
    assert "no steps (nothing saved through resilrun.init/track)" in out and "Captured files (2," in out
    code, out, _ = run([str(root), "--json"], capsys)
    assert code == ExitCode.OK
    data = json.loads(out)["data"]
    assert (data["steps"], data["latest_complete_step"], data["selected"]) == ([], None, None)
    assert data["captured"][1] == {
        "path": "snapshot.pt",
        "bytes": len(SNAPSHOT),
        "sha256": digest(SNAPSHOT),
        "captured_at": 1_796_000_000.123,
        "node": NODE,
        "signed": True,
        "authentic": None,  # no secret given: not checked
        "verified": None,  # no --verify
        "problem": None,
    }
    # a step asked for is still an error, which says there are none
    code, _, err = run([str(root), "--step", "5"], capsys)
    assert code == ExitCode.CHECKPOINT and "step 5 is not in" in err and "captured files only" in err


def test_an_empty_directory_is_still_no_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ckpt" / "captured" / "index").mkdir(parents=True)
    code, _, err = run([str(tmp_path / "ckpt")], capsys)
    assert code == ExitCode.CHECKPOINT and "no checkpoint under" in err


def test_with_the_job_secret_each_file_is_authentic_or_not_and_a_forged_one_fails_the_check(
    tmp_path: Path, secret_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    job_files(root, secret_file)
    put(root, "planted.pt", pickle_payload(tmp_path / "marker"), None)
    # Given the job's files and an unsigned one: the unsigned one is said, and is no failure
    code, out, err = run([str(root), "--job-secret-file", str(secret_file)], capsys)
    assert code == ExitCode.OK, err
    checks = {line.split()[0]: line.split("  ")[-1] for line in out.splitlines() if line.startswith("  ")}
    assert checks["snapshot.pt"] == "authentic, bytes verified"  # the secret implies --verify
    assert checks["planted.pt"] == "NOT authentic (unsigned), bytes verified"
    # When a file signed under another job's secret is planted too
    planted(root, tmp_path)
    code, out, err = run([str(root), "--job-secret-file", str(secret_file)], capsys)
    assert code == ExitCode.CHECKPOINT
    assert "forged.pt  " in out and "NOT authentic (MAC does not verify), bytes verified" in out
    assert "  forged.pt: its MAC does not verify under the job secret" in out
    assert err.splitlines()[0] == "resilrun: error: 1 captured file(s) failed their check: forged.pt"
    code, out, _ = run([str(root), "--job-secret-file", str(secret_file), "--json"], capsys)
    assert code == ExitCode.CHECKPOINT
    captured = {c["path"]: c for c in json.loads(out)["data"]["captured"]}
    assert {p: (c["signed"], c["authentic"]) for p, c in captured.items()} == {
        "ckpt/epoch_2.pt": (True, True),
        "forged.pt": (True, False),
        "planted.pt": (False, False),
        "snapshot.pt": (True, True),
    }
    assert captured["planted.pt"]["problem"] == "unsigned"
    assert not (tmp_path / "marker").exists()  # nothing was unpickled


def test_verify_checks_each_files_bytes_and_names_those_that_differ_or_are_gone(
    tmp_path: Path, secret_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    job_files(root, secret_file)
    code, out, err = run([str(root), "--verify"], capsys)
    assert code == ExitCode.OK, err
    assert out.count("signed, bytes verified") == 2
    # When the bytes of one are overwritten in the bucket and those of another are deleted
    (root / durable.data_key(digest(SNAPSHOT))).write_bytes(SNAPSHOT[:-1] + b"!")
    (root / durable.data_key(digest(EPOCH))).unlink()
    code, out, err = run([str(root), "--verify"], capsys)
    assert code == ExitCode.CHECKPOINT
    assert "snapshot.pt: captured file snapshot.pt in the persistent tier differs from its index" in out
    assert "ckpt/epoch_2.pt: captured file ckpt/epoch_2.pt is gone from the persistent tier" in out
    assert "2 captured file(s) failed their check: ckpt/epoch_2.pt, snapshot.pt" in err
    code, out, _ = run([str(root), "--verify", "--json"], capsys)
    assert code == ExitCode.CHECKPOINT
    assert [c["verified"] for c in json.loads(out)["data"]["captured"]] == [False, False]
    # without --verify only the indexes are read: the listing is still fine
    assert run([str(root)], capsys)[0] == ExitCode.OK
