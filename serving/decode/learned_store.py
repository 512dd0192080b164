"""The replies a server finishes, learned as it serves (SuffixDecoding's global output store).

Every reply that ends (finish reason stop or length, not an error) joins, marked by the tail of
its prompt (the last `mark_tokens` prompt tokens, as `specheads data store` marks the replies of
a built store), so the next request whose context ends like that prompt drafts the reply's
opening. Requests that repeat (agent loops, retried tools, the same question asked again) then
draft whole replies.

Memory is bounded: at most `capacity` tokens (each costs 12 bytes: its id and its suffix-array
entry). The replies live in segments, each a SuffixIndex (heads/artefacts/suffix_search.py)
searched as one body with the built store. A new reply is a segment of its own (indexed at
once, in about a millisecond); adjacent segments merge, newest first, while the older one is at
most twice as large, so there are O(log) of them and each token is re-indexed O(log) times. A
merge of large segments takes a few hundred ms, so merges run on a background thread and are
published when done: no step waits for one (unless replies arrive so fast that the segments
pass MAX_SEGMENTS: `add` then merges the newest, small ones itself). No segment grows past a quarter of the capacity;
when the store is over capacity the oldest segment leaves first.

`segments()` is a snapshot (a tuple that later additions do not change) with its `version`, so
searches never see a segment half built; changes hold a lock, so engines in several threads may
share one store.
"""

from __future__ import annotations

import threading

import numpy as np

from specheads.heads.artefacts.suffix_search import SEPARATOR, SuffixIndex


MAX_SEGMENTS = 32  # beyond this, `add` merges the newest small segments itself (the search reads every segment)


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
        self._merger: threading.Thread | None = None  # the thread running the merges that are due

    @property
    def num_tokens(self) -> int:
        return sum(segment.num_tokens for segment in self._segments)

    def segments(self) -> tuple[tuple[SuffixIndex, ...], int]:
        """(the segments now, oldest first; their version)."""
        return self._segments, self.version

    def add(self, prompt: list[int], reply: list[int]) -> None:
        """Learn `reply` (token ids), marked by the tail of `prompt`: searchable when this returns.
        A reply longer than the capacity keeps its last tokens that fit."""
        if not reply:
            return
        mark = prompt[len(prompt) - self.mark_tokens:] if self.mark_tokens else []
        sequence = (mark + list(reply))[-(self.capacity - 1):] if self.capacity > 1 else []
        if not sequence:
            return
        bad = [token for token in (min(sequence), max(sequence)) if not 0 <= token < SEPARATOR]
        if bad:
            raise ValueError(f"a learned reply holds a token id outside [0, {SEPARATOR}): {bad[0]}")
        segment = SuffixIndex.build([sequence])
        with self._lock:
            segments = list(self._segments) + [segment]
            while sum(one.num_tokens for one in segments) > self.capacity:
                segments.pop(0)
            self._publish(segments)
            self.num_replies += 1
            behind = len(segments) > MAX_SEGMENTS
            start = self._merger is None
            if start:
                self._merger = threading.Thread(target=self._merge, name="learned-store-merge", daemon=True)
        if start:
            self._merger.start()
        while behind:  # replies arrive faster than the thread merges: merge the newest small ones here
            with self._lock:
                pair = self._due()
                behind = pair is not None and len(self._segments) > MAX_SEGMENTS
            if behind:
                self._merge_pair(*pair)

    def flush(self) -> None:
        """Wait until the merges that are due have run."""
        with self._lock:
            merger = self._merger
        if merger is not None:
            merger.join()

    def clear(self) -> None:
        """Forget every learned reply."""
        self.flush()
        with self._lock:
            self._publish([])
            self.num_replies = 0

    def _publish(self, segments: list[SuffixIndex]) -> None:  # under the lock
        self._segments = tuple(segments)
        self.version += 1

    def _merge(self) -> None:
        """The merges that are due (module doc), one at a time, each indexed outside the lock
        (numpy's sort lets the engine run meanwhile) and published if its two segments are
        still there."""
        while True:
            with self._lock:
                pair = self._due()
                if pair is None:
                    self._merger = None
                    return
            self._merge_pair(*pair)

    def _merge_pair(self, older: SuffixIndex, newer: SuffixIndex) -> None:
        """Index two adjacent segments as one, outside the lock; publish it if they are still there."""
        merged = SuffixIndex.of_tokens(np.concatenate([older.tokens, newer.tokens]))
        with self._lock:
            segments = list(self._segments)
            at = next((i for i in range(len(segments) - 1) if segments[i] is older and segments[i + 1] is newer), None)
            if at is not None:
                segments[at:at + 2] = [merged]
                self._publish(segments)

    def _due(self) -> tuple[SuffixIndex, SuffixIndex] | None:  # under the lock
        """The newest adjacent pair whose older one is at most twice the newer one, together
        within max_segment."""
        segments = self._segments
        for i in range(len(segments) - 2, -1, -1):
            older, newer = segments[i], segments[i + 1]
            if older.num_tokens <= 2 * newer.num_tokens and older.num_tokens + newer.num_tokens <= self.max_segment:
                return older, newer
        return None
