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


INTERPRETER_SM = 80  # the configuration the CPU tests run under TRITON_INTERPRET (any one runs there)


@dataclass(frozen=True)
class LaunchConfig:
    """How both kernels are launched for one head dim, dtype and SM."""

    block_m: int  # split: (query head, tree node) rows per program
    block_n: int  # split: keys per loop iteration; divides tree_attention.SPLIT_MULTIPLE
    block_d: int  # the head dim padded to a power of two (tl.arange needs one; masked past HEAD_DIM)
    num_warps: int  # split
    num_stages: int  # split: software-pipelined K/V loads in flight
    merge_num_warps: int


def launch_config(head_dim: int, dtype, sm: int) -> LaunchConfig:
    """The one place the launch shape is chosen: `launch` runs it on the device's SM, and the
    native compile test (serving/kernels/native.py) compiles it for sm_80 and sm_90 at every
    dtype and head dim we claim. SMs from 90 up take the sm_90 choice, the others sm_80's.

    Chosen from the compile report (`python -m specheads.bench.gpu_kernels --compile-report`,
    README's GPU section): registers and stack from `cuobjdump -res-usage` of the JIT's own
    specialisation of a Llama-8B-shaped verify call (64-node tree, 4k prefix). The rule: the
    largest BLOCK_M (rows sharing each K/V block: fewer programs re-read the same keys) whose
    kernel neither spills nor exceeds the SM's shared memory; then the warps with more
    resident warps per SM; BLOCK_N 32, since 64 doubles the K/V tiles for no fewer registers.
    - bf16/fp16: BLOCK_M 64, 8 warps at every head dim on both SMs, no spill (sm_80 128/163/
      180 registers at block_d 64/128/256; sm_90 100/153/179). 4 warps at head dim 256
      reached 255 registers (16 B of stack on sm_80); smaller blocks at 8 warps spilled 8-16 B
      on sm_90 (BLOCK_M 32 at 64, 16 at 128); BLOCK_N 64 at 256 needed 164-256 KB of shared
      memory.
    - fp32 (exact dots, no tensor-core bf16 path): BLOCK_M 32 at head dim 64 (4 warps on
      sm_80, 128 registers, where 8 warps spill 8 B; 8 warps on sm_90, 69 registers, where 4
      warps hit 255); BLOCK_M 16 with 8 warps above 64, since BLOCK_M 32 spilled 8 B to 1 KB
      on both SMs and BLOCK_M 64 up to 9 KB.
    - num_stages 2 (double-buffered K/V): registers, not shared memory, limit the 16-bit
      choices' residency, and 2 stages need 30-45% less shared memory than 3 (bf16 256 on
      sm_90: 104 against 144 KB; fp32 256: 84 against 150 KB), so the sm_80 choices, which
      sm_86/89 also take, fit those GPUs' 99 KB (84 KB at most). fp32 at 256 on sm_90
      spills 16 B at 2 or 3 stages and none at 1 (100 registers, 80 KB), so it takes 1 there.
    - merge: 4 warps up to block_d 128 (64-96 registers), 8 at 256 (4 warps: 183 registers,
      8 warps: 101 and twice the resident warps); 1-2 warps spill from block_d 128.
    """
    import torch

    block_d = max(16, triton.next_power_of_2(head_dim))
    hopper = sm >= 90
    merge_num_warps = 8 if block_d > 128 else 4
    if dtype != torch.float32:
        return LaunchConfig(block_m=64, block_n=32, block_d=block_d, num_warps=8, num_stages=2,
                            merge_num_warps=merge_num_warps)
    if block_d <= 64:
        return LaunchConfig(block_m=32, block_n=32, block_d=block_d, num_warps=8 if hopper else 4, num_stages=2,
                            merge_num_warps=merge_num_warps)
    num_stages = 1 if hopper and block_d > 128 else 2
    return LaunchConfig(block_m=16, block_n=32, block_d=block_d, num_warps=8, num_stages=num_stages,
                        merge_num_warps=merge_num_warps)


def device_sm(device) -> int:
    """`device`'s compute capability as one number (90 for sm_90); INTERPRETER_SM off CUDA."""
    import torch

    if device.type != "cuda":
        return INTERPRETER_SM
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


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


def kernel_calls(q, k, v, packed_mask, prefix_lens, max_prefix_len: int, scale: float, split_size: int, out,
                 config: LaunchConfig) -> tuple[KernelCall, KernelCall]:
    """The split and merge launches for these tensors (see `launch`), partials allocated on q's
    device (meta tensors give the calls without memory, which is how native.py builds them)."""
    import torch

    batch, num_q_heads, num_tree, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    num_prefix_splits = triton.cdiv(max_prefix_len, split_size)
    num_parts = num_prefix_splits + 1
    o_part = torch.empty(batch, num_q_heads, num_tree, num_parts, head_dim, device=q.device, dtype=torch.float32)
    m_part = torch.empty(batch, num_q_heads, num_tree, num_parts, device=q.device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    stride_mb = packed_mask.stride(0) if packed_mask.shape[0] > 1 else 0
    split = KernelCall(
        "split", _tree_attn_split_kernel,
        (triton.cdiv(group * num_tree, config.block_m), batch * num_kv_heads, num_parts),
        (q, k, v, packed_mask, prefix_lens, o_part, m_part, l_part,
         *q.stride(), *k.stride(), *v.stride(), stride_mb, packed_mask.stride(1),
         num_kv_heads, num_q_heads, group, num_tree, split_size, num_prefix_splits, scale),
        dict(HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=config.block_d,
             DOT_FP32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and knobs.runtime.interpret),
             num_warps=config.num_warps, num_stages=config.num_stages))
    merge = KernelCall(
        "merge", _tree_attn_merge_kernel, (batch * num_q_heads * num_tree,),
        (o_part, m_part, l_part, out, *out.stride(), num_q_heads, num_tree, num_parts),
        dict(HEAD_DIM=head_dim, BLOCK_P=max(2, triton.next_power_of_2(num_parts)), BLOCK_D=config.block_d,
             num_warps=config.merge_num_warps))
    return split, merge


def launch(q, k, v, packed_mask, prefix_lens, max_prefix_len: int, scale: float, split_size: int, out) -> None:
    """Run both kernels; `out` [B, Hq, T, D] (any strides) receives the result.

    q [B, Hq, T, D]; k, v [B, Hkv, >= max S+T, D]; packed_mask int32 [B or 1, T, W];
    prefix_lens int32 [B] (S per sequence, on q's device), max_prefix_len = max S;
    split_size: prefix keys per program, a multiple of tree_attention.SPLIT_MULTIPLE (which
    every configuration's block_n divides).
    """
    config = launch_config(q.shape[-1], q.dtype, device_sm(q.device))
    for call in kernel_calls(q, k, v, packed_mask, prefix_lens, max_prefix_len, scale, split_size, out, config):
        call.kernel[call.grid](*call.args, **call.meta)
