"""Where a method's greedy output first differs from the reference's, and whether that is a
near-tie the target itself can hardly tell apart, or a bug.

In fp32 every method's greedy output must equal the reference (hf-greedy) token for token:
a difference is a bug unless the two tokens' fp32 logits are within 1e-3 (fp32 sums in
other orders too, so an exact tie can still flip). In bf16 two correct programs can differ: a verify forward over
T tokens and transformers' one-token steps sum in other orders and round differently, so
where the target's top two logits are within bf16 rounding of each other the argmax can
flip, and from there the texts part. The test of correctness in bf16 is therefore: at the
first differing position, the fp32 target's logits of the two tokens chosen (the reference's
and the method's) are within `tolerance` of each other. A difference farther apart than that
is not rounding: the bench flags it as a bug.

`BF16_TIE_TOLERANCE` was measured on SmolLM2-135M-Instruct: over 928 positions of the fp32
greedy continuations of MT-bench questions 25-36 (run through one forward in each dtype),
the difference between the fp32 target's top two logits moves by at most 0.54 logits in
bf16 (99th percentile 0.31, median 0.06), packed weights or not. Two bf16 programs that
disagree on the argmax can each be that far off, in opposite directions, so a flip needs
an fp32 gap below about twice that: 1.0 logits. fp16 keeps 3 more mantissa bits (about 8x
finer rounding); its tolerance is scaled from bf16's, not measured.

Shape legend: P prompt tokens, N new tokens before the first difference, V vocab.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

BF16_TIE_TOLERANCE = 1.0  # logits (see the module docstring)
FP16_TIE_TOLERANCE = 0.25  # logits: bf16's scaled by its 8x finer rounding, with a 2x margin (not measured)
FP32_TIE_TOLERANCE = 1e-3  # fp32 sums in other orders too (batched verify, packed weights): ~1e-5 of a logit
TOLERANCES = {torch.bfloat16: BF16_TIE_TOLERANCE, torch.float16: FP16_TIE_TOLERANCE,
              torch.float32: FP32_TIE_TOLERANCE}


@dataclass(frozen=True)
class Divergence:
    """The first position where a method's tokens differ from the reference's."""

    position: int  # index among the new tokens
    reference_token: int | None  # None: the reference stopped there
    method_token: int | None  # None: the method stopped there
    gap: float | None  # |fp32 logit(reference_token) - fp32 logit(method_token)|; None if either stopped
    near_tie: bool  # gap <= the dtype's tolerance: rounding can explain it

    def to_json(self) -> dict:
        return asdict(self)


def first_difference(reference: list[int], tokens: list[int]) -> int | None:
    """Index of the first differing token (one list ending early counts), None if equal."""
    for position, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return position
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


class DivergenceChecker:
    """Scores first differences with an fp32 copy of the target (`scorer`: a TargetAdapter in
    fp32), one forward per distinct (prompt, position), cached across methods."""

    def __init__(self, scorer, tolerance: float):
        if scorer.dtype != torch.float32:
            raise ValueError(f"the divergence scorer must be the fp32 target, got {scorer.dtype}")
        self.scorer = scorer
        self.tolerance = tolerance
        self._logits: dict[tuple, torch.Tensor] = {}

    def check(self, prompt_ids: list[int], reference: list[int], tokens: list[int]) -> Divergence | None:
        position = first_difference(reference, tokens)
        if position is None:
            return None
        ours = tokens[position] if position < len(tokens) else None
        theirs = reference[position] if position < len(reference) else None
        if ours is None or theirs is None:
            return Divergence(position, theirs, ours, None, False)
        logits_V = self._next_logits(prompt_ids + reference[:position])
        gap = abs(float(logits_V[theirs] - logits_V[ours]))
        return Divergence(position, theirs, ours, gap, gap <= self.tolerance)

    def _next_logits(self, context: list[int]) -> torch.Tensor:
        key = tuple(context)
        if key not in self._logits:
            input_ids_1N = torch.tensor([context], device=self.scorer.device)
            with torch.inference_mode():
                self._logits[key] = self.scorer(input_ids_1N, [], logits_to_keep=1).logits[0, -1].float().cpu()
        return self._logits[key]


def summarise_divergences(divergences: list[Divergence | None]) -> dict:
    """Per method: how many prompts differ, where on average, and how many are not near-ties."""
    found = [d for d in divergences if d is not None]
    return {"num_different": len(found),
            "first_difference_mean": sum(d.position for d in found) / len(found) if found else None,
            "num_near_tie": sum(d.near_tie for d in found),
            "num_not_near_tie": sum(not d.near_tie for d in found)}
