"""Static draft-tree shapes chosen from measured head accuracy.

A tree is a list of paths; a path is a tuple of ranks, one per depth: (0, 2) means "the
top-1 candidate of depth 1, then the top-3 candidate of depth 2 under it". The root (the
token the target itself already chose) is implicit. Every prefix of a path is a path.

`expand_paths` is Medusa's greedy expansion: the probability that a node is accepted is
approximated by the product of the measured top-k accuracies along its path
(accuracy[d][r] = P(rank-r candidate of depth d+1 is the target's token)), and nodes are
added best-first until the node budget is spent. Because every child scores no higher
than its parent, best-first order always adds a parent before its children.

It lives in heads/ because the heads directory stores the result and both training
(calibration) and serving (DraftTree.from_calibration) use it.
"""

from __future__ import annotations

import heapq


def expand_paths(accuracy: list[list[float]], num_nodes: int) -> list[tuple[int, ...]]:
    """accuracy [depth][rank] in [0, 1] -> up to `num_nodes` paths, best first."""
    if num_nodes < 1:
        raise ValueError(f"a tree needs num_nodes >= 1, got {num_nodes}")
    if not accuracy or not accuracy[0]:
        raise ValueError("accuracy needs at least one depth with at least one rank")
    max_depth = len(accuracy)
    chosen: list[tuple[int, ...]] = []
    # Frontier entries: (-score, path). A node's candidates are its first child and its
    # next sibling, so the frontier stays small.
    frontier = [(-accuracy[0][0], (0,))]
    while frontier and len(chosen) < num_nodes:
        neg_score, path = heapq.heappop(frontier)
        chosen.append(path)
        score = -neg_score
        depth, rank = len(path) - 1, path[-1]
        if rank + 1 < len(accuracy[depth]):
            parent_score = score / accuracy[depth][rank] if accuracy[depth][rank] > 0 else 0.0
            heapq.heappush(frontier, (-(parent_score * accuracy[depth][rank + 1]), path[:-1] + (rank + 1,)))
        if depth + 1 < max_depth:
            heapq.heappush(frontier, (-(score * accuracy[depth + 1][0]), path + (0,)))
    return sorted(chosen, key=lambda p: (len(p), p))


def expected_accepted_draft_tokens(paths: list[tuple[int, ...]], accuracy: list[list[float]]) -> float:
    """Expected accepted draft tokens per step under the independence approximation."""
    total = 0.0
    for path in paths:
        prob = 1.0
        for depth, rank in enumerate(path):
            prob *= accuracy[depth][rank]
        total += prob
    return total
