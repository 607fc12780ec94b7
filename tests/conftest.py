"""Shared fixtures: a clean environment for every test and free loopback ports."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

_STRIP_PREFIXES = ("RESILRUN_", "PET_", "TORCHELASTIC_")
_STRIP_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tests never inherit a launcher's variables from the shell that runs them."""
    for name in list(os.environ):
        if name.startswith(_STRIP_PREFIXES) or name in _STRIP_NAMES:
            monkeypatch.delenv(name, raising=False)
    yield


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def port() -> int:
    return free_port()
