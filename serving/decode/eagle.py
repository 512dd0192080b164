"""EAGLE drafting (EAGLE-3, or EAGLE-1/2 heads): a static tree, or an EAGLE-2 tree drafted
anew every step, both through one level loop.

Each step first runs the head over the rows committed since the last step (row p reads the
target's taps at p and the token at p+1), appending them to the head's own KV cache
(`HeadCache`, committed positions only, never tree nodes); the last row predicts depth 1.
Then one head forward per depth d >= 1 (`_LevelLoop.run`) runs that depth's nodes: a node
reads its own token's embedding and its parent's output feature, sits at position S-1+d,
and attends to the committed rows plus its draft ancestors. Draft ids are mapped to target
ids through the head's d2t.

- `StaticEagleDrafter`: the tree is fixed; a node at depth d and rank r takes the r-th top
  candidate of its parent.
- `DynamicEagleDrafter` (EAGLE-2): the head's own confidence shapes the tree.
  - expand: depth 1 is the root's top_k candidates. At each further depth the top_k
    frontier nodes by cumulative draft log-prob are expanded, each with its top_k children.
  - rerank: every drafted node is ranked by cumulative log-prob and the best `num_nodes`
    are kept. A child's score never exceeds its parent's, and ties keep the earlier-created
    node (the parent) first, so the kept set is closed under ancestors.
  - AdaEDL (`entropy_threshold`): a node whose acceptance bound (serving/decode/sampling.py
    `acceptance_bound`) falls below the threshold gets no children; depth 1 is always drafted.

Both have one entry point, `draft(states) -> DraftBatch` (serving/decode/draft_batch.py):
each sequence's drafted tree, as device tensors, with the head cache that now covers all its
S committed positions. The decode states are not changed. Nothing reads the device back:
an EAGLE-2 tree keeps a fixed size, num_nodes + 1, and a candidate stopped by AdaEDL is an
invalid node of it.

Shape legend: S committed positions, A rows committed since the last step, H hidden,
Vd draft vocab, R ranks used, k top_k, m expanded nodes at one depth, N drafted candidates,
T tree nodes (root included), L head layers, Hkv head KV heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.sampling import acceptance_bound
from specheads.serving.decode.trees import DraftTree, DynamicTreeConfig, TreePlan


@dataclass
class HeadCache:
    """An EAGLE head's keys/values over committed positions (never tree nodes), every layer's."""

    keys: torch.Tensor  # [L, 1, Hkv, S, D]
    values: torch.Tensor  # [L, 1, Hkv, S, D]


def commit_head_rows(head: nn.Module, embeddings: nn.Module, state) -> tuple[torch.Tensor, HeadCache]:
    """Run an EAGLE head over state's rows committed since the last step (row p reads the
    target's taps at p and the token at p+1), after state.draft_cache.
    -> (the last row's output feature [1, 1, H], the cache over all S positions)."""
    cache = state.draft_cache
    num_new = state.hidden.shape[0]
    past_len = 0 if cache is None else cache.keys.shape[-2]
    device = state.hidden.device
    feature = head.fuse(state.hidden[None].to(head.lm_head.weight.dtype))  # [1, A, H]
    embeds = embeddings(state.next_tokens[None]).to(feature.dtype)  # [1, A, H]
    positions = torch.arange(past_len, past_len + num_new, device=device)[None]
    mask = torch.ones(num_new, past_len + num_new, dtype=torch.bool, device=device)
    mask[:, past_len:] = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
    past = None if cache is None else (cache.keys, cache.values)
    out, (k, v) = head.step(embeds, feature, positions, past, mask[None, None])
    if cache is not None:
        k, v = torch.cat([cache.keys, k], -2), torch.cat([cache.values, v], -2)
    return out[:, -1:], HeadCache(k, v)


class _LevelLoop:
    """The head forwards of one step's draft levels: each call runs one depth's nodes after
    the committed rows and the tree nodes run so far."""

    def __init__(self, head: nn.Module, embeddings: nn.Module, cache: HeadCache):
        self.head, self.embeddings, self.cache = head, embeddings, cache
        self.prefix_len = cache.keys.shape[-2]
        self.tree_k = self.tree_v = None

    def run(self, depth: int, tokens_m: torch.Tensor, parent_features: torch.Tensor,
            ancestors_mN: torch.Tensor) -> torch.Tensor:
        """Nodes at `depth` (target ids [m], their parents' features [1, m, H], which of the tree
        nodes run so far plus themselves they attend to [m, N]) -> their output features [1, m, H]."""
        num_nodes = int(tokens_m.shape[0])
        device = parent_features.device
        embeds = self.embeddings(tokens_m[None]).to(parent_features.dtype)  # [1, m, H]
        positions = torch.full((1, num_nodes), self.prefix_len - 1 + depth, device=device)
        mask = torch.cat([torch.ones(num_nodes, self.prefix_len, dtype=torch.bool, device=device), ancestors_mN], 1)
        past_k = self.cache.keys if self.tree_k is None else torch.cat([self.cache.keys, self.tree_k], -2)
        past_v = self.cache.values if self.tree_v is None else torch.cat([self.cache.values, self.tree_v], -2)
        out, (k, v) = self.head.step(embeds, parent_features, positions, (past_k, past_v), mask[None, None])
        self.tree_k = k if self.tree_k is None else torch.cat([self.tree_k, k], -2)
        self.tree_v = v if self.tree_v is None else torch.cat([self.tree_v, v], -2)
        return out


class StaticEagleDrafter:
    """A fixed tree, drafted level by level (module doc)."""

    keeps_head_cache = True  # its head's KV cache covers every committed position

    def __init__(self, head: nn.Module, embeddings: nn.Module, tree: DraftTree):
        if tree.max_depth == 0:
            raise ValueError("an EAGLE drafter needs a tree with draft nodes")
        self.head, self.embeddings, self.tree = head, embeddings, tree
        self.num_ranks = tree.max_rank + 1
        device = head.d2t.device
        self.plan = TreePlan(tree, device)
        self.draft_to_target = head.draft_to_target()  # [Vd]
        depths, parents = tree.depths.tolist(), tree.parents.tolist()
        local = {0: 0}  # node -> index within its level
        self.levels = []  # per depth d >= 1: (parent local index [n_d], rank [n_d], mask rows [n_d, N_d])
        for depth in range(1, tree.max_depth + 1):
            nodes = [n for n in range(tree.num_nodes) if depths[n] == depth]
            for i, node in enumerate(nodes):
                local[node] = i
            parent_local = torch.tensor([local[parents[n]] for n in nodes], device=device)
            mask = tree.tree_mask[nodes][:, 1:nodes[-1] + 1].to(device)  # [n_d, draft nodes up to depth d]
            self.levels.append((parent_local, tree.ranks[nodes].to(device), mask))

    @torch.no_grad()
    def draft(self, states: list) -> DraftBatch:
        """Each sequence's tree (one head run each) -> the rows' drafts, with their head caches."""
        drafted = [self._draft_one(state) for state in states]
        return DraftBatch.from_plan(self.plan, torch.stack([tokens for tokens, _ in drafted]),
                                    head_caches=[cache for _, cache in drafted])

    def _draft_one(self, state) -> tuple[torch.Tensor, HeadCache]:
        features, cache = commit_head_rows(self.head, self.embeddings, state)  # [1, 1, H]
        loop = _LevelLoop(self.head, self.embeddings, cache)
        tokens = [state.root]
        for depth, (parent_local, ranks, mask) in enumerate(self.levels, start=1):
            candidates = self.head.logits(features).topk(self.num_ranks, dim=-1).indices  # [1, n_{d-1}, R]
            level_tokens = self.draft_to_target[candidates[0, parent_local, ranks]]  # [n_d]
            tokens.append(level_tokens)
            if depth < len(self.levels):  # the last level's features are never read
                features = loop.run(depth, level_tokens, features[:, parent_local], mask)
        return torch.cat(tokens), cache


@dataclass
class DynamicDraft:
    """A drafted candidate set before the rerank (global numbering: 0 = root, then candidates
    in creation order, depth-major). Exposed for tests and diagnostics."""

    parents: torch.Tensor  # [N+1] long, root -1
    ranks: torch.Tensor  # [N+1] long, candidate rank under its parent
    depths: torch.Tensor  # [N+1] long
    tokens: torch.Tensor  # [N+1] long, target ids (root first)
    scores: torch.Tensor  # [N+1] float, cumulative draft log-prob; root 0, -inf: stopped by AdaEDL


class DynamicEagleDrafter:
    """EAGLE-2 trees (and AdaEDL early stopping), drafted anew every step (module doc)."""

    keeps_head_cache = True  # its head's KV cache covers every committed position

    def __init__(self, head: nn.Module, embeddings: nn.Module, config: DynamicTreeConfig):
        if not isinstance(config, DynamicTreeConfig):
            raise TypeError(f"config must be a DynamicTreeConfig, got {type(config).__name__}")
        if config.top_k > head.draft_vocab_size:
            raise ValueError(f"tree.dynamic.top_k is {config.top_k} but the head's draft vocab has only "
                             f"{head.draft_vocab_size} tokens")
        self.head, self.embeddings, self.config = head, embeddings, config
        self.draft_to_target = head.draft_to_target()  # [Vd]

    def _children(self, logits_mV: torch.Tensor, parent_scores_m: torch.Tensor):
        """Top-k children of m nodes -> (draft ids [m*k], cumulative log-probs [m*k], ranks [m*k]).
        A parent scored -inf (stopped by AdaEDL) gives children scored -inf: never kept."""
        top_logp, top_ids = torch.log_softmax(logits_mV.float(), dim=-1).topk(self.config.top_k, dim=-1)  # [m, k]
        scores = parent_scores_m[:, None] + top_logp.clamp(max=0.0)
        ranks = torch.arange(top_ids.shape[1], device=top_ids.device).repeat(top_ids.shape[0])
        return top_ids.reshape(-1), scores.reshape(-1), ranks

    @torch.no_grad()
    def expand(self, state) -> tuple[DynamicDraft, HeadCache]:
        """Every candidate, before the rerank, and the head cache over all S positions."""
        head, config = self.head, self.config
        top_k = config.top_k
        features, cache = commit_head_rows(head, self.embeddings, state)  # [1, 1, H]
        loop = _LevelLoop(head, self.embeddings, cache)
        device = features.device
        zero = torch.zeros(1, device=device)
        ids, scores, ranks = self._children(head.logits(features)[0], zero)  # depth 1: always drafted
        all_ids, all_scores, all_ranks = [ids], [scores], [ranks]
        all_parents = [torch.zeros(top_k, dtype=torch.long, device=device)]
        all_depths = [torch.ones(top_k, dtype=torch.long, device=device)]
        level_start = 1  # global index of the current frontier's first node
        parent_local_frontier = torch.zeros(top_k, dtype=torch.long, device=device)  # frontier -> expanded index
        max_expanded = (config.depth - 1) * top_k
        ancestors = torch.zeros(max_expanded, max_expanded, dtype=torch.bool, device=device)
        prev_offset, offset = 0, 0  # expanded-row offsets of the previous / current level
        num_chosen = top_k  # a frontier holds k (depth 1) or k*k nodes; stopped ones score -inf
        for depth in range(1, config.depth):
            chosen = scores.topk(top_k).indices  # [m], frontier-local
            parent_local = parent_local_frontier[chosen]
            rows = torch.arange(offset, offset + num_chosen, device=device)
            if depth > 1:
                ancestors[offset:offset + num_chosen, :offset] = ancestors[prev_offset + parent_local, :offset]
            ancestors[rows, rows] = True
            features = loop.run(depth, self.draft_to_target[ids[chosen]], features[:, parent_local],
                                ancestors[offset:offset + num_chosen, :offset + num_chosen])
            logits = head.logits(features)[0]  # [m, Vd]
            parent_scores = scores[chosen]
            if config.entropy_threshold is not None:  # AdaEDL: these nodes' children are not drafted
                parent_scores = parent_scores.masked_fill(acceptance_bound(logits) < config.entropy_threshold,
                                                          float("-inf"))
            all_parents.append((level_start + chosen).repeat_interleave(top_k))
            level_start += int(scores.shape[0])
            ids, scores, ranks = self._children(logits, parent_scores)
            all_ids.append(ids)
            all_scores.append(scores)
            all_ranks.append(ranks)
            all_depths.append(torch.full_like(ids, depth + 1))
            parent_local_frontier = torch.arange(num_chosen, device=device).repeat_interleave(top_k)
            prev_offset, offset = offset, offset + num_chosen
        minus_one = torch.full((1,), -1, dtype=torch.long, device=device)
        drafted = DynamicDraft(
            parents=torch.cat([minus_one] + all_parents), ranks=torch.cat([minus_one + 1] + all_ranks),
            depths=torch.cat([minus_one + 1] + all_depths),
            tokens=torch.cat([state.root.reshape(1)] + [self.draft_to_target[i] for i in all_ids]),
            scores=torch.cat([zero] + all_scores))
        return drafted, cache

    def rerank(self, drafted: DynamicDraft) -> dict[str, torch.Tensor]:
        """Keep the best num_nodes candidates, on the device -> the row's tree: tokens, parents,
        depths [T], tree_mask [T, T] and valid [T] (T = num_nodes + 1, a fixed size; a kept
        candidate scored -inf, stopped by AdaEDL, is invalid). Nodes are in creation order,
        depth-major, so every parent precedes its children and siblings keep their rank order."""
        scores = drafted.scores[1:]
        num_keep = min(self.config.num_nodes, int(scores.shape[0]))
        # Stable descending sort: on a tie the earlier-created node (a parent before its child) wins.
        best = torch.sort(scores, descending=True, stable=True).indices[:num_keep] + 1
        nodes_T = torch.cat([torch.zeros(1, dtype=torch.long, device=scores.device), best.sort().values])
        num_nodes = num_keep + 1
        new_index = torch.full_like(drafted.parents, -1)
        new_index[nodes_T] = torch.arange(num_nodes, device=scores.device)
        parents_T = torch.cat([torch.full((1,), -1, device=scores.device), new_index[drafted.parents[nodes_T[1:]]]])
        valid_T = torch.isfinite(drafted.scores[nodes_T])  # a finite node's ancestors are finite, so kept
        return {"tokens": drafted.tokens[nodes_T], "parents": parents_T, "depths": drafted.depths[nodes_T],
                "tree_mask": ancestor_mask(parents_T, self.config.depth), "valid": valid_T}

    @torch.no_grad()
    def draft(self, states: list) -> DraftBatch:
        """Each sequence's EAGLE-2 tree (one expansion each) -> the rows' drafts, with their head caches."""
        trees, caches = [], []
        for state in states:
            drafted, cache = self.expand(state)
            trees.append(self.rerank(drafted))
            caches.append(cache)
        fields = {name: torch.stack([tree[name] for tree in trees]) for name in trees[0]}
        return DraftBatch(**fields, max_depth=self.config.depth, max_children=self.config.top_k, head_caches=caches)


def ancestor_mask(parents_T: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[T, T] bool: node i attends to node j iff j is i or one of its ancestors, from parents
    [T] (-1: none) in max_depth pointer-jumping steps of tensor ops (no device sync)."""
    num_nodes = int(parents_T.shape[0])
    mask = torch.eye(num_nodes, dtype=torch.bool, device=parents_T.device)
    ancestor = parents_T
    for _ in range(max_depth):
        has = ancestor >= 0
        mask |= torch.nn.functional.one_hot(ancestor.clamp(min=0), num_nodes).bool() & has[:, None]
        ancestor = torch.where(has, parents_T[ancestor.clamp(min=0)], -1)
    return mask
