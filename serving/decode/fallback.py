"""Falling back to plain decoding when speculation does not pay: the policy's parameters
(`FallbackPolicy`), the measured step costs it decides by (`StepCosts`) and the decisions
themselves (`Fallback`, which serving/decode/engine.py asks before each step and tells after),
with each sequence's state in its own `SpeculationWindow`.

The engine measures the time of every decode step with `StepCosts.clock` (tests replace it),
keyed by (batch size, padded tree size), and the tokens per speculative step (tau) per
batch size, as EMAs in `StepCosts` (kept by the decoder, so later requests reuse them).
- One sequence: at the end of every window of `warmup_steps` speculative steps it falls
  back to plain decoding when no draft token was accepted in the window, or when its
  tokens per second over the window are below (1 - margin) x plain decoding's (1 / the
  cost of a T = 1 step, timed by `probe_steps` plain steps when none was yet). Before a
  window that was too slow makes it fall back, the plain cost is timed again (`probe_steps`
  plain steps; not with fixed costs) and the window judged against that: a machine that
  slowed down since the plain cost was timed slows plain decoding too (on a busy shared machine,
  a stale plain cost made 1 of 40 SmolLM2 requests fall back: its window's 31.7 tokens/s at
  tau 1.62 judged against 35.9 timed earlier). After `retry_after` plain steps it
  speculates again for another window: text often turns predictable later.
- A batch speculates or not as a whole (a plain row in a speculating batch still pays for
  the padded tree): when the measured costs and tau at this batch size predict
  speculation below (1 - margin) x plain, the step is plain for every sequence that may
  fall back, except one speculative step every `retry_after` that refreshes the estimate.
  The no-acceptance rule still applies per sequence.
The stats say so (`DecodeStats.fallback`, `fallbacks`, `fallback_reason`). Seeded sampling
never falls back: its random stream, hence its output, must not depend on timing.

A sequence here is the engine's `Sequence`: its `window`, its `stats` (where a fallback is
reported) and its `finish_reason`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from specheads.serving.decode.stats import alpha_tau


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
        self.frozen = False  # True: record() keeps the given costs
        self.seconds: dict[tuple[int, int], float] = {}
        self.taus: dict[int, float] = {}
        self.spec_nodes: dict[int, int] = {}  # batch size -> padded tree size of its last speculative step

    @classmethod
    def fixed(cls, seconds: dict[tuple[int, int], float], taus: dict[int, float],
              clock: Callable[[], float] = time.perf_counter) -> "StepCosts":
        """Costs as given ({(batch size, tree size): seconds}, {batch size: tau}), never updated."""
        costs = cls(clock=clock)
        costs.seconds, costs.taus = dict(seconds), dict(taus)
        for batch_size, num_nodes in seconds:
            if num_nodes > 1:
                costs.spec_nodes[batch_size] = num_nodes
        costs.frozen = True
        return costs

    def record(self, batch_size: int, num_nodes: int, seconds: float, tau: float | None = None) -> None:
        """One step of this batch size and padded tree size took `seconds`; tau: its tokens per
        speculating sequence (None: no sequence drafted)."""
        if self.frozen:
            return
        for table, key, value in ((self.seconds, (batch_size, num_nodes), seconds), (self.taus, batch_size, tau)):
            if value is not None:
                old = table.get(key)
                table[key] = value if old is None else old + self.smoothing * (value - old)
        if num_nodes > 1:
            self.spec_nodes[batch_size] = num_nodes

    def get(self, batch_size: int, num_nodes: int) -> float | None:
        return self.seconds.get((batch_size, num_nodes))

    def forget(self, batch_size: int, num_nodes: int) -> None:
        """Drop a cost, so that its next measurement replaces it instead of moving its EMA."""
        self.seconds.pop((batch_size, num_nodes), None)

    def predicted_gain(self, batch_size: int, tau: float | None = None) -> float | None:
        """Speculation's tokens/s over plain decoding's at this batch size, from the measured
        step costs and tau (default: the recent tau of all requests); None until measured."""
        tau = self.taus.get(batch_size) if tau is None else tau
        num_nodes = self.spec_nodes.get(batch_size)
        plain, spec = self.get(batch_size, 1), None if num_nodes is None else self.get(batch_size, num_nodes)
        if tau is None or plain is None or spec is None:
            return None
        return tau * plain / spec


@dataclass
class SpeculationWindow:
    """One sequence's fallback state: whether it drafts, and its current decision window."""

    speculating: bool  # drafts when the batch gate lets it (False: speculation off, or fallen back)
    may_fall_back: bool  # False: no policy, speculation off, or seeded sampling
    steps: int = 0  # speculative steps in the window
    accepted: int = 0  # draft tokens they accepted
    seconds: float = 0.0  # their wall time
    plain_run: int = 0  # plain steps since the last fallback (speculation is retried after retry_after)
    retimed: bool = False  # the plain cost was timed during this window (first timed, or again after it fell short)
    fell_back: bool = False  # it fell back at least once, or a batch gate made it plain (its stats say why)

    def restart(self) -> None:
        """A new decision window."""
        self.steps, self.accepted, self.seconds, self.retimed = 0, 0, 0.0, False


class Fallback:
    """One engine's fallback decisions (module doc). The engine asks `drafting(batch)` before
    each step and tells `observe(...)` after committing it; nothing else reads or writes a
    sequence's window. Counters: the probe steps left, and per batch size the speculative
    steps run and the steps the batch gate made plain."""

    def __init__(self, policy: FallbackPolicy | None, costs: StepCosts):
        self.policy, self.costs = policy, costs
        self.probe_steps = 0  # steps left in which every sequence that may fall back decodes plainly
        self.spec_steps_at: dict[int, int] = {}
        self.gated_steps_at: dict[int, int] = {}

    def window(self, speculating: bool, seeded: bool) -> SpeculationWindow:
        """A new sequence's window; seeded sampling never falls back (its output must not depend on timing)."""
        return SpeculationWindow(speculating=speculating,
                                 may_fall_back=speculating and self.policy is not None and not seeded)

    def drafting(self, batch: list) -> list[bool]:
        """The one question before a step: which of the batch's sequences draft."""
        for seq in batch:
            window = seq.window
            if window.may_fall_back and not window.speculating and window.plain_run >= self.policy.retry_after:
                window.speculating = True  # try speculating again: the text may have become predictable
        plain = bool(self.probe_steps) or (len(batch) > 1 and self._plain_step(batch))
        return [seq.window.speculating and not (plain and seq.window.may_fall_back) for seq in batch]

    def observe(self, batch: list, depths: list[int], emitted: list[int | None], num_nodes: int,
                seconds: float) -> None:
        """The one thing after a committed step: each sequence's drafted depth (0: a plain step)
        and emitted tokens (None: it failed; then the step is no measure of the step cost), the
        padded tree size and the step's seconds."""
        speculative = [(depth, count) for depth, count in zip(depths, emitted) if depth > 0 and count is not None]
        if all(count is not None for count in emitted):
            tau = None
            if speculative:
                _, tau = alpha_tau(sum(count - 1 for _, count in speculative), sum(depth for depth, _ in speculative),
                                   len(speculative))
                self.spec_steps_at[len(batch)] = self.spec_steps_at.get(len(batch), 0) + 1
            self.costs.record(len(batch), num_nodes, seconds, tau)
        for seq, depth, count in zip(batch, depths, emitted):
            if count is None:
                continue
            window = seq.window
            if depth == 0:
                window.plain_run += 1
            else:
                window.steps += 1
                window.accepted += count - 1
                window.seconds += seconds
        if self.probe_steps:
            self.probe_steps -= 1
        for seq, count in zip(batch, emitted):
            if count is not None and self.policy is not None and seq.window.steps >= self.policy.warmup_steps:
                self._decide(seq, len(batch))  # a window ended

    def _plain_step(self, batch: list) -> bool:
        """Whether, in a batch of more than one (a single sequence is judged by its window alone)
        and outside a probe, the sequences that may fall back decode plainly this step: when
        speculation is predicted not to pay at this batch size. One speculative step every
        retry_after keeps the estimate fresh."""
        policy = self.policy
        size = len(batch)
        if policy is None or not any(s.window.may_fall_back and s.window.speculating for s in batch):
            return False
        gain = self.costs.predicted_gain(size)
        if gain is None:
            if self.costs.get(size, 1) is None and self.spec_steps_at.get(size, 0) >= policy.warmup_steps:
                self.probe_steps = policy.probe_steps
                return True
            return False
        if gain >= 1 - policy.margin:
            return False
        gated = self.gated_steps_at[size] = self.gated_steps_at.get(size, 0) + 1
        if gated % policy.retry_after == 0:
            return False
        for seq in batch:
            if seq.window.may_fall_back and seq.window.speculating and not seq.window.fell_back:
                _mark(seq, f"in a batch of {size} speculation was predicted at {gain:.2f}x plain "
                                 f"decoding's tokens/s (measured step costs and tau)")
        return True

    def _decide(self, seq, batch_size: int) -> None:
        """At the end of each window of warmup_steps speculative steps: keep speculating or fall
        back; in a batch only the no-acceptance rule is per request (see _plain_step)."""
        policy, window = self.policy, seq.window
        if not window.may_fall_back or not window.speculating or self.probe_steps \
                or seq.finish_reason is not None or window.steps < policy.warmup_steps:
            return
        if window.accepted == 0:
            self._fall_back(seq, f"no draft token accepted in {window.steps} speculative steps")
            return
        if batch_size > 1:  # a batch speculates or not as a whole (_plain_step)
            window.restart()
            return
        plain_cost = self.costs.get(batch_size, 1)
        if plain_cost is not None:
            _, tau = alpha_tau(window.accepted, 0, window.steps)  # tau alone: a window counts no drafted tokens
            spec_rate, plain_rate = (window.accepted + window.steps) / window.seconds, 1.0 / plain_cost
            seq.stats.spec_tokens_per_s, seq.stats.plain_tokens_per_s = spec_rate, plain_rate
            if spec_rate >= (1 - policy.margin) * plain_rate:
                window.restart()
                return
            if window.retimed or self.costs.frozen:
                self._fall_back(seq, f"speculation measured {spec_rate:.1f} tokens/s (tau {tau:.2f}) below plain "
                                     f"decoding's {plain_rate:.1f} tokens/s")
                return
            self.costs.forget(batch_size, 1)  # it may be stale: the new timing replaces it
        self.probe_steps = policy.probe_steps  # time plain steps at this batch size, then decide this window
        window.retimed = True

    @staticmethod
    def _fall_back(seq, reason: str) -> None:
        window = seq.window
        window.speculating = False
        window.restart()
        window.plain_run = 0
        _mark(seq, reason)


def _mark(seq, reason: str) -> None:
    """Report a fallback in the sequence's stats (read by its result, never by a decision)."""
    seq.window.fell_back = True
    stats = seq.stats
    stats.fallback = True
    stats.fallback_reason = reason
    if stats.fallback_step is None:
        stats.fallback_step = stats.steps
    stats.fallbacks += 1
