"""The store of the target's replies (heads/artefacts/reply_store.py, serving/decode/store.py).

Unit level: the store's proposals against a brute force of the documented rule (the longest
matching suffix, then the most frequent continuation token by token, the smallest id on a tie,
stopping at a reply's end), the same for every call, batch and reopening; the bounded count
(max_occurrences) still proposes what the store holds. A store built for another target or
tokenizer is refused with one line (the format and a corrupt store: tests/heads/
test_reply_store_format.py). `DraftBatch.join` with a lookup and a store chain per row.

Engine level, on the tiny random Llama: greedy decoding with the store (alone, beside random
Medusa heads and lookup, beside an EAGLE-3 head's dynamic tree) equals HF greedy in a batch of
several sequences, and store chains are accepted where the store holds the target's reply;
sampling with the store merged into the tree (beside heads and lookup, and alone) keeps the target's
joint law of the first two tokens (chi-square, as test_decode_sampling.py).
"""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from specheads.heads.medusa import MedusaHeads
from specheads.heads.artefacts.suffix_search import SearchSettings
from specheads.heads.artefacts.reply_store import (SEPARATOR, ReplyStore, StoreError, tokenizer_fingerprint,
                                                   write_store)
from specheads.heads.target.adapter import TargetAdapter, TargetIdentity
from specheads.serving.decode.config import SpeculativeDecoder, parse_tree_field
from specheads.serving.decode.draft_batch import DraftBatch
from specheads.serving.decode.generate import generate
from specheads.serving.decode.lookup import LookupConfig
from specheads.serving.decode.sampling import SamplingParams
from specheads.serving.decode.store import StoreConfig, StoreDrafter, open_store
from specheads.serving.decode.trees import DraftTree, DynamicTreeConfig, TreePlan

from conftest import make_tiny_model
from test_batch import run_session
from test_decode_sampling import chi_square_p_value
from test_eagle3 import random_head
from test_lookup import chain_batch, check_row

IDENTITY = TargetIdentity("LlamaForCausalLM", "llama", 64, 256, 2, "tiny")
TOKENIZER = {"name_or_path": "tiny", "fingerprint": "f" * 64, "vocab_size": 256}
NUM_NEW = 30
TREE_PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def build(directory, replies, identity=IDENTITY, fingerprint="f" * 64) -> ReplyStore:
    write_store(directory, replies, target=identity, tokenizer=dict(TOKENIZER, fingerprint=fingerprint))
    return ReplyStore(directory)


def random_replies(seed: int, num: int, vocab: int, max_len: int = 30) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(1, max_len)).tolist() for _ in range(num)]


def reference_propose(replies, context, settings: SearchSettings):
    """Brute force of the documented rule (heads/artefacts/suffix_search.py) over every
    occurrence (no sampling: settings.max_occurrences is not used) -> (chain, match)."""
    context = list(context)[-settings.max_match:]
    best, best_score, last_count, taken = ([], 0), 0.0, -1, 0
    for length in range(len(context), settings.min_match - 1, -1):
        pattern = context[len(context) - length:]
        ends = [(r, i + length) for r, reply in enumerate(replies) for i in range(len(reply) - length + 1)
                if reply[i:i + length] == pattern]
        if not ends or len(ends) == last_count:
            continue
        last_count, taken = len(ends), taken + 1
        chain, probability, score = [], 1.0, 0.0
        while len(chain) < min(settings.num_tokens, math.ceil(settings.tokens_per_match * length)) and ends:
            nexts = [replies[r][p] if p < len(replies[r]) else SEPARATOR for r, p in ends]
            counts = Counter(nexts)
            chosen = min(token for token, count in counts.items() if count == max(counts.values()))
            share = probability * counts[chosen] / len(nexts)
            if chosen == SEPARATOR or share < settings.min_probability:
                break
            probability, score = share, score + share
            chain.append(chosen)
            ends = [(r, p + 1) for (r, p), token in zip(ends, nexts) if token == chosen]
        if chain and score > best_score + 1e-12:
            best, best_score = (chain, length), score
        if taken == settings.max_candidates:
            break
    return best


def occurs(replies, tokens) -> bool:
    return any(reply[i:i + len(tokens)] == tokens for reply in replies for i in range(len(reply) - len(tokens) + 1))


# -- the format and the search --------------------------------------------------------------------


@pytest.mark.parametrize("vocab, max_match, min_match", [(3, 4, 1), (6, 8, 2), (20, 16, 1)])
def test_proposals_follow_the_rule(tmp_path, vocab, max_match, min_match):
    replies = random_replies(vocab, 60, vocab)
    replies += [replies[0][:12]] * 3 + [replies[5]]  # repeated replies: counts above one
    store = build(tmp_path / "s", replies)
    rng = np.random.default_rng(1)
    proposed = 0
    for probability, per_match in ((0.0, 1.0), (0.1, 1.0), (0.3, 2.0)):
        settings = SearchSettings(num_tokens=6, max_match=max_match, min_match=min_match, max_occurrences=10 ** 6,
                                  min_probability=probability, tokens_per_match=per_match)
        for _ in range(50):
            context = rng.integers(0, vocab, rng.integers(0, 12)).tolist()
            found = store.propose(context, settings)
            assert (found.tokens, found.match) == reference_propose(replies, context, settings), context
            proposed += bool(found.tokens)
    assert proposed > 40


def fake_seqs(contexts, prompt_len=4):
    return [SimpleNamespace(seq_id=i, prompt=c[:prompt_len], tokens=c[prompt_len:]) for i, c in enumerate(contexts)]


def test_proposals_are_deterministic_across_calls_batches_and_reopening(tmp_path):
    replies = random_replies(2, 400, 5, max_len=60)
    build(tmp_path / "s", replies)
    config = StoreConfig(num_tokens=8, max_match=6, min_match=1, max_occurrences=4, min_probability=0.0,
                         tokens_per_match=2.0, learn_tokens=0, prompt=False)
    rng = np.random.default_rng(3)
    contexts = [rng.integers(0, 5, 10).tolist() for _ in range(40)]
    first = StoreDrafter(ReplyStore(tmp_path / "s"), config)
    again = StoreDrafter(ReplyStore(tmp_path / "s"), config)
    batched = [first.propose(seq) for seq in fake_seqs(contexts)]
    alone = [again.propose(seq) for seq in reversed(fake_seqs(contexts))][::-1]
    assert batched == alone
    assert sum(bool(one.tokens) for one in batched) > len(contexts) // 2
    for context, one in zip(contexts, batched):
        assert len(one.tokens) <= 8
        # a bounded count may not find the most frequent continuation, but what it proposes is in the store
        assert occurs(replies, context[len(context) - one.match:] + one.tokens)


def test_alone_at_match_and_no_match(tmp_path):
    store = build(tmp_path / "s", [[1, 2, 3, 4, 5, 6]])
    drafter = StoreDrafter(store, StoreConfig(num_tokens=3, max_match=4, min_match=2, alone_at_match=3,
                                              learn_tokens=0, prompt=False))
    seqs = fake_seqs([[9, 1, 2, 3], [9, 1, 2], [2, 7], [5, 6], [1, 2]], prompt_len=1)
    assert drafter.prepare(seqs, [True, True, True, True, False]) == [2, 1, 0, 0, 0]
    assert drafter.table_nX.tolist() == [[4, 5, 6, 3, 1], [3, 4, 0, 2, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0],
                                         [0, 0, 0, 0, 0]]  # [5, 6]: the reply ends there
    by_score = StoreDrafter(store, StoreConfig(num_tokens=3, max_match=4, min_match=2, alone_at_score=2.5,
                                               learn_tokens=0, prompt=False))
    assert by_score.prepare(seqs, [True] * 5) == [2, 1, 0, 0, 1]  # scores 3, 2, -, -, 2 (certain chains)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_tokens=0), "num_tokens"), (dict(max_match=True), "max_match"), (dict(min_match=5, max_match=4), "min_match"),
    (dict(max_occurrences=0), "max_occurrences"), (dict(alone_at_match=1, min_match=2), "alone_at_match"),
    (dict(alone_at_score=0), "alone_at_score"), (dict(min_probability=1.5), "min_probability"),
    (dict(tokens_per_match=0), "tokens_per_match"), (dict(learn_tokens=-1), "learn_tokens"),
    (dict(prompt=1), "prompt"),
])
def test_store_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StoreConfig(**kwargs)


class VocabTokenizer:
    def __init__(self, vocab: dict):
        self.vocab = vocab

    def get_vocab(self) -> dict:
        return dict(self.vocab)


def test_a_store_for_another_target_or_tokenizer_is_refused(tmp_path, tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    ours = VocabTokenizer({"a": 0, "b": 1})
    store = build(tmp_path / "s", [[1, 2, 3]], target.identity, tokenizer_fingerprint(ours))
    assert open_store(tmp_path / "s", target.identity, ours).num_tokens == 3
    with pytest.raises(StoreError, match="tokenizer: .*another vocabulary"):
        open_store(tmp_path / "s", target.identity, VocabTokenizer({"a": 0, "c": 1}))
    other = TargetIdentity(**{**target.identity.__dict__, "vocab_size": 512, "hidden_size": 32})
    with pytest.raises(StoreError, match="hidden_size: store 64, target 32; vocab_size: store 256, target 512") as caught:
        store.check_fits(other)
    assert "specheads data store --target" in str(caught.value)
    elsewhere = TargetIdentity(**{**target.identity.__dict__, "name_or_path": "/another/copy"})
    store.check_fits(elsewhere)  # the same model at another path fits
    build(tmp_path / "t", [[1, 2]], other)
    with pytest.raises(StoreError, match="does not fit the target"):
        SpeculativeDecoder(target, store=StoreDrafter(ReplyStore(tmp_path / "t")))


def test_the_tree_field_records_a_store(tmp_path):
    spec = parse_tree_field({"paths": [[0]], "store": {"path": "/s", "num_tokens": 4}})
    assert spec.store == StoreConfig(num_tokens=4) and spec.store_path == "/s"
    assert parse_tree_field({"paths": [[0]]}).store is None
    with pytest.raises(ValueError, match="'store' must be an object with a 'path'"):
        parse_tree_field({"store": {"num_tokens": 4}})
    with pytest.raises(ValueError, match="keys from"):
        parse_tree_field({"store": {"path": "/s", "tokens": 4}})


# -- two chains per row ---------------------------------------------------------------------------


def test_join_merges_each_source_s_chain_into_the_tree_so_far():
    plan = TreePlan(DraftTree.from_paths([[0], [1], [0, 0]]), torch.device("cpu"))
    base = DraftBatch.from_plan(plan, torch.arange(8).reshape(2, 4))  # row 0: 1, 2 under the root, 3 under 1
    roots = base.tokens[:, 0]
    # Row 0: the lookup chain follows the heads' 1, 3, then adds 6 (node 6); the store chain
    # follows 1, 3 and the lookup's 6, then adds 8 (node 10). Row 1: no lookup chain; the store
    # chain follows the heads' 5 (node 1) and adds 9 (node 8).
    drafts = base.join([chain_batch(roots, [[1, 3, 6], []]), chain_batch(roots, [[1, 3, 6, 8], [5, 9]])])
    assert drafts.num_nodes == 4 + 3 + 4 and drafts.max_depth == 4 and drafts.max_children == 2 + 2
    assert drafts.tokens[0, 4:].tolist() == [1, 3, 6, 1, 3, 6, 8]
    assert drafts.parents[0, 4:].tolist() == [0, 1, 3, 0, 1, 3, 6]
    assert drafts.valid[0, 4:].tolist() == [False, False, True, False, False, False, True]
    assert drafts.parents[1, 7:9].tolist() == [0, 1] and drafts.tokens[1, 8].item() == 9
    assert drafts.valid[1, 4:].tolist() == [False] * 4 + [True] + [False] * 2
    assert drafts.children()[0, 3].tolist()[:1] == [6] and drafts.children()[0, 6].tolist()[:1] == [10]
    assert drafts.children()[1, 1].tolist()[:2] == [3, 8]  # the heads' child, then the store's
    on = drafts.on_chains
    assert [on[0, k].nonzero()[:, 0].tolist() for k in range(2)] == [[1, 3, 6], [1, 3, 6, 10]]
    assert [on[1, k].nonzero()[:, 0].tolist() for k in range(2)] == [[], [1, 8]]
    for row in range(2):
        check_row(drafts, row)
    single = DraftBatch.roots(roots[:1]).join([chain_batch(roots[:1], [[2, 3]]), chain_batch(roots[:1], [[4]])])
    assert not single.is_chain and single.max_children == 2
    check_row(single, 0)
    assert DraftBatch.roots(roots[:1]).join([chain_batch(roots[:1], [[4, 5]])]).is_chain


# -- the engine: greedy ---------------------------------------------------------------------------


def hf_greedy(target: TargetAdapter, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def greedy_setup(tiny_llama_dir, tmp_path_factory):
    """(target, prompts, references, store): the store holds the target's replies to the
    first four prompts (and noise), not to the last two."""
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, target.vocab_size, (9,), generator=generator).tolist() for _ in range(6)]
    references = [hf_greedy(target, prompt, NUM_NEW) for prompt in prompts]
    noise = random_replies(6, 40, target.vocab_size)
    directory = tmp_path_factory.mktemp("store") / "s"
    build(directory, references[:4] + noise, target.identity)
    return target, prompts, references, ReplyStore(directory)


def random_medusa(target: TargetAdapter) -> MedusaHeads:
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, 3)
    heads.init_lm_heads_from(target.lm_head())
    nn.init.normal_(heads.block_weight, std=0.2)
    return heads.eval()


def store_decoder(target, store: ReplyStore, kind: str) -> SpeculativeDecoder:
    drafter = StoreDrafter(store, StoreConfig(num_tokens=6))
    if kind == "store":
        return SpeculativeDecoder(target, store=drafter, fallback=None)
    if kind == "medusa+lookup+store":
        return SpeculativeDecoder(target, random_medusa(target), DraftTree.from_paths(TREE_PATHS),
                                  lookup=LookupConfig(num_tokens=4, alone_at_ngram=None), store=drafter, fallback=None)
    head, config = random_head(target, seed=3)
    return SpeculativeDecoder(target, head, DynamicTreeConfig(depth=3, top_k=2, num_nodes=6),
                              tap_layers=config.tap_layers, store=drafter, fallback=None)


@pytest.mark.parametrize("kind", ["store", "medusa+lookup+store", "eagle3-dynamic+store"])
def test_greedy_decoding_with_the_store_in_a_batch_is_the_target_s_own(greedy_setup, kind):
    target, prompts, references, store = greedy_setup
    decoder = store_decoder(target, store, kind)
    assert decoder.max_tree_nodes == {"store": 1, "medusa+lookup+store": 11, "eagle3-dynamic+store": 7}[kind] + 6
    lengths = [NUM_NEW, 21, NUM_NEW, 17, NUM_NEW, 25]
    requests = [(prompt, length) for prompt, length in zip(prompts, lengths)]
    from specheads.serving.decode.sequence import SequenceRequest

    tokens, results, batched_steps = run_session(decoder, [SequenceRequest(p, n) for p, n in requests])
    assert batched_steps > 3
    for row, (reference, length) in enumerate(zip(references, lengths)):
        assert tokens[row] == results[row].tokens == reference[:length], (kind, row)
        stats = results[row].stats
        assert 0 <= stats.store_accepted <= stats.accepted_tokens and stats.store_steps <= stats.steps
        # on a CPU a row drafts from one chain source a step (SpeculativeDecoder.one_chain_per_row)
        assert stats.lookup_steps + stats.store_steps <= stats.steps
    for row in range(4):  # the store holds these replies: whole runs of them are accepted
        assert results[row].stats.store_accepted >= lengths[row] // 2, (kind, row, results[row].stats)
        assert results[row].stats.steps < lengths[row] // 2
    if kind == "store":  # without heads, every speculative step is a store step
        for result in results:
            assert result.stats.store_steps == result.stats.speculative_steps
            assert result.stats.store_accepted == result.stats.accepted_tokens


def test_the_store_survives_a_faulty_row(greedy_setup, monkeypatch):
    """A store search that fails for one sequence ends that sequence alone."""
    target, prompts, references, store = greedy_setup
    decoder = store_decoder(target, store, "store")
    original = StoreDrafter.propose

    def faulty(self, seq):
        if seq.prompt == list(prompts[1]):  # the second sequence
            raise RuntimeError("injected store fault")
        return original(self, seq)

    monkeypatch.setattr(StoreDrafter, "propose", faulty)
    from specheads.serving.decode.sequence import SequenceRequest

    tokens, results, _ = run_session(decoder, [SequenceRequest(p, NUM_NEW) for p in prompts[:3]])
    assert results[1].finish_reason == "error" and "injected store fault" in results[1].error
    for row in (0, 2):
        assert tokens[row] == references[row]


# -- the engine: sampling ---------------------------------------------------------------------------


VOCAB = 8
PROMPT = [3, 5, 1, 6]
NUM_SAMPLES = 3000
P_VALUE = 1e-4


@pytest.fixture(scope="module")
def sampling_setup(tmp_path_factory):
    """A tiny-vocabulary target whose joint law of two tokens is enumerable, random Medusa
    heads, and a store whose most frequent continuation of each first token t1 (after the
    prompt) is the target's likeliest second token, then two more."""
    from test_decode_sampling import exact_joint

    directory = make_tiny_model("llama", tmp_path_factory.mktemp("tiny-vocab-llama"), seed=3, vocab_size=VOCAB,
                                hidden_size=32, num_layers=2)
    target = TargetAdapter.from_pretrained(directory)
    with torch.no_grad():
        target.model.lm_head.weight.mul_(0.4)
    params = SamplingParams(temperature=1.0)
    joint = exact_joint(target, params)
    likeliest = joint.argmax(-1).tolist()  # [V]: the likeliest t2 after each t1
    replies = [[PROMPT[-1], t1, likeliest[t1], (t1 + 1) % VOCAB, (t1 + 2) % VOCAB] for t1 in range(VOCAB)]
    replies += [[t1, (likeliest[t1] + 3) % VOCAB] for t1 in range(VOCAB)]  # a rarer continuation
    store = build(tmp_path_factory.mktemp("store") / "s", replies, target.identity)
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, 2)
    nn.init.normal_(heads.lm_head_weight, std=0.5)
    nn.init.normal_(heads.block_weight, std=0.2)
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield target, heads, store, params, joint
    torch.set_num_threads(num_threads)


@pytest.mark.parametrize("with_heads", [pytest.param(True, id="medusa+lookup+store"),
                                        pytest.param(False, id="store-alone", marks=pytest.mark.slow)])
def test_first_two_tokens_follow_the_target_with_the_store(sampling_setup, with_heads):
    """Store tokens are candidates fixed in advance: beside the heads' tree and a lookup chain
    (merged into the heads' tree), or the whole tree (no heads)."""
    target, heads, store, params, joint = sampling_setup
    drafter = StoreDrafter(store, StoreConfig(num_tokens=3, max_match=4, min_match=1))
    decoder = SpeculativeDecoder(target, heads if with_heads else None,
                                 DraftTree.from_paths([[0], [1], [2], [0, 0], [1, 0]]) if with_heads else None,
                                 lookup=LookupConfig(num_tokens=3, alone_at_ngram=None) if with_heads else None,
                                 store=drafter, one_chain_per_row=False)  # a row's lookup and store chains merged
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    store_steps = store_accepted = 0
    for seed in range(NUM_SAMPLES):
        result = generate(decoder, PROMPT, 2, sampling=SamplingParams(temperature=params.temperature, seed=seed))
        counts[result.tokens[0], result.tokens[1]] += 1
        store_steps += result.stats.store_steps
        store_accepted += result.stats.store_accepted
        assert result.lossless
    # beside the heads, a store token that a head's candidate repeats shares its node (and counts for both)
    least = NUM_SAMPLES // 50 if with_heads else NUM_SAMPLES // 10
    assert store_steps > NUM_SAMPLES // 2 and store_accepted > least, (store_steps, store_accepted)
    assert chi_square_p_value(counts, joint) > P_VALUE
