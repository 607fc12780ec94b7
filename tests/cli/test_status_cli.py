"""``resilrun status``: read-only against a real TCPStore, text, JSON, watch, and a dead endpoint."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from resilrun import keys
from resilrun.cli import _status_render as view
from resilrun.cli.status import normalize_argv
from resilrun.errors import ExitCode
from resilrun.job_secret import external_secret
from resilrun.rendezvous.api import RendezvousBackend
from resilrun.rendezvous.c10d import C10dBackend, host_store
from resilrun.rendezvous.sealed import SealedBackend, store_key
from tests.cli.test_cli import invoke
from tests.conftest import free_port
from tests.unit.test_status_view import RUN, job, status

SECRET_TEXT = "status-test-secret-" + "s" * 16
UNVERIFIED = {"verified": False, "refused": [], "replayed": []}


def sealed(backend: RendezvousBackend) -> SealedBackend:
    """The backend as the job's agents write to it: every document sealed under the job secret."""
    secret = external_secret(None, {"RESILRUN_JOB_SECRET": SECRET_TEXT})
    assert secret is not None
    return SealedBackend(backend, store_key(secret))


@pytest.fixture
def store() -> Iterator[tuple[SealedBackend, int]]:
    """A TCPStore hosted by the test (as a job's agent would), holding a 2-node job's records."""
    server = host_store("127.0.0.1", 0, timedelta(seconds=10))
    backend = sealed(C10dBackend(server, f"127.0.0.1:{server.port}"))
    job(backend, lost_round=None)  # type: ignore[arg-type]  # any RendezvousBackend
    yield backend, server.port


def test_an_unreachable_endpoint_is_one_error_line_with_a_hint_and_exit_3_fast(
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = free_port()
    started = time.monotonic()
    result = invoke(capsys, "status", "--rdzv-endpoint", f"127.0.0.1:{port}")
    assert time.monotonic() - started < 5
    assert result.code == ExitCode.RENDEZVOUS == 3
    lines = result.err.strip().splitlines()
    assert lines[0] == f"resilrun: error: nothing listens at 127.0.0.1:{port} (connection refused)"
    assert lines[1].startswith("resilrun: hint: ") and len(lines) == 2
    assert result.out == ""
    # and status never hosted a store there
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


def test_an_unreachable_endpoint_with_json_prints_the_error_document(capsys: pytest.CaptureFixture[str]) -> None:
    result = invoke(capsys, "status", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--json")
    assert result.code == 3
    error = json.loads(result.out)["error"]
    assert error["code"] == "StoreConnectionError" and "connection refused" in error["message"] and error["hint"]


def test_a_silent_host_fails_within_the_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    # A listening socket that never accepts: the connect completes, the store handshake never does.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        started = time.monotonic()
        result = invoke(capsys, "status", "--rdzv-endpoint", f"127.0.0.1:{silent.getsockname()[1]}", "--timeout", "1")
        assert time.monotonic() - started < 8
    assert result.code == 3 and "resilrun: error:" in result.err and "Traceback" not in result.err


def test_a_store_that_goes_away_after_the_probe_fails_within_the_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    # The job ends between status's probe and its store client's connect: the port is refused from
    # then on, and TCPStore's own connect would retry it with back-off well past the timeout.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def end_after_the_probe() -> None:
        probe, _ = listener.accept()
        probe.close()
        listener.close()

    ending = threading.Thread(target=end_after_the_probe, daemon=True)
    ending.start()
    started = time.monotonic()
    result = invoke(capsys, "status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "4")
    elapsed = time.monotonic() - started
    ending.join(5)
    assert elapsed < 5.5, f"status took {elapsed:.1f} s with --timeout 4"
    assert result.code == 3 and "no rendezvous store answered there within 4 s" in result.err, result.err


def test_json_is_the_composed_document_of_the_newest_job(
    capsys: pytest.CaptureFixture[str], store: tuple[SealedBackend, int]
) -> None:
    backend, port = store
    result = invoke(capsys, "status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--json")
    assert result.code == 0, result.err
    doc = json.loads(result.out)["data"]
    assert doc == {**status(backend), "endpoint": f"127.0.0.1:{port}"}  # type: ignore[arg-type]
    assert doc["store"] == UNVERIFIED
    assert doc["run_id"] == RUN and [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3]


def test_text_output_off_a_terminal_is_plain_tables(
    capsys: pytest.CaptureFixture[str], store: tuple[SealedBackend, int]
) -> None:
    _, port = store
    result = invoke(capsys, "status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RUN)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].startswith(f"job {RUN}: running, round 1, 2 node(s), world size 4, step 20")
    assert "NODES" in lines and "RANKS" in lines and "HISTORY" in lines
    assert "\x1b[" not in result.out and "┃" not in result.out
    history = lines[lines.index("HISTORY") + 2]
    assert "recovery" in history and "0.63s" in history and "steps redone 0" in history


def test_with_the_job_secret_documents_are_verified_and_a_forged_one_is_refused_and_named(
    capsys: pytest.CaptureFixture[str],
    store: tuple[SealedBackend, int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend, port = store
    secret_file = tmp_path / "job.secret"
    secret_file.write_text(SECRET_TEXT)
    secret_file.chmod(0o600)
    monkeypatch.delenv("RESILRUN_JOB_SECRET", raising=False)
    argv = ["status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RUN, "--job-secret-file", str(secret_file)]
    # Given a party with access to the store but not the secret, who writes a status for node b
    forged = keys.node_status(RUN, "b")
    backend.inner.set(forged, json.dumps({"state": "failed", "host": "attacker", "ranks": []}).encode())
    # Then status with the secret verifies the rest, refuses it and names it
    result = invoke(capsys, *argv, "--json")
    assert result.code == 0, result.err
    doc = json.loads(result.out)["data"]
    assert doc["store"] == {"verified": True, "refused": [forged], "replayed": []}
    assert all(node["host"] != "attacker" for node in doc["nodes"])
    text = invoke(capsys, *argv).out.splitlines()
    assert text[2] == f"store documents: verified; 1 refused (no valid MAC: forged): {forged}"
    # and without the secret it says the documents were not verified
    unverified = invoke(capsys, "status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RUN).out.splitlines()
    assert unverified[2].startswith("store documents: not verified")


def test_an_unknown_job_id_is_exit_3(capsys: pytest.CaptureFixture[str], store: tuple[SealedBackend, int]) -> None:
    _, port = store
    result = invoke(capsys, "status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "other")
    assert result.code == 3 and "no job 'other'" in result.err


def test_watch_with_json_prints_one_document_per_line_until_interrupted(
    capsys: pytest.CaptureFixture[str], store: tuple[SealedBackend, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, port = store
    ticks = iter([None])

    def sleep(seconds: float) -> None:
        assert seconds == 2.0
        if next(ticks, "stop") == "stop":
            raise KeyboardInterrupt

    monkeypatch.setattr("resilrun.cli.status.time.sleep", sleep)
    result = invoke(capsys, "status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--json", "--watch")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert len(lines) == 2 and all(json.loads(line)["data"]["run_id"] == RUN for line in lines)


def test_watch_without_a_value_means_every_two_seconds() -> None:
    assert normalize_argv(["status", "--watch"]) == ["status", "--watch", "2"]
    assert normalize_argv(["status", "--watch", "--json"]) == ["status", "--watch", "2", "--json"]
    assert normalize_argv(["status", "--watch", "5"]) == ["status", "--watch", "5"]
    assert normalize_argv(["run", "--watch"]) == ["run", "--watch"]


def test_the_rich_view_renders_every_section_with_health_colours() -> None:
    from rich.console import Console

    doc = {"schema": 1, "run_id": "r", "endpoint": "e", "backend": "c10d",
           "job": {"state": "degraded", "round": 2, "restarts": 1, "recoveries": 0, "nodes": 1, "world_size": 2,
                   "step": None, "newest_step": 3},
           "nodes": [{"node_rank": 1, "host": "h", "state": "lost", "round": 1, "heartbeat_age_s": 6.0, "ranks": [2],
                      "spares": {}, "tiers": {}}],
           "ranks": [], "spares": {"processes_ready": 0, "processes_alive": 0, "nodes": 0}, "snapshots": {},
           "history": [{"index": 1, "kind": "node_lost", "round": 1, "node_rank": 1, "host": "h",
                        "at": 1.0}]}  # fmt: skip
    console = Console(record=True, width=160, force_terminal=True)
    console.print(view.rich_view(doc))
    text = console.export_text()
    assert "job r: degraded" in text and "lost" in text and "node 1 (h) lost" in text
    assert view.colour("lost") == "red" and view.colour("running") == "green" and view.colour("recovering") == "yellow"
    assert "(no ranks running)" in view.text_lines(doc)


def test_status_reads_a_job_from_etcd_as_from_a_tcpstore(capsys: pytest.CaptureFixture[str], etcd_server: Any) -> None:
    from resilrun.rendezvous.etcd import open_etcd

    backend = open_etcd(etcd_server.endpoint, timeout=timedelta(seconds=5))
    run_id = f"etcd-{uuid.uuid4().hex[:8]}"  # the session's etcd is shared: a fresh job id
    try:
        job(sealed(backend), run_id=run_id)  # type: ignore[arg-type]  # any RendezvousBackend
        argv = ["status", "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id]
        result = invoke(capsys, *argv, "--json")
        assert result.code == 0, result.err
        doc = json.loads(result.out)["data"]
        assert doc["backend"] == "etcd" and doc["run_id"] == run_id
        assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3] and doc["history"][0]["complete"]
    finally:
        backend.close()


def test_an_unreachable_etcd_is_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    result = invoke(capsys, "status", "--rdzv-backend", "etcd", "--rdzv-endpoint", f"127.0.0.1:{free_port()}")
    assert result.code == 3 and result.err.startswith("resilrun: error: ")
