"""Each private torch interface resilrun uses: its probe holds on the torch the tests run on, and
resilrun falls back as documented (a warning, once; no exception) when the interface is gone.

A one-rank gloo group (a HashStore, no sockets) is enough for DDP to build its reducer.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.utils
from torch import nn
from torch.distributed import distributed_c10d
from torch.nn.parallel import DistributedDataParallel

from resilrun.worker import _ddp_sync, _torch_compat, membership
from resilrun.worker import job as job_module

_LOGGER = "resilrun.worker._torch_compat"


@pytest.fixture(autouse=True)
def fresh_probes() -> Iterator[None]:
    """Every test probes anew, and no test leaves a probe cached against a removed attribute."""
    _torch_compat.forget_probes()
    yield
    _torch_compat.forget_probes()


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _holds(name: str) -> bool:
    return next(p.holds for p in _torch_compat.report() if p.name == name)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == _LOGGER and r.levelno == logging.WARNING]


def test_the_report_names_every_probe_with_its_fallback() -> None:
    probes = _torch_compat.report()
    names = [
        "deferred_ddp_sync",
        "ddp_bucket_rebuild",
        "group_counter",
        "cuda_host_register",
        "group_registry",
        "strided_shard",
        "dataloader_workers",
        "ddp_hook_removal",
        "default_group_read",
        "default_store",
        "cuda_fork_state",
        "nvml_device_check",
    ]
    assert [p.name for p in probes] == names
    assert all(p.fallback for p in probes)
    assert torch.__version__.startswith(_torch_compat.TESTED_TORCH + ".")  # the version the module says is tested


def test_the_install_files_declare_the_tested_torch_release() -> None:
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[2]
    dependencies = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    major, minor = (int(part) for part in _torch_compat.TESTED_TORCH.split("."))
    assert f"torch>={major}.{minor},<{major}.{minor + 1}" in dependencies
    pins = re.findall(r"torch==(\S+)", (root / "Makefile").read_text())
    assert pins and all(pin.startswith(f"{major}.{minor}.") for pin in pins)


# deferred_ddp_sync


def test_deferred_ddp_sync_probe_holds_and_syncs_a_ddp_built_without_it(group: None) -> None:
    assert _holds("deferred_ddp_sync") and _torch_compat.can_defer_ddp_sync()
    ddp = DistributedDataParallel(nn.Linear(2, 2), init_sync=False)
    _torch_compat.sync_ddp_start(ddp, broadcast_buffers=True)  # one rank: the collectives run, change nothing


def test_without_the_sync_helpers_ddp_keeps_torchs_own_start_up_sync(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, group: None
) -> None:
    monkeypatch.delattr(torch.distributed.utils, "_sync_module_states")
    assert not _holds("deferred_ddp_sync")
    assert not _ddp_sync.install()
    assert not _ddp_sync.install()
    assert DistributedDataParallel.__init__ is _ddp_sync._ORIGINAL_INIT  # nothing patched
    assert len(_warnings(caplog)) == 1 and "deferred_ddp_sync" in _warnings(caplog)[0]
    with pytest.raises(RuntimeError, match="start-up sync helpers"):
        _torch_compat.sync_ddp_start(DistributedDataParallel(nn.Linear(2, 2)), broadcast_buffers=True)


# ddp_bucket_rebuild


def test_ddp_bucket_rebuild_probe_holds_and_rebuilds_once(group: None) -> None:
    assert _holds("ddp_bucket_rebuild")
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))
    assert not ddp._has_rebuilt_buckets
    assert _torch_compat.rebuild_ddp_buckets(ddp)
    assert ddp._has_rebuilt_buckets
    assert not _torch_compat.rebuild_ddp_buckets(ddp)  # already final: nothing to do


@pytest.mark.parametrize("missing", ["reducer methods", "instance flag"])
def test_without_the_bucket_rebuild_the_layout_is_left_to_ddp(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, group: None, missing: str
) -> None:
    ddp = DistributedDataParallel(nn.Linear(2, 1))
    if missing == "reducer methods":
        monkeypatch.setattr(dist, "Reducer", type("Reducer", (), {}))
        assert not _holds("ddp_bucket_rebuild")
    else:
        del ddp._has_rebuilt_buckets
    job_module.fix_bucket_layouts([ddp])
    job_module.fix_bucket_layouts([ddp])
    assert not getattr(ddp, "_has_rebuilt_buckets", False)  # untouched: DDP rebuilds after its first step
    assert len(_warnings(caplog)) == 1 and "3+ ranks" in _warnings(caplog)[0]
    ddp(torch.ones(1, 2)).sum().backward()  # and training still works


# group_counter


def test_group_counter_probe_holds_and_resets_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _holds("group_counter")
    monkeypatch.setattr(distributed_c10d._world, "group_count", 3)
    assert _torch_compat.reset_group_counter()
    assert distributed_c10d._world.group_count == 0


@pytest.mark.parametrize("missing", ["counter", "world"])
def test_without_the_group_counter_nothing_is_reset(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, missing: str
) -> None:
    if missing == "counter":
        monkeypatch.setattr(distributed_c10d, "_world", SimpleNamespace())  # a _World without the count
    else:
        monkeypatch.delattr(distributed_c10d, "_world")
    assert not _holds("group_counter")
    membership._forget_failed_group_setup()
    assert not _torch_compat.reset_group_counter()
    assert len(_warnings(caplog)) == 1 and "group_counter" in _warnings(caplog)[0]


# cuda_host_register


class _Runtime:
    """Stands in for torch's CUDA runtime module: records each registration, answers ``result``."""

    def __init__(self, result: int) -> None:
        self.result = result
        self.calls: list[tuple[int, int, int]] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append((ptr, nbytes, flags))
        return self.result


def test_cuda_host_register_probe_matches_the_build_and_never_initialises_cuda() -> None:
    assert _holds("cuda_host_register") == (torch.version.cuda is not None)
    if torch.version.cuda is None:
        assert not _torch_compat.pin_host_memory(0, 8)
        assert not torch.cuda.is_initialized()


@pytest.mark.parametrize(("result", "pinned"), [(0, True), (1, False)])
def test_pinning_registers_the_buffer_with_the_cuda_runtime(
    monkeypatch: pytest.MonkeyPatch, result: int, pinned: bool
) -> None:
    runtime = _Runtime(result)
    monkeypatch.setattr(torch._C, "_cudart", runtime, raising=False)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    assert _holds("cuda_host_register")
    assert _torch_compat.pin_host_memory(4096, 512) is pinned
    assert runtime.calls == [(4096, 512, 0)]


def test_without_the_runtime_on_a_cuda_build_buffers_stay_pageable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.0")
    monkeypatch.delattr(torch._C, "_cudart", raising=False)
    assert not _holds("cuda_host_register")
    assert not _torch_compat.pin_host_memory(4096, 512)
    assert not _torch_compat.pin_host_memory(4096, 512)
    assert len(_warnings(caplog)) == 1 and "pageable" in _warnings(caplog)[0]


# group_registry


def test_group_registry_probe_holds_and_lists_subgroups_newest_first(group: None) -> None:
    assert _holds("group_registry")
    first, second = dist.new_group([0]), dist.new_group([0])
    groups = _torch_compat.process_groups(newest_first=True)
    assert groups[:2] == [second, first] and groups[-1] is dist.group.WORLD


def test_without_the_group_registry_no_group_is_listed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(distributed_c10d, "_world", SimpleNamespace())
    assert not _holds("group_registry")
    assert _torch_compat.process_groups() == []
    assert _torch_compat.process_groups() == []
    assert len(_warnings(caplog)) == 1 and "subgroup" in _warnings(caplog)[0]


# strided_shard


def test_strided_shard_probe_holds_and_round_trips_the_placement() -> None:
    from resilrun.worker._dtensor import placement_of, placement_text

    assert _holds("strided_shard")
    assert placement_text(placement_of("SS1:4")) == "SS1:4"


def test_without_the_strided_shard_such_a_dtensor_cannot_be_snapshotted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from torch.distributed.tensor import placement_types

    from resilrun.errors import CheckpointError
    from resilrun.worker._dtensor import placement_of, placement_text

    strided = placement_of("SS0:2")
    monkeypatch.delattr(placement_types, "_StridedShard")
    _torch_compat.forget_probes()  # building the placement above probed with the class there
    assert not _holds("strided_shard")
    with pytest.raises(TypeError, match="cannot snapshot a DTensor placed as"):
        placement_text(strided)
    with pytest.raises(CheckpointError, match="strided shard"):
        placement_of("SS0:2")
    assert len(_warnings(caplog)) == 1 and "strided shards" in _warnings(caplog)[0]


# dataloader_workers


class _Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> int:
        return index


def test_a_failed_generations_dataloader_workers_are_stopped_even_while_referenced() -> None:
    import multiprocessing

    # Given a DataLoader iterator with 2 persistent workers, still referenced (as a framework's
    # cache or a reference cycle would keep it after the generation failed)
    assert _holds("dataloader_workers")
    assert _torch_compat.track_dataloader_workers()
    loader = torch.utils.data.DataLoader(_Numbers(), batch_size=4, num_workers=2, persistent_workers=True)
    kept = iter(loader)
    next(kept)
    workers = [w for w in multiprocessing.active_children() if w.pid in {p.pid for p in kept._workers}]
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    # When the generation ends
    assert _torch_compat.stop_dataloader_workers() == 1
    # Then its workers are gone, cleanly: joined (not left as zombies) and the iterator knows it
    assert not any(w.is_alive() for w in workers)
    assert kept._shutdown
    assert _torch_compat.stop_dataloader_workers() == 0  # each generation's iterators once


def test_without_the_iterator_interface_workers_are_left_to_garbage_collection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from torch.utils.data import dataloader

    monkeypatch.delattr(dataloader, "_MultiProcessingDataLoaderIter")
    _torch_compat.forget_probes()
    assert not _holds("dataloader_workers")
    assert not _torch_compat.track_dataloader_workers()
    assert len(_warnings(caplog)) == 1 and "DataLoader workers" in _warnings(caplog)[0]
    monkeypatch.undo()
    _torch_compat.forget_probes()


def test_without_torchs_fork_state_the_template_cannot_tell_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert _torch_compat.cuda_unusable_after_fork() is False  # this process was not forked after a CUDA query
    monkeypatch.delattr(torch.cuda, "_is_in_bad_fork")
    _torch_compat.forget_probes()
    try:
        with caplog.at_level(logging.WARNING, logger=_LOGGER):
            assert _torch_compat.cuda_unusable_after_fork() is None
        assert any("cuda_fork_state" in w and "does not import the script" in w for w in _warnings(caplog))
    finally:
        monkeypatch.undo()
        _torch_compat.forget_probes()
