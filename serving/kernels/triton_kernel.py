"""Triton kernels for tree attention (see serving/kernels/tree_attention.py for the public API).

Imported lazily by `tree_attention(..., impl="triton")` only: `triton.jit` decides between
compiled and interpreted kernels when this module is imported, so TRITON_INTERPRET=1 must
be set before the first import (the CPU tests do that).

Two launches, flash-decoding style:
1. `_tree_attn_split_kernel`, grid (row blocks, B * Hkv, num_prefix_splits + 1). Rows are
   the g*T (query head in the KV group, tree node) pairs of one KV head, so GQA reads each
   K/V block once for all g query heads. Splits 0..num_prefix_splits-1 each cover
   `split_size` keys of the S-key prefix, which every query sees; the last split covers
   the T tree keys (keys S_b .. S_b+T-1 of sequence b) under the packed ancestor mask. Each writes its partial unnormalised
   output, running max and sum-exp (fp32).
   bf16/fp16 dots run in the input dtype with fp32 accumulation (p is rounded to the value
   dtype, as in FlashAttention); fp32 dots are exact fp32 (input_precision="ieee", no TF32).
   Under TRITON_INTERPRET=1, bf16 takes the fp32 path (DOT_FP32): the interpreter (triton
   3.9) computes tl.dot on bf16 operands wrongly (garbage of order 1e10), so the native
   bf16 dot is only exercised on a GPU.
   A row that sees no key at all (S = 0 and an empty mask row) comes out NaN, like the
   dense reference; tree masks always include the node itself.
2. `_tree_attn_merge_kernel`, grid (B * Hq * T,): log-sum-exp merge of the partials,
   written in the output dtype through arbitrary output strides.

Shape legend: B batch, Hq query heads, Hkv KV heads, g = Hq // Hkv, T tree nodes,
S prefix keys, D head dim, W = ceil(T / 32) mask words, P = num_prefix_splits + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from triton import knobs


@dataclass(frozen=True)
class LaunchConfig:
    """The split kernel's launch shape (the merge kernel's follows from the head dim)."""

    block_m: int  # (query head, tree node) rows per program
    block_n: int  # keys per loop iteration; split sizes are multiples of it
    block_d: int  # the head dim padded to a power of two (tl.arange needs one)
    num_warps: int


def launch_config(head_dim: int, dtype, block_n: int = 32) -> LaunchConfig:
    """The one place the launch shape is chosen: `launch` runs it and the native compile test
    (serving/kernels/native.py) compiles it for every SM, dtype and head dim we claim.

    Chosen from the compile report (`python -m specheads.bench.gpu_kernels --compile-report`,
    README's GPU section), cuobjdump's registers and stack on sm_80 and sm_90. With the former
    BLOCK_M = 32 and 4 warps every kernel above head dim 64 spilled (bf16 at 128 on sm_90:
    255 registers, 80 B of stack; fp32: up to 10 KB) and fp32 at head dim 256 needed 172 KB
    of shared memory, over sm_80's 163 KB. Now: bf16/fp16 up to head dim 64 keep 32 rows and
    4 warps; up to 128, 16 rows (no spill but 16 B at 96 on sm_80); fp32, and any head dim above 128, 16 rows and 8
    warps (fp32 at 96-128 spills 40 B on sm_80 only; 256: 16-48 B, 150 KB of shared memory).
    The same shape serves both SMs."""
    import torch

    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32 or block_d > 128:
        block_m, num_warps = 16, 8
    else:
        block_m, num_warps = (16, 4) if block_d > 64 else (32, 4)
    return LaunchConfig(block_m=block_m, block_n=block_n, block_d=block_d, num_warps=num_warps)


@triton.jit
def _online_softmax_step(q, k_ptrs, v_ptrs, col_ok, visible, d_ok, m_i, l_i, acc, scale,
                         DOT_FP32: tl.constexpr):
    """One key block: fold keys [BLOCK_N] (`col_ok` in range) seen where `visible`
    [BLOCK_M, BLOCK_N] into the running max m_i, sum-exp l_i and unnormalised output acc."""
    k = tl.load(k_ptrs, mask=d_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
    v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    if DOT_FP32:
        s = tl.dot(q, k.to(tl.float32), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N] fp32
    else:
        s = tl.dot(q, k) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; shift by 0 so exp gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_shift)
    p = tl.exp(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _tree_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, prefix_lens_ptr, o_part_ptr, m_part_ptr, l_part_ptr,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mt,
    num_kv_heads, num_q_heads, group, num_tree, split_size, num_prefix_splits, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // num_kv_heads
    hkv = pid_bh % num_kv_heads
    prefix_len = tl.load(prefix_lens_ptr + b)  # this sequence's S

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] (head in group, node) pairs
    row_ok = rows < group * num_tree
    hq = hkv * group + rows // num_tree
    t = rows % num_tree
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + hq[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    v_base = v_ptr + b * stride_vb + hkv * stride_vh
    offs_n = tl.arange(0, BLOCK_N)

    if split < num_prefix_splits:
        # Prefix keys: visible to every query row. Splits past this sequence's S see no key.
        start = split * split_size
        end = tl.minimum(start + split_size, prefix_len)
        for n0 in range(start, end, BLOCK_N):
            cols = n0 + offs_n
            col_ok = cols < end
            visible = row_ok[:, None] & col_ok[None, :]
            m_i, l_i, acc = _online_softmax_step(
                q, k_base + cols[None, :] * stride_kn + d[:, None] * stride_kd,
                v_base + cols[:, None] * stride_vn + d[None, :] * stride_vd, col_ok, visible, d_ok,
                m_i, l_i, acc, scale, DOT_FP32)
    else:
        # Tree keys: bit j of row t's packed words says whether node t sees node j.
        mask_row = mask_ptr + b * stride_mb + t * stride_mt  # [BLOCK_M]
        for n0 in range(0, num_tree, BLOCK_N):
            cols = n0 + offs_n
            col_ok = cols < num_tree
            in_range = row_ok[:, None] & col_ok[None, :]
            words = tl.load(mask_row[:, None] + cols[None, :] // 32, mask=in_range, other=0)
            visible = in_range & (((words >> (cols[None, :] % 32)) & 1) != 0)
            key_cols = prefix_len + cols
            m_i, l_i, acc = _online_softmax_step(
                q, k_base + key_cols[None, :] * stride_kn + d[:, None] * stride_kd,
                v_base + key_cols[:, None] * stride_vn + d[None, :] * stride_vd, col_ok, visible, d_ok,
                m_i, l_i, acc, scale, DOT_FP32)

    # Partials: o_part [B, Hq, T, P, D], m_part / l_part [B, Hq, T, P], all contiguous fp32.
    num_parts = num_prefix_splits + 1
    part_row = ((b * num_q_heads + hq) * num_tree + t) * num_parts + split  # [BLOCK_M]
    tl.store(m_part_ptr + part_row, m_i, mask=row_ok)
    tl.store(l_part_ptr + part_row, l_i, mask=row_ok)
    tl.store(o_part_ptr + part_row[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _tree_attn_merge_kernel(
    o_part_ptr, m_part_ptr, l_part_ptr, out_ptr,
    stride_ob, stride_oh, stride_ot, stride_od,
    num_q_heads, num_tree, num_parts,
    HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)  # (b * Hq + h) * T + t
    t = row % num_tree
    h = (row // num_tree) % num_q_heads
    b = row // (num_tree * num_q_heads)
    parts = tl.arange(0, BLOCK_P)
    p_ok = parts < num_parts
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m = tl.load(m_part_ptr + row * num_parts + parts, mask=p_ok, other=float("-inf"))  # [BLOCK_P]
    l = tl.load(l_part_ptr + row * num_parts + parts, mask=p_ok, other=0.0)
    o = tl.load(o_part_ptr + (row * num_parts + parts)[:, None] * HEAD_DIM + d[None, :],
                mask=p_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_P, BLOCK_D]
    m_max = tl.max(m, 0)
    weight = tl.exp(m - m_max)  # parts with no visible key (m = -inf) weigh 0
    total = tl.sum(weight * l, 0)
    out = tl.sum(weight[:, None] * o, 0) / total  # [BLOCK_D]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + t * stride_ot + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


def launch(q, k, v, packed_mask, prefix_lens, max_prefix_len: int, scale: float, split_size: int, out,
           block_n: int = 32) -> None:
    """Run both kernels; `out` [B, Hq, T, D] (any strides) receives the result.

    q [B, Hq, T, D]; k, v [B, Hkv, >= max S+T, D]; packed_mask int32 [B or 1, T, W];
    prefix_lens int32 [B] (S per sequence, on q's device), max_prefix_len = max S;
    split_size: prefix keys per program, a multiple of block_n.
    """
    import torch

    batch, num_q_heads, num_tree, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    num_prefix_splits = triton.cdiv(max_prefix_len, split_size)
    num_parts = num_prefix_splits + 1
    o_part = torch.empty(batch, num_q_heads, num_tree, num_parts, head_dim, device=q.device, dtype=torch.float32)
    m_part = torch.empty(batch, num_q_heads, num_tree, num_parts, device=q.device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    config = launch_config(head_dim, q.dtype, block_n)
    block_m, block_d = config.block_m, config.block_d
    stride_mb = packed_mask.stride(0) if packed_mask.shape[0] > 1 else 0
    grid = (triton.cdiv(group * num_tree, block_m), batch * num_kv_heads, num_parts)
    _tree_attn_split_kernel[grid](
        q, k, v, packed_mask, prefix_lens, o_part, m_part, l_part,
        *q.stride(), *k.stride(), *v.stride(), stride_mb, packed_mask.stride(1),
        num_kv_heads, num_q_heads, group, num_tree, split_size, num_prefix_splits, scale,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_FP32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and knobs.runtime.interpret),
        num_warps=config.num_warps,
    )
    _tree_attn_merge_kernel[(batch * num_q_heads * num_tree,)](
        o_part, m_part, l_part, out, *out.stride(), num_q_heads, num_tree, num_parts,
        HEAD_DIM=head_dim, BLOCK_P=max(2, triton.next_power_of_2(num_parts)), BLOCK_D=block_d,
    )
