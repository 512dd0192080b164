"""`specheads serve`: correctness through the official openai client against a real uvicorn
server on 127.0.0.1 (tiny Llama, random Medusa heads; decoding is lossless, so the text must
equal the target's own greedy output whatever the heads propose)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import re

import httpx
import pytest
import torch

from specheads.cli import main as cli_main
from test_server_support import MODEL, openai_client, running_server, scrape, tiny_setup  # noqa: F401

PROMPTS = ["def f(x):", "the cat", "import os\n"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tiny_setup):  # noqa: F811 - the imported fixture
    target_dir, heads_dir = tiny_setup
    with running_server(target_dir, heads_dir, max_concurrency=4, max_queue=32) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def stream_text(stream, chat: bool = False) -> tuple[dict[int, str], dict[int, list[str]], object]:
    """-> (text per choice, finish_reasons seen per choice, the usage chunk's usage)."""
    texts: dict[int, str] = {}
    reasons: dict[int, list[str]] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                reasons.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, reasons, usage


def hf_greedy_text(target_dir, prompt: str, max_new_tokens: int) -> tuple[str, int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def cli_generate_text(target_dir, heads_dir, prompt: str, max_new_tokens: int) -> dict:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert cli_main(["generate", "--target", str(target_dir), "--heads", str(heads_dir), "--prompt", prompt,
                         "--max-new-tokens", str(max_new_tokens), "--output-json", "-", "--dtype", "float32"]) == 0
    return json.loads(buffer.getvalue().strip().splitlines()[-1])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_generate_and_hf_greedy(server, client, tiny_setup, prompt):  # noqa: F811
    target_dir, heads_dir = tiny_setup
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    choice = response.choices[0]
    hf_text, hf_tokens = hf_greedy_text(target_dir, prompt, MAX_TOKENS)
    assert choice.text == hf_text
    assert choice.text == cli_generate_text(target_dir, heads_dir, prompt, MAX_TOKENS)["text"]
    assert response.usage.completion_tokens == hf_tokens
    assert choice.finish_reason == ("length" if hf_tokens == MAX_TOKENS else "stop")
    spec = response.model_extra["speculation"]
    assert spec["enabled"] and spec["accepted_tokens"] <= spec["drafted_tokens"]


def test_streamed_greedy_equals_non_streamed_with_usage(client):
    for prompt in PROMPTS:
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        texts, reasons, usage = stream_text(stream)
        assert texts == {0: plain.choices[0].text}
        assert reasons == {0: [plain.choices[0].finish_reason]}  # exactly one finish_reason
        assert usage.model_dump() == plain.usage.model_dump()
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_streamed_and_not(client, tiny_setup):  # noqa: F811
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    message = plain.choices[0].message
    assert message.role == "assistant"
    tokenizer = AutoTokenizer.from_pretrained(tiny_setup[0])
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert plain.usage.prompt_tokens == len(tokenizer(templated, add_special_tokens=False)["input_ids"])
    completion = client.completions.create(model=MODEL, prompt=templated, max_tokens=MAX_TOKENS, temperature=0)
    assert message.content == completion.choices[0].text  # the chat template is the only difference
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, reasons, usage = stream_text(chunks, chat=True)
    assert texts == {0: message.content}
    assert reasons == {0: [plain.choices[0].finish_reason]}
    assert usage.completion_tokens == plain.usage.completion_tokens


def test_chat_template_kwargs_reach_the_template(client, server, tiny_setup):  # noqa: F811
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "the cat"}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_setup[0])
    for kwargs in ({}, {"enable_thinking": False}):
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                               extra_body={"chat_template_kwargs": kwargs})
        templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        assert templated.endswith("<think></think>") == bool(kwargs)
        assert reply.usage.prompt_tokens == len(tokenizer(templated, add_special_tokens=False)["input_ids"])
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "chat_template_kwargs": {"tokenize": True}})
    assert response.status_code == 400 and "tokenize cannot be set here" in response.json()["error"]["message"]


def test_sse_wire_format_ends_with_done(server):
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert sum(1 for c in chunks for ch in c["choices"] if ch["finish_reason"] is not None) == 1


def test_four_identical_concurrent_greedy_requests(client):
    def one(_):
        return client.completions.create(model=MODEL, prompt="import os\n", max_tokens=MAX_TOKENS,
                                         temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, range(4)))
    assert len(set(texts)) == 1
    assert texts[0] == one(0)


def test_speculation_off_gives_the_same_text_and_no_drafts(client):
    on = client.completions.create(model=MODEL, prompt="the cat", max_tokens=MAX_TOKENS, temperature=0)
    off = client.completions.create(model=MODEL, prompt="the cat", max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"speculate": False})
    assert off.choices[0].text == on.choices[0].text
    spec = off.model_extra["speculation"]
    assert spec["enabled"] is False and spec["drafted_tokens"] == 0 and spec["accepted_tokens"] == 0


def test_n_choices_and_prompt_batches(client):
    response = client.completions.create(model=MODEL, prompt=["the cat", "def f(x):"], n=2, max_tokens=8,
                                         temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    texts = [c.text for c in response.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: n copies agree
    single = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=8, temperature=0)
    assert texts[2] == single.choices[0].text
    assert response.usage.completion_tokens == sum(
        client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).usage.completion_tokens * 2
        for p in ["the cat", "def f(x):"])


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL, prompt="the cat", max_tokens=16, temperature=0.9, top_p=0.9, seed=1234,
                  extra_body={"top_k": 50})
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_stop_string_cuts_the_text(client):
    prompt = "the mat"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    text = full.choices[0].text
    # the random target's text is mostly bytes; stop at its first pair of ASCII letters after the start
    match = re.search(r"[a-z]{2}", text[1:])
    assert match is not None, text
    stop = match.group(0)
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.usage.completion_tokens <= full.usage.completion_tokens
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stop=[stop], stream=True)
    texts, reasons, _ = stream_text(stream)
    assert texts == {0: cut.choices[0].text} and reasons == {0: ["stop"]}


def test_models_route_and_unknown_model(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    from openai import NotFoundError

    with pytest.raises(NotFoundError) as info:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert "nope" in str(info.value)
    assert httpx.get(server.url + "/v1/models/nope").status_code == 404


def test_metrics_agree_with_finished_requests(server, client):
    before = scrape(server)
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="the cat", max_tokens=8, temperature=0)
    values = scrape(server)
    finished = sum(v for k, v in values.items() if k.startswith("specheads_request_success_total"))
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert values[f"specheads_{histogram}_count"] == finished
        assert values[f'specheads_{histogram}_bucket{{le="+Inf"}}'] == finished
    assert finished - sum(v for k, v in before.items() if k.startswith("specheads_request_success_total")) == 3
    drafted = values["specheads_spec_decode_num_draft_tokens_total"]
    accepted = values["specheads_spec_decode_num_accepted_tokens_total"]
    assert drafted > 0 and 0 <= accepted <= drafted
    per_pos = sum(v for k, v in values.items() if k.startswith("specheads_spec_decode_num_accepted_tokens_per_pos"))
    assert per_pos == accepted
    assert values["specheads_num_requests_running"] == 0
    assert 0 <= values["specheads_spec_decode_acceptance_rate"] <= 1


def test_metrics_route_speaks_prometheus(server, client):
    from prometheus_client import CONTENT_TYPE_LATEST
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(2):
        client.completions.create(model=MODEL, prompt="the cat", max_tokens=4, temperature=0)
    response = httpx.get(server.url + "/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    families = {family.name: family for family in text_string_to_metric_families(response.text)}
    assert families["specheads_request_success"].type == "counter"
    assert families["specheads_spec_decode_acceptance_rate"].type == "gauge"
    assert families["specheads_e2e_request_latency_seconds"].type == "histogram"
    success = sum(s.value for s in families["specheads_request_success"].samples
                  if s.name == "specheads_request_success_total")
    finished = [s.value for s in families["specheads_e2e_request_latency_seconds"].samples
                if s.name == "specheads_e2e_request_latency_seconds_count"]
    assert finished == [success] and success >= 2


def test_lookup_only_server_is_lossless_and_counts_lookup_tokens(tiny_setup):  # noqa: F811
    """`specheads serve --lookup-num-tokens N` without heads: prompt-lookup decoding on the engine."""
    target_dir, _ = tiny_setup
    prompt = "def f(x):\n" * 4  # this seeded target repeats part of it: a lookup chain gets accepted
    with running_server(target_dir, None, lookup_num_tokens=8) as server:
        response = openai_client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                            temperature=0)
        metrics = scrape(server)
    assert response.choices[0].text == hf_greedy_text(target_dir, prompt, MAX_TOKENS)[0]
    spec = response.model_extra["speculation"]
    assert spec["enabled"] and spec["lookup_accepted_tokens"] >= 1
    assert spec["lookup_accepted_tokens"] <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    assert metrics["specheads_spec_decode_num_lookup_accepted_tokens_total"] == spec["lookup_accepted_tokens"]
