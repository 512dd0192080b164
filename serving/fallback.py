"""The fallback policy's parameters and the measured step costs it decides by.

serving/engine.py's module docstring says how the engine uses them: one sequence falls back
to plain decoding when its own measured tokens/s over a window is below plain decoding's;
a batch speculates or not as a whole, by `StepCosts.predicted_gain`.
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
