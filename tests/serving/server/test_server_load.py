"""`specheads serve` under load and failure: concurrent streams, the admission cap (503 +
Retry-After, not timeouts), client disconnects, request timeouts, graceful shutdown, and
/health while loading and after a fatal engine error."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import pytest

from specheads.runner import load_decoder
from specheads.serving.server.server import ServerThread
from specheads.serving.server.state import ServeConfig
from test_server_support import MODEL, openai_client, running_server, scrape, tiny_setup  # noqa: F401

LONG = {"model": MODEL, "prompt": "the cat", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
        "speculate": False}  # cancelled or timed out before it ends
MEDIUM = dict(LONG, max_tokens=60)  # runs to the end


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_sixteen_concurrent_streaming_clients(tiny_setup):  # noqa: F811
    target_dir, heads_dir = tiny_setup
    with running_server(target_dir, heads_dir, max_concurrency=8, max_queue=32) as server:
        client = openai_client(server)

        def one(i: int) -> tuple[str, list[str]]:
            stream = client.completions.create(model=MODEL, prompt=["the cat", "def f(x):"][i % 2], max_tokens=24,
                                               temperature=0, stream=True)
            text, reasons = "", []
            for chunk in stream:
                for choice in chunk.choices:
                    text += choice.text
                    if choice.finish_reason:
                        reasons.append(choice.finish_reason)
            return text, reasons

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(16)))  # any error raises here
        assert all(len(reasons) == 1 for _, reasons in results)
        assert len({text for i, (text, _) in enumerate(results) if i % 2 == 0}) == 1
        assert len({text for i, (text, _) in enumerate(results) if i % 2 == 1}) == 1
        values = scrape(server)
        assert sum(v for k, v in values.items() if k.startswith("specheads_request_success_total")) == 16


def test_over_the_admission_cap_gets_503_not_timeouts(tiny_setup):  # noqa: F811
    target_dir, heads_dir = tiny_setup
    cap = 3  # 1 running + 2 waiting
    with running_server(target_dir, heads_dir, max_concurrency=1, max_queue=2) as server:
        barrier = threading.Barrier(3 * cap)

        def one(_):
            barrier.wait()
            return httpx.post(server.url + "/v1/completions", json=MEDIUM, timeout=120)

        with concurrent.futures.ThreadPoolExecutor(3 * cap) as pool:
            responses = list(pool.map(one, range(3 * cap)))
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(503) >= cap, statuses
        assert statuses.count(200) >= 1
        for response in responses:
            if response.status_code == 503:
                assert int(response.headers["Retry-After"]) >= 1
                assert response.json()["error"]["code"] == "server_overloaded"
        assert scrape(server)['specheads_request_rejected_total{status="503"}'] == statuses.count(503)


def test_disconnected_clients_free_their_work(tiny_setup):  # noqa: F811
    target_dir, heads_dir = tiny_setup
    with running_server(target_dir, heads_dir, max_concurrency=4, max_queue=128) as server:
        def one(i: int) -> str:
            body = dict(LONG, stream=bool(i % 2))
            try:
                httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
            except httpx.TimeoutException:
                return "timeout"
            return "answered"

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            outcomes = list(pool.map(one, range(100)))
        # Most clients leave before their 480 tokens (how many finish first depends on the machine).
        assert outcomes.count("timeout") >= 50
        # every cancelled sequence leaves the batch; a fresh request is served at once
        # (a handler whose client already left may still submit its job: wait for both to drain)
        assert wait_for(lambda: scrape(server)["specheads_num_requests_running"] == 0
                        and scrape(server)["specheads_num_requests_waiting"] == 0, 30)
        response = httpx.post(server.url + "/v1/completions", json=dict(LONG, max_tokens=8), timeout=20)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
        # most were still queued or decoding when their client left (a few may finish first on a fast machine)
        values = scrape(server)
        assert values.get('specheads_request_aborted_total{reason="disconnect"}', 0) >= 40
        # each request is counted at most once (a client that left before its request reached the
        # app is not counted): never both aborted on disconnect and rejected as a 499
        assert values.get('specheads_request_rejected_total{status="499"}', 0) == 0
        counted = sum(v for k, v in values.items() if k.startswith(("specheads_request_success_total",
                                                                    "specheads_request_aborted_total",
                                                                    "specheads_request_rejected_total")))
        assert counted <= 101


def test_a_client_leaving_while_its_body_is_read_is_counted_once_without_a_traceback(tiny_setup):  # noqa: F811
    import logging
    import socket

    target_dir, heads_dir = tiny_setup
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        with running_server(target_dir, heads_dir) as server:
            host, port = server.url.removeprefix("http://").split(":")
            for _ in range(3):
                with socket.create_connection((host, int(port)), timeout=10) as sock:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 1000\r\n\r\n{\"model\": ")
                    time.sleep(0.2)  # the server is reading the body when the client leaves
            assert wait_for(lambda: scrape(server).get('specheads_request_rejected_total{status="499"}', 0) == 3, 10)
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]


def test_request_timeout_answers_504(tiny_setup):  # noqa: F811
    target_dir, heads_dir = tiny_setup
    with running_server(target_dir, heads_dir, request_timeout_s=0.3) as server:
        response = httpx.post(server.url + "/v1/completions", json=dict(LONG, n=4), timeout=30)
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "timeout"
        with httpx.stream("POST", server.url + "/v1/completions", json=dict(LONG, n=4, stream=True),
                          timeout=30) as streamed:
            if streamed.status_code == 200:  # output had started: the error arrives as the last event
                lines = [line for line in streamed.iter_lines() if line]
                assert lines[-1] == "data: [DONE]"
                assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "timeout"
            else:
                assert streamed.status_code == 504
        assert wait_for(lambda: scrape(server)["specheads_num_requests_running"] == 0, 30)
        assert httpx.get(server.url + "/health").status_code == 200


def test_graceful_shutdown_finishes_in_flight_and_refuses_new(tiny_setup):  # noqa: F811
    target_dir, heads_dir = tiny_setup
    config = ServeConfig(model_name=MODEL, max_concurrency=2)
    server = ServerThread(config, lambda: load_decoder(str(target_dir), str(heads_dir), progress=False),
                          graceful_timeout_s=60).start()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(httpx.post, server.url + "/v1/completions", json=dict(LONG, max_tokens=200),
                                timeout=120)
        registry = server.state.metrics.registry
        assert wait_for(lambda: registry.get_sample_value("specheads_num_requests_running") == 1, 30)
        stopper = threading.Thread(target=server.stop, kwargs={"timeout_s": 120})
        stopper.start()
        assert wait_for(lambda: server.state.draining, 10)
        try:
            refused = httpx.post(server.url + "/v1/completions", json=dict(LONG, max_tokens=4), timeout=10)
            assert refused.status_code == 503
        except httpx.TransportError:
            pass  # the listening socket is already closed: refused as well
        response = in_flight.result()
        stopper.join(120)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 200


def test_requests_still_running_when_the_grace_period_ends_get_503(tiny_setup):  # noqa: F811
    """Past --graceful-timeout, requests still running get a 503 with an OpenAI error body (a
    stream that has started: an error event, then [DONE]), not uvicorn's plain-text 500 or a cut stream."""
    target_dir, heads_dir = tiny_setup
    config = ServeConfig(model_name=MODEL, max_concurrency=4)
    server = ServerThread(config, lambda: load_decoder(str(target_dir), str(heads_dir), progress=False),
                          graceful_timeout_s=0.3).start()
    endless = dict(LONG, n=16)  # 16 x 480 tokens, four at a time: far longer than the grace period
    streaming = threading.Event()

    def streamed() -> tuple[int, list[str]]:
        with httpx.stream("POST", server.url + "/v1/completions", json=dict(endless, stream=True),
                          timeout=120) as response:
            lines = []
            for line in response.iter_lines():
                lines += [line] if line else []
                streaming.set()
            return response.status_code, lines

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stream = pool.submit(streamed)
        assert streaming.wait(30)
        plain = pool.submit(httpx.post, server.url + "/v1/completions", json=dict(LONG, n=2), timeout=120)
        registry = server.state.metrics.registry
        # both jobs queued or running: the stream's 12 choices not yet admitted, and the plain request
        assert wait_for(lambda: registry.get_sample_value("specheads_num_requests_waiting") == 2, 30)
        server.stop(timeout_s=60)
        response, (stream_status, lines) = plain.result(), stream.result()
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable" and "grace" in error["message"]
    assert stream_status == 200 and len(lines) > 2  # it had streamed text before the cut
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "shutting_down"
    assert registry.get_sample_value("specheads_request_aborted_total", {"reason": "shutting_down"}) >= 5


def test_health_is_503_while_loading(tiny_setup):  # noqa: F811
    target_dir, heads_dir = tiny_setup
    release = threading.Event()

    def slow_loader():
        release.wait(60)
        return load_decoder(str(target_dir), str(heads_dir), progress=False)

    server = ServerThread(ServeConfig(model_name=MODEL), slow_loader).start(wait_ready=False)
    try:
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "loading"
        early = httpx.post(server.url + "/v1/completions", json=dict(LONG, max_tokens=2), timeout=10)
        assert early.status_code == 503 and "Retry-After" in early.headers
        release.set()
        assert wait_for(lambda: httpx.get(server.url + "/health", timeout=10).status_code == 200, 60)
        assert httpx.post(server.url + "/v1/completions", json=dict(LONG, max_tokens=2), timeout=30).status_code == 200
    finally:
        release.set()
        server.stop()


def test_health_is_503_after_a_fatal_engine_error(tiny_setup):  # noqa: F811
    target_dir, heads_dir = tiny_setup
    with running_server(target_dir, heads_dir) as server:
        model = server.state.engine.decoder.target.model

        def lost_device(module, args, output):  # what a lost GPU raises inside the target's forward
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        handle = model.register_forward_hook(lost_device)
        try:
            response = httpx.post(server.url + "/v1/completions", json=dict(LONG, max_tokens=4), timeout=30)
            assert response.status_code == 500
            assert "illegal memory access" in response.json()["error"]["message"]
            health = httpx.get(server.url + "/health", timeout=10)
            assert health.status_code == 503 and health.json()["status"] == "failed"
            again = httpx.post(server.url + "/v1/completions", json=dict(LONG, max_tokens=4), timeout=30)
            assert again.status_code == 503
        finally:
            handle.remove()


def test_a_request_that_fails_alone_leaves_the_others_and_the_server_running(tiny_setup, monkeypatch):  # noqa: F811
    from specheads.serving.decode.engine import BatchEngine

    original = BatchEngine._advance

    def faulty(seq, *args):
        if seq.max_new_tokens == 7:  # the faulty request's rows only
            raise RuntimeError("injected fault in one row")
        return original(seq, *args)

    target_dir, heads_dir = tiny_setup
    with running_server(target_dir, heads_dir, max_concurrency=4) as server:
        url = server.url + "/v1/completions"
        good = dict(LONG, max_tokens=40)
        expected = httpx.post(url, json=good, timeout=60).json()["choices"][0]["text"]
        monkeypatch.setattr(BatchEngine, "_advance", staticmethod(faulty))
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            slow = [pool.submit(httpx.post, url, json=dict(good, stream=stream), timeout=60) for stream in (False, True)]
            time.sleep(0.1)  # the faulty request joins a running batch
            bad = httpx.post(url, json=dict(LONG, max_tokens=7, n=2), timeout=60)
            answers = [future.result() for future in slow]
        assert bad.status_code == 500
        error = bad.json()["error"]
        assert error["code"] == "sequence_failed" and "injected fault in one row" in error["message"]
        assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["text"] == expected
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in answers[1].text.splitlines()
                           if line.startswith("data: {"))
        assert streamed == expected
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        monkeypatch.setattr(BatchEngine, "_advance", staticmethod(original))
        assert httpx.post(url, json=good, timeout=60).json()["choices"][0]["text"] == expected
        values = scrape(server)
        assert values['specheads_request_aborted_total{reason="error"}'] == 2  # both choices failed
        assert values.get('specheads_request_rejected_total{status="500"}', 0) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_n_greater_than_batch_size_completes(tiny_setup, stream):  # noqa: F811
    target_dir, heads_dir = tiny_setup
    with running_server(target_dir, heads_dir, max_concurrency=2) as server:
        client = openai_client(server)
        response = client.completions.create(model=MODEL, prompt="the cat", n=5, max_tokens=6, temperature=0.8,
                                             seed=3, stream=stream)
        indices = [c.index for chunk in response for c in chunk.choices] if stream else \
            [c.index for c in response.choices]
        assert set(indices) == set(range(5))
