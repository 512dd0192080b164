"""Prometheus metrics for the HTTP server, on `prometheus_client`.

`ServerMetrics` owns every metric the server exports and one `CollectorRegistry` of its
own (never the library's global default `REGISTRY`), so two servers or two tests in one
process never share counts. The /metrics route (serving/server/app.py) answers
`render()` with the content type `prometheus_client.CONTENT_TYPE_LATEST`. Every metric is
prefixed `specheads_`; counters are declared with the `_total` that Prometheus names
them with (prometheus_client strips it from the family and puts it back on the sample).
The library's metrics are thread-safe (the engine worker thread writes, the event loop
renders).

The per-series `_created` timestamps that prometheus_client adds to counters and
histograms are left out of the exposition: the library's only switch for them,
`disable_created_metrics()`, is process-wide, so `ServerMetrics.collect` drops those
samples for this registry alone.

Conventions (docs/architecture.md invariant 8): acceptance rate alpha = accepted draft tokens /
drafted tokens; acceptance length tau = tokens emitted per verify step = (accepted +
drafts) / drafts, where a draft is one speculative verify step. Everything is counted
per sequence (one choice of a request) when it finishes successfully, so the latency
histograms' counts equal the sum of `specheads_request_success_total`.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from specheads.serving.decode.stats import alpha_tau

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def _total(counter: Counter) -> float:
    """A counter's value summed over all its label values."""
    return sum(sample.value for family in counter.collect() for sample in family.samples
               if sample.name == family.name + "_total")


class ServerMetrics:
    """Every metric the server exports (see the module docstring for the conventions).

    Writers use prometheus_client's own API: `rejected.labels(status=503).inc()`,
    `itl.observe(seconds)`, `running.set_function(fn)`."""

    def __init__(self, running: Callable[[], float] = lambda: 0, waiting: Callable[[], float] = lambda: 0):
        # registry=None: the metrics are not registered anywhere; this object collects them
        # into its own registry (below).
        self.drafts = Counter("specheads_spec_decode_num_drafts_total",
                              "Speculative verify steps (one draft tree each).", registry=None)
        self.draft_tokens = Counter("specheads_spec_decode_num_draft_tokens_total",
                                    "Drafted tokens (steps x tree depth: what one path can contribute).",
                                    registry=None)
        self.accepted_tokens = Counter("specheads_spec_decode_num_accepted_tokens_total", "Accepted draft tokens.",
                                       registry=None)
        self.lookup_accepted_tokens = Counter("specheads_spec_decode_num_lookup_accepted_tokens_total",
                                              "Accepted draft tokens that came from n-gram lookup chains.",
                                              registry=None)
        self.store_accepted_tokens = Counter("specheads_spec_decode_num_store_accepted_tokens_total",
                                             "Accepted draft tokens that came from reply-store chains.",
                                             registry=None)
        self.accepted_per_pos = Counter("specheads_spec_decode_num_accepted_tokens_per_pos_total",
                                        "Verify steps that accepted a draft token at this depth (0-based).",
                                        ["position"], registry=None)
        self.acceptance_rate = Gauge("specheads_spec_decode_acceptance_rate",
                                     "alpha = accepted draft tokens / drafted tokens, since start.", registry=None)
        self.acceptance_rate.set_function(self._alpha)
        self.acceptance_length = Gauge("specheads_spec_decode_acceptance_length",
                                       "tau = tokens emitted per speculative verify step, since start.",
                                       registry=None)
        self.acceptance_length.set_function(self._tau)
        self.ttft = Histogram("specheads_time_to_first_token_seconds",
                              "Arrival to first token, per finished sequence.", buckets=LATENCY_BUCKETS,
                              unit="seconds", registry=None)
        self.itl = Histogram("specheads_inter_token_latency_seconds",
                             "Time per output token after the first (a step's gap split over its tokens).",
                             buckets=ITL_BUCKETS, unit="seconds", registry=None)
        self.e2e = Histogram("specheads_e2e_request_latency_seconds", "Arrival to finish, per finished sequence.",
                             buckets=LATENCY_BUCKETS, unit="seconds", registry=None)
        # Read at render time: the engine sets its live counts with set_function.
        self.running = Gauge("specheads_num_requests_running", "Sequences in the running batch.", registry=None)
        self.running.set_function(running)
        self.waiting = Gauge("specheads_num_requests_waiting", "Requests queued for admission.", registry=None)
        self.waiting.set_function(waiting)
        # The reply store's learned replies (serving/decode/learned_store.py): 0 without one.
        self.learned_tokens = Gauge("specheads_reply_store_learned_tokens",
                                    "Tokens of the replies the reply store learned (marks and separators included).",
                                    registry=None)
        self.learned_replies = Gauge("specheads_reply_store_learned_replies",
                                     "Replies the reply store learned since it started or was cleared.", registry=None)
        # Every request is counted at most once among these three (a request of n choices: once
        # per choice that ran). success: a sequence finished ("stop" | "length") and its choice
        # was sent. aborted: a sequence (or a request still queued) was dropped after the server
        # accepted the request, by reason: "disconnect" (the client left), "timeout" (past the
        # request timeout), "error" (it failed alone: serving/decode/faults.py), "failed" (a sibling
        # choice failed), "engine_error" (the engine broke), "shutting_down". rejected: the
        # server answered an error before the request reached the engine, by HTTP status (400
        # bad request, also when the engine refuses it at admission; 401; 404; 413; 499 the
        # client left while its body was read; 500 a server bug; 503 overloaded or not ready).
        self.success = Counter("specheads_request_success_total", "Finished sequences by finish reason.",
                               ["finished_reason"], registry=None)
        self.aborted = Counter("specheads_request_aborted_total",
                               "Accepted requests' sequences dropped before finishing, by reason.", ["reason"],
                               registry=None)
        self.rejected = Counter("specheads_request_rejected_total",
                                "Requests answered with an error before reaching the engine, by HTTP status.",
                                ["status"], registry=None)
        self.prompt_tokens = Counter("specheads_prompt_tokens_total", "Prompt tokens of finished sequences.",
                                     registry=None)
        self.generation_tokens = Counter("specheads_generation_tokens_total",
                                         "Tokens generated by finished sequences.", registry=None)
        self._all = [m for m in vars(self).values() if isinstance(m, MetricWrapperBase)]  # declaration order
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def _alpha(self) -> float:
        return alpha_tau(_total(self.accepted_tokens), _total(self.draft_tokens), _total(self.drafts))[0]

    def _tau(self) -> float:
        return alpha_tau(_total(self.accepted_tokens), _total(self.draft_tokens), _total(self.drafts))[1]

    def observe_finished(self, finish_reason: str, ttft_s: float, e2e_s: float, prompt_tokens: int,
                         generated_tokens: int, drafts: int, drafted_tokens: int, accepted_tokens: int,
                         accepted_per_position: list[int], lookup_accepted_tokens: int = 0,
                         store_accepted_tokens: int = 0) -> None:
        """One sequence finished successfully; drafts = its speculative verify steps."""
        self.success.labels(finished_reason=finish_reason).inc()
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        if drafted_tokens > 0:
            self.drafts.inc(drafts)
            self.draft_tokens.inc(drafted_tokens)
            self.accepted_tokens.inc(accepted_tokens)
            self.lookup_accepted_tokens.inc(lookup_accepted_tokens)
            self.store_accepted_tokens.inc(store_accepted_tokens)
            for position, count in enumerate(accepted_per_position):
                self.accepted_per_pos.labels(position=position).inc(count)

    def collect(self) -> Iterator[Metric]:
        """The registry's collector: every metric, in declaration order, without `_created`."""
        for metric in self._all:
            for family in metric.collect():
                family.samples = [s for s in family.samples if s.name != family.name + "_created"]
                yield family

    def render(self) -> bytes:
        """The exposition (text format of `prometheus_client.CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)
