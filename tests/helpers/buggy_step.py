"""A three-call-API script with a deterministic bug: rank 1 always fails at step 5."""

import torch

import resilrun

job = resilrun.init()
weights = torch.zeros(4)
job.track(weights=weights)
for step in job.steps(total=20):
    if job.rank == 1 and step == 5:
        raise ValueError("bad batch at step 5")
    torch.distributed.all_reduce(weights)
    weights += 1
