"""N-gram lookup drafts from the sequence's own context, alone or as one more tree branch.

Prompt-lookup decoding (vLLM's `ngram` method, HF `prompt_lookup_num_tokens`) drafts the
tokens that followed the last occurrence of the context's final n-gram. It costs no model
forward, so it wins wherever text repeats (code, retrieval, summaries quoting their source,
and the loops of small models' greedy outputs), and it drafts nothing elsewhere. Heads are
the other way round. The engine combines them per step (`LookupConfig`):

- a match of at least `alone_at_ngram` tokens: the step verifies the lookup chain alone and
  skips the heads' draft (on a CPU an EAGLE draft costs about a target step);
- a shorter match: the heads' tree plus the lookup chain as one more branch under the root;
- no match: the heads' tree alone (or, without heads, a plain step).
Verification and acceptance are unchanged, so greedy output is still the target's own.
Sampled requests use it too: a lookup token is a candidate fixed in advance (a point-mass
draft), exactly like the heads' top-k candidates, so the tree's recursive rejection
sampling (serving/decode/sampling.py) keeps the target's distribution; the chain is the root's
last child, tried after the heads' candidates. The proposal depends only on the tokens, so
a seed still gives the same output.

`NgramIndex` keeps, per n-gram (n <= max_ngram) of the context, where its most recent
continuation starts, updated as tokens arrive (O(max_ngram) per token). A proposal copies
from there; when the copy reaches the end of the context it goes on copying its own output,
so a loop of period p is drafted for as long as asked (the match just before the suffix is
exactly p back).

Chain sources. The engine asks every source of chains the same way (`ChainSource`): n-gram
lookup (`NgramLookup`, here) and the store of the target's own replies (serving/decode/store.py).
A source starts a state per sequence from its prompt, and one call per step drafts a chain
for every sequence that asks; `DraftBatch.with_chains` (serving/decode/draft_batch.py) adds
each chain as one more branch under the row's root, in the decoder's source order (lookup,
then store), after the heads' candidates.

Shape legend: T tree nodes of the heads' draft, L lookup tokens, D max depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class LookupConfig:
    """num_tokens: the longest chain drafted; n-grams of max_ngram down to min_ngram tokens are
    looked up (longest first); alone_at_ngram: a match at least this long skips the heads'
    draft for the step ("max": max_ngram; None: heads always draft too)."""

    num_tokens: int = 10
    max_ngram: int = 3
    min_ngram: int = 1
    alone_at_ngram: int | str | None = "max"

    def __post_init__(self):
        for name in ("num_tokens", "max_ngram", "min_ngram"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"lookup {name} must be an int >= 1, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"lookup min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")
        if self.alone_at_ngram == "max":
            object.__setattr__(self, "alone_at_ngram", self.max_ngram)
        alone = self.alone_at_ngram
        if alone is not None and (isinstance(alone, bool) or not isinstance(alone, int)
                                  or not self.min_ngram <= alone <= self.max_ngram):
            raise ValueError(f"lookup alone_at_ngram must be 'max', None or an int in [min_ngram, max_ngram] = "
                             f"[{self.min_ngram}, {self.max_ngram}], got {alone!r}")


class ChainSource(Protocol):
    """A drafter of one chain of target ids per sequence, from the tokens alone (no forward).
    `name` names its DecodeStats counters (serving/decode/stats.py CHAIN_SOURCES); num_tokens
    is its longest chain (it sizes the cache and the sampled accept's uniforms)."""

    name: str
    num_tokens: int

    def start(self, prompt: list[int]) -> object:
        """A new sequence's state, from its prompt's token ids."""

    def draft(self, states: list, outputs: list[list[int]]) -> list[tuple[list[int], bool]]:
        """One call per step for every sequence that asks: given each one's state and output
        so far -> each one's chain ([] for none) and whether it goes alone (the heads' draft is
        skipped for that sequence this step)."""


class NgramLookup:
    """n-gram lookup as a chain source: one `NgramIndex` per sequence."""

    name = "lookup"

    def __init__(self, config: LookupConfig):
        self.config = config
        self.num_tokens = config.num_tokens

    def start(self, prompt: list[int]) -> "NgramIndex":
        return NgramIndex(self.config, prompt)

    def draft(self, states: list["NgramIndex"], outputs: list[list[int]]) -> list[tuple[list[int], bool]]:
        return [index.draft(output) for index, output in zip(states, outputs)]


class NgramIndex:
    """One sequence's context (prompt + output so far) and its n-gram continuation index."""

    def __init__(self, config: LookupConfig, tokens: list[int] | None = None):
        self.config = config
        self.num_prompt_tokens = len(tokens or [])
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest continuation
        self.extend(tokens or [])

    def extend(self, new_tokens: list[int]) -> None:
        tokens, index, max_n = self.tokens, self._next, self.config.max_ngram
        for token in new_tokens:
            end = len(tokens)  # the n-grams ending here are now followed by `token`
            for n in range(1, min(max_n, end) + 1):
                index[tuple(tokens[end - n:end])] = end
            tokens.append(int(token))

    def draft(self, output: list[int]) -> tuple[list[int], bool]:
        """Index the output tokens not seen yet (output = the tokens after the prompt it was
        built from), then -> (the chain, up to num_tokens tokens; whether it goes alone: its
        match is at least alone_at_ngram tokens long, so the heads' draft is skipped)."""
        self.extend(output[len(self.tokens) - self.num_prompt_tokens:])
        chain, matched = self.propose()
        alone_at = self.config.alone_at_ngram
        return chain, bool(chain) and alone_at is not None and matched >= alone_at

    def propose(self) -> tuple[list[int], int]:
        """-> (up to num_tokens drafted tokens, the matched n-gram's length); ([], 0) if none."""
        tokens, config = self.tokens, self.config
        for n in range(min(config.max_ngram, len(tokens)), config.min_ngram - 1, -1):
            start = self._next.get(tuple(tokens[-n:]))
            if start is None:
                continue
            context_len = len(tokens)
            draft: list[int] = []
            for offset in range(config.num_tokens):
                position = start + offset
                draft.append(tokens[position] if position < context_len else draft[position - context_len])
            return draft, n
        return [], 0
