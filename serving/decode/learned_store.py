"""The replies a server finishes, learned as it serves (SuffixDecoding's global output store).

Every reply that ends (finish reason stop or length, not an error) joins, marked by the tail of
its prompt (the last `mark_tokens` prompt tokens, as `specheads data store` marks the replies of
a built store), so the next request whose context ends like that prompt drafts the reply's
opening. Requests that repeat (agent loops, retried tools, the same question asked again) then
draft whole replies.

Memory is bounded: at most `capacity` tokens (each costs 12 bytes: its id and its suffix-array
entry). The replies live in segments, each a SuffixIndex (heads/artefacts/suffix_search.py)
searched as one body with the built store. A new reply is a segment of its own (indexed at
once: a few ms); the newest segments merge while the one before is at most twice as large, so
there are O(log) of them and each token is re-indexed O(log) times. No segment grows past a
quarter of the capacity; when the store is over capacity the oldest segment leaves first.

`segments()` is a snapshot (a tuple that later additions do not change) with its `version`, so
searches never see a segment half built; `add` holds a lock, so engines in several threads may
share one store.
"""

from __future__ import annotations

import threading

import numpy as np

from specheads.heads.artefacts.suffix_search import SEPARATOR, SuffixIndex, suffix_array


def index_of(tokens: np.ndarray) -> SuffixIndex:
    """The SuffixIndex of `tokens` ([N] uint32, sequences each ending with SEPARATOR)."""
    order = suffix_array(tokens)
    return SuffixIndex(tokens, order[tokens[order] != SEPARATOR].astype("<i8"))


class LearnedStore:
    """Replies learned as they finish (module doc)."""

    def __init__(self, capacity: int, mark_tokens: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"a learned store's capacity must be an int >= 1 (tokens), got {capacity!r}")
        if isinstance(mark_tokens, bool) or not isinstance(mark_tokens, int) or mark_tokens < 0:
            raise ValueError(f"mark_tokens must be an int >= 0, got {mark_tokens!r}")
        self.capacity = capacity
        self.mark_tokens = mark_tokens
        self.max_segment = max(1, capacity // 4)
        self._segments: tuple[SuffixIndex, ...] = ()
        self.version = 0
        self.num_replies = 0
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        return sum(segment.num_tokens for segment in self._segments)

    def segments(self) -> tuple[tuple[SuffixIndex, ...], int]:
        """(the segments now, oldest first; their version)."""
        return self._segments, self.version

    def add(self, prompt: list[int], reply: list[int]) -> None:
        """Learn `reply` (token ids), marked by the tail of `prompt`. A reply longer than the
        capacity keeps its last tokens that fit."""
        if not reply:
            return
        mark = prompt[len(prompt) - self.mark_tokens:] if self.mark_tokens else []
        sequence = (mark + list(reply))[-(self.capacity - 1):] if self.capacity > 1 else []
        if not sequence:
            return
        if max(sequence) >= SEPARATOR or min(sequence) < 0:
            raise ValueError(f"a learned reply holds a token id outside [0, {SEPARATOR}): {max(sequence)}")
        tokens = np.array(sequence + [SEPARATOR], dtype="<u4")
        with self._lock:
            segments = list(self._segments) + [index_of(tokens)]
            while len(segments) > 1 and segments[-2].num_tokens <= 2 * segments[-1].num_tokens \
                    and segments[-2].num_tokens + segments[-1].num_tokens <= self.max_segment:
                merged = np.concatenate([segments[-2].tokens, segments[-1].tokens])
                segments[-2:] = [index_of(merged)]
            while sum(segment.num_tokens for segment in segments) > self.capacity:
                segments.pop(0)
            self._segments = tuple(segments)
            self.version += 1
            self.num_replies += 1

    def clear(self) -> None:
        """Forget every learned reply."""
        with self._lock:
            self._segments = ()
            self.version += 1
            self.num_replies = 0
