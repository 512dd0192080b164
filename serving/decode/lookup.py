"""N-gram lookup drafts from the sequence's own context, alone or merged into the heads' tree.

Prompt-lookup decoding (vLLM's `ngram` method, HF `prompt_lookup_num_tokens`) drafts the
tokens that followed the last occurrence of the context's final n-gram. It costs no model
forward, so it wins wherever text repeats (code, retrieval, summaries quoting their source,
and the loops of small models' greedy outputs), and it drafts nothing elsewhere. Heads are
the other way round. The engine combines them per step (`LookupConfig`):

- a match of at least `alone_at_ngram` tokens: the step verifies the lookup chain alone and
  skips the heads' draft (on a CPU an EAGLE draft costs about a target step);
- a shorter match: the heads' tree with the lookup chain merged into it (serving/decode/draft_batch.py
  `DraftBatch.join`: where the chain begins with the heads' candidates it shares their nodes);
- no match: the heads' tree alone (or, without heads, a plain step).
Verification and acceptance are unchanged, so greedy output is still the target's own.
Sampled requests use it too: a lookup token is a candidate fixed in advance (a point-mass
draft), exactly like the heads' top-k candidates, so the tree's recursive rejection
sampling (serving/decode/sampling.py) keeps the target's distribution; where the chain leaves
the heads' tree its node is the last child, tried after the heads' candidates. The proposal depends only on the tokens, so
a seed still gives the same output.

The lookup runs on the target's device, inside the decode step (serving/decode/draft_batch.py
`Drafter`): each row's context (prompt, then every emitted token) is a device tensor
(`history_BM`), extended by `observe` with the tokens a step accepted; the same `observe`
matches the new context's last n-grams against the whole history (`propose_chains`:
tensor comparisons, no host data) and keeps the next step's chain. The match length goes to
the host with the step's tokens, so the host knows before the next step which rows have a
chain and which go alone without asking the device again. A proposal copies the tokens that
followed the latest occurrence of the longest matching n-gram (max_ngram down to min_ngram);
when the copy reaches the end of the context it goes on copying its own output, so a loop of
period p is drafted for as long as asked (the match just before the suffix is exactly p back).

Shape legend: n rows, B engine rows, M history positions, L chain tokens, T tree nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.serving.decode.draft_batch import DraftBatch


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


def propose_chains(history_nM: torch.Tensor, context_n: torch.Tensor, config: LookupConfig,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's lookup chain from its context history_nM[:context_n] -> (chain [n, L] long,
    matched [n] long: the matched n-gram's length, 0 for none; the chain is then garbage).
    A continuation start j (< context_n) matches k tokens when the k tokens before it equal
    the context's last k; the longest match wins (capped at max_ngram, at least min_ngram),
    the latest start on a tie. One comparison of every window of max_ngram tokens with the
    context's last ones (a padded history's `unfold`, no copy) finds every start's match."""
    num_rows, width = history_nM.shape
    device, max_ngram = history_nM.device, config.max_ngram
    back_k = torch.arange(max_ngram, device=device)  # the (k+1)-th last token of the context
    # windows[j] = the max_ngram tokens before start j (-1 before the history, which no token equals)
    windows_nJK = torch.nn.functional.pad(history_nM, (max_ngram, 0), value=-1).unfold(1, max_ngram, 1)
    last_nK = history_nM.gather(1, (context_n[:, None] - 1 - back_k).clamp(min=0))
    last_nK = torch.where(back_k < context_n[:, None], last_nK, -2)  # a context shorter than max_ngram
    same_nJK = windows_nJK.flip(-1) == last_nK[:, None, :]  # [n, M+1, K]: k tokens back from each start
    length_nJ = same_nJK.cumprod(-1).sum(-1)  # the run of matches from the nearest token back
    start_J = torch.arange(width + 1, device=device)
    usable_nJ = (start_J < context_n[:, None]) & (length_nJ >= config.min_ngram)
    best_n = torch.where(usable_nJ, length_nJ * (width + 1) + start_J, -1).argmax(-1)
    matched_n = (length_nJ * usable_nJ).gather(1, best_n[:, None])[:, 0]
    period_n1 = (context_n - best_n).clamp(min=1)[:, None]
    chain_nL = history_nM.gather(1, (best_n[:, None] + torch.arange(config.num_tokens, device=device) % period_n1)
                                 .clamp(max=width - 1))
    return chain_nL, matched_n


class NgramLookup:
    """n-gram lookup as a chain drafter (module doc), its state one context row per engine row."""

    name = "lookup"
    num_notes = 1  # the next chain's matched length
    lookahead = 0
    max_children = 1

    def __init__(self, config: LookupConfig):
        self.config = config
        self.num_tokens = self.max_depth = config.num_tokens
        self.num_nodes = config.num_tokens + 1
        self.step_tokens = config.num_tokens  # a matched chain is always whole (it repeats its period)
        self.history_BM: torch.Tensor | None = None  # [B, M] each row's context (prompt + output)
        self.chain_BL: torch.Tensor | None = None  # [B, L] the next step's chain
        self.matched_B: torch.Tensor | None = None  # [B] its matched n-gram's length (0: no chain)

    def attach(self, cache, max_cache_len: int) -> "NgramLookup":
        device, rows = cache.lengths.device_lens.device, cache.capacity
        attached = NgramLookup(self.config)
        attached.history_BM = torch.zeros(rows, max_cache_len + 1, dtype=torch.long, device=device)
        attached.chain_BL = torch.zeros(rows, self.num_tokens, dtype=torch.long, device=device)
        attached.matched_B = torch.zeros(rows, dtype=torch.long, device=device)
        for state in (attached.history_BM, attached.chain_BL, attached.matched_B):
            cache.follow(state, 0)
        return attached

    def start(self, row: int, prefilled) -> torch.Tensor:
        length = int(prefilled.prompt_P.shape[0])
        self.history_BM[row, :length] = prefilled.prompt_P
        self.history_BM[row, length:length + 1] = prefilled.root
        context = torch.full((1,), length + 1, dtype=torch.long, device=self.history_BM.device)
        chain, matched = propose_chains(self.history_BM[row:row + 1, :length + 1], context, self.config)
        self.chain_BL[row], self.matched_B[row] = chain[0], matched[0]
        return matched

    def prepare(self, seqs: list, drafting: list[bool]) -> list[int]:
        alone_at = self.config.alone_at_ngram
        codes = []
        for seq, draws in zip(seqs, drafting):
            matched = seq.notes[self.name][0]
            codes.append(0 if not draws or matched == 0 else 2 if alone_at is not None and matched >= alone_at else 1)
        return codes

    def draft(self, rows: slice, roots_n: torch.Tensor, lens_n: torch.Tensor, key_bound: int,
              num_tokens: int) -> DraftBatch:
        matched_n = self.matched_B[rows]
        alone_at = self.config.alone_at_ngram
        return DraftBatch.chain(roots_n, self.chain_BL[rows, :num_tokens],
                                (matched_n > 0)[:, None].expand(-1, num_tokens),
                                None if alone_at is None else matched_n >= alone_at)

    def finish(self, seq) -> None:
        return None

    def observe(self, rows: slice, taps_nTX: torch.Tensor, path_nW: torch.Tensor, num_nodes_n: torch.Tensor,
                emitted_nW: torch.Tensor, lens_n: torch.Tensor, key_bound: int) -> torch.Tensor:
        """Append the emitted tokens to each row's context (past its count: dead data), then
        look the next chain up -> its matched length [n, 1] for the host."""
        history_nM = self.history_BM[rows, :key_bound + 1]
        width = int(emitted_nW.shape[1])
        history_nM.scatter_(1, lens_n[:, None] + 1 + torch.arange(width, device=lens_n.device), emitted_nW)
        chain_nL, matched_n = propose_chains(history_nM, lens_n + num_nodes_n + 1, self.config)
        self.chain_BL[rows], self.matched_B[rows] = chain_nL, matched_n
        return matched_n[:, None]
