"""`specheads serve` as a process: it starts, answers with the API key, refuses without it,
and exits 0 on SIGTERM and on Ctrl-C. Also the metrics exposition itself (prometheus_client)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from specheads.serving.server.metrics import ITL_BUCKETS, LATENCY_BUCKETS, ServerMetrics
from test_server_support import MODEL, metric_values, openai_client, running_server, scrape, tiny_setup  # noqa: F401


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])  # 8-10 s each
def test_serve_subcommand_end_to_end(tiny_setup, stop_signal):  # noqa: F811
    target_dir, heads_dir = tiny_setup
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "specheads", "serve", "--target", str(target_dir), "--heads", str(heads_dir),
         "--port", str(port), "--api-key", "k3y", "--served-model-name", "tiny", "--log-level", "warning"],
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert process.poll() is None, process.stdout.read().decode()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": "the cat", "max_tokens": 4, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
        response = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer k3y"}, timeout=30)
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        process.send_signal(stop_signal)
        status = process.wait(120)
    output = process.stdout.read().decode()
    # a graceful shutdown exits 0 (uvicorn alone would re-raise the signal: -15, or a KeyboardInterrupt)
    assert status == 0, output
    assert "Traceback" not in output, output


def test_serve_rejects_bad_flags(capsys):
    from specheads.cli import main

    assert main(["serve", "--target", "x", "--max-concurrency", "0"]) == 2
    assert "--max-concurrency must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--target", "x", "--lookup-num-tokens", "-1"]) == 2
    assert "--lookup-num-tokens must be >= 0" in capsys.readouterr().err
    assert main(["serve", "--target", "x", "--heads", "/no/such/dir"]) == 2
    assert "--heads" in capsys.readouterr().err


def test_metrics_text_format():
    metrics = ServerMetrics(running=lambda: 2, waiting=lambda: 1)
    metrics.observe_finished("stop", 0.01, 0.5, prompt_tokens=5, generated_tokens=9, drafts=4, drafted_tokens=12,
                             accepted_tokens=4, accepted_per_position=[3, 1, 0], lookup_accepted_tokens=2,
                             store_accepted_tokens=1)
    metrics.observe_finished("length", 0.02, 0.7, prompt_tokens=5, generated_tokens=8, drafts=0, drafted_tokens=0,
                             accepted_tokens=0, accepted_per_position=[])
    values = metric_values(metrics.render().decode())
    assert values['specheads_request_success_total{finished_reason="stop"}'] == 1
    assert values["specheads_e2e_request_latency_seconds_count"] == 2
    assert values['specheads_e2e_request_latency_seconds_bucket{le="0.5"}'] == 1
    assert values["specheads_spec_decode_acceptance_rate"] == pytest.approx(4 / 12)
    assert values["specheads_spec_decode_num_lookup_accepted_tokens_total"] == 2
    assert values["specheads_spec_decode_num_store_accepted_tokens_total"] == 1
    assert values["specheads_spec_decode_acceptance_length"] == pytest.approx((4 + 4) / 4)
    assert values['specheads_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 3
    assert values["specheads_num_requests_running"] == 2 and values["specheads_num_requests_waiting"] == 1
    with pytest.raises(ValueError, match="non-negative"):
        metrics.success.labels(finished_reason="stop").inc(-1)


# Every family the server exports, as prometheus_client's parser names it (a counter's
# family drops the `_total` that its samples carry).
FAMILY_TYPES = {
    "specheads_spec_decode_num_drafts": "counter", "specheads_spec_decode_num_draft_tokens": "counter",
    "specheads_spec_decode_num_accepted_tokens": "counter",
    "specheads_spec_decode_num_lookup_accepted_tokens": "counter",
    "specheads_spec_decode_num_store_accepted_tokens": "counter",
    "specheads_spec_decode_num_accepted_tokens_per_pos": "counter",
    "specheads_spec_decode_acceptance_rate": "gauge", "specheads_spec_decode_acceptance_length": "gauge",
    "specheads_time_to_first_token_seconds": "histogram", "specheads_inter_token_latency_seconds": "histogram",
    "specheads_e2e_request_latency_seconds": "histogram", "specheads_num_requests_running": "gauge",
    "specheads_num_requests_waiting": "gauge", "specheads_reply_store_learned_tokens": "gauge",
    "specheads_reply_store_learned_replies": "gauge", "specheads_request_success": "counter",
    "specheads_request_aborted": "counter", "specheads_request_rejected": "counter",
    "specheads_prompt_tokens": "counter", "specheads_generation_tokens": "counter",
}


def test_metrics_exposition_parses_as_prometheus():
    metrics = ServerMetrics(running=lambda: 3, waiting=lambda: 0)
    metrics.observe_finished("stop", 0.01, 0.5, prompt_tokens=5, generated_tokens=9, drafts=4, drafted_tokens=12,
                             accepted_tokens=4, accepted_per_position=[3, 1, 0])
    metrics.aborted.labels(reason="disconnect").inc()
    metrics.rejected.labels(status=503).inc(2)
    families = {family.name: family for family in text_string_to_metric_families(metrics.render().decode())}
    assert {name: family.type for name, family in families.items()} == FAMILY_TYPES
    names = {sample.name for family in families.values() for sample in family.samples}
    assert not [name for name in names if name.endswith("_created")]  # no per-series creation timestamps
    for name, buckets in [("specheads_time_to_first_token_seconds", LATENCY_BUCKETS),
                          ("specheads_e2e_request_latency_seconds", LATENCY_BUCKETS),
                          ("specheads_inter_token_latency_seconds", ITL_BUCKETS)]:
        bounds = [float(s.labels["le"]) for s in families[name].samples if s.name == name + "_bucket"]
        assert bounds == [*buckets, float("inf")]

    def value(family, sample, **labels):
        return next(s.value for s in families[family].samples if s.name == sample and s.labels == labels)

    assert value("specheads_request_success", "specheads_request_success_total", finished_reason="stop") == 1
    assert value("specheads_request_aborted", "specheads_request_aborted_total", reason="disconnect") == 1
    assert value("specheads_request_rejected", "specheads_request_rejected_total", status="503") == 2
    assert value("specheads_e2e_request_latency_seconds", "specheads_e2e_request_latency_seconds_bucket",
                 le="0.5") == 1
    assert value("specheads_e2e_request_latency_seconds", "specheads_e2e_request_latency_seconds_sum") == 0.5
    assert value("specheads_spec_decode_acceptance_rate", "specheads_spec_decode_acceptance_rate") == 4 / 12
    assert value("specheads_num_requests_running", "specheads_num_requests_running") == 3


def test_each_server_metrics_has_its_own_registry():
    first, second = ServerMetrics(), ServerMetrics()
    assert isinstance(first.registry, CollectorRegistry) and first.registry is not second.registry
    first.rejected.labels(status=503).inc()
    first.observe_finished("length", 0.02, 0.7, prompt_tokens=5, generated_tokens=8, drafts=1, drafted_tokens=3,
                           accepted_tokens=2, accepted_per_position=[1, 1, 0])
    ones, twos = metric_values(first.render().decode()), metric_values(second.render().decode())
    assert ones['specheads_request_rejected_total{status="503"}'] == 1
    assert 'specheads_request_rejected_total{status="503"}' not in twos
    assert ones["specheads_e2e_request_latency_seconds_count"] == 1
    assert twos["specheads_e2e_request_latency_seconds_count"] == 0
    assert twos["specheads_spec_decode_num_accepted_tokens_total"] == 0
    assert twos["specheads_spec_decode_acceptance_rate"] == 0
    assert not [family.name for family in REGISTRY.collect() if family.name.startswith("specheads_")]


def test_serve_exits_non_zero_when_the_target_does_not_load(tmp_path, capsys):
    """vLLM exits when its model does not load; so does `specheads serve`, in one line, rather than
    listening on with /health failing."""
    from conftest import make_tiny_model
    from specheads.cli import main

    assert main(["serve", "--target", str(tmp_path / "nowhere"), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"target {str(tmp_path / 'nowhere')!r} does not exist" in err  # before listening
    broken = make_tiny_model("llama", tmp_path / "broken")
    (broken / "model.safetensors").unlink()  # config.json passes the name check; loading fails in the server
    started = time.monotonic()
    assert main(["serve", "--target", str(broken), "--port", str(free_port()), "--device", "cpu",
                 "--log-level", "critical"]) == 2
    assert time.monotonic() - started < 60
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("specheads serve: error: the model did not load, so the server "
                                                     "stopped: OSError:"), errors


def test_the_server_learns_the_replies_it_serves(tiny_setup):  # noqa: F811
    """--store learn: a finished reply joins the store (the metrics count it), and the same
    request again drafts from it; the text is the same."""
    target_dir, _ = tiny_setup
    with running_server(target_dir, None, store="learn") as server:
        client = openai_client(server)
        first = client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=24, temperature=0)
        values = scrape(server)
        assert values["specheads_reply_store_learned_replies"] == 1
        assert values["specheads_reply_store_learned_tokens"] >= 24
        again = client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=24, temperature=0)
        assert again.choices[0].text == first.choices[0].text
        assert scrape(server)["specheads_spec_decode_num_store_accepted_tokens_total"] >= 12
