"""A small GPT-style decoder-only transformer on resilrun's three-call API (DDP, AdamW, warmup +
cosine LR, gradient accumulation, rank-0-only logging).

The default size (8 layers, width 384, vocabulary 8192, context 128) has about 17M parameters:
big enough that snapshots and replicas cost what they cost for real models, small enough for a
CPU. Tokens are synthetic and a function of (step, rank, micro-batch), so a recovered run computes
what a failure-free run computes, bitwise.

    resilrun --standalone --nproc-per-node 2 --spares 1 examples/train_gpt.py --steps 20
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os

import torch
from torch import nn
from torch.nn import functional as F

import resilrun


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP, each with a residual."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as in GPT-2
        for module in self.modules():  # GPT-2's initialisation: small weights, zero biases
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tokens_for(step: int, rank: int, micro: int, batch: int, context: int, vocab: int) -> torch.Tensor:
    """A batch of token sequences that depends only on (step, rank, micro): resumable data."""
    gen = torch.Generator().manual_seed((step * 1009 + rank) * 31 + micro)
    return torch.randint(0, vocab, (batch, context + 1), generator=gen)


def lr_at(step: int, total: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth (a multiplier of the base LR)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))  # read first, as scripts do: only rank 0 logs
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch per rank")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--checksum-file", default="")
    args = parser.parse_args()

    job = resilrun.init()
    torch.manual_seed(0)
    model = GPT(args.vocab, args.context, args.width, args.layers, args.heads).to(job.device)
    if rank == 0:
        print(f"GPT: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    model = nn.parallel.DistributedDataParallel(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], 3e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, args.steps, max(1, args.steps // 10)))
    job.track(model=model, optimizer=opt, scheduler=sched)

    for step in job.steps(total=args.steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(args.accum):
            seq = tokens_for(step, job.rank, micro, args.batch, args.context, args.vocab).to(job.device)
            logits = model(seq[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), seq[:, 1:].reshape(-1)) / args.accum
            if micro < args.accum - 1:
                with model.no_sync():  # allreduce once per step, as accumulation does
                    loss.backward()
            else:
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item() * args.accum:.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

    digest = hashlib.sha256()
    for tensor in model.module.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    if rank == 0:
        print(f"done: {args.steps} steps on {job.world_size} ranks; params sha256 {digest.hexdigest()}")
        if args.checksum_file:
            with open(args.checksum_file, "w", encoding="utf-8") as handle:
                handle.write(digest.hexdigest())


if __name__ == "__main__":
    main()
