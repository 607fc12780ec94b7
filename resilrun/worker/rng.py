"""The random generators a training step may draw from (torch, CUDA, Python's ``random``, NumPy),
as one trackable object: every snapshot holds them, so a restored step draws what a failure-free
run draws (dropout masks, shuffles, augmentation). Used by ``Job`` and by the framework
integrations, which keep a loop position's generators beside it."""

from __future__ import annotations

import random
from typing import Any

import torch


class RngState:
    """The random generators a step may draw from, tracked without being asked."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        # Python's Mersenne Twister state (625 ints) as a tensor: as JSON it would be 7.5 KiB of
        # every commit message, encoded and parsed at every step.
        python = (version, torch.tensor(internal, dtype=torch.int64), gauss)
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": python}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        try:
            import numpy as np

            state["numpy"] = np.random.get_state()
        except ImportError:
            pass
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"].cpu())
        version, internal, gauss = state["python"]
        if isinstance(internal, torch.Tensor):
            internal = internal.tolist()
        random.setstate((version, tuple(int(v) for v in internal), gauss))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
        if "numpy" in state:
            import numpy as np

            np.random.set_state(state["numpy"])
