"""A torchrun script that checkpoints itself, written the way PyTorch's DDP fault-tolerance tutorial
teaches: every node's local rank 0 ``torch.save``s a snapshot every few epochs, and every worker
loads it at start if ``os.path.exists``. Nothing in it knows about resilrun.

Under torchrun a failure restarts every worker and each reloads the snapshot from its own disk; on
hosts without a shared file system a host that replaces a lost one has no snapshot and starts at
epoch 0 while the others resume. Under resilrun with ``--capture-dir`` the snapshot is also kept on
a peer (and in ``--checkpoint-uri``), and put back into the folder before any worker starts:

    resilrun --standalone --nproc-per-node 2 --max-restarts 2 --capture-dir . \\
        --capture-pattern snapshot.pt examples/train_snapshot_torchrun.py 12 2

Arguments as in the tutorial: total epochs, save every N epochs, ``--batch_size``; plus
``--sleep`` (seconds per batch, for fault tests), ``--snapshot_path`` and ``--hidden`` (the hidden
layer's width: a wider one makes a snapshot big enough for its save to be timed, as
benchmarks/captured_checkpoints.py does; the default keeps the tutorial's small model). The
"Training snapshot saved" line ends with how long ``torch.save`` took, the stall a save costs the
training loop.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RegressionData(Dataset):
    """A fixed dataset: item i is the same on every host and every run."""

    def __init__(self, size: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, 20, generator=gen)
        self.y = self.x.sum(dim=1, keepdim=True).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def ddp_setup() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
        sleep: float,
    ) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.sleep = sleep
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            print(f"[rank {self.global_rank}] Loading snapshot", flush=True)
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[self.local_rank] if torch.cuda.is_available() else None)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[rank {self.global_rank}] Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        batch, steps = self.train_data.batch_size, len(self.train_data)
        print(f"[rank {self.global_rank}] Epoch {epoch} | Batchsize: {batch} | Steps: {steps}", flush=True)
        self.train_data.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for source, targets in self.train_data:
            self._run_batch(source.to(self.device), targets.to(self.device))
            if self.sleep:
                time.sleep(self.sleep)
        print(f"[rank {self.global_rank}] Epoch {epoch} done", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        started = time.perf_counter()
        torch.save(snapshot, self.snapshot_path)
        took = time.perf_counter() - started
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path} in {took:.3f} s", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def checksum(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def main(total_epochs: int, save_every: int, batch_size: int, snapshot_path: str, sleep: float, hidden: int) -> None:
    ddp_setup()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    dataset = RegressionData(256)
    loader = DataLoader(
        dataset, batch_size=batch_size, pin_memory=False, shuffle=False, sampler=DistributedSampler(dataset)
    )
    trainer = Trainer(model, loader, optimizer, save_every, snapshot_path, sleep)
    trainer.train(total_epochs)
    print(
        f"[rank {trainer.global_rank}] finished at epoch {total_epochs - 1} checksum {checksum(trainer.model.module)}",
        flush=True,
    )
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot_path", default="snapshot.pt", help="Where the snapshot is saved and loaded")
    parser.add_argument("--sleep", default=0.0, type=float, help="Extra seconds per batch (fault tests)")
    parser.add_argument("--hidden", default=64, type=int, help="Hidden layer width (a bigger snapshot)")
    args = parser.parse_args()
    main(args.total_epochs, args.save_every, args.batch_size, args.snapshot_path, args.sleep, args.hidden)
