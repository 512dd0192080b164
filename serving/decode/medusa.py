"""Medusa drafting: the heads turn the last committed hidden state into a static tree, with
AdaEDL's per-step depth cut.

The hidden state h at the last committed position p is the one the target's lm_head turned
into the root token (position p+1). Medusa head k reads the same h and predicts position
p+k+2, i.e. tree depth k+1. A node at depth d and rank r takes the r-th top candidate of
head d-1. Top-k runs once per step over all heads for the largest rank the tree uses; the
node tokens are one gather through index tensors precomputed per tree. Every sequence of a
batch is drafted in one head call.

Entropy cut (`entropy_threshold`, AdaEDL): per sequence and step, the depths from the first
head whose acceptance bound (serving/decode/sampling.py `acceptance_bound`) falls below the
threshold are dropped; depth 1 is always kept. The dropped nodes stay in the row as invalid
nodes (serving/decode/draft_batch.py), so the cut needs no device sync.

Shape legend: B batch, H hidden, K heads, T tree nodes, R ranks used (max rank + 1), V vocab,
D tree depth.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn

from specheads.heads.medusa import MedusaHeads
from specheads.serving.decode.sampling import acceptance_bound
from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.trees import DraftTree, TreePlan


def entropy_cut_depths(head_logits_KBV: torch.Tensor, threshold: float, min_depth: int = 1) -> torch.Tensor:
    """Per sequence, the first depth (> min_depth) whose head's acceptance bound < threshold.

    head_logits [K, B, V]: head k predicts depth k+1. -> [B] long: nodes at that depth and
    deeper are dropped this step; K+1 means no cut. Depths <= min_depth are always kept.
    Tensor ops only (no device sync)."""
    if head_logits_KBV.dim() != 3:
        raise ValueError(f"head_logits must be [K, B, V] (heads, sequences, vocab), got shape "
                         f"{tuple(head_logits_KBV.shape)}")
    num_heads, batch = int(head_logits_KBV.shape[0]), int(head_logits_KBV.shape[1])
    no_cut = torch.full((batch,), num_heads + 1, dtype=torch.long, device=head_logits_KBV.device)
    if min_depth >= num_heads:
        return no_cut
    low_KB = acceptance_bound(head_logits_KBV[min_depth:]) < threshold  # heads min_depth.. -> depths min_depth+1..
    return torch.where(low_KB.any(0), min_depth + 1 + low_KB.long().argmax(0), no_cut)


class MedusaDrafter:
    """Medusa heads as a serving/decode/draft_batch.py `Drafter`: its per-row state is the final
    hidden state at each row's last committed position."""

    name = "heads"
    num_notes = 0
    lookahead = 0

    def __init__(self, heads: nn.Module, tree: DraftTree, device: torch.device,
                 entropy_threshold: float | None = None):
        num_heads = getattr(heads, "num_heads", None)
        if num_heads is not None and tree.max_depth > num_heads:
            raise ValueError(f"the tree is {tree.max_depth} deep but there are only {num_heads} heads; "
                             "a node at depth d needs head d-1")
        if tree.max_depth == 0:
            raise ValueError("a Medusa drafter needs a tree with draft nodes")
        if entropy_threshold is not None and not 0 <= entropy_threshold <= 1:
            raise ValueError(f"entropy_threshold must be in [0, 1], got {entropy_threshold!r}")
        self.heads, self.tree, self.entropy_threshold = heads, tree, entropy_threshold
        self.num_nodes, self.max_depth, self.max_children = tree.num_nodes, tree.max_depth, tree.max_children
        self.num_ranks = tree.max_rank + 1
        self.plan = TreePlan(tree, device)
        # Heads with a draft vocab (heads/medusa.py token_map) rank draft ids; these map them back.
        draft_ids = getattr(heads, "draft_to_target", lambda: None)()
        self.draft_ids = None if draft_ids is None else draft_ids.to(device)  # [Vd]
        self.head_index = (tree.depths[1:] - 1).to(device)  # [T-1]
        self.rank_index = tree.ranks[1:].to(device)  # [T-1]
        self.hidden_BH: torch.Tensor | None = None  # per engine row: the final hidden state that chose its root

    @torch.no_grad()
    def draft_tokens(self, hidden_BH: torch.Tensor, root_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, H] at the last committed position, root [B] -> (tree tokens [B, T], the
        heads' logits [D, B, V] (V: the draft vocab) the tokens came from)."""
        if isinstance(self.heads, MedusaHeads):  # only the heads the tree reads
            logits_KBV = self.heads(hidden_BH[:, None, :], num_heads=self.tree.max_depth)[:, :, 0, :]
        else:
            logits_KBV = self.heads(hidden_BH[:, None, :])[:self.tree.max_depth, :, 0, :]
        candidates_KBR = logits_KBV.topk(self.num_ranks, dim=-1).indices
        drafted_NB = candidates_KBR[self.head_index, :, self.rank_index]  # [T-1, B]
        if self.draft_ids is not None:
            drafted_NB = self.draft_ids[drafted_NB]  # draft ids -> target ids
        return torch.cat([root_B[:, None], drafted_NB.T], dim=1), logits_KBV

    def attach(self, cache, max_cache_len: int) -> "MedusaDrafter":
        attached = copy.copy(self)
        attached.cache = cache  # the state is allocated by the first start, in the taps' width and dtype
        return attached

    def start(self, row: int, prefilled) -> None:
        if self.hidden_BH is None:
            self.hidden_BH = prefilled.taps.new_zeros(self.cache.capacity, prefilled.taps.shape[-1])  # [B, H]
            self.cache.follow(self.hidden_BH, 0)
        self.hidden_BH[row].copy_(prefilled.taps[-1])

    def prepare(self, seqs: list, drafting: list[bool]) -> list[int]:
        return [int(draws) for draws in drafting]

    @torch.no_grad()
    def draft(self, rows: slice, roots_n: torch.Tensor, lens_n: torch.Tensor, key_bound: int) -> DraftBatch:
        """The rows' trees in one head call; with entropy_threshold, each row's nodes past its
        cut depth are invalid."""
        tokens_nT, logits_DnV = self.draft_tokens(self.hidden_BH[rows], roots_n)
        drafts = DraftBatch.from_plan(self.plan, tokens_nT)
        if self.entropy_threshold is None:
            return drafts
        cut_n = entropy_cut_depths(logits_DnV, self.entropy_threshold)
        return replace(drafts, valid=self.plan.position_offsets[None, :] < cut_n[:, None])

    def finish(self, seq) -> None:
        return None

    def observe(self, rows: slice, taps_nTH: torch.Tensor, path_nW: torch.Tensor, num_nodes_n: torch.Tensor,
                emitted_nW: torch.Tensor, lens_n: torch.Tensor, key_bound: int) -> None:
        """Keep the final hidden state at each row's last accepted node (it chose the next root)."""
        last_n11 = path_nW.gather(1, (num_nodes_n - 1)[:, None])[:, :, None]
        self.hidden_BH[rows] = taps_nTH.gather(1, last_n11.expand(-1, 1, taps_nTH.shape[-1]))[:, 0]
