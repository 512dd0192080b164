"""The target's processed distribution (serving/decode/sampling.py): temperature, top-k and
top-p in their order, the top-p cut against a stable sort of the whole vocabulary, each row
processed on its own, and SamplingParams' validation."""

from __future__ import annotations

import math

import pytest
import torch

from specheads.serving.decode import sampling
from specheads.serving.decode.sampling import SamplingParams, target_probs


def test_target_probs_processing_order():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    top2 = target_probs(logits, SamplingParams(top_k=2))
    assert torch.allclose(top2[0, :2], torch.tensor([3.0, 2.0]).softmax(0)) and top2[0, 2:].sum() == 0
    probs = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert torch.allclose(target_probs(probs, SamplingParams(top_p=0.7)), torch.tensor([[0.625, 0.375, 0.0]]))
    assert torch.allclose(target_probs(probs, SamplingParams(top_p=0.45)), torch.tensor([[1.0, 0.0, 0.0]]))
    assert torch.allclose(target_probs(probs, SamplingParams(top_p=0.45, temperature=0)),
                          torch.tensor([[1.0, 0.0, 0.0]]))
    # temperature before top-p: at t=0.5 the top token alone holds 0.66 > 0.6 of the mass.
    assert target_probs(probs, SamplingParams(temperature=0.5, top_p=0.6))[0, 1:].sum() == 0
    assert target_probs(probs, SamplingParams(temperature=1.0, top_p=0.6))[0, 1] > 0


def sorted_top_p(probs_NV: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p rule as its docstring states it, over a stable sort of the whole vocab."""
    keep = torch.zeros_like(probs_NV, dtype=torch.bool)
    for row, probs_V in enumerate(probs_NV):
        order = sorted(range(probs_V.shape[0]), key=lambda i: -float(probs_V[i]))  # Python's sort is stable
        mass = 0.0
        for i in order:
            if mass >= top_p:
                break
            keep[row, i], mass = True, mass + float(probs_V[i])
    return keep


def test_top_p_cuts_where_a_stable_sort_of_the_whole_vocab_would():
    """sampling.top_p_keep looks among the TOP_P_CANDIDATES most likely tokens first: rows whose
    cut lies there, rows with tokens tied across the cut (bf16 logits), rows whose cut lies
    beyond the candidates (a flat distribution) all cut as a full stable sort does."""
    assert sampling.TOP_P_CANDIDATES == 256
    tied = torch.full((1, 1000), 1e-9)
    tied[0, [7, 3, 500, 20]] = torch.tensor([0.4, 0.2, 0.2, 0.2])  # the cut at 0.5 keeps 7 and the first tie, 3
    flat = torch.full((1, 1000), 1.0)  # the 256 candidates hold 0.256 of the mass
    assert torch.nonzero(sorted_top_p(tied, 0.5))[:, 1].tolist() == [3, 7]
    gen = torch.Generator().manual_seed(0)
    rows = [tied.log(), flat] + [torch.randn(2, 1000, generator=gen) * scale for scale in (0.3, 3.0, 8.0)]
    rows += [(torch.randn(2, 1000, generator=gen) * 4).bfloat16().float(),  # bf16 logits: ties
             (torch.randn(2, 1000, generator=gen) * 2).round()]
    logits = torch.cat(rows)
    probs = logits.softmax(-1)
    for top_p in (0.1, 0.5, 0.9, 0.95):
        expected = sorted_top_p(probs, top_p)
        assert torch.equal(sampling.top_p_keep(probs, top_p), expected), top_p
        assert torch.equal(sampling.top_p_keep(probs, top_p, host_branches=False), expected), top_p  # a GPU's way
    per_row = torch.tensor([0.1, 0.5, 0.9, 0.95] * 3)[:probs.shape[0]]  # each row its own top_p
    expected = torch.cat([sorted_top_p(probs[i:i + 1], float(per_row[i])) for i in range(probs.shape[0])])
    for host_branches in (True, False):
        assert torch.equal(sampling.top_p_keep(probs, per_row, host_branches=host_branches), expected)
    kept = target_probs(tied.log(), SamplingParams(top_p=0.5))
    assert torch.nonzero(kept)[:, 1].tolist() == [3, 7]
    assert target_probs(flat, SamplingParams(top_p=0.5)).count_nonzero() == 500


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), r"temperature must be a finite number >= 0"),
    (dict(temperature=math.inf), r"temperature"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), r"top_k must be an integer >= 0"),
    (dict(top_k=2.5), r"top_k"),
    (dict(seed=-1), r"seed must be None or an integer in \[0, 2\*\*64 - 1\]"),
])
def test_validation_names_field_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
                                    SamplingParams(temperature=0.8, top_k=20, top_p=0.95)],
                         ids=["t1.0", "t0.7-top_p0.9", "top_k20-top_p0.95"])
def test_each_row_processed_alone_equals_its_row_processed_with_the_others(params):
    """The accept walk processes only the rows it visits, a level at a time: that is exact
    only because target_probs treats every row on its own, bit for bit."""
    torch.manual_seed(0)
    logits = torch.randn(16, 1000) * 3
    for rows in (logits, logits.bfloat16()):  # bf16 logits: ties across the top-p cut
        together = sampling.target_probs(rows, params)
        for row in range(rows.shape[0]):
            assert torch.equal(sampling.target_probs(rows[row:row + 1], params)[0], together[row]), row
