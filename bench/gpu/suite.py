"""The GPU suite: what this project measures and checks on a GPU, in one run of about 8 minutes.

Sections, in the order they run (lossless first, so that a slow compile later cannot skip it;
then the figures the GPU work must reach), each a function returning its own figures (one that
raises records its error; the others still run):
- lossless (bench/gpu/engine.py): fp32 greedy of every engine, everything on included, against
  HF greedy on a tiny random Llama.
- block_sizes (bench/gpu/kernels.py): the tree kernel's launch configurations compiled by this
  machine's own Triton for its SM: no spill, the shared memory fits, the residency the split
  rule counts on.
- step_time (bench/gpu/steps.py): Llama-3.1-8B- and SmolLM2-shaped bf16 targets, decode and
  verify steps (T = 16/32/64) as CUDA-graph replays over the static-shape cache with the tree
  kernel, batch 1/8/32, the model's own forward against the compiled GPU decoder, each beside
  the weight-read floor.
- kernel_speed (bench/gpu/kernels.py): the Triton tree-attention kernel against SDPA (% of HBM).
- end_to_end (bench/gpu/engine.py): decode tokens/s (prefill timed apart) at 4k context on
  peaked random targets (greedy decided beyond bf16 rounding) of both shapes at batch 1/8/32,
  beside the weight-read floor: HF greedy, the engine's plain decoding, oracle-drafted (Medusa)
  and random-EAGLE-3-drafted decoding, graphs and kernel on, every engine's warm steps under
  torch.cuda's sync debug mode "error" (any sync but the step's declared read fails the run);
  speedups against the engine's plain decoding with graphs; bf16 outputs against HF's, every
  difference scored as near-tie or not.
- trained_heads (bench/gpu/trained.py): the real SmolLM2 with its trained EAGLE-3 heads
  (`--trained-target`, `--trained-heads`): bf16 exactness against HF's bf16 greedy (every
  difference at an fp32 near-tie), and batch-1 speed against graphed plain decoding.
- profile (bench/gpu/steps.py): where a graphed 8B decode step's kernel time goes.
- parity (bench/gpu/kernels.py): the kernel against its PyTorch reference.
- gemm, autotune_step (bench/gpu/steps.py): cuBLAS against inductor's autotuned GEMMs at 1-64
  rows; the decoder in max-autotune.

The report starts with the goals (`goals`: the must-reach figures), each beside its target.
It is written to OUT/gpu_suite.json and OUT/gpu_suite.md after every section, so a run
stopped at its time limit keeps what it measured; `--budget-s` skips the sections that would
start after that many seconds. `--compile-cache FILE` loads inductor's cache artifacts from
FILE when it exists and writes them there after every section (a second run on a fresh
machine then compiles from the cache). bench/gpu/README.md says how to run it on a GPU machine
of your own.

It imports torch, triton, transformers and the serving/heads modules that pull no deepspeed,
fastapi, uvicorn, pydantic, wandb, datasets or gguf (tests/bench/test_gpu_suite.py runs it
with those hidden). `--tiny` (implied by --device cpu, which sets TRITON_INTERPRET=1)
shrinks every shape so the suite runs on a CPU in a few minutes (CUDA graphs then run their
static-shape forward uncaptured, and torch.compile compiles for the CPU).

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
from specheads.bench.gpu.engine import section_end_to_end, section_lossless
from specheads.bench.gpu.models import free_device_memory
from specheads.bench.gpu.kernels import section_block_sizes, section_kernel_speed, section_parity
from specheads.bench.gpu.steps import section_autotune_step, section_gemm, section_profile, section_step_time
from specheads.bench.gpu.trained import section_trained_heads

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
            warmup=5, repeats=20, inner=10, eager_repeats=3, rotate_bytes=256 << 20,  # rotated K/V, weights miss L2
            gpu_decoder="compile", autotune_mode="max-autotune", gemm_compile_mode="max-autotune-no-cudagraphs",
            step_models=(("llama-8b-shape", LLAMA_8B, 4096), ("smollm2-shape", SMOLLM2_SHAPE, 1024)),
            step_batches=(1, 8, 32), verify_trees=(16, 32, 64),
            lossless_model=dict(LLAMA_TINY, hidden_size=128, num_hidden_layers=4, vocab_size=512),
            lossless_prompts=8, lossless_new=32, bf16_new=64,
            e2e_models={"llama-8b-shape": LLAMA_8B, "smollm2-shape": SMOLLM2_SHAPE}, e2e_batches=(1, 8, 32),
            e2e_prompts=4, e2e_prompt_len=4096, e2e_new=64, peak_prompts=4, peak_new=32,
            profile_steps=10, profile_top=15, gemm_rows=(1, 16, 64),
            block_cases=((torch.bfloat16, torch.float32), (64, 128), (1, 16, 64)),
            trained_prompts=16, trained_new=128)
TINY = dict(parity_cases=PARITY_CASES[:4] + [(1, 8, 4, 4, 40, 128)],
            layer=(8, 2, 32), speed_trees=(1, 4), speed_prefixes=(32,), warmup=0, repeats=1, inner=1, eager_repeats=1,
            rotate_bytes=0, gpu_decoder="compile", autotune_mode="compile", gemm_compile_mode="default",
            step_models=(("tiny", LLAMA_TINY, 32),), step_batches=(1, 2), verify_trees=(4,),
            lossless_model=LLAMA_TINY, lossless_prompts=2, lossless_new=8, bf16_new=8,
            e2e_models={"tiny": LLAMA_TINY}, e2e_batches=(1, 2), e2e_prompts=2, e2e_prompt_len=8, e2e_new=8,
            peak_prompts=2, peak_new=8, profile_steps=2, profile_top=5, gemm_rows=(1, 4),
            block_cases=((torch.bfloat16,), (64,), (1,)), trained_prompts=2, trained_new=8)


def peak_bandwidth(device_name: str) -> float | None:
    return next((peak for fragment, peak in PEAK_HBM if fragment.lower() in device_name.lower()), None)


def make_context(device: torch.device, tiny: bool, trained_target: str | None = None,
                 trained_heads: str | None = None, **overrides) -> SimpleNamespace:
    """The sections' one argument: the device, its name and peak bandwidth, the FULL or TINY
    shapes, and the trained heads' target and directory (bench/gpu/trained.py)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    return SimpleNamespace(device=device, device_name=name, peak_bw=peak_bandwidth(name), tiny=tiny,
                           trained_target=trained_target, trained_heads=trained_heads,
                           **dict(TINY if tiny else FULL, **overrides))


# --- the goals -----------------------------------------------------------------------------------
def _rows(report: dict, section: str) -> list[dict]:
    record = report["sections"].get(section) or {}
    return (record.get("result") or {}).get("rows", [])


def _find(rows: list[dict], **match) -> dict | None:
    return next((row for row in rows if all(row.get(key) == value for key, value in match.items())), None)


def _goal(goal: str, value, target: str, met) -> dict:
    return dict(goal=goal, value=value, target=target, met=met)


def _end_to_end_goals(report: dict, model: str) -> list[dict]:
    rows = [row for row in _rows(report, "end_to_end") if row.get("model") == model]
    summary = ((report["sections"].get("end_to_end") or {}).get("result") or {}).get("models", {}).get(model, {})
    goals = [_goal(f"{model}: peaked target, positions decided beyond bf16 rounding", summary.get("decided_share"),
                   ">= 0.95", None if "decided_share" not in summary else summary["decided_share"] >= 0.95)]
    oracle = {row["batch"]: row for row in rows if row["method"] == "engine-oracle+graphs"}
    one = oracle.get(1)
    if one and summary.get("verify_cost"):
        bound = 0.8 * one["tau"] / summary["verify_cost"]
        goals.append(_goal(f"{model}: oracle heads, batch 1, vs plain decoding with graphs", one["speedup"],
                           f">= 0.8 x tau / verify cost = 0.8 x {one['tau']:.2f} / {summary['verify_cost']:.2f} "
                           f"= {bound:.2f}", one["speedup"] >= bound))
    for batch, target, bound in ((8, ">= 1.5x", 1.5), (32, ">= 1.0x", 1.0)):
        row = oracle.get(batch)
        goals.append(_goal(f"{model}: oracle heads, batch {batch}, vs plain decoding with graphs",
                           row and row["speedup"], target, row and row["speedup"] >= bound))
    engines = [row for row in rows if row["method"] != "hf-greedy"]
    if engines:
        identical = sum(row["identical_to_hf"] for row in engines) / len(engines)
        goals.append(_goal(f"{model}: bf16 prompts identical to HF greedy (every engine and batch)", identical,
                           ">= 0.95", identical >= 0.95))
        ties = sum(row["num_not_near_tie"] for row in engines)
        goals.append(_goal(f"{model}: bf16 differences not at a near-tie", ties, "0", ties == 0))
    return goals


def goals(report: dict, ctx) -> list[dict]:
    """The GPU work's must-reach figures, each beside its target; met is None where the figure
    is missing (a section failed, was skipped, or a CPU has no peak HBM rate)."""
    steps = _rows(report, "step_time")
    big = ctx.step_models[0][0]
    decode = _find(steps, model=big, forward="compiled", B=1, T=1)
    fraction = decode and decode.get("floor_fraction")
    verify = _find(steps, model=big, forward="compiled", B=1, T=max(ctx.verify_trees))
    ratio = verify and verify.get("ratio_to_decode")
    kernel = [row.get("pct_peak_hbm") for row in _rows(report, "kernel_speed")
              if row.get("impl") == "triton_tree_kernel" and row.get("S") == max(ctx.speed_prefixes)
              and row.get("T", 0) <= 16]
    kernel = None if not kernel or None in kernel else min(kernel)
    lossless = ((report["sections"].get("lossless") or {}).get("result") or {}).get("lossless")
    blocks = (report["sections"].get("block_sizes") or {}).get("result") or {}
    e2e = report["sections"].get("end_to_end") or {}
    strict = [row.get("strict_syncs") for row in _rows(report, "end_to_end") if row["method"] != "hf-greedy"]
    syncs = None if not e2e.get("ok") or not strict or not all(strict) else True
    trained = (report["sections"].get("trained_heads") or {}).get("result") or {}
    found = [_goal(f"{big}: plain decode step (compiled, graphed), share of the weight-read floor", fraction,
                   ">= 0.75", None if fraction is None else fraction >= 0.75),
             _goal(f"{big}: verify at T={max(ctx.verify_trees)} in decode steps", ratio, "<= 1.15",
                   None if ratio is None else ratio <= 1.15),
             _goal(f"tree kernel at S={max(ctx.speed_prefixes)}, T <= 16, % of HBM (least)", kernel, ">= 60",
                   None if kernel is None else kernel >= 60),
             _goal("fp32 greedy lossless, everything on", lossless, "true", lossless),
             _goal(f"tree kernel block sizes fit on this machine's Triton {blocks.get('triton', '')}",
                   blocks.get("fits"), "true", blocks.get("fits")),
             _goal("warm engine steps: no sync but the declared read (sync debug mode 'error')", syncs, "true",
                   syncs),
             _goal("trained EAGLE-3 heads, bf16: every difference from HF bf16 greedy at an fp32 near-tie",
                   trained.get("near_ties_only"), "true", trained.get("near_ties_only")),
             _goal("trained EAGLE-3 heads, batch 1, vs plain decoding with graphs", trained.get("speedup"),
                   ">= 1.3x", None if trained.get("speedup") is None else trained["speedup"] >= 1.3)]
    for model in ctx.e2e_models:
        found += _end_to_end_goals(report, model)
    return found


# --- running and reporting --------------------------------------------------------------
SECTIONS = {"lossless": section_lossless, "block_sizes": section_block_sizes, "step_time": section_step_time,
            "kernel_speed": section_kernel_speed, "end_to_end": section_end_to_end,
            "trained_heads": section_trained_heads, "profile": section_profile, "parity": section_parity,
            "gemm": section_gemm, "autotune_step": section_autotune_step}  # the order they run in


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
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{key}={_cell(item)}" for key, item in value.items())
    return (" / " if any(isinstance(item, dict) for item in value) else " ").join(map(_cell, value)) \
        if isinstance(value, list) else str(value)


def _table(rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    if not columns:
        return []
    return ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + \
        ["| " + " | ".join(_cell(row.get(column, "")) for column in columns) + " |" for row in rows]


def _is_table(value) -> bool:
    """A list of dicts (rows), or a dict of dicts or of scalars (one row per key)."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(item, dict) for item in value)
    return isinstance(value, dict) and bool(value)


def format_markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# specheads GPU suite: {meta['device_name']}", "", f"`{meta['command']}`", "",
             f"torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, CUDA "
             f"{meta['cuda']}, TRITON_INTERPRET={meta['triton_interpret']}, tiny={meta['tiny']}, GPU decoder "
             f"{meta['gpu_decoder']}, {meta.get('seconds', 0):.0f} s", "", "## goals"]
    lines += _table(report["goals"])
    lines += ["", "| section | ok | seconds | error |", "|---|---|---|---|"]
    lines += [f"| {name} | {_cell(r['ok'])} | {r['seconds']:.1f} | {r.get('error', r.get('skipped', ''))} |"
              for name, r in report["sections"].items()]
    for name, record in report["sections"].items():
        result = record.get("result") or {}
        lines += ["", f"## {name}", ""]
        tables = {key: value for key, value in result.items() if _is_table(value)}
        lines += [f"- {key}: {_cell(value)}" for key, value in result.items() if key not in tables]
        for key, value in tables.items():  # rows first, then per-model summaries and the like
            if isinstance(value, dict):
                value = [dict(name=k, **v) if isinstance(v, dict) else dict(name=k, value=v) for k, v in value.items()]
            lines += ([] if key == "rows" else ["", f"{key}:"]) + _table(value)
    return "\n".join(lines) + "\n"


def _load_compile_cache(path: Path | None) -> str:
    if path is None or not path.exists():
        return "none"
    info = torch.compiler.load_cache_artifacts(path.read_bytes())
    return f"loaded {path.stat().st_size} bytes ({info})"


def _save_compile_cache(path: Path | None) -> None:
    saved = torch.compiler.save_cache_artifacts() if path is not None else None
    if saved is not None:
        atomic.write_bytes(path, saved[0])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m specheads.bench.gpu.suite", description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, type=Path, help="folder for gpu_suite.json and gpu_suite.md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (implied by --device cpu)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    parser.add_argument("--budget-s", type=float, default=None, help="skip sections that would start after this")
    parser.add_argument("--gpu-decoder", default=None, choices=["compile", "max-autotune", "eager"],
                        help="the GPU decoder's mode for the 'compiled' forward (default: compile)")
    parser.add_argument("--compile-cache", type=Path, default=None, help="inductor cache artifacts to load and save")
    parser.add_argument("--trained-target", default=None,
                        help="the target the trained heads are for (e.g. embedded:smollm2), for trained_heads")
    parser.add_argument("--trained-heads", default=None, help="a heads directory of EAGLE-3 heads trained on it")
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
    ctx = make_context(device, tiny, args.trained_target, args.trained_heads,
                       **({"gpu_decoder": args.gpu_decoder} if args.gpu_decoder else {}))
    meta = {"device_name": ctx.device_name, "device": str(device), "tiny": tiny, "gpu_decoder": ctx.gpu_decoder,
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "triton_interpret": os.environ.get("TRITON_INTERPRET"),
            "peak_hbm_bytes_per_s": ctx.peak_bw, "command": " ".join(["python -m specheads.bench.gpu.suite", *argv]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "compile_cache": _load_compile_cache(args.compile_cache)}
    report = {"schema": "specheads.gpu_suite/2", "meta": meta, "goals": [], "sections": {}}
    args.output.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    for name in names:
        if args.budget_s is not None and time.perf_counter() - begin > args.budget_s:
            report["sections"][name] = record = {"ok": True, "skipped": f"over the {args.budget_s:.0f} s budget",
                                                 "seconds": 0.0}
        else:
            print(f"[gpu_suite] {name} ...", flush=True)
            report["sections"][name] = record = run_section(ctx, name)
            _save_compile_cache(args.compile_cache)
        print(f"[gpu_suite] {name}: {record.get('error', record.get('skipped', 'ok'))} ({record['seconds']:.1f} s)",
              flush=True)
        meta["seconds"] = time.perf_counter() - begin
        report["goals"] = goals(report, ctx)
        atomic.write_json(args.output / "gpu_suite.json", report)  # after every section: a killed run keeps the rest
        atomic.write_text(args.output / "gpu_suite.md", format_markdown(report))
    for goal in report["goals"]:
        print(f"[gpu_suite] goal {_cell(goal['met']):>3}: {goal['goal']}: {_cell(goal['value'])} ({goal['target']})",
              flush=True)
    return 0 if all(record["ok"] for record in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
