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
threshold are dropped; depth 1 is always kept. The tree cut at each depth is planned once
(`DraftTree.truncated`); the cut tree's nodes are the full tree's first ones.

Shape legend: B batch, H hidden, K heads, T tree nodes, R ranks used (max rank + 1), V vocab,
D tree depth.
"""

from __future__ import annotations

import torch
from torch import nn

from specheads.heads.medusa import MedusaHeads
from specheads.serving.decode.sampling import acceptance_bound
from specheads.serving.decode.trees import Draft, DraftTree, TreePlan


def entropy_cut_depth(head_logits_KV: torch.Tensor, threshold: float, min_depth: int = 1) -> int:
    """The first depth (> min_depth) whose head's acceptance bound < threshold.

    head_logits [K, V]: head k predicts depth k+1. Nodes at the returned depth and deeper are
    dropped this step; K+1 means no cut. Depths <= min_depth are always kept."""
    if head_logits_KV.dim() != 2:
        raise ValueError(f"head_logits must be [K, V] (one row per head), got shape {tuple(head_logits_KV.shape)}")
    num_heads = int(head_logits_KV.shape[0])
    if min_depth >= num_heads:
        return num_heads + 1
    low = acceptance_bound(head_logits_KV[min_depth:]) < threshold  # heads min_depth.. -> depths min_depth+1..
    if not bool(low.any()):
        return num_heads + 1
    return min_depth + 1 + int(low.to(torch.uint8).argmax())


class MedusaDrafter:
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
        self.num_ranks = tree.max_rank + 1
        self.plan = TreePlan(tree, device)
        # Heads with a draft vocab (heads/medusa.py token_map) rank draft ids; these map them back.
        draft_ids = getattr(heads, "draft_to_target", lambda: None)()
        self.draft_ids = None if draft_ids is None else draft_ids.to(device)  # [Vd]
        self.head_index = (tree.depths[1:] - 1).to(device)  # [T-1]
        self.rank_index = tree.ranks[1:].to(device)  # [T-1]
        self.cut_plans = None if entropy_threshold is None else \
            {cut: TreePlan(tree.truncated(cut), device) for cut in range(1, tree.max_depth + 2)}

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

    def draft(self, hidden_BH: torch.Tensor, root_B: torch.Tensor) -> list[Draft]:
        """B sequences in one head call -> one Draft each (cut per sequence with entropy_threshold)."""
        tokens_BT, logits_DBV = self.draft_tokens(hidden_BH, root_B)
        if self.cut_plans is None:
            return [Draft(tokens_BT[b], self.plan) for b in range(tokens_BT.shape[0])]
        drafts = []
        for b in range(tokens_BT.shape[0]):
            cut = min(entropy_cut_depth(logits_DBV[:, b], self.entropy_threshold), self.tree.max_depth + 1)
            plan = self.cut_plans[cut]
            drafts.append(Draft(tokens_BT[b, :plan.num_nodes], plan))
        return drafts
