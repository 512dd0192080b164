"""Drafting: heads turn committed target states into a tree of candidate tokens.

Medusa: heads turn the last committed hidden state into a tree of tokens.

The hidden state h at the last committed position p is the one the target's lm_head
turned into the root token (position p+1). Medusa head k reads the same h and predicts
position p+k+2, i.e. tree depth k+1. A node at depth d and rank r takes the r-th top
candidate of head d-1. Top-k runs once per step over all heads for the largest rank the
tree uses; the node tokens are one gather through index tensors precomputed per tree.

EAGLE: see Eagle3Drafter.

Shape legend: B batch, H hidden, K heads, T tree nodes, R ranks used (max rank + 1), S committed
positions, A rows committed since the last step, Hkv head KV heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specheads.serving.decode.trees import DraftTree


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
        return self.draft_with_logits(hidden_BH, root_B)[0]

    @torch.no_grad()
    def draft_with_logits(self, hidden_BH: torch.Tensor, root_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (tree tokens [B, T], the heads' logits [D, B, V] the tokens came from)."""
        if self.tree.max_depth == 0:
            return root_B[:, None], None
        logits_KBTV = self.heads(hidden_BH[:, None, :])
        logits_KBV = logits_KBTV[:self.tree.max_depth, :, 0, :]
        candidates_KBR = logits_KBV.topk(self.num_ranks, dim=-1).indices
        drafted_NB = candidates_KBR[self.head_index, :, self.rank_index]  # [T-1, B]
        return torch.cat([root_B[:, None], drafted_NB.T], dim=1), logits_KBV


@dataclass
class HeadCache:
    """An EAGLE head's keys/values over committed positions (never tree nodes)."""

    keys: torch.Tensor  # [1, Hkv, S, D]
    values: torch.Tensor  # [1, Hkv, S, D]


def commit_head_rows(head: nn.Module, embeddings: nn.Module, state) -> tuple[torch.Tensor, HeadCache]:
    """Run an EAGLE head over state's rows committed since the last step (row p reads the
    target's taps at p and the token at p+1), appending them to the head's own cache.
    -> (the last row's output feature [1, 1, H], the new cache)."""
    cache = state.draft_cache
    num_new = state.hidden.shape[0]
    past_len = 0 if cache is None else cache.keys.shape[2]
    device = state.hidden.device
    feature = head.fuse(state.hidden[None].to(head.lm_head.weight.dtype))  # [1, A, H]
    embeds = embeddings(state.next_tokens[None]).to(feature.dtype)  # [1, A, H]
    positions = torch.arange(past_len, past_len + num_new, device=device)[None]
    mask = torch.ones(num_new, past_len + num_new, dtype=torch.bool, device=device)
    mask[:, past_len:] = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
    past = None if cache is None else (cache.keys, cache.values)
    out, (k, v) = head.step(embeds, feature, positions, past, mask[None, None])
    if cache is not None:
        k, v = torch.cat([cache.keys, k], 2), torch.cat([cache.values, v], 2)
    return out[:, -1:], HeadCache(k, v)


class Eagle3Drafter:
    """EAGLE-3 (or EAGLE-1/2) drafting of a static tree, level by level.

    Each step first runs the head over the rows committed since the last step (row p reads
    the target's taps at p and the token at p+1), appending them to the head's own cache;
    the last row predicts depth 1. Then one head forward per depth d >= 1 runs that depth's
    nodes: a node reads its own token's embedding and its parent's output feature, sits at
    position S-1+d, and attends to the committed rows plus its draft ancestors (the tree
    mask). Draft ids are mapped to target ids through d2t.
    """

    def __init__(self, head: nn.Module, tree: DraftTree, embeddings: nn.Module, tap_layers: list[int]):
        if tree.max_depth == 0:
            raise ValueError("an EAGLE drafter needs a tree with draft nodes")
        self.head, self.tree, self.embeddings = head, tree, embeddings
        self.tap_layers = list(tap_layers)
        self.num_ranks = tree.max_rank + 1
        device = head.d2t.device
        self.draft_to_target = head.draft_to_target()  # [Vd]
        depths, parents = tree.depths.tolist(), tree.parents.tolist()
        local = {0: 0}  # node -> index within its level
        self.levels = []  # per depth d >= 1: (parent local index [n_d], rank [n_d], mask rows [n_d, N_d])
        for depth in range(1, tree.max_depth + 1):
            nodes = [n for n in range(tree.num_nodes) if depths[n] == depth]
            for i, node in enumerate(nodes):
                local[node] = i
            last = nodes[-1]
            parent_local = torch.tensor([local[parents[n]] for n in nodes], device=device)
            mask = tree.tree_mask[nodes][:, 1:last + 1].to(device)  # [n_d, draft nodes up to depth d]
            self.levels.append((parent_local, tree.ranks[nodes].to(device), mask))

    def _commit_rows(self, state) -> tuple[torch.Tensor, HeadCache]:
        return commit_head_rows(self.head, self.embeddings, state)

    @torch.no_grad()
    def draft(self, state) -> torch.Tensor:
        """DecodeState -> tree tokens [1, T]; sets state.draft_cache to cover all S positions."""
        head = self.head
        parent_features, cache = self._commit_rows(state)  # [1, 1, H]
        state.draft_cache = cache
        prefix_len = cache.keys.shape[2]
        tokens = [state.root]
        tree_k = tree_v = None
        for depth, (parent_local, ranks, mask) in enumerate(self.levels, start=1):
            candidates = head.logits(parent_features).topk(self.num_ranks, dim=-1).indices  # [1, n_{d-1}, R]
            level_tokens = self.draft_to_target[candidates[0, parent_local, ranks]]  # [n_d]
            tokens.append(level_tokens)
            if depth == self.tree.max_depth:
                break
            num_nodes = level_tokens.shape[0]
            embeds = self.embeddings(level_tokens[None]).to(parent_features.dtype)  # [1, n_d, H]
            feature = parent_features[:, parent_local]  # [1, n_d, H]
            positions = torch.full((1, num_nodes), prefix_len - 1 + depth, device=embeds.device)
            full_mask = torch.cat([torch.ones(num_nodes, prefix_len, dtype=torch.bool, device=mask.device), mask], 1)
            past_k = cache.keys if tree_k is None else torch.cat([cache.keys, tree_k], 2)
            past_v = cache.values if tree_v is None else torch.cat([cache.values, tree_v], 2)
            parent_features, (k, v) = head.step(embeds, feature, positions, (past_k, past_v), full_mask[None, None])
            tree_k = k if tree_k is None else torch.cat([tree_k, k], 2)
            tree_v = v if tree_v is None else torch.cat([tree_v, v], 2)
        return torch.cat(tokens)[None]
