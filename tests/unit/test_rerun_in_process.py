"""The worker side of ``--rerun-in-process``: what a plain script's re-run forgets, what makes a
process refuse to re-run, and how the script's own ``init_process_group`` registers it."""

from __future__ import annotations

import json
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from resilrun import worker_main
from resilrun.worker import membership


def test_the_scripts_own_modules_are_imported_fresh_and_installed_packages_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "train_utils.py").write_text("STEPS = []\n")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("CACHE = {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import models  # type: ignore[import-not-found]
    import train_utils  # type: ignore[import-not-found]

    train_utils.STEPS.append(1)  # state of the failed run
    models.CACHE["group"] = object()

    dropped = worker_main._drop_script_modules(str(tmp_path))

    assert dropped == 2
    assert "train_utils" not in sys.modules and "models" not in sys.modules
    assert {"json", "torch", "resilrun.worker_main", "resilrun.worker.membership"} <= set(sys.modules)
    import train_utils as fresh  # type: ignore[import-not-found]

    assert fresh.STEPS == []
    assert json.dumps([]) == "[]"


def test_a_script_in_a_checkout_holding_its_venv_keeps_installed_packages_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = Path(worker_main.__file__).resolve().parents[1]  # the checkout: resilrun/ and .venv under it
    installed = {n for n in sys.modules if n.partition(".")[0] in ("resilrun", "torch", "pytest", "_pytest")}
    modules = dict(sys.modules)
    monkeypatch.setattr(sys, "modules", modules)  # dropped from a copy: this session's stay loaded

    worker_main._drop_script_modules(str(root))

    assert installed <= set(modules)
    assert "tests.unit.test_rerun_in_process" not in modules  # the checkout's own modules go


def test_a_non_daemon_thread_of_the_script_prevents_a_rerun() -> None:
    assert membership.rerun_blockers() == ""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="prefetcher", daemon=False)
    thread.start()
    try:
        reason = membership.rerun_blockers()
        assert "prefetcher" in reason and "non-daemon" in reason
    finally:
        stop.set()
        thread.join()
    assert membership.rerun_blockers() == ""


def test_a_refused_plain_worker_fails_the_torchrun_way(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.delenv("RESILRUN_AGENT_SOCKET", raising=False)
    monkeypatch.setattr(membership, "_JOB", None)
    monkeypatch.setattr(membership, "_TOOK_PART", True)  # even a spare that was given a rank
    monkeypatch.setattr(membership, "_RERUN_REFUSED", None)
    monkeypatch.setattr(membership, "_RERUN_WATCHDOG", None)

    assert membership.refuse_rerun("the script's non-daemon thread(s) prefetcher would keep running")

    assert not membership.is_active()
    assert "cannot re-run its script in-process: the script's non-daemon" in capsys.readouterr().err
    assert not membership.refuse_rerun("")  # nothing holds it any more (a later group setup)
    assert membership.is_active()


def test_the_scripts_init_process_group_registers_once_its_group_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    fake = types.ModuleType("fake_distributed")

    def init_process_group(backend: str, **kwargs: Any) -> str:
        calls.append(("init", backend, kwargs))
        return "group"

    fake.init_process_group = init_process_group  # type: ignore[attr-defined]
    monkeypatch.setattr(membership, "join_for_rerun", lambda before: calls.append(("join", type(before))))

    worker_main._wrap_init_process_group(fake)
    worker_main._wrap_init_process_group(fake)  # hooked twice (torch imported again): wrapped once

    assert fake.init_process_group("gloo", timeout=5) == "group"
    assert calls == [("init", "gloo", {"timeout": 5}), ("join", dict)]
    assert fake.init_process_group.__name__ == "init_process_group"


def test_a_registration_that_fails_leaves_the_script_running(
    monkeypatch: pytest.MonkeyPatch,
    capsys,  # noqa: ANN001
) -> None:
    fake = types.ModuleType("fake_distributed")
    fake.init_process_group = lambda *args, **kwargs: None  # type: ignore[attr-defined]

    def broken(before: dict[int, int]) -> None:
        raise ConnectionRefusedError("agent gone")

    monkeypatch.setattr(membership, "join_for_rerun", broken)
    worker_main._wrap_init_process_group(fake)
    fake.init_process_group("gloo")
    assert "cannot re-run the script in-process: ConnectionRefusedError: agent gone" in capsys.readouterr().err


@pytest.mark.parametrize("environ", [{"RESILRUN_SPARE": "1", "RESILRUN_AGENT_SOCKET": "/nowhere"}, {}])
def test_a_spares_warm_up_group_or_a_plain_python_run_is_not_registered(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str]
) -> None:
    for name in ("RESILRUN_SPARE", "RESILRUN_AGENT_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(membership, "_JOB", None)
    monkeypatch.setattr(membership, "_RERUN_WATCHDOG", None)

    def no_agent(*args: Any) -> None:
        raise AssertionError("the agent was asked")

    monkeypatch.setattr(membership, "AgentClient", no_agent)
    membership.join_for_rerun({})
    assert not membership.reruns_plain_script()


def test_a_spare_that_registers_as_a_plain_worker_is_not_held_to_the_first_step_allowance() -> None:
    from resilrun.agent.workers.control import WorkerControl

    now = [0.0]
    control = WorkerControl(monotonic=lambda: now[0])
    control.assign(7, {"RANK": "1"})  # a spare given the failed rank counts as on the API at first
    control.begin_generation([7])
    now[0] = 10.0
    assert control.first_step_pending_for(7) == 10.0
    control.register_rerun(7)  # its script set up its group: a plain script, which never reports steps
    assert control.first_step_pending_for(7) is None
    assert control.reruns([7]) and not control.uses_api([7])
    control.register_rerun(7, "CUDA graphs were captured")
    assert not control.reruns([7]) and control.first_step_pending_for(7) is None


def test_captured_cuda_graphs_prevent_a_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: CUDA in use and a graph object alive, as torch.cuda.graph() leaves one
    class CUDAGraph:
        pass

    monkeypatch.setattr(membership.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(membership.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(membership.torch.cuda, "CUDAGraph", CUDAGraph)
    assert membership.rerun_blockers() == ""
    graph = CUDAGraph()
    assert "CUDA graphs" in membership.rerun_blockers()
    del graph
