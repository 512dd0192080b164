"""Falling back to plain decoding when speculation does not pay: the policy's parameters
(`FallbackPolicy`), the measured step costs it decides by (`StepCosts`) and the decisions
themselves (`BatchFallback`, which serving/decode/engine.py asks before each step and tells after).

The engine measures the time of every decode step with `StepCosts.clock` (tests replace it),
keyed by (batch size, padded tree size), and the tokens per speculative step (tau) per
batch size, as EMAs in `StepCosts` (kept by the decoder, so later requests reuse them).
- One sequence: at the end of every window of `warmup_steps` speculative steps it falls
  back to plain decoding when no draft token was accepted in the window, or when its
  tokens per second over the window are below (1 - margin) x plain decoding's (1 / the
  cost of a T = 1 step, timed by `probe_steps` plain steps when none was yet). After
  `retry_after` plain steps it speculates again for another window: text often turns
  predictable later.
- A batch speculates or not as a whole (a plain row in a speculating batch still pays for
  the padded tree): when the measured costs and tau at this batch size predict
  speculation below (1 - margin) x plain, the step is plain for every sequence that may
  fall back, except one speculative step every `retry_after` that refreshes the estimate.
  The no-acceptance rule still applies per sequence.
The stats say so (`DecodeStats.fallback`, `fallbacks`, `fallback_reason`). Seeded sampling
never falls back: its random stream, hence its output, must not depend on timing.

A sequence here is the engine's `_Sequence`: its `stats`, its speculation window
(`spec_steps`, `spec_accepted`, `spec_seconds`, `plain_run`) and its flags (`speculating`,
`may_fall_back`, `finish_reason`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class FallbackPolicy:
    warmup_steps: int = 16  # speculative steps per decision window
    probe_steps: int = 2  # plain steps that time a T = 1 step when none was timed yet
    margin: float = 0.1  # fall back only when speculation is slower than (1 - margin) x plain
    retry_after: int = 64  # plain steps after a fallback before speculation is tried again

    def __post_init__(self):
        if self.warmup_steps < 1 or self.probe_steps < 1 or self.retry_after < 1:
            raise ValueError(f"warmup_steps, probe_steps and retry_after must be >= 1, got {self.warmup_steps}, "
                             f"{self.probe_steps} and {self.retry_after}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")


class StepCosts:
    """EMAs of measured decode-step seconds per (batch size, padded tree size), and of the
    tokens a speculative step gave per sequence (tau) per batch size, over all requests.

    The engine times its steps with `clock` (default time.perf_counter). Tests inject their
    own clock, or `StepCosts.fixed(...)` costs that measurements never overwrite, so that a
    fallback decision never depends on how fast or busy the machine is."""

    def __init__(self, smoothing: float = 0.2, clock: Callable[[], float] = time.perf_counter):
        self.smoothing = smoothing
        self.clock = clock
        self.frozen = False  # True: record() and record_tau() keep the given costs
        self.seconds: dict[tuple[int, int], float] = {}
        self.taus: dict[int, float] = {}
        self.spec_nodes: dict[int, int] = {}  # batch size -> padded tree size of its last speculative step

    @classmethod
    def fixed(cls, seconds: dict[tuple[int, int], float], taus: dict[int, float],
              clock: Callable[[], float] = time.perf_counter) -> "StepCosts":
        """Costs as given ({(batch size, tree size): seconds}, {batch size: tau}), never updated."""
        costs = cls(clock=clock)
        for (batch_size, num_nodes), value in seconds.items():
            costs.record(batch_size, num_nodes, value)
        for batch_size, tau in taus.items():
            costs.record_tau(batch_size, tau)
        costs.frozen = True
        return costs

    def _ema(self, table: dict, key, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + self.smoothing * (value - old)

    def record(self, batch_size: int, num_nodes: int, seconds: float) -> None:
        if self.frozen:
            return
        self._ema(self.seconds, (batch_size, num_nodes), seconds)
        if num_nodes > 1:
            self.spec_nodes[batch_size] = num_nodes

    def record_tau(self, batch_size: int, tau: float) -> None:
        if not self.frozen:
            self._ema(self.taus, batch_size, tau)

    def get(self, batch_size: int, num_nodes: int) -> float | None:
        return self.seconds.get((batch_size, num_nodes))

    def predicted_gain(self, batch_size: int, tau: float | None = None) -> float | None:
        """Speculation's tokens/s over plain decoding's at this batch size, from the measured
        step costs and tau (default: the recent tau of all requests); None until measured."""
        tau = self.taus.get(batch_size) if tau is None else tau
        num_nodes = self.spec_nodes.get(batch_size)
        plain, spec = self.get(batch_size, 1), None if num_nodes is None else self.get(batch_size, num_nodes)
        if tau is None or plain is None or spec is None:
            return None
        return tau * plain / spec


class BatchFallback:
    """One engine's fallback decisions (module doc) and its counters: the probe steps left,
    and per batch size the speculative steps run and the steps the batch gate made plain."""

    def __init__(self, decoder):
        self.decoder = decoder  # its .fallback (FallbackPolicy | None) and .step_costs are read each time
        self.probe_steps = 0  # steps left in which every sequence that may fall back decodes plainly
        self.spec_steps_at: dict[int, int] = {}
        self.gated_steps_at: dict[int, int] = {}

    def record(self, batch_size: int, num_nodes: int, speculative_tokens: list[int], seconds: float) -> None:
        """A whole step's cost, and the tokens each speculative row emitted (its tau)."""
        costs = self.decoder.step_costs
        costs.record(batch_size, num_nodes, seconds)
        if speculative_tokens:
            costs.record_tau(batch_size, sum(speculative_tokens) / len(speculative_tokens))
            self.spec_steps_at[batch_size] = self.spec_steps_at.get(batch_size, 0) + 1

    def end_step(self) -> None:
        if self.probe_steps:
            self.probe_steps -= 1

    def plain_step(self, batch: list) -> bool:
        """Whether the sequences that may fall back decode plainly this step: while probing the
        plain-step cost, or (batch > 1) when speculation is predicted not to pay at this batch
        size. One speculative step every retry_after keeps the estimate fresh."""
        policy = self.decoder.fallback
        if self.probe_steps:
            return True
        size = len(batch)
        if policy is None or size == 1 or not any(s.may_fall_back and s.speculating for s in batch):
            return False
        costs = self.decoder.step_costs
        gain = costs.predicted_gain(size)
        if gain is None:
            if costs.get(size, 1) is None and self.spec_steps_at.get(size, 0) >= policy.warmup_steps:
                self.probe_steps = policy.probe_steps
                return True
            return False
        if gain >= 1 - policy.margin:
            return False
        gated = self.gated_steps_at[size] = self.gated_steps_at.get(size, 0) + 1
        if gated % policy.retry_after == 0:
            return False
        for seq in batch:
            if seq.may_fall_back and seq.speculating and not seq.stats.fallback:
                seq.stats.fallback = True
                seq.stats.fallback_reason = (f"in a batch of {size} speculation was predicted at {gain:.2f}x plain "
                                             f"decoding's tokens/s (measured step costs and tau)")
                seq.stats.fallback_step = seq.stats.steps
                seq.stats.fallbacks += 1
        return True

    def after_step(self, seq, batch_size: int) -> None:
        """At the end of each window of warmup_steps speculative steps: keep speculating or fall
        back; in a batch only the no-acceptance rule is per request (see plain_step)."""
        policy = self.decoder.fallback
        if not seq.may_fall_back or not seq.speculating or self.probe_steps or seq.finish_reason is not None \
                or seq.spec_steps < policy.warmup_steps:
            return
        if seq.spec_accepted == 0:
            _fall_back(seq, f"no draft token accepted in {seq.spec_steps} speculative steps")
            return
        if batch_size > 1:  # a batch speculates or not as a whole (plain_step)
            seq.spec_steps, seq.spec_accepted, seq.spec_seconds = 0, 0, 0.0
            return
        plain_cost = self.decoder.step_costs.get(batch_size, 1)
        if plain_cost is None:
            self.probe_steps = policy.probe_steps  # time plain steps at this batch size, then decide
            return
        tau = (seq.spec_accepted + seq.spec_steps) / seq.spec_steps
        spec_rate, plain_rate = (seq.spec_accepted + seq.spec_steps) / seq.spec_seconds, 1.0 / plain_cost
        seq.stats.spec_tokens_per_s, seq.stats.plain_tokens_per_s = spec_rate, plain_rate
        if spec_rate < (1 - policy.margin) * plain_rate:
            _fall_back(seq, f"speculation measured {spec_rate:.1f} tokens/s (tau {tau:.2f}) below plain "
                            f"decoding's {plain_rate:.1f} tokens/s")
        else:
            seq.spec_steps, seq.spec_accepted, seq.spec_seconds = 0, 0, 0.0  # a new window


def _fall_back(seq, reason: str) -> None:
    seq.speculating = False
    seq.spec_steps, seq.spec_accepted, seq.spec_seconds, seq.plain_run = 0, 0, 0.0, 0
    seq.stats.fallback = True
    seq.stats.fallback_reason = reason
    if seq.stats.fallback_step is None:
        seq.stats.fallback_step = seq.stats.steps
    seq.stats.fallbacks += 1
