"""The batched decode loop: several sequences, one target forward per step.

Every sequence owns a row of one `TreeStaticCache` (serving/decode/cache.py); the active
sequences are rows [0, n), kept contiguous (a leaving sequence's row is refilled by moving
the last row into it). A sequence joins with its own prefill forward (its row alone,
`cache.set_rows(r, r + 1)`), which yields its first token; from the next step on it takes
part in the batched decode step:

    draft (per sequence) -> verify (ONE forward over [n, T]) -> accept (per sequence) -> commit

- draft: each sequence drafts its own tree: the decoder's static tree, a dynamic tree, or
  the root alone (speculation off, or fallen back). Medusa sequences are drafted in one
  batched head call; EAGLE heads keep one head cache per sequence (a step the head skips
  leaves its rows for the head's next run). With n-gram lookup (serving/decode/lookup.py) a
  sequence's chain from its own context is verified alone or as one more branch.
- verify: trees are padded to the largest T in the batch. A padding node sees only itself
  and is never accepted. Node i of sequence b sits at position S_b + depth(i) and attends
  to b's S_b committed keys plus its own ancestors (a [n, 1, T, max S + T] bool mask, or
  the tree-attention kernel with per-sequence prefix lengths and packed masks).
- accept/commit: per sequence, as in serving/decode/steps.py; the cache gathers every
  sequence's accepted path in its own row.

Each sequence's greedy output is the target's greedy output for it alone (the rows never
see each other: padding keys and other rows are masked), up to fp ties between batch
shapes.

Fallback to plain decoding when speculation does not pay: serving/decode/fallback.py (its module
doc); the engine asks its `BatchFallback` before each step and tells it after.

Faults (which errors are fatal: serving/decode/faults.py). An exception raised while stepping one
sequence (its prefill, its draft, its accept, its bookkeeping) ends that sequence alone:
finish_reason "error", `GenerationResult.error` names it, and it leaves the batch like a
finished one. The other rows go on; rows never see each other, so their output is what it
would have been without it. A batched call that fails (the Medusa heads' one draft call, the
verify forward) is run again row by row, which finds the faulty row and still advances the
others this step. A failed forward leaves the cache whole: its entries were only pending.
A verify forward that runs out of memory is retried once with the allocator's cache
emptied; out of memory again, or a lost device, raises (`EngineBroken` or the device's
error) and the caller must treat the engine as broken.

Shape legend: n active sequences, T tree nodes (padded), V vocab, nH drafter tap width,
A accepted nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specheads.serving.decode.steps import DecodeState, TreePlan, Verification, accept, emit, prefill
from specheads.serving.decode.fallback import BatchFallback
from specheads.serving.decode.faults import describe, is_fatal, retry_out_of_memory
from specheads.serving.decode.lookup import NgramIndex
from specheads.serving.decode.sampling import SamplingParams, accept_tree_sampling, make_generator, target_probs
from specheads.serving.decode.cache import TreeStaticCache
from specheads.serving.decode.stats import DecodeStats, GenerationResult


@dataclass
class SequenceRequest:
    input_ids: list[int] | torch.Tensor
    max_new_tokens: int
    eos_token_id: int | list[int] | None = None
    sampling: SamplingParams | None = None  # None or temperature 0: greedy
    stop_token_sequences: list[list[int]] | None = None  # the output ends right after the first one
    speculate: bool = True  # False: plain decoding for this sequence (the heads are not used)
    acceptance: str = "rejection"  # "typical": Medusa-2's lossy rule (sampling only), reported lossy


@dataclass
class _Sequence:
    seq_id: int
    prompt_1P: torch.Tensor
    max_new_tokens: int
    eos_ids: frozenset[int]
    stop_sequences: list[list[int]]
    sampling: SamplingParams | None
    greedy: bool
    acceptance: str
    speculating: bool  # drafts this step (False: speculation off, or fallen back)
    may_fall_back: bool
    generator: torch.Generator | None
    stats: DecodeStats
    state: DecodeState | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    joined: bool = False  # takes part in decode steps (set at the latest by the first step after add)
    spec_steps: int = 0  # in the current decision window
    spec_accepted: int = 0
    spec_seconds: float = 0.0  # wall time of the window's speculative steps
    plain_run: int = 0  # plain steps since the last fallback (retried after policy.retry_after)
    lookup: NgramIndex | None = None  # the context's n-gram index (speculating requests of a lookup decoder)
    error: Exception | None = None  # what ended this sequence alone (finish_reason "error")

    def close(self) -> GenerationResult:
        """Stop here: the result so far, finish_reason "stop" unless it had finished."""
        if self.finish_reason is None:
            self.finish_reason = "stop"
        return self.result()

    def result(self) -> GenerationResult:
        self.stats.num_new_tokens = len(self.tokens)
        return GenerationResult(tokens=self.tokens, finish_reason=self.finish_reason or "length",
                                stats=self.stats, lossless=self.stats.lossless,
                                error=None if self.error is None else describe(self.error))


@dataclass
class _Draft:
    tokens: torch.Tensor  # [T_b] long, node 0 = root
    plan: TreePlan
    tree: object  # DraftTree
    heads_drafted: bool = True  # False: a plain step, or a lookup chain alone
    lookup_start: int | None = None  # the first lookup chain node, when the tree has one


@dataclass
class _Outcome:
    """One sequence's verified step."""
    nodes: torch.Tensor  # [A] long, accepted node indices, root first
    root: torch.Tensor  # [1] long, the next step's root (the bonus or recovered token)
    emitted: list[int]  # A tokens: accepted draft tokens + root
    hidden: torch.Tensor  # [A, nH] drafter taps at the accepted nodes


def _as_prompt(input_ids, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty list of ints or a [1, P] tensor, got shape {tuple(ids.shape)}")
    return ids


class BatchEngine:
    """Up to max_batch_size sequences of at most max_cache_len positions (prompt + new
    tokens + one tree) each; see the module docstring."""

    def __init__(self, decoder, max_batch_size: int, max_cache_len: int):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.decoder = decoder
        self.target = decoder.target
        self.max_batch_size = max_batch_size
        self.max_cache_len = max_cache_len
        self.cache = TreeStaticCache(self.target.config, max_cache_len=max_cache_len, batch_size=max_batch_size)
        self.rows: list[_Sequence] = []  # row i holds rows[i]
        self._pad_cache: dict[int, torch.Tensor] = {}
        self.fallback = BatchFallback(decoder)
        self._root_only = torch.zeros(1, dtype=torch.long, device=self.target.device)  # accepted nodes of a plain step

    # --- admission -------------------------------------------------------------------------

    def check(self, request: SequenceRequest, seq_id: int = 0) -> _Sequence:
        """Validate a request (ValueError naming the problem) -> a sequence ready to prefill."""
        if isinstance(request.max_new_tokens, bool) or not isinstance(request.max_new_tokens, int) \
                or request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {request.max_new_tokens!r}")
        if request.acceptance not in ("rejection", "typical"):
            raise ValueError(f"acceptance must be 'rejection' (lossless) or 'typical' (lossy), "
                             f"got {request.acceptance!r}")
        greedy = request.sampling is None or request.sampling.is_greedy
        if request.acceptance == "typical" and greedy:
            raise ValueError("acceptance='typical' needs sampling (a temperature of at least 1e-5)")
        stop_sequences = [list(map(int, s)) for s in request.stop_token_sequences or []]
        if any(len(s) == 0 for s in stop_sequences):
            raise ValueError("stop_token_sequences must not contain an empty sequence")
        eos = request.eos_token_id
        eos_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
        prompt_1P = _as_prompt(request.input_ids, self.target.device)
        needed = int(prompt_1P.shape[1]) + request.max_new_tokens + self.decoder.max_tree_nodes
        if needed > self.max_cache_len:
            raise ValueError(f"prompt ({prompt_1P.shape[1]} tokens) + max_new_tokens ({request.max_new_tokens}) "
                             f"+ one tree ({self.decoder.max_tree_nodes}) = {needed} positions, more than this "
                             f"engine's max_cache_len {self.max_cache_len}")
        speculating = request.speculate and self.decoder.speculates
        policy = self.decoder.fallback
        seeded = not greedy and request.sampling.seed is not None
        return _Sequence(
            seq_id=seq_id, prompt_1P=prompt_1P, max_new_tokens=request.max_new_tokens, eos_ids=eos_ids,
            stop_sequences=stop_sequences, sampling=request.sampling, greedy=greedy,
            acceptance=request.acceptance, speculating=speculating,
            may_fall_back=speculating and policy is not None and not seeded,
            generator=None if greedy else make_generator(request.sampling, self.target.device),
            lookup=NgramIndex(self.decoder.lookup, prompt_1P[0].tolist())
            if speculating and self.decoder.lookup is not None else None,
            stats=DecodeStats(accepted_per_position=[0] * (self.decoder.max_depth if speculating else 0),
                              lossless=request.acceptance == "rejection"))

    def add(self, seq: _Sequence, join: bool = True) -> list[int]:
        """Prefill a checked sequence into the next free row; -> its first token.
        join=False: it sits out the next step (a scheduler reports its first token first).
        An error in the prefill leaves the batch as it was and is raised to the caller."""
        if len(self.rows) >= self.max_batch_size:
            raise RuntimeError(f"the batch is full ({self.max_batch_size} sequences)")
        row = len(self.rows)
        clock = self.decoder.step_costs.clock
        start = clock()
        self.cache.reset_row(row)
        self.cache.set_rows(row, row + 1)
        with torch.inference_mode():
            try:
                state = prefill(self.target, seq.prompt_1P, self.decoder.tap_layers, cache=self.cache)
                if not seq.greedy:
                    probs_1V = target_probs(state.root_logits, seq.sampling)
                    state.root = torch.multinomial(probs_1V, 1, generator=seq.generator)[0]
                    state.next_tokens[-1:] = state.root
            except BaseException:
                self.cache.reset_row(row)
                raise
            state.root_logits = None
        seq.state = state
        seq.joined = join
        self.rows.append(seq)
        seq.finish_reason = emit(seq.tokens, state.root.tolist(), seq.max_new_tokens, seq.eos_ids,
                                 seq.stop_sequences)
        seq.stats.prefill_s = clock() - start
        return list(seq.tokens)

    # --- leaving ---------------------------------------------------------------------------

    def remove(self, seq: _Sequence) -> None:
        """Drop a sequence; the last row moves into its row."""
        row = self.rows.index(seq)
        last = len(self.rows) - 1
        with torch.inference_mode():  # the buffers are inference tensors
            if row != last:
                self.cache.move_row(last, row)
                self.rows[row] = self.rows[last]
            self.rows.pop()
            self.cache.reset_row(last)

    # --- one decode step -------------------------------------------------------------------

    def step(self) -> dict[int, list[int]]:
        """One decode step over every joined, unfinished sequence -> {seq_id: new tokens}.
        Sequences added since the last step join (they already emitted their first token).
        A sequence that fails ends alone with finish_reason "error" (module doc, "Faults")."""
        self._joined_first()
        batch = [seq for seq in self.rows if seq.joined and seq.finish_reason is None]
        for seq in self.rows:
            seq.joined = True
        if not batch:
            return {}
        clock = self.decoder.step_costs.clock
        start = clock()
        plain = self.fallback.plain_step(batch)
        with torch.inference_mode():
            drafts = self._draft(batch, plain)
            outcomes = self._verify_accept_commit(batch, drafts, first_row=0)
            for seq, draft, outcome in zip(batch, drafts, outcomes):
                if outcome is not None:
                    self._guard(seq, self._advance, seq, draft, outcome)
        seconds = clock() - start
        done = [(seq, draft, outcome.emitted) for seq, draft, outcome in zip(batch, drafts, outcomes)
                if seq.error is None]
        if len(done) == len(batch):  # a step with a fault is no measure of the step cost
            self.fallback.record(len(batch), max(int(d.tokens.shape[0]) for d in drafts),
                                 [len(tokens) for _, draft, tokens in done if draft.plan.max_depth > 0], seconds)
        deltas = {seq.seq_id: self._guard(seq, self._emit, seq, draft, tokens, seconds) or []
                  for seq, draft, tokens in done}
        deltas.update({seq.seq_id: [] for seq in batch if seq.error is not None})
        self.fallback.end_step()
        for seq, _, _ in done:
            self._guard(seq, self.fallback.after_step, seq, len(batch))
        return deltas

    def _emit(self, seq: _Sequence, draft: _Draft, tokens: list[int], seconds: float) -> list[int]:
        """Count the step in seq's stats and append its tokens -> the tokens it emitted."""
        before = len(seq.tokens)
        self._count(seq, draft, tokens, seconds)
        seq.finish_reason = emit(seq.tokens, tokens, seq.max_new_tokens, seq.eos_ids, seq.stop_sequences)
        return seq.tokens[before:]

    def _advance(self, seq: _Sequence, draft: _Draft, outcome: _Outcome) -> None:
        """The sequence's decode state after its committed step."""
        nodes, hidden = outcome.nodes, outcome.hidden
        next_tokens = torch.cat([draft.tokens[nodes[1:]], outcome.root])
        if not draft.heads_drafted and self._keeps_head_rows(seq):
            # The EAGLE head did not run this step: its next run covers these rows too.
            hidden = torch.cat([seq.state.hidden, hidden])
            next_tokens = torch.cat([seq.state.next_tokens, next_tokens])
        if draft.lookup_start is not None:
            seq.stats.lookup_steps += 1
            seq.stats.lookup_accepted += int((nodes >= draft.lookup_start).sum())
        seq.state = DecodeState(cache=self.cache, prefix_len=seq.state.prefix_len + int(nodes.shape[0]),
                                root=outcome.root, hidden=hidden, next_tokens=next_tokens,
                                draft_cache=seq.state.draft_cache)

    # --- faults (module doc, "Faults") -----------------------------------------------------

    def _fail(self, seq: _Sequence, err: Exception) -> None:
        """End seq alone: it leaves the batch at the end of this step like a finished one."""
        seq.error = err
        seq.finish_reason = "error"

    def _guard(self, seq: _Sequence, call, *args):
        """call(*args), or None after ending seq alone when it raises a non-fatal error."""
        if seq.error is not None:
            return None
        try:
            return call(*args)
        except Exception as err:  # noqa: BLE001 - one sequence's fault ends that sequence (serving/decode/faults.py)
            if is_fatal(err):
                raise
            self._fail(seq, err)
            return None

    def _joined_first(self) -> None:
        """Reorder rows so that the sequences this step decodes (joined, unfinished) are rows
        [0, n): a removal can move a just-added sequence in front of them."""
        with torch.inference_mode():
            front = 0
            for index, seq in enumerate(self.rows):
                if seq.joined and seq.finish_reason is None:
                    if index != front:
                        self.cache.swap_rows(front, index)
                        self.rows[front], self.rows[index] = self.rows[index], self.rows[front]
                    front += 1

    def _keeps_head_rows(self, seq: _Sequence) -> bool:
        """Whether seq's committed rows must wait for its EAGLE head's next run (the head's
        own cache must cover every position), rather than be dropped."""
        drafter = self.decoder.drafter
        return drafter is not None and not self.decoder.is_medusa and (seq.speculating or seq.stats.fallback)

    def _draft(self, batch: list[_Sequence], plain: bool = False) -> list[_Draft]:
        """Every sequence's draft; a sequence whose drafting fails ends, with a plain draft as
        its placeholder in this step's verify."""
        decoder = self.decoder
        drafts: list[_Draft | None] = [None] * len(batch)
        chains: list[list[int]] = [[] for _ in batch]
        medusa = []
        for index, seq in enumerate(batch):
            planned = self._guard(seq, self._plan_draft, seq, plain)
            if planned is None:
                continue
            chains[index], drafts[index] = planned
            if drafts[index] is None:
                medusa.append(index)
        if medusa:
            self._draft_medusa([batch[i] for i in medusa], medusa, drafts)
        for index, (seq, chain) in enumerate(zip(batch, chains)):
            draft = drafts[index]
            if chain and draft is not None:
                drafted = self._guard(seq, decoder.with_lookup, draft.tokens, draft.tree, chain)
                if drafted is not None:
                    tokens, tree, plan = drafted
                    drafts[index] = _Draft(tokens, plan, tree, draft.heads_drafted, lookup_start=draft.tree.num_nodes)
        return [draft if draft is not None and seq.error is None else self._plain_draft(seq)
                for seq, draft in zip(batch, drafts)]

    def _plain_draft(self, seq: _Sequence) -> _Draft:
        return _Draft(seq.state.root, self.decoder.plain_plan, self.decoder.plain_tree, heads_drafted=False)

    def _plan_draft(self, seq: _Sequence, plain: bool) -> tuple[list[int], _Draft | None]:
        """-> (its n-gram lookup chain, its draft; None: drafted in the batched Medusa call)."""
        decoder = self.decoder
        if seq.stats.fallback and not seq.speculating and seq.plain_run >= decoder.fallback.retry_after:
            seq.speculating = True  # try speculating again: the text may have become predictable
        skip_heads = not seq.speculating or (plain and seq.may_fall_back)
        chain: list[int] = []
        if not skip_heads and seq.lookup is not None:
            seq.lookup.extend(seq.tokens[len(seq.lookup.tokens) - int(seq.prompt_1P.shape[1]):])
            chain, matched = seq.lookup.propose()
            alone_at = decoder.lookup.alone_at_ngram
            skip_heads = alone_at is not None and matched >= alone_at  # the chain alone
        if skip_heads or decoder.drafter is None:
            return chain, self._plain_draft(seq)
        if decoder.is_medusa:
            return chain, None
        tokens, tree, plan = decoder.draft_one(seq.state)
        return chain, _Draft(tokens, plan, tree)

    def _draft_medusa(self, seqs: list[_Sequence], indices: list[int], drafts: list) -> None:
        """One Medusa head call for seqs (at batch positions indices); on an error, one call per
        sequence, which finds the faulty one."""
        def call(group):
            hidden_BH = torch.stack([seq.state.hidden[-1] for seq in group])
            roots_B = torch.cat([seq.state.root for seq in group])
            return [_Draft(tokens, plan, tree) for tokens, tree, plan in self.decoder.draft_medusa(hidden_BH, roots_B)]

        try:
            results = call(seqs)
        except Exception as err:  # noqa: BLE001 - isolated below, row by row
            if is_fatal(err):
                raise
            results = [self._guard(seq, lambda one=seq: call([one])[0]) for seq in seqs]
        for index, draft in zip(indices, results):
            drafts[index] = draft

    def _pad_mask(self, num_nodes: int) -> torch.Tensor:
        """[T, T] bool: padding nodes see only themselves."""
        if num_nodes not in self._pad_cache:
            self._pad_cache[num_nodes] = torch.eye(num_nodes, dtype=torch.bool, device=self.target.device)
        return self._pad_cache[num_nodes]

    def _verify(self, batch: list[_Sequence], drafts: list[_Draft]) -> tuple[torch.Tensor, torch.Tensor]:
        decoder = self.decoder
        plan0 = drafts[0].plan
        attention_kwargs, mask = {}, None
        if len(batch) == 1:
            # One sequence: its own tree, no padding (the single-request fast path).
            tokens_nT = drafts[0].tokens[None]
            positions = (plan0.position_offsets + batch[0].state.prefix_len)[None]
            if decoder.attn_impl == "tree" and plan0.num_nodes > 1:
                attention_kwargs = decoder.tree_kwargs(plan0.packed(), batch[0].state.prefix_len)
            elif not plan0.is_chain:
                mask = self.cache.attention_mask(plan0.tree_mask)
        else:
            num_nodes = max(d.plan.num_nodes for d in drafts)
            pad = self._pad_mask(num_nodes)
            tokens_nT = torch.zeros(len(batch), num_nodes, dtype=torch.long, device=self.target.device)
            offsets_nT = torch.zeros(len(batch), num_nodes, dtype=torch.long, device=self.target.device)
            masks_nTT = pad.expand(len(batch), num_nodes, num_nodes).clone()
            for index, draft in enumerate(drafts):
                size = draft.plan.num_nodes
                tokens_nT[index, :size] = draft.tokens
                offsets_nT[index, :size] = draft.plan.position_offsets
                masks_nTT[index, :size, :size] = draft.plan.tree_mask
            positions = self.cache.position_ids(offsets_nT)
            if decoder.attn_impl == "tree" and num_nodes > 1:
                from specheads.serving.kernels.tree_attention import pack_tree_mask

                attention_kwargs = decoder.tree_kwargs(pack_tree_mask(masks_nTT), self.cache.seq_lens)
            else:
                mask = self.cache.attention_mask(masks_nTT)
        out = self.target(tokens_nT, decoder.tap_layers, attention_mask=mask, position_ids=positions,
                          past_key_values=self.cache, use_cache=True, **attention_kwargs)
        return out.logits, torch.cat(out.taps, dim=-1)

    def _verify_accept_commit(self, batch: list[_Sequence], drafts: list[_Draft],
                              first_row: int) -> list[_Outcome | None]:
        """Verify batch (cache rows [first_row, first_row + n)) in one forward, accept each
        sequence's path, commit them -> one outcome per sequence (None: it failed). A failed
        forward of several rows is run again row by row (module doc, "Faults")."""
        self.cache.set_rows(first_row, first_row + len(batch))
        try:
            logits_nTV, hidden_nTH = retry_out_of_memory(lambda: self._verify(batch, drafts),
                                                         f"a verify forward of {len(batch)} sequences")
        except Exception as err:  # noqa: BLE001 - isolated below, row by row
            if is_fatal(err):
                raise
            if len(batch) == 1:
                self._fail(batch[0], err)
                return [None]
            outcomes = []
            for row, (seq, draft) in enumerate(zip(batch, drafts)):
                outcomes += self._verify_accept_commit([seq], [draft], first_row + row)
            return outcomes
        outcomes = [self._guard(seq, self._accept_one, seq, draft, logits_nTV[index], hidden_nTH[index])
                    for index, (seq, draft) in enumerate(zip(batch, drafts))]
        self.cache.commit([self._root_only if outcome is None else outcome.nodes for outcome in outcomes])
        return outcomes

    def _accept_one(self, seq: _Sequence, draft: _Draft, logits_TV: torch.Tensor,
                    hidden_TH: torch.Tensor) -> _Outcome:
        """seq's accepted path (greedy, or tree rejection sampling) from its verify logits."""
        size = draft.plan.num_nodes
        logits_TV = logits_TV[:size]
        if seq.greedy and size == 1:  # a plain step: the target's token is the next root
            root = logits_TV.argmax(dim=-1)
            nodes, emitted = self._root_only, root.tolist()
        elif seq.greedy:
            target_tokens = logits_TV.argmax(dim=-1)
            step = accept(draft.plan, draft.tokens, Verification(target_tokens=target_tokens, hidden=None))
            nodes, emitted, root = step.nodes, step.emitted, target_tokens[step.nodes[-1:]]
        else:
            sample = accept_tree_sampling(draft.tree, draft.tokens, logits_TV, seq.sampling, seq.generator,
                                          mode=seq.acceptance)
            nodes, emitted = sample.nodes, sample.emitted
            root = torch.tensor(sample.emitted[-1:], dtype=torch.long, device=self.target.device)
        return _Outcome(nodes=nodes, root=root, emitted=emitted, hidden=hidden_TH[nodes])

    # --- bookkeeping -----------------------------------------------------------------------

    def _count(self, seq: _Sequence, draft: _Draft, tokens: list[int], seconds: float) -> None:
        stats = seq.stats
        stats.decode_s += seconds
        stats.steps += 1
        num_accepted = len(tokens) - 1
        if draft.plan.max_depth == 0:  # a plain step (speculation off, probing or fallen back)
            stats.plain_steps += 1
            seq.plain_run += 1
            return
        stats.drafted_tokens += draft.plan.max_depth
        stats.accepted_tokens += num_accepted
        if len(stats.accepted_per_position) < draft.plan.max_depth:
            stats.accepted_per_position += [0] * (draft.plan.max_depth - len(stats.accepted_per_position))
        for depth in range(num_accepted):
            stats.accepted_per_position[depth] += 1
        seq.spec_steps += 1
        seq.spec_accepted += num_accepted
        seq.spec_seconds += seconds
