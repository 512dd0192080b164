"""Lossless speculative SAMPLING through the engine: the joint law of the first two tokens.

A tiny-vocabulary random Llama target (saved and loaded through save_pretrained /
from_pretrained) makes the joint distribution of the first two generated tokens small
enough to enumerate exactly: p(t1) p(t2 | t1) under the same temperature / top-k / top-p
processing (serving.decode.sampling.target_probs). Many seeded runs of the engine with random
Medusa heads on a branching tree must match it by a chi-square test at a conservative
level; the first two tokens come from the prefill's sample and the first verify step,
which exercises acceptance, sibling rejection and the recovered / bonus token. The same
holds for an EAGLE head drafting a dynamic (EAGLE-2) tree anew each step, and with n-gram
lookup chains (serving/decode/lookup.py): beside the heads' tree, and alone without heads. A negative
control (Medusa-2's lossy typical acceptance) must fail the same test, and is reported as
lossy.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats as scipy_stats
from torch import nn

from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.generate import generate
from specheads.serving.decode.trees import DynamicTreeConfig
from specheads.serving.decode.lookup import LookupConfig
from specheads.serving.decode.sampling import SamplingParams, target_probs
from specheads.serving.decode.trees import DraftTree

from conftest import make_tiny_model
from test_eagle3 import random_head

VOCAB = 8
PROMPT = [3, 5, 1, 6]
NUM_SAMPLES = 3000
NUM_HEADS = 2
# Three siblings at depth 1 (recursive rejection over ranks 0..2), one grandchild each for two.
TREE_PATHS = [[0], [1], [2], [0, 0], [1, 0]]
P_VALUE = 1e-4  # conservative: a correct sampler fails one config about once in 10,000 runs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = make_tiny_model("llama", tmp_path_factory.mktemp("tiny-vocab-llama"), seed=3,
                                vocab_size=VOCAB, hidden_size=32, num_layers=2)
    target = TargetAdapter.from_pretrained(directory)
    # Tame the init spread so the distributions are peaked but not near one-hot (rejections happen).
    with torch.no_grad():
        target.model.lm_head.weight.mul_(0.4)
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, NUM_HEADS)
    nn.init.normal_(heads.lm_head_weight, std=0.5)
    nn.init.normal_(heads.block_weight, std=0.2)
    decoder = SpeculativeDecoder(target, heads, DraftTree.from_paths(TREE_PATHS))
    # Thousands of tiny forwards: one intra-op thread is several times faster than contended threads.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield target, decoder
    torch.set_num_threads(num_threads)


def exact_joint(target: TargetAdapter, params: SamplingParams) -> torch.Tensor:
    """[V, V] p(t1) p(t2 | t1), enumerating every first token."""
    with torch.no_grad():
        p1 = target_probs(target(torch.tensor([PROMPT]), []).logits[0, -1:], params)[0].double()
        ids = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        p2 = target_probs(target(ids, []).logits[:, -1], params).double()  # [V, V]
    return p1[:, None] * p2


def empirical_counts(decoder: SpeculativeDecoder, params: SamplingParams, acceptance: str = "rejection",
                     num_samples: int = NUM_SAMPLES, stats: dict | None = None) -> tuple[torch.Tensor, int, bool]:
    """stats (optional) collects the summed lookup_steps and lookup_accepted."""
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    accepted, lossless = 0, True
    for seed in range(num_samples):
        sampling = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed)
        result = generate(decoder, PROMPT, 2, sampling=sampling, acceptance=acceptance)
        t1, t2 = result.tokens
        counts[t1, t2] += 1
        accepted += result.stats.accepted_tokens
        lossless = lossless and result.lossless
        if stats is not None:
            for name in ("lookup_steps", "lookup_accepted"):
                stats[name] = stats.get(name, 0) + getattr(result.stats, name)
    return counts, accepted, lossless


def chi_square_p_value(counts: torch.Tensor, joint: torch.Tensor) -> float:
    """Pearson chi-square; cells with expected count < 5 are pooled into one cell."""
    total = counts.sum()
    expected = (joint * total).flatten()
    observed = counts.flatten()
    assert float(observed[expected == 0].sum()) == 0, "a zero-probability pair was generated"
    big = expected >= 5
    exp_cells = torch.cat([expected[big], expected[~big].sum()[None]])
    obs_cells = torch.cat([observed[big], observed[~big].sum()[None]])
    keep = exp_cells > 0
    exp_cells, obs_cells = exp_cells[keep], obs_cells[keep]
    statistic = float(((obs_cells - exp_cells) ** 2 / exp_cells).sum())
    return float(scipy_stats.chi2.sf(statistic, df=int(keep.sum()) - 1))


@pytest.fixture(scope="module")
def dynamic_decoder(setup):
    """A random EAGLE-1/2-style head (last-layer tap, full vocabulary) drafting dynamic trees."""
    target, _ = setup
    head, config = random_head(target, seed=4, kind="eagle")
    tree = DynamicTreeConfig(depth=2, top_k=3, num_nodes=5)
    return SpeculativeDecoder(target, head, tree, tap_layers=config.tap_layers)


def assert_follows_the_target(target, decoder, params):
    joint = exact_joint(target, params)
    counts, accepted, lossless = empirical_counts(decoder, params)
    assert lossless
    assert accepted > NUM_SAMPLES // 10, "the heads' drafts were (almost) never accepted: the test would be vacuous"
    assert chi_square_p_value(counts, joint) > P_VALUE


# Each case costs 20-40 s on 2 cores: the default suite runs one per tree kind (between them every
# setting), -m slow the rest.
SETTINGS = {"t0.7": SamplingParams(temperature=0.7), "t1.0": SamplingParams(temperature=1.0),
            "t1.0-top_p0.9": SamplingParams(temperature=1.0, top_p=0.9)}
DEFAULT_CASES = {("static", "t1.0-top_p0.9"), ("dynamic", "t0.7")}


@pytest.mark.parametrize("tree_kind, params", [
    pytest.param(kind, params, id=f"{kind}-{name}", marks=() if (kind, name) in DEFAULT_CASES else pytest.mark.slow)
    for kind in ("static", "dynamic") for name, params in SETTINGS.items()])
def test_first_two_tokens_follow_the_target(setup, dynamic_decoder, params, tree_kind):
    target, decoder = setup
    if tree_kind == "dynamic":
        decoder = dynamic_decoder
    assert_follows_the_target(target, decoder, params)


@pytest.mark.parametrize("tree_kind", ["static", pytest.param("dynamic", marks=pytest.mark.slow)])
def test_the_captured_path_samples_from_the_target(setup, dynamic_decoder, tree_kind):
    """What a CUDA graph records (the static-shape cache and verify, run eagerly here) keeps
    the sampled accept exact, for both drafters."""
    target, decoder = setup
    source = decoder if tree_kind == "static" else dynamic_decoder
    decoder = SpeculativeDecoder(target, source.drafter.head if tree_kind == "dynamic" else source.drafter.heads,
                                 source.dynamic or source.tree, tap_layers=source.tap_layers, cuda_graphs="eager")
    params = SamplingParams(temperature=1.0)
    assert_follows_the_target(target, decoder, params)


@pytest.mark.slow  # lookup under sampling also runs in test_store.py (heads + lookup + store), by default
@pytest.mark.parametrize("with_heads", [True, False], ids=["medusa+lookup", "lookup-alone"])
def test_first_two_tokens_follow_the_target_with_lookup(setup, with_heads):
    """Lookup tokens are candidates fixed in advance, like the heads' top-k: the chain is
    merged into the heads' tree (test_draft_merge.py), or is the whole tree (no heads,
    alone_at_ngram=1). A second token that occurs in the prompt makes the first verify step
    look up (the prompt's own continuation of it)."""
    target, decoder = setup
    params = SamplingParams(temperature=1.0)
    lookup = LookupConfig(num_tokens=3, alone_at_ngram=None if with_heads else 1)
    heads = decoder.drafter.heads if with_heads else None
    looked_up = SpeculativeDecoder(target, heads, DraftTree.from_paths(TREE_PATHS) if with_heads else None,
                                   lookup=lookup)
    stats: dict = {}
    counts, accepted, lossless = empirical_counts(looked_up, params, stats=stats)
    assert lossless
    assert stats["lookup_steps"] > NUM_SAMPLES // 4 and stats["lookup_accepted"] > NUM_SAMPLES // 20, stats
    assert chi_square_p_value(counts, exact_joint(target, params)) > P_VALUE


@pytest.mark.slow  # 25 s; test_sampling.py's controls show the test detects a wrong rule, by default
def test_typical_acceptance_is_detected_and_reported_lossy(setup):
    target, decoder = setup
    params = SamplingParams(temperature=1.0)
    counts, _, lossless = empirical_counts(decoder, params, acceptance="typical")
    assert not lossless
    assert chi_square_p_value(counts, exact_joint(target, params)) < P_VALUE


def test_same_seed_same_output(setup):
    _, decoder = setup
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    first = generate(decoder, PROMPT, 24, sampling=params)
    second = generate(decoder, PROMPT, 24, sampling=params)
    assert first.tokens == second.tokens and len(first.tokens) == 24
    assert first.lossless and first.stats.lossless
    other = generate(decoder, PROMPT, 24, sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=4321))
    assert other.tokens != first.tokens


def test_plain_decoding_samples_from_the_target(setup):
    """No heads: one token per step from target_probs; same joint law."""
    target, _ = setup
    decoder = SpeculativeDecoder(target)
    params = SamplingParams(temperature=0.7)
    counts, accepted, lossless = empirical_counts(decoder, params, num_samples=1500)
    assert accepted == 0 and lossless
    assert chi_square_p_value(counts, exact_joint(target, params)) > P_VALUE


def test_greedy_sampling_params_equal_greedy(setup):
    _, decoder = setup
    assert generate(decoder, PROMPT, 12, sampling=SamplingParams(temperature=0.0)).tokens \
        == generate(decoder, PROMPT, 12).tokens


def test_typical_needs_sampling(setup):
    _, decoder = setup
    with pytest.raises(ValueError, match="typical"):
        generate(decoder, PROMPT, 4, acceptance="typical")
