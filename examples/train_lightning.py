"""A PyTorch Lightning script as users write it: nothing of resilrun in it.

A small transformer language model on synthetic tokens, dropout on, a warmup schedule stepped
every optimizer step, gradient accumulation, a shuffling DataLoader (Lightning adds the
distributed sampler; or torchdata's StatefulDataLoader with --stateful), rank-0-only logging, and
the weights saved by rank 0 at the end.

    resilrun --standalone --nproc-per-node 2 --spares 1 examples/train_lightning.py --out /tmp/lit
"""

import argparse
import os

import lightning as L
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--epochs", type=int, default=100)
parser.add_argument("--grad-accum", type=int, default=1)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--samples", type=int, default=256)
parser.add_argument("--stateful", action="store_true", help="torchdata's StatefulDataLoader instead of DataLoader")
cli = parser.parse_args()
if cli.stateful:
    from torchdata.stateful_dataloader import StatefulDataLoader as DataLoader  # noqa: F811

local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
nodes = int(os.environ.get("WORLD_SIZE", "1")) // local_world_size
if int(os.environ.get("RANK", "0")) == 0:
    print(f"training on {nodes} node(s) x {local_world_size} process(es)", flush=True)


class Tokens(Dataset):
    def __init__(self, count: int, length: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, vocab, (count, length + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.data[index]
        return row[:-1], row[1:]


class TinyLM(L.LightningModule):
    def __init__(self, vocab: int = 96, width: int = 32, context: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, 2, 4 * width, dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.body(self.embed(tokens) + self.position, mask=mask, is_causal=True))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's own signature
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class LossPrinter(L.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.is_global_zero and batch_idx % 10 == 0:
            print(f"step {trainer.global_step} loss {outputs['loss'].item():.4f}", flush=True)


L.seed_everything(0)
model = TinyLM()
data = DataLoader(Tokens(cli.samples, 16, 96), batch_size=4, shuffle=True, num_workers=cli.workers)
trainer = L.Trainer(
    accelerator="cpu",
    devices=local_world_size,
    num_nodes=nodes,
    strategy="ddp",
    max_steps=cli.steps,
    max_epochs=cli.epochs,
    accumulate_grad_batches=cli.grad_accum,
    enable_checkpointing=False,
    enable_progress_bar=False,
    logger=False,
    callbacks=[LossPrinter()],
)
trainer.fit(model, data)
if trainer.is_global_zero:
    os.makedirs(cli.out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(cli.out, "model.safetensors"))
    print(f"done: global_step={trainer.global_step}", flush=True)
