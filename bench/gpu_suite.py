"""The GPU suite: what this project measures and checks on a GPU, in one run of < 10 min.

Six sections, each a function returning its own figures (one that raises records its
error; the others still run; the two kernel sections are in bench/gpu_kernels.py, the four
engine sections in bench/gpu_engine.py; this module holds the shapes, runs and reports):
- parity: the Triton tree-attention kernel vs its PyTorch reference in fp32/bf16/fp16, on
  the CPU tests' shapes plus an 8B-shaped layer (32 q / 8 kv heads, head dim 128).
- kernel_speed: that layer in bf16, T = 1..128 tree tokens at 1k/8k prefix: the kernel vs
  SDPA with a dense bool mask (and mem-efficient / flash SDPA); ms (on a GPU, the kernels
  alone, replayed as one CUDA graph; eager_ms beside), GB/s, % of peak HBM.
- lossless: a tiny random Llama in fp32, the engine (heads, both attention paths, CUDA
  graphs) vs HF greedy per prompt; and the bf16 greedy match rate vs HF bf16 greedy.
- verify_vs_decode: a random Llama-3.1-8B-shaped bf16 model at 4k context (TreeStaticCache):
  one eager verify forward at T = 16/32/64 vs one decode step, and vs the weight-read floor.
- graphs: one forward, eager vs its CUDA-graph replay over a static-shape cache, for
  SmolLM2- and 8B-shaped random models (decode and verify, SDPA mask or the kernel).
- end_to_end: tokens/s of HF greedy vs the engine without / with heads, with and without
  CUDA graphs, batch 1 and 8, for SmolLM2- and 8B-shaped random models.

It imports torch, triton, transformers and the serving/heads modules that pull no deepspeed,
fastapi, uvicorn, wandb, datasets or gguf (tests/bench/test_gpu_suite.py runs it with those
blocked). The first run (2026-11-26, an H200; figures in the README's GPU section) carried
transformers 5.24 as a wheel and put the package on PYTHONPATH through a folder of links
(run from outside the repo root, whose specheads/ folder would shadow the package):

    mkdir -p /tmp/pkg/specheads && for f in specheads/*; do ln -s $PWD/$f /tmp/pkg/specheads/; done
    for d in heads training serving data recipes bench; do ln -s $PWD/$d /tmp/pkg/specheads/$d; done
    cd /tmp && env -u TRITON_INTERPRET PYTHONPATH=/tmp/pkg PYTHONUNBUFFERED=1 \
        python3 -m specheads.bench.gpu_suite --out $OUT

It writes $OUT/gpu_suite.json and $OUT/gpu_suite.md after every section. `--sections a,b`
runs a subset; `--tiny` (implied by --device cpu, which sets TRITON_INTERPRET=1) shrinks
every shape so the suite runs on a CPU in well under a minute (CUDA graphs then run their
static-shape forward uncaptured).

Shape legend: B batch, Hq / Hkv query / KV heads, T tree tokens, S prefix keys, D head dim.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from specheads.heads import atomic
from specheads.bench.gpu_engine import (free_device_memory, section_end_to_end, section_graphs, section_lossless,
                                        section_verify_vs_decode)
from specheads.bench.gpu_kernels import section_kernel_speed, section_parity

PEAK_HBM = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))  # bytes/s
# tests/serving/kernels/test_tree_attention.py PARITY_CASES: (B, Hkv, group, T, S, D).
PARITY_CASES = [(1, 1, 1, 1, 0, 16), (1, 2, 1, 1, 37, 32), (2, 1, 2, 3, 0, 64), (1, 2, 4, 3, 1, 16),
                (1, 1, 4, 17, 5, 32), (2, 2, 2, 17, 37, 16), (1, 1, 1, 33, 1, 64), (1, 2, 2, 33, 5, 16),
                (1, 1, 2, 33, 37, 32), (1, 1, 2, 128, 40, 16)]
LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
# SmolLM2-135M's shape (random weights: no checkpoint travels to the device machine).
SMOLLM2_SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0)
LLAMA_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=1024)
FULL = dict(parity_cases=PARITY_CASES + [(1, 8, 4, 64, 1024, 128)],
            layer=(32, 8, 128), speed_trees=(1, 16, 32, 64, 128), speed_prefixes=(1024, 8192),  # (Hq, Hkv, D), T, S
            warmup=5, repeats=20, inner=10, rotate_bytes=256 << 20,  # K/V rotated over this much: reads miss L2
            lossless_model=dict(LLAMA_TINY, hidden_size=128, num_hidden_layers=4, vocab_size=512),
            lossless_prompts=8, lossless_new=32, bf16_new=64, bench_model=LLAMA_8B, context=4096,
            verify_trees=(16, 32, 64), e2e_prompts=4, e2e_prompt_len=128, e2e_new=64, e2e_batch=8,
            e2e_models={"smollm2-shape": SMOLLM2_SHAPE, "llama-8b-shape": LLAMA_8B},
            graph_cases=(("smollm2-shape", SMOLLM2_SHAPE, 1024), ("llama-8b-shape", LLAMA_8B, 4096)))
TINY = dict(parity_cases=PARITY_CASES[:4] + [(1, 8, 4, 4, 40, 128)],
            layer=(8, 2, 32), speed_trees=(1, 4), speed_prefixes=(32,), warmup=0, repeats=1, inner=1, rotate_bytes=0,
            lossless_model=LLAMA_TINY, lossless_prompts=2, lossless_new=8, bf16_new=8, bench_model=LLAMA_TINY,
            context=32, verify_trees=(4,), e2e_prompts=2, e2e_prompt_len=8, e2e_new=8, e2e_batch=2,
            e2e_models={"tiny": LLAMA_TINY}, graph_cases=(("tiny", LLAMA_TINY, 32),))


def peak_bandwidth(device_name: str) -> float | None:
    return next((peak for fragment, peak in PEAK_HBM if fragment.lower() in device_name.lower()), None)


def make_context(device: torch.device, tiny: bool) -> SimpleNamespace:
    """The sections' one argument: the device, its name and peak bandwidth, the FULL or TINY shapes."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    return SimpleNamespace(device=device, device_name=name, peak_bw=peak_bandwidth(name), **(TINY if tiny else FULL))


# --- running and reporting --------------------------------------------------------------
SECTIONS = {"parity": section_parity, "kernel_speed": section_kernel_speed, "lossless": section_lossless,
            "verify_vs_decode": section_verify_vs_decode, "graphs": section_graphs,
            "end_to_end": section_end_to_end}


def run_section(ctx, name: str) -> dict:
    begin = time.perf_counter()
    try:
        with torch.no_grad():
            record = {"ok": True, "result": SECTIONS[name](ctx)}
    except Exception as exc:  # a section's failure is its result; the others still run
        record = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    record["seconds"] = time.perf_counter() - begin
    free_device_memory()  # the 8B model of one section is gone before the next builds its own
    return record


def _cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return " ".join(_cell(item) for item in value) if isinstance(value, list) else str(value)


def format_markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# specheads GPU suite: {meta['device_name']}", "", f"`{meta['command']}`", "",
             f"torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, CUDA "
             f"{meta['cuda']}, TRITON_INTERPRET={meta['triton_interpret']}, tiny={meta['tiny']}", "",
             "| section | ok | seconds | error |", "|---|---|---|---|"]
    lines += [f"| {name} | {_cell(r['ok'])} | {r['seconds']:.1f} | {r.get('error', '')} |"
              for name, r in report["sections"].items()]
    for name, record in report["sections"].items():
        result = record.get("result") or {}
        rows = result.get("rows", [])
        lines += ["", f"## {name}", ""] + [f"- {key}: {_cell(value)}" for key, value in result.items() if key != "rows"]
        columns = list(dict.fromkeys(key for row in rows for key in row))
        if columns:
            lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_cell(row.get(column, "")) for column in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m specheads.bench.gpu_suite", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_suite.json and gpu_suite.md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (implied by --device cpu)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    args = parser.parse_args(argv)
    names = [name for name in args.sections.split(",") if name]
    if set(names) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(set(names) - set(SECTIONS))}; known: {list(SECTIONS)}")
    device = torch.device(args.device)
    if device.type == "cpu":  # the kernel runs interpreted; triton reads this when the kernel module loads
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import transformers
    import triton

    tiny = args.tiny or device.type == "cpu"
    ctx = make_context(device, tiny)
    meta = {"device_name": ctx.device_name, "device": str(device), "tiny": tiny,
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "triton_interpret": os.environ.get("TRITON_INTERPRET"),
            "peak_hbm_bytes_per_s": ctx.peak_bw, "command": " ".join(["python -m specheads.bench.gpu_suite", *argv]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    report = {"schema": "specheads.gpu_suite/1", "meta": meta, "sections": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    for name in names:
        print(f"[gpu_suite] {name} ...", flush=True)
        report["sections"][name] = record = run_section(ctx, name)
        print(f"[gpu_suite] {name}: {record.get('error', 'ok')} ({record['seconds']:.1f} s)", flush=True)
        meta["seconds"] = time.perf_counter() - begin
        atomic.write_json(args.out / "gpu_suite.json", report)  # after every section: a killed run keeps the rest
        atomic.write_text(args.out / "gpu_suite.md", format_markdown(report))
    return 0 if all(record["ok"] for record in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
