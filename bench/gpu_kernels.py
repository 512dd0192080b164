"""The GPU suite's kernel sections (bench/gpu_suite.py runs them): the Triton tree-attention
kernel against its PyTorch reference (parity) and against SDPA (speed), plus the timing
helpers every section uses. Imports torch and the project's kernel module (and, to time a
graph, serving/decode/graphs.py).

Shape legend: B batch, Hq / Hkv query / KV heads, T tree tokens, S prefix keys, D head dim.
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time

import torch

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}  # relative L2, as in the tests


def wall_s(fn, device: torch.device):
    """(fn(), wall seconds with the device synchronised on both sides)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    begin = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - begin


def time_ms(fn, device: torch.device, warmup: int, repeats: int, inner: int = 1) -> float:
    """Median milliseconds per fn() call over `repeats` runs of `inner` calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type != "cuda":
            samples.append(wall_s(lambda: [fn() for _ in range(inner)], device)[1] * 1e3 / inner)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


def graph_ms(calls: list, device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds per call of `calls` (zero-argument functions) replayed as one CUDA
    graph: the kernels' own time, without the Python and launch time of an eager call (which
    is most of it for one attention layer at batch 1)."""
    from specheads.serving.decode.graphs import capture

    graph, _ = capture(lambda: [call() for call in calls], device, warmup_runs=1)
    return time_ms(graph.replay, device, warmup, repeats) / len(calls)


def random_tree_mask(num_tree: int, generator: torch.Generator) -> torch.Tensor:
    """[T, T] bool ancestor mask (self included) of a random tree; node 0 is the root."""
    parents = [-1] + [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, num_tree)]
    mask = torch.eye(num_tree, dtype=torch.bool)
    for node in range(1, num_tree):  # a parent comes before its children
        mask[node] |= mask[parents[node]]
    return mask


# --- 1. kernel parity -------------------------------------------------------------------
def section_parity(ctx) -> dict:
    from specheads.serving.kernels.tree_attention import tree_attention, tree_attention_reference

    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for case in ctx.parity_cases:
            batch, num_kv_heads, group, num_tree, prefix_len, head_dim = case
            generator = torch.Generator().manual_seed(sum(case))
            # q as a transposed view of [B, T, Hq, D], the layout transformers hands over.
            q = torch.randn(batch, num_tree, num_kv_heads * group, head_dim, generator=generator).transpose(1, 2)
            k, v = (torch.randn(batch, num_kv_heads, prefix_len + num_tree, head_dim, generator=generator)
                    for _ in range(2))
            q, k, v = (x.to(ctx.device, dtype) for x in (q, k, v))
            tree_mask = random_tree_mask(num_tree, generator).to(ctx.device)
            out = tree_attention(q, k, v, prefix_len, tree_mask, impl="triton").float()
            ref = tree_attention_reference(q.float(), k.float(), v.float(), prefix_len, tree_mask)
            rel = ((out - ref).norm() / ref.norm()).item()
            rows.append(dict(dtype=str(dtype)[6:], shape="B{}Hkv{}g{}T{}S{}D{}".format(*case), rel_err=rel,
                             max_abs_err=(out - ref).abs().max().item(), tolerance=TOLERANCE[dtype],
                             passed=bool(rel <= TOLERANCE[dtype])))
    return {"rows": rows, "all_passed": all(row["passed"] for row in rows)}


# --- 2. kernel speed --------------------------------------------------------------------
def _speed_rows(ctx, prefix_len: int, num_tree: int) -> list[dict]:
    """The tree kernel and SDPA variants on one (S, T): ms per call, K/V bandwidth."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specheads.serving.kernels.tree_attention import pack_tree_mask, tree_attention

    num_q_heads, num_kv_heads, head_dim = ctx.layer
    kv_bytes = 2 * num_kv_heads * (prefix_len + num_tree) * head_dim * 2  # K and V of one layer, bf16
    num_buffers = max(1, math.ceil(ctx.rotate_bytes / kv_bytes))
    make = lambda heads, length: torch.randn(1, heads, length, head_dim, device=ctx.device, dtype=torch.bfloat16)
    buffers = [(make(num_q_heads, num_tree), make(num_kv_heads, prefix_len + num_tree),
                make(num_kv_heads, prefix_len + num_tree)) for _ in range(num_buffers)]
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
        # SDPA reads grouped K/V itself where the backend can (enable_gqa), else after HF's repeat_kv.
        for gqa in ["kernel"] if name.startswith("triton") else ["enable_gqa", "repeat_kv"]:
            def call(q, k, v, backends=backends, mask=mask, gqa=gqa):
                if gqa == "kernel":
                    return tree_attention(q, k, v, prefix_len, mask, impl="triton")
                if gqa == "repeat_kv":
                    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa == "enable_gqa")
            turn = iter(range(1 << 62))
            try:
                ms = time_ms(lambda: call(*buffers[next(turn) % num_buffers]), ctx.device, ctx.warmup, ctx.repeats,
                             ctx.inner)
                if ctx.device.type == "cuda":  # the kernels alone: one graph of a call per buffer (reads miss L2)
                    row["eager_ms"] = ms
                    ms = graph_ms([functools.partial(call, *buffers[i % num_buffers])
                                   for i in range(max(ctx.inner, num_buffers))], ctx.device, ctx.warmup, ctx.repeats)
            except Exception as exc:  # a backend refusing a shape must not lose the other rows
                row["error"] = f"{type(exc).__name__}: {exc}"
                continue
            row.pop("error", None)
            row.update(gqa=gqa, ms=ms, kv_GB_per_s=kv_bytes / ms / 1e6)
            if ctx.peak_bw:
                row["pct_peak_hbm"] = 100 * kv_bytes / (ms * 1e-3) / ctx.peak_bw
            break
        rows.append(row)
    return rows


def section_kernel_speed(ctx) -> dict:
    rows = [row for prefix_len in ctx.speed_prefixes for num_tree in ctx.speed_trees
            for row in _speed_rows(ctx, prefix_len, num_tree)]
    return {"rows": rows, "layer_Hq_Hkv_D": list(ctx.layer), "peak_hbm_bytes_per_s": ctx.peak_bw,
            "bytes": f"K+V of one layer (Hkv heads, bf16, before any repeat_kv), rotated over "
                     f"{ctx.rotate_bytes >> 20} MiB of buffers so that reads miss L2"}


def main(argv: list[str] | None = None) -> int:
    """`python -m specheads.bench.gpu_kernels --compile-report`: the kernels' static resources per
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
