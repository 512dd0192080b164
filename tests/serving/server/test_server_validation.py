"""`specheads serve`: bad input. Every malformed request gets a 4xx OpenAI-style JSON error
(never a 5xx), the server stays healthy, auth guards every route but the allow-list, and
property-based fuzzing of the request schema finds no 5xx."""

from __future__ import annotations

import collections
import json
import logging

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_server_support import MODEL, running_server, tiny_setup  # noqa: F401

API_KEY = "sk-test-key"
OK = {"model": MODEL, "prompt": "the cat", "max_tokens": 2, "temperature": 0}
CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_setup):  # noqa: F811
    target_dir, heads_dir = tiny_setup
    with running_server(target_dir, heads_dir, max_concurrency=4, max_queue=64, max_body_bytes=64 * 1024,
                        max_model_len=128) as thread:
        yield thread


def with_(base: dict, **changes) -> dict:
    out = dict(base)
    for key, value in changes.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


DROP = object()
# (name, path, raw body or JSON object, expected status)
MALFORMED = [
    ("not json", "/v1/completions", b"{not json", 400),
    ("empty body", "/v1/completions", b"", 400),
    ("json array", "/v1/completions", b"[1, 2]", 400),
    ("json string", "/v1/completions", b'"hello"', 400),
    ("NaN literal", "/v1/completions", b'{"model": "tiny-test", "prompt": "x", "temperature": NaN}', 400),
    ("Infinity literal", "/v1/completions", b'{"model": "tiny-test", "prompt": "x", "top_p": Infinity}', 400),
    ("not utf-8", "/v1/completions", b'{"model": "\xff\xfe"}', 400),
    ("missing model", "/v1/completions", with_(OK, model=DROP), 400),
    ("missing prompt", "/v1/completions", with_(OK, prompt=DROP), 400),
    ("model not a string", "/v1/completions", with_(OK, model=7), 400),
    ("prompt a number", "/v1/completions", with_(OK, prompt=12), 400),
    ("prompt empty", "/v1/completions", with_(OK, prompt=""), 400),
    ("prompt empty list", "/v1/completions", with_(OK, prompt=[]), 400),
    ("prompt mixed list", "/v1/completions", with_(OK, prompt=[1, "a"]), 400),
    ("token id out of vocab", "/v1/completions", with_(OK, prompt=[1, 99999]), 400),
    ("negative token id", "/v1/completions", with_(OK, prompt=[-1]), 400),
    ("max_tokens string", "/v1/completions", with_(OK, max_tokens="5"), 400),
    ("max_tokens float", "/v1/completions", with_(OK, max_tokens=2.5), 400),
    ("max_tokens zero", "/v1/completions", with_(OK, max_tokens=0), 400),
    ("max_tokens negative", "/v1/completions", with_(OK, max_tokens=-3), 400),
    ("max_tokens bool", "/v1/completions", with_(OK, max_tokens=True), 400),
    ("context overflow", "/v1/completions", with_(OK, max_tokens=1000), 400),
    ("prompt over context", "/v1/completions", with_(OK, prompt=[5] * 200, max_tokens=DROP), 400),
    ("temperature negative", "/v1/completions", with_(OK, temperature=-0.5), 400),
    ("temperature string", "/v1/completions", with_(OK, temperature="hot"), 400),
    ("temperature huge float", "/v1/completions", b'{"model": "tiny-test", "prompt": "x", "temperature": 1e999}', 400),
    ("top_p zero", "/v1/completions", with_(OK, top_p=0), 400),
    ("top_p above one", "/v1/completions", with_(OK, top_p=1.5), 400),
    ("top_p negative", "/v1/completions", with_(OK, top_p=-0.1), 400),
    ("top_k below -1", "/v1/completions", with_(OK, top_k=-5), 400),
    ("seed negative", "/v1/completions", with_(OK, seed=-1), 400),
    ("seed too big", "/v1/completions", with_(OK, seed=2 ** 64), 400),
    ("empty stop string", "/v1/completions", with_(OK, stop=""), 400),
    ("empty stop in list", "/v1/completions", with_(OK, stop=["a", ""]), 400),
    ("stop not strings", "/v1/completions", with_(OK, stop=[1, 2]), 400),
    ("n zero", "/v1/completions", with_(OK, n=0), 400),
    ("n huge", "/v1/completions", with_(OK, n=1000), 400),
    ("stream not bool", "/v1/completions", with_(OK, stream="yes"), 400),
    ("stream_options without stream", "/v1/completions", with_(OK, stream_options={"include_usage": True}), 400),
    ("echo not bool", "/v1/completions", with_(OK, echo="yes"), 400),
    ("logprobs string", "/v1/completions", with_(OK, logprobs="3"), 400),
    ("logprobs bool", "/v1/completions", with_(OK, logprobs=True), 400),
    ("logprobs negative", "/v1/completions", with_(OK, logprobs=-1), 400),
    ("logprobs too many", "/v1/completions", with_(OK, logprobs=21), 400),
    ("logit_bias set", "/v1/completions", with_(OK, logit_bias={"5": 10}), 400),
    ("repetition_penalty set", "/v1/completions", with_(OK, repetition_penalty=1.2), 400),
    ("suffix set", "/v1/completions", with_(OK, suffix="end"), 400),
    ("presence penalty", "/v1/completions", with_(OK, presence_penalty=0.5), 400),
    ("speculate not bool", "/v1/completions", with_(OK, speculate="no"), 400),
    ("unknown model", "/v1/completions", with_(OK, model="gpt-4"), 404),
    ("chat missing messages", "/v1/chat/completions", with_(CHAT_OK, messages=DROP), 400),
    ("chat empty messages", "/v1/chat/completions", with_(CHAT_OK, messages=[]), 400),
    ("chat bad role", "/v1/chat/completions", with_(CHAT_OK, messages=[{"role": "robot", "content": "x"}]), 400),
    ("chat content number", "/v1/chat/completions", with_(CHAT_OK, messages=[{"role": "user", "content": 5}]), 400),
    ("chat message not object", "/v1/chat/completions", with_(CHAT_OK, messages=["hi"]), 400),
    ("chat bad part type", "/v1/chat/completions",
     with_(CHAT_OK, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]), 400),
    ("chat logprobs int", "/v1/chat/completions", with_(CHAT_OK, logprobs=1), 400),
    ("chat top_logprobs without logprobs", "/v1/chat/completions", with_(CHAT_OK, top_logprobs=2), 400),
    ("chat top_logprobs too many", "/v1/chat/completions", with_(CHAT_OK, logprobs=True, top_logprobs=21), 400),
    ("chat response_format json", "/v1/chat/completions", with_(CHAT_OK, response_format={"type": "json_object"}),
     400),
    ("chat tools", "/v1/chat/completions",
     with_(CHAT_OK, tools=[{"type": "function", "function": {"name": "f"}}]), 400),
    ("chat context overflow", "/v1/chat/completions", with_(CHAT_OK, max_tokens=5000), 400),
    ("chat unknown model", "/v1/chat/completions", with_(CHAT_OK, model="nope"), 404),
    ("unknown route", "/v1/embeddings", OK, 404),
    ("wrong method", "/v1/models", OK, 405),
]


def post(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=30,
                      headers={"Content-Type": "application/json", **(headers or {})})


def assert_error_body(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_malformed_matrix_gets_4xx_json_and_server_stays_healthy(server):
    assert len(MALFORMED) >= 30
    statuses = {}
    for name, path, body, expected in MALFORMED:
        response = post(server, path, body)
        statuses[name] = response.status_code
        assert response.status_code == expected, (name, response.status_code, response.text)
        assert_error_body(response)
    assert all(400 <= s < 500 for s in statuses.values())
    assert httpx.get(server.url + "/health").status_code == 200
    assert post(server, "/v1/completions", OK).status_code == 200


def test_errors_name_the_field_and_the_numbers(server):
    error = assert_error_body(post(server, "/v1/completions", with_(OK, max_tokens=1000)))
    prompt_len = post(server, "/v1/completions", OK).json()["usage"]["prompt_tokens"]
    for number in (128, prompt_len + 1000, 1000):  # the context length and what was asked for
        assert str(number) in error["message"], error
    error = assert_error_body(post(server, "/v1/completions", with_(OK, top_p=2)))
    assert error["param"] == "top_p" and "(0, 1]" in error["message"]
    error = assert_error_body(post(server, "/v1/chat/completions",
                                   with_(CHAT_OK, messages=[{"role": "user", "content": 5}])))
    assert error["param"] == "messages[0].content"
    error = assert_error_body(post(server, "/v1/completions", with_(OK, model="gpt-4")))
    assert error["code"] == "model_not_found" and MODEL in error["message"]


def test_unknown_fields_are_ignored_with_one_warning_line(server, caplog):
    body = with_(CHAT_OK, frobnicate=1, store=False, messages=[{"role": "user", "content": "hi", "weight": 1}],
                 stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    with caplog.at_level(logging.WARNING, logger="specheads.serve"):
        response = post(server, "/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        assert response.text.rstrip().endswith("data: [DONE]")
        plain = post(server, "/v1/completions", with_(OK, metadata={"a": "b"}))
    assert plain.status_code == 200, plain.text
    warnings = [r.getMessage() for r in caplog.records if r.name == "specheads.serve" and "ignored" in r.getMessage()]
    assert len(warnings) == 2, warnings
    for name in ("'frobnicate'", "store", "messages[0].weight", "stream_options.continuous_usage_stats"):
        assert name.strip("'") in warnings[0], warnings
    assert "metadata" in warnings[1]


def test_null_is_unset_and_unimplemented_fields_pass_at_their_neutral_value(server):
    nulls = with_(OK, top_p=None, n=None, stream=None, seed=None, stop=None, logprobs=None, echo=None,
                  presence_penalty=None, frequency_penalty=None, user=None, logit_bias=None, max_tokens=None)
    reference = post(server, "/v1/completions", with_(OK, max_tokens=DROP)).json()["choices"][0]["text"]
    response = post(server, "/v1/completions", nulls)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference
    sampled = [post(server, "/v1/completions", with_(OK, temperature=t, seed=3)).json()["choices"][0]["text"]
               for t in (None, DROP)]  # null temperature: the default, 1
    assert sampled[0] == sampled[1]
    neutral = with_(CHAT_OK, logit_bias={}, response_format={"type": "text"}, tools=[], tool_choice="none",
                    repetition_penalty=1, min_p=0.0, skip_special_tokens=True, logprobs=False, top_logprobs=0)
    assert post(server, "/v1/chat/completions", neutral).status_code == 200
    error = assert_error_body(post(server, "/v1/completions", with_(OK, logit_bias={"5": 10})))
    assert error["param"] == "logit_bias" and "not supported" in error["message"]
    error = assert_error_body(post(server, "/v1/completions", with_(OK, model=None)))
    assert error["param"] == "model"


def test_wrong_types_name_the_field(server):
    for path, body, field in [("/v1/completions", with_(OK, logprobs="3"), "logprobs"),
                              ("/v1/completions", with_(OK, echo=1), "echo"),
                              ("/v1/chat/completions", with_(CHAT_OK, top_logprobs=3), "top_logprobs"),
                              ("/v1/chat/completions", with_(CHAT_OK, logprobs=True, top_logprobs=99), "top_logprobs"),
                              ("/v1/chat/completions", with_(CHAT_OK, messages=[{"role": "user", "content": "x",
                                                                                 "name": 5}]), "messages[0].name")]:
        response = post(server, path, body)
        assert response.status_code == 400, (body, response.text)
        error = assert_error_body(response)
        assert error["param"] == field and field in error["message"], error


def test_oversized_bodies_are_rejected(server):
    big = with_(OK, prompt="x" * (70 * 1024))
    response = post(server, "/v1/completions", big)
    assert response.status_code == 413
    assert assert_error_body(response)["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(80):
            yield b"x" * 1024

    response = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30)
    assert response.status_code == 413
    assert httpx.get(server.url + "/health").status_code == 200


DEEP_PROMPT = b'{"model": "tiny-test", "prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}"  # 60 KB, the limit here is 64
DEEP_UNKNOWN = b'{"model": "tiny-test", "prompt": "x", "extra": ' + b'{"a": ' * 2000 + b"1" + b"}" * 2001
HOSTILE = [  # (name, path, body, the field the 400 names)
    ("lone surrogate in the prompt", "/v1/completions", with_(OK, prompt="ab\ud800cd"), "prompt"),
    ("lone surrogate in a prompt list", "/v1/completions", with_(OK, prompt=["ok", "\udfff"]), "prompt[1]"),
    ("lone surrogate in chat content", "/v1/chat/completions",
     with_(CHAT_OK, messages=[{"role": "user", "content": "ab\ud800cd"}]), "messages[0].content"),
    ("lone surrogate in a content part", "/v1/chat/completions",
     with_(CHAT_OK, messages=[{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]),
     "messages[0].content[0].text"),
    ("lone surrogate in the model name", "/v1/completions", {"model": "\ud83d", "prompt": "a"}, "model"),
    ("lone surrogate in a stop string", "/v1/completions", with_(OK, stop=["\udc00"]), "stop[0]"),
    ("prompt nested 30,000 lists deep", "/v1/completions", DEEP_PROMPT, "prompt"),
    ("prompt nested 40 lists deep", "/v1/completions", with_(OK, prompt=json.loads("[" * 40 + "]" * 40)), "prompt"),
    ("nested object in an unknown field", "/v1/completions", DEEP_UNKNOWN, "extra"),
]


@pytest.mark.parametrize("name, path, body, field", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_text_that_is_not_unicode_and_deep_nesting_get_a_400_naming_the_field(server, name, path, body, field):
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert assert_error_body(response)["param"] == field
    assert httpx.get(server.url + "/health").status_code == 200


def test_every_error_body_is_json_whatever_the_client_sent(server):
    response = httpx.get(server.url + "/v1/models/%ED%A0%80", timeout=10)  # a lone surrogate's bytes
    assert response.status_code == 404 and assert_error_body(response)
    response = post(server, "/v1/completions", b'{"model": "\xed\xa0\x80", "prompt": "a"}')
    assert response.status_code == 400 and assert_error_body(response)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40])
def test_tiny_temperatures_decode_greedily_and_the_engine_survives(server, temperature):
    greedy = post(server, "/v1/completions", with_(OK, max_tokens=8)).json()["choices"][0]["text"]
    response = post(server, "/v1/completions", with_(OK, max_tokens=8, temperature=temperature))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == greedy
    chat = post(server, "/v1/chat/completions", with_(CHAT_OK, max_tokens=8, temperature=temperature, stream=True))
    assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]")
    assert '"error"' not in chat.text
    assert httpx.get(server.url + "/health").status_code == 200


TEXT = st.text(alphabet=st.characters(categories=["L", "N", "P", "Zs", "Cc", "Cs"]), max_size=8)  # Cs: surrogates
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                      st.floats(allow_nan=False, allow_infinity=False), TEXT)
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(TEXT, inner, max_size=3)),
                          max_leaves=6)
DEEP = st.integers(1, 400).map(lambda depth: json.loads("[" * depth + "1" + "]" * depth))
TINY = st.sampled_from([1e-300, 5e-324, 1e-40, 2.2250738585072014e-308, 1e-5, 1e-6])
FIELD_VALUES = {
    "model": st.one_of(st.just(MODEL), TEXT, JSON_VALUE),
    "prompt": st.one_of(TEXT, st.lists(st.integers(-3, 600), max_size=5), st.lists(TEXT, max_size=3), DEEP,
                        JSON_VALUE),
    "messages": st.one_of(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "bot"]),
         "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                                             max_size=2), DEEP, JSON_VALUE)}), max_size=3), JSON_VALUE),
    "max_tokens": st.one_of(st.integers(-2, 4), st.integers(100, 10 ** 6), JSON_VALUE),
    "temperature": st.one_of(st.floats(-1, 3), TINY, JSON_VALUE),
    "top_p": st.one_of(st.floats(-0.5, 1.5), st.sampled_from([5e-324, 1e-300, 1e-9]), JSON_VALUE),
    "top_k": st.one_of(st.integers(-3, 600), JSON_VALUE),
    "seed": st.one_of(st.integers(-5, 2 ** 65), JSON_VALUE),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), JSON_VALUE),
    "n": st.one_of(st.integers(-1, 3), JSON_VALUE),
    "stream": st.one_of(st.booleans(), JSON_VALUE),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON_VALUE),
    "speculate": st.one_of(st.booleans(), JSON_VALUE),
    "ignore_eos": st.one_of(st.booleans(), JSON_VALUE),
    "bogus": st.one_of(JSON_VALUE, DEEP),
}
FUZZ_CASES = 300


def valid_body(chat: bool, stream: bool) -> dict:
    return dict(CHAT_OK if chat else OK, max_tokens=3, stream=stream)


def test_fuzzed_requests_never_break_the_server(server):
    """A seeded mutator over valid bodies, both routes, streamed or not: no 5xx (a 503 under
    overload is the only documented one), every error an OpenAI error body, the server
    healthy afterwards and its greedy output unchanged."""
    before = post(server, "/v1/completions", with_(OK, max_tokens=12)).json()["choices"][0]["text"]
    outcomes: collections.Counter = collections.Counter()

    @settings(max_examples=FUZZ_CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(chat=st.booleans(), stream=st.booleans(), data=st.data(),
           mutations=st.dictionaries(st.sampled_from(sorted(FIELD_VALUES) + ["-drop"]), st.just(None), max_size=4))
    def one_case(chat, stream, data, mutations):
        body = valid_body(chat, stream)
        for key in mutations:
            if key == "-drop":
                body.pop(data.draw(st.sampled_from(sorted(body)), label="drop"), None)
            else:
                body[key] = data.draw(FIELD_VALUES[key], label=key)
        response = post(server, "/v1/chat/completions" if chat else "/v1/completions", body)
        outcomes[response.status_code] += 1
        if response.status_code >= 400:
            error = assert_error_body(response)
            assert response.status_code < 500 or (response.status_code == 503
                                                   and error["code"] == "server_overloaded"), (body, response.text)
        elif body.get("stream") is True:
            assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text, body
        else:
            assert response.json()["choices"], body

    one_case()
    print(f"\nfuzz: {sum(outcomes.values())} cases, by status: {dict(sorted(outcomes.items()))}")
    assert sum(outcomes.values()) >= FUZZ_CASES and outcomes[200] >= 20  # valid requests were served too
    assert httpx.get(server.url + "/health").status_code == 200
    assert post(server, "/v1/completions", with_(OK, max_tokens=12)).json()["choices"][0]["text"] == before


def test_auth_guards_every_route(tiny_setup):  # noqa: F811
    target_dir, heads_dir = tiny_setup
    with running_server(target_dir, heads_dir, api_key=API_KEY) as server:
        routes = [(method, route.path) for route in server.server.config.app.app.routes
                  for method in sorted(getattr(route, "methods", None) or [])]
        paths = {path for _, path in routes}
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= paths
        routes += [("GET", "/v1/nowhere"), ("POST", "/v1/embeddings")]
        for method, path in routes:
            url = server.url + path.replace("{model_id:path}", MODEL)
            body = CHAT_OK if "chat" in path else OK
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                            {"Authorization": f"Basic {API_KEY}"}):
                response = httpx.request(method, url, json=body if method == "POST" else None, headers=headers,
                                         timeout=30)
                if path == "/health":
                    assert response.status_code == 200
                else:
                    assert response.status_code == 401, (method, path, headers)
                    assert assert_error_body(response)["type"] == "authentication_error"
            authed = httpx.request(method, url, json=body if method == "POST" else None,
                                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
            assert authed.status_code != 401 and authed.status_code < 500, (method, path)
    with running_server(target_dir, heads_dir, api_key=API_KEY, public_metrics=True) as server:
        assert httpx.get(server.url + "/metrics").status_code == 200
        assert httpx.get(server.url + "/v1/models").status_code == 401
