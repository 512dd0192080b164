"""train.skip_repeated_ngram: a loss token that ends an n-gram seen earlier in its block carries
no loss (training/steps.py `repeated_ngram_mask`); 0 keeps every token (the pinned losses)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specheads.train import main
from specheads.training import steps, trainer
from specheads.training.config import RecipeError, load_recipe

from test_feature_cache import EAGLE, recipe_for
from test_pinned_losses import RUN_ARGS, walks  # noqa: F401 (fixture)


def test_mask_marks_the_ends_of_repeated_ngrams_only():
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 4], [5, 5, 5, 5, 6, 5, 5, 6, 7]])
    assert repeated_rows(ids, 2) == [[0, 0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0, 1, 1, 0]]
    assert repeated_rows(ids, 3) == [[0, 0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 0, 0, 0, 1, 0]]
    assert repeated_rows(ids[:, :2], 3) == [[0, 0], [0, 0]]  # shorter than n: nothing repeats


def repeated_rows(ids: torch.Tensor, n: int) -> list[list[int]]:
    return steps.repeated_ngram_mask(ids, n).int().tolist()


def test_one_is_refused_and_the_eagle3_recipe_sets_six(tmp_path, tiny_llama_dir, walks):  # noqa: F811
    path = recipe_for(tmp_path, tiny_llama_dir, walks, "a", EAGLE)
    with pytest.raises(RecipeError, match="train.skip_repeated_ngram: 1 would drop"):
        load_recipe(path, ["train.skip_repeated_ngram=1"])
    assert load_recipe(path).train.skip_repeated_ngram == 0
    recipes = Path(__file__).resolve().parents[2] / "recipes"
    assert load_recipe(recipes / "smollm2-135m-eagle3.yaml").train.skip_repeated_ngram == 6


def test_training_drops_those_tokens_from_the_loss(tmp_path, tiny_llama_dir, walks, monkeypatch):  # noqa: F811
    def run(name: str, *overrides: str) -> list[tuple[list[float], int]]:
        seen, real_step = [], steps.train_step
        monkeypatch.setattr(trainer, "train_step", lambda *a, **k: seen.append(real_step(*a, **k)) or seen[-1])
        args = [str(recipe_for(tmp_path, tiny_llama_dir, walks, name, EAGLE)), *RUN_ARGS]
        assert main(args + [x for override in overrides for x in ("--set", override)]) == 0
        return [(loss.tolist(), tokens) for loss, _, tokens in seen]

    kept, skipped = run("all"), run("skip", "train.skip_repeated_ngram=2")
    # The tiny Markov walks repeat many bigrams: fewer loss tokens every step, and other losses.
    assert all(0 < s_tokens < k_tokens for (_, k_tokens), (_, s_tokens) in zip(kept, skipped))
    assert [loss for loss, _ in kept] != [loss for loss, _ in skipped]
