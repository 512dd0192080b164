"""Batch > 1: sequences decoded together give each sequence's own greedy output.

A Scheduler decodes prompts of different lengths with different max_new_tokens, stop
sequences and EOS, admitting new sequences while others run (continuous batching), and
each output must equal HF greedy `generate` for that prompt alone. Checked for plain
decoding, Medusa (random heads and an oracle that knows every prompt's continuation, so
that whole paths of different lengths are accepted per row), Medusa with AdaEDL depth
cuts, EAGLE static and dynamic trees, and the Triton tree-attention path (interpreted).
Then the fallback: heads that never match fall back to plain decoding and say so; heads
that always match keep speculating.
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
from specheads.serving.decode.trees import DynamicTreeConfig
from specheads.serving.decode.fallback import FallbackPolicy, StepCosts
from specheads.serving.decode.trees import DraftTree

from test_eagle3 import random_head

NUM_HEADS = 3
TREE_PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
PROMPT_LENGTHS = [3, 17, 8, 1, 25, 11]
MAX_NEW = [14, 9, 20, 5, 12, 16]


def hf_greedy(target: TargetAdapter, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class MultiOracle(nn.Module):
    """Stateless Medusa-shaped heads that know the greedy continuation of several prompts:
    a hidden state is mapped to its (prompt, position) by nearest neighbour and head k
    returns one-hot logits for the greedy token k+2 positions later. wrong=True ranks the
    right token last instead (heads that never match)."""

    def __init__(self, target: TargetAdapter, sequences: list[list[int]], prompt_lengths: list[int],
                 wrong: bool = False):
        super().__init__()
        self.num_heads, self.vocab_size, self.wrong = NUM_HEADS, target.vocab_size, wrong
        hidden, nexts = [], []
        with torch.no_grad():
            for tokens, length in zip(sequences, prompt_lengths):
                states = target(torch.tensor([tokens]), [target.num_layers]).taps[0][0]
                for position in range(length - 1, len(tokens)):
                    hidden.append(states[position])
                    ahead = [tokens[min(position + k + 2, len(tokens) - 1)] for k in range(NUM_HEADS)]
                    nexts.append(ahead)
        self.register_buffer("hidden_NH", torch.stack(hidden))
        self.register_buffer("next_NK", torch.tensor(nexts))

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        batch, num_positions, _ = hidden_BTH.shape
        flat = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
        rows = torch.cdist(flat, self.hidden_NH).argmin(dim=1)
        value = -10.0 if self.wrong else 10.0
        logits = torch.zeros(self.num_heads, flat.shape[0], self.vocab_size)
        for head in range(self.num_heads):
            logits[head, torch.arange(flat.shape[0]), self.next_NK[rows, head]] = value
        return logits.reshape(self.num_heads, batch, num_positions, self.vocab_size)


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, target.vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    references = [hf_greedy(target, p, m) for p, m in zip(prompts, MAX_NEW)]
    long = [p + hf_greedy(target, p, m + NUM_HEADS + 2) for p, m in zip(prompts, MAX_NEW)]
    return target, prompts, references, long


def run_session(decoder: SpeculativeDecoder, requests: list[SequenceRequest], max_batch_size: int = 3):
    """Continuous batching: admit while there is room; -> (tokens per request, results, steps
    that ran more than one sequence)."""
    session = Scheduler(decoder, max_batch_size=max_batch_size, max_cache_len=128)
    pending = list(enumerate(requests))
    ids, tokens, results, batched_steps = {}, {}, {}, 0
    while pending or session.num_active:
        while pending and session.has_capacity:
            index, request = pending.pop(0)
            ids[session.add(request)] = index
        batched_steps += session.num_active > 1
        for update in session.step():
            index = ids[update.seq_id]
            tokens.setdefault(index, []).extend(update.new_tokens)
            if update.finished:
                results[index] = update.result
    return [tokens[i] for i in range(len(requests))], [results[i] for i in range(len(requests))], batched_steps


def greedy_requests(prompts, max_new=MAX_NEW, **kwargs):
    return [SequenceRequest(p, m, **kwargs) for p, m in zip(prompts, max_new)]


def decoders(target, prompts, long):
    medusa = MedusaHeads(target.hidden_size, target.vocab_size, NUM_HEADS)
    eagle, config = random_head(target, seed=3)
    oracle = MultiOracle(target, long, PROMPT_LENGTHS)
    tree = DraftTree.from_paths(TREE_PATHS)
    return {
        "plain": SpeculativeDecoder(target),
        "medusa-random": SpeculativeDecoder(target, medusa, tree),
        "medusa-oracle": SpeculativeDecoder(target, oracle, tree),
        "medusa-oracle-adaedl": SpeculativeDecoder(target, oracle, tree, entropy_threshold=0.5),
        "eagle3-static": SpeculativeDecoder(target, eagle, tree, tap_layers=config.tap_layers),
        "eagle3-dynamic": SpeculativeDecoder(target, eagle, DynamicTreeConfig(depth=3, top_k=2, num_nodes=6),
                                             tap_layers=config.tap_layers),
    }


@pytest.mark.parametrize("kind", ["plain", "medusa-random", "medusa-oracle", "medusa-oracle-adaedl",
                                  "eagle3-static", "eagle3-dynamic"])
def test_batched_greedy_equals_each_sequence_alone(setup, kind):
    target, prompts, references, long = setup
    decoder = decoders(target, prompts, long)[kind]
    tokens, results, batched_steps = run_session(decoder, greedy_requests(prompts))
    assert tokens == references
    assert [r.tokens for r in results] == references
    assert all(r.finish_reason == "length" for r in results)
    assert batched_steps > 5  # sequences really ran together
    if kind.startswith("medusa-oracle"):
        # Whole paths accepted per row, in rows of different lengths.
        assert sum(r.stats.accepted_tokens for r in results) > sum(MAX_NEW) // 2


@pytest.mark.parametrize("kind", ["medusa-oracle-stop", "medusa-oracle-adaedl",
                                  pytest.param("eagle3-dynamic", marks=pytest.mark.slow)])  # 36 s on 2 cores
def test_kernel_path_batched(setup, tiny_llama_dir, kind):
    """The Triton tree-attention kernel (interpreted on the CPU) verifies padded per-row trees
    with per-row prefix lengths: static, AdaEDL-cut and dynamic trees, with a stop sequence."""
    target, prompts, references, long = setup
    tree_target = TargetAdapter.from_pretrained(tiny_llama_dir)  # its own model: the decoder switches attention
    tree = DraftTree.from_paths(TREE_PATHS)
    kernel = dict(attn_impl="tree", tree_attention_impl="triton")
    if kind.startswith("medusa"):
        oracle = MultiOracle(tree_target, long, PROMPT_LENGTHS)
        threshold = 0.5 if kind.endswith("adaedl") else None
        decoder = SpeculativeDecoder(tree_target, oracle, tree, entropy_threshold=threshold, **kernel)
    else:
        eagle, config = random_head(tree_target, seed=3)
        decoder = SpeculativeDecoder(tree_target, eagle, DynamicTreeConfig(depth=3, top_k=2, num_nodes=6),
                                     tap_layers=config.tap_layers, **kernel)
    requests = greedy_requests(prompts[:4], MAX_NEW[:4])
    expected = [list(r) for r in references[:4]]
    if kind.endswith("stop"):
        requests[1].stop_token_sequences = [references[1][2:4]]
        stop_at = next(i for i in range(1, len(expected[1])) if expected[1][i - 1:i + 1] == references[1][2:4])
        expected[1] = expected[1][:stop_at + 1]
    tokens, results, _ = run_session(decoder, requests)
    assert tokens == expected
    if kind.startswith("medusa"):
        assert sum(r.stats.accepted_tokens for r in results) > 0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("kind", ["plain", "medusa-oracle", "eagle3-dynamic", "medusa-oracle-triton"])
def test_fused_cpu_forward_batched_greedy_equals_hf(setup, tiny_llama_dir, kind):
    """The packed target runs the fused CPU forward (heads/target/cpu_decoder.py) in every prefill,
    draft tap and verify step, with the grouped attention or the tree attention: in fp32 its
    greedy output is HF's."""
    target, prompts, references, long = setup
    packed = TargetAdapter.from_pretrained(tiny_llama_dir, pack_weights=True)
    assert packed.fused is not None
    if kind == "medusa-oracle-triton":
        decoder = SpeculativeDecoder(packed, MultiOracle(packed, long, PROMPT_LENGTHS), DraftTree.from_paths(TREE_PATHS),
                                     attn_impl="tree", tree_attention_impl="triton")
    else:
        decoder = decoders(packed, prompts, long)[kind]
    tokens, results, _ = run_session(decoder, greedy_requests(prompts))
    assert tokens == references
    if kind.startswith("medusa"):
        assert sum(r.stats.accepted_tokens for r in results) > sum(MAX_NEW) // 2


def test_stop_sequences_eos_and_cancel_in_a_batch(setup):
    target, prompts, references, long = setup
    decoder = SpeculativeDecoder(target, MultiOracle(target, long, PROMPT_LENGTHS), DraftTree.from_paths(TREE_PATHS))
    requests = greedy_requests(prompts)
    requests[0].stop_token_sequences = [references[0][5:7]]
    requests[1].eos_token_id = references[1][3]
    tokens, results, _ = run_session(decoder, requests)
    stop_at = next(i for i in range(1, len(references[0])) if references[0][i - 1:i + 1] == references[0][5:7])
    assert tokens[0] == references[0][:stop_at + 1] and results[0].finish_reason == "stop"
    eos_at = references[1].index(references[1][3])
    assert tokens[1] == references[1][:eos_at + 1] and results[1].finish_reason == "stop"
    assert tokens[2:] == references[2:]

    session = Scheduler(decoder, max_batch_size=4, max_cache_len=128)
    seq_ids = [session.add(r) for r in greedy_requests(prompts[:3])]
    session.step()
    session.cancel(seq_ids[1])
    assert session.num_active == 2
    got = {seq_ids[0]: [], seq_ids[2]: []}
    while session.num_active:
        for update in session.step():
            got[update.seq_id].extend(update.new_tokens)
    assert got[seq_ids[2]] == references[2][len(references[2]) - len(got[seq_ids[2]]):]


def test_bad_requests_are_refused_before_admission(setup):
    target, prompts, _, _ = setup
    session = Scheduler(SpeculativeDecoder(target), max_batch_size=2, max_cache_len=32)
    with pytest.raises(ValueError, match="max_cache_len 32"):
        session.add(SequenceRequest(prompts[4], 20))
    with pytest.raises(ValueError, match="max_new_tokens"):
        session.add(SequenceRequest(prompts[0], 0))
    assert session.num_active == 0
    session.add(SequenceRequest(prompts[0], 3))
    session.add(SequenceRequest(prompts[1], 3))
    with pytest.raises(RuntimeError, match="full"):
        session.add(SequenceRequest(prompts[2], 3))


class TickClock:
    """A clock that advances 1 s per reading: every timed step costs the same."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_fallback_engages_when_heads_never_match(setup):
    target, prompts, references, long = setup
    wrong = MultiOracle(target, long, PROMPT_LENGTHS, wrong=True)
    decoder = SpeculativeDecoder(target, wrong, DraftTree.from_paths(TREE_PATHS),
                                 fallback=FallbackPolicy(warmup_steps=4))
    result = generate(decoder, prompts[2], MAX_NEW[2])
    assert result.tokens == references[2]
    assert result.stats.fallback and "no draft token accepted" in result.stats.fallback_reason
    assert result.stats.fallback_step == 4 and result.stats.plain_steps == result.stats.steps - 4
    assert result.stats.accepted_tokens == 0
    retrying = SpeculativeDecoder(target, wrong, DraftTree.from_paths(TREE_PATHS),
                                  fallback=FallbackPolicy(warmup_steps=2, retry_after=3))
    again = generate(retrying, prompts[2], MAX_NEW[2])
    assert again.tokens == references[2]
    assert again.stats.fallbacks >= 3 and again.stats.plain_steps >= 9  # speculation retried, fell back again
    off = SpeculativeDecoder(target, wrong, DraftTree.from_paths(TREE_PATHS), fallback=None)
    kept = generate(off, prompts[2], MAX_NEW[2])
    assert kept.tokens == references[2] and not kept.stats.fallback and kept.stats.plain_steps == 0


def test_fallback_stays_off_when_heads_match(setup):
    target, prompts, references, long = setup
    oracle = MultiOracle(target, long, PROMPT_LENGTHS)
    decoder = SpeculativeDecoder(target, oracle, DraftTree.chain(NUM_HEADS),
                                 fallback=FallbackPolicy(warmup_steps=2, probe_steps=1))
    decoder.step_costs = StepCosts(clock=TickClock())  # every step "takes" 1 s, however busy the machine
    for index in (2, 5, 0):  # the first request times plain steps; the later ones reuse the costs
        result = generate(decoder, prompts[index], MAX_NEW[index])
        assert result.tokens == references[index]
        assert not result.stats.fallback
    assert decoder.step_costs.get(1, 1) is not None
    assert result.stats.plain_steps == 0 and result.stats.spec_tokens_per_s > result.stats.plain_tokens_per_s


def test_alpha_and_tau_agree_everywhere_after_a_fallback(setup):
    """generate, bench, tune, a server response and /metrics report one alpha and one tau, all
    from serving/decode/stats.py alpha_tau: tau counts speculative steps, not the plain steps
    after a fallback (costs injected: the outcome never depends on the machine's speed)."""
    from specheads.bench.harness import engine_method, summarise
    from specheads.bench.tune import Measured, summary
    from specheads.serving.server.metrics import ServerMetrics
    from specheads.serving.server.responses import aggregate_speculation
    from specheads.serving.server.worker import speculation_stats

    target, prompts, references, long = setup
    oracle = MultiOracle(target, long, PROMPT_LENGTHS)
    decoder = SpeculativeDecoder(target, oracle, DraftTree.chain(NUM_HEADS),
                                 fallback=FallbackPolicy(warmup_steps=2, retry_after=2),
                                 step_costs=StepCosts.fixed({(1, 1): 0.01}, {}, clock=TickClock()))
    result = generate(decoder, prompts[2], MAX_NEW[2])  # a speculative step "takes" 1 s, a plain one 0.01 s
    stats = result.stats
    assert result.tokens == references[2] and stats.fallback and stats.plain_steps > 0 and stats.accepted_tokens > 0
    spec_steps = stats.steps - stats.plain_steps
    expected = (stats.accepted_tokens / stats.drafted_tokens, (stats.accepted_tokens + spec_steps) / spec_steps)
    assert expected[1] != (stats.accepted_tokens + stats.steps) / stats.steps  # the two meanings differ here
    bench = summarise([engine_method("engine", "heads", decoder, None).generate(prompts[2], MAX_NEW[2])],
                      [True], None)
    measured = Measured()
    measured.add(result, 1.0)
    tuned = summary(measured, measured, [result.tokens])
    response = aggregate_speculation([speculation_stats(stats, True)])
    metrics = ServerMetrics()
    spec = speculation_stats(stats, True)
    metrics.observe_finished("length", 0.1, 1.0, 5, len(result.tokens), spec["drafts"], spec["drafted_tokens"],
                             spec["accepted_tokens"], spec["accepted_per_position"], spec["lookup_accepted_tokens"])
    for alpha, tau in [(stats.alpha, stats.tau), (bench["alpha"], bench["tau"]), (tuned["alpha"], tuned["tau"]),
                       (response["alpha"], response["tau"]), (metrics._alpha(), metrics._tau())]:
        assert (alpha, tau) == pytest.approx(expected)


def test_seeded_sampling_never_falls_back(setup):
    """A seed pins the output: it must not depend on measured timings."""
    from specheads.serving.decode.sampling import SamplingParams

    target, prompts, _, long = setup
    wrong = MultiOracle(target, long, PROMPT_LENGTHS, wrong=True)
    decoder = SpeculativeDecoder(target, wrong, DraftTree.from_paths(TREE_PATHS),
                                 fallback=FallbackPolicy(warmup_steps=2))
    seeded = generate(decoder, prompts[0], 12, sampling=SamplingParams(temperature=1.0, seed=3))
    assert not seeded.stats.fallback and seeded.stats.plain_steps == 0
    unseeded = generate(decoder, prompts[0], 12, sampling=SamplingParams(temperature=1.0))
    assert unseeded.stats.fallback


def test_batched_fallback_times_plain_steps_at_the_batch_size(setup):
    """In a batch the plain-step cost is timed at that batch size (a probe step in which every
    sequence decodes plainly), so the per-request decision compares like with like."""
    target, prompts, references, long = setup
    oracle = MultiOracle(target, long, PROMPT_LENGTHS)
    decoder = SpeculativeDecoder(target, oracle, DraftTree.from_paths(TREE_PATHS),
                                 fallback=FallbackPolicy(warmup_steps=1, probe_steps=1))
    tokens, results, _ = run_session(decoder, greedy_requests(prompts), max_batch_size=3)
    assert tokens == references
    assert any(decoder.step_costs.get(n, 1) is not None for n in (2, 3))
    assert sum(r.stats.plain_steps for r in results) > 0


def test_a_batch_falls_back_as_a_whole_when_speculation_is_predicted_not_to_pay(setup):
    """With measured costs saying a speculative step at batch size 3 costs more than tau plain
    steps, the batch decodes plainly (one speculative step every retry_after refreshes the
    estimate); outputs are unchanged and the stats say why."""
    target, prompts, references, long = setup
    oracle = MultiOracle(target, long, PROMPT_LENGTHS)
    decoder = SpeculativeDecoder(target, oracle, DraftTree.from_paths(TREE_PATHS),
                                 fallback=FallbackPolicy(retry_after=1000))
    # As if measured, and never overwritten by this machine's real timings: plain 1 ms, a tree
    # step 10 ms, tau 2.
    sizes = (2, 3)
    decoder.step_costs = StepCosts.fixed({**{(n, 1): 0.001 for n in sizes},
                                          **{(n, len(TREE_PATHS) + 1): 0.010 for n in sizes}},
                                         {n: 2.0 for n in sizes})
    tokens, results, _ = run_session(decoder, greedy_requests(prompts), max_batch_size=3)
    assert tokens == references
    assert all(r.stats.fallback and "in a batch of" in r.stats.fallback_reason for r in results[:3])
    assert sum(r.stats.plain_steps for r in results) > sum(r.stats.steps for r in results) // 2
    assert decoder.step_costs.predicted_gain(3) < 0.9


def test_a_removal_that_moves_a_new_sequence_forward(setup):
    """Cancel the first sequence right after admitting a new one: the new one moves into
    row 0 before it has joined; the next step must still decode the right rows."""
    target, prompts, references, long = setup
    decoder = SpeculativeDecoder(target, MultiOracle(target, long, PROMPT_LENGTHS), DraftTree.from_paths(TREE_PATHS))
    session = Scheduler(decoder, max_batch_size=3, max_cache_len=128)
    first, second = session.add(SequenceRequest(prompts[0], MAX_NEW[0])), session.add(SequenceRequest(prompts[1], MAX_NEW[1]))
    got = {first: [], second: []}
    for update in session.step() + session.step():
        got[update.seq_id].extend(update.new_tokens)
    third = session.add(SequenceRequest(prompts[2], MAX_NEW[2]))
    got[third] = []
    session.cancel(first)
    while session.num_active:
        for update in session.step():
            got[update.seq_id].extend(update.new_tokens)
    assert got[second] == references[1] and got[third] == references[2]
