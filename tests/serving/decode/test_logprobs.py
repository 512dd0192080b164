"""Token logprobs from the verify logits (serving/decode/logprobs.py through the engine).

In fp32 every emitted token's logprob is the log_softmax of HF's own logits for it
(`generate(output_logits=True)`), with heads on and several sequences in one batch: the
row that scores a token is its parent's, across accepted paths of different lengths. Under
sampling the logprobs are of the raw distribution, so they equal a teacher-forced HF forward
over the sampled tokens. Prompt logprobs are the prefill's rows, None for the first token.
"""

from __future__ import annotations

import math

import pytest
import torch

from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.logprobs import (TokenLogprob, prompt_logprobs, score_tokens, step_logprob_rows,
                                               unpack_step_logprobs)
from specheads.serving.decode.sampling import SamplingParams
from specheads.serving.decode.scheduler import Scheduler, SequenceRequest
from specheads.serving.decode.trees import DraftTree, DynamicTreeConfig

from test_batch import NUM_HEADS, PROMPT_LENGTHS, TREE_PATHS, MultiOracle, hf_greedy, run_session
from test_eagle3 import random_head

MAX_NEW = [14, 9, 20, 5, 12, 16]
TOP = 3
ATOL = 1e-4  # fp32: a batched tree forward against HF's one-sequence forward


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, target.vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    long = [p + hf_greedy(target, p, m + NUM_HEADS + 2) for p, m in zip(prompts, MAX_NEW)]
    return target, prompts, long


def forward_logprobs(target: TargetAdapter, tokens: list[int]) -> torch.Tensor:
    """[L, V] HF's log_softmax at every position of one sequence (teacher forcing)."""
    with torch.no_grad():
        logits = target.model(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def hf_generate_logprobs(target: TargetAdapter, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy tokens and the log_softmax of its raw logits for each ([N, V])."""
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                                eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    logits = torch.cat(out.logits)  # [N, V], one row per generated token
    return out.sequences[0, len(prompt):].tolist(), torch.log_softmax(logits.float(), dim=-1)


def assert_entries(entries: list[TokenLogprob], tokens: list[int], reference_NV: torch.Tensor, num_top: int):
    assert [entry.token for entry in entries] == tokens
    assert len(reference_NV) == len(tokens)
    for entry, row in zip(entries, reference_NV):
        assert entry.logprob == pytest.approx(float(row[entry.token]), abs=ATOL)
        values, ids = row.topk(num_top)
        assert [token for token, _ in entry.top] == ids.tolist()
        assert [value for _, value in entry.top] == pytest.approx(values.tolist(), abs=ATOL)


def test_score_tokens_on_hand_built_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, -1.0, float("-inf")]])
    entries = score_tokens(logits, [1, 3], 2)
    expected = torch.log_softmax(logits, dim=-1)
    assert entries[0].logprob == pytest.approx(float(expected[0, 1]))
    assert entries[0].top == ((3, pytest.approx(float(expected[0, 3]))), (2, pytest.approx(float(expected[0, 2]))))
    assert entries[1].logprob == -math.inf  # a masked token: the response layer turns it into OpenAI's -9999
    assert {token for token, _ in entries[1].top} == {0, 1}
    assert score_tokens(logits, [0, 0], 0)[0].top == ()
    assert len(score_tokens(logits, [0, 0], 10)[0].top) == 4  # never more than the vocab
    assert score_tokens(logits.to(torch.bfloat16), [3, 0], 1)[0].logprob == pytest.approx(float(expected[0, 3]),
                                                                                      abs=1e-2)
    with pytest.raises(ValueError, match="one logits row per token"):
        score_tokens(logits, [1], 1)
    with pytest.raises(ValueError, match="num_top"):
        score_tokens(logits, [1, 1], -1)


def test_step_rows_are_the_accepted_nodes_and_the_prompt_starts_with_none():
    logits_TV = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    path = torch.tensor([[0, 2, 3, 0]])  # root -> node 2 -> node 3 (then padding); the bonus: node 3's row
    packed = step_logprob_rows(logits_TV[None], path, torch.tensor([[4, 6, 1, 0]]), 2)
    entries = unpack_step_logprobs(packed[0].tolist(), [4, 6, 1], 2, num_positions=4)
    expected = torch.log_softmax(logits_TV, dim=-1)
    assert [e.logprob for e in entries] == pytest.approx([float(expected[0, 4]), float(expected[2, 6]),
                                                          float(expected[3, 1])])
    assert [token for token, _ in entries[1].top] == expected[2].topk(2).indices.tolist()
    assert len(unpack_step_logprobs(packed[0].tolist(), [4, 6, 1], 1, num_positions=4)[0].top) == 1  # a row's own K
    prompt = prompt_logprobs(logits_TV[:3], [5, 1, 2], 1)
    assert prompt[0] is None
    assert [e.logprob for e in prompt[1:]] == pytest.approx([float(expected[0, 1]), float(expected[1, 2])])
    with pytest.raises(ValueError, match="every prompt position"):
        prompt_logprobs(logits_TV, [5, 1, 2], 1)


def decoders(target, long):
    eagle, config = random_head(target, seed=3)
    tree = DraftTree.from_paths(TREE_PATHS)
    torch.manual_seed(0)
    return {
        "plain": SpeculativeDecoder(target),
        "medusa-random": SpeculativeDecoder(target, MedusaHeads(target.hidden_size, target.vocab_size, NUM_HEADS),
                                            tree),
        "medusa-oracle": SpeculativeDecoder(target, MultiOracle(target, long, PROMPT_LENGTHS), tree),
        "eagle3-dynamic": SpeculativeDecoder(target, eagle, DynamicTreeConfig(depth=3, top_k=2, num_nodes=6),
                                             tap_layers=config.tap_layers),
    }


@pytest.mark.parametrize("kind", ["plain", "medusa-random", "medusa-oracle", "eagle3-dynamic"])
def test_greedy_logprobs_equal_hf_logits_in_a_batch(setup, kind):
    target, prompts, long = setup
    decoder = decoders(target, long)[kind]
    requests = [SequenceRequest(p, m, logprobs=TOP, prompt_logprobs=i % 2 == 0)
                for i, (p, m) in enumerate(zip(prompts, MAX_NEW))]
    tokens, results, batched_steps = run_session(decoder, requests)
    assert batched_steps > 5
    if kind == "medusa-oracle":  # whole paths accepted: several tokens scored per step
        assert sum(r.stats.accepted_tokens for r in results) > sum(MAX_NEW) // 2
    for i, (prompt, max_new, result) in enumerate(zip(prompts, MAX_NEW, results)):
        reference, reference_NV = hf_generate_logprobs(target, prompt, max_new)
        assert result.tokens == reference
        assert_entries(result.logprobs, reference, reference_NV, TOP)
        if i % 2 == 0:
            assert result.prompt_logprobs[0] is None
            assert_entries(result.prompt_logprobs[1:], prompt[1:], forward_logprobs(target, prompt)[:-1], TOP)
        else:
            assert result.prompt_logprobs is None


def test_sampled_logprobs_are_the_raw_distribution(setup):
    """Tree rejection sampling with heads: each emitted token (accepted, recovered or bonus)
    is scored by the raw logits of the position before it, not the temperature-scaled ones."""
    target, prompts, long = setup
    decoder = decoders(target, long)["medusa-oracle"]
    requests = [SequenceRequest(p, m, sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=5 + i), logprobs=2)
                for i, (p, m) in enumerate(zip(prompts, MAX_NEW))]
    _, results, _ = run_session(decoder, requests)
    assert sum(r.stats.accepted_tokens for r in results) > 0
    for prompt, result in zip(prompts, results):
        full = forward_logprobs(target, prompt + result.tokens)[len(prompt) - 1:-1]
        assert_entries(result.logprobs, result.tokens, full, 2)


def test_logprobs_follow_the_output_through_stops_and_updates(setup):
    """One entry per returned token when EOS, a stop sequence or max_new_tokens cut a step
    short; the updates' entries, joined, are the result's."""
    target, prompts, long = setup
    decoder = decoders(target, long)["medusa-oracle"]
    references = [hf_greedy(target, p, m) for p, m in zip(prompts, MAX_NEW)]
    requests = [SequenceRequest(p, m, logprobs=0) for p, m in zip(prompts, MAX_NEW)]
    requests[0].stop_token_sequences = [references[0][5:7]]
    requests[1].eos_token_id = references[1][3]
    session = Scheduler(decoder, max_batch_size=3, max_cache_len=128)
    ids = {session.add(r): i for i, r in enumerate(requests[:3])}
    pending, streamed, results = list(enumerate(requests))[3:], {}, {}
    while session.num_active or pending:
        while pending and session.has_capacity:
            index, request = pending.pop(0)
            ids[session.add(request)] = index
        for update in session.step():
            assert len(update.logprobs) == len(update.new_tokens)
            streamed.setdefault(ids[update.seq_id], []).extend(update.logprobs)
            if update.finished:
                results[ids[update.seq_id]] = update.result
    for index, result in results.items():
        assert len(result.logprobs) == len(result.tokens) and streamed[index] == result.logprobs
        assert all(entry.top == () for entry in result.logprobs)
    assert results[0].finish_reason == "stop" and len(results[0].tokens) < MAX_NEW[0]
    assert results[1].finish_reason == "stop" and len(results[1].tokens) == 4


@pytest.mark.parametrize("bad", [-1, True, 2.5])
def test_bad_logprobs_requests_are_refused(setup, bad):
    target, prompts, _ = setup
    session = Scheduler(SpeculativeDecoder(target), max_batch_size=1, max_cache_len=64)
    with pytest.raises(ValueError, match="logprobs must be"):
        session.add(SequenceRequest(prompts[0], 2, logprobs=bad))
    with pytest.raises(ValueError, match="prompt_logprobs needs logprobs"):
        session.add(SequenceRequest(prompts[0], 2, prompt_logprobs=True))
