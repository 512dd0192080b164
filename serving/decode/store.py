"""The target's own replies as a source of draft chains (SuffixDecoding, REST).

Three bodies of text are searched (heads/artefacts/suffix_search.py: frequency-scored chains,
a probability cut-off, a draft length that follows the match length, several match lengths
scored, the best proposed):
- a built reply store (heads/artefacts/reply_store.py, `specheads data store` from the replies
  `specheads data regenerate` wrote), memory-mapped: what the target said to the training prompts;
- the replies this process finishes, learned as it serves (serving/decode/learned_store.py,
  bounded, oldest out first; `learn_tokens`), searched together with the built store;
- each request's own prompt (`prompt`), a group of its own: a reply quotes its prompt.
Every stored reply is marked by the tail of its prompt, so a reply's opening is drafted too.
Chat replies repeat across prompts (openings, list markers, code idioms, closing formulas) and
served workloads repeat whole requests, where neither the heads (one step ahead) nor n-gram
lookup (this context alone) have the continuation.

`StoreDrafter` is a chain drafter (serving/decode/draft_batch.py `Drafter`). The search runs on
the host, in native code (a few us a sequence), before each step (`prepare`); the rows' chains
go to the device in one copy, the step's one declared upload (from pinned memory and without
waiting, where the device is a GPU; a CPU target reads them where they are). Inside the step
(`draft`) the chain joins the heads' tree (`DraftBatch.join`). Verification and acceptance are
unchanged: a store token is a candidate fixed in advance, so greedy output stays the target's
own and sampled output keeps the target's distribution (serving/decode/accept.py).
With learning off the proposal is a function of the store and the tokens, so a seed gives the
same output; with it on, what a request drafts depends on what finished before it (its output,
greedy or sampled with a seed, does not: drafts never change the output).

A built store is memory-mapped read-only: one opened store serves every engine and sequence of
a process, and every process that opens it (the server's workers) shares the page cache.
`open_store` refuses a corrupt store, or one built for another target or tokenizer, with one line.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

import torch

from specheads.heads.artefacts.reply_store import MARK_TOKENS, ReplyStore, tokenizer_fingerprint
from specheads.heads.artefacts.suffix_search import Proposal, SearchSettings, Searcher, SuffixIndex
from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.learned_store import LearnedStore

LEARN_TOKENS = 1 << 20  # the default bound of the learned replies: 12 MiB


@dataclass(frozen=True)
class StoreConfig(SearchSettings):
    """The search's settings (heads/artefacts/suffix_search.py SearchSettings: num_tokens,
    max_match, min_match, max_occurrences, min_probability, tokens_per_match, max_candidates),
    then the drafter's. alone_at_match: a match at least this long skips the heads' draft for
    the step (None: the heads always draft too); alone_at_score: so does a chain that expects at
    least this many accepted tokens (its score; None: off); prompt: search each request's prompt
    too; learn_tokens: the bound of the replies learned as they finish (0: none); mark_tokens:
    the prompt tokens that mark a learned reply's start."""

    alone_at_match: int | None = None
    alone_at_score: float | None = None
    prompt: bool = True
    learn_tokens: int = LEARN_TOKENS
    mark_tokens: int = MARK_TOKENS

    def __post_init__(self):
        for name in ("num_tokens", "max_match", "min_match", "max_occurrences", "max_candidates"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"store {name} must be an int >= 1, got {value!r}")
        for name in ("learn_tokens", "mark_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"store {name} must be an int >= 0, got {value!r}")
        if self.min_match > self.max_match:
            raise ValueError(f"store min_match ({self.min_match}) must be <= max_match ({self.max_match})")
        for name, low, high in (("min_probability", 0.0, 1.0), ("tokens_per_match", 0.0, math.inf)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high \
                    or (name == "tokens_per_match" and value == 0):
                raise ValueError(f"store {name} must be a number in {'[0, 1]' if high == 1.0 else '(0, inf)'}, "
                                 f"got {value!r}")
        if not isinstance(self.prompt, bool):
            raise ValueError(f"store prompt must be true or false, got {self.prompt!r}")
        score = self.alone_at_score
        if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float)) or score <= 0):
            raise ValueError(f"store alone_at_score must be None or a number > 0, got {score!r}")
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
    """The store's chains as a chain drafter (module doc). store: a built store, or None to
    draft from learned replies (and prompts) alone; learned: the learned replies to share (None:
    a new, empty store when config.learn_tokens > 0). Every engine's copy (`attach`) shares the
    built store and the learned replies; each keeps its requests' prompt indexes."""

    name = "store"
    num_notes = 0
    lookahead = 0
    max_children = 1

    def __init__(self, store: ReplyStore | None, config: StoreConfig = StoreConfig(),
                 learned: LearnedStore | None = None):
        if store is not None and not isinstance(store, ReplyStore):
            raise ValueError(f"store must be None or an opened heads.reply_store.ReplyStore, got {store!r}")
        if not isinstance(config, StoreConfig):
            raise ValueError(f"store config must be a serving.decode.store.StoreConfig, got {config!r}")
        if store is None and not config.learn_tokens:
            raise ValueError("a store drafter needs a built store or learn_tokens > 0 (replies learned as they finish)")
        self.store = store
        self.config = config
        if learned is None and config.learn_tokens:
            learned = LearnedStore(config.learn_tokens, config.mark_tokens)
        self.learned = learned
        self.num_tokens = self.max_depth = config.num_tokens
        self.num_nodes = config.num_tokens + 1
        self.step_tokens = 0  # the longest chain of this step (`prepare`)
        self.device = torch.device("cpu")
        self.table_nX: torch.Tensor | None = None  # [n, L + 2] this step's chains, their lengths, alone
        self._requests: dict[int, _Request] = {}  # seq_id -> its prompt's index and its searcher

    def fresh(self) -> "StoreDrafter":
        """The same store and settings with nothing learned yet (a benchmark's next method)."""
        return StoreDrafter(self.store, self.config)

    def forget(self) -> None:
        """Forget the learned replies (a benchmark's warm-up must not draft its prompts)."""
        if self.learned is not None:
            self.learned.clear()

    def attach(self, cache, max_cache_len: int) -> "StoreDrafter":
        attached = StoreDrafter(self.store, self.config, self.learned)
        attached.device = cache.lengths.device_lens.device
        return attached

    def start(self, row: int, prefilled) -> None:
        return None

    def finish(self, seq) -> None:
        """seq finished: its reply joins the learned replies (marked by its prompt's tail)."""
        self._requests.pop(seq.seq_id, None)
        if self.learned is not None:
            self.learned.add(seq.prompt, seq.tokens)

    def propose(self, seq) -> Proposal:
        """seq's chain: its context's best continuation in the store, the learned replies and
        its prompt (heads/artefacts/suffix_search.py)."""
        width = self.config.max_match
        return self._searcher(seq).propose((seq.prompt[-width:] + seq.tokens[-width:])[-width:])

    def _searcher(self, seq) -> Searcher:
        segments, version = self.learned.segments() if self.learned is not None else ((), 0)
        request = self._requests.get(seq.seq_id)
        if request is None or request.seq is not seq:
            prompt = [SuffixIndex.build([seq.prompt])] if self.config.prompt else []
            request = self._requests[seq.seq_id] = _Request(seq, prompt)
        if request.version != version:
            built = [self.store.index] if self.store is not None else []
            request.searcher = Searcher([built + list(segments), request.prompt], self.config)
            request.version = version
        return request.searcher

    def prepare(self, seqs: list, drafting: list[bool]) -> list[int]:
        """Search for every drafting sequence, and send the chains to the device."""
        alone_at, alone_score = self.config.alone_at_match, self.config.alone_at_score
        proposals = [self.propose(seq) if draws else None for seq, draws in zip(seqs, drafting)]
        if len(self._requests) > 2 * len(seqs) + 16:  # requests that left without finishing
            live = {id(seq) for seq in seqs}
            self._requests = {key: one for key, one in self._requests.items() if id(one.seq) in live}
        chains = [([], False) if one is None else
                  (one.tokens, bool(one.tokens) and ((alone_at is not None and one.match >= alone_at)
                                                     or (alone_score is not None and one.score >= alone_score)))
                  for one in proposals]
        table = torch.tensor([chain + [0] * (self.num_tokens - len(chain)) + [len(chain), alone]
                              for chain, alone in chains], dtype=torch.long,
                             pin_memory=self.device.type == "cuda")  # [n, L + 2]
        self.table_nX = table.to(self.device, non_blocking=True)  # the step's one declared upload
        self.step_tokens = max(len(chain) for chain, _ in chains) if chains else 0
        return [0 if not chain else 2 if alone else 1 for chain, alone in chains]

    def draft(self, rows: slice, roots_n: torch.Tensor, lens_n: torch.Tensor, key_bound: int,
              num_tokens: int) -> DraftBatch:
        table_nX = self.table_nX[rows]  # the batch is the engine's rows [0, n)
        length = self.num_tokens
        valid_nL = torch.arange(num_tokens, device=table_nX.device) < table_nX[:, length:length + 1]
        return DraftBatch.chain(roots_n, table_nX[:, :num_tokens], valid_nL, table_nX[:, length + 1] > 0)

    def observe(self, rows: slice, taps_nTX: torch.Tensor, path_nW: torch.Tensor, num_nodes_n: torch.Tensor,
                emitted_nW: torch.Tensor, lens_n: torch.Tensor, key_bound: int) -> None:
        return None


class _Request:
    """One request's part of the search: its prompt's index and its searcher (rebuilt when the
    learned replies change)."""

    def __init__(self, seq, prompt: list[SuffixIndex]):
        self.seq = seq
        self.prompt = prompt
        self.searcher: Searcher | None = None
        self.version = -1


def open_store(directory: str | os.PathLike, target_identity, tokenizer=None) -> ReplyStore:
    """The store in `directory`, checked against the target (heads/target/adapter.py TargetIdentity)
    and, given one, its tokenizer (StoreError, one line, when it was built for others)."""
    store = ReplyStore(directory)
    store.check_fits(target_identity, tokenizer_fingerprint(tokenizer) if tokenizer is not None else None)
    return store
