"""Which worker exceptions may wait for the agent's verdict: by type only, never by text."""

from __future__ import annotations

import torch
import torch.distributed as dist

from resilrun.worker_main import _may_be_a_broken_collective


def test_what_a_broken_collective_raises_waits_for_the_agents_verdict() -> None:
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    assert _may_be_a_broken_collective(gloo)
    assert _may_be_a_broken_collective(dist.DistBackendError("NCCL communicator was aborted on rank 1"))
    # The text does not decide: a rank's own NCCL or CUDA error is a RuntimeError too, and the agent
    # tells it from a survivor's by what the job knows (tests/unit/test_control.py, integration tests)
    assert _may_be_a_broken_collective(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert _may_be_a_broken_collective(RuntimeError("injected fault at step 4 on rank 1"))


def test_a_broken_collective_wrapped_by_user_code_still_waits() -> None:
    try:
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as exc:
            raise ValueError("training step failed") from exc
    except ValueError as wrapped:
        assert _may_be_a_broken_collective(wrapped)


def test_errors_no_collective_raises_exit_at_once() -> None:
    assert not _may_be_a_broken_collective(ValueError("bad batch at step 5"))
    assert not _may_be_a_broken_collective(KeyError("loss"))
    assert not _may_be_a_broken_collective(torch.OutOfMemoryError("CUDA out of memory"))


def test_error_files_of_two_ranks_failing_in_one_second_order_them(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # The root cause is the earliest failure: whole seconds would tie two ranks failing together
    from types import SimpleNamespace

    from resilrun.agent.workers.failures import collect_failure, root_cause
    from resilrun.worker_main import write_error_file

    # The wall clock as each rank reads it when it writes its error file: the same whole second
    wall = iter((1_700_000_000.25, 1_700_000_000.75))
    monkeypatch.setattr("resilrun.worker_main.time", SimpleNamespace(time=lambda: next(wall)))
    failures = []
    for rank in (1, 0):  # rank 1 fails first, rank 0 (its peer) right after
        path = tmp_path / f"rank_{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        write_error_file(RuntimeError(f"rank {rank}"))
        failures.append(collect_failure(global_rank=rank, local_rank=rank, node_rank=0, pid=rank, exit_code=1,
                                        observed_at=0.0, error_file=path))  # fmt: skip
    cause = root_cause(sorted(failures, key=lambda f: f.global_rank))
    assert cause is not None and cause.global_rank == 1


def test_the_worker_library_imports_nothing_of_the_layers_above_it() -> None:
    # worker/ is built on by integrations/ and driven by the entry point: an import back up would
    # make importing the worker library load a framework integration (or the entry point) too.
    import ast
    from pathlib import Path

    import resilrun.worker

    above = ("resilrun.integrations", "resilrun.worker_main", "resilrun.agent", "resilrun.cli")
    found = []
    for path in Path(resilrun.worker.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):  # ``from resilrun import integrations`` too
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            found += [f"{path.name}: {name}" for name in names if name.startswith(above)]
    assert found == []
