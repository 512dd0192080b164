"""EAGLE drafting (EAGLE-3, or EAGLE-1/2 heads): a static tree, or an EAGLE-2 tree drafted
anew every step, both through one level loop, for every drafted row of a batch at once.

Each step first runs the head over each row's positions committed since its head last ran
(row p reads the target's taps at p and the token at p+1; `commit_new_rows`), writing them
into the head's KV cache (`HeadKV`, one row per engine row: committed positions only);
the last one predicts depth 1. Then one head forward per depth d >= 1 (`_Levels.run`) runs
that depth's nodes of every row: a node reads its own token's embedding and its parent's
output feature, sits at position S-1+d, and attends to its row's committed positions plus
its draft ancestors. Draft ids are mapped to target ids through the head's d2t.

- `StaticEagleDrafter`: the tree is fixed; a node at depth d and rank r takes the r-th top
  candidate of its parent.
- `DynamicEagleDrafter` (EAGLE-2): the head's own confidence shapes each row's tree.
  - expand: depth 1 is the root's top_k candidates. At each further depth the top_k
    frontier nodes by cumulative draft log-prob are expanded, each with its top_k children.
  - rerank: every drafted node is ranked by cumulative log-prob and the best `num_nodes`
    are kept. A child's score never exceeds its parent's, and ties keep the earlier-created
    node (the parent) first, so the kept set is closed under ancestors.
  - AdaEDL (`entropy_threshold`): a node whose acceptance bound (serving/decode/sampling.py
    `acceptance_bound`) falls below the threshold gets no children; depth 1 is always drafted.

Both have one entry point, `draft(states, rows, head_kv) -> DraftBatch` (serving/decode/
draft_batch.py): the rows' drafted trees as device tensors; `new_cache` makes the engine's
`HeadKV`. The head receives a `HeadWrite` as its past: each layer writes its new keys and
values into the rows' slots and attends to them under the caller's mask, so the head runs once
per draft level for the whole batch. The decode states are not changed. Nothing reads the device back: an EAGLE-2 tree
keeps a fixed size, num_nodes + 1, and a candidate stopped by AdaEDL is an invalid node of it.

Shape legend: m drafted rows, S committed positions, A positions since the head last ran, H
hidden, Vd draft vocab, R ranks used, k top_k, n nodes of one depth, N drafted candidates (or
tree nodes run so far), T tree nodes (root included), K attended head cache slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.sampling import acceptance_bound
from specheads.serving.decode.trees import DraftTree, DynamicTreeConfig, TreePlan


class HeadKV:
    """An EAGLE head's keys and values for every row of one engine, [Lh, 2, B, Hkv, M, D]: a
    follower of the engine's TreeStaticCache (serving/decode/cache.py `follow`: its rows swap
    and move with the target's). Row b holds the head's keys and values of its sequence's
    committed positions [0, C_b), C_b = the sequence's prefix_len less the rows its head has
    not run yet (the A rows of its decode state's `hidden`): the lengths live in the decode
    states, not here. A draft writes its new rows at [C_b, C_b + A) and its tree nodes after
    them (dead data after the step, overwritten by the next one)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, batch_size: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_slots = num_slots
        self.buffer = torch.zeros(num_layers, 2, batch_size, num_kv_heads, num_slots, head_dim, dtype=dtype,
                                  device=device)  # [Lh, 2, B, Hkv, M, D]

    def write(self, rows: list[int], slots_mT: torch.Tensor, num_keys: int) -> "HeadWrite":
        """What Eagle3Head.step takes as its past for one call: each layer writes the rows'
        (engine rows, ascending) T new keys and values at slots [m, T] and attends to their
        first num_keys slots (a view when the rows are contiguous)."""
        if num_keys > self.num_slots:
            raise ValueError(f"a draft needs {num_keys} head cache slots, more than the {self.num_slots} allocated")
        rows_m = torch.tensor(rows, device=self.buffer.device)
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        select = slice(rows[0], rows[0] + len(rows)) if contiguous else rows_m
        return HeadWrite([_LayerWrite(self.buffer[layer], rows_m[:, None], select, slots_mT, num_keys)
                          for layer in range(self.buffer.shape[0])])


@dataclass
class HeadWrite:
    layers: list  # one _LayerWrite per head layer


@dataclass
class _LayerWrite:
    kv_2BHMD: torch.Tensor  # this layer's keys and values in the buffer
    rows_m1: torch.Tensor
    select: object  # the rows, as a slice (contiguous: views) or an index tensor
    slots_mT: torch.Tensor
    num_keys: int

    def update(self, keys_mHTD: torch.Tensor, values_mHTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new keys and values -> the rows' keys and values [m, Hkv, K, D]."""
        out = []
        for buffer_BHMD, new_mHTD in zip(self.kv_2BHMD, (keys_mHTD, values_mHTD)):
            # advanced indices on dims 0 and 2 put their broadcast [m, T] first: values are [m, T, Hkv, D]
            buffer_BHMD[self.rows_m1, :, self.slots_mT] = new_mHTD.transpose(1, 2).to(buffer_BHMD.dtype)
            out.append(buffer_BHMD[self.select, :, :self.num_keys])
        return out[0], out[1]


# Positions a row's head has not run yet: at most the tree's depth + 1 in a decode step (more
# after a step the head sat out), a whole prompt after a prefill. Rows with at most this many run
# together, padded to the longest; a row with more (a new prompt) runs alone.
BATCHED_NEW_ROWS = 64


def new_head_cache(head: nn.Module, batch_size: int, max_cache_len: int) -> HeadKV:
    """The head's cache for an engine of batch_size rows of max_cache_len positions (each
    row's committed positions, plus room for padded new rows or a tree after them)."""
    attention = head.midlayer.self_attn
    return HeadKV(head.num_layers, attention.num_kv_heads, attention.head_dim, batch_size,
                  max_cache_len + BATCHED_NEW_ROWS, head.lm_head.weight.dtype, head.d2t.device)


def commit_new_rows(head: nn.Module, embeddings: nn.Module, head_kv: HeadKV, states: list,
                    rows: list[int]) -> torch.Tensor:
    """Run the head over each state's positions its head has not run yet (its `hidden` rows:
    row p reads the target's taps at p and the token at p+1), written into its row of head_kv
    -> each row's last output feature [m, 1, H]. Rows with at most BATCHED_NEW_ROWS such
    positions run in one call, padded to the longest; each other row runs alone."""
    counts = [int(state.hidden.shape[0]) for state in states]
    few = [i for i, count in enumerate(counts) if count <= BATCHED_NEW_ROWS]
    groups = ([few] if few else []) + [[i] for i, count in enumerate(counts) if count > BATCHED_NEW_ROWS]
    dtype, device = head.lm_head.weight.dtype, states[0].hidden.device
    features: list = [None] * len(states)
    for group in groups:
        width = max(counts[i] for i in group)
        hidden = torch.stack([torch.nn.functional.pad(states[i].hidden, (0, 0, 0, width - counts[i]))
                              for i in group]).to(dtype)  # [g, A, nH]
        tokens = torch.stack([torch.nn.functional.pad(states[i].next_tokens, (0, width - counts[i]))
                              for i in group])  # [g, A]
        starts = [states[i].prefix_len - counts[i] for i in group]
        positions_gA = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)
        num_keys = max(starts) + width
        mask_gAK = torch.arange(num_keys, device=device)[None, None] <= positions_gA[:, :, None]  # committed + causal
        feature = head.fuse(hidden)
        out, _ = head.step(embeddings(tokens).to(feature.dtype), feature, positions_gA,
                           head_kv.write([rows[i] for i in group], positions_gA, num_keys), mask_gAK[:, None])
        last = torch.tensor([counts[i] - 1 for i in group], device=device)
        for i, feature_H in zip(group, out[torch.arange(len(group), device=device), last]):
            features[i] = feature_H
    return torch.stack(features)[:, None]


class _Levels:
    """The head forwards of one step's draft levels for m rows: each call runs one depth's n
    nodes of every row after the row's committed positions and the tree nodes run so far,
    whose keys and values go to the head cache's slots after the committed ones."""

    def __init__(self, head: nn.Module, embeddings: nn.Module, head_kv: HeadKV, states: list, rows: list[int]):
        self.head, self.embeddings, self.head_kv, self.rows = head, embeddings, head_kv, rows
        committed = [state.prefix_len for state in states]
        self.committed_m = torch.tensor(committed, device=states[0].hidden.device)
        self.max_committed = max(committed)
        self.num_tree = 0  # tree nodes of each row run so far

    def run(self, depth: int, tokens_mn: torch.Tensor, parent_features_mnH: torch.Tensor,
            ancestors_mnN: torch.Tensor) -> torch.Tensor:
        """Nodes at `depth` (target ids [m, n], their parents' features [m, n, H], which of the
        tree nodes run so far plus themselves they attend to [m, n, N]) -> their output features
        [m, n, H]."""
        num_rows, num_nodes = tokens_mn.shape
        device = parent_features_mnH.device
        num_tree = self.num_tree + num_nodes
        embeds = self.embeddings(tokens_mn).to(parent_features_mnH.dtype)
        positions_mn = (self.committed_m - 1 + depth)[:, None].expand(num_rows, num_nodes)
        slots_mn = self.committed_m[:, None] + self.num_tree + torch.arange(num_nodes, device=device)
        num_keys = self.max_committed + num_tree
        key_K = torch.arange(num_keys, device=device)
        offset_mK = key_K[None] - self.committed_m[:, None]  # a key's place among the tree nodes
        in_tree_mK = (offset_mK >= 0) & (offset_mK < num_tree)
        index_mnK = offset_mK.clamp(0, num_tree - 1)[:, None].expand(num_rows, num_nodes, num_keys)
        tree_mnK = ancestors_mnN.gather(2, index_mnK) & in_tree_mK[:, None]
        mask_mnK = (key_K[None, None] < self.committed_m[:, None, None]) | tree_mnK
        out, _ = self.head.step(embeds, parent_features_mnH, positions_mn,
                                self.head_kv.write(self.rows, slots_mn, num_keys), mask_mnK[:, None])
        self.num_tree = num_tree
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

    def new_cache(self, batch_size: int, max_cache_len: int) -> HeadKV:
        return new_head_cache(self.head, batch_size, max_cache_len)

    @torch.no_grad()
    def draft(self, states: list, rows: list[int], head_kv: HeadKV) -> DraftBatch:
        """The rows' trees (states of engine rows `rows`), one head call per level for all."""
        features = commit_new_rows(self.head, self.embeddings, head_kv, states, rows)  # [m, 1, H]
        levels = _Levels(self.head, self.embeddings, head_kv, states, rows)
        tokens = [torch.cat([state.root for state in states])[:, None]]
        for depth, (parent_local, ranks, mask) in enumerate(self.levels, start=1):
            candidates = self.head.logits(features).topk(self.num_ranks, dim=-1).indices  # [m, n_{d-1}, R]
            level_tokens = self.draft_to_target[candidates[:, parent_local, ranks]]  # [m, n_d]
            tokens.append(level_tokens)
            if depth < len(self.levels):  # the last level's features are never read
                features = levels.run(depth, level_tokens, features[:, parent_local],
                                      mask.expand(len(states), -1, -1))
        return DraftBatch.from_plan(self.plan, torch.cat(tokens, 1))


@dataclass
class DynamicDraft:
    """The rows' drafted candidate sets before the rerank (global numbering per row: 0 = root,
    then candidates in creation order, depth-major). Exposed for tests and diagnostics."""

    parents: torch.Tensor  # [m, N+1] long, root -1
    ranks: torch.Tensor  # [m, N+1] long, candidate rank under its parent
    depths: torch.Tensor  # [m, N+1] long
    tokens: torch.Tensor  # [m, N+1] long, target ids (root first)
    scores: torch.Tensor  # [m, N+1] float, cumulative draft log-prob; root 0, -inf: stopped by AdaEDL


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

    def new_cache(self, batch_size: int, max_cache_len: int) -> HeadKV:
        return new_head_cache(self.head, batch_size, max_cache_len)

    def _children(self, logits_mnV: torch.Tensor, parent_scores_mn: torch.Tensor):
        """Top-k children of each row's n nodes -> (draft ids [m, n*k], cumulative log-probs
        [m, n*k], ranks [m, n*k]). A parent scored -inf (stopped by AdaEDL) gives children
        scored -inf: never kept."""
        top_logp, top_ids = torch.log_softmax(logits_mnV.float(), dim=-1).topk(self.config.top_k, dim=-1)  # [m, n, k]
        scores = parent_scores_mn[..., None] + top_logp.clamp(max=0.0)
        ranks = torch.arange(top_ids.shape[-1], device=top_ids.device).expand_as(top_ids)
        num_rows = top_ids.shape[0]
        return top_ids.reshape(num_rows, -1), scores.reshape(num_rows, -1), ranks.reshape(num_rows, -1)

    @torch.no_grad()
    def expand(self, states: list, rows: list[int], head_kv: HeadKV) -> DynamicDraft:
        """Every row's candidates, before the rerank."""
        head, config = self.head, self.config
        top_k, num_rows = config.top_k, len(states)
        features = commit_new_rows(head, self.embeddings, head_kv, states, rows)  # [m, 1, H]
        levels = _Levels(head, self.embeddings, head_kv, states, rows)
        device = features.device
        rows_m1 = torch.arange(num_rows, device=device)[:, None]
        zero = torch.zeros(num_rows, 1, device=device)
        ids, scores, ranks = self._children(head.logits(features), zero)  # depth 1: always drafted
        all_ids, all_scores, all_ranks = [ids], [scores], [ranks]
        all_parents = [torch.zeros(num_rows, top_k, dtype=torch.long, device=device)]
        all_depths = [torch.ones(num_rows, top_k, dtype=torch.long, device=device)]
        level_start = 1  # global index of the current frontier's first node
        frontier_parent = torch.zeros(num_rows, top_k, dtype=torch.long, device=device)  # frontier -> expanded
        max_expanded = (config.depth - 1) * top_k
        ancestors = torch.zeros(num_rows, max_expanded, max_expanded, dtype=torch.bool, device=device)
        prev_offset, offset = 0, 0  # expanded-row offsets of the previous / current level
        level_k = torch.arange(top_k, device=device)
        for depth in range(1, config.depth):  # a frontier holds k or k*k nodes; stopped ones score -inf
            chosen = scores.topk(top_k, dim=-1).indices  # [m, k], frontier-local
            parent_local = frontier_parent.gather(1, chosen)  # [m, k]
            if depth > 1:
                ancestors[:, offset:offset + top_k, :offset] = ancestors[rows_m1, prev_offset + parent_local, :offset]
            ancestors[:, offset + level_k, offset + level_k] = True
            parent_features = features[rows_m1, parent_local]  # [m, k, H]
            features = levels.run(depth, self.draft_to_target[ids.gather(1, chosen)], parent_features,
                                  ancestors[:, offset:offset + top_k, :offset + top_k])
            logits = head.logits(features)  # [m, k, Vd]
            parent_scores = scores.gather(1, chosen)
            if config.entropy_threshold is not None:  # AdaEDL: these nodes' children are not drafted
                parent_scores = parent_scores.masked_fill(acceptance_bound(logits) < config.entropy_threshold,
                                                          float("-inf"))
            all_parents.append((level_start + chosen).repeat_interleave(top_k, dim=1))
            level_start += int(scores.shape[1])
            ids, scores, ranks = self._children(logits, parent_scores)
            all_ids.append(ids)
            all_scores.append(scores)
            all_ranks.append(ranks)
            all_depths.append(torch.full_like(ids, depth + 1))
            frontier_parent = level_k.repeat_interleave(top_k).expand(num_rows, -1)
            prev_offset, offset = offset, offset + top_k
        minus_one = torch.full((num_rows, 1), -1, dtype=torch.long, device=device)
        roots = torch.cat([state.root for state in states])[:, None]
        return DynamicDraft(
            parents=torch.cat([minus_one] + all_parents, 1), ranks=torch.cat([minus_one + 1] + all_ranks, 1),
            depths=torch.cat([minus_one + 1] + all_depths, 1),
            tokens=torch.cat([roots] + [self.draft_to_target[i] for i in all_ids], 1),
            scores=torch.cat([zero] + all_scores, 1))

    def rerank(self, drafted: DynamicDraft) -> dict[str, torch.Tensor]:
        """Keep each row's best num_nodes candidates, on the device -> the rows' trees: tokens,
        parents, depths, valid [m, T] and tree_mask [m, T, T] (T = num_nodes + 1, a fixed size; a
        kept candidate scored -inf, stopped by AdaEDL, is invalid). Nodes are in creation order,
        depth-major, so every parent precedes its children and siblings keep their rank order."""
        scores = drafted.scores[:, 1:]
        num_rows, num_candidates = scores.shape
        num_keep = min(self.config.num_nodes, int(num_candidates))
        device = scores.device
        # Stable descending sort: on a tie the earlier-created node (a parent before its child) wins.
        best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :num_keep] + 1
        nodes_mT = torch.cat([torch.zeros(num_rows, 1, dtype=torch.long, device=device), best.sort(dim=-1).values], 1)
        num_nodes = num_keep + 1
        new_index = torch.full_like(drafted.parents, -1)
        new_index.scatter_(1, nodes_mT, torch.arange(num_nodes, device=device).expand(num_rows, -1))
        parents_mT = torch.cat([torch.full((num_rows, 1), -1, dtype=torch.long, device=device),
                                new_index.gather(1, drafted.parents.gather(1, nodes_mT[:, 1:]))], 1)
        return {"tokens": drafted.tokens.gather(1, nodes_mT), "parents": parents_mT,
                "depths": drafted.depths.gather(1, nodes_mT), "tree_mask": ancestor_mask(parents_mT, self.config.depth),
                # a finite node's ancestors are finite, so kept
                "valid": torch.isfinite(drafted.scores.gather(1, nodes_mT))}

    @torch.no_grad()
    def draft(self, states: list, rows: list[int], head_kv: HeadKV) -> DraftBatch:
        """The rows' EAGLE-2 trees (states of engine rows `rows`), expanded together."""
        tree = self.rerank(self.expand(states, rows, head_kv))
        return DraftBatch(**tree, max_depth=self.config.depth, max_children=self.config.top_k)


def ancestor_mask(parents_mT: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[m, T, T] bool: node i attends to node j iff j is i or one of its ancestors, from each
    row's parents [m, T] (-1: none), in max_depth pointer-jumping steps of tensor ops (no
    device sync)."""
    num_rows, num_nodes = parents_mT.shape
    mask = torch.eye(num_nodes, dtype=torch.bool, device=parents_mT.device).repeat(num_rows, 1, 1)
    ancestor = parents_mT
    for _ in range(max_depth):
        has = ancestor >= 0
        mask |= torch.nn.functional.one_hot(ancestor.clamp(min=0), num_nodes).bool() & has[..., None]
        ancestor = torch.where(has, parents_mT.gather(1, ancestor.clamp(min=0)), -1)
    return mask
