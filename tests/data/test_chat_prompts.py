"""The locally built chat prompts (data/chat_prompts.py): deterministic, distinct, partly
multi-turn, and disjoint from the evaluation sets (MT-bench ships in prompts/;
Spec-Bench is read from ../shared/data when it is there)."""

from __future__ import annotations

import json
import re

import pytest

from specheads.data.chat_prompts import SLOTS, build_prompts, max_prompts, normalize, write_prompts

from conftest import REPO

ROOT = REPO  # the repository
EVAL_SETS = [ROOT / "prompts" / "mt_bench_question.jsonl",
             ROOT.parent / "shared" / "data" / "spec_bench_question.jsonl"]
NUM = 6000  # the issue asks for >= 5,000 distinct first turns


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


def test_prompts_are_deterministic_distinct_and_multi_turn(prompts, tmp_path):
    assert prompts == build_prompts(NUM, seed=0) != build_prompts(NUM, seed=1)
    assert len({normalize(p["turns"][0]) for p in prompts}) == NUM
    num_turns = [len(p["turns"]) for p in prompts]
    assert 0.2 < num_turns.count(2) / NUM < 0.3 and 0.2 < num_turns.count(3) / NUM < 0.3  # 0.5 x (1 - 0.5), 0.5 x 0.5
    assert all(p["turns"][1] != p["turns"][2] for p in prompts if len(p["turns"]) == 3)
    categories = {p["category"] for p in prompts}
    assert {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities", "translation",
            "summarization", "qa", "math_reasoning", "rag"} <= categories
    assert min(sum(p["category"] == c for p in prompts) for c in categories) >= NUM // (2 * len(categories))
    assert all(len(p["turns"]) == 1 for p in build_prompts(50, follow_up_fraction=0))
    path = write_prompts(tmp_path / "p.jsonl", 10)
    assert [json.loads(line) for line in path.read_text().splitlines()] == build_prompts(10)


def test_asking_for_too_many_prompts_names_the_maximum():
    with pytest.raises(ValueError, match=f"num <= {max_prompts()}"):
        build_prompts(max_prompts() + 1)
    with pytest.raises(ValueError, match="1 <= num"):
        build_prompts(0)


def test_slot_values_stay_distinct_after_normalization():
    for slot, values in SLOTS.items():
        assert len({normalize(v) for v in values}) == len(values), slot


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


def test_embedded_chat_is_generated_once_per_target_and_settings(tmp_path, monkeypatch):
    import specheads.data.regenerate as regenerate_module
    from specheads.data.chat_data import self_distilled_chat
    from specheads.training.config import load_recipe
    from specheads.training.trainer import _materialize_chat_source
    from test_server_support import build_tiny_setup

    target_dir, _ = build_tiny_setup(tmp_path)
    cache = tmp_path / "cache"
    replies = self_distilled_chat(str(target_dir), 4, 4, cache_dir=cache, log=lambda _: None)
    lines = [json.loads(line) for line in replies.read_text().splitlines()]
    assert len(lines) == 4 and all(m["messages"][0]["role"] == "user" for m in lines)
    assert [m["messages"][0]["content"] for m in lines] == [p["turns"][0] for p in build_prompts(4)]
    mixed = self_distilled_chat(str(target_dir), 4, 4, self_instruct_fraction=0.5, cache_dir=cache, log=lambda _: None)
    assert mixed != replies and len(mixed.read_text().splitlines()) == 4  # the tiny target's own prompts are filtered
    sampled = self_distilled_chat(str(target_dir), 4, 4, self_instruct_fraction=0.5, self_instruct_temperature=1.0,
                                  cache_dir=cache, log=lambda _: None)
    assert sampled not in (replies, mixed) and len(sampled.read_text().splitlines()) == 4

    def no_second_generation(*args, **kwargs):
        raise AssertionError("the cached replies were generated again")

    monkeypatch.setattr(regenerate_module, "regenerate", no_second_generation)
    assert self_distilled_chat(str(target_dir), 4, 4, cache_dir=cache, log=lambda _: None) == replies
    with pytest.raises(AssertionError, match="generated again"):  # other settings: another cache entry
        self_distilled_chat(str(target_dir), 5, 4, cache_dir=cache, log=lambda _: None)
    # On a GPU (as a GPU rank's trainer asks): replies from CUDA graphs, 512 sequences a forward.
    asked = {}

    def record(*args, **kwargs):
        asked.update(kwargs)
        raise RuntimeError("recorded")

    monkeypatch.setattr(regenerate_module, "regenerate", record)
    with pytest.raises(RuntimeError, match="recorded"):
        self_distilled_chat(str(target_dir), 6, 4, cache_dir=cache, device="cuda", log=lambda _: None)
    assert (asked["device"], asked["cuda_graphs"], asked["batch_size"], asked["dtype"]) == \
        ("cuda", "capture", 512, "bfloat16")

    monkeypatch.setenv("SPECHEADS_CACHE", str(cache))
    recipe = load_recipe(ROOT / "recipes" / "smollm2-135m-eagle3.yaml", profile="cpu")
    for fraction, temperature, cached in ((0.0, 0.0, replies), (0.5, 0.0, mixed), (0.5, 1.0, sampled)):
        # the recipe's self-instruct share and temperature pick the entry
        data = recipe.data.replace(chat_prompts=4, chat_max_new_tokens=4, chat_self_instruct_fraction=fraction,
                                   chat_self_instruct_temperature=temperature)
        assert _materialize_chat_source(recipe.replace(data=data), str(target_dir)).data.source \
            == str(cached)
