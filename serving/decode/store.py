"""The store of the target's own replies as a source of draft chains (SuffixDecoding, REST).

A reply store (heads/artefacts/reply_store.py: the format, the suffix search; built by `specheads data
store` from the replies `specheads data regenerate` wrote) holds what the target said to the
training prompts. Chat replies repeat themselves across prompts (openings, list markers,
code idioms, closing formulas), so the continuation that most often followed the context's
longest matching suffix in the store is often what the target says next, where neither the
heads (which see one step ahead) nor n-gram lookup (which sees only this context) have it.

`StoreDrafter` is a chain source (serving/decode/lookup.py `ChainSource`): per sequence it
keeps its prompt's last `max_match` tokens; one call per step proposes a chain for every
sequence that asks, each from its last max_match tokens (`ReplyStore.propose`; rows with the
same context share one search). The chain is one more branch under the root, after the heads'
candidates and the lookup chain. Verification and acceptance are unchanged: a store token is a
candidate fixed in advance, so greedy output stays the target's own and sampled output keeps the
target's distribution (serving/decode/accept.py); the proposal is a function of the store and
the tokens, so a seed still gives the same output.

The store is memory-mapped read-only: one opened store serves every engine and sequence of a
process, and every process that opens it (the server's workers) shares the page cache.
`open_store` refuses a corrupt store, or one built for another target or tokenizer, with one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from specheads.heads.artefacts.reply_store import ReplyStore, tokenizer_fingerprint


@dataclass(frozen=True)
class StoreConfig:
    """num_tokens: the longest chain drafted; max_match: the context's last tokens matched
    (M); min_match: a shorter match proposes nothing; max_occurrences: occurrences whose next
    token is read per chain token (bounds a step's work); alone_at_match: a match at least
    this long skips the heads' draft for the step (None: the heads always draft too)."""

    num_tokens: int = 10
    max_match: int = 16
    min_match: int = 2
    max_occurrences: int = 64
    alone_at_match: int | None = None

    def __post_init__(self):
        for name in ("num_tokens", "max_match", "min_match", "max_occurrences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"store {name} must be an int >= 1, got {value!r}")
        if self.min_match > self.max_match:
            raise ValueError(f"store min_match ({self.min_match}) must be <= max_match ({self.max_match})")
        alone = self.alone_at_match
        if alone is not None and (isinstance(alone, bool) or not isinstance(alone, int)
                                  or not self.min_match <= alone <= self.max_match):
            raise ValueError(f"store alone_at_match must be None or an int in [min_match, max_match] = "
                             f"[{self.min_match}, {self.max_match}], got {alone!r}")

    @classmethod
    def from_dict(cls, raw: dict, source: str = "store") -> "StoreConfig":
        allowed = [f.name for f in fields(cls)]
        if not isinstance(raw, dict) or set(raw) - set(allowed):
            raise ValueError(f"{source} must be an object with keys from {allowed}, got {raw!r}")
        return cls(**raw)


class StoreDrafter:
    """A reply store as a chain source (module doc)."""

    name = "store"

    def __init__(self, store: ReplyStore, config: StoreConfig = StoreConfig()):
        if not isinstance(store, ReplyStore):
            raise ValueError(f"store must be an opened heads.reply_store.ReplyStore, got {store!r}")
        if not isinstance(config, StoreConfig):
            raise ValueError(f"store config must be a serving.decode.store.StoreConfig, got {config!r}")
        self.store = store
        self.config = config
        self.num_tokens = config.num_tokens

    def start(self, prompt: list[int]) -> list[int]:
        """A sequence's state: its prompt's last max_match tokens."""
        return list(prompt[-self.config.max_match:])

    def draft(self, states: list[list[int]], outputs: list[list[int]]) -> list[tuple[list[int], bool]]:
        config, found = self.config, {}
        chains = []
        for prompt_tail, output in zip(states, outputs):
            context = tuple((prompt_tail + output[-config.max_match:])[-config.max_match:])
            if context not in found:
                found[context] = self.store.propose(context, config.num_tokens, config.max_match, config.min_match,
                                                    config.max_occurrences)
            chain, matched = found[context]
            alone = bool(chain) and config.alone_at_match is not None and matched >= config.alone_at_match
            chains.append((list(chain), alone))
        return chains


def open_store(directory: str | os.PathLike, target_identity, tokenizer=None) -> ReplyStore:
    """The store in `directory`, checked against the target (heads/target/adapter.py TargetIdentity)
    and, given one, its tokenizer (StoreError, one line, when it was built for others)."""
    store = ReplyStore(directory)
    store.check_fits(target_identity, tokenizer_fingerprint(tokenizer) if tokenizer is not None else None)
    return store
