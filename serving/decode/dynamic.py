"""EAGLE-2 dynamic draft trees for EAGLE heads, and AdaEDL entropy-adaptive draft depth.

EAGLE-2 (`DynamicEagleDrafter`): the head's own confidence shapes the tree each step.
- expand: depth 1 is the root's top_k candidates. At each further depth the top_k frontier
  nodes by cumulative draft log-prob (the sum of log-probs along the path) are expanded,
  each with its top_k children; one head forward per depth runs the expanded nodes (each
  attends to the committed rows plus its expanded ancestors).
- rerank: after `depth` levels every drafted node is ranked by cumulative log-prob and the
  best `num_nodes` are kept. A child's cumulative log-prob never exceeds its parent's, and
  ties keep the earlier-created node (the parent) first, so the kept set is closed under
  ancestors.
A node's rank path is its candidate ranks under each parent, so DraftTree.from_paths would
give the same tree; `tree_from_parents` builds it with tensor ops instead (once per step).

AdaEDL ("entropy-based early draft stopping"): the probability that a drafted token is
accepted is bounded below by 1 - sqrt(gamma * H(p_draft)) (H in nats; gamma =
ADAEDL_GAMMA = 1/2, Pinsker's constant: acceptance = 1 - TV(p, q) >= 1 - sqrt(KL / 2), with
the draft entropy standing in for the unknown KL, as AdaEDL does). The bound is clamped to
[0, 1]. When it falls below `entropy_threshold` (lambda) at a node, that node's children
are not drafted: a branch stops (the whole draft, for chains). Depth 1 is always drafted (a
step without drafts gains nothing). So lambda = 0 never stops, lambda = 1 stops every branch
after depth 1 (unless the draft is certain). For Medusa's static trees,
`entropy_cut_depth` picks the depth at which to cut this step's tree from the heads' logits and
`DepthTruncatedTrees` holds the tree restricted to each depth, precomputed.

Shape legend: S committed positions, A rows committed since the last step, H hidden,
Vd draft vocab, k top_k, m expanded nodes at one depth, N drafted candidates, T tree nodes
(root included), L leaves, D depth, K Medusa heads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

from specheads.serving.decode.trees import DraftTree

ADAEDL_GAMMA = 0.5  # Pinsker: TV <= sqrt(KL / 2); AdaEDL's bound 1 - sqrt(gamma * H)


@dataclass(frozen=True)
class DynamicTreeConfig:
    """EAGLE-2 tree shape: `depth` draft levels, `top_k` candidates per expanded node and
    expanded nodes per level, `num_nodes` drafted nodes kept (root excluded); AdaEDL stops
    a branch when its acceptance bound < entropy_threshold (None: never)."""

    depth: int
    top_k: int
    num_nodes: int
    entropy_threshold: float | None = None

    def __post_init__(self):
        for name in ("depth", "top_k", "num_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"tree.dynamic.{name} must be an int >= 1, got {value!r}")
        threshold = self.entropy_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or not 0.0 <= threshold <= 1.0):
            raise ValueError(f"tree.dynamic.entropy_threshold must be None or a number in [0, 1] "
                             f"(a lower bound on the acceptance probability), got {threshold!r}")

    @property
    def max_candidates(self) -> int:
        """Drafted candidates before the rerank: k at depth 1, k*k at every further depth."""
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    def to_dict(self) -> dict:
        """The heads directory's config `tree` field: {"dynamic": {...}}."""
        return {"dynamic": asdict(self)}

    @classmethod
    def from_dict(cls, tree: dict) -> "DynamicTreeConfig":
        """From the config `tree` field ({"dynamic": {...}}); unknown keys fail by dotted name."""
        if not isinstance(tree, dict) or not isinstance(tree.get("dynamic"), dict):
            raise ValueError(f"tree must be a dict with a 'dynamic' dict (e.g. {{'dynamic': {{'depth': 5, "
                             f"'top_k': 8, 'num_nodes': 48}}}}), got {tree!r}")
        values = tree["dynamic"]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join('tree.dynamic.' + k for k in unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        missing = sorted(name for name in ("depth", "top_k", "num_nodes") if name not in values)
        if missing:
            raise ValueError(f"missing key(s) {', '.join('tree.dynamic.' + k for k in missing)}")
        return cls(**values)

    @classmethod
    def from_tree_field(cls, tree: dict | None) -> "DynamicTreeConfig | None":
        """The dynamic config a heads directory records, or None when its tree is static."""
        if not tree or "dynamic" not in tree:
            return None
        return cls.from_dict(tree)


def tree_from_heads_config(config) -> tuple["DraftTree | DynamicTreeConfig", float | None]:
    """The tree a heads directory records -> (DraftTree or DynamicTreeConfig, Medusa entropy
    threshold or None). `tree` holds {"dynamic": {...}} (EAGLE-2 trees), or {"paths": [...]}
    with an optional "entropy_threshold" (AdaEDL depth cuts for Medusa); without one the
    calibrated or default static tree (DraftTree.from_heads_config)."""
    dynamic = DynamicTreeConfig.from_tree_field(config.tree)
    if dynamic is not None:
        return dynamic, None
    return DraftTree.from_heads_config(config), (config.tree or {}).get("entropy_threshold")


def acceptance_bound(logits: torch.Tensor, gamma: float = ADAEDL_GAMMA) -> torch.Tensor:
    """AdaEDL's lower bound on acceptance, clamp(1 - sqrt(gamma * H(softmax(logits))), 0, 1)
    over the last dim (H in nats): [..., V] -> [...]."""
    entropy = torch.special.entr(torch.softmax(logits.float(), dim=-1)).sum(dim=-1).clamp(min=0.0)
    return (1.0 - (gamma * entropy).sqrt()).clamp(0.0, 1.0)


def entropy_cut_depth(head_logits_KV: torch.Tensor, threshold: float, min_depth: int = 1) -> int:
    """Medusa: the first depth (> min_depth) whose head's acceptance bound < threshold.

    head_logits [K, V]: head k predicts depth k+1. Nodes at the returned depth and deeper are
    dropped this step; K+1 means no cut. Depths <= min_depth are always kept.
    """
    if head_logits_KV.dim() != 2:
        raise ValueError(f"head_logits must be [K, V] (one row per head), got shape {tuple(head_logits_KV.shape)}")
    num_heads = int(head_logits_KV.shape[0])
    if min_depth >= num_heads:
        return num_heads + 1
    low = acceptance_bound(head_logits_KV[min_depth:]) < threshold  # heads min_depth.. -> depths min_depth+1..
    if not bool(low.any()):
        return num_heads + 1
    return min_depth + 1 + int(low.to(torch.uint8).argmax())


class DepthTruncatedTrees:
    """A static tree restricted to depth < d for every d in 1..D+1, built once.

    Nodes are ordered by depth, so the restricted tree's nodes are the first
    `num_nodes(d)` nodes of the full tree: tree tokens [T] cut as tokens[:num_nodes(d)].
    """

    def __init__(self, tree: DraftTree):
        self.full = tree
        depths = tree.depths.tolist()
        self._trees, self._num_nodes = {}, {}
        for cut in range(1, tree.max_depth + 2):
            paths = [path for path in tree.rank_paths if len(path) < cut]
            self._trees[cut] = DraftTree.from_paths(paths) if paths else DraftTree.chain(0)
            self._num_nodes[cut] = sum(1 for depth in depths if depth < cut)

    def tree(self, cut_depth: int) -> DraftTree:
        """The tree without nodes at depth >= cut_depth (cut_depth > D: the full tree)."""
        return self._trees[self._clamp(cut_depth)]

    def num_nodes(self, cut_depth: int) -> int:
        return self._num_nodes[self._clamp(cut_depth)]

    def _clamp(self, cut_depth: int) -> int:
        if cut_depth < 1:
            raise ValueError(f"cut_depth must be >= 1 (1 keeps the root alone), got {cut_depth}")
        return min(cut_depth, self.full.max_depth + 1)


def tree_from_parents(parents_T: torch.Tensor, ranks_T: torch.Tensor, depths_T: torch.Tensor) -> DraftTree:
    """A DraftTree from nodes already in (depth, path) order, with tensor ops.

    parents [T] (root -1), ranks [T], depths [T] long on the CPU; the result equals
    DraftTree.from_paths(its rank paths).
    """
    num_nodes = int(parents_T.shape[0])
    depth_list = depths_T.tolist()
    max_depth = depth_list[-1]
    tree_mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    tree_mask[0, 0] = True
    bounds = torch.searchsorted(depths_T, torch.arange(max_depth + 2)).tolist()  # level d: [bounds[d], bounds[d+1])
    for depth in range(1, max_depth + 1):
        lo, hi = bounds[depth], bounds[depth + 1]
        tree_mask[lo:hi] = tree_mask[parents_T[lo:hi]]
        level = torch.arange(lo, hi)
        tree_mask[level, level] = True
    is_parent = torch.zeros(num_nodes, dtype=torch.bool)
    is_parent[parents_T[1:]] = True
    leaves = (~is_parent).nonzero().flatten()
    rows, cols = tree_mask[leaves].nonzero(as_tuple=True)  # a leaf's ancestors, one per depth
    leaf_paths = torch.full((int(leaves.shape[0]), max_depth + 1), -1, dtype=torch.long)
    leaf_paths[rows, depths_T[cols]] = cols
    parent_list, rank_list = parents_T.tolist(), ranks_T.tolist()
    paths: list[tuple[int, ...]] = [()]
    for node in range(1, num_nodes):
        paths.append(paths[parent_list[node]] + (rank_list[node],))
    return DraftTree(rank_paths=tuple(paths[1:]), parents=parents_T, depths=depths_T, ranks=ranks_T,
                     tree_mask=tree_mask, position_offsets=depths_T.clone(), leaf_paths=leaf_paths)


def ranks_like(top_ids_mk: torch.Tensor) -> torch.Tensor:
    """[m, k] candidate ranks 0..k-1 in each row, flattened to [m*k]."""
    return torch.arange(top_ids_mk.shape[1], device=top_ids_mk.device).repeat(top_ids_mk.shape[0])


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
    """EAGLE-2 dynamic trees (and AdaEDL early stopping) for one sequence; see the module docstring.

    Same state contract as serving/decode/eagle.py's Eagle3Drafter: draft() first runs the head over
    the rows committed since the last step and sets state.draft_cache to cover all S positions.
    """

    def __init__(self, head: nn.Module, embeddings: nn.Module, tap_layers: list[int], config: DynamicTreeConfig):
        if not isinstance(config, DynamicTreeConfig):
            raise TypeError(f"config must be a DynamicTreeConfig, got {type(config).__name__}")
        if config.top_k > head.draft_vocab_size:
            raise ValueError(f"tree.dynamic.top_k is {config.top_k} but the head's draft vocab has only "
                             f"{head.draft_vocab_size} tokens")
        self.head, self.embeddings, self.config = head, embeddings, config
        self.tap_layers = list(tap_layers)
        self.draft_to_target = head.draft_to_target()  # [Vd]

    def _commit_rows(self, state):
        """Run the head over state's new rows; -> last row's output feature [1, 1, H], new cache."""
        from specheads.serving.decode.eagle import commit_head_rows

        return commit_head_rows(self.head, self.embeddings, state)

    def _children(self, logits_mV: torch.Tensor, parent_scores_m: torch.Tensor):
        """Top-k children of m nodes -> (draft ids [m*k], cumulative log-probs [m*k], ranks [m*k]).

        A parent scored -inf (stopped by AdaEDL) gives children scored -inf: never kept.
        """
        top_k = self.config.top_k
        logits = logits_mV.float()
        logp = torch.log_softmax(logits, dim=-1)
        top_logp, top_ids = logp.topk(top_k, dim=-1)  # [m, k]
        scores = parent_scores_m[:, None] + top_logp.clamp(max=0.0)
        return top_ids.reshape(-1), scores.reshape(-1), ranks_like(top_ids)

    @torch.no_grad()
    def expand(self, state) -> DynamicDraft:
        """Commit the new rows (sets state.draft_cache) and draft all candidates, before the rerank."""
        head, config = self.head, self.config
        top_k = config.top_k
        root_feature, cache = self._commit_rows(state)  # [1, 1, H]
        state.draft_cache = cache
        prefix_len = cache.keys.shape[2]
        device = root_feature.device
        zero = torch.zeros(1, device=device)
        ids, scores, ranks = self._children(head.logits(root_feature)[0], zero)  # depth 1: always drafted
        all_ids, all_scores, all_ranks = [ids], [scores], [ranks]
        all_parents = [torch.zeros(top_k, dtype=torch.long, device=device)]
        all_depths = [torch.ones(top_k, dtype=torch.long, device=device)]
        level_start = 1  # global index of the current frontier's first node
        level_features = root_feature  # output features of the nodes whose children form the frontier
        level_parent_local = torch.zeros(top_k, dtype=torch.long, device=device)  # frontier -> expanded index
        max_expanded = (config.depth - 1) * top_k
        ancestors = torch.zeros(max_expanded, max_expanded, dtype=torch.bool, device=device)
        prev_offset, offset = 0, 0  # expanded-row offsets of the previous / current level
        tree_k = tree_v = None
        for depth in range(1, config.depth):
            frontier_scores = scores
            num_live = int(torch.isfinite(frontier_scores).sum())
            if num_live == 0:
                break  # AdaEDL stopped every branch
            chosen = frontier_scores.topk(min(top_k, num_live)).indices  # [m], frontier-local
            num_chosen = int(chosen.shape[0])
            tokens = self.draft_to_target[ids[chosen]]
            embeds = self.embeddings(tokens[None]).to(level_features.dtype)  # [1, m, H]
            parent_local = level_parent_local[chosen]
            feature = level_features[:, parent_local]  # [1, m, H]
            rows = torch.arange(offset, offset + num_chosen, device=device)
            if depth > 1:
                ancestors[offset:offset + num_chosen, :offset] = ancestors[prev_offset + parent_local, :offset]
            ancestors[rows, rows] = True
            mask = torch.cat([torch.ones(num_chosen, prefix_len, dtype=torch.bool, device=device),
                              ancestors[offset:offset + num_chosen, :offset + num_chosen]], dim=1)
            positions = torch.full((1, num_chosen), prefix_len - 1 + depth, device=device)
            past_k = cache.keys if tree_k is None else torch.cat([cache.keys, tree_k], 2)
            past_v = cache.values if tree_v is None else torch.cat([cache.values, tree_v], 2)
            out, (k, v) = head.step(embeds, feature, positions, (past_k, past_v), mask[None, None])
            tree_k = k if tree_k is None else torch.cat([tree_k, k], 2)
            tree_v = v if tree_v is None else torch.cat([tree_v, v], 2)
            logits = head.logits(out)[0]  # [m, Vd]
            parent_scores = frontier_scores[chosen]
            if config.entropy_threshold is not None:  # AdaEDL: these nodes' children are not drafted
                stop = acceptance_bound(logits) < config.entropy_threshold
                parent_scores = parent_scores.masked_fill(stop, float("-inf"))
            ids, scores, ranks = self._children(logits, parent_scores)
            all_ids.append(ids)
            all_scores.append(scores)
            all_ranks.append(ranks)
            all_parents.append((level_start + chosen).repeat_interleave(top_k))
            all_depths.append(torch.full_like(ids, depth + 1))
            level_start += int(frontier_scores.shape[0])
            level_features = out
            level_parent_local = torch.arange(num_chosen, device=device).repeat_interleave(top_k)
            prev_offset, offset = offset, offset + num_chosen
        minus_one = torch.full((1,), -1, dtype=torch.long, device=device)
        return DynamicDraft(
            parents=torch.cat([minus_one] + all_parents), ranks=torch.cat([minus_one + 1] + all_ranks),
            depths=torch.cat([minus_one + 1] + all_depths),
            tokens=torch.cat([state.root.reshape(1)] + [self.draft_to_target[i] for i in all_ids]),
            scores=torch.cat([zero] + all_scores))

    def rerank(self, drafted: DynamicDraft) -> tuple[torch.Tensor, DraftTree]:
        """Keep the best num_nodes candidates; -> (tokens [T] in node order, tree)."""
        scores = drafted.scores[1:].cpu()
        # Stable descending sort: on a tie the earlier-created node (a parent before its child) wins.
        order = torch.sort(scores, descending=True, stable=True).indices
        num_keep = min(self.config.num_nodes, int(torch.isfinite(scores).sum()))
        kept = order[:num_keep] + 1  # global indices
        parents, ranks, depths = drafted.parents.cpu(), drafted.ranks.cpu(), drafted.depths.cpu()
        kept_depths = depths[kept]
        # (depth, parent's new index, rank) order = DraftTree's (depth, path) order, level by level.
        new_index = torch.full((int(parents.shape[0]),), -1, dtype=torch.long)
        new_index[0] = 0
        ordered = [torch.zeros(1, dtype=torch.long)]
        next_index = 1
        for depth in range(1, int(kept_depths.max()) + 1 if num_keep else 1):
            level = kept[kept_depths == depth]
            key = new_index[parents[level]] * self.config.top_k + ranks[level]
            level = level[torch.argsort(key)]
            new_index[level] = torch.arange(next_index, next_index + int(level.shape[0]))
            next_index += int(level.shape[0])
            ordered.append(level)
        nodes = torch.cat(ordered)  # [T] global indices in node order
        parents_T = new_index[parents[nodes]]
        parents_T[0] = -1
        tree = tree_from_parents(parents_T, ranks[nodes], depths[nodes])
        return drafted.tokens[nodes.to(drafted.tokens.device)], tree

    @torch.no_grad()
    def draft(self, state) -> tuple[torch.Tensor, DraftTree]:
        """DecodeState -> (tree tokens [T] long target ids, root first, in node order; the tree).

        Sets state.draft_cache to cover all S committed positions (as Eagle3Drafter does).
        """
        return self.rerank(self.expand(state))
