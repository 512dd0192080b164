"""Drafting: Medusa heads turn the last committed hidden state into a tree of tokens.

The hidden state h at the last committed position p is the one the target's lm_head
turned into the root token (position p+1). Medusa head k reads the same h and predicts
position p+k+2, i.e. tree depth k+1. A node at depth d and rank r takes the r-th top
candidate of head d-1. Top-k runs once per step over all heads for the largest rank the
tree uses; the node tokens are one gather through index tensors precomputed per tree.

Shape legend: B batch, H hidden, K heads, T tree nodes, R ranks used (max rank + 1).
"""

from __future__ import annotations

import torch
from torch import nn

from specheads.serving.tree import DraftTree


class MedusaDrafter:
    def __init__(self, heads: nn.Module, tree: DraftTree):
        num_heads = getattr(heads, "num_heads", None)
        if num_heads is not None and tree.max_depth > num_heads:
            raise ValueError(f"the tree is {tree.max_depth} deep but there are only {num_heads} heads; "
                             "a node at depth d needs head d-1")
        self.heads = heads
        self.tree = tree
        self.num_ranks = tree.max_rank + 1
        param = next(heads.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        self.head_index = (tree.depths[1:] - 1).to(device)  # [T-1]
        self.rank_index = tree.ranks[1:].to(device)  # [T-1]

    @torch.no_grad()
    def draft(self, hidden_BH: torch.Tensor, root_B: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] at the last committed position, root [B] -> tree tokens [B, T]."""
        if self.tree.max_depth == 0:
            return root_B[:, None]
        logits_KBTV = self.heads(hidden_BH[:, None, :])
        logits_KBV = logits_KBTV[:self.tree.max_depth, :, 0, :]
        candidates_KBR = logits_KBV.topk(self.num_ranks, dim=-1).indices
        drafted_NB = candidates_KBR[self.head_index, :, self.rank_index]  # [T-1, B]
        return torch.cat([root_B[:, None], drafted_NB.T], dim=1)
