"""`specheads serve`: logprobs and echo, through the openai client and plain HTTP.

The server runs the tiny target in fp32 with heads and n-gram lookup drafting several tokens
per step, several requests at once; every reported logprob must be the log_softmax of HF's
own logits for that token (`generate(output_logits=True)`, or a forward over the prompt for
echo), in OpenAI's shapes, streamed or not. The shapes themselves and token bytes are
checked without a server too.
"""

from __future__ import annotations

import concurrent.futures
import json
import math

import httpx
import pytest
import torch

from specheads.serving.decode.logprobs import TokenLogprob
from specheads.serving.server.logprobs import (LOGPROB_FLOOR, ScoredToken, TokenPiece, TokenText, chat_logprobs,
                                               completion_logprobs)
from test_server_support import MODEL, make_tokenizer, openai_client, running_server, tiny_setup  # noqa: F401

PROMPTS = ["def f(x):", "the cat", "import os\n", "the cat sat on the mat\nthe cat"]
MAX_TOKENS = 20
ATOL = 1e-4  # fp32: batched tree verify against HF's one-sequence forward


@pytest.fixture(scope="module")
def server(tiny_setup):  # noqa: F811
    target_dir, heads_dir = tiny_setup
    with running_server(target_dir, heads_dir, lookup_num_tokens=4, max_concurrency=4) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def hf(tiny_setup):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_setup[0])
    model = AutoModelForCausalLM.from_pretrained(tiny_setup[0], dtype=torch.float32).eval()
    return model, tokenizer


def hf_greedy_logprobs(hf, ids: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens (to EOS or max_new) and the log_softmax of its raw logits for each [N, V]."""
    model, tokenizer = hf
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, len(ids):].tolist()
    return new, torch.log_softmax(torch.cat(out.logits).float(), dim=-1)[:len(new)]


def prompt_ids(hf, prompt: str) -> list[int]:
    return hf[1](prompt, add_special_tokens=False)["input_ids"]


def check_completion_logprobs(hf, logprobs: dict, tokens: list[int], rows: torch.Tensor, top: int,
                              first_offset: int = 0):
    tokenizer = hf[1]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in tokens]
    for token, logprob, top_dict, row in zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], rows):
        assert logprob == pytest.approx(float(row[token]), abs=ATOL)
        values, ids = row.topk(top)
        expected = {tokenizer.decode([i]): float(v) for i, v in zip(ids.tolist(), values)}
        expected.setdefault(tokenizer.decode([token]), float(row[token]))  # the chosen token, always
        assert top_dict == pytest.approx(expected, abs=ATOL)
    offsets = [first_offset]
    for text in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(text))
    assert logprobs["text_offset"] == offsets


def test_completion_logprobs_equal_hf_with_heads_at_batch_above_one(client, hf):
    def one(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         logprobs=3)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(one, PROMPTS))
    accepted = 0
    for prompt, response in zip(PROMPTS, responses):
        tokens, rows = hf_greedy_logprobs(hf, prompt_ids(hf, prompt), MAX_TOKENS)
        choice = response.choices[0]
        assert response.usage.completion_tokens == len(tokens)
        check_completion_logprobs(hf, choice.logprobs.model_dump(), tokens, rows, 3)
        accepted += response.model_extra["speculation"]["accepted_tokens"]
    assert accepted > 0  # steps that emitted several tokens were scored too


def test_chat_logprobs_streamed_and_not(client, hf):
    model, tokenizer = hf
    messages = [{"role": "user", "content": "the cat"}]
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tokens, rows = hf_greedy_logprobs(hf, prompt_ids(hf, templated), MAX_TOKENS)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = plain.choices[0].logprobs.content
    assert [entry.token for entry in content] == [tokenizer.decode([t]) for t in tokens]
    for entry, token, row in zip(content, tokens, rows):
        assert entry.logprob == pytest.approx(float(row[token]), abs=ATOL)
        if "\ufffd" not in entry.token:  # else the token's own bytes: part of a character
            assert bytes(entry.bytes) == entry.token.encode()
        values, ids = row.topk(2)
        assert [top.token for top in entry.top_logprobs] == [tokenizer.decode([i]) for i in ids.tolist()]
        assert [top.logprob for top in entry.top_logprobs] == pytest.approx(values.tolist(), abs=ATOL)
    text = plain.choices[0].message.content
    joined = b"".join(bytes(e.bytes) for e, t in zip(content, tokens) if t != tokenizer.eos_token_id)
    assert joined.decode("utf-8", errors="replace") == text
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [entry.model_dump() for chunk in stream for choice in chunk.choices
                if choice.logprobs is not None for entry in choice.logprobs.content]
    assert [entry["token"] for entry in streamed] == [entry.token for entry in content]
    assert [entry["logprob"] for entry in streamed] == pytest.approx([entry.logprob for entry in content], abs=ATOL)
    no_top = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            logprobs=True)
    assert all(entry.top_logprobs == [] for entry in no_top.choices[0].logprobs.content)
    without = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert without.choices[0].logprobs is None


def test_streamed_completion_logprobs_equal_non_streamed(client):
    for prompt in PROMPTS[:2]:
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=2, n=2)
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=2, n=2, stream=True)
        joined: dict[int, dict] = {}
        for chunk in stream:
            for choice in chunk.choices:
                into = joined.setdefault(choice.index, {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                        "text_offset": []})
                for key in into:
                    into[key] += getattr(choice.logprobs, key)
        for choice in plain.choices:  # the same tokens; their logprobs up to fp differences between batches
            expected, got = choice.logprobs.model_dump(), joined[choice.index]
            assert got["tokens"] == expected["tokens"] and got["text_offset"] == expected["text_offset"]
            assert got["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=ATOL)
            assert [pytest.approx(top, abs=ATOL) for top in expected["top_logprobs"]] == got["top_logprobs"]


def test_echo_scores_the_prompt_like_lm_eval(server, hf):
    """lm-eval's local-completions loglikelihood request: token-id prompts, echo, logprobs=1, max_tokens=1."""
    model, tokenizer = hf
    contexts = [prompt_ids(hf, "the cat sat on"), prompt_ids(hf, "import os\nprint(")]
    body = {"model": MODEL, "prompt": contexts, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
            "seed": 1234}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    for ids, choice in zip(contexts, sorted(response.json()["choices"], key=lambda c: c["index"])):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        with torch.no_grad():
            rows = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        generated, generated_rows = hf_greedy_logprobs(hf, ids, 1)
        scored = ids[1:] + generated
        check_completion_logprobs(hf, {key: value[1:] for key, value in logprobs.items()}, scored,
                                  torch.cat([rows[:-1], generated_rows]), 1, len(logprobs["tokens"][0]))
        assert logprobs["text_offset"][0] == 0
        assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True) + tokenizer.decode(generated)
        # lm-eval's own reading of the answer: the continuation's sum and whether it was greedy
        continuation = logprobs["token_logprobs"][2:-1]
        assert sum(continuation) == pytest.approx(float(sum(rows[i - 1, ids[i]] for i in range(2, len(ids)))),
                                                  abs=1e-3)
        is_greedy = all(lp == max(top.values()) for lp, top in zip(continuation, logprobs["top_logprobs"][2:-1]))
        assert is_greedy == all(int(rows[i - 1].argmax()) == ids[i] for i in range(2, len(ids)))


def test_echo_without_logprobs_and_streamed(client, hf):
    plain = client.completions.create(model=MODEL, prompt="the cat", max_tokens=6, temperature=0, echo=True)
    no_echo = client.completions.create(model=MODEL, prompt="the cat", max_tokens=6, temperature=0)
    assert plain.choices[0].text == "the cat" + no_echo.choices[0].text
    assert plain.choices[0].logprobs is None
    stream = client.completions.create(model=MODEL, prompt="the cat", max_tokens=6, temperature=0, echo=True,
                                       logprobs=0, stream=True)
    chunks = [choice for chunk in stream for choice in chunk.choices]
    assert chunks[0].text.startswith("the cat")
    assert "".join(c.text for c in chunks) == plain.choices[0].text
    tokens = [token for c in chunks for token in c.logprobs.tokens]
    assert len(tokens) == len(prompt_ids(hf, "the cat")) + plain.usage.completion_tokens
    assert chunks[0].logprobs.token_logprobs[0] is None


def test_token_bytes_rebuild_characters_split_over_tokens(tmp_path):
    tokenizer = make_tokenizer(tmp_path)
    text = TokenText(tokenizer)
    for word in ("日本", "café", "naïve ∑"):
        ids = tokenizer(word, add_special_tokens=False)["input_ids"]
        pieces = [text(i) for i in ids]
        assert any("\ufffd" in piece.text for piece in pieces)  # a character split over tokens
        assert b"".join(bytes(piece.bytes) for piece in pieces) == word.encode()
    assert text(ids[0]) is text(ids[0])  # cached


def test_shapes_floor_minus_infinity_and_name_the_chosen_token():
    a, b, c = TokenPiece("a", [97]), TokenPiece("b", [98]), TokenPiece("c", [99])
    scored = [ScoredToken(a, None, ()), ScoredToken(b, -math.inf, ((a, -0.1), (c, -2.0))),
              ScoredToken(c, -1.5, ())]
    shaped, end = completion_logprobs(scored, 10)
    assert shaped == {"tokens": ["a", "b", "c"], "token_logprobs": [None, LOGPROB_FLOOR, -1.5],
                      "top_logprobs": [None, {"a": -0.1, "c": -2.0, "b": LOGPROB_FLOOR}, {"c": -1.5}],
                      "text_offset": [10, 11, 12]}
    assert end == 13
    chat = chat_logprobs(scored[1:])
    assert chat["content"][0] == {"token": "b", "logprob": LOGPROB_FLOOR, "bytes": [98],
                                  "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]},
                                                   {"token": "c", "logprob": -2.0, "bytes": [99]}]}
    json.dumps(chat, allow_nan=False)
    piece_text = TokenText.__new__(TokenText)
    piece_text._pieces = {7: a}
    assert piece_text.score(TokenLogprob(7, -0.5, ((7, -0.5),)), 7) == ScoredToken(a, -0.5, ((a, -0.5),))
