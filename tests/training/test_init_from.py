"""heads.init_from: a run that starts from trained heads (fine-tuning them on new data) takes
their weights and their draft vocab, and a recipe whose heads have another shape is refused
before any data is read, by the run and by its dry run, naming the key to set.

The target is conftest's tiny random Llama; the data are the Markov walks of test_training.py
(tokens 4-67), and, for the run that starts from them, the same walks moved to tokens 104-167,
so that counting that data would give a draft vocab with none of the first run's tokens.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from specheads.heads.artefacts.heads_dir import read_heads_config
from specheads.train import main

from test_training import markov_walks, write_jsonl, write_recipe

EAGLE3 = ["--set", "heads.kind=eagle3", "--set", "heads.ttt_steps=2", "--set", "heads.draft_vocab_size=48",
          "--set", "heads.intermediate_size=32"]


@pytest.fixture(scope="module")
def trained_eagle3(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("first")
    walks = write_jsonl(tmp / "walks.jsonl", markov_walks(num_records=120))
    recipe = write_recipe(tmp, tiny_llama_dir, walks, tmp / "run")
    assert main([str(recipe), *EAGLE3, "--set", "train.steps=6"]) == 0
    return tmp / "run" / "heads"


@pytest.fixture(scope="module")
def moved_walks(tmp_path_factory):
    records = [{"input_ids": [t + 100 for t in r["input_ids"]]} for r in markov_walks(num_records=120, seed=5)]
    return write_jsonl(tmp_path_factory.mktemp("moved") / "moved.jsonl", records)


def test_a_run_from_trained_heads_starts_at_their_weights_and_keeps_their_draft_vocab(
        trained_eagle3, moved_walks, tiny_llama_dir, tmp_path):
    recipe = write_recipe(tmp_path, tiny_llama_dir, moved_walks, tmp_path / "run")
    # One step at a learning rate too small to move a weight visibly, and more draft steps than
    # the first run unrolled (they unroll the same weights).
    assert main([str(recipe), *EAGLE3, "--set", "heads.ttt_steps=3", "--set", f"heads.init_from={trained_eagle3}",
                 "--set", "train.steps=1", "--set", "train.lr=1e-9", "--set", "train.warmup_steps=0"]) == 0
    first = load_file(str(trained_eagle3 / "model.safetensors"))
    then = load_file(str(tmp_path / "run" / "heads" / "model.safetensors"))
    assert first.keys() == then.keys()
    assert torch.equal(first["d2t"], then["d2t"]) and torch.equal(first["t2d"], then["t2d"])
    draft_tokens = (torch.arange(48) + first["d2t"]).tolist()
    assert max(draft_tokens) < 68  # the first data's tokens (and EOS), none of 104-167
    for name in first:
        torch.testing.assert_close(then[name], first[name], rtol=0, atol=1e-6, msg=name)
    assert read_heads_config(tmp_path / "run" / "heads").num_heads == 3

    # Without init_from, the same recipe counts its own data and starts from the target's lm_head.
    fresh = write_recipe(tmp_path, tiny_llama_dir, moved_walks, tmp_path / "fresh")
    assert main([str(fresh), *EAGLE3, "--set", "train.steps=1", "--set", "train.lr=1e-9",
                 "--set", "train.warmup_steps=0"]) == 0
    other = load_file(str(tmp_path / "fresh" / "heads" / "model.safetensors"))
    assert not torch.equal(other["d2t"], first["d2t"])
    assert (other["lm_head.weight"] - first["lm_head.weight"]).abs().max() > 1e-3


@pytest.mark.parametrize("dry_run", [False, True])
def test_heads_of_another_shape_are_refused_naming_the_key_to_set(trained_eagle3, moved_walks, tiny_llama_dir,
                                                                  tmp_path, capsys, dry_run):
    recipe = write_recipe(tmp_path, tiny_llama_dir, moved_walks, tmp_path / "run")
    extra = ["--dry-run"] if dry_run else []
    assert main([str(recipe), *EAGLE3, "--set", "heads.draft_vocab_size=40", "--set",
                 f"heads.init_from={trained_eagle3}", *extra]) == 2
    err = capsys.readouterr().err
    assert "heads.init_from=" in err and "draft_vocab_size is 48 there, 40 here (set heads.draft_vocab_size=48)" in err
    assert not (tmp_path / "run").exists()  # refused before training wrote anything

    assert main([str(recipe), "--set", f"heads.init_from={trained_eagle3}", *extra]) == 2  # Medusa from EAGLE-3
    assert "kind is 'eagle3' there, 'medusa' here (set heads.kind='eagle3')" in capsys.readouterr().err
    assert main([str(recipe), *EAGLE3, "--set", "heads.num_layers=2", "--set",
                 f"heads.init_from={trained_eagle3}", *extra]) == 2
    assert "num_layers is 1 there, 2 here (set heads.num_layers=1)" in capsys.readouterr().err
    assert main([str(recipe), *EAGLE3, "--set", "heads.num_layers=0", *extra]) == 2
    assert "heads.num_layers: an EAGLE head needs at least one decoder layer, got 0" in capsys.readouterr().err


def test_a_directory_without_heads_is_refused_naming_what_it_lacks(moved_walks, tiny_llama_dir, tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_llama_dir, moved_walks, tmp_path / "run")
    assert main([str(recipe), "--set", f"heads.init_from={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"heads.init_from={str(tmp_path)!r}" in err and "has no config.json" in err


def test_the_dry_run_names_the_heads_it_starts_from(trained_eagle3, moved_walks, tiny_llama_dir, tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_llama_dir, moved_walks, tmp_path / "run")
    assert main([str(recipe), *EAGLE3, "--set", f"heads.init_from={trained_eagle3}", "--dry-run"]) == 0
    assert f"starting from the trained heads at {trained_eagle3} (heads.init_from)" in capsys.readouterr().out


def test_medusa_heads_of_another_head_count_are_refused(moved_walks, tiny_llama_dir, tmp_path, capsys):
    first = write_recipe(tmp_path, tiny_llama_dir, moved_walks, tmp_path / "first")  # 3 Medusa heads
    assert main([str(first), "--set", "train.steps=2"]) == 0
    recipe = write_recipe(tmp_path, tiny_llama_dir, moved_walks, tmp_path / "run")
    assert main([str(recipe), "--set", "heads.num_heads=2", "--set",
                 f"heads.init_from={tmp_path / 'first' / 'heads'}"]) == 2
    assert "num_heads is 3 there, 2 here (set heads.num_heads=3)" in capsys.readouterr().err
    assert main([str(recipe), "--set", f"heads.init_from={tmp_path / 'first' / 'heads'}", "--set",
                 "train.steps=1"]) == 0  # the same count starts from them
