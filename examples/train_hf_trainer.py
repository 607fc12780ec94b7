"""A Hugging Face Trainer fine-tuning script as users write it: nothing of resilrun in it.

A tiny GPT-2 built from its config (no download), synthetic token data, dropout on, a warmup +
cosine schedule, gradient accumulation, rank-0-only saving through ``trainer.save_model``.
"""

import argparse
import os

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--grad-accum", type=int, default=1)
parser.add_argument("--workers", type=int, default=0)
cli = parser.parse_args()

if int(os.environ.get("RANK", "0")) == 0:
    print(f"training on {os.environ.get('WORLD_SIZE', '1')} processes", flush=True)


class Tokens(Dataset):
    def __init__(self, count: int, length: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, vocab, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict:
        ids = self.data[index]
        return {"input_ids": ids, "labels": ids.clone()}


set_seed(0)
config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16)
model = GPT2LMHeadModel(config)
args = TrainingArguments(
    output_dir=cli.out,
    max_steps=cli.steps,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=cli.grad_accum,
    learning_rate=3e-3,
    warmup_steps=3,
    lr_scheduler_type="cosine",
    logging_steps=5,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    seed=0,
    dataloader_num_workers=cli.workers,
    disable_tqdm=True,
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(256, 16, config.vocab_size))
result = trainer.train()
trainer.save_model(cli.out)
if trainer.is_world_process_zero():
    print(f"done: global_step={result.global_step}", flush=True)
