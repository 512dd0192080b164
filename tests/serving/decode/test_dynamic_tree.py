"""EAGLE-2 dynamic trees (serving/decode/eagle.py) and AdaEDL (serving/decode/sampling.py, medusa.py).

A tiny random Llama target and a randomly initialised EAGLE-3 head. The reference for the
dynamic drafter is a brute-force re-implementation that runs the head along each path on
its own (no tree mask, no batching) and applies EAGLE-2's expand / rerank rules in Python.
(That the head's cache covers the committed positions across the engine's steps, for both
EAGLE drafters, is test_lookup.py's test_eagle_head_cache_covers_the_committed_positions_*.)
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from specheads.heads.draft_vocab import build_draft_vocab
from specheads.heads.eagle3 import Eagle3Head
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.cache import TreeStaticCache
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.eagle import DynamicEagleDrafter
from specheads.serving.decode.generate import generate
from specheads.serving.decode.medusa import entropy_cut_depths
from specheads.serving.decode.sampling import ADAEDL_GAMMA, acceptance_bound
from specheads.serving.decode.steps import prefill
from specheads.serving.decode.config import TreeSpec, parse_tree_field
from specheads.serving.decode.trees import DraftTree, DynamicTreeConfig

TAPS = [0, 1, 2]
DRAFT_VOCAB = 200
CONFIGS = [DynamicTreeConfig(depth=4, top_k=3, num_nodes=10), DynamicTreeConfig(depth=3, top_k=4, num_nodes=30),
           DynamicTreeConfig(depth=5, top_k=1, num_nodes=5), DynamicTreeConfig(depth=2, top_k=2, num_nodes=1)]


@pytest.fixture(scope="module")
def target(tiny_llama_dir) -> TargetAdapter:
    return TargetAdapter.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def head(target) -> Eagle3Head:
    text = target.text_config
    torch.manual_seed(0)
    head = Eagle3Head(target.hidden_size, target.vocab_size, DRAFT_VOCAB, text.num_attention_heads,
                      text.num_key_value_heads, text.intermediate_size, num_taps=len(TAPS))
    with torch.no_grad():
        for param in head.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
        head.lm_head.weight.mul_(4.0)  # peaked drafts of varied entropy, as a trained head's
    counts = torch.randint(0, 1000, (target.vocab_size,), generator=torch.Generator().manual_seed(1))
    head.set_draft_vocab(*build_draft_vocab(counts, DRAFT_VOCAB, [2]))
    return head.eval()


def prompt_state(target, seed: int) -> SimpleNamespace:
    """A prompt prefilled into a cache of its own: what a drafter's row starts from."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, target.vocab_size, (1, 4 + seed % 9), generator=generator)
    cache = TreeStaticCache(target.config, max_cache_len=prompt.shape[1] + 64)
    prefilled = prefill(target, prompt, TAPS, cache)
    return SimpleNamespace(cache=cache, prefilled=prefilled, root=prefilled.root, prefix_len=prompt.shape[1],
                           hidden=prefilled.taps, next_tokens=torch.cat([prompt[0, 1:], prefilled.root]))


@dataclasses.dataclass
class Tree:
    """One drafted row's valid nodes (the drafter's fixed-size row without its invalid ones)."""

    tokens: torch.Tensor  # [T] long
    parents: list[int]  # root -1
    depths: list[int]
    tree_mask: torch.Tensor  # [T, T] bool

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)


def draft_args(drafter, state) -> tuple:
    """The drafter attached to the state's cache, its row 0 started from the prefill -> the
    arguments of its draft and expand."""
    attached = drafter.attach(state.cache, state.cache.max_cache_len)
    attached.start(0, state.prefilled)
    return attached, (slice(0, 1), state.root, state.cache.lengths.device_lens[:1], state.cache.max_cache_len)


def expand_one(drafter, state):
    """One state's candidates before the rerank (row 0 of the batched expand)."""
    attached, args = draft_args(drafter, state)
    drafted = attached.expand(*args)
    return type(drafted)(**{name: value[0] for name, value in drafted.__dict__.items()})


def drafted_tree(drafter, state) -> Tree:
    """The valid nodes of one state's draft."""
    attached, args = draft_args(drafter, state)
    drafts = attached.draft(*args)
    keep = drafts.valid[0].nonzero()[:, 0]
    new_index = {int(old): new for new, old in enumerate(keep)}
    parents = [new_index.get(int(drafts.parents[0, old]), -1) for old in keep]
    return Tree(drafts.tokens[0, keep], parents, drafts.depths[0, keep].tolist(),
                drafts.tree_mask[0][keep][:, keep])


# -- brute force ---------------------------------------------------------------------------------------


class PathRunner:
    """Runs the head along one path at a time: committed rows (causal) + the path's nodes."""

    def __init__(self, head, embeddings, state):
        self.head, self.embeddings = head, embeddings
        feature = head.fuse(state.hidden[None])
        embeds = embeddings(state.next_tokens[None])
        num_rows = feature.shape[1]
        out, (self.keys, self.values) = head.step(embeds, feature, torch.arange(num_rows)[None])
        self.root_feature = out[:, -1:]
        self.prefix_len = num_rows
        self.d2t = head.draft_to_target()
        self._memo = {}

    def logits(self, path: tuple[int, ...]) -> torch.Tensor:
        """Draft logits [Vd] after the path (draft ids), the root's for ()."""
        if path not in self._memo:
            self._memo[path] = self.head.logits(self._feature(path))[0, 0].float()
        return self._memo[path]

    def _feature(self, path):
        feature, keys, values = self.root_feature, self.keys, self.values
        for depth, draft_id in enumerate(path, start=1):
            embeds = self.embeddings(self.d2t[draft_id].reshape(1, 1))
            mask = torch.ones(1, 1, 1, keys.shape[-2] + 1, dtype=torch.bool)
            position = torch.tensor([[self.prefix_len - 1 + depth]])
            feature, (k, v) = self.head.step(embeds, feature, position, (keys, values), mask)
            keys, values = torch.cat([keys, k], -2), torch.cat([values, v], -2)
        return feature


def brute_force(runner: PathRunner, config: DynamicTreeConfig) -> dict[tuple[int, ...], float]:
    """EAGLE-2 in plain Python -> {path of draft ids: cumulative log-prob} of the kept nodes."""
    candidates = []  # (path, score) in creation order

    def children(path, score):
        logp = torch.log_softmax(runner.logits(path), dim=-1)
        if path and config.entropy_threshold is not None:
            bound = 1 - (ADAEDL_GAMMA * -(logp.exp() * logp).sum()).sqrt().clamp(0, 1)
            if float(bound) < config.entropy_threshold:
                return []
        top = logp.topk(config.top_k)
        return [(path + (int(i),), score + float(v)) for v, i in zip(top.values, top.indices)]

    frontier = children((), 0.0)
    candidates += frontier
    for _ in range(1, config.depth):
        ranked = sorted(range(len(frontier)), key=lambda i: -frontier[i][1])[:config.top_k]
        frontier = [child for i in ranked for child in children(*frontier[i])]
        candidates += frontier
        if not frontier:
            break
    order = sorted(range(len(candidates)), key=lambda i: -candidates[i][1])[:config.num_nodes]
    return {candidates[i][0]: candidates[i][1] for i in order}


def tree_paths_as_draft_ids(tree: Tree, head) -> dict[tuple[int, ...], int]:
    """{path of draft ids from the root: node index} for every drafted node."""
    target_to_draft = {int(t): d for d, t in enumerate(head.draft_to_target().tolist())}
    paths = {0: ()}
    for node in range(1, tree.num_nodes):
        paths[node] = paths[tree.parents[node]] + (target_to_draft[int(tree.tokens[node])],)
    return {path: node for node, path in paths.items() if node}


def candidate_paths(drafted, head) -> dict[int, tuple[int, ...]]:
    """{candidate index: its path of draft ids} for a DynamicDraft (root: ())."""
    target_to_draft = {int(t): d for d, t in enumerate(head.draft_to_target().tolist())}
    paths = {0: ()}
    for node in range(1, drafted.tokens.shape[0]):
        paths[node] = paths[int(drafted.parents[node])] + (target_to_draft[int(drafted.tokens[node])],)
    return paths


def check_invariants(tree: Tree, config: DynamicTreeConfig, state) -> None:
    tokens = tree.tokens
    assert tokens.dtype == torch.long and tokens.shape == (tree.num_nodes,)
    assert int(tokens[0]) == int(state.root[0])
    assert 2 <= tree.num_nodes <= config.num_nodes + 1
    assert tree.max_depth <= config.depth
    parents = tree.parents
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, tree.num_nodes))  # parents first
    for node in range(1, tree.num_nodes):
        assert tree.depths[node] == tree.depths[parents[node]] + 1
    for parent in set(parents[1:]):
        siblings = [int(tokens[i]) for i in range(1, tree.num_nodes) if parents[i] == parent]
        assert len(siblings) == len(set(siblings))  # unique children per parent
    for node in range(tree.num_nodes):  # the mask holds the node and its ancestors, nothing else
        ancestors, walk = set(), node
        while walk >= 0:
            ancestors.add(walk)
            walk = parents[walk]
        assert set(tree.tree_mask[node].nonzero()[:, 0].tolist()) == ancestors


# -- the drafter ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS + [DynamicTreeConfig(depth=4, top_k=3, num_nodes=12,
                                                                entropy_threshold=0.45)])
def test_kept_nodes_are_the_best_by_cumulative_log_prob(target, head, config):
    drafter = DynamicEagleDrafter(head, target.embeddings(), config)
    for seed in range(3):
        state = prompt_state(target, seed)
        with torch.inference_mode():
            tree = drafted_tree(drafter, state)
            expected = brute_force(PathRunner(head, target.embeddings(), state), config)
        check_invariants(tree, config, state)
        got = tree_paths_as_draft_ids(tree, head)
        assert set(got) == set(expected)
        with torch.inference_mode():
            drafted = expand_one(drafter, state)  # the scores behind the rerank are the brute force's
        node_of = {path: node for node, path in candidate_paths(drafted, head).items()}
        for path, score in expected.items():
            assert abs(float(drafted.scores[node_of[path]]) - score) < 1e-4


def test_adaedl_threshold_zero_never_stops_and_one_stops_at_depth_one(target, head):
    base = DynamicTreeConfig(depth=4, top_k=3, num_nodes=20)
    state = prompt_state(target, 5)
    with torch.inference_mode():
        plain_tree = drafted_tree(DynamicEagleDrafter(head, target.embeddings(), base), state)
        zero = dataclasses.replace(base, entropy_threshold=0.0)
        zero_tree = drafted_tree(DynamicEagleDrafter(head, target.embeddings(), zero), state)
        one = dataclasses.replace(base, entropy_threshold=1.0)
        one_tree = drafted_tree(DynamicEagleDrafter(head, target.embeddings(), one), state)
        chain = DynamicTreeConfig(depth=5, top_k=1, num_nodes=5, entropy_threshold=1.0)
        chain_tree = drafted_tree(DynamicEagleDrafter(head, target.embeddings(), chain), state)
    assert torch.equal(plain_tree.tokens, zero_tree.tokens) and zero_tree.parents == plain_tree.parents
    assert plain_tree.max_depth == 4
    assert one_tree.max_depth == 1 and one_tree.num_nodes == 1 + base.top_k
    assert torch.equal(one_tree.tokens, plain_tree.tokens[:1 + base.top_k])  # depth 1: the root's top-k, rank order
    assert chain_tree.max_depth == 1  # a chain stops as a whole
    # A threshold between the expanded nodes' bounds stops exactly the branches below it.
    with torch.inference_mode():
        drafted = expand_one(DynamicEagleDrafter(head, target.embeddings(), base), state)
        runner = PathRunner(head, target.embeddings(), state)
        paths = candidate_paths(drafted, head)
        expanded = sorted({int(p) for p in drafted.parents[1:] if int(p) > 0})
        bounds = {node: float(acceptance_bound(runner.logits(paths[node]))) for node in expanded}
        threshold = float(torch.tensor(list(bounds.values())).median()) + 1e-6
        middle = dataclasses.replace(base, entropy_threshold=threshold)
        stopped_draft = expand_one(DynamicEagleDrafter(head, target.embeddings(), middle), state)
    low = {node for node, bound in bounds.items() if bound < threshold}
    assert 0 < len(low) < len(bounds)
    depth2 = [n for n in range(1, drafted.tokens.shape[0]) if int(drafted.depths[n]) == 2]
    for node in depth2:  # depth 2 is expanded from the same depth-1 nodes either way
        index = depth2.index(node)
        stopped_node = [n for n in range(1, stopped_draft.tokens.shape[0]) if int(stopped_draft.depths[n]) == 2][index]
        assert int(stopped_draft.tokens[stopped_node]) == int(drafted.tokens[node])
        assert torch.isfinite(stopped_draft.scores[stopped_node]) == (int(drafted.parents[node]) not in low)


def test_greedy_decoding_with_dynamic_trees_is_lossless(target, head):
    """The engine with dynamic trees (and AdaEDL) equals HF greedy decoding."""
    config = DynamicTreeConfig(depth=3, top_k=3, num_nodes=8, entropy_threshold=0.02)
    decoder = SpeculativeDecoder(target, head, config, tap_layers=TAPS)
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        prompt = torch.randint(3, target.vocab_size, (1, 4 + seed % 9), generator=generator)
        reference = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                          max_new_tokens=12, pad_token_id=0)[0, prompt.shape[1]:].tolist()
        assert generate(decoder, prompt[0].tolist(), 12).tokens == reference


# -- config, AdaEDL helpers -----------------------------------------------------------


def test_config_validation_and_round_trip():
    config = DynamicTreeConfig(depth=5, top_k=8, num_nodes=48, entropy_threshold=0.3)
    assert config.to_dict() == {"dynamic": {"depth": 5, "top_k": 8, "num_nodes": 48, "entropy_threshold": 0.3}}
    assert DynamicTreeConfig.from_dict(config.to_dict()) == config
    assert isinstance(parse_tree_field({"paths": [[0]]}).tree, DraftTree)
    assert parse_tree_field(config.to_dict()).tree == config
    with pytest.raises(ValueError, match="tree.dynamic.top_k"):
        DynamicTreeConfig(depth=2, top_k=0, num_nodes=4)
    with pytest.raises(ValueError, match="tree.dynamic.depth"):
        DynamicTreeConfig(depth=2.5, top_k=1, num_nodes=4)
    with pytest.raises(ValueError, match="entropy_threshold"):
        DynamicTreeConfig(depth=2, top_k=1, num_nodes=4, entropy_threshold=1.5)
    with pytest.raises(ValueError, match="tree.dynamic.width"):
        DynamicTreeConfig.from_dict({"dynamic": {"depth": 2, "top_k": 1, "num_nodes": 3, "width": 2}})
    with pytest.raises(ValueError, match="tree.dynamic.num_nodes"):
        DynamicTreeConfig.from_dict({"dynamic": {"depth": 2, "top_k": 1}})
    with pytest.raises(ValueError, match="'dynamic'"):
        DynamicTreeConfig.from_dict({"depth": 2})


def test_acceptance_bound_and_medusa_cut_depth():
    vocab = 50
    peaked = torch.full((vocab,), -30.0)
    peaked[3] = 30.0
    uniform = torch.zeros(vocab)
    half = torch.full((vocab,), -30.0)
    half[:2] = 0.0  # entropy ln 2
    bounds = acceptance_bound(torch.stack([peaked, uniform, half]))
    assert bounds[0] > 0.999 and bounds[1] == 0.0
    assert abs(float(bounds[2]) - (1 - (ADAEDL_GAMMA * torch.log(torch.tensor(2.0))).sqrt())) < 1e-5
    heads = torch.stack([peaked, peaked, half, uniform])[:, None]  # heads 0..3 predict depths 1..4; one row
    assert entropy_cut_depths(heads, 0.0).tolist() == [5]  # lambda 0: never cut
    assert entropy_cut_depths(heads, 0.5).tolist() == [3]  # head 2 (depth 3) is the first below 0.5
    assert entropy_cut_depths(heads, 0.2).tolist() == [4]
    two_rows = torch.stack([torch.stack([peaked, uniform]), torch.stack([uniform, peaked])], dim=1)  # [K=2, B=2, V]
    assert entropy_cut_depths(two_rows, 0.5).tolist() == [2, 3]  # depth 1 is always kept; each row its own cut
    assert entropy_cut_depths(two_rows, 0.5, min_depth=0).tolist() == [2, 1]
    with pytest.raises(ValueError, match=r"\[K, B, V\]"):
        entropy_cut_depths(uniform[None], 0.5)


def test_tree_spec_reads_every_stored_form():
    from types import SimpleNamespace

    paths = [[0], [1], [0, 0]]
    spec = TreeSpec.from_heads_config(SimpleNamespace(tree={"paths": paths}, calibration=None, num_heads=2))
    assert [list(p) for p in spec.tree.rank_paths] == paths and spec.entropy_threshold is None
    spec = TreeSpec.from_heads_config(SimpleNamespace(tree={"paths": paths, "entropy_threshold": 0.4},
                                                      calibration=None, num_heads=2))
    assert spec.entropy_threshold == 0.4
    spec = TreeSpec.from_heads_config(SimpleNamespace(
        tree={"dynamic": {"depth": 3, "top_k": 2, "num_nodes": 6}}, calibration=None, num_heads=4))
    assert spec.tree == DynamicTreeConfig(depth=3, top_k=2, num_nodes=6) and spec.entropy_threshold is None
