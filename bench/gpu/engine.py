"""The GPU suite's engine sections (bench/gpu/suite.py runs them, with its shapes in `ctx`):
greedy lossless against HF and end-to-end tokens/s, plus what every section builds: random
targets (peaked ones whose greedy tokens bf16 cannot flip), prompts, stub heads (no checkpoint
travels to a lent GPU) and a verify forward built as the engine's CUDA graphs build it.
Imports torch, transformers and the serving modules that pull no deepspeed, fastapi, uvicorn,
pydantic, wandb, datasets or gguf.

Shape legend: B batch, T tree tokens, S prefix keys, V vocab, H hidden size, P prompts,
C continuation tokens.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
from dataclasses import dataclass

import torch
from torch import nn

from specheads.bench.support import random_tree_mask
from specheads.bench.support import kv_read_bytes, time_ms, wall_s, weight_read_bytes
from specheads.serving.decode.generate import generate

# The Medusa tree of tests/serving/decode/test_decode_lossless.py: ranks 0 and 1, depth 4.
TREE_PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0], [0, 0, 1, 0]]
NUM_HEADS = 4
# Peaked targets: the o_proj/down_proj scales tried, largest first (halving is exact in bf16),
# and the share of greedy positions that must be decided beyond bf16 rounding to stop.
PEAK_LAYER_SCALE = 0.05
PEAK_TRIES = 5  # down to 0.05 / 16: the 8B shape's wider, deeper layers add more per unit of scale
PEAK_DECIDED = 0.99


def merged_stats(results):
    from specheads.serving.decode.stats import DecodeStats

    return functools.reduce(DecodeStats.merge, (result.stats for result in results), DecodeStats())


def graphs_mode(device: torch.device) -> str:
    """The engines' cuda_graphs setting: capture on a GPU; elsewhere "eager", the same
    static-shape forward uncaptured."""
    return "capture" if device.type == "cuda" else "eager"


def spread_weights(module: nn.Module, std: float) -> None:
    """Every 2-D weight drawn from N(0, std): a random model less tie-prone than its init."""
    for param in module.parameters():
        if param.dim() == 2:
            nn.init.normal_(param, 0.0, std)


def free_device_memory() -> None:
    """Drop what the last model left, so the next (an 8B one) fits; a no-op without CUDA."""
    gc.collect()
    torch.cuda.empty_cache()


@contextlib.contextmanager
def built_on(device: torch.device, dtype: torch.dtype):
    """Build modules on `device` in `dtype`: an 8B model never exists on the CPU or in fp32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def random_llama(shape: dict, device: torch.device, dtype: torch.dtype, init_std: float | None = 0.3):
    """A random Llama (the tests' make_tiny_model, built in place). init_std: the spread of 2-D
    weights (0.3 makes greedy decoding less tie-prone); None keeps transformers' init."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with built_on(device, dtype):
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                             pad_token_id=0))
    if init_std is not None:
        spread_weights(model, init_std)
    return model.eval().requires_grad_(False)


def adapters(ctx, model) -> dict:
    """The two forwards the suite compares on one model: "hf" (the model's own) and "compiled"
    (the GPU decoder in ctx.gpu_decoder's mode, heads/target/gpu_decoder.py; its weights are views of
    the model's, so both share one copy)."""
    from specheads.heads.target.adapter import TargetAdapter

    return {"hf": TargetAdapter(model, "random-llama"),
            "compiled": TargetAdapter(model, "random-llama", gpu_decoder=ctx.gpu_decoder)}


def random_prompts(num: int, length: int | None, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` tokens (None: lengths 3..31, spread)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [length or 3 + (7 * index) % 29 for index in range(num)]
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF generate(do_sample=False), equal-length prompts batched together (no padding)."""
    ids = torch.tensor(prompts, device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


# --- peaked targets -----------------------------------------------------------------------
@dataclass
class PeakedTarget:
    model: nn.Module  # bf16, the suite's target
    scorer: object  # TargetAdapter of the same weights in fp32 (bench/divergence.py's scorer)
    layer_scale: float
    stats: dict  # decided_share etc. (`decided_share`)


def decided_share(model, scorer, prompts: list[list[int]], num_new: int) -> dict:
    """How stable `model`'s bf16 greedy decoding is: over the positions of its greedy
    continuations of `prompts`, the fp32 top-1 gap against how far bf16 moves it. tolerance
    = twice the 99th percentile of that movement (two bf16 programs can each be that far off,
    in opposite directions: bench/divergence.py's rule, measured on this model); decided_share
    = positions whose fp32 gap is above it; argmax_agreement = positions where bf16 and fp32
    pick the same token on the same context."""
    from specheads.heads.target.adapter import TargetAdapter

    sequences = torch.tensor([p + c for p, c in zip(prompts, hf_greedy(model, prompts, num_new))], device=model.device)
    context = sequences[:, :-1]  # logits at the last num_new positions predict the continuation
    with torch.inference_mode():
        fp32_PCV = scorer(context, [], logits_to_keep=num_new).logits.float()
        bf16_PCV = TargetAdapter(model)(context, [], logits_to_keep=num_new).logits.float()
    top_PC2 = fp32_PCV.topk(2, dim=-1)
    gap_PC = top_PC2.values[..., 0] - top_PC2.values[..., 1]
    bf16_PC2 = bf16_PCV.gather(-1, top_PC2.indices)
    movement_PC = ((bf16_PC2[..., 0] - bf16_PC2[..., 1]) - gap_PC).abs()
    tolerance = 2 * torch.quantile(movement_PC.flatten(), 0.99).item()
    return dict(positions=gap_PC.numel(), tolerance=tolerance, gap_median=gap_PC.median().item(),
                decided_share=(gap_PC > tolerance).float().mean().item(),
                argmax_agreement=(bf16_PCV.argmax(-1) == fp32_PCV.argmax(-1)).float().mean().item())


def peaked_llama(ctx, shape: dict) -> PeakedTarget:
    """A random bf16 Llama of `shape` whose greedy tokens are decided beyond bf16 rounding.
    Scaling the logits does not do it: bf16's error scales with them. So the lm_head rows are
    the input embeddings in a random order (the final state's own token embedding picks its
    logit), and every o_proj and down_proj is scaled down (PEAK_LAYER_SCALE, halved until
    PEAK_DECIDED of the positions are decided, in at most PEAK_TRIES tries) so that the layers
    perturb that state without flattening it. Every layer still runs at full cost."""
    from specheads.heads.target.adapter import TargetAdapter

    model = random_llama(shape, ctx.device, torch.bfloat16, init_std=None)
    generator = torch.Generator().manual_seed(3)
    order = torch.randperm(model.config.vocab_size, generator=generator).to(ctx.device)
    projections = [w for layer in model.model.layers
                   for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight[order])
        for weight in projections:
            weight.mul_(PEAK_LAYER_SCALE)
    scorer = TargetAdapter(copy.deepcopy(model).float(), "random-llama-fp32")
    projections += [w for layer in scorer.model.model.layers for w in (layer.self_attn.o_proj.weight,
                                                                       layer.mlp.down_proj.weight)]
    prompts = random_prompts(ctx.peak_prompts, ctx.e2e_prompt_len, model.config.vocab_size, seed=11)
    scale, tries = PEAK_LAYER_SCALE, []
    for attempt in range(PEAK_TRIES):
        tries.append(dict(layer_scale=scale, **decided_share(model, scorer, prompts, ctx.peak_new)))
        if tries[-1]["decided_share"] >= PEAK_DECIDED or attempt + 1 == PEAK_TRIES:
            break
        with torch.no_grad():  # both copies, exactly
            for weight in projections:
                weight.mul_(0.5)
        scale /= 2
    return PeakedTarget(model, scorer, scale, dict(tries[-1], tries=tries))


class OracleMedusa(nn.Module):
    """Medusa-shaped stub heads that know the target's greedy continuations (the tests'
    MultiOracle on any device): a hidden state is matched to its (prompt, position) by
    nearest neighbour; head k puts its mass on the greedy token k+2 positions on."""

    def __init__(self, target, sequences: list[list[int]], prompt_lengths: list[int]):
        super().__init__()
        self.num_heads, self.vocab_size = NUM_HEADS, target.vocab_size
        hidden, ahead = [], []
        for tokens, length in zip(sequences, prompt_lengths):
            states = target(torch.tensor([tokens], device=target.device), [target.num_layers]).taps[0][0].float()
            for position in range(length - 1, len(tokens)):
                hidden.append(states[position])
                ahead.append([tokens[min(position + k + 2, len(tokens) - 1)] for k in range(NUM_HEADS)])
        # A frozen parameter, not a buffer: the Medusa drafter takes the heads' device from their parameters.
        self.hidden_NH = nn.Parameter(torch.stack(hidden), requires_grad=False)
        self.register_buffer("ahead_NK", torch.tensor(ahead, device=target.device))

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> logits [K, B, T, V]."""
        batch, num_positions, size = hidden_BTH.shape
        rows_N = torch.cdist(hidden_BTH.reshape(-1, size).float(), self.hidden_NH).argmin(dim=1)
        logits = torch.zeros(self.num_heads, rows_N.shape[0], self.vocab_size, device=hidden_BTH.device)
        logits.scatter_(2, self.ahead_NK[rows_N].T[:, :, None], 10.0)
        return logits.reshape(self.num_heads, batch, num_positions, self.vocab_size)


def random_medusa(target) -> nn.Module:
    from specheads.heads.medusa import MedusaHeads

    with built_on(target.device, target.dtype):
        heads = MedusaHeads(target.hidden_size, target.vocab_size, NUM_HEADS)
    heads.init_lm_heads_from(target.lm_head())  # plausible candidates: often the target's own top tokens
    nn.init.normal_(heads.block_weight, std=0.2)
    return heads.eval()


# --- a verify forward as the engine's CUDA graphs run it ------------------------------------
def prefilled_cache(target, num_rows: int, context: int, room: int, group: int = 4):
    """A static-shape TreeStaticCache (serving/decode/cache.py, as the engine builds it for CUDA
    graphs) of `num_rows` rows, each holding a committed random prompt of `context` tokens, with
    `room` slots after it; prefilled `group` rows per forward."""
    from specheads.serving.decode.cache import TreeStaticCache

    cache = TreeStaticCache(target.config, max_cache_len=context + room, batch_size=num_rows, static_shape=True)
    generator = torch.Generator().manual_seed(context)
    with torch.inference_mode():
        for start in range(0, num_rows, group):
            stop = min(start + group, num_rows)
            cache.set_rows(start, stop)
            prompt = torch.randint(3, target.vocab_size, (stop - start, context), generator=generator)
            target(prompt.to(target.device), [], past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.commit()
    cache.set_rows(0, num_rows)
    return cache


def verify_call(target, cache, num_tree: int, attn: str, tap_layers: list[int] | None = None):
    """A zero-argument call: one verify forward of a random T-node tree in each of the cache's
    active rows, with its inputs built as serving/decode/graphs.py builds them (device tensors
    made once; positions, masks and prefix lengths derived on the device inside the call, the
    tree kernel's prefix lengths bounded so nothing syncs) -> logits [B, T, V]. Its T entries
    stay pending, so the next call overwrites them, as a rejected tree's are."""
    from specheads.serving.kernels.tree_attention import pack_tree_mask, use_tree_attention

    if attn == "tree":  # else the model's attention function would drop the tree arguments
        use_tree_attention(target.model)
    num_rows, device = len(cache.seq_lens), target.device
    generator = torch.Generator().manual_seed(num_tree)
    tree_TT = random_tree_mask(num_tree, generator).to(device)
    masks_BTT, offsets_BT = tree_TT.expand(num_rows, -1, -1), (tree_TT.sum(dim=1) - 1).expand(num_rows, -1)
    tokens_BT = torch.randint(3, target.vocab_size, (num_rows, num_tree), generator=generator).to(device)
    taps = [target.num_layers] if tap_layers is None else tap_layers

    def call():
        if attn == "tree":
            kwargs = dict(tree_mask=pack_tree_mask(masks_BTT), prefix_len=cache.lengths.active_device,
                          max_prefix_len=cache.max_cache_len - num_tree)
        else:
            kwargs = dict(attention_mask=cache.attention_mask(masks_BTT))
        return target(tokens_BT, taps, position_ids=cache.position_ids(offsets_BT), past_key_values=cache,
                      use_cache=True, **kwargs).logits
    return call


def step_ms(ctx, call) -> dict:
    """One forward's milliseconds: eager (the first call compiles what it needs), and on a GPU
    its CUDA-graph replay (serving/decode/graphs.capture, as the engine captures it): `ms`."""
    with torch.inference_mode():
        row = dict(eager_ms=time_ms(call, ctx.device, 1, ctx.eager_repeats))
        if ctx.device.type == "cuda":
            from specheads.serving.decode.graphs import capture

            graph, _ = capture(call, ctx.device)
            row["graph_ms"] = time_ms(graph.replay, ctx.device, ctx.warmup, ctx.repeats)
            del graph
    return dict(row, ms=row.get("graph_ms", row["eager_ms"]))


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


def random_eagle3(target):
    """A random EAGLE-3 head of the target's size, on its device and in its dtype (its drafting
    costs what a trained one's does; it rarely guesses right)."""
    from specheads.heads.eagle3 import Eagle3Head

    text = target.text_config
    with built_on(target.device, target.dtype):
        head = Eagle3Head(target.hidden_size, target.vocab_size, target.vocab_size, text.num_attention_heads,
                          text.num_key_value_heads, text.intermediate_size, num_taps=3)
    return head.eval().requires_grad_(False)


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
