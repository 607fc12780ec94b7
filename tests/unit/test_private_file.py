"""A secret file is judged by the descriptor it is read from (issue 43, F8): checking one path and
reading another moment's file let a swap hand a world-readable file's text to the job."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from resilrun.errors import ConfigError
from resilrun.private_file import read_private


def _private(tmp_path: Path, text: str = "s3cret-s3cret-s3cret") -> Path:
    path = tmp_path / "secret"
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_a_symlink_is_judged_by_the_file_it_leads_to(tmp_path: Path) -> None:
    # Kubernetes mounts a Secret's file as a link into its ..data folder: it must work, and the
    # checks must apply to what is read, not to the link
    link = tmp_path / "link"
    link.symlink_to(_private(tmp_path))
    assert read_private(link, "--job-secret-file") == "s3cret-s3cret-s3cret"
    lax = tmp_path / "lax"
    lax.write_text("s3cret-s3cret-s3cret")
    lax.chmod(0o644)
    (tmp_path / "lax-link").symlink_to(lax)
    with pytest.raises(ConfigError, match=r"can be read by others \(mode 0644\)"):
        read_private(tmp_path / "lax-link", "--job-secret-file")


def test_the_checks_are_made_on_the_opened_file_not_on_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No stat by path at all: what is checked is what is read (a swap in between cannot matter)."""
    path = _private(tmp_path)
    by_path: list[str] = []

    def spy(real: Callable[..., object]) -> Callable[..., object]:
        def call(target: object, *args: object, **kwargs: object) -> object:
            if str(target) == str(path):
                by_path.append(real.__name__)
            return real(target, *args, **kwargs)

        return call

    monkeypatch.setattr(os, "stat", spy(os.stat))
    monkeypatch.setattr(os, "lstat", spy(os.lstat))
    monkeypatch.setattr(Path, "stat", spy(Path.stat))
    monkeypatch.setattr(Path, "read_text", spy(Path.read_text))
    assert read_private(path, "--job-secret-file") == "s3cret-s3cret-s3cret"
    assert by_path == []


def test_a_file_swapped_in_after_the_first_look_is_not_what_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race, made deterministic: right after the first look at the path (an open or a stat), a
    world-readable file takes its place; what is returned must still be the private file's text."""
    path = _private(tmp_path)
    lax = tmp_path / "lax"
    lax.write_text("everyone-can-read-this")
    lax.chmod(0o644)

    def then_swap(real: Callable[..., object]) -> Callable[..., object]:
        def call(target: object, *args: object, **kwargs: object) -> object:
            result = real(target, *args, **kwargs)
            if str(target) == str(path) and lax.exists():
                os.replace(lax, path)
            return result

        return call

    monkeypatch.setattr(os, "open", then_swap(os.open))
    monkeypatch.setattr(Path, "stat", then_swap(Path.stat))
    assert read_private(path, "--job-secret-file") == "s3cret-s3cret-s3cret"


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_private(fifo, "--job-secret-file")


def test_the_messages_stay_as_they_were(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        read_private(tmp_path / "nope", "--job-secret-file")
    with pytest.raises(ConfigError, match="not a regular file"):
        read_private(tmp_path, "--job-secret-file")
    lax = _private(tmp_path)
    lax.chmod(0o640)
    with pytest.raises(ConfigError, match=r"can be read by others \(mode 0640\)"):
        read_private(lax, "--job-secret-file")
