"""The hand-written Accelerate loop benchmarks/framework_overhead.py runs under each launcher.

Written as Accelerate's examples write it for torchrun: ``accelerator.save_state`` every
--save-steps optimizer steps, and on start the newest saved state loaded back with
``load_state`` and the epoch's trained batches skipped with ``skip_first_batches`` (what a
torchrun restart relies on). Nothing of resilrun is in it. One epoch of exactly --steps optimizer
steps, so the loop is bounded by its data. The step stamped is read from the optimizer's own
state (its per-parameter step count), which a resumed run restores, where the script's own
counter would start again at the resumed point.
"""

import os
import re

import torch
from _framework_bench import CONTEXT, VOCAB, Bench, Tokens, parse_args
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader

cli = parse_args()
bench = Bench(cli)
BATCH = 8


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, cli.width)
        layer = nn.TransformerEncoderLayer(cli.width, 4, 4 * cli.width, dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, cli.layers)
        self.head = nn.Linear(cli.width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(CONTEXT)
        return self.head(self.body(self.embed(tokens), mask=mask, is_causal=True))


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    states = [s for s in optimizer.state.values() if "step" in s]
    return int(states[0]["step"]) if states else 0


accelerator = Accelerator(cpu=True)
set_seed(0)
model = LM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
warmup = 4 * accelerator.num_processes  # Accelerate steps a scheduler once per process per optimizer step
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
data = DataLoader(Tokens(cli.steps * BATCH * accelerator.num_processes), batch_size=BATCH, shuffle=True)
model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)

names = os.listdir(cli.out) if os.path.isdir(cli.out) else []
saved = sorted((int(m[1]), name) for name in names if (m := re.fullmatch(r"step_(\d+)", name)))
batches = data
if saved:
    resumed, name = saved[-1]
    accelerator.load_state(os.path.join(cli.out, name))
    batches = accelerator.skip_first_batches(data, resumed)
    accelerator.print(f"resumed from {name}")

for tokens, targets in batches:
    bench.step_begins(optimizer_steps(optimizer))
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    done = optimizer_steps(optimizer)
    bench.step_ended(done)
    if cli.save_steps and done % cli.save_steps == 0:
        accelerator.save_state(os.path.join(cli.out, f"step_{done}"))
accelerator.print("done")
accelerator.wait_for_everyone()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
