"""The PyTorch Lightning script benchmarks/framework_overhead.py runs under each launcher.

Written as users write it for torchrun: ``ModelCheckpoint(every_n_train_steps=--save-steps,
save_last=True)`` and ``fit(ckpt_path="last")`` (what a torchrun restart relies on). Nothing of
resilrun is in it. The fault is the benchmark's: a callback SIGKILLs rank --kill-rank as optimizer
step --kill-step starts, once per job (a marker file remembers it), so the same kill hits both
launchers. The model is a small transformer LM of --layers blocks of --width.
"""

import os

import lightning as L
import torch
from _framework_bench import CONTEXT, VOCAB, Bench, Tokens, parse_args
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

cli = parse_args()
bench = Bench(cli)


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, cli.width)
        layer = nn.TransformerEncoderLayer(cli.width, 4, 4 * cli.width, dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, cli.layers)
        self.head = nn.Linear(cli.width, VOCAB)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        mask = nn.Transformer.generate_square_subsequent_mask(CONTEXT)
        logits = self.head(self.body(self.embed(tokens), mask=mask, is_causal=True))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class Stamps(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:  # noqa: ANN001
        bench.step_begins(trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        bench.step_ended(trainer.global_step)


callbacks: list[L.Callback] = [Stamps()]
if cli.save_steps:
    callbacks.append(ModelCheckpoint(dirpath=cli.out, every_n_train_steps=cli.save_steps, save_last=True))
L.seed_everything(0)
local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
trainer = L.Trainer(
    accelerator="cpu",
    devices=local,
    num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local,
    strategy="ddp",
    max_steps=cli.steps,
    enable_checkpointing=bool(cli.save_steps),
    enable_progress_bar=False,
    enable_model_summary=False,
    logger=False,
    callbacks=callbacks,
)
data = DataLoader(Tokens(4096), batch_size=8, shuffle=True)
trainer.fit(LM(), data, ckpt_path="last" if cli.save_steps else None)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
