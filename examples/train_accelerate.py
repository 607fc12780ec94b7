"""A hand-written Hugging Face Accelerate training loop as users write it: nothing of resilrun in it.

A small transformer language model on synthetic tokens, dropout on, a warmup schedule stepped
every optimizer step, gradient accumulation with ``accelerator.accumulate``, a shuffling DataLoader
that ``accelerator.prepare`` shards (or torchdata's StatefulDataLoader with --stateful), an
evaluation pass after every epoch (and, with --save-state, the script's own checkpoint, which
--resume starts from), rank-0-only printing, and the weights saved at the end.

    resilrun --standalone --nproc-per-node 2 --spares 1 examples/train_accelerate.py --out /tmp/acc
"""

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn
from torch.utils.data import DataLoader, Dataset

if int(os.environ.get("RANK", "0")) == 0:
    print(f"training on {os.environ.get('WORLD_SIZE', '1')} process(es)", flush=True)

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--grad-accum", type=int, default=1)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--samples", type=int, default=64)
parser.add_argument("--stateful", action="store_true", help="torchdata's StatefulDataLoader under Accelerate")
parser.add_argument("--save-state", action="store_true", help="also accelerator.save_state() after every epoch")
parser.add_argument("--resume", action="store_true", help="start from the newest epoch_N that --save-state wrote")
cli = parser.parse_args()


class Tokens(Dataset):
    def __init__(self, count: int, length: int, vocab: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (count, length + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.data[index]
        return row[:-1], row[1:]


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 96, width: int = 32, context: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, 2, 4 * width, dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.body(self.embed(tokens) + self.position, mask=mask, is_causal=True))


accelerator = Accelerator(
    cpu=not torch.cuda.is_available(),
    gradient_accumulation_steps=cli.grad_accum,
    dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=cli.stateful),
)
set_seed(0)
model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
# Accelerate steps a scheduler once per process per optimizer step: warm up over 5 optimizer steps.
warmup = 5 * accelerator.num_processes
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
train_data = DataLoader(Tokens(cli.samples, 16, 96, 1234), batch_size=4, shuffle=True, num_workers=cli.workers)
eval_data = DataLoader(Tokens(16, 16, 96, 4321), batch_size=4)
model, optimizer, train_data, eval_data, scheduler = accelerator.prepare(
    model, optimizer, train_data, eval_data, scheduler
)

starting_epoch = 0
saved = [int(name[6:]) for name in os.listdir(cli.out) if name.startswith("epoch_")] if os.path.isdir(cli.out) else []
if cli.resume and saved:
    accelerator.load_state(os.path.join(cli.out, f"epoch_{max(saved)}"))
    starting_epoch = max(saved) + 1
    accelerator.print(f"resumed from epoch_{max(saved)}")

completed_steps = 0
for epoch in range(starting_epoch, cli.epochs):
    model.train()
    for tokens, targets in train_data:
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
            if completed_steps % 5 == 0:
                accelerator.print(f"epoch {epoch} step {completed_steps} loss {loss.item():.4f}")
    model.eval()
    losses = []
    for tokens, targets in eval_data:
        with torch.no_grad():
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        losses.append(accelerator.gather_for_metrics(loss.repeat(len(tokens))))
    accelerator.print(f"epoch {epoch} eval loss {torch.cat(losses).mean().item():.4f}")
    if cli.save_state:
        accelerator.save_state(os.path.join(cli.out, f"epoch_{epoch}"))

accelerator.wait_for_everyone()
accelerator.save_model(model, cli.out)
accelerator.end_training()
accelerator.print(f"done: {cli.epochs} epochs, {completed_steps} optimizer steps in this run")
