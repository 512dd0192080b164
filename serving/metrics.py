"""Prometheus metrics for the HTTP server, written in the text exposition format (0.0.4).

No client library: the server needs counters, gauges and histograms with a few labels,
and the format is a few lines of text. Every metric is prefixed `specheads_`. All
updates are thread-safe (the engine worker thread writes, the event loop renders).

Conventions (DESIGN.md invariant 8): acceptance rate alpha = accepted draft tokens /
drafted tokens; acceptance length tau = tokens emitted per verify step = (accepted +
drafts) / drafts, where a draft is one speculative verify step. Everything is counted
per sequence (one choice of a request) when it finishes successfully, so the latency
histograms' counts equal the sum of `specheads_request_success_total`.
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Iterable

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{name}="{_escape(value)}"' for name, value in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Iterable[str] = ()):
        if not name.startswith("specheads_"):
            raise ValueError(f"metric names must start with 'specheads_', got {name!r}")
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, object]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {list(self.labelnames)}, got {sorted(labels)}")
        return tuple(str(labels[name]) for name in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing count; rendered with the `_total` suffix in its name."""
    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Iterable[str] = ()):
        if not name.endswith("_total"):
            raise ValueError(f"counter names end with '_total', got {name!r}")
        super().__init__(name, help_text, labelnames)
        self._values: dict[tuple[str, ...], float] = {} if self.labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: counters only go up, got inc({amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def total(self) -> float:
        with self._lock:
            return sum(self._values.values())

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.labelnames, key)} {_format_value(v)}" for key, v in items]


class Gauge(_Metric):
    """A value that goes up and down, or one read from `source` at render time."""
    kind = "gauge"

    def __init__(self, name: str, help_text: str, source: Callable[[], float] | None = None):
        super().__init__(name, help_text)
        self._value = 0.0
        self._source = source

    def set_source(self, source: Callable[[], float]) -> None:
        """Read the value from `source` at render time (the engine's live counts)."""
        self._source = source

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def value(self) -> float:
        if self._source is not None:
            return float(self._source())
        with self._lock:
            return self._value

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {_format_value(self.value())}"]


class Histogram(_Metric):
    """Cumulative buckets plus _sum and _count."""
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Iterable[float] = LATENCY_BUCKETS):
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(float(b) for b in buckets))
        if not self.buckets:
            raise ValueError(f"{self.name}: a histogram needs at least one bucket")
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self._counts[i] += 1
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def render(self) -> list[str]:
        with self._lock:
            counts, total, count = list(self._counts), self._sum, self._count
        lines = self.header()
        for bound, bucket_count in zip(self.buckets, counts):
            lines.append(f'{self.name}_bucket{{le="{_format_value(bound)}"}} {bucket_count}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {count}')
        lines.append(f"{self.name}_sum {_format_value(total)}")
        lines.append(f"{self.name}_count {count}")
        return lines


class ServerMetrics:
    """Every metric the server exports (see the module docstring for the conventions)."""

    def __init__(self, running: Callable[[], float] = lambda: 0, waiting: Callable[[], float] = lambda: 0):
        p = "specheads_"
        self.drafts = Counter(p + "spec_decode_num_drafts_total", "Speculative verify steps (one draft tree each).")
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens_total",
                                    "Drafted tokens (steps x tree depth: what one path can contribute).")
        self.accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens_total", "Accepted draft tokens.")
        self.lookup_accepted_tokens = Counter(p + "spec_decode_num_lookup_accepted_tokens_total",
                                              "Accepted draft tokens that came from n-gram lookup chains.")
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos_total",
                                        "Verify steps that accepted a draft token at this depth (0-based).",
                                        ["position"])
        self.acceptance_rate = Gauge(p + "spec_decode_acceptance_rate",
                                     "alpha = accepted draft tokens / drafted tokens, since start.",
                                     source=self._alpha)
        self.acceptance_length = Gauge(p + "spec_decode_acceptance_length",
                                       "tau = tokens emitted per speculative verify step, since start.",
                                       source=self._tau)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token, per finished sequence.")
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "Time per output token after the first (a step's gap split over its tokens).",
                             ITL_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to finish, per finished sequence.")
        self.running = Gauge(p + "num_requests_running", "Sequences in the running batch.", source=running)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued for admission.", source=waiting)
        # Every request is counted at most once among these three (a request of n choices: once
        # per choice that ran). success: a sequence finished ("stop" | "length") and its choice
        # was sent. aborted: a sequence (or a request still queued) was dropped after the server
        # accepted the request, by reason: "disconnect" (the client left), "timeout" (past the
        # request timeout), "error" (it failed alone: serving/faults.py), "failed" (a sibling
        # choice failed), "engine_error" (the engine broke), "shutting_down". rejected: the
        # server answered an error before the request reached the engine, by HTTP status (400
        # bad request, also when the engine refuses it at admission; 401; 404; 413; 499 the
        # client left while its body was read; 500 a server bug; 503 overloaded or not ready).
        self.success = Counter(p + "request_success_total", "Finished sequences by finish reason.",
                               ["finished_reason"])
        self.aborted = Counter(p + "request_aborted_total",
                               "Accepted requests' sequences dropped before finishing, by reason.", ["reason"])
        self.rejected = Counter(p + "request_rejected_total",
                                "Requests answered with an error before reaching the engine, by HTTP status.",
                                ["status"])
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of finished sequences.")
        self.generation_tokens = Counter(p + "generation_tokens_total", "Tokens generated by finished sequences.")
        self._all = [self.drafts, self.draft_tokens, self.accepted_tokens, self.lookup_accepted_tokens,
                     self.accepted_per_pos,
                     self.acceptance_rate, self.acceptance_length, self.ttft, self.itl, self.e2e, self.running,
                     self.waiting, self.success, self.aborted, self.rejected, self.prompt_tokens,
                     self.generation_tokens]

    def _alpha(self) -> float:
        drafted = self.draft_tokens.total()
        return self.accepted_tokens.total() / drafted if drafted else 0.0

    def _tau(self) -> float:
        drafts = self.drafts.total()
        return (self.accepted_tokens.total() + drafts) / drafts if drafts else 0.0

    def observe_finished(self, finish_reason: str, ttft_s: float, e2e_s: float, prompt_tokens: int,
                         generated_tokens: int, drafts: int, drafted_tokens: int, accepted_tokens: int,
                         accepted_per_position: list[int], lookup_accepted_tokens: int = 0) -> None:
        """One sequence finished successfully; drafts = its speculative verify steps."""
        self.success.inc(finished_reason=finish_reason)
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        if drafted_tokens > 0:
            self.drafts.inc(drafts)
            self.draft_tokens.inc(drafted_tokens)
            self.accepted_tokens.inc(accepted_tokens)
            self.lookup_accepted_tokens.inc(lookup_accepted_tokens)
            for position, count in enumerate(accepted_per_position):
                self.accepted_per_pos.inc(count, position=position)

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._all:
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"
