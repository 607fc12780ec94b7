"""A NumPy leaf of a snapshot tree comes back as a host array whatever device its tensor is on.

Found on a GPU machine: a CUDA job's restore makes private copies of values on its GPU, and
numpy's RNG state (a NumPy array inside a tuple) then failed to convert ("can't convert cuda:0
device type tensor to numpy"), so a killed worker's replacement could not resume.
"""

from __future__ import annotations

import numpy as np
import torch

from resilrun.snapshot.tree import flatten, unflatten


class _OnAccelerator:
    """Stands in for a tensor on a GPU (this machine has none): only a host copy converts."""

    def __init__(self, host: torch.Tensor) -> None:
        self._host = host

    def cpu(self) -> torch.Tensor:
        return self._host

    def numpy(self) -> np.ndarray:
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first.")


def test_a_numpy_leaf_restored_from_a_tensor_on_an_accelerator_is_a_host_array() -> None:
    state = np.random.RandomState(7).get_state()
    tensors, tree = flatten({"numpy": state}, "_rng")
    on_device = {name: _OnAccelerator(tensor) for name, tensor in tensors.items()}
    restored = unflatten(tree, on_device)  # type: ignore[arg-type]
    assert isinstance(restored["numpy"][1], np.ndarray)
    np.random.set_state(restored["numpy"])
    assert np.random.randint(1 << 30) == np.random.RandomState(7).randint(1 << 30)
