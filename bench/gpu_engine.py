"""The GPU suite's engine sections (bench/gpu_suite.py runs them, with its shapes in `ctx`):
greedy lossless against HF, verify against decode, one forward eager against its CUDA graph,
and end-to-end tokens/s, plus the random targets, prompts and stub heads they build (no
checkpoint travels to a lent GPU). Imports torch, transformers and the serving modules that
pull no deepspeed, fastapi, uvicorn, wandb, datasets or gguf.

Shape legend: B batch, T tree tokens, S prefix keys, V vocab, H hidden size.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc

import torch

from torch import nn

from specheads.bench.gpu_kernels import random_tree_mask, time_ms, wall_s
from specheads.serving.decode.generate import generate

# The Medusa tree of tests/serving/decode/test_decode_lossless.py: ranks 0 and 1, depth 4.
TREE_PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0], [0, 0, 1, 0]]
NUM_HEADS = 4


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


def bench_target(ctx, shape: dict | None = None):
    """A random bf16 target of `shape` (default: verify_vs_decode's, 8B-shaped unless tiny)."""
    from specheads.heads.target import TargetAdapter

    model = random_llama(shape or ctx.bench_model, ctx.device, torch.bfloat16, init_std=None)
    return TargetAdapter(model, "random-llama")


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


# --- 3. greedy lossless -----------------------------------------------------------------
def lossless_decoders(target, sequences: list[list[int]], prompt_lengths: list[int]) -> dict:
    """Engines to compare with HF greedy; the kernel ones run on a copy of the target (the
    tree-attention path switches its model's attention function)."""
    from specheads.heads.eagle3 import Eagle3Head, default_tap_layers
    from specheads.heads.target import TargetAdapter
    from specheads.serving.decode.config import SpeculativeDecoder
    from specheads.serving.decode.trees import DraftTree

    tree, text, taps = DraftTree.from_paths(TREE_PATHS), target.text_config, default_tap_layers(target.num_layers)
    kernel_target = TargetAdapter(copy.deepcopy(target.model), "random-tiny-llama")
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
            "medusa-oracle+kernel+graphs": SpeculativeDecoder(kernel_target, oracle, tree, **kernel, cuda_graphs=graphs),
            "eagle3-random+kernel+graphs": SpeculativeDecoder(kernel_target, eagle, tree, tap_layers=taps, **kernel,
                                                              cuda_graphs=graphs)}


def _greedy_match(target, prompts: list[list[int]], num_new: int) -> list[dict]:
    long = [hf_greedy(target.model, [prompt], num_new + NUM_HEADS + 2)[0] for prompt in prompts]
    decoders = lossless_decoders(target, [p + t for p, t in zip(prompts, long)], [len(p) for p in prompts])
    rows = []
    for name, decoder in decoders.items():
        results = [generate(decoder, prompt, num_new) for prompt in prompts]
        identical = [result.tokens == tokens[:num_new] for result, tokens in zip(results, long)]
        rows.append(dict(dtype=str(target.dtype)[6:], decoder=name, identical_per_prompt=identical,
                         match_rate=sum(identical) / len(identical), tau=merged_stats(results).tau, new_tokens=num_new))
    return rows


def section_lossless(ctx) -> dict:
    from specheads.heads.target import TargetAdapter

    model = random_llama(ctx.lossless_model, ctx.device, torch.float32)
    prompts = random_prompts(ctx.lossless_prompts, None, model.config.vocab_size, seed=1234)
    fp32 = _greedy_match(TargetAdapter(model, "random-tiny-llama"), prompts, ctx.lossless_new)
    bf16 = _greedy_match(TargetAdapter(copy.deepcopy(model).to(torch.bfloat16), "bf16"), prompts, ctx.bf16_new)
    return {"rows": fp32 + bf16, "lossless": all(all(row["identical_per_prompt"]) for row in fp32),
            "bf16_match_rate": {row["decoder"]: row["match_rate"] for row in bf16}}


# --- 4. verify vs decode ----------------------------------------------------------------
def prefilled(ctx, shape: dict | None, context: int, static_shape: bool = False):
    """(random bf16 target of `shape`, a TreeStaticCache holding a committed random prompt of
    `context` tokens, room for the largest verify tree)."""
    from specheads.serving.decode.cache import TreeStaticCache

    target = bench_target(ctx, shape)
    cache = TreeStaticCache(target.model.config, max_cache_len=context + max(ctx.verify_trees) + 1,
                            static_shape=static_shape)
    prompt = torch.randint(3, target.vocab_size, (1, context), device=ctx.device)
    target(prompt, [], past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.commit()
    return target, cache


def forward_call(ctx, target, cache, num_tree: int, attn: str):
    """A zero-argument call: one target forward of a random T-node tree over the committed
    cache -> its logits. Its T entries stay pending, so the next call overwrites them (as a
    rejected tree's are). Every input is a device tensor made once, as a captured engine
    step's would be; a static-shape cache gets its mask even at T = 1 (a graph records no
    host state), a dynamic one then uses the model's own causal mask."""
    from specheads.serving.kernels.tree_attention import pack_tree_mask

    tree_mask = random_tree_mask(num_tree, torch.Generator().manual_seed(num_tree)).to(ctx.device)
    position_ids = cache.position_ids(tree_mask.sum(dim=1) - 1)  # [1, T] committed length + depth
    tokens = torch.randint(3, target.vocab_size, (1, num_tree), device=ctx.device)
    kwargs = {}
    if num_tree > 1 or cache.static_shape:
        kwargs = dict(tree_mask=pack_tree_mask(tree_mask), prefix_len=cache.get_seq_length()) if attn == "tree" \
            else dict(attention_mask=cache.attention_mask(tree_mask))
    return lambda: target(tokens, [], position_ids=position_ids, past_key_values=cache, use_cache=True,
                          **kwargs).logits


def section_verify_vs_decode(ctx) -> dict:
    from specheads.serving.kernels.tree_attention import use_tree_attention

    target, cache = prefilled(ctx, None, ctx.context)
    model = target.model
    rows = []
    for attn in ("sdpa", "tree"):  # the model is this section's own: no need to switch it back
        if attn == "tree":
            use_tree_attention(model)
        for num_tree in (1, *ctx.verify_trees):
            ms = time_ms(forward_call(ctx, target, cache, num_tree, attn), ctx.device, max(1, ctx.warmup // 2),
                         max(1, ctx.repeats // 2))
            if num_tree == 1:  # first in the loop: the decode step the trees are compared to
                decode_ms = ms
            rows.append(dict(attention=attn, T=num_tree, ms=ms, ratio_to_decode=ms / decode_ms))
    # A decode step reads every weight but the input embedding (one row of it).
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= model.get_input_embeddings().weight.numel() * model.get_input_embeddings().weight.element_size()
    result = {"rows": rows, "context": ctx.context, "weight_bytes": weight_bytes, "model": dict(ctx.bench_model)}
    if ctx.peak_bw:
        floor_ms = weight_bytes / ctx.peak_bw * 1e3
        result.update(weight_read_floor_ms=floor_ms, decode_floor_fraction=floor_ms / rows[0]["ms"])
    return result


# --- 5. end to end ----------------------------------------------------------------------
def _scheduler(decoder, batch: int, prompt_len: int, num_new: int):
    from specheads.serving.decode.scheduler import Scheduler

    return Scheduler(decoder, max_batch_size=batch, max_cache_len=prompt_len + num_new + decoder.max_tree_nodes + 1)


def _session_results(decoder, prompts, num_new: int, session=None) -> list:
    """Every prompt admitted at once to a Scheduler (`session`, else a new one) and decoded to
    the end; results in prompt order."""
    from specheads.serving.decode.scheduler import SequenceRequest

    session = session or _scheduler(decoder, len(prompts), len(prompts[0]), num_new)
    seq_ids = [session.add(SequenceRequest(prompt, num_new)) for prompt in prompts]
    results = {}
    while session.num_active:
        results.update({update.seq_id: update.result for update in session.step() if update.finished})
    return [results[seq_id] for seq_id in seq_ids]


def _rate_rows(ctx, target, decoders: dict, prompts, num_new: int, batch: int) -> list[dict]:
    """tokens/s of HF greedy and of each engine over `prompts` in groups of `batch` (batch 1:
    the engine's generate; more: a Scheduler; CUDA graphs: one Scheduler kept across groups, as
    a server keeps its engine, so the warm-up run captures), each after a warm-up run."""
    groups, rows = [prompts[i:i + batch] for i in range(0, len(prompts), batch)], []
    for name, make in {"hf-greedy": None, **decoders}.items():
        decoder = make() if make else None  # built in turn: a tree-attention engine switches the model's attention
        session = _scheduler(decoder, batch, len(prompts[0]), num_new) \
            if decoder is not None and decoder.cuda_graphs else None

        def run(group):
            if decoder is None:
                return hf_greedy(target.model, group, num_new)
            if session is not None:
                return _session_results(decoder, group, num_new, session)
            return [generate(decoder, p, num_new) for p in group] if batch == 1 else \
                _session_results(decoder, group, num_new)
        run(groups[0])  # warm-up: kernel compile, allocator
        outputs, seconds = [], 0.0
        for group in groups:
            out, took = wall_s(lambda: run(group), ctx.device)
            outputs, seconds = outputs + out, seconds + took
        tokens, rate = [getattr(out, "tokens", out) for out in outputs], len(prompts) * num_new / seconds
        if name == "hf-greedy":
            hf_tokens, hf_rate = tokens, rate
        rows.append(dict(batch=batch, method=name, tokens_per_s=rate, speedup=rate / hf_rate,
                         tau=1.0 if name == "hf-greedy" else merged_stats(outputs).tau,
                         identical_to_hf=sum(a == b for a, b in zip(tokens, hf_tokens)) / len(prompts)))
    return rows


def _end_to_end_rows(ctx, model_name: str, shape: dict) -> list[dict]:
    from specheads.serving.decode.config import SpeculativeDecoder
    from specheads.serving.decode.trees import DraftTree

    target = bench_target(ctx, shape)
    prompts = random_prompts(max(ctx.e2e_prompts, ctx.e2e_batch), ctx.e2e_prompt_len, target.vocab_size, seed=7)
    long = hf_greedy(target.model, prompts, ctx.e2e_new + NUM_HEADS + 2)
    oracle = OracleMedusa(target, [p + t for p, t in zip(prompts, long)], [len(p) for p in prompts])
    tree, medusa = DraftTree.from_paths(TREE_PATHS), random_medusa(target)
    graphs = graphs_mode(ctx.device)
    decoders = {"engine-plain": lambda: SpeculativeDecoder(target, fallback=None),
                "engine-plain+graphs": lambda: SpeculativeDecoder(target, fallback=None, cuda_graphs=graphs),
                "engine-medusa-random": lambda: SpeculativeDecoder(target, medusa, tree, fallback=None),
                "engine-medusa-oracle": lambda: SpeculativeDecoder(target, oracle, tree, fallback=None),
                # Last two: their engines switch the model's attention function (restored below).
                "engine-medusa-oracle+kernel": lambda: SpeculativeDecoder(target, oracle, tree, fallback=None,
                                                                          attn_impl="tree"),
                "engine-medusa-oracle+kernel+graphs": lambda: SpeculativeDecoder(
                    target, oracle, tree, fallback=None, attn_impl="tree", cuda_graphs=graphs)}
    try:
        rows = _rate_rows(ctx, target, decoders, prompts[:ctx.e2e_prompts], ctx.e2e_new, batch=1)
    finally:
        target.model.set_attn_implementation("sdpa")
    batched = {name: decoders[name] for name in ("engine-plain", "engine-plain+graphs", "engine-medusa-oracle",
                                                 "engine-medusa-oracle+kernel+graphs")}
    rows += _rate_rows(ctx, target, batched, prompts[:ctx.e2e_batch], ctx.e2e_new, batch=ctx.e2e_batch)
    return [dict(model=model_name, **row) for row in rows]


def section_end_to_end(ctx) -> dict:
    rows = []
    for model_name, shape in ctx.e2e_models.items():
        rows += _end_to_end_rows(ctx, model_name, shape)
        free_device_memory()  # one model at a time on the device
    return {"rows": rows, "prompt_len": ctx.e2e_prompt_len, "new_tokens": ctx.e2e_new,
            "note": "random bf16 targets of each shape, fallback off; 'oracle' heads know HF's greedy continuation "
                    "(tau's upper bound), 'random' heads are untrained (its lower bound)"}


# --- 6. CUDA graphs ---------------------------------------------------------------------
def _graph_row(ctx, target, cache, num_tree: int, attn: str) -> dict:
    """One forward of T tokens over a static-shape cache (`forward_call`), eager against its
    CUDA-graph replay."""
    call = forward_call(ctx, target, cache, num_tree, attn)
    row = dict(attention=attn, T=num_tree, eager_ms=time_ms(call, ctx.device, ctx.warmup, ctx.repeats))
    if ctx.device.type != "cuda":
        return dict(row, graph_error="CUDA graphs need a CUDA device")
    from specheads.serving.decode.graphs import capture

    try:
        graph, logits = capture(call, ctx.device)
        expected = call().float()
        row["graph_ms"] = time_ms(graph.replay, ctx.device, ctx.warmup, ctx.repeats)
        row.update(speedup=row["eager_ms"] / row["graph_ms"],
                   replay_rel_err=((logits.float() - expected).norm() / expected.norm()).item())
        del graph
    except Exception as exc:  # what stops a capture is this section's finding
        row["graph_error"] = f"{type(exc).__name__}: {exc}"
    return row


def section_graphs(ctx) -> dict:
    """Eager against CUDA-graph replay for one target forward (decode T=1 and verify trees)
    over a static-shape TreeStaticCache at a fixed context, per model shape: what a captured
    verify step would save in launch and Python time. The tree kernel is captured with its
    prefix length fixed (an engine would pass it as a device tensor)."""
    from specheads.serving.kernels.tree_attention import use_tree_attention

    rows = []
    for model_name, shape, context in ctx.graph_cases:
        target, cache = prefilled(ctx, shape, context, static_shape=True)
        for attn in ("sdpa", "tree"):
            if attn == "tree":
                use_tree_attention(target.model)
            for num_tree in (1, *ctx.verify_trees):
                rows.append(dict(model=model_name, context=context, **_graph_row(ctx, target, cache, num_tree, attn)))
        del target, cache
        free_device_memory()
    return {"rows": rows, "note": "one forward of the random bf16 target, static-shape cache; eager includes the "
                                  "Python and launch time that a graph replay removes"}
