"""How the frozen target runs fast on a CPU: the fast dtype, linear weights packed once, and
attention over the KV heads.

Three decisions, all made here and applied behind the target adapter (heads/target/adapter.py), never in
the drafters or the accept rule:

- dtype "auto" (decided in heads/target/cpu_decoder.py's `auto_dtype`, which knows what the fused
  forward runs): bf16 on a CPU with native bf16 arithmetic (AVX512-BF16 or AMX) and on a CUDA GPU.
  On any other CPU, torch's bf16 is emulated and slower than fp32, so training and the model's
  own forward take fp32; an inference load of a model the fused forward runs takes bf16 there
  too, its linear layers in heads/target/cpu_gemm.py's AVX2 kernel (bf16 weights, fp32 sums).
  fp32 stays the exact mode: there, greedy speculation is token-identical to the target's own
  decoding.
- packed linear weights: `nn.Linear` calls `F.linear`, whose fp32 path re-packs the weight
  matrix into the BLAS layout on every call with more than one row, and whose bf16 path does
  not use oneDNN's blocked layout. `PackedLinear` holds the weight reordered once, at load,
  into oneDNN's layout (`torch.ops.mkldnn._reorder_linear_weight`) and multiplies with
  `_linear_pointwise`. Measured on SmolLM2-135M, 2 cores, one forward after a 128-token prefix
  (docs/results/2026-11-26-cpu-forward.md): fp32 39 -> 23 ms at T=1, 60 -> 27 ms at T=8; bf16 20.6 -> 15.8 ms
  at T=1, 24.2 -> 19.4 ms at T=8.
- grouped attention (`grouped_attention_forward`, registered with transformers as
  "specheads_cpu"): with a mask and more than one query token, transformers' SDPA path copies
  every KV head `group` times (`repeat_kv`) in every layer, and torch's CPU SDPA kernel is slow
  for masked, batched rows. Here the query heads of one KV head are stacked into one matrix and
  multiplied with that KV head directly (two batched matmuls and an fp32 softmax). SmolLM2's
  shapes (9 query / 3 KV heads, head dim 64), bf16, one layer: 96 rows x 1 token over 512 keys
  3.8 -> 2.0 ms; one row x 16 tokens over 316 keys 0.148 -> 0.114 ms. One row x one token
  goes to the kernel below (with or without a mask; SDPA took about 130 us a layer for one
  query over 200 cached keys in the engine, the kernel about 20 us), or without it keeps SDPA
  (0.040 against 0.065 ms for the bmm path), and so does anything this path does not cover.
  Rows of one batch attend to different lengths (continuous batching mixes a first turn's
  100 keys with a third turn's 800), and each row reads only its own: where a C compiler is
  found, heads/target/cpu_attention.py's kernel reads them in place in the cache; elsewhere the
  rows are sorted by how many keys they see and each bucket of rows multiplies only its own
  longest length (`_row_buckets`), its keys and values gathered into a scratch buffer that
  every layer and step reuses. 96 rows at 100-800 keys (mean 410), bf16, one layer: the
  dense copy of the keys and values alone took 15.5 ms (a fresh copy per layer paid more in
  page faults than in copying), the bucketed attention 2.5-4 ms, the kernel 1.0 ms; a
  decode step of SmolLM2 at those lengths 655 ms, then 173-198 ms, then 100-103 ms.

Packing keeps the plain weights (the `Parameter`s are shared, not copied): heads read the
target's lm_head and embeddings through them, and `PackedWeights.plain()` swaps the plain
`nn.Linear`s (and SDPA) back for a baseline that must run transformers as a user would (the
bench's HF methods). The packed copy costs as much memory as the linear weights themselves.

Only for inference: the packed op has no autograd, so training (and PEFT, which wraps
`nn.Linear`) loads the target unpacked.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math
import threading
from dataclasses import dataclass

import torch
from torch import nn

from specheads.heads.target import cpu_attention

PACKED_DTYPES = (torch.float32, torch.bfloat16)
CPU_ATTENTION = "specheads_cpu"
# Row buckets of the grouped attention: 1, 2, 4 or 8 of equal row counts, whichever reads the
# fewest keys counting each bucket's own calls as BUCKET_COST_ROW_KEYS more (about 75 us a
# layer against about 125 ns a row and key, SmolLM2 in bf16). 96 rows at 100-800 keys, one
# layer: 1 bucket 7.9 ms, 2: 3.9, 4: 2.7, 8: 2.5, 12: 2.8.
ROW_BUCKET_COUNTS = (1, 2, 4, 8)
BUCKET_COST_ROW_KEYS = 600


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


def packing_pays(dtype: torch.dtype, device: str | torch.device) -> bool:
    """Whether `pack_linears` applies: a CPU with oneDNN, fp32 or bf16 weights."""
    return torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available() and dtype in PACKED_DTYPES


@functools.cache
def onednn_reorders_bf16() -> bool:
    """Whether oneDNN can lay bf16 weights out on this CPU: its bf16 reorder needs AVX512BW, VL
    and DQ, or AVX-NE-CONVERT (on an AVX2-only CPU it raises)."""
    from specheads.heads.target.cpu_kernels import cpu_flags

    flags = set(cpu_flags().split())
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


def reorders(dtype: torch.dtype) -> bool:
    """Whether `pack_weight` takes weights of `dtype` here."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_reorders_bf16())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear weight [out, in] reordered once into oneDNN's layout (module docstring)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_matmul(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ a `pack_weight` weight (+ bias) -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


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
        self.register_buffer("packed_weight", pack_weight(linear.weight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.packed_weight, self.bias)

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
    h // group, as `repeat_kv` lays them out. Each row reads only the keys it sees (module
    docstring: the ragged kernel, else buckets of rows). Scores and softmax in fp32; a row
    with no key to attend to (a padded batch row) gets a finite output instead of NaN.
    Anything else (a float or a per-head mask, no mask over several query tokens, dropout,
    extra kwargs such as sinks; without the kernel also no mask at all, or a single query
    token in a single row) goes to transformers' own SDPA function."""
    batch, num_q_heads, num_new, head_dim = query.shape
    kernel = cpu_attention.supports(query, key, value)
    masked = attention_mask is not None and attention_mask.dtype is torch.bool and attention_mask.shape[1] == 1
    covered = (not dropout and not kwargs.get("s_aux") and key.shape[-1] == value.shape[-1]
               and (masked and (batch * num_new > 1 or kernel) or attention_mask is None and num_new == 1 and kernel))
    if not covered:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scale = head_dim ** -0.5 if scaling is None else scaling
    if kernel:  # each row's own keys, read in place (heads/target/cpu_attention.py); no mask: all of them
        return cpu_attention.grouped_attention(query, key, value, attention_mask, scale), None
    num_kv_heads, num_keys = key.shape[1], key.shape[2]
    group = num_q_heads // num_kv_heads
    query_BHGD = query.reshape(batch, num_kv_heads, group * num_new, head_dim)  # G = group * T rows per KV head
    visible_B1TK = attention_mask[..., :num_keys]  # a mask may be longer than the keys, as SDPA allows
    out_BHGD = torch.empty_like(query_BHGD)
    for rows_N, length in _row_buckets(visible_B1TK):
        # bmm reads strided views of the cache through a slow clone, so each bucket's keys and
        # values are gathered densely first, into reused scratch memory.
        num_rows = batch if rows_N is None else rows_N.shape[0]
        keys = _SCRATCH.take(0, key, (num_rows, num_kv_heads, length, head_dim))
        values = _SCRATCH.take(1, value, keys.shape)
        if rows_N is None:  # every row, in order
            keys.copy_(key[:, :, :length])
            values.copy_(value[:, :, :length])
            query_NHGD, visible_N1TK = query_BHGD, visible_B1TK
        else:
            torch.index_select(key[:, :, :length], 0, rows_N, out=keys)
            torch.index_select(value[:, :, :length], 0, rows_N, out=values)
            query_NHGD, visible_N1TK = query_BHGD.index_select(0, rows_N), visible_B1TK.index_select(0, rows_N)
        scores = torch.matmul(query_NHGD, keys.transpose(-1, -2))
        scores = scores.view(num_rows, num_kv_heads, group, num_new, length).float().mul_(scale)
        scores = scores.masked_fill_(~visible_N1TK[:, :, None, :, :length], torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(value.dtype).view(num_rows, num_kv_heads, group * num_new, length)
        if rows_N is None:
            torch.matmul(probs, values, out=out_BHGD)
        else:
            out_BHGD.index_copy_(0, rows_N, torch.matmul(probs, values))
    return out_BHGD.view(batch, num_q_heads, num_new, head_dim).transpose(1, 2), None


def _row_lengths(visible_B1TK: torch.Tensor) -> torch.Tensor:
    """[B] the keys each row reads: its last visible column + 1, at least 1 (a row that sees
    nothing stays finite)."""
    num_keys = visible_B1TK.shape[-1]
    seen_BK = visible_B1TK.any(dim=2)[:, 0]
    return (num_keys - seen_BK.flip(-1).to(torch.uint8).argmax(dim=-1)).masked_fill_(~seen_BK.any(-1), 1)


def _row_buckets(visible_B1TK: torch.Tensor) -> list[tuple[torch.Tensor | None, int]]:
    """The rows in buckets of similar visible lengths (ROW_BUCKET_COUNTS) -> [(row indices
    [N], or None for every row in order; the keys that bucket reads, `_row_lengths`)]."""
    batch = visible_B1TK.shape[0]
    lens_B = _row_lengths(visible_B1TK)
    order_B = torch.argsort(lens_B)
    sorted_lens = lens_B[order_B].tolist()

    def bounds(num_buckets: int) -> list[int]:
        return [batch * i // num_buckets for i in range(num_buckets + 1)]

    def cost(num_buckets: int) -> int:
        edges = bounds(num_buckets)
        return sum((hi - lo) * sorted_lens[hi - 1] + BUCKET_COST_ROW_KEYS for lo, hi in zip(edges, edges[1:]))

    best = min((count for count in ROW_BUCKET_COUNTS if count <= batch), key=cost)
    if best == 1:
        return [(None, sorted_lens[-1])]
    edges = bounds(best)
    return [(order_B[lo:hi], sorted_lens[hi - 1]) for lo, hi in zip(edges, edges[1:])]


class _ScratchBuffers(threading.local):
    """Flat buffers that the grouped attention gathers keys and values into, grown as needed
    and reused by every layer and step (per thread: a server's engine thread owns its own)."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def take(self, slot: int, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous tensor of `shape` in like's dtype and device, over slot's buffer."""
        num = math.prod(shape)
        key = (slot, like.dtype, like.device, torch.is_inference_mode_enabled())  # inference tensors stay inside
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < num:
            buffer = self.buffers[key] = torch.empty(num, dtype=like.dtype, device=like.device)
        return buffer[:num].view(shape)


_SCRATCH = _ScratchBuffers()


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
        self.active = True  # False inside `plain()`

    def unpack(self, which) -> None:
        """Put the plain `nn.Linear` back for every `PackedLinear` that `which(packed)` selects,
        and drop its packed copy (heads/target/cpu_decoder.py holds those weights fused instead)."""
        kept = []
        for swap in self.swaps:
            if which(swap.packed):
                setattr(swap.parent, swap.name, swap.plain)
            else:
                kept.append(swap)
        self.swaps = kept

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
        self.active = False
        try:
            yield
        finally:
            self.active = True
            for swap in self.swaps:
                setattr(swap.parent, swap.name, swap.packed)
            if self.plain_attention is not None:
                self.model.set_attn_implementation(attention)


def packed_for_inference(module: nn.Module) -> nn.Module:
    """A copy of `module` (draft heads) whose fp32/bf16 CPU `nn.Linear`s run packed, for drafting
    under no_grad: oneDNN's layout (`PackedLinear`) where it takes the dtype here, else bf16 through
    heads/target/cpu_gemm.py's AVX2 kernel (`PackedBf16Module`) where that is built, and there an
    EAGLE-3 head's layers as two kernel calls each (heads/target/cpu_gemm_layer.py
    `PackedHeadLayer`; AVX2-only Zen 3, 2 threads: SmolLM2's head, a step over 2 tokens plus its
    draft logits, 1.91 -> 1.37 ms between verifies, which evict its weights). Its parameters
    and buffers are the original's (shared, not copied), so it costs only the packed weights; the
    original keeps its `nn.Linear`s and trains as before. Weights changed after the copy are not
    seen by its packed layers: build it from final weights. SmolLM2's EAGLE-3 head, bf16: a
    depth-1 draft 1.0 -> 0.9 ms, depth 3 2.6 -> 2.1 ms (`bench/step_costs.py`); end to end (3-node tree,
    6 MT-bench prompts x 96 tokens, three interleaved runs each) 117.7 against 115.8 tok/s, within
    run-to-run noise."""
    from specheads.heads.target import cpu_gemm

    shared = {id(tensor): tensor for tensor in itertools.chain(module.parameters(), module.buffers())}
    packed = copy.deepcopy(module, memo=shared)
    fused = set()  # modules inside a PackedHeadLayer: it runs their weights itself
    if cpu_gemm.available() and not reorders(torch.bfloat16):
        from specheads.heads.eagle3 import DecoderLayer, MidLayer
        from specheads.heads.target.cpu_gemm_layer import PackedHeadLayer

        for parent in list(packed.modules()):
            for name, child in list(parent.named_children()):
                if type(child) in (MidLayer, DecoderLayer) and _bf16_on_cpu(child):
                    setattr(parent, name, PackedHeadLayer(child))
                    fused.update(id(m) for m in child.modules())
    for parent in list(packed.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu" or id(child) in fused:
                continue
            dtype = child.weight.dtype
            if dtype in PACKED_DTYPES and reorders(dtype):
                setattr(parent, name, PackedLinear(child))
            elif dtype == torch.bfloat16 and cpu_gemm.available():
                setattr(parent, name, cpu_gemm.PackedBf16Module(child))
    return packed


def _bf16_on_cpu(layer: nn.Module) -> bool:
    """Whether every parameter of `layer` is a bf16 CPU tensor and its linear layers have no bias
    (an EAGLE-3 head layer that heads/target/cpu_gemm_layer.py `PackedHeadLayer` runs)."""
    return all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in layer.parameters()) \
        and all(m.bias is None for m in layer.modules() if isinstance(m, nn.Linear))


def pack_linears(model: nn.Module) -> PackedWeights:
    """Replace every `nn.Linear` of a frozen model by a `PackedLinear` (where oneDNN can lay out
    its dtype here: `reorders`; elsewhere the layers stay, for heads/target/cpu_decoder.py's own
    kernels), and its "sdpa" attention by the grouped one (in place)."""
    if any(param.requires_grad for param in model.parameters()):
        raise ValueError("pack_linears is for frozen inference models: the packed op has no autograd")
    swaps = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # subclasses (PEFT's, quantized ones) keep their own forward
            if type(child) is nn.Linear and reorders(child.weight.dtype):
                swaps.append(_Swap(parent, name, child, PackedLinear(child)))
                setattr(parent, name, swaps[-1].packed)
    plain_attention = getattr(model.config, "_attn_implementation", None)
    if plain_attention == "sdpa":
        model.set_attn_implementation(register_cpu_attention())
    return PackedWeights(swaps, model, plain_attention if plain_attention == "sdpa" else None)
