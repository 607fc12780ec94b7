"""A restore hands modules views of node memory (one copy) but never lets anything keep them:
the slot is overwritten by a later commit, and an optimizer holding a view would change with it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from resilrun.snapshot.restore import Tier
from resilrun.worker.job import Job, Seat, _holdings


class _NodeMemory:
    """Stands in for the snapshotter: one slot, read back as views like the real one."""

    def __init__(self) -> None:
        self.slot = torch.empty(0)
        self.names: list[tuple[str, torch.dtype, torch.Size, int, int]] = []
        self.meta: Any = None

    def save(self, tensors: dict[str, torch.Tensor], meta: Any) -> None:
        flat = [t.detach().reshape(-1).view(torch.uint8) for t in tensors.values()]
        self.slot = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
        offset = 0
        self.names = []
        for (name, tensor), raw in zip(tensors.items(), flat, strict=True):
            self.names.append((name, tensor.dtype, tensor.shape, offset, offset + raw.numel()))
            offset += raw.numel()
        self.meta = meta

    def load(self, step: int) -> tuple[dict[str, torch.Tensor], Any]:
        views = {name: self.slot[a:b].view(dtype).view(shape) for name, dtype, shape, a, b in self.names}
        return views, self.meta


def _trained() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt, torch.arange(5.0)


def _job(memory: _NodeMemory, model: nn.Module, opt: torch.optim.Optimizer, extra: torch.Tensor) -> Job:
    job = Job(Seat(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), snapshotter=memory))  # type: ignore[arg-type]
    job.track(model=model, optimizer=opt, extra=extra, progress={"seen": 3})
    return job


def test_restored_state_survives_the_slot_being_overwritten() -> None:
    memory = _NodeMemory()
    model, opt, extra = _trained()
    source = _job(memory, model, opt, extra)
    memory.save(*source._collect())
    expected_params = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moments = [s["exp_avg"].clone() for s in opt.state.values()]

    torch.manual_seed(1)
    fresh_model = nn.Linear(8, 8)
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=0.1)
    fresh_extra = torch.zeros(5)
    target = _job(memory, fresh_model, fresh_opt, fresh_extra)
    loaded = target._load(memory, step=0)  # type: ignore[arg-type]
    memory.slot.fill_(0xFF)  # the next commit into this slot

    assert loaded == memory.slot.numel()
    assert all(torch.equal(fresh_model.state_dict()[k], v) for k, v in expected_params.items())
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(fresh_opt.state.values(), expected_moments, strict=True))
    assert torch.equal(fresh_extra, torch.arange(5.0))
    assert target["progress"] == {"seen": 3}
    slot = memory.slot.untyped_storage().data_ptr()
    kept = [*fresh_model.parameters(), *(t for s in fresh_opt.state.values() for t in s.values())]
    assert all(t.untyped_storage().data_ptr() != slot for t in kept)


def test_reentry_after_a_failed_group_setup_names_the_next_group_as_a_fresh_process_would() -> None:
    from torch.distributed import distributed_c10d

    from resilrun.worker import membership as job_module

    distributed_c10d._world.group_count = 1  # what an init_process_group that failed midway leaves
    try:
        job_module.reset_for_reentry()
        # The retried group is named "0", like the fresh spares' (its store keys are prefixed by it)
        assert distributed_c10d._world.group_count == 0
        assert job_module.is_active()  # a failure while joining the next generation is recovered too
    finally:
        distributed_c10d._world.group_count = 0
        job_module._TOOK_PART = False


def test_a_state_lost_error_says_what_each_rank_holds_when_no_step_is_common() -> None:
    memory = {Tier.MEMORY: frozenset({14, 15}), Tier.PEER: frozenset(), Tier.PERSISTENT: frozenset()}
    peer = {Tier.MEMORY: frozenset(), Tier.PEER: frozenset({16}), Tier.PERSISTENT: frozenset()}
    assert _holdings([memory, memory, peer, peer]) == "rank(s) 0-1: memory 14-15; rank(s) 2-3: peer 16"
