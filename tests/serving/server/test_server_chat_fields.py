"""Chat request fields that change the output are honoured or refused with a 400 naming them,
never dropped (serving/server/schema.py); a request without temperature, top_p or top_k takes
them from the target's generation_config.json, as vLLM does; `--reasoning-parser` splits a
reply's reasoning off as vLLM's and SGLang's parsers do (serving/server/reasoning.py).

One server of a tiny target whose generation_config.json sets temperature 0.6 and top_p 0.9
(Llama 3.1's). Each honoured field is checked the same way: the chat reply is the greedy
completion of the prompt the template renders with that field, and its prompt token count is
that prompt's."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from test_server_support import MODEL, build_tiny_setup, running_server

TOOL_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                 "{% for c in m.tool_calls or [] %}call {{ c.function.name }}({{ c.function.arguments.city }})"
                 "{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}"
                 "{% if m.reasoning_content %}(thought {{ m.reasoning_content }}){% endif %}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer, GenerationConfig

    target_dir, heads_dir = build_tiny_setup(tmp_path_factory.mktemp("chat-fields"))
    config = GenerationConfig.from_pretrained(target_dir)
    config.update(do_sample=True, temperature=0.6, top_p=0.9)
    config.save_pretrained(target_dir)
    with running_server(target_dir, heads_dir) as server:
        yield server, AutoTokenizer.from_pretrained(target_dir)


def chat(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def completion_of(server, tokenizer, messages: list[dict], **template) -> tuple[str, int]:
    """(the greedy completion of the prompt the template renders, that prompt's token count)."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, **template)
    response = httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"], len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def reply_of(response: httpx.Response) -> tuple[str, int]:
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]


def test_continue_final_message_and_add_generation_prompt_are_honoured(setup):
    server, tokenizer = setup
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "def f(x"}]
    continued = reply_of(chat(server, messages=messages, add_generation_prompt=False, continue_final_message=True))
    assert continued == completion_of(server, tokenizer, messages, add_generation_prompt=False,
                                      continue_final_message=True)
    plain = reply_of(chat(server, messages=messages[:1], add_generation_prompt=False))
    assert plain == completion_of(server, tokenizer, messages[:1], add_generation_prompt=False)
    assert plain[1] < reply_of(chat(server, messages=messages[:1]))[1]  # without the assistant's opening
    refused = chat(server, messages=messages, continue_final_message=True)  # add_generation_prompt defaults on
    assert refused.status_code == 400 and "continue_final_message" in refused.json()["error"]["message"]
    refused = chat(server, messages=messages[:1], continue_final_message=True, add_generation_prompt=False)
    assert refused.status_code == 400 and "the last message is the user's" in refused.json()["error"]["message"]


def test_a_requests_chat_template_and_tool_call_history_reach_the_template(setup):
    server, tokenizer = setup
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "reasoning_content": "ask the tool",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "weather", "arguments": json.dumps({"city": "Oslo"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    reply = reply_of(chat(server, messages=messages, chat_template=TOOL_TEMPLATE))
    rendered = [messages[0], {**messages[1], "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        messages[2]]
    assert "call weather(Oslo)" in tokenizer.apply_chat_template(rendered, chat_template=TOOL_TEMPLATE,
                                                                 tokenize=False, add_generation_prompt=True)
    assert reply == completion_of(server, tokenizer, rendered, chat_template=TOOL_TEMPLATE, add_generation_prompt=True)
    vllm_name = [messages[0], {**messages[1], "reasoning": "ask the tool"}, messages[2]]
    del vllm_name[1]["reasoning_content"]
    assert reply_of(chat(server, messages=vllm_name, chat_template=TOOL_TEMPLATE)) == reply
    bad = [messages[0], {**messages[1], "tool_calls": [{"id": "c", "type": "function",
                                                        "function": {"name": "weather", "arguments": "{city"}}]}]
    refused = chat(server, messages=bad, chat_template=TOOL_TEMPLATE)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


@pytest.mark.parametrize("field, value", [("truncate_prompt_tokens", 4), ("allowed_token_ids", [1, 2]),
                                          ("tools", [{"type": "function", "function": {"name": "f"}}])])
def test_fields_this_server_does_not_implement_are_refused_by_name(setup, field, value):
    server, _ = setup
    refused = chat(server, messages=[{"role": "user", "content": "hi"}], **{field: value})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field


def test_unset_sampling_fields_come_from_the_generation_config(setup):
    server, _ = setup
    assert server.state.default_sampling == {"temperature": 0.6, "top_p": 0.9}
    messages = [{"role": "user", "content": "the cat"}]

    def text(**fields) -> str:
        body = {"model": MODEL, "messages": messages, "max_tokens": 12, "seed": 7, **fields}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    assert text() == text(temperature=0.6, top_p=0.9) == text(temperature=None, top_p=None)
    assert text() != text(temperature=1.0, top_p=1.0)  # vLLM's and OpenAI's default without a generation_config


def test_a_reasoning_parser_splits_the_reply_streamed_or_not(setup):
    server, _ = setup
    messages = [{"role": "user", "content": "the cat"}]
    plain = chat(server, messages=messages).json()["choices"][0]["message"]
    assert "reasoning_content" not in plain
    try:
        server.state.config.reasoning_parser = "deepseek_r1"  # its template opens <think>: all of it is reasoning
        split = chat(server, messages=messages).json()["choices"][0]["message"]
        assert split == {"role": "assistant", "content": "", "reasoning_content": plain["content"]}
        stream = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True})
        deltas = [json.loads(line[len("data: "):])["choices"][0]["delta"] for line in stream.text.splitlines()
                  if line.startswith("data: {")]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == plain["content"]
        assert "".join(d.get("content") or "" for d in deltas) == ""
        server.state.config.reasoning_parser = "qwen3"  # a reply that does not open with <think> is content
        assert chat(server, messages=messages).json()["choices"][0]["message"] == {**plain, "reasoning_content": None}
    finally:
        server.state.config.reasoning_parser = None


@pytest.mark.parametrize("parser, text, expected", [
    ("qwen3", "<think>\nTwo and two.\n</think>\n\nFour.", ("\nTwo and two.\n", "\n\nFour.")),
    ("qwen3", "  <think>cut short", ("cut short", "")),
    ("qwen3", "Four.", ("", "Four.")),
    ("qwen3", "<thin", ("", "<thin")),
    ("deepseek_r1", "Two and two.</think>Four.", ("Two and two.", "Four.")),
    ("deepseek_r1", "<think>Two.</think>Four.", ("Two.", "Four.")),
    ("deepseek_r1", "still thinking </thi", ("still thinking </thi", "")),
])
def test_reasoning_splits_a_whole_reply_and_any_chunking_of_it_alike(parser, text, expected):
    from specheads.serving.server.reasoning import ReasoningStream, split_reasoning

    assert split_reasoning(text, parser) == expected
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        stream, pieces = ReasoningStream(parser), []
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            pieces.append(stream.feed(text[a:b]))
        pieces.append(stream.flush())
        assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == expected
