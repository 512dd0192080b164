"""The GPU suite's trained-heads section (bench/gpu/suite.py runs it): the real SmolLM2 with
EAGLE-3 heads trained on it, where the suite is told where they are (`--trained-target`,
`--trained-heads`: a heads directory carried to the device, e.g. the one bench/gpu/heads.py
brings back).

- bf16 exactness: the engine in bf16 (the heads, CUDA graphs, the tree kernel, the compiled
  forward) against HF's own bf16 greedy decoding of the same prompts (MT-bench first turns),
  every first difference scored by the fp32 target (bench/divergence.py): a difference must
  sit at an fp32 near-tie (bf16 rounding explains it), never at a clear choice. This is the
  check the peaked random targets of the end-to-end section cannot make: their greedy tokens
  are decided far beyond bf16 rounding by construction.
- speed at batch 1: decode tokens/s of the engine with the trained heads against its own plain
  decoding, both graphed (prefill timed apart), the must-reach figure of the issue "The
  speculative step as one device program" (at least 1.3x).

Without a target and heads to load, the section says so in its one row. `--tiny` (the CPU
run) builds a tiny random Llama and a random EAGLE-3 head in place, so the section's code runs
in every CI run; its figures mean nothing there.
"""

from __future__ import annotations

import copy

import torch

from specheads.bench.gpu.engine import DENOMINATOR, _timed
from specheads.bench.gpu.models import graphs_mode, hf_greedy, random_eagle3, random_llama, random_prompts

MIN_SPEEDUP = 1.3


def _loaded(ctx):
    """(bf16 target, fp32 scorer, EAGLE-3 heads, their config or None, prompts) for the section."""
    from specheads.heads.target.adapter import TargetAdapter

    if ctx.tiny:
        model = random_llama(ctx.lossless_model, ctx.device, torch.float32)
        scorer = TargetAdapter(model, "random-tiny-llama")
        target = TargetAdapter(copy.deepcopy(model).to(torch.bfloat16), "random-tiny-llama-bf16")
        prompts = random_prompts(ctx.trained_prompts, None, model.config.vocab_size, seed=5)
        return target, scorer, random_eagle3(target), None, prompts
    from specheads.bench.prompts import encode_prompts, load_prompts, mt_bench_path
    from specheads.heads.artefacts.heads_dir import load_heads
    from specheads.runner import load_inference_target, load_target_and_tokenizer

    device = str(ctx.device)
    target, tokenizer = load_target_and_tokenizer(ctx.trained_target, heads=[ctx.trained_heads], dtype="bfloat16",
                                                  device=device)
    scorer = load_inference_target(ctx.trained_target, dtype="float32", device=device)
    heads, config = load_heads(ctx.trained_heads, target=target.identity, device=device, dtype=target.dtype)
    prompts = [p.input_ids for p in encode_prompts(tokenizer, load_prompts(mt_bench_path(), limit=ctx.trained_prompts))]
    return target, scorer, heads, config, prompts


def section_trained_heads(ctx) -> dict:
    """bf16 exactness and batch-1 speed of the trained EAGLE-3 heads (module doc)."""
    from specheads.bench.divergence import BF16_TIE_TOLERANCE, DivergenceChecker, summarise_divergences
    from specheads.serving.decode.config import SpeculativeDecoder, TreeSpec

    if not ctx.tiny and not (ctx.trained_target and ctx.trained_heads):
        return {"rows": [{"skipped": "no --trained-target and --trained-heads to load"}], "speedup": None,
                "near_ties_only": None}
    target, scorer, heads, config, prompts = _loaded(ctx)
    tree = TreeSpec.from_heads_config(config).tree if config is not None else None
    taps = dict(tap_layers=config.tap_layers) if config is not None else {}
    graphs, num_new = graphs_mode(ctx.device), ctx.trained_new
    engine = dict(fallback=None, attn_impl="tree", cuda_graphs=graphs)
    makers = {DENOMINATOR: lambda: SpeculativeDecoder(target, **engine),
              "engine-eagle3-trained+graphs": lambda: SpeculativeDecoder(target, heads, tree, **taps, **engine)}
    with torch.inference_mode():
        reference = [hf_greedy(target.model, [prompt], num_new)[0] for prompt in prompts]
    checker = DivergenceChecker(scorer, BF16_TIE_TOLERANCE)
    rows = []
    for name, make in makers.items():
        run = _timed(ctx, target.model, make, [[prompt] for prompt in prompts], num_new)
        divergences = [checker.check(p, want, got) for p, want, got in zip(prompts, reference, run["tokens"])]
        rows.append(dict(method=name, batch=1, tokens_per_s=len(prompts) * (num_new - 1) / run["decode_s"],
                         prefill_ms_per_prompt=run["prefill_s"] / len(prompts) * 1e3,
                         tau=sum(r.stats.tau for r in run["results"]) / len(prompts),
                         identical_to_hf=sum(d is None for d in divergences) / len(prompts),
                         divergences=[d.to_json() for d in divergences if d is not None],
                         **summarise_divergences(divergences)))
    plain, heads_row = rows
    return {"rows": rows, "speedup": heads_row["tokens_per_s"] / plain["tokens_per_s"],
            "near_ties_only": all(row["num_not_near_tie"] == 0 for row in rows), "prompts": len(prompts),
            "new_tokens": num_new, "tolerance": BF16_TIE_TOLERANCE,
            "note": "bf16 engine (heads, graphs, tree kernel, compiled forward where the target has one) against "
                    "HF bf16 greedy; every first difference scored by the fp32 target"}
