"""Decoding controls: token-level stop sequences and streaming.

Stop sequences: the output ends right after the first occurrence of any stop sequence in
the generated tokens (finish_reason "stop"), exactly what greedy decoding cut at that
point gives, also when the sequence ends inside an accepted path or straddles two verify
steps. Streaming: the per-step deltas concatenate to generate's output, and the final
GenerationResult is available once the stream is exhausted.

Tiny random targets and oracle / random Medusa heads as in test_decode_lossless.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.engine import BatchEngine
from specheads.serving.decode.sequence import SequenceRequest
from specheads.serving.decode.generate import generate, stream
from specheads.serving.decode.sampling import SamplingParams
from specheads.serving.decode.trees import DraftTree

from test_decode_lossless import NUM_HEADS, NUM_LONG, NUM_NEW, TREE_PATHS, Case, capacity, hf_greedy

NUM_CASES = 6


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    generator = torch.Generator().manual_seed(77)
    cases = []
    for index in range(NUM_CASES):
        length = 1 + (index * 7) % 29
        prompt = torch.randint(3, target.vocab_size, (length,), generator=generator).tolist()
        long_reference = hf_greedy(target, prompt, NUM_LONG)
        tokens = torch.tensor(prompt + long_reference)
        with torch.no_grad():
            hidden = target(tokens[None], [target.num_layers]).taps[0][0]
        cases.append(Case(prompt, long_reference[:NUM_NEW], long_reference, hidden[length - 1:], tokens))
    return target, cases


def cut_at_stop(tokens: list[int], stops: list[list[int]]) -> list[int]:
    """Greedy output cut right after the first occurrence of any stop sequence."""
    for end in range(1, len(tokens) + 1):
        if any(end >= len(s) and tokens[end - len(s):end] == s for s in stops):
            return tokens[:end]
    return tokens


def random_heads(target: TargetAdapter) -> MedusaHeads:
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, NUM_HEADS)
    heads.init_lm_heads_from(target.lm_head())
    nn.init.normal_(heads.block_weight, std=0.2)
    return heads


def test_stop_sequences_inside_accepted_paths(setup):
    target, cases = setup
    tree = DraftTree.from_paths(TREE_PATHS)
    num_truncated = num_runs = 0
    for case in cases:
        decoder = SpeculativeDecoder(target, case.oracle(target), tree)
        reference = case.reference
        for start in range(0, 10):
            for length in (1, 2, 3):
                stop = reference[start:start + length]
                stops = [[target.vocab_size - 1] * 5, stop]  # the first never occurs
                expected = cut_at_stop(reference, stops)
                result = generate(decoder, case.prompt, NUM_NEW, stop_token_sequences=stops)
                assert result.tokens == expected
                assert result.finish_reason == "stop"
                assert result.tokens[-len(stop):] == stop
                num_truncated += capacity(result.stats) > len(result.tokens)
                num_runs += 1
    assert num_truncated >= num_runs // 2  # stops really fell inside accepted paths


@pytest.mark.parametrize("kind", ["plain", "random", "corrupt"])
def test_stop_sequences_with_other_drafters(setup, kind):
    target, cases = setup
    tree = DraftTree.from_paths(TREE_PATHS)

    def corrupt(depth, position):
        return "rank1" if (depth + position) % 3 == 0 else None

    for index, case in enumerate(cases):
        if kind == "plain":
            decoder = SpeculativeDecoder(target)
        elif kind == "random":
            decoder = SpeculativeDecoder(target, random_heads(target), tree)
        else:
            decoder = SpeculativeDecoder(target, case.oracle(target, corrupt), tree)
        stop = case.reference[3 + index % 7: 5 + index % 7]
        result = generate(decoder, case.prompt, NUM_NEW, stop_token_sequences=[stop])
        assert result.tokens == cut_at_stop(case.reference, [stop])
        assert result.finish_reason == "stop"


def test_stop_eos_and_length_interplay(setup):
    target, cases = setup
    case = cases[0]
    decoder = SpeculativeDecoder(target, case.oracle(target), DraftTree.from_paths(TREE_PATHS))
    ref = case.reference
    # Stops around the length limit: whichever comes first wins; a stop completed by the
    # last allowed token is "stop".
    for start in range(NUM_NEW - 3, NUM_NEW + 2):
        stops = [case.long_reference[start:start + 2]]
        full = cut_at_stop(case.long_reference, stops)
        result = generate(decoder, case.prompt, NUM_NEW, stop_token_sequences=stops)
        if len(full) <= NUM_NEW:
            assert result.tokens == full and result.finish_reason == "stop"
        else:
            assert result.tokens == ref and result.finish_reason == "length"
    # EOS before the stop sequence completes.
    eos = ref[5]
    stops = [ref[6:8]]
    expected = hf_greedy(target, case.prompt, NUM_NEW, eos_token_id=eos)
    result = generate(decoder, case.prompt, NUM_NEW, eos, stop_token_sequences=stops)
    assert result.tokens == cut_at_stop(expected, stops) and result.finish_reason == "stop"
    # A stop sequence ending at the first token (from prefill).
    result = generate(decoder, case.prompt, NUM_NEW, stop_token_sequences=[[ref[0]]])
    assert result.tokens == [ref[0]] and result.finish_reason == "stop" and result.stats.steps == 0
    with pytest.raises(ValueError):
        generate(decoder, case.prompt, NUM_NEW, stop_token_sequences=[[]])


@pytest.mark.parametrize("kind", ["plain", "oracle", "random"])
def test_stream_concatenation_equals_generate(setup, kind):
    target, cases = setup
    tree = DraftTree.from_paths(TREE_PATHS)
    for case in cases:
        if kind == "plain":
            decoder = SpeculativeDecoder(target)
        elif kind == "oracle":
            decoder = SpeculativeDecoder(target, case.oracle(target), tree)
        else:
            decoder = SpeculativeDecoder(target, random_heads(target), tree)
        expected = generate(decoder, case.prompt, NUM_NEW)
        decoding = stream(decoder, case.prompt, NUM_NEW)
        assert decoding.result is None
        deltas = list(decoding)
        assert [t for delta in deltas for t in delta] == expected.tokens == case.reference
        assert decoding.result is not None and decoding.result.tokens == expected.tokens
        assert decoding.result.finish_reason == expected.finish_reason
        assert len(deltas) == 1 + decoding.result.stats.steps  # prefill's token, then one delta per verify step
        assert len(deltas[0]) == 1
        assert all(1 <= len(delta) <= 1 + tree.max_depth for delta in deltas[1:])
        if kind == "oracle":
            assert max(len(delta) for delta in deltas) > 1


def test_stream_with_stop_and_sampling(setup):
    target, cases = setup
    case = cases[1]
    decoder = SpeculativeDecoder(target, case.oracle(target), DraftTree.from_paths(TREE_PATHS))
    stop = case.reference[4:6]
    decoding = stream(decoder, case.prompt, NUM_NEW, stop_token_sequences=[stop])
    assert [t for delta in decoding for t in delta] == cut_at_stop(case.reference, [stop])
    assert decoding.result.finish_reason == "stop"
    params = SamplingParams(temperature=0.8, seed=5)
    sampled = generate(decoder, case.prompt, NUM_NEW, sampling=params)
    decoding = stream(decoder, case.prompt, NUM_NEW, sampling=params)
    assert [t for delta in decoding for t in delta] == sampled.tokens == decoding.result.tokens


def test_static_cache_is_not_reallocated_across_steps(setup):
    """The engine allocates its TreeStaticCache once; every step's verify and commit write into
    the same buffers (the engine's own path, stepped one step at a time)."""
    target, cases = setup
    case = cases[2]
    tree = DraftTree.from_paths(TREE_PATHS)
    decoder = SpeculativeDecoder(target, case.oracle(target), tree)
    engine = BatchEngine(decoder, max_batch_size=1, max_cache_len=len(case.prompt) + NUM_NEW + tree.num_nodes)
    seq = engine.check(SequenceRequest(case.prompt, NUM_NEW))
    emitted = engine.add(seq)
    pointers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in engine.cache.layers]
    for _ in range(3):
        emitted += engine.step()[seq.seq_id]
        assert engine.cache.get_seq_length() == seq.prefix_len == len(case.prompt) + len(emitted) - 1
        assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in engine.cache.layers] == pointers
    assert seq.stats.accepted_tokens > 0  # the oracle's drafts were accepted: commits gathered several nodes
    assert emitted == case.reference[:len(emitted)]
