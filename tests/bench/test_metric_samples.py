"""Prometheus /metrics text is read with prometheus_client's parser (bench/support.py
metric_samples): llama-server's speculative counters (bench/llama_cpp.py) and specheads
serve's (bench/tools/serve_load.py)."""

from __future__ import annotations

from specheads.bench.llama_cpp import spec_counters_of
from specheads.bench.support import metric_samples

LLAMA_SERVER_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 312
# HELP llamacpp:spec_decode_num_draft_tokens_total Draft tokens proposed.
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 120
# HELP llamacpp:spec_decode_num_accepted_tokens_total Draft tokens accepted.
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 53
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 40
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 30
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2.3e1
"""


def test_llama_servers_counters_are_read_by_the_prometheus_parser():
    assert spec_counters_of(LLAMA_SERVER_METRICS) == {"draft_tokens": 120.0, "accepted_tokens": 53.0, "drafts": 40.0,
                                                      "pos0": 30.0, "pos1": 23.0}


def test_specheads_serve_counters_are_read_from_its_exposition():
    from specheads.bench.tools.serve_load import SPEC_COUNTERS
    from specheads.serving.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.drafts.inc(4)
    metrics.draft_tokens.inc(12)
    metrics.accepted_tokens.inc(7)
    samples = {name: value for name, labels, value in metric_samples(metrics.render().decode()) if name in SPEC_COUNTERS}
    assert samples == dict(zip(SPEC_COUNTERS, (4.0, 12.0, 7.0)))
