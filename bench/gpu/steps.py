"""The GPU suite's step sections (bench/gpu/suite.py runs them, with its shapes in `ctx`): what
one engine step costs on the device and where that time goes.

- step_time: a decode step (T = 1) and verify steps (T = 16/32/64) of a random bf16 target
  over a static-shape cache at a fixed context, batch 1, 8 and 32, replayed as CUDA graphs as
  the engine replays them (tree kernel), for the model's own forward ("hf") and the GPU
  decoder ("compiled", heads/target/gpu_decoder.py); each beside the weight-read floor: bytes of
  weights (less the input embedding, of which a step reads one row per token) and of the
  K/V a step reads, over the card's HBM rate.
- profile: torch.profiler over graphed decode steps at the 8B shape, CUDA kernel time grouped
  into GEMM, attention, norm/rotary/elementwise and copies, with the largest kernels named.
- gemm: the 8B shape's GEMMs (fused qkv and gate_up, o, down, lm_head) at 1-64 rows: cuBLAS
  (what F.linear and inductor's default call) against inductor's autotuned Triton GEMMs
  (`max-autotune`), each with the weight rotated so reads miss L2, as % of HBM.
- autotune_step: the decode and a verify step with the GPU decoder compiled in max-autotune.

Shape legend: B batch, T tree tokens, M GEMM rows, N out features, K in features.
"""

from __future__ import annotations

import math
import re

import torch

from specheads.bench.gpu.models import (adapters, free_device_memory, prefilled_cache, random_llama, step_ms,
                                        verify_call)
from specheads.bench.gpu.kernels import graph_ms
from specheads.bench.support import kv_read_bytes, time_ms, weight_read_bytes

# Kernel names -> groups, first match wins (attention first: flash's "splitkv" is no split-K
# GEMM). Inductor's fused kernels (triton_poi/red/per) are the norms, RoPE, SiLU and residual
# adds, whatever ops their names list.
KERNEL_GROUPS = (
    ("attention", r"attn|attention|flash|fmha|sdpa|softmax"),
    ("gemm", r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitk|triton_tem|aten::(mm|addmm|bmm|linear|matmul)\b"),
    ("norm_rotary_elementwise", r"triton_(poi|red|per)_"),
    ("copies", r"copy|memcpy|memset|index|scatter|gather|\bcat\b|catarray|fill|arange|clone|contiguous"),
)
OTHER_GROUP = "norm_rotary_elementwise"  # elementwise kernels of the model's own forward (mul, add, pow, ...)


def with_floor(ctx, row: dict, weight_bytes: int, kv_bytes: int) -> dict:
    """The row plus its weight-read floor: the ms the bytes take at peak HBM, and ms's share of it."""
    row.update(weight_bytes=weight_bytes, kv_bytes=kv_bytes)
    if ctx.peak_bw:
        row["floor_ms"] = (weight_bytes + kv_bytes) / ctx.peak_bw * 1e3
        row["floor_fraction"] = row["floor_ms"] / row["ms"]
    return row


# --- step_time ---------------------------------------------------------------------------------
def step_rows(ctx, model_name: str, forwards: dict, context: int, batches, trees) -> list[dict]:
    """Decode and verify steps of each forward in `forwards` at each batch size; verify trees
    `trees` at batch 1, the first of them at larger batches."""
    model = next(iter(forwards.values())).model
    weight_bytes, rows = weight_read_bytes(model), []
    for batch in batches:
        sizes = (1, *trees) if batch == 1 else (1, trees[0])
        cache = prefilled_cache(next(iter(forwards.values())), batch, context, max(sizes) + 1)
        for name, target in forwards.items():
            for num_tree in sizes:
                row = dict(model=model_name, context=context, forward=name, B=batch, T=num_tree)
                try:
                    row.update(step_ms(ctx, verify_call(target, cache, num_tree, "tree")))
                except Exception as exc:  # one forward failing (a compile error, say) keeps the other's rows
                    rows.append(dict(row, error=f"{type(exc).__name__}: {exc}"))
                    continue
                decode = next((r for r in rows if r["forward"] == name and r["B"] == batch and r["T"] == 1), row)
                row["ratio_to_decode"] = row["ms"] / decode["ms"] if "ms" in decode else None
                rows.append(with_floor(ctx, row, weight_bytes, kv_read_bytes(model.config, batch, context + num_tree)))
        del cache
        free_device_memory()
    return rows


def section_step_time(ctx) -> dict:
    rows, compile_s = [], {}
    for model_name, shape, context in ctx.step_models:
        forwards = adapters(ctx, random_llama(shape, ctx.device, torch.bfloat16, init_std=None))
        rows += step_rows(ctx, model_name, forwards, context, ctx.step_batches, ctx.verify_trees)
        compile_s[model_name] = forwards["compiled"].gpu.compile_seconds
        del forwards
        free_device_memory()
    return {"rows": rows, "compile_s": compile_s, "gpu_decoder": ctx.gpu_decoder, "peak_hbm_bytes_per_s": ctx.peak_bw,
            "note": "random bf16 targets, static-shape cache, tree kernel; ms is the CUDA-graph replay on a GPU "
                    "(eager elsewhere); floor_fraction = (weight + K/V bytes at peak HBM) / ms"}


def section_autotune_step(ctx) -> dict:
    """The 8B decode and first verify step with the GPU decoder in max-autotune (inductor also
    tries its Triton GEMMs), against the default compile of the same model."""
    from specheads.heads.target.adapter import TargetAdapter

    model_name, shape, context = ctx.step_models[0]
    model = random_llama(shape, ctx.device, torch.bfloat16, init_std=None)
    forwards = {"compiled": TargetAdapter(model, gpu_decoder=ctx.gpu_decoder),
                "autotuned": TargetAdapter(model, gpu_decoder=ctx.autotune_mode)}
    rows = step_rows(ctx, model_name, forwards, context, (1,), ctx.verify_trees[:1])
    return {"rows": rows, "mode": ctx.autotune_mode,
            "compile_s": {name: target.gpu.compile_seconds for name, target in forwards.items()}}


# --- profile -----------------------------------------------------------------------------------
def kernel_group(name: str) -> str:
    for group, pattern in KERNEL_GROUPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return group
    return OTHER_GROUP


def _kernel_times(prof, device: torch.device) -> list[tuple[str, float]]:
    """(name, microseconds) of every device kernel, copy and memset the profile saw; on a CPU,
    of every top-level aten op (its self time), the CPU's kernels."""
    from torch.autograd import DeviceType

    if device.type == "cuda":
        return [(event.name, event.time_range.elapsed_us()) for event in prof.events()
                if event.device_type == DeviceType.CUDA]
    return [(event.name, event.self_cpu_time_total) for event in prof.events()
            if event.name.startswith("aten::") and event.cpu_parent is None]


def profile_rows(ctx, call, steps: int) -> dict:
    """Kernel time of `steps` calls of `call`, replayed from one CUDA graph where the profiler
    sees the graph's kernels (else eager: `source` says which), grouped by `kernel_group`."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if ctx.device.type == "cuda" else ProfilerActivity.CPU
    graph, source = None, "eager"
    with torch.inference_mode():
        call()  # compiled before anything is profiled
        if ctx.device.type == "cuda":
            from specheads.serving.decode.graphs import capture

            graph, _ = capture(call, ctx.device)
        for replay in ([graph.replay] if graph is not None else []) + [call]:
            with profile(activities=[activity]) as prof:
                for _ in range(steps):
                    replay()
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize(ctx.device)
            kernels = _kernel_times(prof, ctx.device)
            if kernels:
                source = "graph" if replay is not call else "eager"
                break
    groups, by_name = {}, {}
    for name, micros in kernels:
        entry = groups.setdefault(kernel_group(name), [0.0, 0])
        entry[0], entry[1] = entry[0] + micros, entry[1] + 1
        by_name[name] = by_name.get(name, 0.0) + micros
    total_ms = sum(micros for _, micros in kernels) / 1e3 / steps
    rows = [dict(group=group, ms_per_step=micros / 1e3 / steps, kernels_per_step=count / steps,
                 share=micros / 1e3 / steps / total_ms if total_ms else 0.0)
            for group, (micros, count) in sorted(groups.items(), key=lambda item: -item[1][0])]
    top = sorted(by_name.items(), key=lambda item: -item[1])[:ctx.profile_top]
    return {"source": source, "kernel_ms_per_step": total_ms, "kernels_per_step": len(kernels) / steps, "groups": rows,
            "top_kernels": [dict(name=name[:100], us_per_step=micros / steps, group=kernel_group(name))
                            for name, micros in top]}


def section_profile(ctx) -> dict:
    """Our graphed decode step (batch 1, T = 1, tree kernel) at the 8B shape and the suite's
    context, for the compiled forward and the model's own: where the kernel time goes."""
    model_name, shape, context = ctx.step_models[0]
    forwards = adapters(ctx, random_llama(shape, ctx.device, torch.bfloat16, init_std=None))
    cache = prefilled_cache(forwards["hf"], 1, context, 2)
    rows, top, totals = [], [], {}
    for name, target in forwards.items():
        found = profile_rows(ctx, verify_call(target, cache, 1, "tree"), ctx.profile_steps)
        rows += [dict(forward=name, **group) for group in found["groups"]]
        top += [dict(forward=name, **kernel) for kernel in found["top_kernels"]]
        totals[name] = {key: found[key] for key in ("source", "kernel_ms_per_step", "kernels_per_step")}
    return {"rows": rows, "model": model_name, "context": context, "totals": totals, "top_kernels": top}


# --- gemm --------------------------------------------------------------------------------------
def gemm_shapes(config) -> dict:
    """name -> (N, K) of the target's GEMMs as the GPU decoder runs them."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inter = config.hidden_size, config.intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    return {"qkv": (qkv, hidden), "o": (hidden, config.num_attention_heads * head_dim), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "lm_head": (config.vocab_size, hidden)}


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight)


def _gemm_ms(ctx, linear, x, weights) -> float:
    """ms per call of linear(x, w), cycling through `weights` (rotated so reads miss L2): replayed
    from one CUDA graph on a GPU, else eager."""
    turn = iter(range(1 << 62))
    call = lambda: linear(x, weights[next(turn) % len(weights)])
    call()  # compile / autotune first
    if ctx.device.type != "cuda":
        return time_ms(call, ctx.device, ctx.warmup, ctx.repeats)
    return graph_ms([(lambda w=w: linear(x, w)) for w in weights], ctx.device, ctx.warmup, ctx.repeats)


def section_gemm(ctx) -> dict:
    from transformers import LlamaConfig

    from specheads.heads.target.gpu_decoder import allow_recompiles

    config = LlamaConfig(**ctx.step_models[0][1])
    allow_recompiles()  # one graph per (shape, rows)
    compiled = torch.compile(_linear, dynamic=False, mode=ctx.gemm_compile_mode)
    rows = []
    for name, (out_features, in_features) in gemm_shapes(config).items():
        weight_bytes = out_features * in_features * 2
        copies = max(1, math.ceil(ctx.rotate_bytes / weight_bytes))
        weights = [torch.randn(out_features, in_features, device=ctx.device, dtype=torch.bfloat16) / 64
                   for _ in range(copies)]
        for num_rows in ctx.gemm_rows:
            x = torch.randn(num_rows, in_features, device=ctx.device, dtype=torch.bfloat16)
            moved = weight_bytes + 2 * num_rows * (in_features + out_features)
            row = dict(gemm=name, M=num_rows, N=out_features, K=in_features)
            with torch.inference_mode():
                for impl, linear in (("cublas", torch.nn.functional.linear), ("inductor", compiled)):
                    ms = _gemm_ms(ctx, linear, x, weights)
                    row[f"{impl}_ms"] = ms
                    if ctx.peak_bw:
                        row[f"{impl}_pct_hbm"] = 100 * moved / (ms * 1e-3) / ctx.peak_bw
            row["faster"] = "cublas" if row["cublas_ms"] <= row["inductor_ms"] else "inductor"
            rows.append(row)
        del weights
        free_device_memory()
    return {"rows": rows, "inductor_mode": ctx.gemm_compile_mode, "model": ctx.step_models[0][0],
            "note": f"bf16; each weight rotated over {ctx.rotate_bytes >> 20} MiB of copies so reads miss L2; "
                    "% of HBM counts the weight, x and the output once"}
