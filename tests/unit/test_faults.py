"""The fault-injection plan users and tests hand to workers through RESILRUN_FAULTS."""

from __future__ import annotations

import pytest

from resilrun.worker.faults import RESTORE_STEP, Fault, fire, parse_faults


def test_a_plan_parses_every_kind_with_defaults() -> None:
    plan = parse_faults(
        "kill:rank=1,step=12; exit:rank=0,step=3,code=7 ;raise:rank=2,step=5,attempt=1;hang:rank=1,step=8"
    )
    assert plan == (
        Fault("kill", 1, 12),
        Fault("exit", 0, 3, code=7),
        Fault("raise", 2, 5, attempt=1),
        Fault("hang", 1, 8),
    )
    assert parse_faults("") == ()


def test_step_restore_names_the_restore_of_a_recovery() -> None:
    assert parse_faults("kill:rank=0,step=restore,attempt=1") == (Fault("kill", 0, RESTORE_STEP, attempt=1),)


@pytest.mark.parametrize(
    "text",
    ["boom:rank=1,step=2", "kill:rank=1", "kill:step=1", "kill:rank=x,step=1", "kill:rank=1,step=2,when=3", "kill"],
)
def test_a_bad_plan_is_refused_naming_the_bad_part(text: str) -> None:
    with pytest.raises(ValueError, match="fault"):
        parse_faults(text)


def test_a_fault_fires_only_at_its_rank_step_and_attempt() -> None:
    plan = parse_faults("raise:rank=1,step=4,attempt=2")
    for rank, step, attempt in [(0, 4, 2), (1, 3, 2), (1, 4, 0)]:
        fire(plan, rank=rank, step=step, attempt=attempt)
    with pytest.raises(RuntimeError, match="injected fault at step 4 on rank 1"):
        fire(plan, rank=1, step=4, attempt=2)
