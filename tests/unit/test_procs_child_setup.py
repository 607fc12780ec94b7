"""Between fork and exec the child does no dlopen (issue 14, item 10): a thread of the agent may hold
the loader lock at fork time, and the child would wait on it forever. PR_SET_PDEATHSIG still holds."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from resilrun.agent.workers import procs
from resilrun.option_values import Std

# Runs in the worker, after exec (its own ctypes, untouched by the test's patch).
_PRINT_PDEATHSIG = (
    "import ctypes; v = ctypes.c_int(-1); "
    "ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(v)); print(v.value)"  # 2: PR_GET_PDEATHSIG
)


def test_the_child_sets_pdeathsig_without_loading_a_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent_pid = os.getpid()
    real_cdll = ctypes.CDLL
    loads_in_parent: list[Any] = []

    def guarded_cdll(*args: Any, **kwargs: Any) -> Any:
        if os.getpid() != agent_pid:  # in the forked child: a raise here fails Popen with SubprocessError
            raise RuntimeError("dlopen between fork and exec")
        loads_in_parent.append(args)
        return real_cdll(*args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", guarded_cdll)
    spec = procs.WorkerSpec(
        local_rank=0,
        global_rank=0,
        argv=(sys.executable, "-c", _PRINT_PDEATHSIG),
        env=dict(os.environ),
        log_dir=tmp_path,
        to_file=Std.OUT,
        to_console=Std.NONE,
    )
    first = procs.spawn(spec)
    assert first.popen.wait(60) == 0
    procs.stop([first], signal.SIGKILL, 0.0)
    second = procs.spawn(spec)  # libc is resolved once per agent, not per spawn
    assert second.popen.wait(60) == 0
    procs.stop([second], signal.SIGKILL, 0.0)
    assert (tmp_path / "stdout.log").read_text().split() == [str(int(signal.SIGKILL))]
    assert len(loads_in_parent) <= 1
