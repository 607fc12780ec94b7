"""Recovery-benchmark worker for torchrun: plain DDP, a DCP checkpoint every 10 steps, resume from it.

What a careful torchrun user writes today: ``torch.distributed.checkpoint`` (DCP) saves of model
and optimizer every ``--save-every`` completed steps, and on (re)start a resume from the newest
complete checkpoint (DCP writes ``.metadata`` last, so its presence marks completeness). The
failure is rank ``--kill-rank`` SIGKILLing itself when step ``--kill-step`` starts, in the first
attempt only (``TORCHELASTIC_RESTART_COUNT == 0``): the same moment resilrun's fault plan picks.
"""

from __future__ import annotations

import time

SCRIPT_START = time.time()  # before heavy imports: a restarted worker pays them again

import os  # noqa: E402 - the stamp above must precede the imports
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from _recovery_common import EventLog, build_model, checksum, parse_args, set_up_work, state_mib, train_step  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

IMPORTED = time.time()


def newest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """(steps completed, directory) of the newest checkpoint whose save finished, if any."""
    done = [(int(p.name.split("_")[1]), p) for p in root.glob("step_*") if (p / ".metadata").exists()]
    return max(done) if done else None


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = EventLog(args.events, rank)
    log.write("phase", "start", SCRIPT_START)
    log.write("phase", "imported", IMPORTED)
    dist.init_process_group("gloo")
    log.write("phase", "init")
    set_up_work(args.setup, args.setup_cpu)  # the script's set-up: paid again by every restarted worker
    model = build_model(args.mib)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    log.write("phase", "ddp")
    if rank == 0:
        log.write("config", f"{state_mib(model):.1f}")
    root = Path(args.ckpt_dir)
    start = 0
    found = newest_checkpoint(root)
    if found is not None:
        start, path = found
        model_sd, optim_sd = get_state_dict(ddp, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(ddp, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed from {path.name}", file=sys.stderr, flush=True)
    log.write("phase", "first")
    for step in range(start, args.steps):
        if attempt == 0 and rank == args.kill_rank and step == args.kill_step:
            log.write("kill", step)
            os.kill(os.getpid(), signal.SIGKILL)
        train_step(ddp, opt, step, rank, args.sleep)
        if rank == 0:
            log.write("step", step)
        completed = step + 1
        if completed % args.save_every == 0 and completed < args.steps:
            model_sd, optim_sd = get_state_dict(ddp, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / f"step_{completed:06d}"))
    if rank == 0:
        log.write("done", checksum(model))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
