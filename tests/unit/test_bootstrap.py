"""Which worker exceptions may wait for the agent's verdict: by type only, never by text."""

from __future__ import annotations

import torch
import torch.distributed as dist

from resilrun.worker._bootstrap import _may_be_a_broken_collective


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
