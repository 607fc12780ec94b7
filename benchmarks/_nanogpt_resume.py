"""A training script in the shape of nanoGPT's ``train.py``, for benchmarks/captured_checkpoints.py's
scenario D (issue 45): the loop most small-LLM users start from, run unmodified under each launcher.

What it keeps from that shape (written here from its public description, not copied): settings as
module-level globals overridden by ``--key=value`` arguments; ``ddp = RANK is set`` read before
anything else; ``init_process_group``, ``master_process`` and a per-rank seed offset; gradient
accumulation with ``require_backward_grad_sync`` on the last micro-step only; batches drawn at
random positions of a token array; AdamW with warm-up and cosine decay; every ``eval_interval``
iterations the master process writes ``ckpt.pt`` (model, optimizer, ``iter_num``, the settings) with
``torch.save``; and the resume path, taken when ``init_from == "resume"``. The one change torchrun
users make so that a restart resumes instead of failing on the first start: ``init_from`` becomes
``"resume"`` when ``ckpt.pt`` exists. As in nanoGPT, the random generator is not saved, so a
resumed run draws other batches than an uninterrupted one (the same under every launcher).

Lines: ``iter N: loss L, time T ms`` (master, every ``log_interval``), ``saving checkpoint to DIR in
S s`` (the ``torch.save``'s stall), ``resuming training from DIR at iter N`` (every rank), and
``[rank R] finished at iter N``.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# -- settings (``--name=value`` overrides any of them) --------------------------------------------
out_dir = "out"
eval_interval = 20
log_interval = 1
init_from = "scratch"
gradient_accumulation_steps = 2
batch_size = 4
block_size = 64
n_layer = 4
n_head = 4
n_embd = 128
vocab_size = 512
learning_rate = 1e-3
max_iters = 60
warmup_iters = 5
min_lr = 1e-4
grad_clip = 1.0
sleep = 0.0  # extra seconds per iteration (pacing for fault tests)

for arg in sys.argv[1:]:
    key, _, value = arg.removeprefix("--").partition("=")
    if key not in globals() or key.startswith("_"):
        raise SystemExit(f"unknown setting {key!r}")
    globals()[key] = type(globals()[key])(value)

ddp = int(os.environ.get("RANK", -1)) != -1  # read before anything else, as nanoGPT does
if ddp:
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{ddp_local_rank}" if torch.cuda.is_available() else "cpu"
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
else:
    ddp_rank, ddp_world_size, device, master_process, seed_offset = 0, 1, "cpu", True, 0
if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
ckpt_path = os.path.join(out_dir, "ckpt.pt")
if init_from == "scratch" and os.path.exists(ckpt_path):
    init_from = "resume"  # the change torchrun users make for automatic restarts

tokens = torch.randint(vocab_size, (1 << 16,), generator=torch.Generator().manual_seed(7))


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(tokens) - block_size - 1, (batch_size,))
    x = torch.stack([tokens[i : i + block_size] for i in ix])
    y = torch.stack([tokens[i + 1 : i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


iter_num = 0
model = GPT()
checkpoint = None
if init_from == "resume":
    checkpoint = torch.load(ckpt_path, map_location=device)
    model.load_state_dict(checkpoint["model"])
    iter_num = checkpoint["iter_num"]
    print(f"resuming training from {out_dir} at iter {iter_num}", flush=True)
model.to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95))
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint["optimizer"])
checkpoint = None  # free it
if ddp:
    model = DDP(model)
raw_model = model.module if ddp else model


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / max(1, max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio))) * (learning_rate - min_lr)


X, Y = get_batch()
t0 = time.time()
while True:
    for group in optimizer.param_groups:
        group["lr"] = get_lr(iter_num)
    if iter_num % eval_interval == 0 and iter_num > 0 and master_process:
        state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
        began = time.perf_counter()
        torch.save(state, ckpt_path)
        print(f"saving checkpoint to {out_dir} in {time.perf_counter() - began:.3f} s", flush=True)
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        loss = model(X, Y) / gradient_accumulation_steps
        X, Y = get_batch()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if sleep:
        time.sleep(sleep)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms", flush=True)
    iter_num += 1
    if iter_num > max_iters:
        break
print(f"[rank {ddp_rank}] finished at iter {iter_num}", flush=True)
if ddp:
    destroy_process_group()
