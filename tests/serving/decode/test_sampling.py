"""Lossless tree sampling: known outcomes on hand-built logits, refused modes, seeds, and a
statistical test that the output follows the target's processed distribution (with negative
controls showing the statistic catches wrong rules).

The engine's candidates are fixed in advance (the heads' top-k, lookup chains), and
serving/decode/accept.py has that rule alone; the tests run it batched, as the engine does. The rule for children *sampled* from a draft
distribution q (SpecInfer's, with or without replacement) lives here as a reference
(`accept_sampled_drafts`): the statistic confirms it on sampled drafts, and catches it when q
is not how the children were drawn, which shows the test can see a subtle bias.

The statistical "model" is a table: target logits L[prev2, prev1] -> [V] (a trigram
model over a tiny vocabulary), and a deliberately different draft table. The exact joint
distribution of the next K tokens is computed by enumeration; the empirical joint (one
accept step, then plain target sampling to fill K tokens) is compared by Pearson's
chi-square against a Wilson-Hilferty critical value at alpha = 1e-4. Everything is seeded,
so each verdict is reproducible.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specheads.serving.decode import accept
from specheads.serving.decode.accept import (accept_rejection, accept_tree_sampling, accept_typical, draw_uniforms,
                                             sibling_tests)
from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.sampling import (RowSampling, SamplingParams, TypicalAcceptance, make_generator,
                                               target_probs)
from specheads.serving.decode.trees import DraftTree, TreePlan

V = 5  # vocab
K = 3  # generated tokens whose joint distribution is tested
NUM_SAMPLES = 12_000
CONTEXT = (2, 3)  # (token before the root, root); the chain accepts depth 1 w.p. 0.74 at t=1
CHAIN = DraftTree.chain(2)
BRANCHING = DraftTree.from_paths([[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]])
Z_ALPHA = 3.719  # one-sided normal quantile for alpha = 1e-4


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: thread hand-offs would dominate the per-sample cost."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the table "model" ------------------------------------------------------------------

def make_tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """target logits [V, V, V] and a correlated but different draft table."""
    gen = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(V, V, V, generator=gen)
    draft = 0.5 * target + 1.2 * torch.randn(V, V, V, generator=gen)
    return target, draft


TARGET, DRAFT = make_tables()


def exact_joint(params: SamplingParams, context=CONTEXT, length: int = K) -> torch.Tensor:
    """P(t_1..t_length | context) under the processed target, flattened to [V ** length]."""
    probs = target_probs(TARGET.reshape(V * V, V).double(), params).reshape(V, V, V)
    joint = torch.zeros(V ** length, dtype=torch.float64)
    for cell, seq in enumerate(itertools.product(range(V), repeat=length)):
        history, prob = list(context), 1.0
        for token in seq:
            prob *= float(probs[history[-2], history[-1], token])
            history.append(token)
        joint[cell] = prob
    return joint


def node_context(tree: DraftTree, tokens_NT: torch.Tensor, before_root: torch.Tensor) -> torch.Tensor:
    """The token before each node ([N, T]): its parent's token, or the one before the root."""
    parent_tokens = tokens_NT[:, tree.parents.clamp_min(0)]
    parent_tokens[:, 0] = before_root
    return parent_tokens


def draft_tree_tokens(tree: DraftTree, root_N: torch.Tensor, before_root_N: torch.Tensor, draft_temperature: float,
                      how: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill the tree from the draft table, node by node. -> tokens [N, T], draft probs [N, T, V].

    how: "topk" (children = the draft's top-k by rank, deterministic), "without" (sequential
    sampling without replacement via Gumbel-top-k), "with" (i.i.d. draws).
    """
    num = root_N.shape[0]
    tokens = torch.zeros(num, tree.num_nodes, dtype=torch.long)
    tokens[:, 0] = root_N
    draft_probs = torch.zeros(num, tree.num_nodes, V)
    parents = tree.parents.tolist()
    for node in range(tree.num_nodes):
        prev = before_root_N if node == 0 else tokens[:, parents[node]]
        q = (DRAFT[prev, tokens[:, node]] / draft_temperature).softmax(dim=-1)  # [N, V]
        draft_probs[:, node] = q
        kids = [k for k in range(tree.num_nodes) if parents[k] == node]
        if not kids:
            continue
        if how == "topk":
            ranked = q.argsort(dim=-1, descending=True, stable=True)
            chosen = ranked[:, [int(tree.ranks[k]) for k in kids]]
        elif how == "without":
            gumbel = -torch.log(-torch.log(torch.rand(num, V, generator=gen)))
            chosen = (q.log() + gumbel).topk(len(kids), dim=-1).indices  # draw order
        else:
            chosen = torch.multinomial(q, len(kids), replacement=True, generator=gen)
        tokens[:, kids] = chosen
    return tokens, draft_probs


def residual(p_V: torch.Tensor, q_V: torch.Tensor) -> torch.Tensor:
    """normalise(max(p - q, 0)); p itself if rounding left no mass."""
    rest = (p_V - q_V).clamp_min(0.0)
    total = float(rest.sum())
    return rest / total if total > 0 else p_V


def accept_sampled_drafts(tree: DraftTree, tokens_T: torch.Tensor, logits_TV: torch.Tensor, params: SamplingParams,
                          gen: torch.Generator | None, draft_probs_TV: torch.Tensor, replacement: bool = False,
                          residual_rule=residual) -> list[int]:
    """Reference: recursive rejection sampling of children drawn from draft_probs (i.i.d. with
    replacement, or one after another without) -> the emitted tokens (accepted + final).
    p_1 = p_n, q_1 = q_n; accept x_i w.p. min(1, p_i(x_i) / q_i(x_i)); else p_{i+1} =
    residual(p_i, q_i) and q_{i+1} = q_i (with replacement) or q_i without x_i, renormalised."""
    probs_TV = target_probs(logits_TV, params).double()
    uniforms = torch.rand(tree.num_nodes, generator=gen, dtype=torch.float64).tolist()
    parents, tokens = tree.parents.tolist(), tokens_T.tolist()
    path, next_u = [0], 0
    while True:
        node = path[-1]
        kids = [k for k in range(tree.num_nodes) if parents[k] == node]
        p_V, q_V, chosen = probs_TV[node], draft_probs_TV[node].double(), None
        for kid in kids:
            u, next_u = uniforms[next_u], next_u + 1
            if u < float(p_V[tokens[kid]]) / float(q_V[tokens[kid]]):
                chosen = kid
                break
            p_V = residual_rule(p_V, q_V)
            if not replacement:
                q_V = q_V.clone()
                q_V[tokens[kid]] = 0.0
                q_V = q_V / float(q_V.sum()) if float(q_V.sum()) > 0 else q_V
        if chosen is None:
            final = int(torch.multinomial(p_V, 1, generator=gen))
            return [tokens[n] for n in path[1:]] + [final]
        path.append(chosen)


def complete(emitted: list[list[int]], params: SamplingParams, context_N2: torch.Tensor,
             gen: torch.Generator) -> torch.Tensor:
    """First K tokens: each sample's emitted tokens, then plain target sampling. -> [N, K]."""
    num = len(emitted)
    out = torch.full((num, K), -1, dtype=torch.long)
    for i, tokens in enumerate(emitted):
        out[i, :min(K, len(tokens))] = torch.tensor(tokens[:K])
    history = torch.cat([context_N2, out], dim=1)
    for pos in range(K):
        missing = history[:, 2 + pos] < 0
        if missing.any():
            probs = target_probs(TARGET[history[missing, pos], history[missing, pos + 1]], params)
            history[missing, 2 + pos] = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return history[:, 2:]


def chi_square(samples_NK: torch.Tensor, joint: torch.Tensor) -> tuple[float, float]:
    """Pearson statistic (cells with expected < 5 pooled) and its alpha = 1e-4 critical value.

    A sample in a zero-probability cell makes the statistic infinite.
    """
    num, length = samples_NK.shape
    cells = (samples_NK * (V ** torch.arange(length - 1, -1, -1))).sum(dim=1)
    observed = torch.bincount(cells, minlength=V ** length).double()
    if observed[joint == 0].sum() > 0:
        return math.inf, 0.0
    expected = num * joint
    big = expected >= 5
    obs_bins = torch.cat([observed[big], observed[~big & (joint > 0)].sum()[None]])
    exp_bins = torch.cat([expected[big], expected[~big & (joint > 0)].sum()[None]])
    keep = exp_bins > 0
    stat = float(((obs_bins[keep] - exp_bins[keep]) ** 2 / exp_bins[keep]).sum())
    dof = int(keep.sum()) - 1
    critical = dof * (1 - 2 / (9 * dof) + Z_ALPHA * math.sqrt(2 / (9 * dof))) ** 3
    return stat, critical


def run_static(tree: DraftTree, params: SamplingParams, how: str, *, num: int = NUM_SAMPLES,
               pass_draft_probs: bool | None = None, seed: int = 0, **accept_kwargs) -> tuple[float, float]:
    """One accept step per sample at CONTEXT, completed to K tokens; -> (statistic, critical).
    With the draft probabilities (default: for sampled drafts) the reference rule accepts
    (accept_kwargs: replacement, residual_rule), without them accept_tree_sampling (mode)."""
    gen = torch.Generator().manual_seed(seed)
    root = torch.full((num,), CONTEXT[1])
    before_root = torch.full((num,), CONTEXT[0])
    if how == "topk":  # deterministic: one tree for every sample
        tokens, draft_probs = draft_tree_tokens(tree, root[:1], before_root[:1], 1.0, how, gen)
        tokens, draft_probs = tokens.expand(num, -1), draft_probs.expand(num, -1, -1)
    else:
        tokens, draft_probs = draft_tree_tokens(tree, root, before_root, 1.0, how, gen)
    logits = TARGET[node_context(tree, tokens, before_root), tokens]  # [N, T, V]
    if pass_draft_probs is None:
        pass_draft_probs = how != "topk"
    if pass_draft_probs:
        emitted = [accept_sampled_drafts(tree, tokens[i], logits[i], params, gen, draft_probs[i], **accept_kwargs)
                   for i in range(num)]
    else:
        emitted = accept_rows(tree, tokens, logits, params, gen, **accept_kwargs)
    samples = complete(emitted, params, torch.tensor([CONTEXT]).expand(num, 2), gen)
    return chi_square(samples, exact_joint(params))


def accept_rows(tree: DraftTree, tokens_NT: torch.Tensor, logits_NTV: torch.Tensor, params: SamplingParams,
                gen: torch.Generator | None, mode: str = "rejection") -> list[list[int]]:
    """Every sample's accept step as one batch of rows (the engine's call) -> emitted tokens."""
    num = int(tokens_NT.shape[0])
    drafts = DraftBatch.from_plan(TreePlan(tree, tokens_NT.device), tokens_NT)
    rows = RowSampling.of([params] * num)
    if mode == "rejection":
        uniforms = draw_uniforms([gen] * num, [True] * num, (drafts.max_depth, drafts.max_children), tokens_NT.device)
        accepted = accept_rejection(drafts, logits_NTV, rows, uniforms)
    else:
        uniforms = draw_uniforms([gen] * num, [True] * num, (0, 0), tokens_NT.device)
        accepted = accept_typical(drafts, logits_NTV, rows, uniforms[:, -1], TypicalAcceptance())
    return [accepted.emitted[i, :count].tolist() for i, count in enumerate(accepted.num_nodes.tolist())]


SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
            SamplingParams(temperature=1.0, top_p=0.9)]
SETTING_IDS = ["t1.0", "t0.7", "t1.0-top_p0.9"]
T10, T07, TOP_P = SETTINGS
SLOW = pytest.mark.slow


# --- statistical losslessness -----------------------------------------------------------
# The default run covers every tree kind and drafting mode at least once and every
# setting on the deterministic trees; `-m slow` runs the rest of the matrix.

@pytest.mark.parametrize("params", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("tree", [CHAIN, BRANCHING], ids=["chain", "branching"])
def test_deterministic_topk_drafts_follow_the_target(tree, params):
    stat, critical = run_static(tree, params, "topk")
    assert stat < critical, (stat, critical)


@pytest.mark.parametrize("how, replacement, params", [
    ("without", False, TOP_P),
    ("with", True, T10),
    pytest.param("without", False, T10, marks=SLOW),
    pytest.param("without", False, T07, marks=SLOW),
    pytest.param("with", True, T07, marks=SLOW),
    pytest.param("with", True, TOP_P, marks=SLOW),
], ids=["without-t1.0-top_p0.9", "with-t1.0", "without-t1.0", "without-t0.7", "with-t0.7", "with-t1.0-top_p0.9"])
def test_sampled_drafts_follow_the_target(how, replacement, params):
    """The reference rule on sampled drafts (the statistic's check of itself)."""
    stat, critical = run_static(BRANCHING, params, how, replacement=replacement)
    assert stat < critical, (stat, critical)


@pytest.mark.parametrize("params", [T10, pytest.param(TOP_P, marks=SLOW)], ids=["t1.0", "t1.0-top_p0.9"])
def test_sampled_drafts_with_the_point_mass_rule_follow_the_target(params):
    """accept_tree_sampling's point-mass rule is exact for any candidates fixed before acceptance
    (a lower acceptance rate than the reference rule)."""
    stat, critical = run_static(BRANCHING, params, "without", pass_draft_probs=False)
    assert stat < critical, (stat, critical)


def dynamic_paths(q_root: torch.Tensor, root: int) -> list[tuple[int, ...]]:
    """EAGLE-style: expand a node 1 child if the draft is confident (top-1 > 0.5), else 2; depth 2."""
    def width(q):
        return 1 if float(q.max()) > 0.5 else 2
    paths = []
    order = q_root.argsort(descending=True, stable=True)
    for rank in range(width(q_root)):
        paths.append((rank,))
        q_child = DRAFT[root, int(order[rank])].softmax(dim=-1)
        paths.extend((rank, sub) for sub in range(width(q_child)))
    return paths


@pytest.mark.parametrize("params", [T07, pytest.param(T10, marks=SLOW), pytest.param(TOP_P, marks=SLOW)],
                         ids=["t0.7", "t1.0", "t1.0-top_p0.9"])
def test_dynamic_tree_follows_the_target(params):
    """The root varies (sampled from the target) and each root gets its own draft-built tree."""
    gen = torch.Generator().manual_seed(1)
    num = NUM_SAMPLES
    roots = torch.multinomial(target_probs(TARGET[CONTEXT[0], CONTEXT[1]][None], params)[0], num,
                              replacement=True, generator=gen)
    per_root = {}
    for root in range(V):
        tree = DraftTree.from_paths(dynamic_paths(DRAFT[CONTEXT[1], root].softmax(dim=-1), root))
        tokens, _ = draft_tree_tokens(tree, torch.tensor([root]), torch.tensor([CONTEXT[1]]), 1.0, "topk", gen)
        logits = TARGET[node_context(tree, tokens, torch.tensor([CONTEXT[1]])), tokens]
        per_root[root] = (tree, tokens[0], logits[0])
    assert len({tree.rank_paths for tree, _, _ in per_root.values()}) > 1, "roots should get different shapes"
    emitted = []
    for root, (tree, tokens, logits) in per_root.items():  # each root's samples as one batch
        count = int((roots == root).sum())
        rows = accept_rows(tree, tokens.expand(count, -1), logits.expand(count, -1, -1), params, gen)
        emitted += [[root] + row for row in rows]
    # Joint of (root, next two tokens) given CONTEXT: the root, the emitted tokens, then plain sampling.
    samples = complete(emitted, params, torch.tensor([CONTEXT]).expand(num, 2), gen)
    stat, critical = chi_square(samples, exact_joint(params))
    assert stat < critical, (stat, critical)


# --- negative controls: the same statistic catches wrong rules ---------------------------

def test_control_no_residual_update_is_detected(monkeypatch):
    """Rejected candidates keep their mass: the recovered token can repeat a rejected one."""
    original = accept.sibling_tests

    def keep_p(p_nV, kid_tokens_nC, has_nC, u_nC):
        passes, _ = original(p_nV, kid_tokens_nC, has_nC, u_nC)
        return passes, p_nV
    monkeypatch.setattr(accept, "sibling_tests", keep_p)
    stat, critical = run_static(CHAIN, T10, "topk")
    assert stat > critical, (stat, critical)


def test_control_sampled_residual_without_q_is_detected():
    stat, critical = run_static(BRANCHING, T10, "without", residual_rule=lambda p_V, q_V: p_V)
    assert stat > critical, (stat, critical)


def test_control_topk_candidates_with_draft_probs_are_detected():
    """q must be what the children were drawn from: top-k candidates are not draws from q."""
    stat, critical = run_static(BRANCHING, T10, "topk", pass_draft_probs=True)
    assert stat > critical, (stat, critical)


def test_control_without_replacement_draws_with_the_replacement_rule_are_detected():
    """A subtle mismatch: q not renormalised after each rejected sibling."""
    stat, critical = run_static(BRANCHING, T10, "without", replacement=True)
    assert stat > critical, (stat, critical)


def test_typical_acceptance_is_flagged_lossy_and_detected():
    tree = CHAIN
    tokens, _ = draft_tree_tokens(tree, torch.tensor([CONTEXT[1]]), torch.tensor([CONTEXT[0]]), 1.0, "topk",
                                  torch.Generator())
    logits = TARGET[node_context(tree, tokens, torch.tensor([CONTEXT[0]])), tokens]
    assert not accept_tree_sampling(tree, tokens[0], logits[0], T10, mode="typical").lossless
    assert accept_tree_sampling(tree, tokens[0], logits[0], T10).lossless
    stat, critical = run_static(tree, T10, "topk", mode="typical")
    assert stat > critical, (stat, critical)


# --- known outcomes ---------------------------------------------------------------------

def one_hot_logits(token: int, scale: float = 1e4) -> torch.Tensor:
    logits = torch.zeros(V)
    logits[token] = scale
    return logits


def test_certain_token_is_always_accepted():
    tree = DraftTree.chain(1)
    tokens = torch.tensor([0, 2])
    logits = torch.stack([one_hot_logits(2), torch.randn(V)])
    for seed in range(50):
        sample = accept_tree_sampling(tree, tokens, logits, SamplingParams(seed=seed),
                                      make_generator(SamplingParams(seed=seed)))
        assert sample.nodes.tolist() == [0, 1] and sample.emitted[0] == 2 and sample.final_kind == "bonus"


def test_impossible_tokens_are_rejected_and_never_recovered():
    """Children 1 and 2 have p = 0: always rejected; the recovered token is neither."""
    tree = DraftTree.from_paths([[0], [1], [2]])
    tokens = torch.tensor([0, 1, 2, 3])
    root_logits = torch.tensor([0.0, -math.inf, -math.inf, 0.0, 0.0])
    logits = torch.stack([root_logits] + [torch.zeros(V)] * 3)
    recovered = set()
    for seed in range(200):
        gen = make_generator(SamplingParams(seed=seed))
        sample = accept_tree_sampling(tree, tokens, logits, SamplingParams(), gen)
        assert sample.nodes[:2].tolist() != [0, 1] and sample.nodes[:2].tolist() != [0, 2]
        if sample.final_kind == "recovered":
            recovered.add(sample.emitted[-1])
    assert recovered and recovered.isdisjoint({1, 2})


def test_residual_after_rejecting_first_sibling_has_no_mass_there():
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0]], dtype=torch.float64)
    kids, has = torch.tensor([[0, 1]]), torch.tensor([[True, True]])
    passes, rest = sibling_tests(p, kids, has, torch.tensor([[0.99, 0.99]], dtype=torch.float64))
    assert not passes.any() and rest[0, 0] == 0 and rest[0, 1] == 0 and rest[0, 2:].sum() > 0
    q = torch.tensor([0.7, 0.1, 0.1, 0.1, 0.0])
    assert residual(p[0], q.double())[0] == 0  # the reference's residual: p(0) < q(0)
    # Second sibling's test uses the renormalised residual: p(1) / (1 - p(0)) = 0.5.
    passes, _ = sibling_tests(p, kids, has, torch.tensor([[0.99, 0.49]], dtype=torch.float64))
    assert passes.tolist() == [[False, True]]
    passes, _ = sibling_tests(p, kids, has, torch.tensor([[0.99, 0.51]], dtype=torch.float64))
    assert not passes.any()
    # A repeated child token has no mass left after its first rejection; padding slots never pass.
    passes, rest = sibling_tests(p, torch.tensor([[0, 0, 2]]), torch.tensor([[True, True, False]]),
                                 torch.tensor([[0.99, 0.0, 0.0]], dtype=torch.float64))
    assert passes.tolist() == [[False, False, False]] and rest[0, 2] > 0


def test_greedy_parameters_are_refused():
    """Greedy acceptance is accept_greedy's alone (tests/serving/decode/test_tree.py)."""
    for mode in ("rejection", "typical"):
        with pytest.raises(ValueError, match="decodes greedily, which accept_greedy accepts"):
            accept_tree_sampling(CHAIN, torch.zeros(3, dtype=torch.long), torch.zeros(3, V),
                                 SamplingParams(temperature=1e-6), mode=mode)


def test_bad_mode_and_typical_params_are_rejected():
    with pytest.raises(ValueError, match="mode must be 'rejection'"):
        accept_tree_sampling(CHAIN, torch.zeros(3, dtype=torch.long), torch.zeros(3, V), SamplingParams(), mode="x")
    with pytest.raises(ValueError, match=r"posterior_threshold must be in \[0, 1\]"):
        TypicalAcceptance(posterior_threshold=2)


def test_seed_gives_reproducible_outputs():
    tree = BRANCHING
    gen = torch.Generator().manual_seed(3)
    steps = [(torch.randint(0, V, (tree.num_nodes,), generator=gen), torch.randn(tree.num_nodes, V, generator=gen))
             for _ in range(30)]

    def run(seed):
        params = SamplingParams(temperature=0.8, seed=seed)
        request_gen = make_generator(params)
        return [accept_tree_sampling(tree, tokens, logits, params, request_gen).emitted for tokens, logits in steps]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert make_generator(SamplingParams()) is None
