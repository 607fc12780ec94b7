"""etcd's TLS and user from ``--rdzv-conf`` (config.py, rendezvous/factory.py): parsed, checked, and
refused with one line where they cannot work."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from resilrun.config import Config
from resilrun.errors import ConfigError, ExitCode
from resilrun.option_values import parse_rdzv_conf
from resilrun.rendezvous import factory
from resilrun.rendezvous.factory import ETCD_PASSWORD_ENV, etcd_security, open_backend


def test_the_etcd_keys_are_parsed_and_the_rest_stay_as_they_were() -> None:
    conf = parse_rdzv_conf("ca_file=/c/ca.pem,cert_file=/c/me.pem,key_file=/c/me.key,user=trainer,join_timeout=5")
    given = (conf.ca_file, conf.cert_file, conf.key_file, conf.user)
    assert given == ("/c/ca.pem", "/c/me.pem", "/c/me.key", "trainer")
    assert conf.join_timeout_s == 5 and conf.etcd_security_keys() == ["ca_file", "cert_file", "key_file", "user"]
    assert parse_rdzv_conf("").etcd_security_keys() == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("cert_file=/c/me.pem", "cert_file and key_file go together"),
        ("key_file=/c/me.key", "cert_file and key_file go together"),
        ("password_file=/c/pw", "password_file needs user"),
        ("ca_file=", "ca_file is empty"),
    ],
)
def test_incomplete_etcd_keys_are_one_line_errors(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_rdzv_conf(value)


def test_the_password_comes_from_a_private_file_or_the_environment(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    secret.chmod(0o600)
    security = etcd_security(parse_rdzv_conf(f"user=trainer,password_file={secret}"), {ETCD_PASSWORD_ENV: "env"})
    assert security is not None and security.password == "from-file" and not security.tls
    security = etcd_security(parse_rdzv_conf("user=trainer,ca_file=/c/ca.pem"), {ETCD_PASSWORD_ENV: "from-env"})
    assert security is not None and security.password == "from-env" and security.tls
    assert "from-env" not in repr(security)  # never in a log line
    assert etcd_security(parse_rdzv_conf("join_timeout=5"), {}) is None


def test_a_user_without_a_password_or_with_a_lax_password_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="user=trainer without a password"):
        etcd_security(parse_rdzv_conf("user=trainer"), {})
    lax = tmp_path / "pw"
    lax.write_text("x\n")
    lax.chmod(0o644)
    with pytest.raises(ConfigError, match="can be read by others"):
        etcd_security(parse_rdzv_conf(f"user=trainer,password_file={lax}"), {})


def test_etcd_keys_on_the_c10d_backend_are_refused_before_anything_starts() -> None:
    config = Config(nproc_per_node="1", script="train.py", rdzv_conf="ca_file=/c/ca.pem")
    with pytest.raises(ConfigError, match="only for --rdzv-backend etcd"):
        open_backend(config)


# issue 43, F9: etcd's gateway takes the user's password in the body of an authenticate request, so
# over plain http anyone on the path reads it.


def test_a_user_and_password_without_tls_are_refused_under_require_auth() -> None:
    with pytest.raises(ConfigError, match="in clear") as caught:
        etcd_security(parse_rdzv_conf("user=trainer"), {ETCD_PASSWORD_ENV: "pw"}, require_auth=True)
    assert caught.value.hint is not None and "ca_file=" in caught.value.hint
    assert caught.value.exit_code == ExitCode.USAGE
    security = etcd_security(
        parse_rdzv_conf("user=trainer,ca_file=/c/ca.pem"), {ETCD_PASSWORD_ENV: "pw"}, require_auth=True
    )
    assert security is not None and security.tls  # with TLS, the same user is fine


def test_a_user_and_password_without_tls_are_warned_about_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(factory, "_warned_in_clear", False)  # once per process: earlier tests may have
    caplog.set_level(logging.WARNING, logger="resilrun.rendezvous.factory")
    for _ in range(2):
        security = etcd_security(parse_rdzv_conf("user=trainer"), {ETCD_PASSWORD_ENV: "pw"})
        assert security is not None and security.password == "pw"
    warnings = [r for r in caplog.records if "in clear" in r.getMessage()]
    assert len(warnings) == 1 and "ca_file" in warnings[0].getMessage()
    assert "pw" not in warnings[0].getMessage().replace("password", "")


def test_require_auth_reaches_the_etcd_check_before_anything_is_contacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ETCD_PASSWORD_ENV, "pw")
    config = Config(
        nproc_per_node="1",
        script="train.py",
        rdzv_backend="etcd",
        rdzv_endpoint="127.0.0.1:9",  # nothing listens: a check after connecting would fail differently
        rdzv_conf="user=trainer,read_timeout=2",
        require_auth=True,
    )
    with pytest.raises(ConfigError, match="in clear"):
        open_backend(config)
