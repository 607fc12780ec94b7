"""torchtitan on this machine's CPU: test scaffolding, never product code.

This folder goes on the PYTHONPATH of a torchtitan run in the tests and benchmarks, so that what
runs is exactly what a user runs, ``-m torchtitan.train``, unmodified: Python imports this
``sitecustomize`` at start-up, and it only installs an import hook (nothing else is imported: the
launcher's own processes start as they would). torchtitan is written for GPUs; when it is first
imported, what a CPU with gloo cannot do is changed, and nothing else:
- the device: torchtitan falls back to "cuda" when torch reports no accelerator; here it gets
  "cpu", with the few memory-report functions torchtitan asks of a device module;
- FlexAttention: its backward has no CPU kernel; the same attention (the block mask made dense,
  the log-sum-exp returned when asked for) is computed in plain tensor operations;
- FSDP2's gradient reduce-scatter: torchtitan sets a divide factor of 1, which FSDP2 sends as
  ``PREMUL_SUM(1.0)``, an operation gloo refuses; a sum with the same factor is the same number;
- ``torch.distributed.set_timeout``, missing from torch 2.13's CPU build: the groups keep their
  set-up timeout;
- the expert-parallel kernels module imports triton, which this machine lacks: a module that
  refuses when used stands in (the models these tests train never call it);
- gpt_oss's experts multiply in bfloat16 and return bfloat16 whatever the parameters' dtype; the
  token combine then adds them into a float32 buffer, which a CPU refuses: their output is cast back
  to the input's dtype, as torchtitan's base experts class does.
With ``TORCHTITAN_TEST_MOE_HIDDEN=N`` (and ``TORCHTITAN_TEST_MOE_LAYERS=L``), gpt_oss's debug model is
built with experts of hidden size N (and L layers) instead of 2,880 (and 4): 81.5M parameters train
at ~5 s a step on this CPU, a few million in a fraction of a second.
With ``TORCHTITAN_TEST_DIGESTS=DIR``, each rank also writes the SHA-256 of its model shards when
its trainer closes (``DIR/digest_rank{R}``): equal digests, bitwise-equal weights.

Why a start-up hook and not a wrapper script: a hot spare imports a script's leading imports
while it waits (``resilrun.worker_main.script_imports``); torchtitan must be changed whoever
imports it first. The tests run in a folder holding ``tests/assets`` (``tests/torchtitan_assets.py``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import math
import os
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

_PATCHED = "__resilrun_tests_cpu__"


def _cpu_device_module() -> types.ModuleType:
    import psutil
    import torch

    module = types.ModuleType("torchtitan_cpu_device")
    module.__dict__.update({name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("__")})
    total = psutil.virtual_memory().total
    module.current_device = lambda: 0  # an index, as barrier(device_ids=[...]) takes it (torch.cpu's is "cpu")
    module.get_device_name = lambda device=None: "cpu"
    module.get_device_properties = lambda device=None: types.SimpleNamespace(name="cpu", total_memory=total)
    module.memory_stats = lambda device=None: {}
    module.reset_peak_memory_stats = lambda device=None: None
    module.empty_cache = lambda: None
    return module


def _dense_attention(
    q: Any, k: Any, v: Any, mask: Any, scale: float | None, enable_gqa: bool, want_lse: bool
) -> tuple[Any, Any]:
    import torch

    if enable_gqa and k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if want_lse else None
    return torch.softmax(scores, dim=-1) @ v, lse


def _patch_flex_attention(attention: types.ModuleType) -> None:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    attention._compiled_create_block_mask = create_block_mask  # eager: no compiler run per launch

    def forward(self: Any, q_BLNH: Any, k_BLNH: Any, v_BLNH: Any, *, attention_masks: Any, **kwargs: Any) -> Any:
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        mask = create_mask(attention_masks.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
        if kwargs.get("score_mod") is not None:
            raise NotImplementedError("the CPU stand-in for FlexAttention takes no score_mod")
        out_transform = kwargs.get("out_transform")
        scale, gqa = kwargs.get("scale"), kwargs.get("enable_gqa", False)
        out, lse = _dense_attention(q, k, v, mask.to(torch.bool), scale, gqa, out_transform is not None)
        out_BLNH = out.transpose(1, 2)
        return out_BLNH if out_transform is None else out_transform(out_BLNH, lse.transpose(1, 2))

    attention.FlexAttention.forward = forward


def _patch_fsdp_sum() -> None:
    from torch.distributed.fsdp import FSDPModule

    own = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self: Any, factor: float) -> None:
        own(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def _stub_triton_kernels() -> None:
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    stub = types.ModuleType(name)

    def missing(attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{attribute} needs triton (a GPU); the CPU tests do not use expert-parallel kernels")

        return kernel

    stub.__getattr__ = missing  # type: ignore[method-assign]  # a module-level __getattr__ (PEP 562)
    sys.modules.setdefault(name, stub)


def _patch_gpt_oss(gpt_oss: types.ModuleType) -> None:
    from torchtitan.models.gpt_oss import moe

    own_forward = moe.GptOssGroupedExperts.forward

    def forward(self: Any, x: Any, num_tokens_per_expert: Any) -> Any:
        return own_forward(self, x, num_tokens_per_expert).to(x.dtype)

    moe.GptOssGroupedExperts.forward = forward
    hidden, layers = os.environ.get("TORCHTITAN_TEST_MOE_HIDDEN"), os.environ.get("TORCHTITAN_TEST_MOE_LAYERS")
    if hidden is None and layers is None:
        return
    own_layers = gpt_oss._build_gptoss_layers

    def build_layers(**kwargs: Any) -> Any:
        if kwargs.get("dim") == 256:  # the debug model's; the real flavours are left as they are
            kwargs["hidden_dim"] = int(hidden or kwargs["hidden_dim"])
            kwargs["n_layers"] = int(layers or kwargs["n_layers"])
        return own_layers(**kwargs)

    gpt_oss._build_gptoss_layers = build_layers


def apply() -> None:
    import torch
    import torch._utils
    import torch.distributed as dist

    if getattr(torch, _PATCHED, False):
        return
    device = _cpu_device_module()
    own_module = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type: device if device_type == "cpu" else own_module(device_type)
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: None
    _stub_triton_kernels()
    _patch_fsdp_sum()
    setattr(torch, _PATCHED, True)


def _record_digests(trainer_module: types.ModuleType) -> None:
    """Each rank writes the SHA-256 of its model shards when its trainer closes (``digest_rank{R}``)."""
    import hashlib

    folder = os.environ.get("TORCHTITAN_TEST_DIGESTS")
    if not folder:
        return
    trainer_class = trainer_module.Trainer
    own_close = trainer_class.close

    def close(self: Any) -> None:
        digest = hashlib.sha256()
        for part in getattr(self, "model_parts", []):
            for name, tensor in sorted(part.state_dict().items()):
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                digest.update(name.encode())
                digest.update(local.detach().contiguous().cpu().numpy().tobytes())
        if self.step > 0:
            with open(os.path.join(folder, f"digest_rank{os.environ['RANK']}"), "w", encoding="utf-8") as handle:
                handle.write(f"{self.step} {digest.hexdigest()}\n")
        own_close(self)

    trainer_class.close = close


class _Loader(importlib.abc.Loader):
    """A module's own loader, with ``after`` run once the module has executed."""

    def __init__(self, loader: importlib.abc.Loader, after: Callable[[types.ModuleType], None]) -> None:
        self._loader, self._after = loader, after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self._after(module)


class _OnTorchtitan(importlib.abc.MetaPathFinder):
    """Finds nothing itself: changes torch before torchtitan's first import, and two of
    torchtitan's modules right after theirs."""

    _AFTER: dict[str, Callable[[types.ModuleType], None]] = {
        "torchtitan.models.common.attention": _patch_flex_attention,
        "torchtitan.trainer": _record_digests,
        "torchtitan.models.gpt_oss": _patch_gpt_oss,
    }

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchtitan":
            apply()
        after = self._AFTER.get(fullname)
        if after is None or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.name = None
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, after)
        return spec


if not any(isinstance(finder, _OnTorchtitan) for finder in sys.meta_path):
    sys.meta_path.insert(0, _OnTorchtitan())
