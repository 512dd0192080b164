"""`DraftBatch.join` merging chains into the heads' tree (serving/decode/draft_batch.py), and
what the merge is for: sampled acceptance that reaches a chain's tokens after a token it shares
with the heads.

Unit level, on hand-made trees: a chain that shares two tokens with the heads' tree and then
diverges, one that shares nothing, one that shares everything, two chains that share a prefix
with each other, a row whose chain goes alone, and nodes that must not be merged into (invalid,
padding, a later sibling with the same token). Every row is checked against brute force from
its parents (tree mask = ancestors + itself, depths, children), and the step's per-chain counts
(serving/decode/steps.py `chain_counts`) against the path.

Sampling: tree rejection sampling over a merged tree, on test_sampling.py's table model, keeps
the target's joint law of three tokens (chi-square) and accepts the chains' own nodes below a
shared one, which the old layout (each chain its own branch under the root) never did. On the
engine, with random Medusa heads and a chain source whose first token is the heads' first
candidate, the first three tokens follow the target and lookup_accepted counts the chain's
token below the shared one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.accept import accept_rejection, draw_uniforms
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.eagle import ancestor_mask
from specheads.serving.decode.generate import generate_many
from specheads.serving.decode.lookup import LookupConfig, NgramLookup
from specheads.serving.decode.sampling import RowSampling, SamplingParams, target_probs
from specheads.serving.decode.steps import chain_counts
from specheads.serving.decode.trees import DraftTree, TreePlan

from conftest import make_tiny_model
from test_decode_sampling import chi_square_p_value
from test_lookup import chain_batch, plan_batch
from test_sampling import BRANCHING, CONTEXT, NUM_SAMPLES, TARGET, chi_square, complete, draft_tree_tokens, \
    exact_joint

# Nodes: 0 root, 1 (0,), 2 (1,), 3 (0, 0), 4 (0, 1), 5 (1, 0), 6 (0, 0, 0)
PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
HEADS_TOKENS = [50, 11, 12, 13, 14, 15, 16]


def heads(rows: int = 1, tokens: list[int] = HEADS_TOKENS) -> DraftBatch:
    return plan_batch(PATHS, torch.tensor([tokens] * rows))


def ancestors_and_self(parents: list[int], node: int) -> set[int]:
    found = set()
    while node >= 0:
        found.add(node)
        node = parents[node]
    return found


def check_against_parents(drafts: DraftBatch, row: int) -> None:
    """Every node's mask row is its ancestors and itself (invalid and padding nodes too); a valid
    node's parent is valid, earlier and one level up; children() lists the valid children in
    node order, within max_children."""
    parents, depths, valid = drafts.parents[row].tolist(), drafts.depths[row].tolist(), drafts.valid[row].tolist()
    assert parents[0] == -1 and valid[0]
    children = drafts.children()[row].tolist()
    for node in range(drafts.num_nodes):
        assert set(drafts.tree_mask[row, node].nonzero()[:, 0].tolist()) == ancestors_and_self(parents, node), node
        if node and valid[node]:
            parent = parents[node]
            assert 0 <= parent < node and valid[parent] and depths[node] == depths[parent] + 1, node
        kids = [kid for kid in range(1, drafts.num_nodes) if valid[kid] and parents[kid] == node]
        assert children[node] == kids + [-1] * (drafts.max_children - len(kids)), node


def on_chain(drafts: DraftBatch, row: int, chain: int) -> list[int]:
    return drafts.on_chains[row, chain].nonzero()[:, 0].tolist()


def counts(drafts: DraftBatch, paths: list[list[int]]) -> list[list[int]]:
    """chain_counts for each row's accepted path (padded with the root, as accept pads)."""
    width = drafts.max_depth + 1
    path_nW = torch.tensor([path + [0] * (width - len(path)) for path in paths])
    return chain_counts(drafts, path_nW, torch.tensor([len(path) for path in paths])).tolist()


# -- join on hand-made trees ------------------------------------------------------------------------


def test_a_chain_follows_the_heads_tree_as_far_as_it_shares_then_branches_off():
    drafts = heads().join([chain_batch(torch.tensor([50]), [[11, 13, 7, 8]])])  # 11, 13: nodes 1, 3
    assert drafts.num_nodes == 7 + 4 and drafts.max_depth == 4 and drafts.max_children == 2 + 1
    assert drafts.tokens[0, 7:].tolist() == [11, 13, 7, 8]
    assert drafts.parents[0, 7:].tolist() == [0, 1, 3, 9]  # duplicates under the shared nodes' parents
    assert drafts.depths[0, 7:].tolist() == [1, 2, 3, 4]
    assert drafts.valid[0].tolist() == [True] * 7 + [False, False, True, True]
    assert drafts.children()[0, 3].tolist() == [6, 9, -1]  # the heads' child first, then the chain's
    assert on_chain(drafts, 0, 0) == [1, 3, 9, 10]
    assert counts(drafts, [[0, 1, 3, 9, 10]]) == [[4]] and counts(drafts, [[0, 1, 4]]) == [[1]]
    assert counts(drafts, [[0, 1, 3, 6]]) == [[2]] and counts(drafts, [[0, 2]]) == [[0]]
    check_against_parents(drafts, 0)


def test_a_chain_that_shares_nothing_hangs_under_the_root():
    drafts = heads().join([chain_batch(torch.tensor([50]), [[20, 21]])])
    assert drafts.parents[0, 7:].tolist() == [0, 7] and drafts.valid[0, 7:].all()
    assert drafts.children()[0, 0].tolist() == [1, 2, 7]
    assert on_chain(drafts, 0, 0) == [7, 8] and counts(drafts, [[0, 7, 8]]) == [[2]]
    check_against_parents(drafts, 0)


def test_a_chain_that_shares_everything_adds_no_valid_node_and_is_still_present():
    drafts = heads(2).join([chain_batch(torch.tensor([50, 50]), [[11, 13, 16]] * 2)])
    assert not drafts.valid[:, 7:].any() and drafts.parents[0, 7:].tolist() == [0, 1, 3]
    assert on_chain(drafts, 0, 0) == [1, 3, 6]  # the heads' path it repeats
    assert counts(drafts, [[0, 1, 3, 6], [0, 2, 5]]) == [[3], [0]]  # present (0, not -1) though not accepted
    check_against_parents(drafts, 0)


def test_a_later_chain_merges_into_an_earlier_chain():
    roots = torch.tensor([50])
    drafts = heads().join([chain_batch(roots, [[30, 31, 32]]), chain_batch(roots, [[30, 31, 40, 41]])])
    assert drafts.num_nodes == 7 + 3 + 4 and drafts.max_children == 2 + 2
    assert drafts.parents[0, 7:].tolist() == [0, 7, 8, 0, 7, 8, 12]
    assert drafts.valid[0, 7:].tolist() == [True] * 3 + [False, False, True, True]
    assert drafts.children()[0, 8].tolist()[:2] == [9, 12]
    assert on_chain(drafts, 0, 0) == [7, 8, 9] and on_chain(drafts, 0, 1) == [7, 8, 12, 13]
    assert counts(drafts, [[0, 7, 8, 12, 13]]) == [[2, 4]] and counts(drafts, [[0, 1]]) == [[0, 0]]
    check_against_parents(drafts, 0)


def test_a_row_whose_chain_goes_alone_merges_under_its_root_alone():
    roots = torch.tensor([50, 50])
    drafts = heads(2).join([chain_batch(roots, [[11, 13], [11, 13]], alone=[True, False])])
    assert drafts.valid.tolist() == [[True] + [False] * 6 + [True, True], [True] * 7 + [False, False]]
    assert drafts.parents[:, 7:].tolist() == [[0, 7], [0, 1]]
    assert on_chain(drafts, 0, 0) == [7, 8] and on_chain(drafts, 1, 0) == [1, 3]
    for row in range(2):
        check_against_parents(drafts, row)


def test_invalid_padding_and_repeated_nodes_are_not_merged_into():
    cut = heads(2)  # row 0: node 1 and its subtree left out (an AdaEDL cut); row 1 whole
    cut.valid = torch.tensor([[True, False, True, False, False, True, False], [True] * 7])
    drafts = cut.join([chain_batch(torch.tensor([50, 50]), [[11, 13], [11, 13]])])
    assert drafts.parents[:, 7:].tolist() == [[0, 7], [0, 1]]
    assert drafts.valid[:, 7:].tolist() == [[True, True], [False, False]]
    padded = heads().padded(9)  # padding nodes 7, 8: token 0, no parent
    drafts = padded.join([chain_batch(torch.tensor([50]), [[0, 5]])])
    assert drafts.parents[0, 9:].tolist() == [0, 9] and drafts.valid[0, 9:].all()
    check_against_parents(drafts, 0)
    # node 2 repeats node 1's token: the chain takes node 1 (the one a walk accepts), though
    # node 2's child holds its next token
    repeated = heads(tokens=[50, 11, 11, 13, 14, 15, 16]).join([chain_batch(torch.tensor([50]), [[11, 15]])])
    assert repeated.parents[0, 7:].tolist() == [0, 1] and repeated.valid[0, 7:].tolist() == [False, True]
    check_against_parents(repeated, 0)


def test_a_row_without_a_chain_or_that_does_not_draft_has_none_present():
    drafts = heads(2).join([chain_batch(torch.tensor([50, 50]), [[11, 20], []])])
    assert on_chain(drafts, 0, 0) == [1, 8] and on_chain(drafts, 1, 0) == []
    assert counts(drafts, [[0, 1, 8], [0, 1]]) == [[2], [-1]]
    drafts.valid = drafts.valid & (torch.arange(drafts.num_nodes) == 0)  # the step's plain rows
    assert counts(drafts, [[0], [0]]) == [[-1], [-1]]
    for row in range(2):
        check_against_parents(drafts, row)


# -- sampled acceptance through a merged tree (test_sampling.py's table model) ---------------------


def merged_and_old(num: int) -> tuple[DraftBatch, DraftBatch, list[int]]:
    """BRANCHING's top-k tree at CONTEXT (nodes 1-3 at depth 1, node 4 under node 1) and two
    chains: the heads' first candidate, then the target's likeliest other token after it, then
    two different tokens -> (the merged tree, the old layout with each chain its own branch
    under the root, the merged tree's chain nodes below the shared one)."""
    root = torch.tensor([CONTEXT[1]])
    tokens, _ = draft_tree_tokens(BRANCHING, root, torch.tensor([CONTEXT[0]]), 1.0, "topk",
                                  torch.Generator().manual_seed(0))
    first, heads_child = int(tokens[0, 1]), int(tokens[0, 4])
    after_first = TARGET[CONTEXT[1], first].clone()
    after_first[heads_child] = -float("inf")
    second = int(after_first.argmax())
    third = TARGET[first, second].argsort(descending=True)[:2].tolist()
    chains = [[first, second, third[0]], [first, second, third[1]]]
    base = DraftBatch.from_plan(TreePlan(BRANCHING, root.device), tokens.expand(num, -1))
    merged = base.join([chain_batch(root.expand(num), [chain] * num) for chain in chains])
    own = [node for node in range(BRANCHING.num_nodes, merged.num_nodes) if merged.valid[0, node]]
    assert merged.parents[0, own].tolist() == [1, 8, 8]  # the first chain's 2 nodes, the second's 1 beside
    parents = BRANCHING.parents.tolist() + [0, 7, 8, 0, 10, 11]
    old_tokens = torch.cat([tokens, torch.tensor([chains[0] + chains[1]])], 1).expand(num, -1)
    parents_nT = torch.tensor([parents]).expand(num, -1)
    old = DraftBatch(tokens=old_tokens, parents=parents_nT, depths=torch.tensor([[0, 1, 1, 1, 2, 2, 3] + [1, 2, 3] * 2])
                     .expand(num, -1), tree_mask=ancestor_mask(parents_nT, 3),
                     valid=torch.ones(num, len(parents), dtype=torch.bool), max_depth=3, max_children=3 + 2)
    return merged, old, own


def sample_table(drafts: DraftBatch, params: SamplingParams, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One accept per row over the table model's logits -> (each row's first 3 tokens completed by
    plain sampling [N, 3], accepted paths [N, W] padded with the root)."""
    num = int(drafts.tokens.shape[0])
    parent_tokens = drafts.tokens.gather(1, drafts.parents.clamp(min=0))
    parent_tokens[:, 0] = CONTEXT[0]
    logits = TARGET[parent_tokens, drafts.tokens]  # [N, T, V]: the table at each node's context
    uniforms = draw_uniforms([gen] * num, [True] * num, (drafts.max_depth, drafts.max_children), torch.device("cpu"))
    accepted = accept_rejection(drafts, logits, RowSampling.of([params] * num), uniforms)
    emitted = [accepted.emitted[i, :count].tolist() for i, count in enumerate(accepted.num_nodes.tolist())]
    taken = torch.arange(accepted.path.shape[1]) < accepted.num_nodes[:, None]
    return complete(emitted, params, torch.tensor([CONTEXT]).expand(num, 2), gen), accepted.path * taken


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)],
                         ids=["t1.0", "t1.0-top_p0.9"])
def test_a_merged_tree_samples_from_the_target_and_reaches_the_chains(params):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors
    try:
        merged, old, own = merged_and_old(NUM_SAMPLES)
        gen = torch.Generator().manual_seed(2)
        samples, paths = sample_table(merged, params, gen)
        stat, critical = chi_square(samples, exact_joint(params))
        assert stat < critical, (stat, critical)
        reached = torch.isin(paths, torch.tensor(own)).any(-1).sum().item()
        assert reached > NUM_SAMPLES // 20, reached  # the chains' own nodes below the shared node
        _, old_paths = sample_table(old, params, gen)
        assert not (old_paths >= BRANCHING.num_nodes).any()  # a repeated sibling is never accepted
    finally:
        torch.set_num_threads(threads)


# -- the engine: a chain whose first token is the heads' first candidate ----------------------------


PROMPT = [3, 5, 1, 6]
TREE_PATHS = [[0], [1], [2], [0, 0], [1, 0]]  # nodes 1-3 at depth 1; 4 under 1, 5 under 2
ENGINE_SAMPLES = 1200
P_VALUE = 1e-4


class FixedChain(NgramLookup):
    """A lookup drafter that proposes the same chain every step (the test chooses its tokens)."""

    def __init__(self, config: LookupConfig, chain: list[int]):
        super().__init__(config)
        self.chain = chain

    def attach(self, cache, max_cache_len: int) -> "FixedChain":
        state = super().attach(cache, max_cache_len)
        attached = FixedChain(self.config, self.chain)
        attached.history_BM, attached.chain_BL, attached.matched_B = state.history_BM, state.chain_BL, state.matched_B
        return attached

    def start(self, row: int, prefilled) -> torch.Tensor:
        self.chain_BL[row] = torch.tensor(self.chain)
        self.matched_B[row] = 1
        return self.matched_B[row:row + 1]

    def observe(self, rows, taps_nTX, path_nW, num_nodes_n, emitted_nW, lens_n, key_bound) -> torch.Tensor:
        return self.matched_B[rows, None]


@pytest.fixture(scope="module")
def engine_setup(tmp_path_factory):
    """A tiny-vocabulary target (as test_decode_sampling.py's), random Medusa heads, and the
    target's exact joint law of the first three tokens after PROMPT [V, V, V]."""
    directory = make_tiny_model("llama", tmp_path_factory.mktemp("tiny-vocab-llama"), seed=3, vocab_size=8,
                                hidden_size=32, num_layers=2)
    target = TargetAdapter.from_pretrained(directory)
    vocab = target.vocab_size
    with torch.no_grad():
        target.model.lm_head.weight.mul_(0.4)
        params = SamplingParams(temperature=1.0)
        p1 = target_probs(target(torch.tensor([PROMPT]), []).logits[0, -1:], params)[0].double()
        firsts = torch.tensor([PROMPT + [t] for t in range(vocab)])
        p2 = target_probs(target(firsts, []).logits[:, -1], params).double()
        pairs = torch.tensor([PROMPT + [t1, t2] for t1 in range(vocab) for t2 in range(vocab)])
        p3 = target_probs(target(pairs, []).logits[:, -1], params).double().reshape(vocab, vocab, vocab)
    torch.manual_seed(0)
    medusa = MedusaHeads(target.hidden_size, vocab, 2)
    nn.init.normal_(medusa.lm_head_weight, std=0.5)
    nn.init.normal_(medusa.block_weight, std=0.2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield target, medusa, params, p1[:, None, None] * p2[:, :, None] * p3
    torch.set_num_threads(threads)


def test_a_chain_through_a_head_candidate_samples_from_the_target(engine_setup):
    """The first verify step's heads' tree depends on the prompt alone (Medusa reads the prompt's
    last hidden state), so its candidates are known. The chain [c, x] starts with one of them
    and x is not the heads' child of c: it merges at c and x hangs below. Of those pairs, the
    one the target says most often as its 2nd and 3rd tokens: the walk reaches x as often
    (P(t2 = c, t3 = x): c is accepted with p(c), x after the heads' child with p(x | c))."""
    target, medusa, params, joint = engine_setup
    lookup = LookupConfig(num_tokens=2, alone_at_ngram=None)
    decoder = SpeculativeDecoder(target, medusa, DraftTree.from_paths(TREE_PATHS), lookup=lookup, fallback=None)
    with torch.no_grad():
        taps = torch.cat(target(torch.tensor([PROMPT]), decoder.tap_layers).taps, -1)[:, -1]
        tree = decoder.drafter.draft_tokens(taps, torch.zeros(1, dtype=torch.long))[0][0].tolist()
    later_VV = joint.sum(0).clone()  # [t2, t3]
    for node, child in ((1, 4), (2, 5)):  # a heads' child is not the chain's own node
        later_VV[tree[node], tree[child]] = 0.0
    rate, chain = max((float(later_VV[tree[node]].max()), [tree[node], int(later_VV[tree[node]].argmax())])
                      for node in (1, 2, 3))
    decoder.chain_sources = [FixedChain(lookup, chain)]  # in the lookup's place
    results = generate_many(decoder, [PROMPT] * ENGINE_SAMPLES, 3, max_batch_size=64, prefill_group=64,
                            sampling=[SamplingParams(temperature=1.0, seed=seed) for seed in range(ENGINE_SAMPLES)])
    sampled = torch.zeros_like(joint)
    for result in results:
        assert result.lossless and result.stats.lookup_steps >= 1
        sampled[tuple(result.tokens)] += 1
    below = sum(result.stats.lookup_accepted >= 2 for result in results)  # c, then the chain's own x
    assert rate > 0.02 and below > ENGINE_SAMPLES * rate / 2, (rate, below)
    assert chi_square_p_value(sampled, joint) > P_VALUE
