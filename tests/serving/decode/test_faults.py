"""One sequence's fault never takes the engine down, and sampling cannot produce NaN.

- Tiny temperatures (1e-300, 5e-324, fp32 denormals) decode greedily instead of dividing
  logits into inf and NaN (the request that used to kill the server for good); top-p and
  top-k at their edges.
- A fault injected into one row of a running batch (its accept, the batched Medusa draft,
  the batched verify forward, its bookkeeping) ends that sequence alone with finish_reason
  "error"; the other rows' output equals their output alone, and the engine takes new
  sequences. The batched step that fails is run again row by row, in one place
  (BatchEngine._run).
- Only a lost device or out-of-memory after a retry is fatal (serving/decode/faults.py).
"""

from __future__ import annotations

import sys

import pytest
import torch

from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.scheduler import Scheduler, SequenceRequest
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.generate import generate
from specheads.serving.decode import steps as steps_module
from specheads.serving.decode.engine import BatchEngine
from specheads.serving.decode.faults import EngineBroken, is_fatal
from specheads.serving.decode.sampling import GREEDY_BELOW_TEMPERATURE, SamplingParams, target_probs
from specheads.serving.decode.trees import DraftTree

from test_batch import hf_greedy

TREE_PATHS = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
PROMPT_LENGTHS = [4, 9, 40]  # the last one is the faulty row of the verify test (its positions are >= 40)
MAX_NEW = 10
TINY_TEMPERATURES = [1e-300, 5e-324, 1e-40, sys.float_info.min, 9.99e-6]


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, target.vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    references = [hf_greedy(target, p, MAX_NEW) for p in prompts]
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, 3)
    decoder = SpeculativeDecoder(target, heads, DraftTree.from_paths(TREE_PATHS))
    return target, decoder, prompts, references


def run(decoder, requests, max_batch_size=3):
    """All requests admitted at once, stepped to the end -> ({index: result}, session)."""
    session = Scheduler(decoder, max_batch_size=max_batch_size, max_cache_len=128)
    ids = {session.add(request): index for index, request in enumerate(requests)}
    results = {}
    while session.num_active:
        for update in session.step():
            if update.finished:
                results[ids[update.seq_id]] = update.result
    return results, session


# --- sampling that cannot produce NaN ---------------------------------------------------------

@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_tiny_temperatures_are_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy
    logits = torch.randn(4, 50) * 30
    probs = target_probs(logits, params)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())
    assert not SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE).is_greedy


def test_the_smallest_sampled_temperature_stays_finite():
    logits = torch.randn(4, 50) * 1000  # far larger than any model's logits
    probs = target_probs(logits, SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE))
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(4))


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_tiny_temperature_requests_decode_greedily(setup, temperature):
    target, decoder, prompts, references = setup
    sampling = SamplingParams(temperature=temperature, seed=1)
    assert generate(decoder, prompts[0], MAX_NEW, sampling=sampling).tokens == references[0]


def test_top_p_and_top_k_at_their_edges():
    logits = torch.randn(3, 64) * 4
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), 64).float()
    for top_p in (5e-324, 1e-300, 1e-9):
        assert torch.equal(target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p)), one_hot)
    assert torch.equal(target_probs(logits, SamplingParams(temperature=1.0, top_k=1)), one_hot)
    full = target_probs(logits, SamplingParams(temperature=0.7))
    for top_k in (64, 65, 10 ** 6):
        assert torch.equal(target_probs(logits, SamplingParams(temperature=0.7, top_k=top_k)), full)
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0]])  # top_k=1 keeps every token tied with the largest
    assert target_probs(ties, SamplingParams(top_k=1)).tolist() == [[0.0, 0.5, 0.5, 0.0]]


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, top_k=1, seed=3),
                                      SamplingParams(temperature=1.0, top_p=1e-300, seed=3),
                                      SamplingParams(temperature=0.8, top_k=10 ** 6, top_p=1.0, seed=3)])
def test_sampled_decoding_at_the_edges(setup, sampling):
    target, decoder, prompts, references = setup
    result = generate(decoder, prompts[1], MAX_NEW, sampling=sampling)
    assert len(result.tokens) == MAX_NEW and result.error is None
    if sampling.top_k == 1 or sampling.top_p < 1:  # only the top token survives: greedy output
        assert result.tokens == references[1]


def test_logits_without_a_distribution_raise_a_clear_error():
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(1, 8)
        logits[0, 3] = bad
        with pytest.raises(ValueError, match="no distribution"):
            target_probs(logits, SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="no distribution"):
        target_probs(torch.full((1, 8), -float("inf")), SamplingParams(temperature=1.0))


# --- a fault in one row ends that sequence alone ----------------------------------------------

def assert_isolated(results, references, faulty: int, message: str):
    assert results[faulty].finish_reason == "error"
    assert message in results[faulty].error
    for index, result in results.items():
        if index != faulty:
            assert result.error is None and result.tokens == references[index], index


def test_a_fault_in_one_rows_accept_ends_that_sequence_alone(setup, monkeypatch):
    target, decoder, prompts, references = setup
    original = steps_module.accept
    calls = {"n": 0}

    def faulty_accept(*args):
        calls["n"] += 1
        # the second step's batched accept fails; stepped row by row (calls 3, 4, 5), row 1 fails again
        if calls["n"] in (2, 4):
            raise RuntimeError("injected accept fault")
        return original(*args)

    monkeypatch.setattr(steps_module, "accept", faulty_accept)
    results, session = run(decoder, [SequenceRequest(p, MAX_NEW) for p in prompts])
    assert_isolated(results, references, 1, "RuntimeError: injected accept fault")
    assert 0 < len(results[1].tokens) < MAX_NEW  # what it had emitted before the fault
    monkeypatch.setattr(steps_module, "accept", original)
    again, _ = run(decoder, [SequenceRequest(prompts[1], MAX_NEW)])
    assert again[0].tokens == references[1]


def test_a_fault_in_one_rows_bookkeeping_ends_that_sequence_alone(setup, monkeypatch):
    target, decoder, prompts, references = setup
    original = BatchEngine._advance

    def faulty_advance(seq, *args):
        if seq.seq_id == 2 and len(seq.tokens) > 1:  # after its first decode step
            raise RuntimeError("injected bookkeeping fault")
        return original(seq, *args)

    monkeypatch.setattr(BatchEngine, "_advance", staticmethod(faulty_advance))
    results, _ = run(decoder, [SequenceRequest(p, MAX_NEW) for p in prompts])
    assert_isolated(results, references, 2, "RuntimeError: injected bookkeeping fault")
    assert 1 < len(results[2].tokens) < MAX_NEW


def test_a_fault_in_the_batched_medusa_draft_is_found_row_by_row(setup, monkeypatch):
    target, decoder, prompts, references = setup
    original = decoder.drafter.draft_tokens
    solo_calls = {"n": 0}

    def faulty_draft(hidden_BH, roots_B):
        if hidden_BH.shape[0] > 1:
            raise RuntimeError("injected draft fault")  # the batched call fails...
        solo_calls["n"] += 1
        if solo_calls["n"] == 3:  # ...and alone, the third row of the first batched step does
            raise ValueError("injected row fault")
        return original(hidden_BH, roots_B)

    monkeypatch.setattr(decoder.drafter, "draft_tokens", faulty_draft)
    results, _ = run(decoder, [SequenceRequest(p, MAX_NEW) for p in prompts])
    assert_isolated(results, references, 2, "ValueError: injected row fault")


def test_a_fault_in_the_batched_verify_forward_is_found_row_by_row(setup):
    target, decoder, prompts, references = setup

    def faulty_forward(module, args, kwargs):  # a fault only the long prompt's row triggers
        positions = kwargs.get("position_ids")
        if positions is not None and positions.shape[-1] <= 8 and int(positions.max()) >= PROMPT_LENGTHS[2]:
            raise IndexError("injected verify fault")

    handle = target.model.register_forward_pre_hook(faulty_forward, with_kwargs=True)
    try:
        results, session = run(decoder, [SequenceRequest(p, MAX_NEW) for p in prompts])
    finally:
        handle.remove()
    assert_isolated(results, references, 2, "IndexError: injected verify fault")
    assert results[2].tokens == references[2][:1]  # its prefill token only
    assert session.engine.rows == []


def test_a_prefill_fault_leaves_the_batch_as_it_was(setup):
    target, decoder, prompts, references = setup
    session = Scheduler(decoder, max_batch_size=3, max_cache_len=128)
    first = session.add(SequenceRequest(prompts[0], MAX_NEW))
    handle = target.model.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("injected")))
    try:
        with pytest.raises(RuntimeError, match="injected"):  # SequenceFailed, never a ValueError (a refusal)
            session.add(SequenceRequest(prompts[1], MAX_NEW))
    finally:
        handle.remove()
    assert session.num_active == 1 and len(session.engine.rows) == 1
    tokens = []
    while session.num_active:
        for update in session.step():
            assert update.seq_id == first
            tokens += update.new_tokens
    assert tokens == references[0]


def test_one_sequence_generate_raises_its_fault(setup, monkeypatch):
    target, decoder, prompts, references = setup

    def broken(*args):
        raise KeyError("injected")

    monkeypatch.setattr(steps_module, "accept", broken)
    with pytest.raises(KeyError, match="injected"):
        generate(decoder, prompts[0], MAX_NEW)


# --- what is fatal ----------------------------------------------------------------------------

def test_only_a_lost_device_or_repeated_out_of_memory_is_fatal():
    assert is_fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_fatal(RuntimeError("CUDA error: device-side assert triggered"))
    assert is_fatal(EngineBroken("out of memory again"))
    for err in (RuntimeError("shape mismatch"), ValueError("nan"), IndexError("index out of range"),
                torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")):
        assert not is_fatal(err), err


@pytest.mark.parametrize("failures, fatal", [(1, False), (2, True)])
def test_out_of_memory_in_verify_is_retried_once(setup, failures, fatal):
    target, decoder, prompts, references = setup
    session = Scheduler(decoder, max_batch_size=3, max_cache_len=128)
    session.add(SequenceRequest(prompts[0], MAX_NEW))
    session.step()  # the prefill's token
    left = {"n": failures}

    def out_of_memory(module, args):
        if left["n"]:
            left["n"] -= 1
            raise torch.OutOfMemoryError("injected out of memory")

    handle = target.model.register_forward_pre_hook(out_of_memory)
    try:
        if fatal:
            with pytest.raises(EngineBroken, match="again after emptying"):
                session.step()
        else:
            tokens = session.step()[0].new_tokens
            assert tokens == references[0][1:1 + len(tokens)]
    finally:
        handle.remove()
