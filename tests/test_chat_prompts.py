"""The locally built chat prompts (data/chat_prompts.py): deterministic, distinct, partly
multi-turn, and disjoint from the evaluation sets (MT-bench ships in bench/prompts;
Spec-Bench is read from ../shared/data when it is there)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specheads.data.chat_prompts import build_prompts, write_prompts

ROOT = Path(__file__).resolve().parents[1]
EVAL_SETS = [ROOT / "bench" / "prompts" / "mt_bench_question.jsonl",
             ROOT.parent / "shared" / "data" / "spec_bench_question.jsonl"]
NUM = 3000


def normal(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()


def eval_turns() -> list[str]:
    turns = []
    for path in EVAL_SETS:
        if path.exists():
            turns += [t for line in path.read_text().splitlines() for t in json.loads(line)["turns"]]
    return turns


@pytest.fixture(scope="module")
def prompts():
    return build_prompts(NUM, seed=0)


def test_prompts_are_deterministic_distinct_and_partly_multi_turn(prompts, tmp_path):
    assert prompts == build_prompts(NUM, seed=0) != build_prompts(NUM, seed=1)
    firsts = [p["turns"][0] for p in prompts]
    assert len(set(firsts)) == NUM
    assert 0.4 < sum(len(p["turns"]) == 2 for p in prompts) / NUM < 0.6
    assert len({p["category"] for p in prompts}) >= 8
    path = write_prompts(tmp_path / "p.jsonl", 10)
    assert [json.loads(line) for line in path.read_text().splitlines()] == build_prompts(10)
    with pytest.raises(ValueError, match="num >= 1"):
        build_prompts(0)


def test_no_evaluation_prompt_is_among_the_training_prompts(prompts):
    if not EVAL_SETS[1].exists():
        pytest.skip(f"Spec-Bench questions not found at {EVAL_SETS[1]} (MT-bench is checked by the next test)")
    check_disjoint(prompts, eval_turns())


def test_no_mt_bench_prompt_is_among_the_training_prompts(prompts):
    turns = [t for line in EVAL_SETS[0].read_text().splitlines() for t in json.loads(line)["turns"]]
    assert len(turns) == 160
    check_disjoint(prompts, turns)


def check_disjoint(prompts: list[dict], turns: list[str]) -> None:
    train = {normal(t) for p in prompts for t in p["turns"]}
    train_heads = {t[:60] for t in train}
    for turn in map(normal, turns):
        assert turn not in train, turn
        assert turn[:60] not in train_heads, turn
