"""The fallback policy's decisions (serving/decode/fallback.py), driven step by step with
given timings: no model, no clock."""

from dataclasses import dataclass, field

from specheads.serving.decode.fallback import Fallback, FallbackPolicy, StepCosts
from specheads.serving.decode.stats import DecodeStats

TREE_NODES, DEPTH, TAU = 7, 3, 2
POLICY = FallbackPolicy(warmup_steps=4, probe_steps=2, margin=0.1, retry_after=50)


@dataclass
class Seq:
    window: object
    stats: DecodeStats = field(default_factory=DecodeStats)
    finish_reason: str | None = None
    kinds: str = ""  # each step's kind until the fallback: S speculative, P plain


def run(fallback: Fallback, steps: int, slow_from: int, slow_plain: float, slow_spec: float = 2.5) -> Seq:
    """One sequence at batch size 1: a plain step takes 1 s and a speculative one 1.2 s (TAU
    tokens), until step slow_from; from then on slow_plain and slow_spec."""
    seq = Seq(fallback.window(True, seeded=False))
    for step in range(steps):
        plain, spec = (1.0, 1.2) if step < slow_from else (slow_plain, slow_spec)
        (drafts,) = fallback.drafting([seq])
        if not seq.stats.fallback:
            seq.kinds += "S" if drafts else "P"
        if drafts:
            fallback.observe([seq], [DEPTH], [TAU], TREE_NODES, spec)
        else:
            fallback.observe([seq], [0], [1], 1, plain)
    return seq


def test_a_stale_plain_cost_is_timed_again_before_a_slow_window_falls_back():
    # The machine slows to half speed at step 10: plain 2 s, speculative 2.5 s (0.8 tok/s, above
    # 0.9 x 0.5). Judged against the 1 tok/s timed before, that window would fall back.
    fallback = Fallback(POLICY, StepCosts())
    seq = run(fallback, steps=40, slow_from=10, slow_plain=2.0)
    assert not seq.stats.fallback and seq.stats.fallbacks == 0
    assert fallback.costs.get(1, 1) == 2.0  # the new timing replaced the stale one, not its EMA
    assert (seq.stats.spec_tokens_per_s, seq.stats.plain_tokens_per_s) == (0.8, 0.5)


def test_speculation_that_is_really_slower_still_falls_back_after_the_new_timing():
    # Only speculative steps slow down (plain stays at 1 s): 0.8 tok/s is below 0.9 x 1.
    fallback = Fallback(POLICY, StepCosts())
    seq = run(fallback, steps=40, slow_from=10, slow_plain=1.0)
    assert seq.stats.fallback and seq.stats.fallbacks == 1
    assert seq.kinds == "SSSSPP" + "SSSS" + "SSSSPP"  # the third window fell short, was timed again, fell back
    assert "0.8 tokens/s (tau 2.00) below plain decoding's 1.0 tokens/s" in seq.stats.fallback_reason


def test_a_first_timing_is_fresh_and_fixed_costs_are_never_timed_again():
    # Slow from the start: the plain cost is first timed after the first window, so that window
    # is judged on it at once (no second timing).
    fallback = Fallback(POLICY, StepCosts())
    seq = run(fallback, steps=12, slow_from=0, slow_plain=1.0)
    assert seq.stats.fallback and seq.kinds == "SSSSPP"  # one window, its first timing, the decision
    fixed = Fallback(POLICY, StepCosts.fixed({(1, 1): 1.0}, {}))
    seq = run(fixed, steps=12, slow_from=0, slow_plain=1.0)
    assert seq.stats.fallback and seq.kinds == "SSSS"
    assert fixed.costs.get(1, 1) == 1.0
