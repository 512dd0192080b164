"""What the GPU suite's sections build and time (bench/gpu/suite.py; the sections in engine.py,
kernels.py, steps.py and trained.py): random targets and peaked ones whose greedy tokens bf16
cannot flip, prompts, HF greedy references, stub heads (random EAGLE-3, oracle Medusa: the suite
needs no checkpoint), a prefilled cache and a verify forward built as the engine's CUDA graphs
build it, and a forward's timing. Imports torch, transformers and the serving modules that pull
no deepspeed, fastapi, uvicorn, pydantic, wandb, datasets or gguf.

Shape legend: B batch, T tree tokens, S prefix keys, V vocab, H hidden size.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
from dataclasses import dataclass

import torch
from torch import nn

from specheads.bench.support import random_tree_mask, time_ms

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


def random_eagle3(target):
    """A random EAGLE-3 head of the target's size, on its device and in its dtype (its drafting
    costs what a trained one's does; it rarely guesses right)."""
    from specheads.heads.eagle3 import Eagle3Head

    text = target.text_config
    with built_on(target.device, target.dtype):
        head = Eagle3Head(target.hidden_size, target.vocab_size, target.vocab_size, text.num_attention_heads,
                          text.num_key_value_heads, text.intermediate_size, num_taps=3)
    return head.eval().requires_grad_(False)
