"""EAGLE drafting (EAGLE-3, or EAGLE-1/2 heads): a static tree, or an EAGLE-2 tree drafted
anew every step, both through one level loop, for every row of a batch at once; both are
serving/decode/draft_batch.py `Drafter`s.

Per-row state, on the target's device, following the cache's rows: the head's own KV cache
(`kv_BHMD`, one row per engine row) over every committed position of the row, and the head's
output feature at the row's last committed position (`feature_BH`: the one that predicts
depth 1). Row p of the head reads the target's taps at p and the token at p+1.
- `start` (a sequence joins): the head runs over the positions its prefill ran.
- `observe` (after a step's accept, before its commit): the head runs over each row's
  accepted nodes (their taps, the token after each), written at the positions they are
  committed to, so the head's cache is always as long as the target's. Every row runs W
  nodes (the accept's path width); those past a row's count land past its new length, dead
  data. So the shapes are fixed whether or not the row drafted this step.
- `draft`: one head forward per depth d >= 1 (`_level`) runs that depth's nodes of every
  row: a node reads its own token's embedding and its parent's output feature, sits at
  position S-1+d, and attends to its row's committed positions plus its draft ancestors
  (written into the head cache's slots after the committed ones: dead data after the step).
  Draft ids are mapped to target ids through the head's d2t.

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
  An EAGLE-2 tree keeps a fixed size, num_nodes + 1; a candidate stopped by AdaEDL is an
  invalid node of it.

The head receives a `HeadWrite` as its past: each layer writes its new keys and values into
the rows' slots and attends to the first `key_bound` slots under the caller's mask.

Shape legend: n rows, S committed positions, H hidden, nH taps, Vd draft vocab, R ranks
used, k top_k, N drafted candidates (or tree nodes run so far), T tree nodes (root
included), W accepted path width, K attended head cache slots.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.sampling import acceptance_bound
from specheads.serving.decode.trees import DraftTree, DynamicTreeConfig, TreePlan


@dataclass
class HeadWrite:
    layers: list  # one _LayerWrite per head layer


@dataclass
class _LayerWrite:
    kv_2BHMD: torch.Tensor  # this layer's keys and values in the head cache
    rows: slice  # the engine rows
    slots_nT: torch.Tensor  # where each new row's key and value go
    num_keys: int  # the slots attended to

    def update(self, keys_nHTD: torch.Tensor, values_nHTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new keys and values -> the rows' keys and values [n, Hkv, K, D]."""
        out = []
        index_n1 = torch.arange(keys_nHTD.shape[0], device=keys_nHTD.device)[:, None]
        for buffer_BHMD, new_nHTD in zip(self.kv_2BHMD, (keys_nHTD, values_nHTD)):
            rows_nHMD = buffer_BHMD[self.rows]
            # advanced indices on dims 0 and 2 put their broadcast [n, T] first: values are [n, T, Hkv, D]
            rows_nHMD[index_n1, :, self.slots_nT] = new_nHTD.transpose(1, 2).to(buffer_BHMD.dtype)
            out.append(rows_nHMD[:, :, :self.num_keys])
        return out[0], out[1]


class _EagleDrafter:
    """The per-row state, `start`, `observe` and the head forward both EAGLE drafters share
    (module doc)."""

    name = "heads"
    num_notes = 0
    lookahead = 1  # the head's row p reads the token at p + 1

    def __init__(self, head: nn.Module, embeddings: nn.Module):
        self.head, self.embeddings = head, embeddings
        self.draft_to_target = head.draft_to_target()  # [Vd]
        self.kv_BHMD: torch.Tensor | None = None  # [Lh, 2, B, Hkv, M, D] the head's cache
        self.feature_BH: torch.Tensor | None = None  # [B, H] its output feature at each row's last position

    def attach(self, cache, max_cache_len: int) -> "_EagleDrafter":
        head, attention = self.head, self.head.midlayer.self_attn
        dtype, device = head.lm_head.weight.dtype, head.d2t.device
        attached = copy.copy(self)
        attached.kv_BHMD = torch.zeros(head.num_layers, 2, cache.capacity, attention.num_kv_heads, max_cache_len,
                                       attention.head_dim, dtype=dtype, device=device)
        attached.feature_BH = torch.zeros(cache.capacity, head.hidden_size, dtype=dtype, device=device)
        cache.follow(attached.kv_BHMD, 2)
        cache.follow(attached.feature_BH, 0)
        return attached

    @torch.no_grad()
    def start(self, row: int, prefilled) -> None:
        """Run the head over the positions the prefill ran (row p: taps at p, token p+1)."""
        prompt_P, begin = prefilled.prompt_P, prefilled.start
        length = int(prompt_P.shape[0])
        next_tokens = torch.cat([prompt_P[begin + 1:], prefilled.root])[None]  # [1, A]
        positions = torch.arange(begin, length, device=prompt_P.device)[None]
        mask = torch.arange(length, device=prompt_P.device)[None, None] <= positions[:, :, None]
        out = self._run(slice(row, row + 1), next_tokens, self.head.fuse(prefilled.taps[None].to(self.feature_BH.dtype)),
                        positions, mask, length)
        self.feature_BH[row] = out[0, -1]

    @torch.no_grad()
    def finish(self, seq) -> None:
        return None

    def observe(self, rows: slice, taps_nTX: torch.Tensor, path_nW: torch.Tensor, num_nodes_n: torch.Tensor,
                emitted_nW: torch.Tensor, lens_n: torch.Tensor, key_bound: int) -> None:
        """Run the head over each row's accepted nodes at the positions they commit to."""
        width = int(path_nW.shape[1])
        taps_nWX = taps_nTX.gather(1, path_nW[:, :, None].expand(-1, -1, taps_nTX.shape[-1]))
        positions_nW = lens_n[:, None] + torch.arange(width, device=lens_n.device)
        mask_nWK = torch.arange(key_bound, device=lens_n.device)[None, None] <= positions_nW[:, :, None]
        out = self._run(rows, emitted_nW, self.head.fuse(taps_nWX.to(self.feature_BH.dtype)), positions_nW,
                        mask_nWK, key_bound)
        self.feature_BH[rows] = out.gather(1, (num_nodes_n - 1)[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]

    def _level(self, rows: slice, lens_n: torch.Tensor, depth: int, num_run: int, tokens_nd: torch.Tensor,
               parent_features_ndH: torch.Tensor, ancestors_ndN: torch.Tensor, key_bound: int) -> torch.Tensor:
        """One draft depth's nodes (target ids [n, d], their parents' features [n, d, H], which of
        the num_run tree nodes run before them plus themselves they attend to [n, d, N]) -> their
        output features [n, d, H]. They go to the head cache's slots after the committed ones
        and the tree nodes run before them."""
        num_rows, num_nodes = tokens_nd.shape
        device = tokens_nd.device
        num_tree = num_run + num_nodes
        positions_nd = (lens_n - 1 + depth)[:, None].expand(num_rows, num_nodes)
        slots_nd = lens_n[:, None] + num_run + torch.arange(num_nodes, device=device)
        key_K = torch.arange(key_bound, device=device)
        offset_nK = key_K[None] - lens_n[:, None]  # a key's place among the tree nodes
        in_tree_nK = (offset_nK >= 0) & (offset_nK < num_tree)
        index_ndK = offset_nK.clamp(0, num_tree - 1)[:, None].expand(num_rows, num_nodes, key_bound)
        tree_ndK = ancestors_ndN.gather(2, index_ndK) & in_tree_nK[:, None]
        mask_ndK = (key_K[None, None] < lens_n[:, None, None]) | tree_ndK
        return self._run(rows, tokens_nd, parent_features_ndH, positions_nd, mask_ndK, key_bound, slots_nd)

    def _run(self, rows: slice, tokens_nT: torch.Tensor, features_nTH: torch.Tensor, positions_nT: torch.Tensor,
             mask_nTK: torch.Tensor, num_keys: int, slots_nT: torch.Tensor | None = None) -> torch.Tensor:
        """One head forward over T new rows per sequence (written at slots, default their
        positions; attending to num_keys slots under the mask) -> output features [n, T, H]."""
        slots_nT = positions_nT if slots_nT is None else slots_nT
        past = HeadWrite([_LayerWrite(kv, rows, slots_nT, num_keys) for kv in self.kv_BHMD])
        embeds = self.embeddings(tokens_nT).to(features_nTH.dtype)
        out, _ = self.head.step(embeds, features_nTH, positions_nT, past, mask_nTK[:, None])
        return out


class StaticEagleDrafter(_EagleDrafter):
    """A fixed tree, drafted level by level (module doc)."""

    def __init__(self, head: nn.Module, embeddings: nn.Module, tree: DraftTree):
        if tree.max_depth == 0:
            raise ValueError("an EAGLE drafter needs a tree with draft nodes")
        super().__init__(head, embeddings)
        self.tree = tree
        self.num_nodes, self.max_depth, self.max_children = tree.num_nodes, tree.max_depth, tree.max_children
        self.num_ranks = tree.max_rank + 1
        device = head.d2t.device
        self.plan = TreePlan(tree, device)
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

    def prepare(self, seqs: list, drafting: list[bool]) -> list[int]:
        return [int(draws) for draws in drafting]

    @torch.no_grad()
    def draft(self, rows: slice, roots_n: torch.Tensor, lens_n: torch.Tensor, key_bound: int) -> DraftBatch:
        """The rows' trees, one head call per level for all."""
        features = self.feature_BH[rows][:, None]  # [n, 1, H]
        tokens, num_run = [roots_n[:, None]], 0
        for depth, (parent_local, ranks, mask) in enumerate(self.levels, start=1):
            candidates = self.head.logits(features).topk(self.num_ranks, dim=-1).indices  # [n, n_{d-1}, R]
            level_tokens = self.draft_to_target[candidates[:, parent_local, ranks]]  # [n, n_d]
            tokens.append(level_tokens)
            if depth < len(self.levels):  # the last level's features are never read
                features = self._level(rows, lens_n, depth, num_run, level_tokens, features[:, parent_local],
                                       mask.expand(int(roots_n.shape[0]), -1, -1), key_bound)
                num_run += int(level_tokens.shape[1])
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


class DynamicEagleDrafter(_EagleDrafter):
    """EAGLE-2 trees (and AdaEDL early stopping), drafted anew every step (module doc)."""

    def __init__(self, head: nn.Module, embeddings: nn.Module, config: DynamicTreeConfig):
        if not isinstance(config, DynamicTreeConfig):
            raise TypeError(f"config must be a DynamicTreeConfig, got {type(config).__name__}")
        if config.top_k > head.draft_vocab_size:
            raise ValueError(f"tree.dynamic.top_k is {config.top_k} but the head's draft vocab has only "
                             f"{head.draft_vocab_size} tokens")
        super().__init__(head, embeddings)
        self.config = config
        self.num_nodes = min(config.num_nodes, config.max_candidates) + 1  # the rerank keeps a fixed size
        self.max_depth, self.max_children = config.depth, config.top_k

    def prepare(self, seqs: list, drafting: list[bool]) -> list[int]:
        return [int(draws) for draws in drafting]

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
    def expand(self, rows: slice, roots_n: torch.Tensor, lens_n: torch.Tensor, key_bound: int) -> DynamicDraft:
        """Every row's candidates, before the rerank."""
        head, config = self.head, self.config
        top_k, num_rows = config.top_k, int(roots_n.shape[0])
        features = self.feature_BH[rows][:, None]  # [m, 1, H]
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
        prev_offset, offset = 0, 0  # expanded-row offsets of the previous / current level (tree nodes run)
        level_k = torch.arange(top_k, device=device)
        for depth in range(1, config.depth):  # a frontier holds k or k*k nodes; stopped ones score -inf
            chosen = scores.topk(top_k, dim=-1).indices  # [m, k], frontier-local
            parent_local = frontier_parent.gather(1, chosen)  # [m, k]
            if depth > 1:
                ancestors[:, offset:offset + top_k, :offset] = ancestors[rows_m1, prev_offset + parent_local, :offset]
            ancestors[:, offset + level_k, offset + level_k] = True
            parent_features = features[rows_m1, parent_local]  # [m, k, H]
            features = self._level(rows, lens_n, depth, offset, self.draft_to_target[ids.gather(1, chosen)],
                                   parent_features, ancestors[:, offset:offset + top_k, :offset + top_k], key_bound)
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
        roots = roots_n[:, None]
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
    def draft(self, rows: slice, roots_n: torch.Tensor, lens_n: torch.Tensor, key_bound: int) -> DraftBatch:
        """The rows' EAGLE-2 trees, expanded together."""
        tree = self.rerank(self.expand(rows, roots_n, lens_n, key_bound))
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
