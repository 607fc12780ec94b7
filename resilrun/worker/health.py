"""A process's check of its device before it takes a rank: the device answers, a small matrix
multiply runs at the expected speed, and (a spare given a failed rank) a first collective with
the other ranks completes in time.

Why: a spare taking a failed rank's place (or a new worker) on a device that hangs or crawls would
turn one failure into a second one, or into a straggler the whole job waits for. Checked once per
process, right before it first joins a generation (``membership._join``), within ``BUDGET_S``: a
device that does not answer in that time fails the check instead of hanging the process.

What "expected" means: each process that passes reports its rate to its agent, and the agent hands
the median of its node's rates to the spares it gives a rank (``EXPECTED_GFLOPS_ENV``); a spare
slower than ``SLOWER_THAN`` of that fails. Only on GPUs: each process has its device to itself
there, while CPU processes share the node's cores with training, so their rate says nothing about
the hardware (a CPU check is the answer and the multiply completing within the budget).

The collective with the others (``hand_off``): every rank of a generation takes one one-element
all-reduce right after the process group is set up (every rank must: a collective is all of them);
a spare that was given a failed rank's place must complete it within ``PEER_BUDGET_S``, timed from
the moment every rank reached it (each counts itself in the group's store), so that the survivors'
own re-entry (their script's set-up before ``init()``) does not count against it. A spare that
does not is presumed at fault, not the others: they were training together until the failure, it
is the one part that is new (a host whose links are down, an NCCL transport that cannot be set up:
NCCL sets up its communicator at this first collective). It tells its agent why and exits with
``UNHEALTHY_EXIT_CODE``, so the next spare takes the rank; the survivors' all-reduce breaks (or is
aborted once the next generation is published) and they move to that generation in-process. A
link so broken that the group's set-up itself never completes is bounded by the process group's
timeout, as any rank's is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

BUDGET_S = 20.0
# Far above a healthy first collective (an NCCL communicator's set-up across thousands of ranks
# included), far below the process group's timeout, which would otherwise decide.
PEER_BUDGET_S = 60.0
SLOWER_THAN = 0.5
_SIZE = {"cuda": 2048, "cpu": 256}
_REPEATS = 3


@dataclass(frozen=True, slots=True)
class DeviceCheck:
    """What the check saw; ``reason`` is empty when the device passed (``judge`` adds the speed)."""

    device: str
    answer_s: float | None  # a one-element op, synchronized
    gflops: float | None  # the best of a few timed multiplies
    reason: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"device": self.device, "answer_s": self.answer_s, "gflops": self.gflops, "reason": self.reason}


def check_device(device: torch.device, budget_s: float = BUDGET_S, *, fail: str = "") -> DeviceCheck:
    """Run the check on a helper thread, waiting at most ``budget_s``; ``fail``: an injected failure
    (the fault plan's ``unhealthy``), reported as the device's."""
    result: list[DeviceCheck] = []

    def run() -> None:
        try:
            result.append(_measure(device))
        except Exception as exc:  # noqa: BLE001 - any error of the device is the check's answer
            result.append(DeviceCheck(str(device), None, None, f"{type(exc).__name__}: {exc}"))

    if fail:
        return DeviceCheck(str(device), None, None, fail)
    thread = threading.Thread(target=run, name="resilrun-device-check", daemon=True)
    thread.start()
    thread.join(budget_s)
    if not result:
        return DeviceCheck(str(device), None, None, f"the device did not answer within {budget_s:g} s")
    return result[0]


def _measure(device: torch.device) -> DeviceCheck:
    started = time.perf_counter()
    torch.ones(1, device=device).add_(1).item()  # .item() waits for the device
    answer_s = time.perf_counter() - started
    n = _SIZE.get(device.type, _SIZE["cpu"])
    # A generator of its own: drawing from the default one would shift the script's random stream
    # (its dropout masks, its data order), and a recovered run would no longer equal a failure-free one.
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=generator)
    b = torch.randn(n, n, device=device, generator=generator)
    best = float("inf")
    for _ in range(_REPEATS + 1):  # the first is a warm-up (kernels, caches)
        started = time.perf_counter()
        c = a @ b
        c[0, 0].item()
        best = min(best, time.perf_counter() - started)
    finite = bool(torch.isfinite(c).all().item())
    del a, b, c
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the script's memory, not ours, from here on
    if not finite:
        return DeviceCheck(str(device), answer_s, None, "the multiply returned non-finite values")
    return DeviceCheck(str(device), answer_s, 2 * n**3 / best / 1e9)


def judge(check: DeviceCheck, expected_gflops: float | None) -> str:
    """Why ``check`` fails (empty: it passes); the speed counts on GPUs only (module docstring)."""
    if check.reason:
        return check.reason
    on_gpu = check.device.startswith("cuda") and expected_gflops and check.gflops is not None
    if on_gpu and check.gflops < SLOWER_THAN * expected_gflops:  # type: ignore[operator]
        return (
            f"a {_SIZE['cuda']}x{_SIZE['cuda']} multiply ran at {check.gflops:.0f} GFLOP/s, "
            f"under {SLOWER_THAN:g}x this node's {expected_gflops:.0f}"
        )
    return ""


def hand_off(
    device: torch.device,
    budget_s: float | None,
    overdue: Callable[[float], None],
    *,
    hang: bool,
    everyone_here: Callable[[], None] | None = None,
) -> float:
    """The generation's first collective (an all-reduce of one element); returns its seconds.

    ``budget_s``: a promoted spare's budget (None: not bounded, a survivor or a first start), after
    which ``overdue(budget_s)`` runs on a timer thread (it is to end the process: the collective
    cannot be cancelled); the budget starts once ``everyone_here()`` returned (every rank reached
    its hand-off: on NCCL, setting up the group waits for no one). ``hang``: an injected isolation
    (the fault plan's ``isolated``).
    """
    timer, lock, done = None, threading.Lock(), threading.Event()
    if budget_s is not None:
        if everyone_here is not None:
            everyone_here()

        def expire(budget: float) -> None:
            with lock:  # a collective that completed as the budget ran out is not reported overdue
                if not done.is_set():
                    overdue(budget)

        timer = threading.Timer(budget_s, expire, args=(budget_s,))
        timer.daemon = True
        timer.start()
    started = time.perf_counter()
    try:
        if hang:
            threading.Event().wait()  # a spare whose links are down: the others wait in the all-reduce
        one = torch.ones(1, device=device)
        dist.all_reduce(one)
        one.item()  # waits for the device (NCCL is asynchronous)
    finally:
        with lock:
            done.set()
        if timer is not None:
            timer.cancel()
    return time.perf_counter() - started
