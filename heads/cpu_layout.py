"""How the frozen target runs fast on a CPU: the fast dtype, and linear weights packed once.

Two decisions, both made here and applied behind the target adapter (heads/target.py), never in
the drafters or the accept rule:

- dtype "auto": bf16 on a CPU with native bf16 arithmetic (AVX512-BF16 or AMX), fp32 on any
  other CPU (bf16 would be emulated there and slower than fp32), bf16 on a CUDA GPU. fp32 stays
  the exact mode: there, greedy speculation is token-identical to the target's own decoding.
- packed linear weights: `nn.Linear` calls `F.linear`, whose fp32 path re-packs the weight
  matrix into the BLAS layout on every call with more than one row, and whose bf16 path does
  not use oneDNN's blocked layout. `PackedLinear` holds the weight reordered once, at load,
  into oneDNN's layout (`torch.ops.mkldnn._reorder_linear_weight`) and multiplies with
  `_linear_pointwise`. Measured on SmolLM2-135M, 2 cores, one forward after a 128-token prefix
  (README "Speed on a CPU"): fp32 39 -> 23 ms at T=1, 60 -> 27 ms at T=8; bf16 20.6 -> 15.8 ms
  at T=1, 24.2 -> 19.4 ms at T=8.

Packing keeps the plain weights (the `Parameter`s are shared, not copied): heads read the
target's lm_head and embeddings through them, and `PackedWeights.plain()` swaps the plain
`nn.Linear`s back for a baseline that must run transformers as a user would (the bench's
HF methods). The packed copy costs as much memory as the linear weights themselves.

Only for inference: the packed op has no autograd, so training (and PEFT, which wraps
`nn.Linear`) loads the target unpacked.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX512-BF16 or AMX tiles)."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(check is not None for check in checks):
        return any(check() for check in checks if check is not None)
    try:  # an older torch without the probes: the kernel's own flags
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = set(cpuinfo.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def auto_dtype(device: str | torch.device) -> torch.dtype:
    """The fast dtype of `device` (module docstring): bf16 on CUDA and on CPUs with native bf16."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def packing_pays(dtype: torch.dtype, device: str | torch.device) -> bool:
    """Whether `pack_linears` applies: a CPU with oneDNN, fp32 or bf16 weights."""
    return torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available() and dtype in PACKED_DTYPES


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight is reordered once into oneDNN's layout (module docstring).

    `weight` and `bias` are the original `Parameter`s (same state-dict keys, shared storage);
    `packed_weight` is a non-persistent buffer. Input [..., in_features] -> [..., out_features].
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


@dataclass
class _Swap:
    parent: nn.Module
    name: str
    plain: nn.Linear
    packed: PackedLinear


class PackedWeights:
    """The linear layers of one model, packed in place; `plain()` undoes it for a while."""

    def __init__(self, swaps: list[_Swap]):
        self.swaps = swaps

    @property
    def num_packed(self) -> int:
        return len(self.swaps)

    @contextlib.contextmanager
    def plain(self):
        """The model with its original `nn.Linear`s inside the block, packed again after it."""
        for swap in self.swaps:
            setattr(swap.parent, swap.name, swap.plain)
        try:
            yield
        finally:
            for swap in self.swaps:
                setattr(swap.parent, swap.name, swap.packed)


def pack_linears(model: nn.Module) -> PackedWeights:
    """Replace every `nn.Linear` of a frozen model by a `PackedLinear` (in place)."""
    if any(param.requires_grad for param in model.parameters()):
        raise ValueError("pack_linears is for frozen inference models: the packed op has no autograd")
    swaps = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:  # subclasses (PEFT's, quantized ones) keep their own forward
                swaps.append(_Swap(parent, name, child, PackedLinear(child)))
                setattr(parent, name, swaps[-1].packed)
    return PackedWeights(swaps)
