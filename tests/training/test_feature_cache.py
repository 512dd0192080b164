"""Training from the offline feature cache (data.feature_cache, training/cached.py): the same
blocks, seed and recipe give the same per-step losses and (nearly) the same heads as training
online, for Medusa and EAGLE-3 heads; a cache that does not fit the run is refused."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specheads.data.feature_cache import FeatureCache, write_cache
from specheads.data.text import DataError
from specheads.heads.eagle3 import default_tap_layers
from specheads.heads.target.adapter import TargetAdapter
from specheads.train import main
from specheads.training.config import load_recipe
from specheads.training.data_split import load_training_data

from conftest import TINY_VOCAB
from test_training import markov_walks, write_jsonl, write_recipe

STEPS = 5
STEP_LINE = re.compile(r"^step (\d+)/\d+ loss ([\d.]+) \| head loss ([\d. ]+) \|", re.M)
EAGLE = "heads:\n  kind: eagle3\n  ttt_steps: 3\n  draft_vocab_size: 128\n"


@pytest.fixture(scope="module")
def walks(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("cache-data") / "walks.jsonl", markov_walks(num_records=80))


def recipe_for(tmp_path: Path, target: Path, walks: Path, name: str, extra: str) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    path = write_recipe(directory, target, walks, directory / "run", extra=extra)
    if "kind: eagle3" in extra:  # write_recipe's heads section is Medusa's; swap it for EAGLE-3's
        text = path.read_text().replace("heads:\n  num_heads: 3\n  num_layers: 1\n", "")
        path.write_text(text)
    return path


def build_cache(recipe_path: Path, out: Path, top_k: int | None = None) -> Path:
    """Cache the target over exactly the blocks the trainer would train on."""
    recipe = load_recipe(recipe_path)
    target = TargetAdapter.from_pretrained(recipe.target.name_or_path)
    train, _ = load_training_data(recipe.data, recipe.target.name_or_path, recipe.train.seed, 2, target.vocab_size)
    taps = [target.num_layers] if recipe.heads.kind == "medusa" else default_tap_layers(target.num_layers)
    write_cache(target, train, taps, out, top_k=0 if top_k is None else top_k, batch_size=3, blocks_per_shard=16,
                log=lambda line: None)
    return out


def run_and_read_losses(recipe: Path, capsys, *overrides: str) -> list[list[float]]:
    args = [str(recipe), "--set", f"train.steps={STEPS}", "--set", "train.log_every=1"]
    for override in overrides:
        args += ["--set", override]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert ("train data feature cache" in out) == any(o.startswith("data.feature_cache=") for o in overrides)
    lines = STEP_LINE.findall(out)
    assert [int(step) for step, _, _ in lines] == list(range(1, STEPS + 1))
    return [[float(loss)] + [float(x) for x in heads.split()] for _, loss, heads in lines]


@pytest.mark.parametrize("heads", ["medusa", "eagle3"])
def test_training_from_the_cache_matches_online_training(heads, tiny_llama_dir, walks, tmp_path, capsys):
    extra = EAGLE if heads == "eagle3" else ""
    online = recipe_for(tmp_path, tiny_llama_dir, walks, "online", extra)
    cached = recipe_for(tmp_path, tiny_llama_dir, walks, "cached", extra)
    cache = build_cache(cached, tmp_path / "cache")
    online_losses = run_and_read_losses(online, capsys)
    cached_losses = run_and_read_losses(cached, capsys, f"data.feature_cache={cache}")
    assert torch.allclose(torch.tensor(cached_losses), torch.tensor(online_losses), rtol=2e-3, atol=2e-3)
    assert len({tuple(row) for row in online_losses}) == STEPS  # the losses move: the steps really trained
    a = load_file(str(tmp_path / "online" / "run" / "checkpoints" / "step-00000005" / "heads.safetensors"))
    b = load_file(str(tmp_path / "cached" / "run" / "checkpoints" / "step-00000005" / "heads.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        if a[name].is_floating_point():
            assert torch.allclose(a[name], b[name], atol=1e-4), name
        else:
            assert torch.equal(a[name], b[name]), name  # EAGLE-3 draft-vocab maps: same counts, same maps


def test_a_top_k_cache_trains_with_losses_close_to_online(tiny_llama_dir, walks, tmp_path, capsys):
    online = recipe_for(tmp_path, tiny_llama_dir, walks, "online", "")
    cached = recipe_for(tmp_path, tiny_llama_dir, walks, "cached", "")
    cache = build_cache(cached, tmp_path / "cache", top_k=64)
    assert "topk_values" in FeatureCache(cache).batch([0])
    online_losses = torch.tensor(run_and_read_losses(online, capsys))
    cached_losses = torch.tensor(run_and_read_losses(cached, capsys, f"data.feature_cache={cache}"))
    # The tiny random target's distributions are peaked (init spread 0.3); top-64 of 256 holds
    # nearly all their mass, so the KL moves by little but not by nothing.
    assert torch.allclose(cached_losses, online_losses, rtol=0.05, atol=0.05)


def test_feature_cache_auto_is_built_once_from_the_training_blocks_then_reused(tiny_llama_dir, walks, tmp_path,
                                                                              capsys, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "specheads-cache"))
    extra = EAGLE
    online = recipe_for(tmp_path, tiny_llama_dir, walks, "online", extra)
    auto = recipe_for(tmp_path, tiny_llama_dir, walks, "auto", extra)
    online_losses = torch.tensor(run_and_read_losses(online, capsys))
    first = run_and_read_losses(auto, capsys, "data.feature_cache=auto")
    # The tiny target's vocab is small enough for full logits: the same losses as online.
    assert torch.allclose(torch.tensor(first), online_losses, rtol=2e-3, atol=2e-3)
    features = tmp_path / "specheads-cache" / "features"
    built = [p for p in features.iterdir() if p.is_dir()]
    assert len(built) == 1 and (built[0] / "manifest.json").exists()  # one whole cache, no temp dir left
    cache = FeatureCache(built[0])
    recipe = load_recipe(auto)
    train, _ = load_training_data(recipe.data, str(tiny_llama_dir), recipe.train.seed, 2, TINY_VOCAB)
    assert torch.equal(cache.blocks().input_ids, train.input_ids)  # the training split, not the eval blocks

    shutil.rmtree(tmp_path / "auto" / "run")
    second = run_and_read_losses(auto, capsys, "data.feature_cache=auto")
    assert second == first  # the same cache, read back
    assert [p for p in features.iterdir() if p.is_dir()] == built


def test_teacher_logits_from_top_k_put_zero_mass_outside_the_k():
    values = torch.tensor([[[3.0, 1.0]]])
    indices = torch.tensor([[[4, 0]]], dtype=torch.int32)
    dense = FeatureCache.teacher_logits({"topk_values": values, "topk_indices": indices}, vocab_size=6)
    probs = dense.softmax(-1)[0, 0]
    assert torch.allclose(probs[[4, 0]], torch.tensor([3.0, 1.0]).softmax(-1))
    assert probs[[1, 2, 3, 5]].sum() == 0
    assert torch.isfinite(torch.log_softmax(dense, -1)).all()


def test_teacher_draft_logits_equal_the_dense_teacher_restricted_to_the_draft_vocab():
    """The top-k path scatters straight into the draft vocab: the same bits as the dense [b, T, V]
    teacher index-selected, and the same full-vocab argmax (ties: the lowest id, as argmax)."""
    torch.manual_seed(0)
    vocab, k = 50, 8
    logits = torch.randn(2, 5, vocab).round(decimals=1)  # rounding makes ties in the top-k
    values, indices = logits.topk(k, dim=-1)
    batch = {"topk_values": values, "topk_indices": indices.to(torch.int32)}
    draft_ids = torch.randperm(vocab)[:20]
    dense = FeatureCache.teacher_logits(batch, vocab)
    draft, argmax = FeatureCache.teacher_draft_logits(batch, vocab, draft_ids)
    assert torch.equal(draft, dense.index_select(-1, draft_ids))
    assert torch.equal(argmax, dense.argmax(-1))
    full = {"logits": logits}
    draft, argmax = FeatureCache.teacher_draft_logits(full, vocab, draft_ids)
    assert torch.equal(draft, logits.index_select(-1, draft_ids)) and torch.equal(argmax, logits.argmax(-1))


def test_a_cache_that_does_not_fit_the_run_is_refused(tiny_llama_dir, walks, tmp_path, capsys):
    cached = recipe_for(tmp_path, tiny_llama_dir, walks, "cached", "")
    cache = build_cache(cached, tmp_path / "cache")
    assert main([str(cached), "--set", f"data.feature_cache={cache}", "--set", "data.seq_len=32"]) == 2
    assert "blocks of 64 tokens, but data.seq_len is 32" in capsys.readouterr().err
    eagle = recipe_for(tmp_path, tiny_llama_dir, walks, "eagle", EAGLE)
    assert main([str(eagle), "--set", f"data.feature_cache={cache}"]) == 2
    assert "are not cached (cached taps [2]" in capsys.readouterr().err
    assert main([str(cached), "--set", f"data.feature_cache={tmp_path / 'nowhere'}"]) == 2
    assert "has no manifest.json" in capsys.readouterr().err
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    with pytest.raises(DataError, match="hidden_size: cache 64, target 32"):
        FeatureCache(cache).check_fits(type(target.identity)(**{**target.identity.__dict__, "hidden_size": 32}),
                                       [2], 64)
