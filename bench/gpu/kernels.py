"""The GPU suite's kernel sections (bench/gpu/suite.py runs them): the Triton tree-attention
kernel against its PyTorch references and SDPA's error (parity, with a torch.compile check
and a bf16 control for the lossless section), and against SDPA and other launch
configurations (speed), plus the timing helpers every section uses. Imports torch and the
project's kernel modules (and, to time a graph, serving/decode/graphs.py; for the bf16
control, bench/gpu/models.py's random targets).

Shape legend: B batch, Hq / Hkv query / KV heads, T tree tokens, S prefix keys, D head dim.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from specheads.bench.gpu.models import hf_greedy, random_llama, random_prompts
from specheads.bench.support import random_tree_mask, time_ms

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}  # relative L2, as in the tests


def graph_ms(calls: list, device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds per call of `calls` (zero-argument functions) replayed as one CUDA
    graph: the kernels' own time, without the Python and launch time of an eager call (which
    is most of it for one attention layer at batch 1)."""
    from specheads.serving.decode.graphs import capture

    graph, _ = capture(lambda: [call() for call in calls], device, warmup_runs=1)
    return time_ms(graph.replay, device, warmup, repeats) / len(calls)


# --- 1. kernel parity -------------------------------------------------------------------
FLASH_ULPS = 2.0  # 16-bit output against the flash-rounded reference, in ulps of each row's largest |value|
SDPA_FACTOR = 1.1  # 16-bit error against fp32, at most this times SDPA's on the same inputs
ULP_BITS = {torch.bfloat16: 7, torch.float16: 10}  # mantissa bits


def row_ulps(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """max |out - ref| in units of the last place (of `dtype`) of each row's largest |ref|."""
    top = ref.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    return ((out.float() - ref.float()).abs() / 2.0 ** (torch.floor(torch.log2(top)) - ULP_BITS[dtype])).max().item()


def sdpa_tree(q, k, v, prefix_len: int, tree_mask: torch.Tensor) -> torch.Tensor:
    """PyTorch's SDPA (its default backend choice) on the same inputs, the tree as a dense mask."""
    import torch.nn.functional as F

    num_tree = q.shape[2]
    mask = torch.ones(num_tree, prefix_len + num_tree, dtype=torch.bool, device=q.device)
    mask[:, prefix_len:] = tree_mask
    keys, values = (x[:, :, :prefix_len + num_tree] for x in (k, v))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def _parity_row(ctx, dtype: torch.dtype, case: tuple) -> dict:
    from specheads.serving.kernels.tree_attention import (tree_attention, tree_attention_flash_reference,
                                                          tree_attention_reference)

    batch, num_kv_heads, group, num_tree, prefix_len, head_dim = case
    generator = torch.Generator().manual_seed(sum(case))
    # q as a transposed view of [B, T, Hq, D], the layout transformers hands over.
    q = torch.randn(batch, num_tree, num_kv_heads * group, head_dim, generator=generator).transpose(1, 2)
    k, v = (torch.randn(batch, num_kv_heads, prefix_len + num_tree, head_dim, generator=generator) for _ in range(2))
    q, k, v = (x.to(ctx.device, dtype) for x in (q, k, v))
    tree_mask = random_tree_mask(num_tree, generator).to(ctx.device)
    out = tree_attention(q, k, v, prefix_len, tree_mask, impl="triton")
    ref = tree_attention_reference(q.float(), k.float(), v.float(), prefix_len, tree_mask)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    row = dict(dtype=str(dtype)[6:], shape="B{}Hkv{}g{}T{}S{}D{}".format(*case), rel_err=rel,
               max_abs_err=(out.float() - ref).abs().max().item(), tolerance=TOLERANCE[dtype],
               passed=bool(rel <= TOLERANCE[dtype]))
    if dtype != torch.float32:  # held to FlashAttention's rounding, and to SDPA's error on the same inputs
        sdpa = sdpa_tree(q, k, v, prefix_len, tree_mask).float()
        row.update(flash_ulps=row_ulps(out, tree_attention_flash_reference(q, k, v, prefix_len, tree_mask), dtype),
                   sdpa_rel_err=((sdpa - ref).norm() / ref.norm()).item())
        row["passed"] = row["passed"] and row["flash_ulps"] <= FLASH_ULPS and rel <= SDPA_FACTOR * row["sdpa_rel_err"]
    return row


def compiled_check(ctx) -> dict:
    """torch.compile(fullgraph=True) of a function calling the tree attention (the operator
    torch.ops.specheads.tree_attention_): its output against eager, and on a GPU whether
    inductor's code launches the Triton kernels itself (the operator decomposed) or calls
    the operator as an opaque fallback."""
    from specheads.serving.kernels.tree_attention import pack_tree_mask, tree_attention

    if ctx.device.type != "cuda":
        return {"skipped": "on the CPU the interpreted kernels are an opaque operator "
                           "(tests/serving/kernels/test_custom_op.py compiles it there)"}
    from torch._inductor.utils import run_and_get_code

    num_q_heads, num_kv_heads, head_dim = ctx.layer
    prefix_len, num_tree = 1024, 16
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, num_q_heads, num_tree, head_dim, generator=generator)
    k, v = (torch.randn(1, num_kv_heads, prefix_len + num_tree, head_dim, generator=generator) for _ in range(2))
    q, k, v = (x.to(ctx.device, torch.bfloat16) for x in (q, k, v))
    packed = pack_tree_mask(random_tree_mask(num_tree, generator)).to(ctx.device)
    lengths = torch.tensor([prefix_len - 5], device=ctx.device)

    def layer(q, k, v, packed, lengths):
        return tree_attention(q * 1.0, k, v, lengths, packed, impl="triton", max_prefix_len=prefix_len) + 0.0

    eager = layer(q, k, v, packed, lengths)
    try:
        out, codes = run_and_get_code(torch.compile(layer, backend="inductor", fullgraph=True), q, k, v, packed,
                                      lengths)
    except Exception as exc:  # the result to report, not a reason to lose the parity rows
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    code = "\n".join(codes)
    return {"max_abs_diff_vs_eager": (out.float() - eager.float()).abs().max().item(),
            "inductor_launches_the_kernels": "_tree_attn_split_kernel" in code and "_tree_attn_merge_kernel" in code,
            "opaque_operator_call": "specheads.tree_attention_" in code}


def bf16_control(ctx) -> dict:
    """Why the lossless section's bf16 match rates say little about the kernel: (1) in one
    tree-verify forward of the lossless section's bf16 model, the logits' error against its
    bf16 weights run in fp32, through the kernel and through SDPA; (2) HF greedy decoding of
    that model with SDPA's math backend against its default backend: how often two correct
    bf16 attentions give different greedy text (the section's reference is the default)."""
    import copy

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specheads.serving.kernels.tree_attention import pack_tree_mask, use_tree_attention

    from transformers import DynamicCache

    bf16 = random_llama(ctx.lossless_model, ctx.device, torch.float32).to(torch.bfloat16)
    model = copy.deepcopy(bf16).float()  # the bf16 weights, run in fp32: the exact result
    kernel = copy.deepcopy(bf16)
    use_tree_attention(kernel)
    vocab, num_tree, prefix_len = model.config.vocab_size, 16, 24
    generator = torch.Generator().manual_seed(7)
    tree_mask = random_tree_mask(num_tree, generator).to(ctx.device)
    tokens = torch.randint(3, vocab, (1, prefix_len + num_tree), generator=generator).to(ctx.device)
    positions = torch.cat([torch.arange(prefix_len, device=ctx.device), prefix_len + tree_mask.sum(1) - 1])[None]
    dense = torch.ones(1, 1, prefix_len + num_tree, prefix_len + num_tree, dtype=torch.bool, device=ctx.device).tril()
    dense[0, 0, prefix_len:, prefix_len:] = tree_mask
    logits = {}
    for name, target in (("fp32", model), ("sdpa", bf16), ("kernel", kernel)):
        cache = DynamicCache(config=target.config)
        target(tokens[:, :prefix_len], past_key_values=cache, use_cache=True)
        extra = dict(tree_mask=pack_tree_mask(tree_mask), prefix_len=prefix_len) if name == "kernel" else \
            dict(attention_mask=dense[:, :, prefix_len:])
        logits[name] = target(tokens[:, prefix_len:], position_ids=positions[:, prefix_len:], past_key_values=cache,
                              use_cache=True, **extra).logits.float()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    prompts = random_prompts(ctx.lossless_prompts, None, vocab, seed=1234)
    default = [hf_greedy(bf16, [prompt], ctx.bf16_new)[0] for prompt in prompts]
    with sdpa_kernel([SDPBackend.MATH]):
        math_backend = [hf_greedy(bf16, [prompt], ctx.bf16_new)[0] for prompt in prompts]
    return {"verify_logits_rel_err_vs_fp32": {"kernel": rel(logits["kernel"], logits["fp32"]),
                                              "sdpa": rel(logits["sdpa"], logits["fp32"])},
            "verify_logits_kernel_vs_sdpa": rel(logits["kernel"], logits["sdpa"]),
            "verify_argmax_agreement_kernel_vs_sdpa": (logits["kernel"].argmax(-1) ==
                                                       logits["sdpa"].argmax(-1)).float().mean().item(),
            "greedy_match_sdpa_math_vs_default": sum(a == b for a, b in zip(math_backend, default)) / len(prompts)}


def section_parity(ctx) -> dict:
    rows = [_parity_row(ctx, dtype, case) for dtype in (torch.float32, torch.bfloat16, torch.float16)
            for case in ctx.parity_cases]
    return {"rows": rows, "all_passed": all(row["passed"] for row in rows), "compiled": compiled_check(ctx),
            "bf16_control": bf16_control(ctx)}


# --- 2. kernel speed --------------------------------------------------------------------
# Alternatives to the launcher's configuration, timed beside it on a GPU for Llama-8B's layer
# (bf16, head dim 128), so a run says which one the table should hold: (BLOCK_M, BLOCK_N,
# warps, stages, resident programs per SM from the compile report on sm_90).
SWEEP_CONFIGS = {1: [(16, 64, 4, 3, 2), (16, 32, 4, 3, 4), (16, 64, 8, 2, 3), (64, 32, 8, 3, 2)],
                 16: [(64, 64, 8, 2, 1), (64, 64, 4, 2, 2), (32, 64, 4, 3, 2), (16, 64, 4, 2, 3)],
                 64: [(128, 64, 8, 2, 1), (64, 32, 8, 3, 2), (64, 64, 4, 2, 2), (64, 64, 8, 2, 1)]}
SPLIT_FACTORS = (0.5, 2.0)  # the launcher's own configuration with half and twice its prefix splits


def _kv_buffers(ctx, prefix_len: int, num_tree: int) -> tuple[list, int]:
    """(bf16 (q, k, v) buffer sets rotated over ctx.rotate_bytes so that reads miss L2, K+V bytes
    of one layer)."""
    num_q_heads, num_kv_heads, head_dim = ctx.layer
    kv_bytes = 2 * num_kv_heads * (prefix_len + num_tree) * head_dim * 2  # K and V of one layer, bf16
    num_buffers = max(1, math.ceil(ctx.rotate_bytes / kv_bytes))
    make = lambda heads, length: torch.randn(1, heads, length, head_dim, device=ctx.device, dtype=torch.bfloat16)
    return [(make(num_q_heads, num_tree), make(num_kv_heads, prefix_len + num_tree),
             make(num_kv_heads, prefix_len + num_tree)) for _ in range(num_buffers)], kv_bytes


def _timed(ctx, call, buffers: list, kv_bytes: int) -> dict:
    """ms per call(q, k, v) over the rotated buffers (on a GPU: the kernels alone, replayed as one
    CUDA graph of a call per buffer, and the eager time beside it), and the K/V bandwidth."""
    turn = iter(range(1 << 62))
    ms = time_ms(lambda: call(*buffers[next(turn) % len(buffers)]), ctx.device, ctx.warmup, ctx.repeats, ctx.inner)
    timing = {}
    if ctx.device.type == "cuda":
        timing["eager_ms"] = ms
        ms = graph_ms([functools.partial(call, *buffers[i % len(buffers)]) for i in range(max(ctx.inner, len(buffers)))],
                      ctx.device, ctx.warmup, ctx.repeats)
    timing.update(ms=ms, kv_GB_per_s=kv_bytes / ms / 1e6)
    if ctx.peak_bw:
        timing["pct_peak_hbm"] = 100 * kv_bytes / (ms * 1e-3) / ctx.peak_bw
    return timing


def _plan_fields(launch_plan) -> dict:
    config = launch_plan.config
    return dict(config=f"M{config.block_m} N{config.block_n} w{config.num_warps} s{config.num_stages}",
                prefix_splits=launch_plan.num_prefix_splits)


def _speed_rows(ctx, prefix_len: int, num_tree: int) -> list[dict]:
    """The tree kernel and SDPA variants on one (S, T): ms per call, K/V bandwidth."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specheads.serving.kernels.tree_attention import pack_tree_mask, tree_attention

    num_q_heads, num_kv_heads, head_dim = ctx.layer
    buffers, kv_bytes = _kv_buffers(ctx, prefix_len, num_tree)
    tree_mask = random_tree_mask(num_tree, torch.Generator().manual_seed(num_tree)).to(ctx.device)
    packed = pack_tree_mask(tree_mask)  # the engine packs once per step
    dense = torch.ones(1, 1, num_tree, prefix_len + num_tree, dtype=torch.bool, device=ctx.device)
    dense[0, 0, :, prefix_len:] = tree_mask
    sdpa = {"sdpa_bool_mask": (None, dense, True)}  # name -> (backends, mask, applies the tree mask exactly)
    if ctx.device.type == "cuda":  # flash takes no mask: exact for T = 1, else a lower bound ignoring the tree
        sdpa.update(sdpa_mem_efficient_mask=([SDPBackend.EFFICIENT_ATTENTION], dense, True),
                    sdpa_flash_no_mask=([SDPBackend.FLASH_ATTENTION], None, num_tree == 1))
    group, rows = num_q_heads // num_kv_heads, []
    for name, (backends, mask, exact) in [("triton_tree_kernel", (None, packed, True)), *sdpa.items()]:
        row = dict(S=prefix_len, T=num_tree, impl=name, exact_tree_mask=exact)
        if name == "triton_tree_kernel":
            row.update(_plan_fields(_kernel_plan(ctx, prefix_len, num_tree)))
        # SDPA reads grouped K/V itself where the backend can (enable_gqa), else after HF's repeat_kv.
        for gqa in ["kernel"] if name.startswith("triton") else ["enable_gqa", "repeat_kv"]:
            def call(q, k, v, backends=backends, mask=mask, gqa=gqa):
                if gqa == "kernel":
                    return tree_attention(q, k, v, prefix_len, mask, impl="triton")
                if gqa == "repeat_kv":
                    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa == "enable_gqa")
            try:
                timing = _timed(ctx, call, buffers, kv_bytes)
            except Exception as exc:  # a backend refusing a shape must not lose the other rows
                row["error"] = f"{type(exc).__name__}: {exc}"
                continue
            row.pop("error", None)
            row.update(gqa=gqa, **timing)
            break
        rows.append(row)
    return rows


def _kernel_plan(ctx, prefix_len: int, num_tree: int, config=None, splits: int | None = None):
    """The launcher's plan for the speed layer on this device, or one with `config` and/or
    `splits` prefix splits instead of its own."""
    import dataclasses

    from specheads.serving.kernels import triton_kernel

    num_q_heads, num_kv_heads, head_dim = ctx.layer
    sm, num_sms = triton_kernel.device_sm(ctx.device)
    launch_plan = triton_kernel.plan(1, num_q_heads, num_kv_heads, num_tree, head_dim, torch.bfloat16, prefix_len,
                                     sm, num_sms)
    if config is not None:
        row_blocks = math.ceil(num_q_heads // num_kv_heads * num_tree / config.block_m)
        launch_plan = triton_kernel.LaunchPlan(config, row_blocks, triton_kernel.prefix_splits(
            prefix_len, row_blocks * num_kv_heads, num_sms, config))
    if splits is not None:
        launch_plan = dataclasses.replace(launch_plan, num_prefix_splits=splits)
    return launch_plan


def _sweep_rows(ctx, prefix_len: int, num_tree: int) -> list[dict]:
    """SWEEP_CONFIGS and SPLIT_FACTORS for one (S, T), launched as the launcher launches its own."""
    from specheads.serving.kernels import triton_kernel
    from specheads.serving.kernels.tree_attention import pack_tree_mask

    buffers, kv_bytes = _kv_buffers(ctx, prefix_len, num_tree)
    packed = pack_tree_mask(random_tree_mask(num_tree, torch.Generator().manual_seed(num_tree)).to(ctx.device))[None]
    default = _kernel_plan(ctx, prefix_len, num_tree)
    plans = [_kernel_plan(ctx, prefix_len, num_tree, triton_kernel.LaunchConfig(
        block_m, block_n, default.config.block_d, warps, stages, default.config.merge_num_warps, resident))
        for block_m, block_n, warps, stages, resident in SWEEP_CONFIGS.get(num_tree, [])]
    plans += [_kernel_plan(ctx, prefix_len, num_tree, splits=max(1, min(triton_kernel.MAX_PREFIX_SPLITS,
                                                                        round(default.num_prefix_splits * factor))))
              for factor in SPLIT_FACTORS]
    def run(q, k, v, launch_plan):
        out = torch.empty_like(q)
        for kernel_call in triton_kernel.kernel_calls(q, k, v, packed, prefix_len, prefix_len, q.shape[-1] ** -0.5,
                                                      out, launch_plan):
            kernel_call.kernel[kernel_call.grid](*kernel_call.args, **kernel_call.meta)
        return out

    expected = run(*buffers[0], default).float()
    rows = []
    for launch_plan in plans:
        row = dict(S=prefix_len, T=num_tree, impl="triton_sweep", exact_tree_mask=True, **_plan_fields(launch_plan))
        try:
            row["max_abs_diff_vs_launcher"] = (run(*buffers[0], launch_plan).float() - expected).abs().max().item()
            row.update(gqa="kernel", **_timed(ctx, functools.partial(run, launch_plan=launch_plan), buffers, kv_bytes))
        except Exception as exc:  # e.g. a configuration over the SM's shared memory: the others still run
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rows.append(row)
    return rows


def section_kernel_speed(ctx) -> dict:
    rows = [row for prefix_len in ctx.speed_prefixes for num_tree in ctx.speed_trees
            for row in _speed_rows(ctx, prefix_len, num_tree)]
    if ctx.device.type == "cuda":  # the alternatives at the longest prefix
        rows += [row for num_tree in ctx.speed_trees for row in _sweep_rows(ctx, max(ctx.speed_prefixes), num_tree)]
    return {"rows": rows, "layer_Hq_Hkv_D": list(ctx.layer), "peak_hbm_bytes_per_s": ctx.peak_bw,
            "bytes": f"K+V of one layer (Hkv heads, bf16, before any repeat_kv), rotated over "
                     f"{ctx.rotate_bytes >> 20} MiB of buffers so that reads miss L2",
            "sweep": "triton_sweep rows: other launch configurations (SWEEP_CONFIGS, with the split rule) and the "
                     "launcher's own with half and twice its prefix splits, at the longest prefix"}


def _launched_resources(ctx, sm: int, dtype: torch.dtype, head_dim: int, num_tree: int) -> list:
    """Both kernels of one case launched on this GPU at the launcher's plan for native.LAYER
    (real tensors), and read back from the kernel this machine's Triton compiled: registers,
    spilled registers (as `stack`: any is a spill) and shared memory -> native.Resources rows."""
    from specheads.serving.kernels import native, triton_kernel

    layer, batch = native.LAYER, native.LAYER["batch"]
    prefix_len, make = layer["prefix_len"], dict(device=ctx.device, dtype=dtype)
    q = torch.randn(batch, num_tree, layer["num_q_heads"], head_dim, **make).transpose(1, 2)
    k, v = (torch.randn(batch, layer["num_kv_heads"], prefix_len + num_tree, head_dim, **make) for _ in range(2))
    packed = torch.zeros(1, num_tree, -(-num_tree // 32), device=ctx.device, dtype=torch.int32)
    prefix_lens = torch.full((batch,), prefix_len, device=ctx.device, dtype=torch.long)
    out = torch.empty_like(q)
    launch_plan = triton_kernel.plan(batch, layer["num_q_heads"], layer["num_kv_heads"], num_tree, head_dim, dtype,
                                     prefix_len, sm, triton_kernel.device_sm(ctx.device)[1])
    rows = []
    for call in triton_kernel.kernel_calls(q, k, v, packed, prefix_lens, prefix_len, head_dim ** -0.5, out,
                                           launch_plan):
        compiled = call.kernel[call.grid](*call.args, **call.meta)
        compiled._init_handles()
        blocks = " ".join(f"{name.removeprefix('BLOCK_')}{value}" for name, value in call.meta.items()
                          if name.startswith("BLOCK_"))
        rows.append(native.Resources(kernel=call.name, sm=sm, num_tree=num_tree, dtype=native.DTYPE_NAMES[dtype],
                                     head_dim=head_dim, blocks=blocks, num_warps=compiled.metadata.num_warps,
                                     num_stages=compiled.metadata.num_stages, registers=compiled.n_regs,
                                     stack=compiled.n_spills, shared=compiled.metadata.shared))
    return rows


def section_block_sizes(ctx) -> dict:
    """The tree kernel's launch configurations (serving/kernels/triton_kernel.py launch_config:
    tables picked with another Triton and torch) compiled by this machine's Triton for its own
    SM, and checked as tests/serving/kernels/test_native_compile.py checks them (native.problems:
    the shared memory fits, nothing spills, one SM holds the split programs the split rule
    counts on), for ctx.block_cases. On a GPU the kernels are launched on a representative layer
    and read back from what its Triton compiled; elsewhere (--tiny on a CPU) they are compiled
    for sm_90 by serving/kernels/native.py, in a subprocess without TRITON_INTERPRET."""
    import dataclasses
    import json
    import os
    import subprocess
    import sys

    import triton

    from specheads.serving.kernels import native, triton_kernel

    dtypes, head_dims, trees = ctx.block_cases
    if ctx.device.type == "cuda":
        sm = triton_kernel.device_sm(ctx.device)[0]
        found = [row for dtype in dtypes for head_dim in head_dims for num_tree in trees
                 for row in _launched_resources(ctx, sm, dtype, head_dim, num_tree)]
        rows = [dict(dataclasses.asdict(row), problems=native.problems(row)) for row in found]
    else:
        sm = 90
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        argv = ["--json", "--check", "--sms", str(sm), "--dtypes", ",".join(native.DTYPE_NAMES[d] for d in dtypes),
                "--head-dims", ",".join(map(str, head_dims)), "--trees", ",".join(map(str, trees))]
        proc = subprocess.run([sys.executable, "-m", "specheads.serving.kernels.native", *argv], env=env,
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            return {"rows": [{"error": (proc.stdout + proc.stderr).strip()[-2000:]}], "fits": None,
                    "triton": triton.__version__, "sm": sm}
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"rows": rows, "fits": all(not row["problems"] for row in rows), "triton": triton.__version__, "sm": sm,
            "how": "launched on this GPU and read back" if ctx.device.type == "cuda" else "compiled for sm_90 (ptxas)"}


def main(argv: list[str] | None = None) -> int:
    """`python -m specheads.bench.gpu.kernels --compile-report`: the kernels' static resources per
    SM, dtype and head dim, compiled natively with no GPU (serving/kernels/native.py)."""
    import argparse

    from specheads.serving.kernels import native

    p = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
    p.add_argument("--compile-report", action="store_true", required=True,
                   help="compile for sm_80/sm_90 and print registers, stack, shared memory and occupancy")
    p.parse_args(argv)
    return native.main([])


if __name__ == "__main__":
    raise SystemExit(main())
