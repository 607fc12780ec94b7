"""Which worker exceptions wait for the job's next generation: broken collectives only."""

from __future__ import annotations

import torch.distributed as dist

from resilrun.worker._bootstrap import _peer_failure


def test_a_broken_collective_is_a_peer_failure() -> None:
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    assert _peer_failure(gloo)
    assert _peer_failure(RuntimeError("Read error [127.0.0.1]:5: Connection reset by peer"))
    assert _peer_failure(dist.DistBackendError("NCCL communicator was aborted on rank 1"))


def test_a_peer_failure_wrapped_by_user_code_is_still_seen() -> None:
    try:
        try:
            raise RuntimeError("gloo: Connection closed by peer")
        except RuntimeError as exc:
            raise ValueError("training step failed") from exc
    except ValueError as wrapped:
        assert _peer_failure(wrapped)


def test_the_ranks_own_errors_are_not_peer_failures() -> None:
    assert not _peer_failure(ValueError("bad batch at step 5"))
    assert not _peer_failure(RuntimeError("injected fault at step 4 on rank 1"))
    assert not _peer_failure(RuntimeError("CUDA out of memory"))
    assert not _peer_failure(KeyError("loss"))
