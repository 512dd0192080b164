"""Self-instruct (data/self_instruct.py): every rejected candidate counted by reason, the
target's answers cleaned, mixed prompts distinct and exactly as many as asked; and the chat
data report (data/chat_prompts.report_chat_data) on a hand-made file."""

from __future__ import annotations

import json

import pytest

import specheads.data.self_instruct as self_instruct
from specheads.data.chat_prompts import format_report, normalize, report_chat_data
from specheads.data.self_instruct import REJECT_REASONS, clean, evaluation_turns, filter_candidates, mixed_prompts

MT_BENCH_FIRST = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural"


def test_every_reject_reason_is_counted():
    candidates = [
        ("qa", ""),                                                    # empty
        ("qa", "Why bees?"),                                           # too short
        ("qa", "Why " + "very " * 100 + "long?"),                      # too long
        ("qa", "Почему небо голубое и что такое рассеяние света?"),    # not English
        ("qa", "What is one thing a user might ask a chatbot about tea?"),  # echoes the instruction
        ("qa", "I'm here to help with any question you may have."),    # assistant voice
        ("qa", "Bees are insects that make honey in hives."),          # not a question or request
        ("writing", MT_BENCH_FIRST + " and more?"),                    # evaluation prompt (first 60 characters)
        ("qa", "How do bees make honey in a hive?"),                   # kept
        ("qa", "how do bees make honey, in a hive?"),                  # duplicate after normalize
        ("advice", "Give me three tips for learning the guitar."),     # kept: a request
        ("qa", "What is the history of tea in China?"),                # duplicate of an existing prompt
    ]
    existing = {normalize("What is the history of tea in China?")}
    kept, rejected = filter_candidates(candidates, evaluation_turns(), existing)
    assert [text for _, text in kept] == ["How do bees make honey in a hive?",
                                          "Give me three tips for learning the guitar."]
    assert rejected == {reason: (2 if reason == "duplicate" else 1) for reason in REJECT_REASONS[:-1]}
    assert len(kept) + sum(rejected.values()) == len(candidates)
    for text in ("I'm an AI designed to assist with math. Can you give me a problem?",  # seen in sampled answers
                 "I'm sorry, but as a chatbot I can't accept that. Could you rephrase it?"):
        assert self_instruct.reject_reason(text, set(), set(), set()) == "assistant voice"


def test_clean_takes_the_quoted_message_or_the_first_line():
    assert clean('A user might ask: "How do bees make honey?') == "How do bees make honey?"
    assert clean("\n1. Question: Why is the sky blue?\nBecause...") == "Why is the sky blue?"


def test_mixed_prompts_keep_the_share_count_every_candidate_and_fill_from_templates(monkeypatch):
    good = [("stem", f"How does a wind turbine number {i} turn wind into power?") for i in range(5)]
    bad = [("qa", "no"), ("qa", "I'm here to help you today.")]
    monkeypatch.setattr(self_instruct, "generate_candidates", lambda target, plan, **kw: good + bad)
    logs = []
    records, rejected = mixed_prompts(10, "unused", self_instruct_fraction=0.3, log=logs.append)
    assert len(records) == 10 == len({normalize(r["turns"][0]) for r in records})
    assert sum(r["category"] == "self-instruct/stem" for r in records) == 3
    assert rejected == {"too short": 1, "assistant voice": 1, "over the self-instruct share": 2}
    assert "3 of 7 generated prompts kept" in logs[0] and "assistant voice 1" in logs[0]
    assert records == mixed_prompts(10, "unused", self_instruct_fraction=0.3, log=logs.append)[0]


def test_self_instruct_generates_with_the_tiny_target(tmp_path):
    from test_server_support import build_tiny_setup

    target_dir, _ = build_tiny_setup(tmp_path)
    plan = self_instruct.plan(6, seed=0)
    candidates = self_instruct.generate_candidates(str(target_dir), plan, max_new_tokens=6, batch_size=6)
    assert [kind for kind, _ in candidates] == [kind for kind, _ in plan]
    logs = []
    records, rejected = mixed_prompts(6, str(target_dir), self_instruct_fraction=0.5, max_new_tokens=6,
                                      batch_size=12, log=logs.append)
    num_kept = sum(r["category"].startswith("self-instruct/") for r in records)
    assert len(records) == 6 and num_kept + sum(rejected.values()) == 12  # 4 x 3 asked, every one accounted for
    assert f"{num_kept} of 12 generated prompts kept" in logs[0]


def test_the_plan_repeats_instructions_only_for_sampled_answers():
    space = len(self_instruct.plan(10**6, seed=0))  # every kind x subject x instruction, once
    assert space == sum(len(subjects) for _, subjects in self_instruct.KIND_STYLES.values()) * 3
    assert self_instruct.plan(10, seed=0) == self_instruct.plan(10, seed=0, repeat=True)  # the same first draws
    repeated = self_instruct.plan(space + 50, seed=0, repeat=True)
    assert len(repeated) == space + 50 and len(set(repeated)) == space  # a second pass, in another order
    assert repeated[:space] == self_instruct.plan(space, seed=0)


def test_sampled_self_instruct_draws_anew_and_is_deterministic_for_a_seed(tmp_path):
    from test_server_support import build_tiny_setup

    target_dir, _ = build_tiny_setup(tmp_path)
    one = self_instruct.plan(1, seed=0) * 6  # the same instruction six times

    def candidates(**kw):
        return [text for _, text in self_instruct.generate_candidates(str(target_dir), one, max_new_tokens=8,
                                                                      batch_size=6, **kw)]

    assert len(set(candidates())) == 1  # greedy: one answer per instruction
    sampled = candidates(temperature=1.0, seed=0)
    assert len(set(sampled)) > 1 and sampled == candidates(temperature=1.0, seed=0)
    assert sampled != candidates(temperature=1.0, seed=1)
    with pytest.raises(ValueError, match=r"temperature must be a number in \[0, 2\] \(0 = greedy\), got -1"):
        candidates(temperature=-1)
    logs = []
    records, rejected = mixed_prompts(6, str(target_dir), self_instruct_fraction=0.5, temperature=1.0,
                                      max_new_tokens=8, batch_size=12, log=logs.append)
    assert len(records) == 6 == len({normalize(r["turns"][0]) for r in records})
    num_kept = sum(r["category"].startswith("self-instruct/") for r in records)
    assert num_kept + sum(rejected.values()) == 12 and f"{num_kept} of 12 generated prompts kept" in logs[0]


@pytest.fixture
def word_tokenizer(tmp_path):
    """A word-level tokenizer (one token per word) with a plain chat template: known token counts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1, "a": 2, "b": 3, "c": 4, "hi": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    tokenizer.save_pretrained(tmp_path / "tok")
    return str(tmp_path / "tok")


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat(*turns):
    return {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]}


def test_report_counts_a_hand_made_file(tmp_path, word_tokenizer):
    data = write_jsonl(tmp_path / "train.jsonl", [chat("hi there", "a b c"), chat("Hi,  there", "a a", "more", "b"),
                                                  chat("other?", "a"), {"foo": 1}])
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [chat("q", "a b zzz")])
    report = report_chat_data(data, word_tokenizer, draft_vocab_size=2, eval_paths=[evaluation])
    assert report == {"conversations": 3, "reply_tokens": 7, "replies": 4, "conversations_by_replies": {1: 2, 2: 1},
                      "distinct_first_prompts": 2, "skipped": {"missing field 'text'": 1}, "draft_vocab_size": 2,
                      "eval_reply_tokens": 3, "eval_coverage": 1 / 3}  # the vocab: EOS and "a" (4 of 7)
    assert "covers 33.3% of 3 evaluation reply tokens" in format_report(report)
