"""The decode loop: several sequences, one target forward per step. A single request is a
batch of one (serving/decode/generate.py); serving/decode/scheduler.py admits and retires
requests around it for a server.

Every sequence owns a row of one `TreeStaticCache` (serving/decode/cache.py) and of the decode
step's per-row device state (serving/decode/steps.py `DeviceStep`: its root, sampling
settings and drafters' state, which move with the cache's rows); the decoding sequences are
rows [0, n), kept contiguous (a leaving sequence's row is refilled by moving the last row
into it). A sequence joins with its own prefill forward (its row alone), which yields its
first token, or with a group of new sequences in one left-padded forward (`add_many`: on a
GPU a forward costs its launches more than its tokens); one that continues a finished
sequence's context (the next turn of a conversation) takes over that row and prefills only
what it adds. From the next step on it takes part in the batched step:

    (host) which rows draft -> (device) draft -> verify -> accept -> commit -> (host) record

- which rows draft: the fallback policy (serving/decode/fallback.py); the others verify
  their root alone (a plain step).
- draft / verify / accept / commit: `DeviceStep`, one step for the whole batch on the
  target's device, then its one read.
- record: each sequence's output (EOS, stop sequences, max_new_tokens), stats and logprobs,
  and what the step cost and gave, told to the fallback policy.

Each sequence's greedy output is the target's greedy output for it alone: rows never see
each other (padding keys and other rows are masked).

Faults (which errors are fatal: serving/decode/faults.py). An exception raised while
stepping one sequence (its prefill, its draft, its verify, its accept, its bookkeeping) ends
that sequence alone: finish_reason "error", `GenerationResult.error` names it, and it leaves
the batch like a finished one. The other rows go on; their output is what it would have been
without it. There is one boundary per step (`_run`): a batched step that fails is run again
row by row, which finds the faulty row and still advances the others this step (a step writes
its state only after every row's draft, verify and accept, so a failed one left the rows as
they were). A step that runs out of memory is run once more with the allocator's cache
emptied; out of memory again, or a lost device, raises (`EngineBroken` or the device's error)
and the caller must treat the engine as broken.

Shape legend: n decoding sequences, T tree nodes (padded), V vocab.
"""

from __future__ import annotations

import torch

from specheads.serving.decode.accept import NO_DISTRIBUTION, HostAccepted
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.cache import TreeStaticCache
from specheads.serving.decode.fallback import Fallback
from specheads.serving.decode.graphs import VerifyGraphs
from specheads.serving.decode.faults import OUT_OF_MEMORY, is_fatal, rerun_out_of_memory
from specheads.serving.decode.logprobs import unpack_step_logprobs
from specheads.serving.decode.sampling import make_generator
from specheads.serving.decode.stats import DecodeStats
from specheads.serving.decode.sequence import Sequence, SequenceRequest, as_prompt
from specheads.serving.decode.steps import DeviceStep, emit, prefill, prefill_many


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
                                     static_shape=decoder.cuda_graphs is not None, device=self.target.device)
        self.graphs = None if decoder.cuda_graphs is None else \
            VerifyGraphs(decoder, self.cache, capture=decoder.cuda_graphs == "capture")
        self.device_step = DeviceStep(decoder, self.cache, max_cache_len, self.graphs)
        self.rows: list[Sequence] = []  # row i holds rows[i]
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
        prompt = request.input_ids if isinstance(request.input_ids, list) else prompt_1P[0].tolist()
        return Sequence(
            seq_id=seq_id, prompt_1P=prompt_1P, max_new_tokens=request.max_new_tokens,
            eos_ids=frozenset([eos] if isinstance(eos, int) else eos or []), stop_sequences=stop_sequences,
            sampling=None if greedy else request.sampling, acceptance=request.acceptance,
            window=self.fallback.window(speculating, seeded=not greedy and request.sampling.seed is not None),
            generator=None if greedy else make_generator(request.sampling, self.target.device),
            stats=DecodeStats(accepted_per_position=[0] * (decoder.max_depth if speculating else 0),
                              lossless=request.acceptance == "rejection"),
            prompt=[int(token) for token in prompt], num_top_logprobs=num_top,
            logprobs=None if num_top is None else [], prompt_logprobs=[] if request.prompt_logprobs else None)

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
                prefilled = prefill(self.target, seq.prompt_1P, self.decoder.tap_layers, self.cache, seq.sampling,
                                    seq.generator, all_logits=seq.prompt_logprobs is not None, start=reuse)
                first, seq.notes = self.device_step.start(row, seq, prefilled)
                seq.score_prefill(prefilled.logits, first)  # logprobs: the first token's (and the prompt's)
            except BaseException:
                self.cache.truncate_row(row, reuse)
                raise
        seq.joined, seq.prefix_len = join, int(seq.prompt_1P.shape[1])
        if continues is None:
            self.rows.append(seq)
        else:
            self.rows[row] = seq
        seq.finish_reason = emit(seq.tokens, [first], seq.max_new_tokens, seq.eos_ids, seq.stop_sequences)
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
            first_row, start = len(self.rows), self.clock()
            with torch.inference_mode():  # the buffers are inference tensors
                for row in range(first_row, first_row + len(group)):
                    self.cache.truncate_row(row, 0)
                self.cache.set_rows(first_row, first_row + len(group))
                try:
                    prefills = prefill_many(self.target, [seq.prompt_1P for seq in group], self.decoder.tap_layers,
                                            self.cache, [seq.sampling for seq in group],
                                            [seq.generator for seq in group])
                    firsts = []
                    for row, (seq, prefilled) in enumerate(zip(group, prefills), start=first_row):
                        first, seq.notes = self.device_step.start(row, seq, prefilled)
                        seq.score_prefill(prefilled.logits, first)  # logprobs: the first token's
                        firsts.append(first)
                except BaseException:
                    for row in range(first_row, first_row + len(group)):
                        self.cache.truncate_row(row, 0)
                    raise
            seconds = (self.clock() - start) / len(group)
            for seq, first in zip(group, firsts):
                seq.joined, seq.prefix_len = join, int(seq.prompt_1P.shape[1])
                self.rows.append(seq)
                seq.finish_reason = emit(seq.tokens, [first], seq.max_new_tokens, seq.eos_ids, seq.stop_sequences)
                seq.stats.prefill_s = seconds
        return [list(seq.tokens) for seq in seqs]

    def reusable_prefix(self, done: Sequence, seq: Sequence) -> int:
        """How many of done's cached positions seq's prompt can keep: the context both start
        with, short of seq's last prompt token (a prefill needs one), and, where the token after
        them changes (or is not known here: accepted tokens that max_new_tokens cut), fewer by
        the drafters' lookahead (their state at a position reads the tokens after it: an EAGLE
        head's, one). ValueError for a running sequence."""
        if done.finish_reason is None or done not in self.rows:
            raise ValueError("only a finished sequence that still holds its row can be continued")
        # Row position i holds token i of done's context, for i below its committed length. The
        # last emitted token has no entry yet; max_new_tokens may have cut accepted tokens that do.
        cached = done.prompt + done.tokens
        prompt = seq.prompt
        limit = min(done.prefix_len, len(cached), len(prompt) - 1)
        same = 0
        while same < limit and cached[same] == prompt[same]:
            same += 1
        if same < len(cached) and cached[same] == prompt[same]:
            return same
        return max(0, same - max((drafter.lookahead for drafter in self.device_step.drafters), default=0))

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
        A sequence that fails ends alone with finish_reason "error" (module doc, "Faults")."""
        decoding = [seq.joined and seq.finish_reason is None for seq in self.rows]
        front = sum(decoding)
        # The decoding sequences move to rows [0, n), one swap per misplaced row (a swap moves both
        # rows' state): each row in [0, front) that sits out trades places with a decoding row after.
        holes = [row for row in range(front) if not decoding[row]]
        movers = [row for row in range(front, len(self.rows)) if decoding[row]]
        with torch.inference_mode():
            for hole, mover in zip(holes, movers):
                self.cache.swap_rows(hole, mover)
                self.rows[hole], self.rows[mover] = self.rows[mover], self.rows[hole]
            batch = self.rows[:front]
            for seq in self.rows:
                seq.joined = True  # every sequence added before now joins the next step
            if not batch:
                return {}
            start = self.clock()
            steps, num_nodes = self._run(batch, self.fallback.drafting(batch))
            return self._record(batch, steps, num_nodes, self.clock() - start)

    def _run(self, batch: list[Sequence], drafting: list[bool]) -> tuple[list[HostAccepted | None], int]:
        """The step's one fault boundary: rows [0, n) in one device step, or, when that raises
        a non-fatal error, each row alone (a row that fails again ends) -> (each row's step,
        None where it failed; the batched step's tree size)."""
        try:
            return self._step_rows(batch, drafting, 0)
        except Exception as err:  # noqa: BLE001 - isolated below, row by row
            if is_fatal(err):
                raise
            self.cache.drop_pending()
            if len(batch) == 1:
                self._fail(batch[0], err)
                return [None], 1
        steps, num_nodes = [], 1
        for row, (seq, draws) in enumerate(zip(batch, drafting)):
            one = self._guard(seq, self._step_rows, [seq], [draws], row)
            if one is None:
                self.cache.drop_pending()
            steps.append(None if one is None else one[0][0])
            num_nodes = max(num_nodes, 1 if one is None else one[1])
        return steps, num_nodes

    def _step_rows(self, seqs: list[Sequence], drafting: list[bool], first: int
                   ) -> tuple[list[HostAccepted], int]:
        """One device step of rows [first, first + len(seqs)) and its read."""
        lengths = self.cache.lengths
        if (lengths.start, lengths.stop) != (first, first + len(seqs)):  # else they are the active rows already
            self.cache.set_rows(first, first + len(seqs))
        device_step = self.device_step
        variant, uniforms = device_step.plan(seqs, drafting)
        try:
            packed = device_step.run(variant, uniforms)
        except OUT_OF_MEMORY:  # once more with the allocator's cache emptied; twice is fatal
            self.cache.drop_pending()
            packed = rerun_out_of_memory(lambda: device_step.run(variant, uniforms),
                                         f"a decode step of {len(seqs)} sequences")
        steps = device_step.read(packed, variant)
        self.cache.count_committed([len(one.path) for one in steps])
        return steps, variant.num_nodes

    def _record(self, batch: list[Sequence], steps: list[HostAccepted | None], num_nodes: int,
                seconds: float) -> dict[int, list[int]]:
        """Each sequence's output, stats and logprobs, then what the step cost and gave, told to
        the fallback policy -> {seq_id: new tokens}."""
        deltas, depths, emitted = {}, [], []
        for seq, one in zip(batch, steps):
            before = len(seq.tokens)
            if one is not None and one.bad:
                self._fail(seq, ValueError(NO_DISTRIBUTION))
            if one is not None and seq.error is None:
                try:
                    self._advance(seq, one, seconds)
                except Exception as err:  # noqa: BLE001 - one sequence's fault ends that sequence (faults.py)
                    if is_fatal(err):
                        raise
                    self._fail(seq, err)
            ok = seq.error is None
            if ok and seq.finish_reason is not None:  # it ended in this step
                self.device_step.finish(seq)
            depths.append(one.depth if ok else 0)
            emitted.append(len(one.emitted) if ok else None)
            deltas[seq.seq_id] = seq.tokens[before:] if ok else []
        self.fallback.observe(batch, depths, emitted, num_nodes, seconds)
        return deltas

    @staticmethod
    def _advance(seq: Sequence, one: HostAccepted, seconds: float) -> None:
        """One sequence after its committed step: its length, its drafters' notes, its stats,
        its output and logprobs."""
        seq.prefix_len += len(one.path)
        seq.notes.update(one.notes)
        seq.stats.count_step(one.depth, len(one.path) - 1, seconds)
        for name, count in one.chains.items():
            seq.stats.count_chain(name, count)
        seq.finish_reason = emit(seq.tokens, one.emitted, seq.max_new_tokens, seq.eos_ids, seq.stop_sequences)
        if seq.logprobs is not None:  # only the entries the output took (emit may stop early)
            entries = unpack_step_logprobs(one.logprobs, one.emitted, seq.num_top_logprobs, one.width)
            seq.logprobs += entries[:len(seq.tokens) - len(seq.logprobs)]

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
