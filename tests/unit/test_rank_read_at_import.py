"""What a package took from the environment once, as it was imported, is set again when a worker gets
its own environment (resilrun.integrations.refresh_ranks_read_at_import): its packages may have been
imported with no rank (the node's worker template it was forked from, a hot spare)."""

from __future__ import annotations

import pytest

from resilrun import env, integrations

rank_zero = pytest.importorskip("lightning_utilities.core.rank_zero")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.setenv(key, "0")  # (recorded, so that what apply_assignment writes is undone after)
        monkeypatch.delenv(key)
    monkeypatch.setattr(env, "_ON_ASSIGNMENT", [])
    monkeypatch.setattr(rank_zero.rank_zero_only, "rank", 0, raising=False)


def test_lightnings_rank_zero_rank_follows_the_workers_rank_when_its_assignment_is_adopted() -> None:
    # Given Lightning's rank_zero_only imported with no rank (it took 0), in a worker that asked to follow
    env.on_assignment(integrations.refresh_ranks_read_at_import)
    # When the worker adopts the rank the agent gave it
    env.apply_assignment({"RANK": "3", "LOCAL_RANK": "1"})
    # Then rank_zero_only is that rank, as a fresh import would have set it
    assert rank_zero.rank_zero_only.rank == 3


@pytest.mark.parametrize(
    ("environ", "rank"),
    [({"LOCAL_RANK": "2"}, 2), ({"SLURM_PROCID": "5"}, 5), ({}, 0), ({"RANK": "1", "SLURM_PROCID": "7"}, 1)],
)
def test_the_rank_is_read_as_lightning_reads_it(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], rank: int
) -> None:
    rank_zero.rank_zero_only.rank = 9
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    integrations.refresh_ranks_read_at_import()
    assert rank_zero.rank_zero_only.rank == rank


def test_a_rank_zero_only_never_set_is_left_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    # (no package set it: the first import of Lightning or torchmetrics will, from the environment then)
    monkeypatch.delattr(rank_zero.rank_zero_only, "rank")
    monkeypatch.setenv("RANK", "4")
    integrations.refresh_ranks_read_at_import()
    assert not hasattr(rank_zero.rank_zero_only, "rank")
