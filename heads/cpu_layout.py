"""How the frozen target runs fast on a CPU: the fast dtype, linear weights packed once, and
attention over the KV heads.

Three decisions, all made here and applied behind the target adapter (heads/target.py), never in
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
- grouped attention (`grouped_attention_forward`, registered with transformers as
  "specheads_cpu"): with a mask and more than one query token, transformers' SDPA path copies
  every KV head `group` times (`repeat_kv`) in every layer, and torch's CPU SDPA kernel is slow
  for masked, batched rows. Here the query heads of one KV head are stacked into one matrix and
  multiplied with that KV head directly (two batched matmuls and an fp32 softmax). SmolLM2's
  shapes (9 query / 3 KV heads, head dim 64), bf16, one layer: 96 rows x 1 token over 512 keys
  3.8 -> 2.0 ms; one row x 16 tokens over 316 keys 0.148 -> 0.114 ms. One row x one token
  keeps SDPA (0.040 against 0.065 ms), and so does anything this path does not cover.

Packing keeps the plain weights (the `Parameter`s are shared, not copied): heads read the
target's lm_head and embeddings through them, and `PackedWeights.plain()` swaps the plain
`nn.Linear`s (and SDPA) back for a baseline that must run transformers as a user would (the
bench's HF methods). The packed copy costs as much memory as the linear weights themselves.

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
CPU_ATTENTION = "specheads_cpu"


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


def grouped_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, Hq, T, D], key/value [B, Hkv, K, D], a bool
    mask [B, 1, T, K] (True = attend) -> ([B, T, Hq, D], None). Query head h reads KV head
    h // group, as `repeat_kv` lays them out. Scores and softmax in fp32; a row with no key to
    attend to (a padded batch row) averages instead of making NaN. Anything else (no, a float
    or a per-head mask, dropout, a single query token in a single row, extra kwargs such as
    sinks) goes to transformers' own SDPA function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, num_q_heads, num_new, head_dim = query.shape
    covered = (attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1
               and not dropout and batch * num_new > 1 and not kwargs.get("s_aux")
               and key.shape[-1] == value.shape[-1])
    if not covered:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    num_kv_heads, num_keys = key.shape[1], key.shape[2]
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if scaling is None else scaling
    query_BHGD = query.reshape(batch, num_kv_heads, group * num_new, head_dim)  # G = group * T rows per KV head
    # A cache hands out [B, Hkv, :K, D] views of longer buffers. bmm would copy them itself, through
    # a slow strided clone of the transposed view; one dense copy first halves the attention
    # (96 rows x 512 keys of SmolLM2 in bf16: 5.3 -> 2.8 ms a layer).
    key, value = key.contiguous(), value.contiguous()
    scores = torch.matmul(query_BHGD, key.transpose(-1, -2)).view(batch, num_kv_heads, group, num_new, num_keys)
    visible_B11TK = attention_mask[:, :, None, :, :num_keys]  # a mask may be longer than the keys, as SDPA allows
    scores = scores.float().mul_(scale).masked_fill_(~visible_B11TK, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(batch, num_kv_heads, group * num_new, num_keys)
    out_BHTD = torch.matmul(probs, value).view(batch, num_q_heads, num_new, head_dim)
    return out_BHTD.transpose(1, 2), None


def register_cpu_attention() -> str:
    """Register "specheads_cpu" with transformers (idempotent); masks are built as for SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CPU_ATTENTION, grouped_attention_forward)
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    return CPU_ATTENTION


class PackedWeights:
    """The linear layers of one model, packed in place, and its SDPA attention swapped for the
    grouped one; `plain()` undoes both for a while."""

    def __init__(self, swaps: list[_Swap], model: nn.Module | None = None, plain_attention: str | None = None):
        self.swaps = swaps
        self.model = model
        self.plain_attention = plain_attention  # the implementation transformers loaded; None: not swapped

    @property
    def num_packed(self) -> int:
        return len(self.swaps)

    @contextlib.contextmanager
    def plain(self):
        """The model as transformers loaded it inside the block (original `nn.Linear`s and
        attention), packed again after it."""
        attention = getattr(self.model.config, "_attn_implementation", None)  # the engine may have set its own
        for swap in self.swaps:
            setattr(swap.parent, swap.name, swap.plain)
        if self.plain_attention is not None:
            self.model.set_attn_implementation(self.plain_attention)
        try:
            yield
        finally:
            for swap in self.swaps:
                setattr(swap.parent, swap.name, swap.packed)
            if self.plain_attention is not None:
                self.model.set_attn_implementation(attention)


def pack_linears(model: nn.Module) -> PackedWeights:
    """Replace every `nn.Linear` of a frozen model by a `PackedLinear`, and its "sdpa"
    attention by the grouped one (in place)."""
    if any(param.requires_grad for param in model.parameters()):
        raise ValueError("pack_linears is for frozen inference models: the packed op has no autograd")
    swaps = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:  # subclasses (PEFT's, quantized ones) keep their own forward
                swaps.append(_Swap(parent, name, child, PackedLinear(child)))
                setattr(parent, name, swaps[-1].packed)
    plain_attention = getattr(model.config, "_attn_implementation", None)
    if plain_attention == "sdpa":
        model.set_attn_implementation(register_cpu_attention())
    return PackedWeights(swaps, model, plain_attention if plain_attention == "sdpa" else None)
