"""DDP's start-up broadcast, deferred under resilrun: skipped when a restore overwrites every
parameter, run (same result as torch's own) on a fresh start or at the first forward otherwise.

Two real gloo processes on loopback; rank 1 starts from different weights than rank 0, so a
broadcast that did not happen shows as differing parameters. The patch's scope (installed, then
undone when the process leaves its generation) is checked in this process, on one rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from resilrun.worker import _ddp_sync


def _model(rank: int) -> nn.Module:
    torch.manual_seed(rank)  # different weights per rank: only a broadcast makes them equal
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(float(rank))
    return model


SCENARIOS = ("fresh", "partial", "forward", "restored", "explicit")


def _scenarios(rank: int, out: str) -> None:
    # A file store, not a port: nothing another test holds can collide with it.
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    try:
        assert _ddp_sync.install()
        results = {}
        for scenario in SCENARIOS:
            results[scenario] = _scenario(rank, scenario)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # torch 2.13's gloo teardown at interpreter exit sometimes aborts ("terminate called without an
    # active exception"); the results are saved, so leave without it (resilrun's bootstrap does too).
    os._exit(0)


def _scenario(rank: int, scenario: str) -> dict:
    model = _model(rank)
    ddp = nn.parallel.DistributedDataParallel(model)
    pending_after_build = ddp in _ddp_sync._PENDING
    if scenario == "restored":
        with torch.no_grad():  # what a restore does (rank-dependent here, to show nothing was broadcast)
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.copy_(torch.full_like(tensor, 7.0 + rank))
        _ddp_sync.settle([ddp])
    elif scenario == "fresh":
        _ddp_sync.settle([])
    elif scenario == "partial":  # only the Linear restored: the BatchNorm's tensors are not covered
        _ddp_sync.settle([model[0]])
    elif scenario == "forward":  # never settled: the first forward syncs
        ddp(torch.ones(2, 4))
    elif scenario == "explicit":  # the user asked for torch's own behaviour
        _ddp_sync.settle([])
        ddp = nn.parallel.DistributedDataParallel(_model(rank), init_sync=True)
        pending_after_build = ddp in _ddp_sync._PENDING
    state = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    return {"pending_after_build": pending_after_build, "pending": len(_ddp_sync._PENDING), "state": state}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("ddp_sync")
    mp.start_processes(_scenarios, args=(str(out),), nprocs=2, start_method="spawn")
    by_rank = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    return {scenario: [by_rank[0][scenario], by_rank[1][scenario]] for scenario in SCENARIOS}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("scenario", ["fresh", "partial", "forward"])
def test_a_deferred_broadcast_makes_every_rank_start_from_rank_0s_weights(results: dict, scenario: str) -> None:
    rank0, rank1 = results[scenario]
    assert rank0["pending_after_build"] and rank1["pending_after_build"]  # built without a broadcast
    assert rank0["pending"] == rank1["pending"] == 0
    assert _equal(rank0["state"], rank1["state"])
    reference = _model(0).state_dict()
    if scenario != "forward":  # a forward in train mode updates the BatchNorm's running stats
        assert _equal(rank0["state"], reference)


def test_a_restore_that_sets_every_tensor_skips_the_broadcast(results: dict) -> None:
    rank0, rank1 = results["restored"]
    assert rank0["pending"] == rank1["pending"] == 0
    for rank, result in enumerate((rank0, rank1)):
        floats = [v for v in result["state"].values() if v.is_floating_point()]
        assert floats and all(torch.equal(v, torch.full_like(v, 7.0 + rank)) for v in floats)


def test_an_explicit_init_sync_is_left_to_torch(results: dict) -> None:
    rank0, rank1 = results["explicit"]
    assert not rank0["pending_after_build"] and not rank1["pending_after_build"]
    assert _equal(rank0["state"], rank1["state"])


# The patch's scope, in this process: one rank on a HashStore is enough to build DDPs.


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        _ddp_sync.uninstall()
        dist.destroy_process_group()


def test_uninstall_gives_ddp_back_torchs_own_init(one_rank: None) -> None:
    assert _ddp_sync.install() and _ddp_sync.installed()
    patched = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    assert patched in _ddp_sync._PENDING and _ddp_sync.built() == [patched]
    _ddp_sync.uninstall()
    assert nn.parallel.DistributedDataParallel.__init__ is _ddp_sync._ORIGINAL_INIT
    assert not _ddp_sync.installed() and not _ddp_sync._PENDING and not _ddp_sync.built()
    plain = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    assert plain not in _ddp_sync._PENDING and not _ddp_sync.built()
    _ddp_sync.uninstall()  # idempotent


def test_uninstall_leaves_a_later_patch_in_place_and_ours_passes_through(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ddp_class = nn.parallel.DistributedDataParallel
    _ddp_sync.install()
    ours = ddp_class.__init__
    calls = []

    def theirs(self: nn.parallel.DistributedDataParallel, *args: object, **kwargs: object) -> None:
        calls.append(self)
        ours(self, *args, **kwargs)

    monkeypatch.setattr(ddp_class, "__init__", theirs)
    _ddp_sync.uninstall()
    assert ddp_class.__init__ is theirs
    ddp = ddp_class(nn.Linear(2, 2))
    assert calls == [ddp] and ddp not in _ddp_sync._PENDING and not _ddp_sync.built()


def test_leaving_a_generation_uninstalls_the_patch() -> None:
    from resilrun.worker import membership as job_module

    assert _ddp_sync.install()
    try:
        job_module.reset_for_reentry()
        assert not _ddp_sync.installed()
        assert nn.parallel.DistributedDataParallel.__init__ is _ddp_sync._ORIGINAL_INIT
    finally:
        _ddp_sync.uninstall()
        job_module._TOOK_PART = False
