"""N-gram lookup drafting (serving/decode/lookup.py) alone and beside the heads' tree.

Unit level: the device lookup `propose_chains` against a brute-force reference (longest
n-gram first, the most recent continuation, loops drafted by copying the draft itself; a
batch of contexts of different lengths in one call), `LookupConfig` validation, and
`DraftBatch.join`'s tree tensors checked against trees rebuilt from their parents. Engine
level, on the tiny random Llama: greedy decoding with lookup (no heads, random Medusa heads,
a random EAGLE-3 head on a static and on a dynamic tree, with and without `alone_at_ngram`)
equals HF greedy `generate`, and lookup chains really are accepted on prompts whose greedy
continuation loops. The EAGLE head's own cache covers exactly the target's committed
positions after every step, those that skipped the head included. In a batch, greedy rows
equal decoding alone and seeded sampled rows (which look up too) equal the same seeded
request alone. (That sampling with lookup keeps the target's distribution
is tested by chi-square in test_decode_sampling.py.)

Tiny random models loop only from some contexts, so the fixture picks, among short random
patterns repeated, the prompts whose greedy continuation repeats most.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.scheduler import Scheduler, SequenceRequest
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.generate import generate
from specheads.serving.decode.accept import accept_greedy
from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.steps import Prefilled
from specheads.serving.decode.trees import DynamicTreeConfig
from specheads.serving.decode.engine import BatchEngine
from specheads.serving.decode.lookup import LookupConfig, propose_chains
from specheads.serving.decode.sampling import SamplingParams
from specheads.serving.decode.trees import DraftTree, TreePlan

from test_batch import run_session
from test_eagle3 import random_head

NUM_NEW = 40
NUM_HEADS = 3
TREE_PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
PROMPT_LEN = 9
NUM_CANDIDATES = 48
NUM_REPETITIVE = 3


# -- propose_chains -----------------------------------------------------------------------------------


def reference_propose(tokens: list[int], config: LookupConfig) -> tuple[list[int], int]:
    """Brute force: for n = max_ngram..min_ngram, the latest earlier occurrence of the last n
    tokens that has a continuation; copy from there, then from the draft itself."""
    for n in range(min(config.max_ngram, len(tokens)), config.min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                context = list(tokens)
                for offset in range(config.num_tokens):
                    context.append(context[start + n + offset])
                return context[len(tokens):], n
    return [], 0


def index_config(**kwargs) -> LookupConfig:
    """A config for the lookup alone (alone_at_ngram only matters to the engine)."""
    return LookupConfig(alone_at_ngram=None, **kwargs)


def propose(config: LookupConfig, tokens: list[int] | None = None) -> tuple[list[int], int]:
    """propose_chains over one context (padded past its end, as a row of the history is)."""
    tokens = tokens or []
    history = torch.tensor([tokens + [0] * (config.num_tokens + 3)])
    chain, matched = propose_chains(history, torch.tensor([len(tokens)]), config)
    return (chain[0].tolist() if int(matched[0]) else []), int(matched[0])


def test_lookup_prefers_the_longest_match():
    tokens = [1, 2, 3, 4, 8, 2, 3, 5, 1, 2, 3]  # (1, 2, 3) -> 4 at the start; (2, 3) -> 5 more recently
    assert propose(index_config(num_tokens=3, max_ngram=3), tokens) == ([4, 8, 2], 3)
    assert propose(index_config(num_tokens=3, max_ngram=2), tokens) == ([5, 1, 2], 2)
    assert propose(index_config(num_tokens=2, max_ngram=1), tokens) == ([5, 1], 1)


def test_lookup_takes_the_most_recent_continuation():
    config = index_config(num_tokens=4, max_ngram=1)
    assert propose(config, [4, 1, 4, 2, 4]) == ([2, 4, 2, 4], 1)  # not (4 -> 1), the older one
    assert propose(config, [4, 1, 7, 4, 1, 9, 4]) == ([1, 9, 4, 1], 1)


def test_lookup_drafts_a_loop_by_copying_its_own_output():
    config = index_config(num_tokens=10, max_ngram=3)
    assert propose(config, [5, 6, 7, 5, 6, 7, 5]) == ([6, 7, 5] * 3 + [6], 3)
    assert propose(config, [3, 9, 9]) == ([9] * 10, 1)  # period 1: (9, 9) has no earlier match
    assert propose(index_config(num_tokens=5, max_ngram=2), [8, 1, 2, 1, 2]) == ([1, 2, 1, 2, 1], 2)


def test_lookup_without_a_match_and_min_ngram():
    config = index_config(num_tokens=4, max_ngram=3)
    assert propose(config, [1, 2, 3, 4, 9]) == ([], 0)
    assert propose(config, [7]) == ([], 0)
    assert propose(config) == ([], 0)
    tokens = [5, 6, 7, 5]
    assert propose(config, tokens) == ([6, 7, 5, 6], 1)
    assert propose(index_config(num_tokens=4, max_ngram=3, min_ngram=2), tokens) == ([], 0)
    # (6, 7, 5) matches with 3 tokens, so min_ngram=3 still drafts.
    assert propose(index_config(num_tokens=2, max_ngram=3, min_ngram=3), [5, 6, 7, 5, 6, 7, 5]) == ([6, 7], 3)


@pytest.mark.parametrize("config", [index_config(), index_config(num_tokens=7, max_ngram=4, min_ngram=2),
                                    index_config(num_tokens=3, max_ngram=1, min_ngram=1)])
def test_a_batch_of_contexts_equals_the_brute_force(config):
    """Every prefix of a random sequence as one row of one call (the rows' contexts differ in
    length; what lies past a row's context is never read)."""
    generator = torch.Generator().manual_seed(0)
    for vocab in (3, 6):
        tokens = torch.randint(0, vocab, (80,), generator=generator).tolist()
        history = torch.tensor([tokens + [0] * config.num_tokens] * len(tokens))
        lengths = torch.arange(1, len(tokens) + 1)
        chains, matched = propose_chains(history, lengths, config)
        for row, length in enumerate(lengths.tolist()):
            expected = reference_propose(tokens[:length], config)
            got = (chains[row].tolist() if int(matched[row]) else [], int(matched[row]))
            assert got == expected, length


# -- LookupConfig --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_tokens=0), "num_tokens"), (dict(num_tokens=-2), "num_tokens"), (dict(num_tokens=2.0), "num_tokens"),
    (dict(num_tokens=True), "num_tokens"), (dict(max_ngram=0), "max_ngram"), (dict(max_ngram="3"), "max_ngram"),
    (dict(min_ngram=0, alone_at_ngram=None), "min_ngram"), (dict(min_ngram=4, max_ngram=3), "min_ngram"),
    (dict(alone_at_ngram=4), "alone_at_ngram"), (dict(alone_at_ngram=0), "alone_at_ngram"),
    (dict(min_ngram=2, alone_at_ngram=1), "alone_at_ngram"), (dict(alone_at_ngram=2.0), "alone_at_ngram"),
    (dict(alone_at_ngram=True), "alone_at_ngram"),
])
def test_lookup_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LookupConfig(**kwargs)


def test_lookup_config_accepts_good_values():
    assert LookupConfig() == LookupConfig(num_tokens=10, max_ngram=3, min_ngram=1, alone_at_ngram=3)
    LookupConfig(num_tokens=1, max_ngram=1, min_ngram=1, alone_at_ngram=1)
    LookupConfig(num_tokens=4, max_ngram=5, min_ngram=2, alone_at_ngram=None)
    assert LookupConfig(max_ngram=2).alone_at_ngram == 2  # "max" follows max_ngram
    assert LookupConfig(max_ngram=5, alone_at_ngram="max").alone_at_ngram == 5
    with pytest.raises(ValueError, match="alone_at_ngram"):
        LookupConfig(alone_at_ngram="min")


# -- DraftBatch.join ------------------------------------------------------------------------------------


def ancestors(parents: list[int], node: int) -> set[int]:
    out = set()
    while node >= 0:
        out.add(node)
        node = parents[node]
    return out


def check_row(drafts: DraftBatch, row: int) -> None:
    """Every tensor of one row agrees with what its parents imply, over its valid nodes; the
    children table lists exactly the valid children, in node order."""
    parents, depths = drafts.parents[row].tolist(), drafts.depths[row].tolist()
    valid = drafts.valid[row].tolist()
    assert parents[0] == -1 and valid[0]
    children = drafts.children()[row].tolist()
    for node in range(drafts.num_nodes):
        if not valid[node]:
            continue
        if node:
            assert 0 <= parents[node] < node and valid[parents[node]] and depths[node] == depths[parents[node]] + 1
        assert set(drafts.tree_mask[row, node].nonzero()[:, 0].tolist()) == ancestors(parents, node)
        assert [c for c in children[node] if c >= 0] == [c for c in range(drafts.num_nodes)
                                                        if valid[c] and parents[c] == node and c]


def plan_batch(paths: list, tokens_nT: torch.Tensor) -> DraftBatch:
    return DraftBatch.from_plan(TreePlan(DraftTree.from_paths(paths), torch.device("cpu")), tokens_nT)


def chain_batch(roots: torch.Tensor, chains: list[list[int]], length: int | None = None,
                alone: list[bool] | None = None) -> DraftBatch:
    """Each row's chain (a list, [] for none) as a chain drafter's tree of `length` tokens."""
    length = length or max(len(chain) for chain in chains)
    tokens = torch.tensor([chain + [0] * (length - len(chain)) for chain in chains])
    valid = torch.arange(length)[None] < torch.tensor([len(chain) for chain in chains])[:, None]
    return DraftBatch.chain(roots, tokens, valid, None if alone is None else torch.tensor(alone))


def test_join_appends_a_chain_under_the_root():
    base = plan_batch([[0], [1], [0, 0]], torch.tensor([[10, 11, 12, 13]]))  # 0 root, 1 (0,), 2 (1,), 3 (0, 0)
    drafts = base.join([chain_batch(torch.tensor([10]), [[5, 6, 7]])])  # chain nodes 4, 5, 6
    assert drafts.num_nodes == 7 and drafts.max_depth == 3 and not drafts.is_chain
    assert drafts.tokens.tolist() == [[10, 11, 12, 13, 5, 6, 7]]
    assert drafts.parents.tolist() == [[-1, 0, 0, 1, 0, 4, 5]]
    assert drafts.depths.tolist() == [[0, 1, 1, 2, 1, 2, 3]]
    assert drafts.max_children == 3
    assert torch.equal(drafts.tree_mask[0, :4, :4], base.tree_mask[0])  # base nodes unchanged
    assert not drafts.tree_mask[0, :4, 4:].any()  # and blind to the chain
    assert drafts.tree_mask[0, 4:].tolist() == [[True, False, False, False, True, False, False],
                                                [True, False, False, False, True, True, False],
                                                [True, False, False, False, True, True, True]]
    assert drafts.children()[0, 0].tolist() == [1, 2, 4]  # the chain is the root's last child
    check_row(drafts, 0)


@pytest.mark.parametrize("paths, chains", [
    ([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]], [[7], [8, 9, 10, 11, 12, 13]]),
    ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], [[5, 6], []]),  # a chain base, and a row without a chain
    ([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], [list(range(20, 30)), [3, 4]]),
])
def test_join_keeps_every_row_a_tree(paths, chains):
    tree = DraftTree.from_paths(paths)
    base = plan_batch(paths, torch.arange(2 * tree.num_nodes).reshape(2, -1))
    longest = max(len(chain) for chain in chains)
    drafts = base.join([chain_batch(base.tokens[:, 0], chains)])
    assert drafts.num_nodes == tree.num_nodes + longest and drafts.max_depth == max(tree.max_depth, longest)
    for row, chain in enumerate(chains):
        check_row(drafts, row)
        assert drafts.valid[row].tolist() == [True] * tree.num_nodes + [i < len(chain) for i in range(longest)]
        assert drafts.tokens[row, tree.num_nodes:tree.num_nodes + len(chain)].tolist() == chain
        assert torch.equal(drafts.tree_mask[row, :tree.num_nodes, :tree.num_nodes], tree.tree_mask)


def test_a_chain_that_goes_alone_leaves_out_the_heads_nodes_of_its_row():
    base = plan_batch([[0], [1], [0, 0]], torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]]))
    drafts = base.join([chain_batch(base.tokens[:, 0], [[5, 6], [7, 8]], alone=[True, False])])
    assert drafts.valid.tolist() == [[True, False, False, False, True, True], [True] * 6]
    for row in range(2):
        check_row(drafts, row)


@pytest.mark.parametrize("length", [1, 4])
def test_a_chain_on_a_root_alone_is_a_pure_chain(length):
    drafts = DraftBatch.roots(torch.tensor([9])).join([chain_batch(torch.tensor([9]), [list(range(length))])])
    check_row(drafts, 0)
    assert drafts.is_chain and drafts.num_nodes == length + 1 and drafts.max_depth == length
    assert torch.equal(drafts.tree_mask[0], torch.ones(length + 1, length + 1, dtype=torch.bool).tril())


def test_accept_on_a_combined_tree_picks_the_longest_match():
    tokens = torch.tensor([[10, 11, 12, 13]])
    # The chain's 11 is the heads' node 1: it merges there (its own node 4 is an invalid
    # duplicate) and its 5, 6 hang below node 1 as nodes 5, 6.
    drafts = plan_batch([[0], [1], [0, 0]], tokens).join([chain_batch(tokens[:, 0], [[11, 5, 6]])])
    assert drafts.parents[0].tolist() == [-1, 0, 0, 1, 0, 1, 5] and not drafts.valid[0, 4]
    apart = plan_batch([[0], [1], [0, 0]], torch.tensor([[10, 99, 98, 97]])).join(
        [chain_batch(tokens[:, 0], [[20, 21, 22]])])  # shares nothing: nodes 4, 5, 6 under the root

    def run(target_after_node: list[int], tree: DraftBatch = drafts):
        accepted = accept_greedy(tree, torch.tensor([target_after_node]))
        count = int(accepted.num_nodes[0])
        return accepted.path[0, :count].tolist(), accepted.emitted[0, :count].tolist()

    # The chain 0 -> 1 -> 5 -> 6 matches (4 nodes) through the heads' node 1.
    assert run([11, 5, 0, 40, 0, 6, 23]) == ([0, 1, 5, 6], [11, 5, 6, 23])
    # The chain breaks after its shared token: the heads' branch 0 -> 1 -> 3 wins.
    assert run([11, 13, 0, 40, 0, 6, 23]) == ([0, 1, 3], [11, 13, 40])
    # Only the root: nothing matches.
    assert run([11 + 100, 0, 0, 0, 9, 0, 0]) == ([0], [111])
    assert run([20, 0, 0, 0, 21, 9, 0], apart) == ([0, 4, 5], [20, 21, 9])
    # The invalid duplicate of node 1 is never accepted, though its token matches.
    assert run([11, 40, 0, 0, 5, 0, 0]) == ([0, 1], [11, 40])


# -- the engine -------------------------------------------------------------------------------------


def hf_greedy(target: TargetAdapter, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def lookup_hits(prompt: list[int], continuation: list[int]) -> int:
    """Continuation tokens a 1-token lookup would have drafted right (a cheap repetition score)."""
    config = LookupConfig(num_tokens=1)
    return sum(reference_propose(prompt + continuation[:i], config)[0] == [token]
               for i, token in enumerate(continuation))


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    """(target, prompts, HF greedy references); prompts[:NUM_REPETITIVE] loop under greedy decoding."""
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    generator = torch.Generator().manual_seed(11)
    candidates = []
    for index in range(NUM_CANDIDATES):
        pattern = torch.randint(3, target.vocab_size, (1 + index % 3,), generator=generator).tolist()
        candidates.append((pattern * PROMPT_LEN)[:PROMPT_LEN])
    ids = torch.tensor(candidates)
    with torch.no_grad():  # one batched generate to rank the candidates; the references are per prompt
        continuations = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                              max_new_tokens=NUM_NEW, eos_token_id=None,
                                              pad_token_id=0)[:, PROMPT_LEN:].tolist()
    ranked = sorted(range(NUM_CANDIDATES), key=lambda i: -lookup_hits(candidates[i], continuations[i]))
    prompts = [candidates[i] for i in ranked[:NUM_REPETITIVE]]
    prompts.append(torch.randint(3, target.vocab_size, (13,), generator=generator).tolist())  # no repeats
    references = [hf_greedy(target, prompt, NUM_NEW) for prompt in prompts]
    return target, prompts, references


def random_medusa(target: TargetAdapter) -> MedusaHeads:
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, NUM_HEADS)
    heads.init_lm_heads_from(target.lm_head())  # plausible candidates: often the target's own top tokens
    nn.init.normal_(heads.block_weight, std=0.2)
    return heads.eval()


def make_decoder(target: TargetAdapter, kind: str, lookup: LookupConfig | None) -> SpeculativeDecoder:
    """fallback=None: whether a request speculates must not depend on measured timings here."""
    if kind == "lookup":
        return SpeculativeDecoder(target, lookup=lookup, fallback=None)
    if kind == "medusa":
        return SpeculativeDecoder(target, random_medusa(target), DraftTree.from_paths(TREE_PATHS), lookup=lookup,
                                  fallback=None)
    head, config = random_head(target, seed=3)
    tree = DraftTree.from_paths(TREE_PATHS) if kind == "eagle3-static" \
        else DynamicTreeConfig(depth=3, top_k=2, num_nodes=6)
    return SpeculativeDecoder(target, head, tree, tap_layers=config.tap_layers, lookup=lookup, fallback=None)


def test_fixture_prompts_loop_under_greedy_decoding(setup):
    target, prompts, references = setup
    for prompt, reference in zip(prompts[:NUM_REPETITIVE], references):
        assert lookup_hits(prompt, reference) >= 4, (prompt, reference)


@pytest.mark.parametrize("alone_at_ngram", [None, 3])
@pytest.mark.parametrize("kind", ["lookup", "medusa", "eagle3-static", "eagle3-dynamic"])
def test_greedy_decoding_with_lookup_is_lossless(setup, kind, alone_at_ngram):
    target, prompts, references = setup
    lookup = LookupConfig(alone_at_ngram=alone_at_ngram)
    decoder = make_decoder(target, kind, lookup)
    base_nodes = 1 if kind == "lookup" else 7 if kind == "eagle3-dynamic" else len(TREE_PATHS) + 1
    assert decoder.max_tree_nodes == base_nodes + lookup.num_tokens  # the cache holds one combined tree
    for index, (prompt, reference) in enumerate(zip(prompts, references)):
        result = generate(decoder, prompt, NUM_NEW)
        stats = result.stats
        assert result.tokens == reference, (kind, index)
        assert result.finish_reason == "length" and stats.num_new_tokens == NUM_NEW
        assert 0 <= stats.lookup_accepted <= stats.accepted_tokens
        assert stats.lookup_steps <= stats.steps
        assert 1 + stats.steps + stats.accepted_tokens >= NUM_NEW  # tau counts the lookup tokens too
        if index < NUM_REPETITIVE:
            assert stats.lookup_steps > 0 and stats.lookup_accepted > 0, (kind, index, stats)
            assert stats.steps < NUM_NEW - 1  # fewer verify steps than plain decoding
        if kind == "lookup":
            # Without heads every speculative step is a lookup step; the rest are plain.
            assert stats.lookup_steps + stats.plain_steps == stats.steps
            assert stats.lookup_accepted == stats.accepted_tokens


def test_lookup_without_a_match_is_plain_decoding(setup):
    target, _, _ = setup
    decoder = make_decoder(target, "lookup", LookupConfig())
    prompt = list(range(20, 32))
    reference = hf_greedy(target, prompt, 5)
    context = prompt + reference
    assert len(set(context)) == len(context)  # no token repeats, so no n-gram ever matches
    result = generate(decoder, prompt, 5)
    assert result.tokens == reference
    assert result.stats.lookup_steps == 0 and result.stats.plain_steps == result.stats.steps == 4


def test_speculate_false_and_lookup_off_never_look_up(setup):
    target, prompts, references = setup
    decoder = make_decoder(target, "medusa", LookupConfig())
    result = generate(decoder, prompts[0], NUM_NEW, speculate=False)
    assert result.tokens == references[0]
    assert result.stats.lookup_steps == 0 and result.stats.plain_steps == result.stats.steps
    plain_heads = generate(make_decoder(target, "medusa", None), prompts[0], NUM_NEW)
    assert plain_heads.tokens == references[0] and plain_heads.stats.lookup_steps == 0


@pytest.mark.parametrize("kind", ["eagle3-static", "eagle3-dynamic"])
def test_eagle_head_cache_covers_the_committed_positions_when_lookup_skips_the_head(setup, kind):
    """After every step (those whose lookup chain went alone, with no head draft, too) the
    head's cache holds exactly what the head computes over the whole committed context at
    once, and its feature is the one at the last committed position."""
    target, prompts, references = setup
    decoder = make_decoder(target, kind, LookupConfig(alone_at_ngram=2))
    alone = drafted = 0
    for prompt, reference in zip(prompts, references):
        max_cache_len = len(prompt) + NUM_NEW + decoder.max_tree_nodes
        engine = BatchEngine(decoder, max_batch_size=1, max_cache_len=max_cache_len)
        seq = engine.check(SequenceRequest(prompt, NUM_NEW))
        engine.add(seq)
        drafter = engine.device_step.heads
        with torch.inference_mode():
            while seq.finish_reason is None:
                went_alone = seq.notes["lookup"][0] >= 2  # the step verifies the chain alone
                engine.step()
                alone, drafted = alone + went_alone, drafted + (not went_alone)
                if seq.finish_reason is not None:
                    break
                context = prompt + seq.tokens  # committed positions + the root
                committed = seq.prefix_len
                assert len(context) == committed + 1
                kv, feature = drafter.kv_BHMD, drafter.feature_BH
                saved = kv[:, :, :1].clone(), feature[:1].clone()
                taps = target(torch.tensor([context[:-1]]), decoder.tap_layers).taps
                drafter.start(0, Prefilled(prompt_P=torch.tensor(context[:-1]), start=0,
                                           root=torch.tensor(context[-1:]), taps=torch.cat(taps, dim=-1)[0],
                                           logits=None))  # the head over the whole context, in row 0
                whole = kv[:, :, 0, :, :committed].clone(), feature[0].clone()
                kv[:, :, :1], feature[:1] = saved
                torch.testing.assert_close(kv[:, :, 0, :, :committed], whole[0], atol=1e-4, rtol=1e-4)
                # the feature passes the head's MLP after attention over taps of another batch shape
                torch.testing.assert_close(feature[0], whole[1], atol=1e-3, rtol=1e-3)
        assert seq.result().tokens == reference
    assert alone > 0 and drafted > 0  # both kinds of step happened


@pytest.mark.parametrize("kind", ["lookup", "medusa"])
def test_batch_mixing_greedy_and_seeded_sampling(setup, kind):
    target, prompts, references = setup
    decoder = make_decoder(target, kind, LookupConfig(alone_at_ngram=None if kind == "medusa" else 3))
    greedy_new = [NUM_NEW, 25, 33, NUM_NEW]
    sampled = [(prompts[0], 30, SamplingParams(temperature=0.8, seed=5)),
               (prompts[1], 24, SamplingParams(temperature=1.0, top_k=20, seed=17))]
    requests = [SequenceRequest(p, m) for p, m in zip(prompts, greedy_new)]
    requests.insert(1, SequenceRequest(sampled[0][0], sampled[0][1], sampling=sampled[0][2]))
    requests.insert(4, SequenceRequest(sampled[1][0], sampled[1][1], sampling=sampled[1][2]))
    greedy_rows = [0, 2, 3, 5]
    tokens, results, batched_steps = run_session(decoder, requests)
    assert batched_steps > 5
    for row, (reference, max_new) in zip(greedy_rows, zip(references, greedy_new)):
        assert tokens[row] == results[row].tokens == reference[:max_new], row
        alone = generate(decoder, requests[row].input_ids, max_new)
        assert alone.tokens == tokens[row]
    assert sum(results[row].stats.lookup_accepted for row in greedy_rows[:NUM_REPETITIVE]) > 0
    for row, (prompt, max_new, sampling) in zip([1, 4], sampled):
        result = results[row]
        assert len(result.tokens) == max_new
        alone = generate(decoder, prompt, max_new, sampling=sampling)
        assert tokens[row] == result.tokens == alone.tokens, row
        assert alone.stats.lookup_steps == result.stats.lookup_steps


def test_tree_attention_path_with_lookup_is_lossless(setup, tiny_llama_dir):
    """attn_impl="tree" (the PyTorch reference of the tree-attention function): the combined
    trees are passed packed, alone and padded in a batch."""
    _, prompts, references = setup
    tree_target = TargetAdapter.from_pretrained(tiny_llama_dir)  # its own model: the decoder switches attention
    decoder = SpeculativeDecoder(tree_target, random_medusa(tree_target), DraftTree.from_paths(TREE_PATHS),
                                 lookup=LookupConfig(alone_at_ngram=None), fallback=None, attn_impl="tree",
                                 tree_attention_impl="torch")
    result = generate(decoder, prompts[0], NUM_NEW)
    assert result.tokens == references[0] and result.stats.lookup_accepted > 0
    session = Scheduler(decoder, max_batch_size=len(prompts), max_cache_len=128)
    ids = {session.add(SequenceRequest(prompt, NUM_NEW)): index for index, prompt in enumerate(prompts)}
    tokens = {index: [] for index in ids.values()}
    while session.num_active:
        for update in session.step():
            tokens[ids[update.seq_id]].extend(update.new_tokens)
    assert [tokens[index] for index in range(len(prompts))] == references


@pytest.mark.parametrize("bad", ["x", {"num_tokens": 4}, 10])
def test_decoder_rejects_a_lookup_that_is_not_a_config(setup, bad):
    target, _, _ = setup
    with pytest.raises(ValueError, match="lookup"):
        SpeculativeDecoder(target, lookup=bad)
