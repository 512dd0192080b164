"""Triton kernels for tree attention (see serving/kernels/tree_attention.py for the public API).

Imported lazily by `tree_attention(..., impl="triton")` only: `triton.jit` decides between
compiled and interpreted kernels when this module is imported, so TRITON_INTERPRET=1 must
be set before the first import (the CPU tests do that).

Two launches, flash-decoding style:
1. `_tree_attn_split_kernel`, grid (row blocks, B * Hkv, num_prefix_splits + 1). Rows are
   the g*T (query head in the KV group, tree node) pairs of one KV head, so GQA reads each
   K/V block once for all g query heads. Splits 0..num_prefix_splits-1 share the S-key
   prefix, which every query sees: each sequence's prefix is cut into whole BLOCK_N key
   blocks spread evenly over the splits, on the device from its own S, so the grid depends
   only on the launch's bound on S (a CUDA graph stays valid as the prefix grows). The last
   split covers the T tree keys (keys S_b .. S_b+T-1 of sequence b) under the packed
   ancestor mask. Each writes its partial unnormalised output, running max and sum-exp (fp32).
2. `_tree_attn_merge_kernel`, grid (B * Hq * T,): log-sum-exp merge of the partials,
   written in the output dtype through arbitrary output strides.

Rounding (16-bit inputs), at FlashAttention's points: scores accumulated in fp32 with the
softmax scale applied in fp32 (folded with log2(e), as FlashAttention does, so p = exp2(s -
m)); p in fp32, its row sum in fp32, p rounded once to the value dtype for the PV product,
accumulated in fp32; partials and their merge in fp32; one rounding of the output.
fp32 inputs: exact fp32 dots (input_precision="ieee", no TF32).

Under TRITON_INTERPRET=1 the interpreter computes tl.dot on bf16 operands wrongly (it
multiplies their raw bits) and truncates fp32 -> bf16 casts, where the GPU rounds to nearest
even. So bf16 runs the GPU's arithmetic emulated (DotMode.EMULATED): the bf16 operands are
widened to fp32, where their products are exact, and dotted with fp32 accumulation (what a
bf16 tensor-core dot computes, up to summation order), and every cast to bf16 rounds to
nearest even on the bits first. The casts, the rounding of p, the scale, the merge and the
output cast are the code the GPU runs. fp16 needs none of this (numpy has float16).

A row that sees no key at all (S = 0 and an empty mask row) comes out NaN, like the dense
reference; tree masks always include the node itself.

Shape legend: B batch, Hq query heads, Hkv KV heads, g = Hq // Hkv, T tree nodes,
S prefix keys, D head dim, W = ceil(T / 32) mask words, P = num_prefix_splits + 1,
R = B * Hq * T output rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import triton
import triton.language as tl
from triton import knobs

INTERPRETER_SM = 80  # the configuration the CPU tests run under TRITON_INTERPRET (any one runs there)
INTERPRETER_NUM_SMS = 4  # the SMs the split rule fills under TRITON_INTERPRET: a few splits, quickly run
LOG2E = 1.4426950408889634
MIN_SPLIT_KEYS = 128  # the fewest prefix keys a split is cut to: below it the partials cost more than they share
MAX_PREFIX_SPLITS = 128
MERGE_PART_CHUNK = 32  # partials the merge folds per step: its registers do not grow with the split count


class DotMode:
    """How `_dot` multiplies (a constexpr of both kernels)."""

    NATIVE = 0  # 16-bit operands on the tensor cores, fp32 accumulation
    EXACT_FP32 = 1  # fp32 operands, IEEE fp32 products (no TF32)
    EMULATED = 2  # bf16 under the interpreter: the GPU's native arithmetic, in fp32 (module docstring)


@dataclass(frozen=True)
class LaunchConfig:
    """How both kernels are launched for one row count, head dim, dtype and SM."""

    block_m: int  # split: (query head, tree node) rows per program
    block_n: int  # split: keys per loop iteration; prefix splits are whole blocks of it
    block_d: int  # the head dim padded to a power of two (tl.arange needs one; masked past HEAD_DIM)
    num_warps: int  # split
    num_stages: int  # split: software-pipelined K/V loads in flight
    merge_num_warps: int
    blocks_per_sm: int  # split programs one SM holds at once (the compile report's occupancy)


@dataclass(frozen=True)
class LaunchPlan:
    """A launch's configuration and grid: fixed by the shapes, the bound on S and the GPU."""

    config: LaunchConfig
    row_blocks: int  # ceil(g * T / block_m)
    num_prefix_splits: int

    @property
    def num_parts(self) -> int:
        return self.num_prefix_splits + 1

    def split_grid(self, batch: int, num_kv_heads: int) -> tuple[int, int, int]:
        return self.row_blocks, batch * num_kv_heads, self.num_parts


# (block_m, block_d) -> (block_n, num_warps, num_stages, blocks_per_sm) per SM family: the
# compile report's pick (launch_config's docstring says how it picks).
_HALF_CONFIGS = {
    90: {(16, 64): (64, 4, 3, 5), (32, 64): (64, 4, 3, 4), (64, 64): (64, 8, 3, 2), (128, 64): (64, 8, 3, 1),
         (16, 128): (64, 4, 2, 3), (32, 128): (64, 4, 3, 2), (64, 128): (32, 8, 3, 2), (128, 128): (32, 8, 3, 1),
         (16, 256): (32, 8, 3, 2), (32, 256): (32, 8, 3, 2), (64, 256): (32, 8, 3, 1)},
    80: {(16, 64): (64, 4, 2, 6), (32, 64): (64, 4, 2, 4), (64, 64): (64, 4, 3, 2),
         (16, 128): (64, 8, 3, 2), (32, 128): (64, 4, 2, 3), (64, 128): (64, 8, 2, 1),
         (16, 256): (64, 8, 2, 2), (32, 256): (32, 8, 2, 2), (64, 256): (32, 8, 2, 1)},
}
_FP32_CONFIGS = {
    90: {(16, 64): (32, 8, 2, 3), (16, 128): (32, 8, 2, 3), (16, 256): (32, 8, 2, 2)},
    80: {(16, 64): (32, 8, 2, 3), (16, 128): (16, 4, 2, 5), (16, 256): (32, 8, 2, 1)},
}


def launch_config(head_dim: int, dtype, sm: int, rows: int = 64) -> LaunchConfig:
    """The one place the launch shape is chosen: `plan` runs it on the device's SM, and the
    native compile test (serving/kernels/native.py) compiles it for sm_80 and sm_90 at every
    dtype and head dim we claim, for plain decode steps and 16- and 64-node trees. SMs from
    90 up take the sm_90 table, the others sm_80's (which sm_86/89 take too). rows: g * T,
    the (query head, tree node) rows that share one KV head.

    BLOCK_M is the rows rounded up to a power of two, from 16 (tl.dot's least) to 64, or to
    128 for 16-bit inputs at head dims up to 128 on sm_90 (two warpgroups on one wgmma tile):
    a plain decode step (g * T = 4) runs 16-row programs, not 64-row ones that are three
    quarters padding and hold the registers of all 64; a 64-node tree (256 rows at g = 4)
    runs 2 row blocks, each reading the K/V once for its 128 rows, not 4.

    The rest is the compile report's pick (`python -m specheads.bench.gpu.kernels
    --compile-report`: registers, stack and shared memory of the JIT's own specialisation
    of a Llama-8B-shaped layer) among BLOCK_N 32/64 (16/32 for fp32) x 4/8 warps x 2/3
    stages (1/2 for fp32), compiled for a 64-node tree and checked for a plain step and a
    16-node tree (ptxas allocates differently for T = 1, where the JIT makes T a constant):
    no spill, at most 232 registers (headroom for another ptxas), at most 96 KB of shared
    memory on the sm_80 table (sm_86/89 hold 99 KB); then the most K/V bytes in flight per
    SM (resident programs x (stages - 1) x BLOCK_N: the kernel is memory-bound below about
    200 rows per KV head, bf16 on an H200), then the most resident warps, then fewer stages.
    `blocks_per_sm` is the least residency the compile report finds for that configuration
    over those shapes, which the split rule fills (`prefix_splits`). Head dims below 64 take the
    64 row, those above 256 the 256 row. fp32 (the exact mode, not the speed path): BLOCK_M
    16 (larger blocks spill at some tree sizes), and the same pick.
    """
    import torch

    block_d = max(16, triton.next_power_of_2(head_dim))
    family = 90 if sm >= 90 else 80
    block_m = max(16, triton.next_power_of_2(max(1, rows)))
    merge_num_warps = 8 if block_d > 128 else 4
    if dtype == torch.float32:
        table, block_m = _FP32_CONFIGS[family], 16
    else:
        table, block_m = _HALF_CONFIGS[family], min(block_m, 128 if family == 90 and block_d <= 128 else 64)
    block_n, num_warps, num_stages, blocks_per_sm = table[(block_m, min(256, max(64, block_d)))]
    return LaunchConfig(block_m=block_m, block_n=block_n, block_d=block_d, num_warps=num_warps,
                        num_stages=num_stages, merge_num_warps=merge_num_warps, blocks_per_sm=blocks_per_sm)


def prefix_splits(max_prefix_len: int, programs_per_split: int, num_sms: int, config: LaunchConfig,
                  split_size: int | None = None) -> int:
    """How many programs share the prefix (FlashDecoding's split): enough that the split
    kernel's programs, the tree split's included, fill every SM's resident slots once
    (num_sms * blocks_per_sm), with at least MIN_SPLIT_KEYS keys each and at most
    MAX_PREFIX_SPLITS; or ceil(max S / split_size) when the caller sets a split size. It
    depends on the bound on S only, never on the sequences' own lengths."""
    if max_prefix_len <= 0:
        return 0
    if split_size is not None:
        if split_size < 1:
            raise ValueError(f"split_size must be >= 1, got {split_size}")
        return math.ceil(max_prefix_len / split_size)
    fill = num_sms * config.blocks_per_sm // programs_per_split - 1
    return max(1, min(fill, math.ceil(max_prefix_len / MIN_SPLIT_KEYS), MAX_PREFIX_SPLITS))


def plan(batch: int, num_q_heads: int, num_kv_heads: int, num_tree: int, head_dim: int, dtype,
         max_prefix_len: int, sm: int, num_sms: int, split_size: int | None = None) -> LaunchPlan:
    """The launch for these shapes on a GPU of `num_sms` SMs of compute capability `sm`."""
    rows = num_q_heads // num_kv_heads * num_tree
    config = launch_config(head_dim, dtype, sm, rows)
    row_blocks = triton.cdiv(rows, config.block_m)
    splits = prefix_splits(max_prefix_len, row_blocks * batch * num_kv_heads, num_sms, config, split_size)
    return LaunchPlan(config=config, row_blocks=row_blocks, num_prefix_splits=splits)


def device_sm(device) -> tuple[int, int]:
    """(`device`'s compute capability as one number, 90 for sm_90; its SM count); the
    interpreter's stand-ins off CUDA."""
    import torch

    if device.type != "cuda":
        return INTERPRETER_SM, INTERPRETER_NUM_SMS
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor, torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _dot(a, b, MODE: tl.constexpr):
    """a @ b accumulated in fp32 (see DotMode)."""
    if MODE == 0:
        return tl.dot(a, b)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _round_to(x, dtype: tl.constexpr, MODE: tl.constexpr):
    """fp32 x -> dtype, rounded to nearest even (the GPU's cvt.rn). Under DotMode.EMULATED
    the rounding is done on the bits first, since the interpreter's bf16 cast truncates."""
    if MODE == 2:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _fold_block(q, k, v, visible, m_i, l_i, acc, qk_scale, MODE: tl.constexpr):
    """One key block: fold k [BLOCK_D, BLOCK_N], v [BLOCK_N, BLOCK_D], seen where `visible`
    [BLOCK_M, BLOCK_N] (or [1, BLOCK_N]), into the running max m_i (log2 units), sum-exp l_i
    [BLOCK_M] and unnormalised output acc [BLOCK_M, BLOCK_D], all fp32."""
    s = _dot(q, k, MODE) * qk_scale  # [BLOCK_M, BLOCK_N]: fp32 scores, scaled in fp32
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(s - m_shift[:, None])  # fp32; its row sum is taken before p is rounded
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(_round_to(p, v.dtype, MODE), v, MODE)
    return m_new, l_i, acc


@triton.jit
def _tree_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, prefix_lens_ptr, o_part_ptr, m_part_ptr, l_part_ptr,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mt,
    num_kv_heads, num_q_heads, group, num_tree, uniform_prefix_len, num_prefix_splits, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PER_SEQUENCE: tl.constexpr, MODE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // num_kv_heads
    hkv = pid_bh % num_kv_heads
    if PER_SEQUENCE:
        prefix_len = tl.load(prefix_lens_ptr + b).to(tl.int32)  # this sequence's S
    else:
        prefix_len = uniform_prefix_len

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] (head in group, node) pairs
    row_ok = rows < group * num_tree
    hq = hkv * group + rows // num_tree
    t = rows % num_tree
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    b64 = b.to(tl.int64)  # a large cache's batch offset passes 2**31 elements
    q = tl.load(q_ptr + b64 * stride_qb + hq[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + b64 * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = v_ptr + b64 * stride_vb + hkv.to(tl.int64) * stride_vh
    offs_n = tl.arange(0, BLOCK_N)

    if split < num_prefix_splits:
        # Prefix keys, visible to every row: this split's share of the sequence's key blocks
        # (balanced to one block; splits past a short sequence's blocks see no key).
        num_blocks = tl.cdiv(prefix_len, BLOCK_N)
        start = (split * num_blocks // num_prefix_splits) * BLOCK_N
        end = tl.minimum((split + 1) * num_blocks // num_prefix_splits * BLOCK_N, prefix_len)
        k_ptrs = k_base + (start + offs_n)[None, :] * stride_kn + d[:, None] * stride_kd  # [BLOCK_D, BLOCK_N]
        v_ptrs = v_base + (start + offs_n)[:, None] * stride_vn + d[None, :] * stride_vd  # [BLOCK_N, BLOCK_D]
        for n0 in range(start, end, BLOCK_N):
            col_ok = n0 + offs_n < end
            k = tl.load(k_ptrs, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = _fold_block(q, k, v, col_ok[None, :], m_i, l_i, acc, qk_scale, MODE)
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    else:
        # Tree keys: bit j of row t's packed words says whether node t sees node j.
        mask_row = mask_ptr + b * stride_mb + t * stride_mt  # [BLOCK_M]
        for n0 in range(0, num_tree, BLOCK_N):
            cols = n0 + offs_n
            col_ok = cols < num_tree
            words = tl.load(mask_row[:, None] + cols[None, :] // 32, mask=row_ok[:, None] & col_ok[None, :], other=0)
            visible = ((words >> (cols[None, :] % 32)) & 1) != 0
            key_cols = prefix_len + cols
            k = tl.load(k_base + key_cols[None, :] * stride_kn + d[:, None] * stride_kd,
                        mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_base + key_cols[:, None] * stride_vn + d[None, :] * stride_vd,
                        mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = _fold_block(q, k, v, visible, m_i, l_i, acc, qk_scale, MODE)

    # Partials: o_part [P, R, D], m_part / l_part [P, R], fp32; one block's rows are contiguous.
    num_rows = tl.num_programs(1) // num_kv_heads * num_q_heads * num_tree
    part = split.to(tl.int64) * num_rows
    row = (b * num_q_heads + hq) * num_tree + t  # [BLOCK_M]
    tl.store(m_part_ptr + part + row, m_i, mask=row_ok)
    tl.store(l_part_ptr + part + row, l_i, mask=row_ok)
    tl.store(o_part_ptr + part * HEAD_DIM + row[:, None] * HEAD_DIM + d[None, :], acc,
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _tree_attn_merge_kernel(
    o_part_ptr, m_part_ptr, l_part_ptr, out_ptr,
    stride_ob, stride_oh, stride_ot, stride_od,
    num_q_heads, num_tree, num_parts,
    HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, PART_CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
    MODE: tl.constexpr,
):
    row = tl.program_id(0)  # (b * Hq + h) * T + t
    num_rows = tl.num_programs(0)
    t = row % num_tree
    h = (row // num_tree) % num_q_heads
    b = row // (num_tree * num_q_heads)
    parts = tl.arange(0, BLOCK_P)
    p_ok = parts < num_parts
    m = tl.load(m_part_ptr + parts.to(tl.int64) * num_rows + row, mask=p_ok, other=float("-inf"))  # [BLOCK_P]
    l = tl.load(l_part_ptr + parts.to(tl.int64) * num_rows + row, mask=p_ok, other=0.0)
    m_max = tl.max(m, 0)
    total = tl.sum(tl.math.exp2(m - m_max) * l, 0)  # parts with no visible key (m = -inf) weigh 0
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(0, num_parts, PART_CHUNK):
        chunk = p0 + tl.arange(0, PART_CHUNK)
        chunk_ok = chunk < num_parts
        chunk_row = chunk.to(tl.int64) * num_rows + row  # [PART_CHUNK]
        m_c = tl.load(m_part_ptr + chunk_row, mask=chunk_ok, other=float("-inf"))
        o_c = tl.load(o_part_ptr + chunk_row[:, None] * HEAD_DIM + d[None, :],
                      mask=chunk_ok[:, None] & d_ok[None, :], other=0.0)  # [PART_CHUNK, BLOCK_D]
        acc += tl.sum(tl.math.exp2(m_c - m_max)[:, None] * o_c, 0)
    out = acc / total  # [BLOCK_D], fp32 until the one rounding below
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + t * stride_ot + d * stride_od,
             _round_to(out, out_ptr.dtype.element_ty, MODE), mask=d_ok)


@dataclass(frozen=True)
class KernelCall:
    """One kernel launch as the launcher builds it: `kernel[grid](*args, **meta)`. native.py
    compiles the same call for a GPU it does not have, so it gets the JIT's own specialisation
    (strides equal to 1 become constants, multiples of 16 are marked aligned)."""

    name: str  # "split" | "merge"
    kernel: triton.JITFunction
    grid: tuple[int, ...]
    args: tuple
    meta: dict  # constexprs and compile options (num_warps, num_stages)


def dot_mode(dtype) -> int:
    """The DotMode for inputs of `dtype` here (EMULATED for bf16 under the interpreter)."""
    import torch

    if dtype == torch.float32:
        return DotMode.EXACT_FP32
    return DotMode.EMULATED if dtype == torch.bfloat16 and knobs.runtime.interpret else DotMode.NATIVE


def kernel_calls(q, k, v, packed_mask, prefix_len, max_prefix_len: int, scale: float, out,
                 launch_plan: LaunchPlan) -> tuple[KernelCall, KernelCall]:
    """The split and merge launches for these tensors (see `launch`), partials allocated on q's
    device (meta tensors give the calls without memory, which is how native.py builds them)."""
    import torch

    batch, num_q_heads, num_tree, head_dim = q.shape
    num_kv_heads = k.shape[1]
    config, num_parts = launch_plan.config, launch_plan.num_parts
    num_rows = batch * num_q_heads * num_tree
    o_part = torch.empty(num_parts, num_rows, head_dim, device=q.device, dtype=torch.float32)
    m_part = torch.empty(num_parts, num_rows, device=q.device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    per_sequence = isinstance(prefix_len, torch.Tensor)
    stride_mb = packed_mask.stride(0) if packed_mask.shape[0] > 1 else 0
    mode = dot_mode(q.dtype)
    split = KernelCall(
        "split", _tree_attn_split_kernel, launch_plan.split_grid(batch, num_kv_heads),
        (q, k, v, packed_mask, prefix_len if per_sequence else None, o_part, m_part, l_part,
         *q.stride(), *k.stride(), *v.stride(), stride_mb, packed_mask.stride(1),
         num_kv_heads, num_q_heads, num_q_heads // num_kv_heads, num_tree, 0 if per_sequence else prefix_len,
         launch_plan.num_prefix_splits, scale * LOG2E),
        dict(HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=config.block_d,
             PER_SEQUENCE=per_sequence, MODE=mode, num_warps=config.num_warps, num_stages=config.num_stages))
    merge = KernelCall(
        "merge", _tree_attn_merge_kernel, (num_rows,),
        (o_part, m_part, l_part, out, *out.stride(), num_q_heads, num_tree, num_parts),
        dict(HEAD_DIM=head_dim, BLOCK_P=max(2, triton.next_power_of_2(num_parts)),
             PART_CHUNK=min(MERGE_PART_CHUNK, max(2, triton.next_power_of_2(num_parts))), BLOCK_D=config.block_d,
             MODE=mode, num_warps=config.merge_num_warps))
    return split, merge


def launch(q, k, v, packed_mask, prefix_len, max_prefix_len: int, scale: float, out,
           split_size: int | None = None, wrap=None) -> LaunchPlan:
    """Run both kernels; `out` [B, Hq, T, D] (any strides) receives the result. -> the plan run.

    q [B, Hq, T, D]; k, v [B, Hkv, >= max S+T, D]; packed_mask int32 [B or 1, T, W];
    prefix_len: S as an int, or per sequence as an integer tensor [B] on q's device (read on
    the device: no sync), with max_prefix_len >= every S; split_size: see `prefix_splits`;
    wrap: applied to each kernel before its launch (torch.library.wrap_triton in the custom op).
    """
    batch, num_q_heads, num_tree, head_dim = q.shape
    sm, num_sms = device_sm(q.device)
    launch_plan = plan(batch, num_q_heads, k.shape[1], num_tree, head_dim, q.dtype, max_prefix_len, sm, num_sms,
                       split_size)
    for call in kernel_calls(q, k, v, packed_mask, prefix_len, max_prefix_len, scale, out, launch_plan):
        kernel = call.kernel if wrap is None else wrap(call.kernel)
        kernel[call.grid](*call.args, **call.meta)
    return launch_plan
