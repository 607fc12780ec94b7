"""The per-step compute time a rank reports for straggler detection (worker/_compute_probe.py):
from the step's start to its last gradient, without what comes after (the wait for the others,
the optimizer, the snapshot), on models written the way users write them."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from resilrun.worker._compute_probe import ComputeProbe


class Slow(nn.Module):
    """A layer whose forward takes at least ``seconds`` (a slow rank's compute)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


def _model(seconds: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Slow(seconds), nn.ReLU(), nn.Linear(8, 1))


def _step(model: nn.Module, opt: torch.optim.Optimizer, micro_batches: int = 1) -> None:
    opt.zero_grad(set_to_none=True)
    for _ in range(micro_batches):
        model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()


def test_a_step_counts_up_to_its_last_gradient_not_the_wait_after_it() -> None:
    model = _model(0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = ComputeProbe()
    probe.watch([model, opt, torch.zeros(3)])  # tracked objects of every kind: modules are measured
    for _ in range(3):
        probe.started()
        _step(model, opt)
        time.sleep(0.2)  # after the backward: a collective's wait, the optimizer, a snapshot
        probe.ended()
    mean = probe.take()
    assert mean is not None and 0.05 <= mean < 0.2
    assert probe.take() is None  # taken: the next commit reports only newer steps


def test_after_the_first_step_one_hook_is_left() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = ComputeProbe()
    probe.watch([model])
    assert len(probe._handles) == len([p for p in model.parameters() if p.requires_grad])
    probe.started()
    _step(model, opt)
    probe.ended()
    assert probe.take() is None  # the first step is a warm-up: it only picks the hook
    assert len(probe._handles) == 1
    # the first layer's gradients come last in the backward pass: one of its parameters keeps it
    assert any(probe._params[0] is p for p in model[0].parameters())
    probe.started()
    _step(model, opt)
    probe.ended()
    assert probe.take() is not None
    probe.close()
    assert probe._handles == []


def test_gradient_accumulation_counts_every_micro_batch() -> None:
    model = _model(0.03)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = ComputeProbe()
    probe.watch([model])
    for _ in range(2):
        probe.started()
        _step(model, opt, micro_batches=4)
        probe.ended()
    mean = probe.take()
    assert mean is not None and mean >= 4 * 0.03


def test_a_compiled_model_is_measured() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    compiled = torch.compile(model, backend="eager")  # dynamo's graph capture, without a compiler
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = ComputeProbe()
    probe.watch([compiled])
    for _ in range(3):
        probe.started()
        _step(compiled, opt)
        probe.ended()
    assert probe.take() is not None


def test_gradients_outside_a_step_and_steps_without_gradients_report_nothing() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = ComputeProbe()
    probe.watch([model])
    _step(model, opt)  # an evaluation or warm-up pass outside the loop resilrun times
    probe.started()
    with torch.no_grad():
        model(torch.randn(4, 8))  # a step without a backward pass
    probe.ended()
    assert probe.take() is None


@pytest.mark.parametrize("objects", [[], [{"epoch": 1}], [nn.Linear(2, 2).requires_grad_(False)]])
def test_nothing_to_measure_leaves_the_probe_inert(objects: list[object]) -> None:
    probe = ComputeProbe()
    probe.watch(objects)
    probe.started()
    probe.ended()
    assert probe.take() is None
    assert probe._handles == []


def test_modules_tracked_later_are_not_watched_twice() -> None:
    model = _model()
    probe = ComputeProbe()
    probe.watch([model])
    handles = len(probe._handles)
    probe.watch([model, nn.Linear(3, 3)])
    assert len(probe._handles) == handles
