"""The steps of tree speculative decoding, each written once and batched (a single request is
a batch of one): prefill, verify and the output rule (emit); accept is
serving/decode/accept.py's. The engine (serving/decode/engine.py) runs them, commits, and
records.

    prefill -> repeat: draft -> verify -> accept -> commit

State between steps (`DecodeState`, one per sequence): the cache row holds the S committed
positions; `root` is the next token, already chosen by the target but not yet in the cache;
`hidden` holds the drafter's target taps (concatenated) at the A positions committed by the
last step (all P prompt positions after prefill), `next_tokens` the token after each of
them. Medusa reads the final (post-norm) hidden state at position S-1, the one that chose
`root`; EAGLE heads read every new row (their own KV cache in the engine's row covers the rest:
serving/decode/eagle.py `HeadKV`).

- draft (the drafters: serving/decode/medusa.py, eagle.py; lookup chains: lookup.py): one
  `DraftBatch` (serving/decode/draft_batch.py) for the batch, each row a tree of T nodes
  (node 0 = root), as device tensors.
- verify: ONE target forward over every sequence's tree, padded to the largest T; node i
  of sequence b sits at position S_b + depth(i) and attends to b's S_b committed keys plus
  its own ancestors (a 4-D bool mask [n, 1, T, max S + T], or the tree-attention kernel
  with per-sequence prefix lengths and packed masks). A padding node sees only itself and
  is never accepted. Its logits are the target's prediction for the token after node i.
- accept (serving/decode/accept.py): greedy, the deepest node whose every ancestor's token
  is the target's argmax at its parent, then the target's argmax there (the bonus token,
  the next root); sampled, tree rejection sampling, which keeps the target's distribution
  exactly. Tensor operations for the whole batch; their result is the step's one copy to
  the host.
- commit (the engine): the cache keeps each sequence's accepted nodes' KV entries (root
  first) in its row and drops the rest (`TreeStaticCache.commit`), and the sequence gets its
  next DecodeState.

Lossless: every emitted token is the target's argmax given exactly the tokens before it, so
greedy output equals the target's own greedy decoding (up to fp ties between batch shapes).

Shape legend: P prompt tokens, S committed positions, n sequences, T tree nodes (padded),
V vocab, nH drafter tap width, A accepted nodes (root included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.cache import TreeStaticCache
from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.sampling import SamplingParams, target_probs


@dataclass
class DecodeState:
    cache: TreeStaticCache  # holds the S committed positions (in this sequence's row)
    prefix_len: int  # S
    root: torch.Tensor  # [1] long, next token, not yet in the cache
    hidden: torch.Tensor  # [A, nH] drafter taps at positions S-A..S-1 (Medusa: nH = H, final hidden)
    next_tokens: torch.Tensor  # [A] long, the token after each of those positions (ends with root)
    # [L, V] the prefill's logits: its last row (L = 1), or every position it ran (all_logits);
    # they score the first token and the prompt (serving/decode/logprobs.py). None from the first step on.
    logits: torch.Tensor | None = None


@torch.inference_mode()
def prefill(target: TargetAdapter, input_ids_1P: torch.Tensor, tap_layers: list[int], cache: TreeStaticCache,
            sampling: SamplingParams | None = None, generator: torch.Generator | None = None,
            all_logits: bool = False) -> DecodeState:
    """Run the prompt into the cache's active row, after the positions that row already holds
    (none for a new sequence) -> the state with its root (the target's argmax, or a sample
    under `sampling`); `hidden` covers the positions run here. The cache must hold the
    prompt plus every later step (the engine sizes it). all_logits: keep every position's
    logits in `logits` (prompt logprobs), not the last one alone."""
    held = cache.get_seq_length()
    out = target(input_ids_1P, tap_layers, past_key_values=cache, use_cache=True,
                 logits_to_keep=0 if all_logits else 1)  # 0: every position
    cache.commit()
    logits_1V = out.logits[:, -1]
    if sampling is None or sampling.is_greedy:
        root = greedy_tokens(logits_1V)  # [1]
    else:
        root = torch.multinomial(target_probs(logits_1V, sampling), 1, generator=generator)[0]
    return DecodeState(cache=cache, prefix_len=held + int(input_ids_1P.shape[1]), root=root,
                       hidden=torch.cat(out.taps, dim=-1)[0], next_tokens=torch.cat([input_ids_1P[0, 1:], root]),
                       logits=out.logits[0])


@torch.inference_mode()
def prefill_many(target: TargetAdapter, prompts_1P: list[torch.Tensor], tap_layers: list[int], cache: TreeStaticCache,
                 samplings: list[SamplingParams | None], generators: list[torch.Generator | None]) -> list[DecodeState]:
    """Several prompts ([1, P_i] on the target's device) in ONE forward, one into each of the
    cache's active rows, which must be empty -> each prompt's state, as `prefill` gives it
    alone (up to fp ties between batch shapes). On a GPU a forward costs its launches more
    than its tokens, so one forward for a group of new sequences costs about what one
    sequence's does.

    The prompts are left-padded to the longest (P): a padding token sees only itself, and
    prompt token j sits at position j and sees prompt tokens 0..j (the verify step's tree
    mask and position offsets, for a chain). So every prompt's last token is the forward's
    last, and only that position's logits are made. The commit then moves each prompt's
    entries to the front of its row."""
    lengths = [int(prompt.shape[1]) for prompt in prompts_1P]
    num_rows, longest = len(lengths), max(lengths)
    device = target.device
    tokens_nP = torch.stack([torch.nn.functional.pad(prompt[0], (longest - length, 0))
                             for prompt, length in zip(prompts_1P, lengths)])
    offsets_nP = torch.zeros(num_rows, longest, dtype=torch.long)
    masks_nPP = torch.eye(longest, dtype=torch.bool).repeat(num_rows, 1, 1)
    causal = torch.ones(longest, longest, dtype=torch.bool).tril()
    for row, length in enumerate(lengths):
        pad = longest - length
        offsets_nP[row, pad:] = torch.arange(length)
        masks_nPP[row, pad:, pad:] = causal[:length, :length]
    offsets_nP = offsets_nP.to(device)
    out = target(tokens_nP, tap_layers, attention_mask=cache.attention_mask(masks_nPP.to(device)),
                 position_ids=cache.position_ids(offsets_nP), past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.commit([torch.arange(longest - length, longest) for length in lengths])
    logits_nV = out.logits[:, -1]
    roots = greedy_tokens(logits_nV)
    hidden_nPH = torch.cat(out.taps, dim=-1)
    states = []
    for row, (length, sampling, generator) in enumerate(zip(lengths, samplings, generators)):
        root = roots[row:row + 1]
        if sampling is not None and not sampling.is_greedy:
            root = torch.multinomial(target_probs(logits_nV[row:row + 1], sampling), 1, generator=generator)[0]
        pad = longest - length
        states.append(DecodeState(cache=cache, prefix_len=length, root=root, hidden=hidden_nPH[row, pad:],
                                  next_tokens=torch.cat([tokens_nP[row, pad + 1:], root]),
                                  logits=logits_nV[row:row + 1]))
    return states


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The target's argmax over the vocab (last dim), as transformers' greedy search takes it:
    on fp32 logits (the cast from bf16 is exact; a bf16 argmax on a CPU is ~10x slower), the
    first index on ties."""
    return logits.float().argmax(dim=-1)


@dataclass
class Verified:
    """One verify forward's result for the batch."""

    logits: torch.Tensor  # [n, T, V] the target's prediction for the token after each node
    taps: torch.Tensor  # [n, T, nH] the drafter's taps at each node
    target_tokens: torch.Tensor  # [n, T] long, greedy_tokens(logits)


def verify(decoder, cache: TreeStaticCache, drafts: DraftBatch, num_nodes: int | None = None,
           graphs=None) -> Verified:
    """ONE target forward over the cache's active rows, one draft row each (a single sequence
    is a batch of one), padded to num_nodes (default: the drafts' T). decoder: its target,
    tap_layers and attention choice. graphs: a serving/decode/graphs.py `VerifyGraphs` that
    runs the forward (static shapes, CUDA graphs)."""
    if num_nodes is not None and num_nodes != drafts.num_nodes:
        drafts = drafts.padded(num_nodes)
    tokens_nT, offsets_nT, tree_masks = drafts.tokens, drafts.depths, drafts.tree_mask
    if graphs is not None:
        logits, taps = graphs.forward(tokens_nT, offsets_nT, tree_masks)
    else:
        attention_kwargs, mask = {}, None
        if decoder.attn_impl == "tree" and drafts.num_nodes > 1:
            from specheads.serving.kernels.tree_attention import pack_tree_mask

            attention_kwargs = {"tree_mask": pack_tree_mask(tree_masks), "prefix_len": cache.seq_lens}
            if decoder.tree_attention_impl is not None:
                attention_kwargs["tree_attention_impl"] = decoder.tree_attention_impl
        elif not drafts.is_chain:
            mask = cache.attention_mask(tree_masks)
        # else one chain (a plain step, a chain tree): the model's own causal mask is its tree mask
        # (padding after it is never read), and it runs the attention of the target's own decoding.
        out = decoder.target(tokens_nT, decoder.tap_layers, attention_mask=mask,
                             position_ids=cache.position_ids(offsets_nT), past_key_values=cache, use_cache=True,
                             **attention_kwargs)
        logits, taps = out.logits, torch.cat(out.taps, dim=-1)
    return Verified(logits=logits, taps=taps, target_tokens=greedy_tokens(logits))


def emit(out_tokens: list[int], new_tokens: list[int], max_new_tokens: int, eos_ids: frozenset[int],
         stop_sequences: list[list[int]]) -> str | None:
    """Append new_tokens up to the first EOS, the end of a stop sequence, or max_new_tokens;
    -> "stop", "length", or None to go on."""
    for token in new_tokens:
        out_tokens.append(token)
        if token in eos_ids or any(out_tokens[-len(stop):] == stop for stop in stop_sequences):
            return "stop"
        if len(out_tokens) >= max_new_tokens:
            return "length"
    return None
