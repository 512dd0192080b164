"""The decode loop: several sequences, one target forward per step. A single request is a
batch of one (serving/decode/generate.py); serving/decode/scheduler.py admits and retires
requests around it for a server.

Every sequence owns a row of one `TreeStaticCache` (serving/decode/cache.py); the decoding
sequences are rows [0, n), kept contiguous (a leaving sequence's row is refilled by moving
the last row into it). A sequence joins with its own prefill forward (its row alone),
which yields its first token, or with a group of new sequences in one left-padded forward
(`add_many`: on a GPU a forward costs its launches more than its tokens); one that
continues a finished sequence's context (the next turn of a conversation) takes over that
row and prefills only what it adds. From the next step on it takes part in the batched step:

    draft -> verify -> accept -> commit -> record

- draft: the fallback policy says which sequences draft (serving/decode/fallback.py); each
  of those drafts its tree through the decoder's drafter (Medusa: every sequence in one
  head call; EAGLE: one head run per sequence, with its own head cache), and each of the
  decoder's chain sources (n-gram lookup from its own context, the store of the target's
  replies: serving/decode/lookup.py `ChainSource`), one call per source for every drafting
  sequence, adds a chain that goes alone or as one more branch. The others verify their
  root alone (a plain step).
- verify / accept: serving/decode/steps.py, one forward for the whole batch.
- commit: the cache keeps each row's accepted entries (serving/decode/cache.py).
- record: each sequence's next decode state, stats and output (EOS, stop sequences,
  max_new_tokens), and what the step cost and gave, told to the fallback policy.

Each sequence's greedy output is the target's greedy output for it alone: rows never see
each other (padding keys and other rows are masked).

Faults (which errors are fatal: serving/decode/faults.py). An exception raised while
stepping one sequence (its prefill, its draft, its accept, its bookkeeping) ends that
sequence alone: finish_reason "error", `GenerationResult.error` names it, and it leaves the
batch like a finished one. The other rows go on; their output is what it would have been
without it. A batched call that fails (the Medusa heads' one draft call, the verify
forward) is run again row by row, which finds the faulty row and still advances the others
this step. A failed forward leaves the cache whole: its entries were only pending. A verify
forward that runs out of memory is retried once with the allocator's cache emptied; out of
memory again, or a lost device, raises (`EngineBroken` or the device's error) and the
caller must treat the engine as broken.

Shape legend: n decoding sequences, T tree nodes (padded), V vocab, nH drafter tap width.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specheads.serving.decode.accept import NO_DISTRIBUTION, Accepted, HostAccepted, concat_accepted
from specheads.serving.decode.accept import accept as accept_batch
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.cache import TreeStaticCache
from specheads.serving.decode.fallback import Fallback
from specheads.serving.decode.graphs import VerifyGraphs, bucket
from specheads.serving.decode.faults import is_fatal, retry_out_of_memory
from specheads.serving.decode.logprobs import step_logprob_rows, unpack_step_logprobs
from specheads.serving.decode.sampling import make_generator
from specheads.serving.decode.stats import DecodeStats
from specheads.serving.decode.sequence import Sequence, SequenceRequest, as_prompt
from specheads.serving.decode.steps import DecodeState, Verified, emit, prefill, prefill_many, verify


# At most this many padded prompt tokens go into one prefill forward of several new sequences
# (BatchEngine.add_many): its attention mask and index tensors grow with rows x P^2.
PREFILL_GROUP_TOKENS = 32768


class BatchEngine:
    """Up to max_batch_size sequences of at most max_cache_len positions (prompt + new
    tokens + one tree) each; see the module docstring. Building one installs the tree
    attention on the target when the decoder verifies with it."""

    def __init__(self, decoder: SpeculativeDecoder, max_batch_size: int, max_cache_len: int):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.decoder = decoder
        self.target = decoder.target
        self.max_batch_size = max_batch_size
        self.max_cache_len = max_cache_len
        self.cache = TreeStaticCache(self.target.config, max_cache_len=max_cache_len, batch_size=max_batch_size,
                                     static_shape=decoder.cuda_graphs is not None)
        # An EAGLE head's KV cache, one row per engine row, moving with the cache's rows
        self.head_kv = None if decoder.drafter is None else decoder.drafter.new_cache(max_batch_size, max_cache_len)
        if self.head_kv is not None:
            self.cache.follow(self.head_kv.buffer)
        self.graphs = None if decoder.cuda_graphs is None else \
            VerifyGraphs(decoder, self.cache, capture=decoder.cuda_graphs == "capture")
        self.rows: list[Sequence] = []  # row i holds rows[i]
        self.chain_names = [source.name for source in decoder.chain_sources]
        self.fallback = Fallback(decoder.fallback, decoder.step_costs)
        self.clock = decoder.step_costs.clock
        if decoder.attn_impl == "tree":
            from specheads.serving.kernels.tree_attention import use_tree_attention

            use_tree_attention(self.target.model)

    # --- admission and leaving -------------------------------------------------------------

    def check(self, request: SequenceRequest, seq_id: int = 0) -> Sequence:
        """Validate a request (ValueError naming the problem) -> a sequence ready to add."""
        if isinstance(request.max_new_tokens, bool) or not isinstance(request.max_new_tokens, int) \
                or request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {request.max_new_tokens!r}")
        if request.acceptance not in ("rejection", "typical"):
            raise ValueError(f"acceptance must be 'rejection' (lossless) or 'typical' (lossy), "
                             f"got {request.acceptance!r}")
        greedy = request.sampling is None or request.sampling.is_greedy
        if request.acceptance == "typical" and greedy:
            raise ValueError("acceptance='typical' needs sampling (a temperature of at least 1e-5)")
        num_top = request.logprobs
        if num_top is not None and (isinstance(num_top, bool) or not isinstance(num_top, int) or num_top < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0 (the top tokens to report), got {num_top!r}")
        if request.prompt_logprobs and num_top is None:
            raise ValueError("prompt_logprobs needs logprobs (the number of top tokens to report, 0 or more)")
        stop_sequences = [list(map(int, s)) for s in request.stop_token_sequences or []]
        if any(len(s) == 0 for s in stop_sequences):
            raise ValueError("stop_token_sequences must not contain an empty sequence")
        eos = request.eos_token_id
        prompt_1P = as_prompt(request.input_ids, self.target.device)
        decoder = self.decoder
        needed = int(prompt_1P.shape[1]) + request.max_new_tokens + decoder.max_tree_nodes
        if needed > self.max_cache_len:
            raise ValueError(f"prompt ({prompt_1P.shape[1]} tokens) + max_new_tokens ({request.max_new_tokens}) "
                             f"+ one tree ({decoder.max_tree_nodes}) = {needed} positions, more than this "
                             f"engine's max_cache_len {self.max_cache_len}")
        speculating = request.speculate and decoder.speculates
        prompt = prompt_1P[0].tolist() if speculating and decoder.chain_sources else []
        return Sequence(
            seq_id=seq_id, prompt_1P=prompt_1P, max_new_tokens=request.max_new_tokens,
            eos_ids=frozenset([eos] if isinstance(eos, int) else eos or []), stop_sequences=stop_sequences,
            sampling=None if greedy else request.sampling, acceptance=request.acceptance,
            window=self.fallback.window(speculating, seeded=not greedy and request.sampling.seed is not None),
            generator=None if greedy else make_generator(request.sampling, self.target.device),
            chain_states=[source.start(prompt) for source in decoder.chain_sources] if speculating else [],
            keep_head_rows=speculating and decoder.drafts_from_head_cache,
            stats=DecodeStats(accepted_per_position=[0] * (decoder.max_depth if speculating else 0),
                              lossless=request.acceptance == "rejection"),
            num_top_logprobs=num_top, logprobs=None if num_top is None else [],
            prompt_logprobs=[] if request.prompt_logprobs else None)

    def add(self, seq: Sequence, join: bool = True, continues: Sequence | None = None) -> list[int]:
        """Prefill a checked sequence into the next free row; -> its first token.
        join=False: it sits out the next step (a scheduler reports its first token first).
        continues: a finished sequence still in its row (a conversation's last turn) whose
        context seq's prompt extends: seq takes over that row and prefills only what its prompt
        adds past the context both share (`reusable_prefix`), as a prefix cache would.
        An error in the prefill leaves the batch as it was (a continued row keeps the shared
        prefix only) and is raised to the caller."""
        if continues is None and len(self.rows) >= self.max_batch_size:
            raise RuntimeError(f"the batch is full ({self.max_batch_size} sequences)")
        row = len(self.rows) if continues is None else self.rows.index(continues)
        # prompt logprobs need every prompt position's logits: nothing is reused
        reuse = 0 if continues is None or seq.prompt_logprobs is not None else self.reusable_prefix(continues, seq)
        start = self.clock()
        with torch.inference_mode():  # the buffers are inference tensors
            self.cache.truncate_row(row, reuse)
            self.cache.set_rows(row, row + 1)
            try:
                seq.state = prefill(self.target, seq.prompt_1P[:, reuse:], self.decoder.tap_layers, self.cache,
                                    seq.sampling, seq.generator, all_logits=seq.prompt_logprobs is not None)
                seq.score_prefill()  # logprobs: the first token's (and the prompt's)
            except BaseException:
                self.cache.truncate_row(row, reuse)
                raise
        seq.joined = join
        if continues is None:
            self.rows.append(seq)
        else:
            self.rows[row] = seq
        seq.finish_reason = emit(seq.tokens, seq.state.root.tolist(), seq.max_new_tokens, seq.eos_ids,
                                 seq.stop_sequences)
        seq.stats.prefill_s = self.clock() - start
        seq.stats.prefill_reused_tokens = reuse
        return list(seq.tokens)

    def add_many(self, seqs: list[Sequence], join: bool = True) -> list[list[int]]:
        """Prefill several checked sequences into the next free rows, in groups of at most
        PREFILL_GROUP_TOKENS padded prompt tokens, one forward per group (steps.prefill_many);
        -> each one's first token. What `add` does for each, at the cost of one forward on a
        GPU. An error in a group's prefill leaves the batch with the groups before it and is
        raised to the caller."""
        if len(self.rows) + len(seqs) > self.max_batch_size:
            raise RuntimeError(f"{len(seqs)} more sequences do not fit the batch ({len(self.rows)} of "
                               f"{self.max_batch_size} rows taken)")
        groups, group, longest = [], [], 0
        for seq in seqs:
            length = int(seq.prompt_1P.shape[1])
            if seq.prompt_logprobs is not None:  # its prefill keeps every position's logits: alone
                groups += [group, [seq]] if group else [[seq]]
                group, longest = [], 0
                continue
            if group and max(longest, length) * (len(group) + 1) > PREFILL_GROUP_TOKENS:
                groups.append(group)
                group, longest = [], 0
            group.append(seq)
            longest = max(longest, length)
        groups += [group] if group else []
        for group in groups:
            if len(group) == 1:
                self.add(group[0], join)
                continue
            first, start = len(self.rows), self.clock()
            with torch.inference_mode():  # the buffers are inference tensors
                for row in range(first, first + len(group)):
                    self.cache.truncate_row(row, 0)
                self.cache.set_rows(first, first + len(group))
                try:
                    states = prefill_many(self.target, [seq.prompt_1P for seq in group], self.decoder.tap_layers,
                                          self.cache, [seq.sampling for seq in group],
                                          [seq.generator for seq in group])
                    for seq, state in zip(group, states):
                        seq.state = state
                        seq.score_prefill()  # logprobs: the first token's
                except BaseException:
                    for row in range(first, first + len(group)):
                        self.cache.truncate_row(row, 0)
                    raise
            seconds = (self.clock() - start) / len(group)
            for seq, state in zip(group, states):
                seq.state, seq.joined = state, join
                self.rows.append(seq)
                seq.finish_reason = emit(seq.tokens, state.root.tolist(), seq.max_new_tokens, seq.eos_ids,
                                         seq.stop_sequences)
                seq.stats.prefill_s = seconds
        return [list(seq.tokens) for seq in seqs]

    def reusable_prefix(self, done: Sequence, seq: Sequence) -> int:
        """How many of done's cached positions seq's prompt can keep: the context both start
        with, short of seq's last prompt token (a prefill needs one). ValueError for a running
        sequence or an EAGLE drafter (its head cache would lack the kept positions; Medusa reads
        only the last position's state)."""
        if done.finish_reason is None or done not in self.rows:
            raise ValueError("only a finished sequence that still holds its row can be continued")
        if seq.keep_head_rows:
            raise ValueError("an EAGLE-drafted sequence cannot continue another's cache; add it alone")
        # Row position i holds token i of done's context, for i below its committed length. The
        # last emitted token has no entry yet; max_new_tokens may have cut accepted tokens that do.
        cached = done.prompt_1P[0].tolist() + done.tokens
        prompt = seq.prompt_1P[0].tolist()
        limit = min(done.state.prefix_len, len(cached), len(prompt) - 1)
        same = 0
        while same < limit and cached[same] == prompt[same]:
            same += 1
        return same

    def remove(self, seq: Sequence) -> None:
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
        A sequence that fails ends alone with finish_reason "error" (module doc, "Faults").
        Everything up to the accepted tokens runs on the device; their copy to the host is
        the step's one device sync."""
        batch = self._decoding()
        if not batch:
            return {}
        start = self.clock()
        with torch.inference_mode():
            drafts = self._draft(batch)
            verified = self._verify(batch, drafts)
            accepted, host = self._accept(batch, drafts, verified)
            # commit: each row keeps its accepted entries (a failed row its root alone: that
            # sequence has ended, the entry is never read); a root alone stays where it is
            self.cache.commit([None if seq.error is not None or len(path) == 1 else path
                               for seq, path in zip(batch, host.paths)], num_kept=[1] * len(batch))
            return self._record(batch, drafts, verified, accepted, host, self.clock() - start)

    def _decoding(self) -> list[Sequence]:
        """The sequences this step decodes (joined, unfinished), moved to rows [0, n); every
        sequence added before now joins the next step."""
        decoding = [seq.joined and seq.finish_reason is None for seq in self.rows]
        front = sum(decoding)
        # One swap per misplaced row (a swap copies both rows' KV): each row in [0, front) that
        # sits out trades places with a decoding row from [front, n).
        holes = [row for row in range(front) if not decoding[row]]
        movers = [row for row in range(front, len(self.rows)) if decoding[row]]
        with torch.inference_mode():
            for hole, mover in zip(holes, movers):
                self.cache.swap_rows(hole, mover)
                self.rows[hole], self.rows[mover] = self.rows[mover], self.rows[hole]
        batch = self.rows[:front]
        for seq in self.rows:
            seq.joined = True
        return batch

    def _draft(self, batch: list[Sequence]) -> DraftBatch:
        """The batch's drafts: each drafting sequence's chains (alone, or more branches), the
        heads' trees of the rest, every other row its root alone. A sequence whose drafting
        fails ends, its root alone standing in for it in this step's verify."""
        sources = self.decoder.chain_sources
        chains = [[[] for _ in sources] for _ in batch]  # [n][S]
        alone = [False] * len(batch)
        drafting = [index for index, speculates in enumerate(self.fallback.drafting(batch)) if speculates]
        asking = [index for index in drafting if batch[index].chain_states]
        for number, source in enumerate(sources):
            proposals = self._draft_chains(source, number, [batch[i] for i in asking])
            for index, (chain, goes_alone) in zip(asking, proposals):
                chains[index][number] = chain
                alone[index] = alone[index] or goes_alone
        heads_rows = [index for index in drafting if not alone[index] and self.decoder.drafter is not None
                      and batch[index].error is None]
        drafted = self._draft_heads(batch, heads_rows) if heads_rows else None
        if drafted is None or len(drafted[0]) < len(heads_rows):  # rows whose drafting failed
            heads_rows = [] if drafted is None else [heads_rows[i] for i in drafted[0]]
        if len(heads_rows) == len(batch):  # every row drafted (the common case): nothing to pad in
            drafts = replace(drafted[1], heads_drafted=[True] * len(batch))
        else:
            drafts = DraftBatch.merge(DraftBatch.roots(torch.cat([seq.state.root for seq in batch])),
                                      None if drafted is None else drafted[1], heads_rows)
        chains = [row if seq.error is None else [] for seq, row in zip(batch, chains)]
        return drafts.with_chains(chains) if any(any(row) for row in chains) else drafts

    def _draft_chains(self, source, number: int, seqs: list[Sequence]) -> list[tuple[list[int], bool]]:
        """One call of a chain source for seqs -> each one's (chain, alone). On an error, one
        call per sequence, which finds the faulty one and ends it alone (its chain: none)."""
        if not seqs:
            return []
        try:
            return source.draft([seq.chain_states[number] for seq in seqs], [seq.tokens for seq in seqs])
        except Exception as err:  # noqa: BLE001 - isolated below, row by row
            if is_fatal(err):
                raise
        alone = [self._guard(seq, source.draft, [seq.chain_states[number]], [seq.tokens]) for seq in seqs]
        return [([], False) if one is None else one[0] for one in alone]

    def _draft_heads(self, batch: list[Sequence], rows: list[int]) -> tuple[list[int], DraftBatch] | None:
        """One drafter call for the given rows -> (the drafted rows' indices in `rows`, their
        drafts). On an error, one call per sequence, which finds the faulty one and ends it alone."""
        drafter = self.decoder.drafter
        try:
            return list(range(len(rows))), drafter.draft([batch[row].state for row in rows], rows, self.head_kv)
        except Exception as err:  # noqa: BLE001 - isolated below, row by row
            if is_fatal(err):
                raise
        alone = [self._guard(batch[row], drafter.draft, [batch[row].state], [row], self.head_kv) for row in rows]
        drafted = [i for i, one in enumerate(alone) if one is not None]
        if not drafted:
            return None
        ones = [alone[i] for i in drafted]
        width = max(one.num_nodes for one in ones)
        padded = [one.padded(width) for one in ones]
        stacked = {name: torch.cat([getattr(one, name) for one in padded])
                   for name in ("tokens", "parents", "depths", "tree_mask", "valid")}
        return drafted, DraftBatch(**stacked, max_depth=max(one.max_depth for one in ones),
                                   max_children=max(one.max_children for one in ones))

    def _verify(self, batch: list[Sequence], drafts: DraftBatch) -> Verified | None:
        """ONE forward over rows [0, n). A failed forward of several rows is run again row by
        row, padded alike so that the rows commit together; a row that fails alone ends (its
        logits are then zeros, never read)."""
        self.cache.set_rows(0, len(batch))
        num_nodes = drafts.num_nodes
        if self.graphs is not None:  # a few tree sizes, so a few graphs
            num_nodes = bucket(num_nodes, self.decoder.max_tree_nodes)
        try:
            return retry_out_of_memory(lambda: verify(self.decoder, self.cache, drafts, num_nodes, self.graphs),
                                       f"a verify forward of {len(batch)} sequences")
        except Exception as err:  # noqa: BLE001 - isolated below, row by row
            if is_fatal(err):
                raise
            if len(batch) == 1:
                self._fail(batch[0], err)
        rows = []
        for row, seq in enumerate(batch):
            self.cache.set_rows(row, row + 1, pending_written=True)  # the failed forward's entries are dropped
            one = None if seq.error is not None else self._guard(seq, lambda: retry_out_of_memory(
                lambda: verify(self.decoder, self.cache, drafts.rows([row]), num_nodes, self.graphs),
                "a verify forward of one sequence"))
            rows.append(one)
        self.cache.set_rows(0, len(batch), pending_written=True)
        done = next((one for one in rows if one is not None), None)
        if done is None:
            return None
        blank = Verified(torch.zeros_like(done.logits), torch.zeros_like(done.taps), torch.zeros_like(done.target_tokens))
        rows = [blank if one is None else one for one in rows]
        return Verified(*(torch.cat([getattr(one, name) for one in rows]) for name in ("logits", "taps", "target_tokens")))

    def _accept(self, batch: list[Sequence], drafts: DraftBatch, verified: Verified | None):
        """Every row's accepted path on the device, then its copy to the host (the step's one
        sync) -> (Accepted, HostAccepted). If the batched accept fails, each row is accepted
        alone, which finds the faulty one and ends it; a row whose logits give no distribution
        ends too."""
        if verified is None:  # every row failed in the verify
            return None, HostAccepted.root_only(len(batch))
        try:
            accepted = self._accept_rows(batch, drafts, verified, list(range(len(batch))))
        except Exception as err:  # noqa: BLE001 - isolated below, row by row
            if is_fatal(err):
                raise
            alone = [self._guard(seq, self._accept_rows, batch, drafts, verified, [row]) for row, seq in enumerate(batch)]
            blank = next((one for one in alone if one is not None), None)
            if blank is None:
                return None, HostAccepted.root_only(len(batch))
            accepted = concat_accepted([blank if one is None else one for one in alone])
        asks = any(seq.logprobs is not None for seq in batch)
        host = accepted.to_host(self._logprob_rows(batch, verified, accepted) if asks else None)
        for seq, bad in zip(batch, host.bad):
            if bad and seq.error is None:
                self._fail(seq, ValueError(NO_DISTRIBUTION))
        return accepted, host

    def _accept_rows(self, batch: list[Sequence], drafts: DraftBatch, verified: Verified, rows: list[int]) -> Accepted:
        """The accept of the given rows (all of them, or one alone)."""
        if len(rows) < len(batch):
            index = torch.tensor(rows, device=verified.logits.device)
            drafts = drafts.rows(rows)
            verified = Verified(*(getattr(verified, name).index_select(0, index)
                                  for name in ("logits", "taps", "target_tokens")))
        seqs = [batch[row] for row in rows]
        return accept_batch(drafts, verified.logits, verified.target_tokens, [seq.sampling for seq in seqs],
                            [seq.generator for seq in seqs], [seq.acceptance for seq in seqs],
                            self.decoder.uniform_shape)

    def _record(self, batch: list[Sequence], drafts: DraftBatch, verified: Verified | None, accepted: Accepted | None,
                host: HostAccepted, seconds: float) -> dict[int, list[int]]:
        """Each sequence's next state, stats and new tokens, then what the step cost and gave,
        told to the fallback policy -> {seq_id: new tokens}."""
        deltas, emitted = {}, []
        for row, seq in enumerate(batch):
            before = len(seq.tokens)
            if seq.error is None:
                self._guard(seq, self._advance, seq, drafts, verified, accepted, host, row, seconds,
                            self.chain_names)
            ok = seq.error is None
            emitted.append(len(host.emitted[row]) if ok else None)
            deltas[seq.seq_id] = seq.tokens[before:] if ok else []
        self.fallback.observe(batch, host.depths, emitted, drafts.num_nodes, seconds)
        return deltas

    @staticmethod
    def _advance(seq: Sequence, drafts: DraftBatch, verified: Verified, accepted: Accepted, host: HostAccepted,
                 row: int, seconds: float, chain_names: list[str]) -> None:
        """One sequence after its committed step: its next decode state, its stats, its output.
        chain_names: the decoder's chain sources' names, in order. Device tensors are sliced
        with host counts: no sync."""
        state, path, emitted = seq.state, host.paths[row], host.emitted[row]
        num_nodes = len(path)
        hidden = verified.taps[row].index_select(0, accepted.path[row, :num_nodes])  # [A, nH]
        next_tokens = accepted.emitted[row, :num_nodes]  # the token after each accepted node
        heads_drafted = drafts.heads_drafted is None or drafts.heads_drafted[row]
        if seq.keep_head_rows and not heads_drafted:  # the EAGLE head covers these rows on its next run
            hidden, next_tokens = torch.cat([state.hidden, hidden]), torch.cat([state.next_tokens, next_tokens])
        seq.state = DecodeState(cache=state.cache, prefix_len=state.prefix_len + num_nodes,
                                root=accepted.emitted[row, num_nodes - 1:num_nodes], hidden=hidden,
                                next_tokens=next_tokens)
        seq.stats.count_step(host.depths[row], num_nodes - 1, seconds)
        for name, span in zip(chain_names, drafts.chain_spans[row] if drafts.chain_spans is not None else []):
            if span is not None:
                seq.stats.count_chain(name, sum(span[0] <= node < span[0] + span[1] for node in path))
        seq.finish_reason = emit(seq.tokens, emitted, seq.max_new_tokens, seq.eos_ids, seq.stop_sequences)
        if seq.logprobs is not None:  # only the entries the output took (emit may stop early)
            entries = unpack_step_logprobs(host.extra[row], emitted, seq.num_top_logprobs,
                                           int(accepted.path.shape[1]))
            seq.logprobs += entries[:len(seq.tokens) - len(seq.logprobs)]

    # --- logprobs (serving/decode/logprobs.py) ----------------------------------------------

    @staticmethod
    def _logprob_rows(batch: list[Sequence], verified: Verified, accepted: Accepted) -> torch.Tensor:
        """The step's emitted tokens scored for the rows that ask (serving/decode/logprobs.py; at
        least one does), on the device, to travel in the step's one copy to the host."""
        rows = [row for row, seq in enumerate(batch) if seq.logprobs is not None]
        num_top = max(batch[row].num_top_logprobs for row in rows)
        index = torch.tensor(rows, device=verified.logits.device)
        scored = step_logprob_rows(verified.logits.index_select(0, index), accepted.path.index_select(0, index),
                                   accepted.emitted.index_select(0, index), num_top)
        extra = scored.new_full((len(batch), scored.shape[1]), float("nan"))
        return extra.index_copy_(0, index, scored)

    # --- faults (module doc, "Faults") -----------------------------------------------------

    def _fail(self, seq: Sequence, err: Exception) -> None:
        """End seq alone: it leaves the batch at the end of this step like a finished one."""
        seq.error = err
        seq.finish_reason = "error"

    def _guard(self, seq: Sequence, call, *args):
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
