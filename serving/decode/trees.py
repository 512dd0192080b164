"""Draft trees: which candidate tokens a decode step drafts, how they attend, and which
path is accepted. Every tree constructor and the longest-accepted-path rule live here.

A tree is data. Node 0 is the root: the token the target already chose, so it is certain.
Every other node comes from a rank-path: (0, 2) is "the top-1 candidate of depth 1, then
the top-3 candidate of depth 2 under it" (see heads/tree_paths.py). A node at depth d
holds the rank-th top candidate of draft position d (Medusa head d-1).

Nodes are ordered by (depth, path), so a parent always comes before its children and
node indices are stable for a given set of paths. All tensors live on the CPU; the
decoder moves the ones it uses to the target's device once per tree.

Constructors (all return a `DraftTree`): `from_paths` (rank paths), `chain(depth)`,
`from_calibration` (best-first from measured accuracy), `default` (a prior guess).
`TreePlan` is a static tree's tensors on the target's device. `DynamicTreeConfig` is the
shape of an EAGLE-2 tree drafted anew every step (serving/decode/eagle.py builds its tensors
on the device). A step's drafts for the whole batch, lookup chains included, are a
serving/decode/draft_batch.py `DraftBatch`; the accept rules are serving/decode/accept.py's.
A heads directory's `tree` field is read in serving/decode/config.py.

Shape legend: T tree nodes (root included), L leaves, D max depth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Sequence

import torch

from specheads.heads.tree_paths import expand_paths

# The tree used when a heads directory records none: Medusa-style expansion over a prior
# guess of head accuracy (top-1 accuracy decaying with depth, lower ranks halving). Small
# on purpose: on a CPU the verify cost grows with the node count.
DEFAULT_NUM_DRAFT_NODES = 15
PRIOR_TOP1_ACCURACY = 0.6
PRIOR_DEPTH_DECAY = 0.75
PRIOR_RANK_DECAY = 0.5
PRIOR_NUM_RANKS = 4


def prior_accuracy(num_depths: int) -> list[list[float]]:
    """accuracy[depth][rank] for heads nobody has measured yet."""
    return [[PRIOR_TOP1_ACCURACY * PRIOR_DEPTH_DECAY ** depth * PRIOR_RANK_DECAY ** rank
             for rank in range(PRIOR_NUM_RANKS)] for depth in range(num_depths)]


def _check_paths(paths: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Normalise to sorted unique tuples; raise ValueError for malformed paths."""
    normalised = []
    for path in paths:
        path = tuple(int(rank) for rank in path)
        if not path:
            raise ValueError("a rank-path must not be empty: the root is implicit")
        if min(path) < 0:
            raise ValueError(f"ranks must be >= 0, got path {list(path)}")
        normalised.append(path)
    present = set(normalised)
    if len(present) != len(normalised):
        duplicates = sorted({p for p in normalised if normalised.count(p) > 1})
        raise ValueError(f"duplicate rank-paths: {[list(p) for p in duplicates]}")
    for path in normalised:
        for end in range(1, len(path)):
            if path[:end] not in present:
                raise ValueError(f"path {list(path)} needs its prefix {list(path[:end])}, "
                                 "which is not in the tree (every prefix of a path must be a path)")
    return sorted(normalised, key=lambda p: (len(p), p))


@dataclass(frozen=True)
class DraftTree:
    rank_paths: tuple[tuple[int, ...], ...]  # the draft nodes' rank-paths, in node order 1..T-1
    parents: torch.Tensor  # [T] long, parent node index; root -1
    depths: torch.Tensor  # [T] long, root 0
    ranks: torch.Tensor  # [T] long, candidate rank at its depth; root 0
    tree_mask: torch.Tensor  # [T, T] bool, node i attends to node j iff j is i or an ancestor of i
    position_offsets: torch.Tensor  # [T] long, position relative to the root (= depths)
    leaf_paths: torch.Tensor  # [L, D+1] long, root-to-leaf node indices, padded with -1

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "DraftTree":
        """Build a tree from rank-paths; every prefix of a path must itself be a path."""
        rank_paths = _check_paths(paths)
        index = {(): 0}
        parents, depths, ranks = [-1], [0], [0]
        for node, path in enumerate(rank_paths, start=1):
            index[path] = node
            parents.append(index[path[:-1]])
            depths.append(len(path))
            ranks.append(path[-1])
        num_nodes = len(parents)
        tree_mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
        for node in range(num_nodes):
            ancestor = node
            while ancestor >= 0:
                tree_mask[node, ancestor] = True
                ancestor = parents[ancestor]
        is_parent = set(parents[1:])
        leaves = [node for node in range(num_nodes) if node not in is_parent]
        max_depth = max(depths)
        leaf_paths = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            chain = []
            node = leaf
            while node >= 0:
                chain.append(node)
                node = parents[node]
            leaf_paths[row, :len(chain)] = torch.tensor(chain[::-1])
        depths_T = torch.tensor(depths, dtype=torch.long)
        return cls(rank_paths=tuple(rank_paths), parents=torch.tensor(parents, dtype=torch.long),
                   depths=depths_T, ranks=torch.tensor(ranks, dtype=torch.long), tree_mask=tree_mask,
                   position_offsets=depths_T.clone(), leaf_paths=leaf_paths)

    @classmethod
    def chain(cls, depth: int) -> "DraftTree":
        """The top-1 candidate at each of `depth` positions; chain(0) is the root alone."""
        if depth < 0:
            raise ValueError(f"chain depth must be >= 0, got {depth}")
        return cls.from_paths([(0,) * d for d in range(1, depth + 1)])

    @classmethod
    def from_calibration(cls, accuracy: list[list[float]], num_nodes: int) -> "DraftTree":
        """Best-first tree from measured accuracy[depth][rank].

        `num_nodes` is the budget of draft nodes, root excluded (as in expand_paths), so the
        result has up to num_nodes + 1 nodes.
        """
        return cls.from_paths(expand_paths(accuracy, num_nodes))

    @classmethod
    def default(cls, num_depths: int) -> "DraftTree":
        """A small tree for heads with no measured accuracy (see prior_accuracy)."""
        return cls.from_calibration(prior_accuracy(num_depths), DEFAULT_NUM_DRAFT_NODES)

    @property
    def num_nodes(self) -> int:
        """T, root included."""
        return int(self.parents.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.leaf_paths.shape[1]) - 1

    @property
    def max_rank(self) -> int:
        return int(self.ranks.max())

    @property
    def max_children(self) -> int:
        """The most children of one node (0 for the root alone)."""
        return int(torch.bincount(self.parents[1:]).max()) if self.num_nodes > 1 else 0

    @property
    def num_leaves(self) -> int:
        return int(self.leaf_paths.shape[0])

    @property
    def is_chain(self) -> bool:
        """True when the tree mask is the causal mask (every node a child of the previous)."""
        return bool(torch.equal(self.parents[1:], torch.arange(self.num_nodes - 1)))


class TreePlan:
    """A static tree's tensors on the target's device, prepared once per tree (a step's
    drafts: serving/decode/draft_batch.py `DraftBatch.from_plan`)."""

    def __init__(self, tree: DraftTree, device: torch.device):
        self.tree = tree
        self.num_nodes = tree.num_nodes
        self.max_depth = tree.max_depth
        self.is_chain = tree.is_chain  # then the causal mask is the tree mask
        self.tree_mask = tree.tree_mask.to(device)  # [T, T]
        self.position_offsets = tree.position_offsets.to(device)  # [T]
        self.parents = tree.parents.to(device)  # [T], root -1
        self.all_valid = torch.ones(tree.num_nodes, dtype=torch.bool, device=device)  # [T]
        self.max_children = tree.max_children


@dataclass(frozen=True)
class DynamicTreeConfig:
    """EAGLE-2 tree shape (serving/decode/eagle.py): `depth` draft levels, `top_k` candidates
    per expanded node and expanded nodes per level, `num_nodes` drafted nodes kept (root
    excluded); AdaEDL stops a branch when its acceptance bound < entropy_threshold (None: never)."""

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
