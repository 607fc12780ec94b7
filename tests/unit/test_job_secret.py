"""Where the job secret comes from (job_secret.py): a private file, the environment, or none."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resilrun.config import Config
from resilrun.env import agent_secrets
from resilrun.errors import ConfigError
from resilrun.job_secret import SECRET_ENV, choose_secret, external_secret, random_secret

TEXT = "0123456789abcdef0123456789abcdef"


def _file(tmp_path: Path, text: str = TEXT, mode: int = 0o600) -> Path:
    path = tmp_path / "job.secret"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def test_a_private_file_gives_a_32_byte_key_and_the_same_text_the_same_key(tmp_path: Path) -> None:
    key = external_secret(str(_file(tmp_path)), {})
    assert key is not None and len(key) == 32
    # every node reading the same text (a trailing newline or not) derives the same key
    assert external_secret(None, {SECRET_ENV: TEXT}) == key
    assert external_secret(None, {SECRET_ENV: TEXT[:-1] + "0"}) != key
    assert key != TEXT.encode()[:32]  # the text is hashed, not used as is


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o601])
def test_a_file_others_can_read_is_refused_with_the_mode_and_the_fix(tmp_path: Path, mode: int) -> None:
    path = _file(tmp_path, mode=mode)
    with pytest.raises(ConfigError) as caught:
        external_secret(str(path), {})
    assert f"mode {mode:04o}" in caught.value.message and "can be read by others" in caught.value.message
    assert caught.value.hint is not None and f"chmod 600 {path}" in caught.value.hint


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = _file(tmp_path)
    os.chown(path, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        external_secret(str(path), {})


def test_a_missing_file_a_directory_and_a_short_secret_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as caught:
        external_secret(str(tmp_path / "nope"), {})
    assert caught.value.hint is not None and "openssl rand -hex 32" in caught.value.hint
    with pytest.raises(ConfigError, match="not a regular file"):
        external_secret(str(tmp_path), {})
    with pytest.raises(ConfigError, match="has 5 characters; at least 16"):
        external_secret(str(_file(tmp_path, "short")), {})
    with pytest.raises(ConfigError, match=f"{SECRET_ENV} has 3 characters"):
        external_secret(None, {SECRET_ENV: "abc"})


def test_the_file_wins_over_the_environment_and_nothing_given_is_none(tmp_path: Path) -> None:
    assert external_secret(str(_file(tmp_path)), {SECRET_ENV: "x" * 20}) == external_secret(None, {SECRET_ENV: TEXT})
    assert external_secret(None, {}) is None
    assert external_secret(None, {SECRET_ENV: ""}) is None


def _job_secret(config: Config, max_nodes: int) -> bytes | None:
    """The agent's choice, from the secret outside the store as the agent reads it."""
    outside = external_secret(config.job_secret_file, agent_secrets())
    return choose_secret(
        outside, max_nodes=max_nodes, require_auth=config.require_auth, persistent=bool(config.checkpoint_uri)
    )


def _config(*, nnodes: str, require_auth: bool = False, secret_file: str | None = None) -> Config:
    endpoint = {} if nnodes == "1" else {"rdzv_endpoint": "head:29400"}
    return Config.from_cli(
        nnodes=nnodes, script=__file__, require_auth=require_auth, job_secret_file=secret_file, **endpoint
    )


def test_a_multi_node_job_without_a_secret_keeps_it_in_the_store_unless_auth_is_required(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert _job_secret(_config(nnodes="2"), 2) is None  # the first agent keeps one in the store (and says so)
    with pytest.raises(ConfigError, match="--require-auth: no job secret given") as caught:
        _job_secret(_config(nnodes="2", require_auth=True), 2)
    assert caught.value.hint is not None and "--job-secret-file" in caught.value.hint
    given = _job_secret(_config(nnodes="2", require_auth=True, secret_file=str(_file(tmp_path))), 2)
    assert given == external_secret(str(_file(tmp_path)), {})


def test_a_single_node_job_gets_a_random_secret_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    first = _job_secret(_config(nnodes="1", require_auth=True), 1)
    assert first is not None and len(first) == 32 and first != _job_secret(_config(nnodes="1"), 1)
    assert len(random_secret()) == 32
