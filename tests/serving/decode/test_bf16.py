"""bf16, the CPU's fast dtype: greedy decoding with heads on packed weights matches HF's own
bf16 greedy decoding, or parts from it only at a near-tie of the fp32 target's logits
(bench/divergence.py). The check can fail: a made-up difference at a clear choice is flagged."""

from __future__ import annotations

import pytest
import torch

from specheads.bench.divergence import BF16_TIE_TOLERANCE, DivergenceChecker, first_difference
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.generate import generate
from specheads.serving.decode.trees import DraftTree

from test_batch import MultiOracle, hf_greedy

NUM_PROMPTS, MAX_NEW = 8, 24
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture(scope="module")
def targets(tiny_llama_dir):
    bf16 = TargetAdapter.from_pretrained(tiny_llama_dir, dtype="bfloat16", pack_weights=True)
    fp32 = TargetAdapter.from_pretrained(tiny_llama_dir, dtype="float32")
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, bf16.vocab_size, (n,), generator=generator).tolist()
               for n in torch.randint(2, 20, (NUM_PROMPTS,), generator=generator).tolist()]
    return bf16, fp32, prompts


class Bf16Oracle(MultiOracle):
    """test_batch's oracle Medusa heads over bf16 hidden states (matched in fp32)."""

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_BTH.float())


def test_bf16_greedy_with_heads_differs_from_hf_bf16_only_at_near_ties(targets):
    bf16, fp32, prompts = targets
    with torch.inference_mode(), bf16.plain_weights():
        references = [hf_greedy(bf16, prompt, MAX_NEW + 8) for prompt in prompts]
    # Heads that know HF's continuations: whole paths are accepted, so most tokens come from
    # multi-token verify forwards, the bf16 numerics that differ from HF's one-token steps.
    oracle = Bf16Oracle(bf16, [p + r for p, r in zip(prompts, references)], [len(p) for p in prompts]).float()
    decoder = SpeculativeDecoder(bf16, oracle, DraftTree.from_paths([[0], [1], [0, 0], [0, 0, 0]]), fallback=None)
    checker = DivergenceChecker(fp32, BF16_TIE_TOLERANCE)
    num_identical, accepted = 0, 0
    for prompt, reference in zip(prompts, references):
        result = generate(decoder, prompt, MAX_NEW)
        accepted += result.stats.accepted_tokens
        divergence = checker.check(prompt, reference[:MAX_NEW], result.tokens)
        num_identical += divergence is None
        assert divergence is None or divergence.near_tie, (prompt, divergence)
    assert accepted >= NUM_PROMPTS * MAX_NEW // 3  # the verify forwards really ran several tokens
    assert num_identical >= NUM_PROMPTS // 2  # most agree outright; the check above covers the rest


def test_the_near_tie_check_flags_a_difference_at_a_clear_choice(targets):
    _, fp32, prompts = targets
    prompt = prompts[0]
    with torch.inference_mode():
        logits_V = fp32(torch.tensor([prompt]), []).logits[0, -1]
    ranked = logits_V.argsort(descending=True).tolist()
    checker = DivergenceChecker(fp32, BF16_TIE_TOLERANCE)
    clear = checker.check(prompt, [ranked[0]], [ranked[-1]])  # the best token against the worst
    assert clear.position == 0 and not clear.near_tie
    assert clear.gap == pytest.approx(float(logits_V[ranked[0]] - logits_V[ranked[-1]]), rel=1e-5)
    assert checker.check(prompt, [ranked[0], 5], [ranked[0], 5]) is None
    assert first_difference([1, 2, 3], [1, 2]) == 2 and first_difference([1, 2], [1, 2]) is None
    stopped = checker.check(prompt, [ranked[0]], [])
    assert stopped.method_token is None and not stopped.near_tie
    with pytest.raises(ValueError, match="must be the fp32 target"):
        DivergenceChecker(targets[0], BF16_TIE_TOLERANCE)
