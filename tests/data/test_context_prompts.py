"""Context tasks (data/context_prompts.py): passages from given texts with an instruction about
them; deterministic for a seed, distinct, refusals counted by reason, no evaluation prompt,
and mixed into `specheads data prompts` by --context-from / --context-fraction."""

from __future__ import annotations

import json
import random

import pytest

from specheads.data.chat_prompts import normalize
from specheads.data.context_prompts import (CONTEXT, CONTEXT_TASKS, MAX_PASSAGE_CHARS, MAX_TEXT_CHARS, context_prompts,
                                            mixed_in, source_texts, usable_texts)
from specheads.data.self_instruct import evaluation_turns

WORDS = ("river", "budget", "engine", "garden", "ledger", "harbour", "violin", "orbit", "meadow", "copper",
         "lantern", "tunnel", "quarry", "pepper", "walnut", "falcon", "canyon", "marble", "cobalt", "saddle")


def prose(seed: int, sentences: int = 12) -> str:
    """A varied paragraph (it compresses like text, not like a loop)."""
    rng = random.Random(seed)
    return " ".join(f"The {rng.choice(WORDS)} near {rng.choice(WORDS)} {rng.randint(2, 990)} held "
                    f"{rng.randint(3, 400)} {rng.choice(WORDS)}s in {1900 + rng.randint(0, 120)}."
                    for _ in range(sentences))


def code_reply(seed: int) -> str:
    code = f"def f{seed}(xs):\n    return [x * {seed} for x in xs if x > {seed % 7}]"
    return f"Here is one way:\n\n```python\n{code}\n```\n" + prose(seed + 1000, 6)


@pytest.fixture(scope="module")
def texts():
    return [prose(i) for i in range(40)] + [code_reply(i) for i in range(10)]


def test_prompts_are_deterministic_distinct_and_built_from_whole_texts(texts):
    records = context_prompts(120, texts, seed=3)
    assert records == context_prompts(120, texts, seed=3) != context_prompts(120, texts, seed=4)
    assert len({normalize(r["turns"][0]) for r in records}) == 120
    kinds = [r["category"].removeprefix(CONTEXT) for r in records]
    assert set(kinds) == set(CONTEXT_TASKS) and min(kinds.count(k) for k in CONTEXT_TASKS) == 120 // len(CONTEXT_TASKS)
    for record, kind in zip(records, kinds):
        first = record["turns"][0]
        used = sorted((t for t in texts if t in first), key=first.index)
        assert 1 <= len(used) <= 3 and sum(map(len, used)) <= MAX_PASSAGE_CHARS
        assert any(template.format(passage="\n\n".join(used)) == first for template in CONTEXT_TASKS[kind])
        if kind == "code":
            assert all("```" in t for t in used)
        assert len(record["turns"]) <= 2  # one follow-up at most
    turns = [len(r["turns"]) for r in records]
    assert 0.3 < turns.count(2) / len(turns) < 0.7
    assert all(len(r["turns"]) == 1 for r in context_prompts(20, texts, follow_up_fraction=0))


def test_without_code_texts_there_are_no_code_tasks(texts):
    records = context_prompts(30, [t for t in texts if "```" not in t])
    assert CONTEXT + "code" not in {r["category"] for r in records} and len(records) == 30


def test_refused_texts_are_counted_by_reason(texts):
    mt_bench = evaluation_turns()[0]
    candidates = [texts[0], "  ", "too short to be a passage", "x" * (MAX_TEXT_CHARS + 1),
                  "All work and no play. " * 40, prose(1, 6) + " " + mt_bench[:80] + " " + prose(2, 6),
                  texts[0] + "\n", texts[1]]
    kept, refused = usable_texts(candidates, evaluation_turns())
    assert kept == [texts[0], texts[1]]
    assert refused == {"empty": 1, "too short": 1, "too long": 1, "repetitive": 1, "holds an evaluation prompt": 1,
                       "duplicate": 1}


def test_too_few_texts_for_distinct_prompts_is_an_error_not_a_short_list(texts):
    with pytest.raises(ValueError, match="no usable source text"):
        context_prompts(5, [])
    with pytest.raises(ValueError, match="only .* distinct prompts from 1 source texts"):
        context_prompts(500, texts[:1])


def test_source_texts_take_assistant_turns_and_text_records(tmp_path, texts):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "q"},
                                                     {"role": "assistant", "content": t}]}) + "\n"
                            for t in texts[:3]))
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": texts[3]}) + "\n")
    assert source_texts([str(chat), str(docs)]) == texts[:4]
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text(json.dumps({"text": texts[0]}) + "\n" + json.dumps({"input_ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match="tokens.jsonl: record 1 gives no text"):
        source_texts([str(tokens)])


def test_mixed_in_renumbers_and_keeps_every_record():
    a = [{"id": "p00000", "category": "qa", "turns": ["one"]}, {"id": "p00001", "category": "qa", "turns": ["two"]}]
    b = [{"category": CONTEXT + "qa", "turns": ["three"]}]
    mixed = mixed_in(a, b, seed=0)
    assert [r["id"] for r in mixed] == ["p00000", "p00001", "p00002"]
    assert sorted(r["turns"][0] for r in mixed) == ["one", "three", "two"] and mixed == mixed_in(a, b, seed=0)


def test_the_prompts_command_mixes_context_tasks_in(tmp_path, texts, capsys):
    from specheads.cli import main

    source = tmp_path / "replies.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts + ["short"]))
    out = tmp_path / "prompts.jsonl"
    assert main(["data", "prompts", "--output", str(out), "--num", "40", "--context-from", str(source),
                 "--context-fraction", "0.25"]) == 0
    printed = capsys.readouterr().out
    assert "context: 50 source texts usable; refused: too short 1" in printed and "(10 context tasks)" in printed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 40 and sum(r["category"].startswith(CONTEXT) for r in records) == 10
    assert len({normalize(r["turns"][0]) for r in records}) == 40
    assert main(["data", "prompts", "--output", str(out), "--num", "12", "--context-from", str(source),
                 "--context-fraction", "1"]) == 0
    assert all(json.loads(line)["category"].startswith(CONTEXT) for line in out.read_text().splitlines())
    assert main(["data", "prompts", "--output", str(out), "--context-from", str(source),
                 "--context-fraction", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--context-fraction must be in [0, 1], got 1.5" in err
