"""The store of the target's own replies as a source of draft chains (SuffixDecoding, REST).

A reply store (heads/artefacts/reply_store.py: the format, the suffix search; built by `specheads data
store` from the replies `specheads data regenerate` wrote) holds what the target said to the
training prompts. Chat replies repeat themselves across prompts (openings, list markers,
code idioms, closing formulas), so the continuation that most often followed the context's
longest matching suffix in the store is often what the target says next, where neither the
heads (which see one step ahead) nor n-gram lookup (which sees only this context) have it.

`StoreDrafter` is a chain drafter (serving/decode/draft_batch.py `Drafter`). The store is
searched on the host, where it is mapped: before each step (`prepare`) every drafting
sequence's last max_match tokens propose a chain (`ReplyStore.propose`; rows with the same
context share one search), and the rows' chains go to the device in one copy, the step's one
declared upload (from pinned memory and without waiting, where the device is a GPU; a CPU
target reads them where they are). Inside the step (`draft`) the chain is one more branch
under the root, after the heads' candidates and the lookup chain. Verification and acceptance are unchanged: a store token is a
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

import torch

from specheads.heads.artefacts.reply_store import ReplyStore, tokenizer_fingerprint
from specheads.serving.decode.draft_batch import DraftBatch


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
    """A reply store as a chain drafter (module doc)."""

    name = "store"
    num_notes = 0
    lookahead = 0
    max_children = 1

    def __init__(self, store: ReplyStore, config: StoreConfig = StoreConfig()):
        if not isinstance(store, ReplyStore):
            raise ValueError(f"store must be an opened heads.reply_store.ReplyStore, got {store!r}")
        if not isinstance(config, StoreConfig):
            raise ValueError(f"store config must be a serving.decode.store.StoreConfig, got {config!r}")
        self.store = store
        self.config = config
        self.num_tokens = self.max_depth = config.num_tokens
        self.num_nodes = config.num_tokens + 1
        self.device = torch.device("cpu")
        self.table_nX: torch.Tensor | None = None  # [n, L + 2] this step's chains, their lengths, alone

    def attach(self, cache, max_cache_len: int) -> "StoreDrafter":
        attached = StoreDrafter(self.store, self.config)
        attached.device = cache.lengths.device_lens.device
        return attached

    def start(self, row: int, prefilled) -> None:
        return None

    def chains(self, contexts: list[list[int] | None]) -> list[tuple[list[int], bool]]:
        """Each context's chain (None: no proposal) and whether it goes alone."""
        config, found, chains = self.config, {}, []
        for context in contexts:
            if context is None:
                chains.append(([], False))
                continue
            key = tuple(context[-config.max_match:])
            if key not in found:
                found[key] = self.store.propose(key, config.num_tokens, config.max_match, config.min_match,
                                                config.max_occurrences)
            chain, matched = found[key]
            chains.append((list(chain), bool(chain) and config.alone_at_match is not None
                           and matched >= config.alone_at_match))
        return chains

    def prepare(self, seqs: list, drafting: list[bool]) -> list[int]:
        """Search the store for every drafting sequence, and send the chains to the device."""
        width = self.config.max_match
        chains = self.chains([(seq.prompt[-width:] + seq.tokens[-width:]) if draws else None
                              for seq, draws in zip(seqs, drafting)])
        table = torch.tensor([chain + [0] * (self.num_tokens - len(chain)) + [len(chain), alone]
                              for chain, alone in chains], dtype=torch.long,
                             pin_memory=self.device.type == "cuda")  # [n, L + 2]
        self.table_nX = table.to(self.device, non_blocking=True)  # the step's one declared upload
        return [0 if not chain else 2 if alone else 1 for chain, alone in chains]

    def draft(self, rows: slice, roots_n: torch.Tensor, lens_n: torch.Tensor, key_bound: int) -> DraftBatch:
        table_nX = self.table_nX[rows]  # the batch is the engine's rows [0, n)
        length = self.num_tokens
        valid_nL = torch.arange(length, device=table_nX.device) < table_nX[:, length:length + 1]
        return DraftBatch.chain(roots_n, table_nX[:, :length], valid_nL, table_nX[:, length + 1] > 0)

    def observe(self, rows: slice, taps_nTX: torch.Tensor, path_nW: torch.Tensor, num_nodes_n: torch.Tensor,
                emitted_nW: torch.Tensor, lens_n: torch.Tensor, key_bound: int) -> None:
        return None


def open_store(directory: str | os.PathLike, target_identity, tokenizer=None) -> ReplyStore:
    """The store in `directory`, checked against the target (heads/target/adapter.py TargetIdentity)
    and, given one, its tokenizer (StoreError, one line, when it was built for others)."""
    store = ReplyStore(directory)
    store.check_fits(target_identity, tokenizer_fingerprint(tokenizer) if tokenizer is not None else None)
    return store
