"""A worker that starts a helper process of its own (a tokenizer server, a metrics sidecar, a
prefetcher), once per process, as scripts do, and trains on the three-call API.

The helper does not watch its parent: when the worker dies, only the launcher can end it. Each
helper's pid is written to ``--out/helper_<pid of the worker>`` for the test to look at.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import resilrun

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()

if "HELPER_PID" not in os.environ:  # once per process: a recovered survivor runs this script again
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    os.environ["HELPER_PID"] = str(helper.pid)
    (args.out / f"helper_{os.getpid()}").write_text(os.environ["HELPER_PID"])

job = resilrun.init()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.track(model=model, optimizer=opt)
for step in job.steps(total=args.steps):
    loss = model(torch.full((4, 8), float(step))).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.1)
os.kill(int(os.environ["HELPER_PID"]), 15)
