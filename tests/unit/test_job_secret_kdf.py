"""The job secret's text is stretched by a memory-hard KDF (issue 43, F12): whoever reads the sealed
store documents (or a persisted step's MACs) can test guesses of the text offline, and scrypt makes
each guess cost what one derivation costs an agent at start, once."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from resilrun import job_secret
from resilrun.errors import ConfigError
from resilrun.job_secret import SECRET_ENV, external_secret


def _text() -> str:
    return f"a secret of enough characters {uuid.uuid4().hex}"  # (a fresh one: the derivation is cached)


def test_the_secret_is_derived_with_scrypt_at_the_stated_cost() -> None:
    text = _text()
    key = external_secret(None, {SECRET_ENV: text})
    assert key == hashlib.scrypt(
        text.encode(),
        salt=job_secret.KDF_SALT,
        n=job_secret.SCRYPT_N,
        r=job_secret.SCRYPT_R,
        p=job_secret.SCRYPT_P,
        maxmem=job_secret.SCRYPT_MAXMEM,
        dklen=32,
    )
    assert key != hashlib.sha256(b"resilrun job secret v1\0" + text.encode()).digest()  # not the old one hash
    # The cost the docstring states: N = 2**15, r = 8 (128 * r * N = 32 MiB of memory per guess).
    assert (job_secret.SCRYPT_N, job_secret.SCRYPT_R, job_secret.SCRYPT_P) == (1 << 15, 8, 1)
    assert 128 * job_secret.SCRYPT_R * job_secret.SCRYPT_N <= job_secret.SCRYPT_MAXMEM <= 64 * 2**20
    assert "N = 2**15" in (job_secret.__doc__ or "") + (external_secret.__doc__ or "")


def test_the_derivation_runs_once_per_process_per_text(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bytes] = []
    real = hashlib.scrypt

    def counting(password: bytes, **kwargs: int | bytes) -> bytes:
        calls.append(password)
        return real(password, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(job_secret.hashlib, "scrypt", counting)
    text = _text()
    first = external_secret(None, {SECRET_ENV: text})
    assert external_secret(None, {SECRET_ENV: text + "\n"}) == first  # (the agent reads it twice at start)
    assert len(calls) == 1


def test_the_minimum_length_is_still_enforced() -> None:
    with pytest.raises(ConfigError, match="has 15 characters; at least 16"):
        external_secret(None, {SECRET_ENV: "x" * 15})
