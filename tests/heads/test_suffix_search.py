"""The store's search (heads/artefacts/suffix_search.py): the index against brute force, the rule
on hand-made stores (a rare continuation is not proposed, the draft follows the match length,
the best of several match lengths, groups), and the native search equal to the Python rule on
random stores, token for token."""

from __future__ import annotations

import numpy as np
import pytest

from specheads.heads.artefacts.suffix_search import (SEPARATOR, SearchSettings, Searcher, SuffixIndex,
                                                      propose_reference, suffix_array)


def random_sequences(seed: int, num: int, vocab: int, max_len: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    base = [rng.integers(0, vocab, rng.integers(1, max_len)).tolist() for _ in range(num)]
    # repeats with small edits, as replies repeat their openings and idioms
    return base + [seq[:len(seq) // 2] + rng.integers(0, vocab, 3).tolist() for seq in base[: num // 2]]


@pytest.mark.parametrize("vocab", [2, 5, 300])
def test_the_suffix_array_sorts_every_suffix(vocab):
    tokens = np.random.default_rng(vocab).integers(0, vocab, 300).astype(np.uint32)
    brute = sorted(range(len(tokens)), key=lambda p: tokens[p:].tolist())
    assert suffix_array(tokens).tolist() == brute


def test_find_gives_every_occurrence():
    sequences = random_sequences(0, 30, 4)
    index = SuffixIndex.build(sequences)
    flat = index.tokens.tolist()
    for pattern in ([0], [1, 2], [3, 3, 3], [0, 1, 2, 3], [9]):
        lo, hi = index.find(pattern)
        found = sorted(int(p) for p in index.suffix_array[lo:hi])
        brute = [p for p in range(len(flat)) if flat[p:p + len(pattern)] == pattern]
        assert found == brute, pattern


def test_a_rare_continuation_is_not_proposed():
    # after [1, 2]: 49 times 3 then 4, once 7 then 8 ...: the chain takes 3, 4; after [5, 6] the
    # continuations split 50/50 below the cut-off from the second token on
    sequences = [[1, 2, 3, 4]] * 49 + [[1, 2, 7, 8, 9, 10, 11, 12, 13, 14]] + [[5, 6, 20, 30], [5, 6, 20, 31]] * 3
    searcher = Searcher([[SuffixIndex.build(sequences)]], SearchSettings(num_tokens=10, min_probability=0.1))
    assert searcher.propose([0, 1, 2]).tokens == [3, 4]
    assert searcher.propose([1, 2, 7]).tokens == [8, 9, 10]  # the rare branch once the context is in it
    scattered = Searcher([[SuffixIndex.build([[1, 2, 100 + k, 5] for k in range(50)])]], SearchSettings())
    assert scattered.propose([0, 1, 2]).tokens == []  # every continuation has a 2% share
    half = searcher.propose([9, 5, 6])
    assert half.tokens == [20, 30] and half.score == pytest.approx(1.5)  # 1 + 0.5, ties to the smaller id
    assert Searcher([[SuffixIndex.build(sequences)]], SearchSettings(min_probability=0.6)).propose(
        [9, 5, 6]).tokens == [20]


def test_the_draft_follows_the_match_length():
    sequences = [list(range(100, 130))]
    settings = SearchSettings(num_tokens=10, max_match=16, min_match=2, tokens_per_match=1.0)
    searcher = Searcher([[SuffixIndex.build(sequences)]], settings)
    assert searcher.propose([1, 100, 101]).tokens == [102, 103]  # a 2-token match: 2 tokens
    assert searcher.propose(list(range(100, 105))).tokens == list(range(105, 110))
    assert searcher.propose(list(range(100, 115))).tokens == list(range(115, 125))  # capped at num_tokens
    assert searcher.propose([7, 100]).tokens == []  # below min_match
    assert Searcher([[SuffixIndex.build(sequences)]], SearchSettings(tokens_per_match=0.5)).propose(
        list(range(100, 106))).tokens == [106, 107, 108]


def test_a_shorter_match_wins_when_it_scores_higher():
    # [8, 1, 2] occurs once, followed by 5; [1, 2] occurs 10 times, 9 of them followed by 3, 4
    sequences = [[8, 1, 2, 5]] + [[1, 2, 3, 4, 6]] * 9
    searcher = Searcher([[SuffixIndex.build(sequences)]], SearchSettings(num_tokens=4, tokens_per_match=2.0))
    best = searcher.propose([8, 1, 2])
    assert best.match == 2 and best.tokens == [3, 4, 6]  # 3 x 0.9 beats 1 token for sure
    only_longest = Searcher([[SuffixIndex.build(sequences)]], SearchSettings(num_tokens=4, tokens_per_match=2.0,
                                                                             max_candidates=1))
    assert only_longest.propose([8, 1, 2]).tokens == [5]


def test_the_best_group_is_proposed():
    store = SuffixIndex.build([[1, 2, 3]])
    prompt = SuffixIndex.build([[1, 2, 9, 9, 9], [1, 2, 9, 9, 9]])
    best = Searcher([[store], [prompt]], SearchSettings(tokens_per_match=3.0)).propose([0, 1, 2])
    assert (best.tokens, best.group) == ([9, 9, 9], 1)
    assert Searcher([[store], []], SearchSettings()).propose([0, 1, 2]).tokens == [3]
    assert Searcher([[], []], SearchSettings()).propose([0, 1, 2]).tokens == []


@pytest.mark.parametrize("seed", range(4))
def test_the_native_search_is_the_python_rule(seed):
    rng = np.random.default_rng(seed)
    vocab = [3, 6, 50, 400][seed]
    indexes = [SuffixIndex.build(random_sequences(seed * 10 + k, 40, vocab)) for k in range(3)]
    groups = [indexes[:2], indexes[2:]]
    settings = SearchSettings(num_tokens=int(rng.integers(1, 12)), max_match=int(rng.integers(2, 12)),
                              min_match=int(rng.integers(1, 3)), max_occurrences=int(rng.integers(1, 20)),
                              min_probability=float(rng.choice([0.0, 0.1, 0.3])),
                              tokens_per_match=float(rng.choice([0.5, 1.0, 2.5])),
                              max_candidates=int(rng.integers(1, 5)))
    native = Searcher(groups, settings)
    assert native.library is not None  # this machine has a C compiler: the native search is what runs
    flat = [seq for index in indexes for seq in random_sequences(seed * 10, 40, vocab)]
    contexts = [seq[:int(rng.integers(1, len(seq) + 1))] for seq in flat[:60]]
    contexts += [rng.integers(0, vocab, 20).tolist() for _ in range(20)]
    proposed = 0
    for context in contexts:
        mine, reference = native.propose(context), propose_reference(groups, context, settings)
        assert (mine.tokens, mine.match, mine.group) == (reference.tokens, reference.match, reference.group), context
        assert mine.score == reference.score
        assert SEPARATOR not in mine.tokens
        proposed += bool(mine.tokens)
    assert proposed > 10


def test_a_big_endian_store_index_is_searched_alike():
    sequences = random_sequences(5, 30, 7)
    native = SuffixIndex.build(sequences)
    big = SuffixIndex(native.tokens.astype(">u4"), native.suffix_array.astype("<i4"))
    settings = SearchSettings(min_probability=0.0)
    for context in sequences[:20]:
        assert Searcher([[big]], settings).propose(context[:5]) == Searcher([[native]], settings).propose(context[:5])
