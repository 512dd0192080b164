"""The GPU suite's engine sections (bench/gpu/suite.py runs them, with its shapes in `ctx`):
greedy lossless against HF and end-to-end tokens/s, on what bench/gpu/models.py builds.
Imports torch, transformers and the serving modules that pull no deepspeed, fastapi, uvicorn,
pydantic, wandb, datasets or gguf.

Shape legend: B batch, T tree tokens, S prefix keys, V vocab, P prompts, C continuation tokens.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from specheads.bench.gpu.models import (NUM_HEADS, TREE_PATHS, OracleMedusa, adapters, built_on, free_device_memory,
                                        graphs_mode, hf_greedy, merged_stats, peaked_llama, prefilled_cache,
                                        random_eagle3, random_llama, random_medusa, random_prompts, spread_weights,
                                        step_ms, verify_call)
from specheads.bench.support import kv_read_bytes, wall_s, weight_read_bytes
from specheads.serving.decode.generate import generate

# --- greedy lossless ------------------------------------------------------------------------
def lossless_decoders(ctx, target, sequences: list[list[int]], prompt_lengths: list[int]) -> dict:
    """Engines to compare with HF greedy; the kernel ones run on a copy of the target (the
    tree-attention path switches its model's attention function), the compiled ones on
    another copy through the GPU decoder (heads/target/gpu_decoder.py)."""
    from specheads.heads.eagle3 import Eagle3Head, default_tap_layers
    from specheads.heads.target.adapter import TargetAdapter
    from specheads.serving.decode.config import SpeculativeDecoder
    from specheads.serving.decode.trees import DraftTree

    tree, text, taps = DraftTree.from_paths(TREE_PATHS), target.text_config, default_tap_layers(target.num_layers)
    kernel_target = TargetAdapter(copy.deepcopy(target.model), "random-tiny-llama")
    compiled = TargetAdapter(copy.deepcopy(target.model), "random-tiny-llama", gpu_decoder=ctx.gpu_decoder)
    kernel = dict(attn_impl="tree", tree_attention_impl="triton", fallback=None)
    oracle = OracleMedusa(target, sequences, prompt_lengths)
    with built_on(target.device, target.dtype):
        eagle = Eagle3Head(target.hidden_size, target.vocab_size, target.vocab_size, text.num_attention_heads,
                           text.num_key_value_heads, text.intermediate_size, num_taps=3).eval()
    spread_weights(eagle, 0.3)
    graphs = graphs_mode(target.device)
    return {"plain": SpeculativeDecoder(target, fallback=None),
            "plain+graphs": SpeculativeDecoder(target, fallback=None, cuda_graphs=graphs),
            "medusa-random": SpeculativeDecoder(target, random_medusa(target), tree, fallback=None),
            "medusa-oracle": SpeculativeDecoder(target, oracle, tree, fallback=None),
            "eagle3-random": SpeculativeDecoder(target, eagle, tree, tap_layers=taps, fallback=None),
            "medusa-oracle+kernel": SpeculativeDecoder(kernel_target, oracle, tree, **kernel),
            "eagle3-random+kernel": SpeculativeDecoder(kernel_target, eagle, tree, tap_layers=taps, **kernel),
            "medusa-oracle+kernel+graphs": SpeculativeDecoder(kernel_target, oracle, tree, **kernel,
                                                              cuda_graphs=graphs),
            "eagle3-random+kernel+graphs": SpeculativeDecoder(kernel_target, eagle, tree, tap_layers=taps, **kernel,
                                                              cuda_graphs=graphs),
            # Everything on: the compiled forward, the kernel and CUDA graphs.
            "plain+kernel+graphs+compiled": SpeculativeDecoder(compiled, **kernel, cuda_graphs=graphs),
            "medusa-oracle+kernel+graphs+compiled": SpeculativeDecoder(compiled, oracle, tree, **kernel,
                                                                       cuda_graphs=graphs),
            "eagle3-random+kernel+graphs+compiled": SpeculativeDecoder(compiled, eagle, tree, tap_layers=taps,
                                                                       **kernel, cuda_graphs=graphs)}


def _greedy_match(ctx, target, prompts: list[list[int]], num_new: int) -> list[dict]:
    long = [hf_greedy(target.model, [prompt], num_new + NUM_HEADS + 2)[0] for prompt in prompts]
    decoders = lossless_decoders(ctx, target, [p + t for p, t in zip(prompts, long)], [len(p) for p in prompts])
    rows = []
    for name, decoder in decoders.items():
        results = [generate(decoder, prompt, num_new) for prompt in prompts]
        identical = [result.tokens == tokens[:num_new] for result, tokens in zip(results, long)]
        rows.append(dict(dtype=str(target.dtype)[6:], decoder=name, identical_per_prompt=identical,
                         match_rate=sum(identical) / len(identical), tau=merged_stats(results).tau, new_tokens=num_new))
    return rows


def section_lossless(ctx) -> dict:
    """fp32 greedy of every engine (everything on included) against HF greedy on a tiny random
    Llama, and the bf16 match rate of the same engines on its bf16 copy (tie-prone: the peaked
    targets' bf16 check is in end_to_end)."""
    from specheads.heads.target.adapter import TargetAdapter

    model = random_llama(ctx.lossless_model, ctx.device, torch.float32)
    prompts = random_prompts(ctx.lossless_prompts, None, model.config.vocab_size, seed=1234)
    fp32 = _greedy_match(ctx, TargetAdapter(model, "random-tiny-llama"), prompts, ctx.lossless_new)
    bf16 = _greedy_match(ctx, TargetAdapter(copy.deepcopy(model).to(torch.bfloat16), "bf16"), prompts, ctx.bf16_new)
    return {"rows": fp32 + bf16, "lossless": all(all(row["identical_per_prompt"]) for row in fp32),
            "bf16_match_rate": {row["decoder"]: row["match_rate"] for row in bf16}}


# --- end to end -------------------------------------------------------------------------------
DENOMINATOR = "engine-plain+graphs"  # speedups are against the engine's own plain decoding, graphed


def _scheduler(decoder, batch: int, prompt_len: int, num_new: int):
    from specheads.serving.decode.scheduler import Scheduler

    return Scheduler(decoder, max_batch_size=batch, max_cache_len=prompt_len + num_new + decoder.max_tree_nodes + 1)


@contextlib.contextmanager
def strict_syncs(ctx):
    """On a GPU, torch.cuda's sync debug mode "error" inside: any host sync raises, except the
    decode step's declared one (its read, and a CUDA graph's capture: serving/decode/graphs.py
    `declared_sync`). Elsewhere a no-op."""
    if ctx.device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _admit(session, prompts, num_new: int) -> list[int]:
    """Every prompt admitted to `session` (a Scheduler): each one's prefill -> their seq_ids."""
    from specheads.serving.decode.scheduler import SequenceRequest

    return [session.add(SequenceRequest(prompt, num_new)) for prompt in prompts]


def _decode(session, seq_ids: list[int], ctx=None) -> list:
    """Step `session` until every sequence finished -> results in seq_ids' order. ctx: under
    `strict_syncs(ctx)`; a sequence that failed raises (under sync debug mode a sync is fatal:
    serving/decode/faults.py)."""
    results = {}
    with strict_syncs(ctx) if ctx is not None else contextlib.nullcontext():
        while session.num_active:
            results.update({update.seq_id: update.result for update in session.step() if update.finished})
    failed = [result.error for result in results.values() if result.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"{len(failed)} sequences failed: {failed[0]}")
    return [results[seq_id] for seq_id in seq_ids]


def _timed(ctx, model, make, groups, num_new: int) -> dict:
    """One method over `groups` of prompts after a warm-up run of the first (captures, compiles),
    its prefill timed apart from its decode steps, the decode steps under `strict_syncs` (an
    engine's; HF's generate syncs by design) -> dict(tokens per prompt, results (None for HF),
    decode_s, prefill_s). HF's prefill is one forward of the group, its decode the rest of its
    generate. An engine keeps one Scheduler across groups, as a server keeps its engine."""
    decoder = make() if make else None
    outputs, decode_s, prefill_s = [], 0.0, 0.0
    with torch.inference_mode():
        if decoder is None:
            hf_greedy(model, groups[0], num_new)
            for group in groups:
                ids = torch.tensor(group, device=model.device)
                _, prefill = wall_s(lambda: model(ids, attention_mask=torch.ones_like(ids), logits_to_keep=1),
                                    ctx.device)
                out, took = wall_s(lambda: hf_greedy(model, group, num_new), ctx.device)
                outputs, decode_s, prefill_s = outputs + out, decode_s + took - prefill, prefill_s + prefill
            return dict(tokens=outputs, results=None, decode_s=decode_s, prefill_s=prefill_s)
        session = _scheduler(decoder, len(groups[0]), len(groups[0][0]), num_new)
        _decode(session, _admit(session, groups[0], num_new))
        for group in groups:
            seq_ids, prefill = wall_s(lambda: _admit(session, group, num_new), ctx.device)
            results, took = wall_s(lambda: _decode(session, seq_ids, ctx), ctx.device)
            outputs, decode_s, prefill_s = outputs + results, decode_s + took, prefill_s + prefill
    return dict(tokens=[result.tokens for result in outputs], results=outputs, decode_s=decode_s, prefill_s=prefill_s)


def _rate_rows(ctx, model, decoders: dict, prompts, num_new: int, batch: int, checker, context: int) -> list[dict]:
    """Decode tokens/s (the tokens after each prompt's first, over the decode steps' time; the
    prefill timed apart) of HF greedy and of each engine over `prompts` in groups of `batch`,
    beside the weight-read floor of plain decoding at this batch and `context` (weights + K/V
    bytes at peak HBM, one token per row per step); speedups against DENOMINATOR; each output
    against HF's bf16 greedy, a difference scored by the fp32 target (near-tie or not:
    bench/divergence.py)."""
    from specheads.bench.divergence import summarise_divergences

    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    methods = {"hf-greedy": None, **decoders}
    measured = {name: _timed(ctx, model, make, groups, num_new) for name, make in methods.items()}
    rates = {name: len(prompts) * (num_new - 1) / run["decode_s"] for name, run in measured.items()}
    floor = None
    if ctx.peak_bw:
        floor = batch * ctx.peak_bw / (weight_read_bytes(model) + kv_read_bytes(model.config, batch, context))
    reference = measured["hf-greedy"]["tokens"]
    rows = []
    for name, run in measured.items():
        divergences = [checker.check(p, want, got) for p, want, got in zip(prompts, reference, run["tokens"])]
        tau = 1.0 if run["results"] is None else merged_stats(run["results"]).tau
        rows.append(dict(batch=batch, method=name, tokens_per_s=rates[name], speedup=rates[name] / rates[DENOMINATOR],
                         vs_hf=rates[name] / rates["hf-greedy"], tau=tau,
                         prefill_ms_per_prompt=run["prefill_s"] / len(prompts) * 1e3,
                         floor_tokens_per_s=floor, floor_fraction=floor and rates[name] / floor,
                         strict_syncs=ctx.device.type == "cuda" and run["results"] is not None,
                         identical_to_hf=sum(d is None for d in divergences) / len(prompts),
                         **summarise_divergences(divergences)))
    return rows


def _end_to_end(ctx, model_name: str, shape: dict) -> tuple[list[dict], dict]:
    from specheads.bench.divergence import DivergenceChecker
    from specheads.heads.eagle3 import default_tap_layers
    from specheads.serving.decode.config import SpeculativeDecoder
    from specheads.serving.decode.trees import DraftTree

    peaked = peaked_llama(ctx, shape)
    forwards, num_new = adapters(ctx, peaked.model), ctx.e2e_new
    prompts = random_prompts(max(ctx.e2e_prompts, *ctx.e2e_batches), ctx.e2e_prompt_len, peaked.model.config.vocab_size,
                             seed=7)
    with torch.inference_mode():
        long = hf_greedy(peaked.model, prompts, num_new + NUM_HEADS + 2)
        oracle = OracleMedusa(forwards["compiled"], [p + t for p, t in zip(prompts, long)], [len(p) for p in prompts])
    tree, graphs = DraftTree.from_paths(TREE_PATHS), graphs_mode(ctx.device)
    eagle = random_eagle3(forwards["compiled"])
    taps = default_tap_layers(forwards["compiled"].num_layers)

    def engine(forward: str, heads=None):
        target = forwards[forward]
        extra = dict(tap_layers=taps) if heads is eagle else {}
        return lambda: SpeculativeDecoder(target, heads, tree if heads is not None else None, fallback=None,
                                          attn_impl="tree", cuda_graphs=graphs, **extra)
    decoders = {DENOMINATOR: engine("compiled"), "engine-oracle+graphs": engine("compiled", oracle),
                "engine-eagle3-random+graphs": engine("compiled", eagle)}
    checker = DivergenceChecker(peaked.scorer, peaked.stats["tolerance"])
    context = ctx.e2e_prompt_len + num_new // 2  # the decode steps' mean context
    rows = []
    for batch in ctx.e2e_batches:
        methods = dict(decoders) if batch > 1 else dict(decoders, **{
            f"{DENOMINATOR}/hf-forward": engine("hf"), "engine-oracle+graphs/hf-forward": engine("hf", oracle)})
        rows += _rate_rows(ctx, peaked.model, methods, prompts[:batch if batch > 1 else ctx.e2e_prompts], num_new,
                           batch, checker, context)
    # The batch-1 goal's verify cost: a verify of the tree against a decode step, graphed, at this context.
    cache = prefilled_cache(forwards["hf"], 1, ctx.e2e_prompt_len + num_new // 2, tree.num_nodes + 1)
    decode_ms = step_ms(ctx, verify_call(forwards["compiled"], cache, 1, "tree"))["ms"]
    verify_ms = step_ms(ctx, verify_call(forwards["compiled"], cache, tree.num_nodes, "tree"))["ms"]
    summary = dict(peaked.stats, layer_scale=peaked.layer_scale, verify_nodes=tree.num_nodes,
                   verify_cost=verify_ms / decode_ms, compile_s=forwards["compiled"].gpu.compile_seconds)
    return [dict(model=model_name, **row) for row in rows], summary


def section_end_to_end(ctx) -> dict:
    """Decode tokens/s (prefill timed apart) on peaked random targets of each shape at each batch
    size, at ctx.e2e_prompt_len context, beside the weight-read floor: HF greedy (eager), the
    engine's plain decoding, oracle-drafted (Medusa) and random-EAGLE-3-drafted decoding, CUDA
    graphs and the tree kernel on, the compiled forward (and, at batch 1, the model's own
    forward); speedups against the engine's plain decoding with graphs. On a GPU every engine's
    warm steps run under sync debug mode "error" (`strict_syncs`)."""
    rows, models = [], {}
    for model_name, shape in ctx.e2e_models.items():
        model_rows, models[model_name] = _end_to_end(ctx, model_name, shape)
        rows += model_rows
        free_device_memory()  # one model at a time on the device
    return {"rows": rows, "models": models, "prompt_len": ctx.e2e_prompt_len, "new_tokens": ctx.e2e_new,
            "denominator": DENOMINATOR,
            "note": "peaked random bf16 targets (gpu_engine.peaked_llama), fallback off, tree kernel and CUDA graphs "
                    "on; 'oracle' heads know HF's greedy continuation (tau's upper bound for this tree); "
                    "'eagle3-random': a random EAGLE-3 head of the target's size (its drafting cost, tau near 1); "
                    "tokens_per_s: decode steps only (prefill_ms_per_prompt apart); floor_tokens_per_s: plain "
                    "decoding's weight-read floor at this batch and context"}
