"""Continuous batching around the engine: requests join and leave a running batch between steps.

`Scheduler` is what a server worker (serving/server/worker.py) drives: it gives each
admitted request an id, reports a new request's first token with the next step's updates
(so every update comes from `step()`), retires finished sequences from the engine's rows,
and cancels by id. The engine itself knows rows, not requests. It owns up to
`max_batch_size` sequences; `add()` admits one (its prefill runs on the next
`step()`), `step()` advances every active sequence by one decode step and reports each
one's new tokens, `cancel()` drops one at once. A session is used from one thread only.

Each `SequenceUpdate` carries the tokens a step produced for one sequence; the first
update of a sequence holds the prefill's token. When `finished` is set, `result` holds the
sequence's `GenerationResult` (tokens, finish_reason, stats) and the sequence has left
the batch, unless the scheduler keeps finished rows (`keep_finished`): then each finished
sequence holds its row until the caller either continues it (`add(..., continues=seq_id)`:
a conversation's next turn reuses the cached context) or `release`s it. Greedy output of
every sequence equals decoding it alone. The decode loop is serving/decode/engine.py's
BatchEngine: one target forward per step for all sequences.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.engine import BatchEngine
from specheads.serving.decode.sequence import SequenceRequest
from specheads.serving.decode.faults import SequenceFailed, describe, is_fatal
from specheads.serving.decode.stats import GenerationResult

__all__ = ["Scheduler", "SequenceRequest", "SequenceUpdate"]


@dataclass
class SequenceUpdate:
    seq_id: int
    new_tokens: list[int]
    finished: bool = False
    result: GenerationResult | None = None  # set when finished
    # the request asked for logprobs: one TokenLogprob per new token (serving/decode/logprobs.py), and
    # in a sequence's first update, with prompt_logprobs, the prompt's (None for its first token)
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class Scheduler:
    """Up to max_batch_size sequences decoded together (see the module docstring).

    max_cache_len bounds every sequence's prompt + max_new_tokens + one tree; default the
    target's max_position_embeddings plus one tree. The KV cache for max_batch_size rows of
    that length is allocated on the first prefill.
    """

    def __init__(self, decoder: SpeculativeDecoder, max_batch_size: int = 8, max_cache_len: int | None = None,
                 keep_finished: bool = False):
        if max_cache_len is None:
            max_positions = getattr(decoder.target.config, "max_position_embeddings", None)
            if not max_positions:
                raise ValueError("the target's config has no max_position_embeddings; pass max_cache_len")
            max_cache_len = int(max_positions) + decoder.max_tree_nodes
        self.decoder = decoder
        self.engine = BatchEngine(decoder, max_batch_size, max_cache_len)
        self._ids = itertools.count()
        self._sequences: dict[int, object] = {}  # seq_id -> the engine's sequence
        self._first: list[tuple[int, list[int]]] = []  # first tokens of sequences added since the last step
        self.keep_finished = keep_finished
        self._kept: dict[int, object] = {}  # seq_id -> a finished sequence still in its row (keep_finished)

    @property
    def max_batch_size(self) -> int:
        return self.engine.max_batch_size

    @property
    def num_active(self) -> int:
        return len(self._sequences)

    @property
    def has_capacity(self) -> bool:
        return len(self._sequences) + len(self._kept) < self.max_batch_size

    def add(self, request: SequenceRequest, continues: int | None = None) -> int:
        """Admit a sequence and run its prefill; -> its seq_id. Bad requests raise ValueError
        before admission; a prefill that fails (not fatally, serving/decode/faults.py) raises
        SequenceFailed, the batch unchanged. Its first token is reported by the next step().
        continues: the seq_id of a kept finished sequence whose row (and cached context, as
        far as the new prompt repeats it) the new sequence takes over (BatchEngine.add)."""
        if continues is not None and continues not in self._kept:
            raise ValueError(f"sequence {continues} is not a kept finished sequence")
        if continues is None and not self.has_capacity:
            raise RuntimeError(f"the batch is full ({self.max_batch_size} sequences); wait for one to finish")
        seq = self.engine.check(request, next(self._ids))
        done = None if continues is None else self._kept.pop(continues)
        try:
            first = self.engine.add(seq, join=False, continues=done)
        except Exception as err:  # noqa: BLE001 - a valid request the engine failed on: never a refusal
            if is_fatal(err):
                raise
            raise SequenceFailed(describe(err)) from err
        finally:
            if done is not None and done in self.engine.rows:  # the prefill failed: the row is still done's
                self.engine.remove(done)
        self._admit([seq], [first])
        return seq.seq_id

    def add_many(self, requests: list[SequenceRequest]) -> list[int]:
        """Admit several new sequences, their prefills batched (BatchEngine.add_many); -> their
        seq_ids. Bad requests raise ValueError before any is admitted; a prefill that fails
        raises SequenceFailed, with the sequences of the groups before it admitted."""
        if len(self._sequences) + len(self._kept) + len(requests) > self.max_batch_size:
            raise RuntimeError(f"{len(requests)} more sequences do not fit the batch ({self.max_batch_size} "
                               f"sequences); wait for some to finish")
        seqs = [self.engine.check(request, next(self._ids)) for request in requests]
        try:
            firsts = self.engine.add_many(seqs, join=False)
        except Exception as err:  # noqa: BLE001 - valid requests the engine failed on: never a refusal
            if is_fatal(err):
                raise
            admitted = [seq for seq in seqs if seq in self.engine.rows]
            self._admit(admitted, [list(seq.tokens) for seq in admitted])
            raise SequenceFailed(describe(err)) from err
        self._admit(seqs, firsts)
        return [seq.seq_id for seq in seqs]

    def _admit(self, seqs: list, firsts: list[list[int]]) -> None:
        for seq, first in zip(seqs, firsts):
            self._first.append((seq.seq_id, first))
            self._sequences[seq.seq_id] = seq

    def release(self, seq_id: int) -> None:
        """Free the row of a kept finished sequence (keep_finished)."""
        self.engine.remove(self._kept.pop(seq_id))

    def cancel(self, seq_id: int) -> GenerationResult | None:
        """Drop a sequence now; -> its result so far (finish_reason "stop", the engine's own
        stats), None for unknown or finished ids."""
        seq = self._sequences.pop(seq_id, None)
        if seq is None:
            return None
        self.engine.remove(seq)
        self._first = [(i, t) for i, t in self._first if i != seq_id]
        return seq.close()

    def step(self) -> list[SequenceUpdate]:
        """First tokens of the sequences added since the last step, then one decode step for
        the others; a finished sequence's update carries its result and it leaves the batch."""
        updates = {seq_id: tokens for seq_id, tokens in self._first}
        first = set(updates)
        self._first = []
        for seq_id, tokens in self.engine.step().items():
            updates[seq_id] = tokens
        out = []
        for seq_id, tokens in updates.items():
            seq = self._sequences[seq_id]
            update = SequenceUpdate(seq_id, tokens)
            if seq.logprobs is not None:  # aligned with seq.tokens, whose last len(tokens) are new
                update.logprobs = seq.logprobs[len(seq.logprobs) - len(tokens):]
                update.prompt_logprobs = seq.prompt_logprobs if seq_id in first else None
            if seq.finish_reason is not None:
                update.finished, update.result = True, seq.result()
                del self._sequences[seq_id]
                if self.keep_finished:
                    self._kept[seq_id] = seq
                else:
                    self.engine.remove(seq)
            out.append(update)
        return out
