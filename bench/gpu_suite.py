"""The GPU suite: what this project measures and checks on a GPU, in one run of < 10 min.

Six sections, each a function returning its own figures (one that raises records its
error; the others still run; the two kernel sections are in bench/gpu_kernels.py):
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
import contextlib
import copy
import functools
import gc
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from torch import nn

from specheads.heads import atomic
from specheads.serving.decode.generate import generate
from specheads.bench.gpu_kernels import random_tree_mask, section_kernel_speed, section_parity, time_ms, wall_s

PEAK_HBM = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))  # bytes/s
# The Medusa tree of tests/serving/decode/test_decode_lossless.py: ranks 0 and 1, depth 4.
TREE_PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0], [0, 0, 1, 0]]
NUM_HEADS = 4
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


def merged_stats(results):
    from specheads.serving.decode.stats import DecodeStats

    return functools.reduce(DecodeStats.merge, (result.stats for result in results), DecodeStats())


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
    for param in model.parameters():
        if param.dim() == 2 and init_std is not None:
            nn.init.normal_(param, 0.0, init_std)
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
    for param in eagle.parameters():
        if param.dim() == 2:
            nn.init.normal_(param, 0.0, 0.3)
    graphs = "capture" if target.device.type == "cuda" else "eager"  # eager: the same static forward, uncaptured
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
def _forward_ms(ctx, target, cache, num_tree: int, attn: str) -> float:
    """One target forward of T tokens over the committed cache; its T entries stay pending,
    so the next forward overwrites them (as a rejected tree's are)."""
    from specheads.serving.kernels.tree_attention import pack_tree_mask

    prefix_len = cache.get_seq_length()
    tree_mask = random_tree_mask(num_tree, torch.Generator().manual_seed(num_tree)).to(ctx.device)
    position_ids = (prefix_len + tree_mask.sum(dim=1) - 1)[None]  # [1, T] prefix + depth
    tokens = torch.randint(3, target.vocab_size, (1, num_tree), device=ctx.device)
    kwargs = {}
    if num_tree > 1:
        kwargs = dict(tree_mask=pack_tree_mask(tree_mask), prefix_len=prefix_len) if attn == "tree" \
            else dict(attention_mask=cache.attention_mask(tree_mask))
    call = lambda: target(tokens, [], position_ids=position_ids, past_key_values=cache, use_cache=True, **kwargs)
    return time_ms(call, ctx.device, max(1, ctx.warmup // 2), max(1, ctx.repeats // 2))


def section_verify_vs_decode(ctx) -> dict:
    from specheads.serving.decode.cache import TreeStaticCache
    from specheads.serving.kernels.tree_attention import use_tree_attention

    target = bench_target(ctx)
    model = target.model
    cache = TreeStaticCache(model.config, max_cache_len=ctx.context + max(ctx.verify_trees) + 1)
    prompt = torch.randint(3, target.vocab_size, (1, ctx.context), device=ctx.device)
    target(prompt, [], past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.commit()
    rows = []
    for attn in ("sdpa", "tree"):  # the model is this section's own: no need to switch it back
        if attn == "tree":
            use_tree_attention(model)
        for num_tree in (1, *ctx.verify_trees):
            ms = _forward_ms(ctx, target, cache, num_tree, attn)
            decode_ms = ms if num_tree == 1 else decode_ms
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
    graphs = "capture" if ctx.device.type == "cuda" else "eager"
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
        gc.collect()  # one model at a time on the device
        torch.cuda.empty_cache()
    return {"rows": rows, "prompt_len": ctx.e2e_prompt_len, "new_tokens": ctx.e2e_new,
            "note": "random bf16 targets of each shape, fallback off; 'oracle' heads know HF's greedy continuation "
                    "(tau's upper bound), 'random' heads are untrained (its lower bound)"}


# --- 6. CUDA graphs ---------------------------------------------------------------------
def _graph_row(ctx, target, cache, num_tree: int, attn: str) -> dict:
    """One forward of T tokens over a static-shape cache, eager against its CUDA-graph replay.
    Every input is a device tensor made once, as a captured engine step's would be."""
    from specheads.serving.kernels.tree_attention import pack_tree_mask

    prefix_len = cache.get_seq_length()
    tree_mask = random_tree_mask(num_tree, torch.Generator().manual_seed(num_tree)).to(ctx.device)
    position_ids = cache.position_ids(tree_mask.sum(dim=1) - 1)  # [1, T] committed length + depth
    tokens = torch.randint(3, target.vocab_size, (1, num_tree), device=ctx.device)
    kwargs = dict(tree_mask=pack_tree_mask(tree_mask), prefix_len=prefix_len) if attn == "tree" \
        else dict(attention_mask=cache.attention_mask(tree_mask))
    call = lambda: target(tokens, [], position_ids=position_ids, past_key_values=cache, use_cache=True,
                          **kwargs).logits
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
    from specheads.serving.decode.cache import TreeStaticCache
    from specheads.serving.kernels.tree_attention import use_tree_attention

    rows = []
    for model_name, shape, context in ctx.graph_cases:
        target = bench_target(ctx, shape)
        cache = TreeStaticCache(target.model.config, max_cache_len=context + max(ctx.verify_trees) + 1,
                                static_shape=True)
        prompt = torch.randint(3, target.vocab_size, (1, context), device=ctx.device)
        target(prompt, [], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.commit()
        for attn in ("sdpa", "tree"):
            if attn == "tree":
                use_tree_attention(target.model)
            for num_tree in (1, *ctx.verify_trees):
                rows.append(dict(model=model_name, context=context, **_graph_row(ctx, target, cache, num_tree, attn)))
        del target, cache
        gc.collect()
        torch.cuda.empty_cache()
    return {"rows": rows, "note": "one forward of the random bf16 target, static-shape cache; eager includes the "
                                  "Python and launch time that a graph replay removes"}


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
    gc.collect()  # the 8B model of one section is gone before the next builds its own
    torch.cuda.empty_cache()  # a no-op without CUDA
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
