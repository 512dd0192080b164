"""DraftTree: construction from rank-paths, validation, chains, calibration; the greedy accept
rule (serving/decode/accept.py) against a plain-Python reference."""

from __future__ import annotations

import pytest
import torch

from specheads.heads.artefacts.heads_dir import HeadsConfig
from specheads.heads.target.adapter import TargetIdentity
from specheads.heads.tree_paths import expand_paths
from specheads.serving.decode.config import TreeSpec
from specheads.serving.decode.accept import accept_greedy
from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.trees import DraftTree, TreePlan

# Nodes in (depth, path) order: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (0,1), 5 (1,0), 6 (0,0,0)
EXAMPLE_PATHS = [[0, 0, 0], [1], [0, 1], [0], [1, 0], [0, 0]]  # deliberately unsorted


def test_from_paths_matches_hand_built_example():
    tree = DraftTree.from_paths(EXAMPLE_PATHS)
    assert tree.num_nodes == 7 and tree.max_depth == 3 and tree.num_leaves == 3 and tree.max_rank == 1
    assert tree.rank_paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.ranks.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert torch.equal(tree.position_offsets, tree.depths)
    expected_mask = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert tree.tree_mask.dtype == torch.bool
    assert torch.equal(tree.tree_mask, expected_mask)
    assert tree.leaf_paths.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert not tree.is_chain


def test_leaf_paths_follow_parents():
    tree = DraftTree.from_paths(expand_paths([[0.8, 0.1, 0.05], [0.6, 0.2], [0.5, 0.1], [0.4]], 20))
    for path in tree.leaf_paths.tolist():
        nodes = [n for n in path if n >= 0]
        assert nodes[0] == 0
        assert all(tree.parents[child] == parent for parent, child in zip(nodes, nodes[1:]))
        assert [int(tree.depths[n]) for n in nodes] == list(range(len(nodes)))
    # A node's mask row is exactly its root path.
    for node in range(tree.num_nodes):
        ancestors, n = set(), node
        while n >= 0:
            ancestors.add(n)
            n = int(tree.parents[n])
        assert set(torch.nonzero(tree.tree_mask[node]).flatten().tolist()) == ancestors


@pytest.mark.parametrize("paths, message", [
    ([[0], [0, 1, 0]], r"prefix \[0, 1\]"),
    ([[1, 0]], r"prefix \[1\]"),
    ([[0], [0]], "duplicate"),
    ([[]], "empty"),
    ([[0], [-1]], ">= 0"),
])
def test_from_paths_rejects_malformed_paths(paths, message):
    with pytest.raises(ValueError, match=message):
        DraftTree.from_paths(paths)


def test_chain():
    tree = DraftTree.chain(4)
    assert tree.num_nodes == 5 and tree.max_depth == 4 and tree.num_leaves == 1
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]
    assert torch.equal(tree.tree_mask, torch.ones(5, 5, dtype=torch.bool).tril())
    assert tree.leaf_paths.tolist() == [[0, 1, 2, 3, 4]]
    assert tree.is_chain
    root_only = DraftTree.chain(0)
    assert root_only.num_nodes == 1 and root_only.max_depth == 0 and root_only.leaf_paths.tolist() == [[0]]
    with pytest.raises(ValueError):
        DraftTree.chain(-1)


def test_from_calibration_uses_expand_paths():
    accuracy = [[0.9, 0.05, 0.02], [0.7, 0.1], [0.5]]
    tree = DraftTree.from_calibration(accuracy, num_nodes=5)
    assert tree.num_nodes == 6  # 5 draft nodes + root
    assert set(tree.rank_paths) == set(expand_paths(accuracy, 5))
    assert tree.rank_paths[0] == (0,)


def greedy_reference(parents: list[int], tokens: list[int], target_tokens: list[int], valid: list[bool]) -> list[int]:
    """Walked node by node in plain Python: a node is correct when it is valid and its token is
    the target's argmax at its parent; the path ends at the deepest node whose ancestors are all
    correct, the lowest-numbered one on a tie (two correct siblings need a repeated token, and
    then both emit the same tokens)."""
    def run(node):
        chain = []
        while node > 0:
            if not valid[node] or tokens[node] != target_tokens[parents[node]]:
                return None
            chain.append(node)
            node = parents[node]
        return [0] + chain[::-1]

    runs = [r for r in (run(node) for node in range(len(parents))) if r is not None]
    return max(runs, key=lambda r: (len(r), -r[-1]))


def accept_one(drafts: DraftBatch, target_tokens_T: torch.Tensor) -> tuple[list[int], list[int]]:
    accepted = accept_greedy(drafts, target_tokens_T[None])
    count = int(accepted.num_nodes[0])
    return accepted.path[0, :count].tolist(), accepted.emitted[0, :count].tolist()


def test_accept_greedy_matches_the_reference():
    gen = torch.Generator().manual_seed(0)
    vocab = 5
    for tree, chain in ((DraftTree.from_paths(EXAMPLE_PATHS), 0), (DraftTree.chain(3), 0), (DraftTree.chain(0), 0),
                        (DraftTree.from_paths([[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]), 3)):
        plan = TreePlan(tree, torch.device("cpu"))
        for _ in range(200):
            drafts = DraftBatch.from_plan(plan, torch.randint(0, vocab, (1, tree.num_nodes), generator=gen))
            if chain:  # a lookup and a store chain, merged where they repeat the tree's tokens
                drafts = drafts.join([DraftBatch.chain(drafts.tokens[:, 0], torch.randint(0, vocab, (1, length),
                                                                                          generator=gen),
                                                       torch.ones(1, length, dtype=torch.bool))
                                      for length in (chain, chain - 1)])
            parents = drafts.parents[0].tolist()
            target_tokens = torch.randint(0, vocab, (drafts.num_nodes,), generator=gen)
            hit = torch.rand(drafts.num_nodes, generator=gen) < 0.6  # make long matches common
            tokens = drafts.tokens[0].clone()
            tokens[1:] = torch.where(hit[1:], target_tokens[drafts.parents[0, 1:]], tokens[1:])
            drafts.tokens = tokens[None]
            path, emitted = accept_one(drafts, target_tokens)
            expected = greedy_reference(parents, tokens.tolist(), target_tokens.tolist(), drafts.valid[0].tolist())
            assert path == expected
            assert emitted == [int(tokens[n]) for n in expected[1:]] + [int(target_tokens[expected[-1]])]


def test_accept_greedy_known_outcomes():
    plan = TreePlan(DraftTree.from_paths(EXAMPLE_PATHS), torch.device("cpu"))  # leaves 4, 5, 6
    target = torch.tensor([7, 8, 9, 5, 6, 4, 3])  # the target's argmax after each node

    def accept_tokens(tokens):
        return accept_one(DraftBatch.from_plan(plan, torch.tensor([tokens])), target)[0]

    # Node 1 (token 7) and 2 (token 7) are both correct; 1's subtree goes deeper.
    assert accept_tokens([0, 7, 7, 8, 8, 9, 5]) == [0, 1, 3, 6]
    # Two runs of length 2 (via 1 and via 2): the lower node (4, under 1) wins.
    assert accept_tokens([0, 7, 7, 0, 8, 9, 0]) == [0, 1, 4]
    # No draft node matches: the root alone.
    assert accept_tokens([0, 1, 1, 1, 1, 1, 1]) == [0]
    # An invalid node is never accepted, nor anything under it.
    drafts = DraftBatch.from_plan(plan, torch.tensor([[0, 7, 7, 8, 8, 9, 5]]))
    drafts.valid = torch.tensor([[True, True, True, False, True, True, True]])
    assert accept_one(drafts, target)[0] == [0, 1, 4]


def _heads_config(tree=None, calibration=None, num_heads=3):
    target = TargetIdentity("LlamaForCausalLM", "llama", 64, 256, 2, "tiny")
    return HeadsConfig(kind="medusa", hidden_size=64, vocab_size=256, num_heads=num_heads, num_layers=1,
                       tap_layers=[2], target=target, tree=tree, calibration=calibration)


def test_from_heads_config():
    tree = TreeSpec.from_heads_config(_heads_config(tree={"paths": [[0], [1], [0, 0]]})).tree
    assert tree.rank_paths == ((0,), (1,), (0, 0))
    calibrated = TreeSpec.from_heads_config(_heads_config(calibration={"accuracy": [[0.9, 0.1], [0.8], [0.7]]})).tree
    assert calibrated.max_depth <= 3 and calibrated.num_nodes > 1
    default = TreeSpec.from_heads_config(_heads_config(num_heads=4)).tree
    assert 1 < default.num_nodes and default.max_depth <= 4
    assert default.rank_paths == DraftTree.default(4).rank_paths
