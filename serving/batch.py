"""Step-level batched decoding: sequences join and leave a running batch between steps.

`BatchSession` is the engine's interface for a scheduler (the HTTP server's worker): it
owns up to `max_batch_size` sequences; `add()` admits one (its prefill runs on the next
`step()`), `step()` advances every active sequence by one decode step and reports each
one's new tokens, `cancel()` drops one at once. A session is used from one thread only.

Each `SequenceUpdate` carries the tokens a step produced for one sequence; the first
update of a sequence holds the prefill's token. When `finished` is set, `result` holds the
sequence's `GenerationResult` (tokens, finish_reason, stats) and the sequence has left
the batch. Greedy output of every sequence equals decoding it alone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from specheads.serving.decode import GenerationResult, SpeculativeDecoder
from specheads.serving.sampling import SamplingParams


@dataclass
class SequenceRequest:
    input_ids: list[int]
    max_new_tokens: int
    eos_token_id: int | list[int] | None = None
    sampling: SamplingParams | None = None  # None or temperature 0: greedy
    stop_token_sequences: list[list[int]] = field(default_factory=list)
    speculate: bool = True  # False: plain decoding for this sequence (the heads are not used)


@dataclass
class SequenceUpdate:
    seq_id: int
    new_tokens: list[int]
    finished: bool = False
    result: GenerationResult | None = None  # set when finished


class BatchSession:
    """Up to max_batch_size sequences decoded together (see the module docstring)."""

    def __init__(self, decoder: SpeculativeDecoder, max_batch_size: int = 8):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.decoder = decoder
        self.max_batch_size = max_batch_size
        self._ids = itertools.count()
        self._active: dict[int, object] = {}  # seq_id -> the sequence's running decode

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def has_capacity(self) -> bool:
        return len(self._active) < self.max_batch_size

    def add(self, request: SequenceRequest) -> int:
        """Admit a sequence; -> its seq_id. Bad requests raise ValueError before admission."""
        if not self.has_capacity:
            raise RuntimeError(f"the batch is full ({self.max_batch_size} sequences); wait for one to finish")
        stream = self.decoder.stream(request.input_ids, request.max_new_tokens, request.eos_token_id,
                                     sampling=request.sampling,
                                     stop_token_sequences=request.stop_token_sequences or None,
                                     speculate=request.speculate)
        seq_id = next(self._ids)
        self._active[seq_id] = stream
        return seq_id

    def cancel(self, seq_id: int) -> None:
        """Drop a sequence now (unknown or finished ids are ignored)."""
        self._active.pop(seq_id, None)

    def step(self) -> list[SequenceUpdate]:
        """One decode step for every active sequence."""
        updates = []
        for seq_id, stream in list(self._active.items()):
            try:
                updates.append(SequenceUpdate(seq_id, next(stream)))
            except StopIteration:
                del self._active[seq_id]
                updates.append(SequenceUpdate(seq_id, [], finished=True, result=stream.result))
        return updates
