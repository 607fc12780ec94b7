"""The Hugging Face Trainer script benchmarks/framework_overhead.py runs under each launcher.

Written as users write it for torchrun: the Trainer's own checkpoints every --save-steps and
``resume_from_checkpoint`` when one exists (what a torchrun restart relies on). Nothing of
resilrun is in it. The fault is the benchmark's, not the script's: a callback SIGKILLs rank
--kill-rank as optimizer step --kill-step starts, once per job (a marker file remembers it), so
the same kill hits both launchers.
"""

import os

import torch
from _framework_bench import Bench, parse_args
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

cli = parse_args()
bench = Bench(cli)


class Tokens(Dataset):
    def __init__(self, count: int, length: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.data[index], "labels": self.data[index].clone()}


class Stamps(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001, ANN003
        bench.step_begins(state.global_step)

    def on_step_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001, ANN003
        bench.step_ended(state.global_step)


set_seed(0)
config = GPT2Config(n_layer=cli.layers, n_embd=cli.width, n_head=4, vocab_size=512, n_positions=64)
args = TrainingArguments(
    output_dir=cli.out,
    max_steps=cli.steps,
    per_device_train_batch_size=8,
    learning_rate=1e-3,
    warmup_steps=4,
    lr_scheduler_type="cosine",
    logging_steps=10,
    save_strategy="steps" if cli.save_steps else "no",
    save_steps=cli.save_steps or 500,
    report_to="none",
    use_cpu=True,
    seed=0,
    disable_tqdm=True,
)
trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(4096, 64, 512), callbacks=[Stamps()])
last = get_last_checkpoint(cli.out) if os.path.isdir(cli.out) else None
trainer.train(resume_from_checkpoint=last)
if bench.rank == 0:
    print(f"done: resumed_from={last}", flush=True)
# As torch recommends: without it, plain torchrun's workers sometimes abort at exit (gloo's threads:
# "terminate called without an active exception"), failing a run whose every step completed.
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
