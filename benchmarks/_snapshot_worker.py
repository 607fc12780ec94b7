"""Benchmark worker for ``snapshot_cost.py``: one DDP script on resilrun's three-call API.

The same unmodified file runs under both launchers. Under resilrun, ``job.steps()`` commits every
finished step into node memory; under torchrun there is no agent, so ``resilrun.init()`` only
sets up the process group and ``steps()`` commits nothing: the two runs differ by the snapshots
(and resilrun's heartbeat thread). ``--plain-loop`` skips ``track``/``steps`` altogether (a plain
``range``), to tell the launcher's own cost, heartbeat included, from the snapshots' under resilrun.

Rank 0 prints one ``BENCH_JSON {...}`` line with, per step: the wall time from the top of one
loop body to the top of the next (the step time a user sees); the time between the end of a body
and the top of the next one (inside ``steps()``: the commit, i.e. the training time the snapshot
blocks), on rank 0 and on the slowest rank (DDP makes everyone wait for that one at the next
allreduce), and of it the time to post the commit message to the agent (its answer is read at
the next commit); and the CPU seconds this process used (all its threads), because on a machine
shared with other users' jobs wall time swings with their load and CPU time much less. The step
does real work (forward, backward, DDP allreduce, AdamW) on an MLP whose parameters + Adam
moments are the requested size, so "fraction of a step" is meaningful; ``--model gpt`` trains
``examples/train_gpt.py``'s decoder-only transformer instead (8 layers, vocabulary 8192, context
128, its width solved from the requested size), on random tokens with cross-entropy.

On a machine with CUDA the model, data and collectives go to ``job.device`` (NCCL, one GPU per
local rank) and each step ends with a device synchronize, so step times are the GPU's, not the
launch queue's; the snapshot is then a pinned, non-blocking device-to-host copy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

GPT_LAYERS, GPT_VOCAB, GPT_CONTEXT = 8, 8192, 128

LAYERS = 4  # square Linear layers; hidden size is solved from the requested state size


def hidden_for(state_mib: float) -> int:
    """Hidden size h whose params + AdamW's two moments (fp32) are ``state_mib``: 12 * 4 * (h^2 + h) bytes."""
    per_layer = state_mib * 2**20 / (3 * 4 * LAYERS)
    return max(8, round((-1 + (1 + 4 * per_layer) ** 0.5) / 2))


def build_model(state_mib: float) -> nn.Sequential:
    """An MLP of LAYERS square layers (deterministic init) sized for ``state_mib`` of tracked state."""
    hidden = hidden_for(state_mib)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers.append(nn.Linear(hidden, hidden))
        if i < LAYERS - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def gpt_width_for(state_mib: float) -> int:
    """The width w (a multiple of 64) whose GPT's params + AdamW moments (12 bytes a parameter,
    about vocab * w + 12 * layers * w^2 parameters) come nearest to ``state_mib``."""
    params = state_mib * 2**20 / 12
    a, b = 12 * GPT_LAYERS, GPT_VOCAB
    width = (-b + (b * b + 4 * a * params) ** 0.5) / (2 * a)
    return max(64, round(width / 64) * 64)


def build_gpt(state_mib: float) -> nn.Module:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from train_gpt import GPT

    width = gpt_width_for(state_mib)
    torch.manual_seed(0)
    return GPT(GPT_VOCAB, GPT_CONTEXT, width, GPT_LAYERS, width // 64)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """Forward, backward (DDP allreduces here when ``model`` is DDP) and an AdamW update."""
    if x.dtype == torch.long:  # token sequences: the GPT
        logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    else:
        loss = nn.functional.mse_loss(model(x), x.tanh())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of parameters and optimizer tensors: what a snapshot of (model, optimizer) holds."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for per_param in opt.state.values():
        total += sum(v.numel() * v.element_size() for v in per_param.values() if isinstance(v, torch.Tensor))
    return total


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    """``fn``, appending the seconds of each call to ``into``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - begin)

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mib", type=float, default=64.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    parser.add_argument("--plain-loop", action="store_true", help="no track()/steps(): no snapshots at all")
    args = parser.parse_args()

    import resilrun  # after argparse: --help works without torch.distributed

    job = resilrun.init()
    cuda = job.device.type == "cuda"
    gpt = args.model == "gpt"
    built = build_gpt(args.state_mib) if gpt else build_model(args.state_mib)
    model = nn.parallel.DistributedDataParallel(built.to(job.device), device_ids=[job.device] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    hidden = gpt_width_for(args.state_mib) if gpt else hidden_for(args.state_mib)
    gen = torch.Generator().manual_seed(job.rank)

    def batch() -> torch.Tensor:
        if gpt:  # --batch sequences of GPT_CONTEXT + 1 tokens
            return torch.randint(0, GPT_VOCAB, (args.batch, GPT_CONTEXT + 1), generator=gen)
        return torch.randn(args.batch, hidden, generator=gen)

    loop: Iterable[int]
    messages: list[float] = []
    if args.plain_loop:
        loop = range(args.steps)
    else:
        job.track(model=model, optimizer=opt)
        loop = job.steps(total=args.steps)
        snapshotter = getattr(job, "_snapshotter", None)
        if snapshotter is not None:  # under resilrun: time posting the commit message to the agent
            snapshotter.client.post = _timed(snapshotter.client.post, messages)
    tops: list[float] = []
    cpu: list[float] = []
    ends: list[float] = []
    for _ in loop:
        tops.append(time.perf_counter())
        cpu.append(time.process_time())
        train_step(model, opt, batch().to(job.device))
        ends.append(time.perf_counter())
    tops.append(time.perf_counter())  # after the last commit: steps() returned
    cpu.append(time.process_time())
    commits = [top - end for end, top in zip(ends, tops[1:], strict=False)]
    # DDP makes every rank wait for the slowest one's commit at the next allreduce: gather them all.
    gathered = [torch.zeros(len(commits), dtype=torch.float64, device=job.device) for _ in range(job.world_size)]
    torch.distributed.all_gather(gathered, torch.tensor(commits, dtype=torch.float64, device=job.device))
    snapshots = bool(os.environ.get("RESILRUN_AGENT_SOCKET")) and not args.plain_loop
    if job.rank == 0:
        result = {
            "model": args.model,
            "hidden": hidden,
            "state_bytes": state_bytes(model, opt),
            "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS", ""),
            "snapshots": snapshots,
            "step": [b - a for a, b in zip(tops, tops[1:], strict=False)],
            "commit": commits,
            "commit_slowest": torch.stack(gathered).max(dim=0).values.cpu().tolist(),
            "device": str(job.device),
            "cpu": [b - a for a, b in zip(cpu, cpu[1:], strict=False)],
            "message": messages[-len(ends) :] if messages else [],  # every post is a commit
            # the steps between snapshots the run ended with (auto: as measured), where there are any
            "interval": getattr(job, "snapshot_interval", None) if snapshots else None,
            "replica_interval": getattr(job, "replica_interval", None) if snapshots else None,
        }
        print("BENCH_JSON " + json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
