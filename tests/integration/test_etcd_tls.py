"""The etcd backend against a real etcd with TLS and authentication on (issue 19).

Certificates come from a throwaway CA the test makes (tests/helpers/tls_certs.py). Two set-ups, as
etcd's gateway allows them: mutual TLS (etcd asks every client for a certificate its CA signed),
and TLS with etcd's users (a user allowed the ``resilrun/`` key prefix, its password in a private
file). In each a job trains across two agents, ``resilrun status`` reads it, and a node without the
credential stops at once with one line saying why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import _require_etcd
from tests.etcd_server import EtcdCluster
from tests.helpers.tls_certs import make_certs
from tests.integration.conftest import TRAIN_TINY, run_resilrun

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture
def cluster_with(tmp_path: Path) -> Any:
    started: list[EtcdCluster] = []

    def start(*, client_cert_auth: bool) -> tuple[EtcdCluster, Any]:
        _require_etcd()
        certs = make_certs(tmp_path / "certs")
        cluster = EtcdCluster(tmp_path / "etcd", tls=certs, client_cert_auth=client_cert_auth).start()
        started.append(cluster)
        return cluster, certs

    yield start
    for cluster in started:
        cluster.stop()


def _job(launcher: Any, endpoint: str, run_id: str, conf: str, out: Path) -> list[Any]:
    args = [
        "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", conf,
        "--nnodes", "2", "--nproc-per-node", "1", str(TRAIN_TINY), "--out", str(out), "--steps", "5",
    ]  # fmt: skip
    return [launcher("resilrun", *args) for _ in range(2)]


def _status(endpoint: str, run_id: str, conf: str) -> dict[str, Any]:
    args = ["status", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", conf]
    done = run_resilrun(*args, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)["data"]


def _refused_at_once(launcher: Any, endpoint: str, conf: str) -> str:
    args = ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-conf", conf, "--nnodes", "2"]
    node = launcher("resilrun", *args, str(TRAIN_TINY), "--out", "unused")
    assert node.wait(60) == 3, node.stderr()[-3000:]
    err = node.stderr()
    assert "Traceback" not in err and err.count("resilrun: error:") == 1
    return err


def test_a_job_runs_on_etcd_with_mutual_tls_and_a_node_without_a_certificate_is_refused(
    launcher: Any, cluster_with: Any, tmp_path: Path
) -> None:
    # Given an etcd that speaks https only and asks every client for a certificate its CA signed
    cluster, certs = cluster_with(client_cert_auth=True)
    conf = f"ca_file={certs.ca},cert_file={certs.client_cert},key_file={certs.client_key}"
    # Then a job whose nodes have a client certificate trains to the end, and status reads it
    nodes = _job(launcher, cluster.endpoint, "etcd-mtls", conf, tmp_path / "out")
    for node in nodes:
        assert node.wait(120) == 0, node.stderr()[-3000:]
    assert len({(tmp_path / "out" / f"checksum_rank{r}").read_text() for r in range(2)}) == 1
    assert _status(cluster.endpoint, "etcd-mtls", conf)["job"]["state"] == "succeeded"
    # and a node without one, or one that does not know etcd's CA, stops at once saying why
    _refused_at_once(launcher, cluster.endpoint, f"ca_file={certs.ca}")
    err = _refused_at_once(launcher, cluster.endpoint, f"cert_file={certs.client_cert},key_file={certs.client_key}")
    assert "TLS with etcd" in err and "ca_file" in err


def test_a_job_runs_on_etcd_with_tls_and_a_user_and_a_wrong_password_is_one_line(
    launcher: Any, cluster_with: Any, tmp_path: Path
) -> None:
    # Given an etcd over https with authentication on, and a user allowed the resilrun/ keys only
    cluster, certs = cluster_with(client_cert_auth=False)
    cluster.enable_auth("trainer", "trainer-password", "resilrun/")
    password = tmp_path / "etcd.password"
    password.write_text("trainer-password\n")
    password.chmod(0o600)
    conf = f"ca_file={certs.ca},user=trainer,password_file={password}"
    # Then a job with the user's password trains to the end, and status reads it
    nodes = _job(launcher, cluster.endpoint, "etcd-auth", conf, tmp_path / "out")
    for node in nodes:
        assert node.wait(120) == 0, node.stderr()[-3000:]
    assert _status(cluster.endpoint, "etcd-auth", conf)["job"]["state"] == "succeeded"
    # and a wrong password is one line naming the user, at once
    wrong = tmp_path / "wrong.password"
    wrong.write_text("guess\n")
    wrong.chmod(0o600)
    err = _refused_at_once(launcher, cluster.endpoint, f"ca_file={certs.ca},user=trainer,password_file={wrong}")
    assert "refused user 'trainer': wrong user or password" in err
    # and a password file others can read is refused before anything is asked of etcd
    lax = tmp_path / "lax.password"
    lax.write_text("trainer-password\n")
    lax.chmod(0o644)
    args = ["--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoint, "--nnodes", "2"]
    node = launcher("resilrun", *args, "--rdzv-conf", f"ca_file={certs.ca},user=trainer,password_file={lax}",
                    str(TRAIN_TINY), "--out", "unused")  # fmt: skip
    assert node.wait(60) == 2
    assert "can be read by others (mode 0644)" in node.stderr()
