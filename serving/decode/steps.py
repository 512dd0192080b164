"""The steps of tree speculative decoding, each written once and batched (a single request is
a batch of one): prefill, the warm decode step (`DeviceStep`) and the output rule (emit).
The engine (serving/decode/engine.py) runs them around its sequences.

    prefill -> repeat: draft -> verify -> accept -> commit   (then the host records)

`DeviceStep.run` is one warm step for the engine's active rows, written once for every
drafter and batch: tensor operations on the target's device over per-row state that lives
there (the cache and its lengths, each row's root and sampling settings, the drafters'
state: every tensor has one row per engine row and moves with the cache's rows). Nothing in
it reads the device or builds a tensor from host data, so it can be compiled whole
(`compile_step`). Its one transfer back is `read`: the accepted tokens, copied into pinned
memory without blocking on a GPU, then waited for (the step's one sync; the host needs them
before it can choose the next step, so it reads them at the end of each step, not one step
later). What the host decides before a step (`plan`: which drafters draft, which rule each
row samples with) arrives as a `Variant` (host values: one compiled graph per variant), as the
uniforms drawn from the rows' generators on the device, and, with a reply store, as its
chains: the one upload, searched on the host (serving/decode/store.py).

- draft: every drafter that drafts this step proposes a tree for every row (serving/decode/
  draft_batch.py `Drafter`): the heads' tree, or the root alone, with each chain merged into
  it (`DraftBatch.join`: a prefix the chain shares with the tree is one path, the rest hangs
  below it); rows that do not draft keep their root alone (their other nodes are invalid). The
  read counts, per chain a row verified, the accepted nodes on it (`chain_counts`).
- verify: ONE target forward over every row's tree, padded to the largest T; node i of row b
  sits at position S_b + depth(i) and attends to b's S_b committed keys plus its own
  ancestors (a 4-D bool mask [n, 1, T, K], or the tree-attention kernel with per-row prefix
  lengths and packed masks). Its logits are the target's prediction for the token after each
  node.
- accept (serving/decode/accept.py): greedy, the deepest node whose every ancestor's token is
  the target's argmax at its parent, then the target's argmax there (the bonus token, the
  next root); sampled, tree rejection sampling, which keeps the target's distribution.
- commit: every drafter observes what was accepted (its state for the next step), each row's
  root becomes its final token, and the cache keeps each row's accepted nodes' entries (root
  first) and advances the lengths (`TreeStaticCache.commit_accepted`). Before that, the step
  writes only what the next step overwrites (pending KV entries, head-cache slots past the
  committed positions), so a step that fails in a row's draft, verify or accept leaves the
  rows as they were (the engine then steps them one by one). The drafters' observes only shape
  later drafts; the commit, last, is what advances a sequence.

Lossless: every emitted token is the target's argmax given exactly the tokens before it, so
greedy output equals the target's own greedy decoding (up to fp ties between batch shapes).

Shape legend: P prompt tokens, S committed positions, n rows, B engine rows, T tree nodes,
V vocab, nH drafter tap width, W accepted path width (the tree's depth + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.accept import HostAccepted, RowRules, accept, draw_uniforms
from specheads.serving.decode.cache import TreeStaticCache
from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.graphs import bucket, declared_sync
from specheads.serving.decode.logprobs import step_logprob_rows
from specheads.serving.decode.sampling import RowSampling, SamplingParams, target_probs


@dataclass
class Prefilled:
    """What a prefill gives a sequence's row."""

    prompt_P: torch.Tensor  # [P] long, the row's context: the whole prompt
    start: int  # the first position the prefill ran (the positions before it were kept)
    root: torch.Tensor  # [1] long, the next token (the target's argmax, or a sample), not in the cache yet
    taps: torch.Tensor  # [P - start, nH] the drafter's taps at the positions run
    # [L, V] the last position's logits (L = 1), or every position run (all_logits); they score the
    # first token and the prompt (serving/decode/logprobs.py)
    logits: torch.Tensor


@torch.inference_mode()
def prefill(target: TargetAdapter, input_ids_1P: torch.Tensor, tap_layers: list[int], cache: TreeStaticCache,
            sampling: SamplingParams | None = None, generator: torch.Generator | None = None,
            all_logits: bool = False, start: int = 0) -> Prefilled:
    """Run the prompt's positions from `start` on into the cache's active row, after the
    `start` positions that row already holds -> its root (the target's argmax, or a sample
    under `sampling`) and the taps of the positions run. The cache must hold the prompt plus
    every later step (the engine sizes it). all_logits: keep every position's logits, not the
    last one alone (prompt logprobs)."""
    out = target(input_ids_1P[:, start:], tap_layers, past_key_values=cache, use_cache=True,
                 logits_to_keep=0 if all_logits else 1)  # 0: every position
    cache.commit()
    logits_1V = out.logits[:, -1]
    if sampling is None or sampling.is_greedy:
        root = greedy_tokens(logits_1V)  # [1]
    else:
        root = torch.multinomial(target_probs(logits_1V, sampling), 1, generator=generator)[0]
    return Prefilled(prompt_P=input_ids_1P[0], start=start, root=root, taps=torch.cat(out.taps, dim=-1)[0],
                     logits=out.logits[0])


@torch.inference_mode()
def prefill_many(target: TargetAdapter, prompts_1P: list[torch.Tensor], tap_layers: list[int], cache: TreeStaticCache,
                 samplings: list[SamplingParams | None], generators: list[torch.Generator | None]) -> list[Prefilled]:
    """Several prompts ([1, P_i] on the target's device) in ONE forward, one into each of the
    cache's active rows, which must be empty -> each prompt's prefill, as `prefill` gives it
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
    prefills = []
    for row, (prompt, length, sampling, generator) in enumerate(zip(prompts_1P, lengths, samplings, generators)):
        root = roots[row:row + 1]
        if sampling is not None and not sampling.is_greedy:
            root = torch.multinomial(target_probs(logits_nV[row:row + 1], sampling), 1, generator=generator)[0]
        prefills.append(Prefilled(prompt_P=prompt[0], start=0, root=root, taps=hidden_nPH[row, longest - length:],
                                  logits=logits_nV[row:row + 1]))
    return prefills


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The target's argmax over the vocab (last dim), as transformers' greedy search takes it:
    on fp32 logits (the cast from bf16 is exact; a bf16 argmax on a CPU is ~10x slower), the
    first index on ties."""
    return logits.float().argmax(dim=-1)


def verify(decoder, cache: TreeStaticCache, drafts: DraftBatch, num_nodes: int, graphs=None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """ONE target forward over the cache's active rows, one draft row each, padded to
    num_nodes -> (logits [n, T, V], taps [n, T, nH]). decoder: its target, tap_layers and
    attention choice. graphs: a serving/decode/graphs.py `VerifyGraphs` that runs the forward
    (static shapes, CUDA graphs)."""
    if num_nodes != drafts.tokens.shape[1]:
        drafts = drafts.padded(num_nodes)
    tokens_nT, offsets_nT, tree_masks = drafts.tokens, drafts.depths, drafts.tree_mask
    if graphs is not None:
        return graphs.forward(tokens_nT, offsets_nT, tree_masks)
    attention_kwargs, mask = {}, None
    if decoder.attn_impl == "tree" and num_nodes > 1:
        from specheads.serving.kernels.tree_attention import pack_tree_mask

        attention_kwargs = {"tree_mask": pack_tree_mask(tree_masks), "prefix_len": cache.lengths.active_device}
        if cache.static_shape:  # a bound on the lengths: no read of them
            attention_kwargs["max_prefix_len"] = cache.max_cache_len - num_nodes
        else:
            attention_kwargs["max_prefix_len"] = max(cache.lengths.active)
        if decoder.tree_attention_impl is not None:
            attention_kwargs["tree_attention_impl"] = decoder.tree_attention_impl
    elif not drafts.is_chain:
        mask = cache.attention_mask(tree_masks)
    # else one chain (a plain step, a chain tree): the model's own causal mask is its tree mask
    # (padding after it is never read), and it runs the attention of the target's own decoding.
    out = decoder.target(tokens_nT, decoder.tap_layers, attention_mask=mask,
                         position_ids=cache.position_ids(offsets_nT), past_key_values=cache, use_cache=True,
                         **attention_kwargs)
    return out.logits, torch.cat(out.taps, dim=-1)


def chain_counts(drafts: DraftBatch, path_nW: torch.Tensor, count_n: torch.Tensor) -> torch.Tensor:
    """[n, K] long, per joined chain (drafts.on_chains): the accepted path's nodes on it (its
    accepted tokens, those it shares with the heads' tree or an earlier chain included), or -1
    where the row did not verify it (no node of it is valid in the row)."""
    on_nKT = drafts.on_chains
    present_nK = (on_nKT & drafts.valid[:, None, :]).any(-1)
    taken_nW = torch.arange(path_nW.shape[1], device=path_nW.device) < count_n[:, None]  # past the count: padding
    on_path_nKW = on_nKT.gather(2, path_nW[:, None, :].expand(-1, on_nKT.shape[1], -1)) & taken_nW[:, None, :]
    return torch.where(present_nK, on_path_nKW.sum(-1), -1)


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


@dataclass(frozen=True)
class Variant:
    """What the host decided before a warm step (DeviceStep.plan): fixed for the step, and one
    compiled graph each."""

    heads: bool  # the heads draft (some drafting row has no chain that goes alone)
    chains: tuple[int, ...]  # the chain drafters (indices into DeviceStep.chains) that draft
    chain_tokens: tuple[int, ...]  # the nodes each of them gets: its longest chain this step where known
    some_plain: bool  # some row does not draft this step (its draft nodes are left out)
    num_nodes: int  # the verify's tree size (padded to a CUDA-graph bucket)
    key_bound: int  # keys an attention over a row's cache may need (max_cache_len with static shapes)
    rejection: bool = False  # some row samples losslessly
    typical: bool = False  # some row uses typical acceptance
    max_top_k: int = 0
    top_p: bool = False
    num_top_logprobs: int | None = None  # some row asks for logprobs: this many top tokens


class DeviceStep:
    """One engine's warm decode step and the per-row state it runs over (module doc).

    decoder: a serving/decode/config.py SpeculativeDecoder (its target, heads drafter and
    chain drafters, each attached to this engine's cache: `heads`, `chains`). cache: the engine's TreeStaticCache; max_cache_len
    its length. graphs: the engine's serving/decode/graphs.py VerifyGraphs, or None. With
    decoder.compile_step set, `run` is `torch.compile(fullgraph=True)` of the eager step with
    that backend (the cache must have static shapes)."""

    def __init__(self, decoder, cache: TreeStaticCache, max_cache_len: int, graphs=None):
        self.decoder, self.cache, self.graphs = decoder, cache, graphs
        rows, device = cache.capacity, decoder.target.device
        self.heads = None if decoder.drafter is None else decoder.drafter.attach(cache, max_cache_len)
        self.chains = [chain.attach(cache, max_cache_len) for chain in decoder.chain_sources]
        self.drafters = ([] if self.heads is None else [self.heads]) + self.chains
        self.roots_B = torch.zeros(rows, dtype=torch.long, device=device)  # each row's next token
        self.drafting_B = torch.zeros(rows, dtype=torch.bool, device=device)  # the row drafts
        self.temperature_B = torch.ones(rows, dtype=torch.float64, device=device)
        self.top_k_B = torch.zeros(rows, dtype=torch.long, device=device)
        self.top_p_B = torch.ones(rows, dtype=torch.float64, device=device)
        self.rejection_B = torch.zeros(rows, dtype=torch.bool, device=device)
        self.typical_B = torch.zeros(rows, dtype=torch.bool, device=device)
        for state in (self.roots_B, self.drafting_B, self.temperature_B, self.top_k_B, self.top_p_B,
                      self.rejection_B, self.typical_B):
            cache.follow(state, 0)
        self.run = self.step
        if decoder.compile_step is not None:
            if not cache.static_shape:
                raise ValueError("compile_step needs the cache's static shapes (cuda_graphs='eager' or 'capture')")
            self.run = torch.compile(self.step, fullgraph=True, backend=decoder.compile_step)

    def start(self, row: int, seq, prefilled: Prefilled) -> tuple[int, dict[str, list[int]]]:
        """A sequence took row `row`: its root, sampling settings and drafters' state -> (its
        first token, the drafters' first notes), read in one copy."""
        self.roots_B[row:row + 1] = prefilled.root
        seq.drafting_on_device = seq.window.speculating
        sampling = seq.sampling
        for state, value in ((self.drafting_B, seq.drafting_on_device),
                             (self.temperature_B, 1.0 if sampling is None else sampling.temperature),
                             (self.top_k_B, 0 if sampling is None else sampling.top_k),
                             (self.top_p_B, 1.0 if sampling is None else sampling.top_p),
                             (self.rejection_B, sampling is not None and seq.acceptance == "rejection"),
                             (self.typical_B, sampling is not None and seq.acceptance == "typical")):
            state[row].fill_(value)  # a scalar argument: nothing is copied from host memory
        notes = [(drafter.name, drafter.start(row, prefilled)) for drafter in self.drafters]
        notes = [(name, note) for name, note in notes if note is not None]
        values = torch.cat([prefilled.root] + [note for _, note in notes]).tolist()
        at, kept = 1, {}
        for name, note in notes:
            kept[name] = values[at:at + int(note.shape[0])]
            at += int(note.shape[0])
        return values[0], kept

    def finish(self, seq) -> None:
        """seq ended well this step: every drafter may learn from it (draft_batch.py `Drafter.finish`)."""
        for drafter in self.drafters:
            drafter.finish(seq)

    def plan(self, seqs: list, drafting: list[bool]) -> tuple[Variant, torch.Tensor | None]:
        """The host's part before a step over the active rows (seqs, in row order; drafting:
        which of them draft) -> (the step's Variant, its uniforms). The chain drafters prepare
        (the store sends its chains: the step's one upload); a row whose drafting changed has
        its flag set on the device (a fill with a scalar argument, no copy from host memory)."""
        start = self.cache.lengths.start
        for row, (seq, draws) in enumerate(zip(seqs, drafting), start=start):
            if seq.drafting_on_device != draws:  # a fallback decision changed
                self.drafting_B[row].fill_(draws)
                seq.drafting_on_device = draws
        codes, covered = [], [False] * len(seqs)
        for chain in self.chains:  # in order; with one_chain_per_row a row's first proposal is its only one
            codes.append(chain.prepare(seqs, [draws and not done for draws, done in zip(drafting, covered)]
                                       if self.decoder.one_chain_per_row else drafting))
            covered = [done or code > 0 for done, code in zip(covered, codes[-1])]
        alone = [any(code[i] == 2 for code in codes) for i in range(len(seqs))]
        heads = self.heads is not None and any(draws and not goes for draws, goes in zip(drafting, alone))
        chains = tuple(i for i, code in enumerate(codes) if any(code))
        # a chain gets as many nodes as its longest proposal (on a CPU every verified node costs, padding
        # too); with CUDA graphs or a compiled step, its full length (fewer shapes to record)
        fixed = self.graphs is not None or self.decoder.compile_step is not None
        chain_tokens = tuple(self.chains[i].num_tokens if fixed else self.chains[i].step_tokens for i in chains)
        num_nodes = (self.heads.num_nodes if heads else 1) + sum(chain_tokens)
        if self.graphs is not None:  # a few tree sizes, so a few graphs
            num_nodes = bucket(num_nodes, self.decoder.max_tree_nodes)
        cache = self.cache
        key_bound = cache.max_cache_len if cache.static_shape \
            else max(cache.lengths.host[start:start + len(seqs)]) + num_nodes
        sampled = [seq.sampling is not None for seq in seqs]
        asks = [seq.num_top_logprobs for seq in seqs if seq.logprobs is not None]
        variant = Variant(heads=heads, chains=chains, chain_tokens=chain_tokens,
                          some_plain=not all(drafting) and num_nodes > 1,
                          num_nodes=num_nodes, key_bound=key_bound,
                          rejection=any(s and seq.acceptance == "rejection" for s, seq in zip(sampled, seqs)),
                          typical=any(s and seq.acceptance == "typical" for s, seq in zip(sampled, seqs)),
                          max_top_k=max((seq.sampling.top_k for seq in seqs if seq.sampling is not None), default=0),
                          top_p=any(seq.sampling.top_p < 1 for seq in seqs if seq.sampling is not None),
                          num_top_logprobs=max(asks) if asks else None)
        uniforms = None
        if any(sampled):
            uniforms = draw_uniforms([seq.generator for seq in seqs], sampled, self.decoder.uniform_shape,
                                     self.roots_B.device)
        return variant, uniforms

    def step(self, variant: Variant, uniforms_nU: torch.Tensor | None) -> torch.Tensor:
        """One warm step of the active rows (module doc) -> what `read` brings back [n, X]."""
        cache, decoder = self.cache, self.decoder
        rows = slice(cache.lengths.start, cache.lengths.stop)
        lens_n, roots_n = cache.lengths.device_lens[rows], self.roots_B[rows]
        key_bound = variant.key_bound
        base = self.heads.draft(rows, roots_n, lens_n, key_bound) if variant.heads else DraftBatch.roots(roots_n)
        chains = [self.chains[i].draft(rows, roots_n, lens_n, key_bound, size)
                  for i, size in zip(variant.chains, variant.chain_tokens)]
        drafts = base.join(chains) if chains else base
        if variant.some_plain:  # those rows keep their root alone
            nodes_T = torch.arange(drafts.tokens.shape[1], device=roots_n.device)
            drafts.valid = drafts.valid & ((nodes_T == 0) | self.drafting_B[rows, None])
        graphs = None if torch.compiler.is_compiling() else self.graphs
        logits_nTV, taps_nTX = verify(decoder, cache, drafts, variant.num_nodes, graphs)
        rules = None
        if variant.rejection or variant.typical:
            sampling = RowSampling(self.temperature_B[rows], self.top_k_B[rows], self.top_p_B[rows],
                                   variant.max_top_k, variant.top_p)
            rules = RowRules(sampling, self.rejection_B[rows], self.typical_B[rows], variant.rejection,
                             variant.typical)
        accepted = accept(drafts, logits_nTV, greedy_tokens(logits_nTV), rules, uniforms_nU, decoder.uniform_shape)
        path_nW, count_n, emitted_nW = accepted.path, accepted.num_nodes, accepted.emitted
        notes = [drafter.observe(rows, taps_nTX, path_nW, count_n, emitted_nW, lens_n, key_bound)
                 for drafter in self.drafters]
        self.roots_B[rows] = emitted_nW.gather(1, (count_n - 1)[:, None])[:, 0]
        cache.commit_accepted(path_nW, count_n)
        packed = torch.cat([count_n[:, None], accepted.depth[:, None], accepted.bad.long()[:, None], path_nW,
                            emitted_nW] + ([chain_counts(drafts, path_nW, count_n)] if chains else [])
                           + [note for note in notes if note is not None], 1)
        if variant.num_top_logprobs is None:
            return packed
        # float64 holds the ints exactly (token ids and node indices are far below 2**53)
        return torch.cat([packed.double(), step_logprob_rows(logits_nTV, path_nW, emitted_nW,
                                                             variant.num_top_logprobs)], 1)

    def read(self, packed_nX: torch.Tensor, variant: Variant) -> list[HostAccepted]:
        """The step's one read: `step`'s result to the host (into pinned memory without
        blocking, then waited for, where the device is a GPU) -> each row's HostAccepted."""
        if packed_nX.device.type == "cuda":
            host = torch.empty(packed_nX.shape, dtype=packed_nX.dtype, pin_memory=True)
            host.copy_(packed_nX, non_blocking=True)
            with declared_sync():
                torch.cuda.current_stream(packed_nX.device).synchronize()
            packed_nX = host
        depths = [self.heads.max_depth if variant.heads else 0] + list(variant.chain_tokens)
        width, names = max(depths) + 1, [self.chains[i].name for i in variant.chains]
        noted = [(drafter.name, drafter.num_notes) for drafter in self.drafters if drafter.num_notes]
        out = []
        for row in packed_nX.tolist():
            count, at = int(row[0]), 3 + 2 * width + len(names)
            path = [int(value) for value in row[3:3 + count]]
            chains = {name: int(accepted) for name, accepted in zip(names, row[3 + 2 * width:at]) if accepted >= 0}
            notes = {}
            for name, size in noted:
                notes[name] = [int(value) for value in row[at:at + size]]
                at += size
            out.append(HostAccepted(path=path, emitted=[int(v) for v in row[3 + width:3 + width + count]],
                                    depth=int(row[1]), bad=bool(row[2]), chains=chains, notes=notes, width=width,
                                    logprobs=None if variant.num_top_logprobs is None else row[at:]))
        return out
