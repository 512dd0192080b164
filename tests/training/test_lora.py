"""Medusa-2 LoRA joint training (training/lora.py) on a tiny local Llama with a tokenizer:
the adapter and the heads both train (after the heads-only warmup), checkpoints carry the
adapter and resume bit-exactly, `specheads export RUN --format merged` writes a merged
target whose greedy decoding with the heads equals its own `generate`, the dry run counts
the adapter, and bad lora settings fail naming the key."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specheads.serving.decode.generate import generate
from specheads.train import main
from specheads.training.config import RecipeError, load_recipe

from test_training import make_tokenizer, markov_walks, write_jsonl, write_recipe

LORA = """lora:
  rank: 4
  alpha: 8
  dropout: 0.1
  target_modules: [q_proj, v_proj, down_proj]
  lm_loss_weight: 0.5
  heads_warmup_steps: 4
"""


@pytest.fixture(scope="module")
def target_with_tokenizer(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama plus a tokenizer (the merged export ships the base's tokenizer)."""
    directory = tmp_path_factory.mktemp("lora-target") / "model"
    shutil.copytree(tiny_llama_dir, directory)
    make_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def walks(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("lora-data") / "walks.jsonl", markov_walks(num_records=120))


def lora_recipe(tmp_path: Path, target: Path, walks: Path, name: str, extra: str = LORA) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    return write_recipe(directory, target, walks, tmp_path / name / "run", extra=extra)


RUN_ARGS = ["--set", "train.steps=6", "--set", "train.save_every=2", "--set", "train.micro_batch_size=4"]


@pytest.fixture(scope="module")
def lora_run(target_with_tokenizer, walks, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("lora-run")
    assert main([str(lora_recipe(tmp, target_with_tokenizer, walks, "a")), *RUN_ARGS]) == 0
    return tmp / "a" / "run"


def test_adapter_stays_frozen_in_warmup_then_adapter_and_heads_both_train(lora_run):
    checkpoints = lora_run / "checkpoints"
    warm = load_file(str(checkpoints / "step-00000004" / "adapter.safetensors"))
    done = load_file(str(checkpoints / "step-00000006" / "adapter.safetensors"))
    lora_b = [name for name in warm if "lora_B" in name]
    assert lora_b and len(warm) == 2 * len(lora_b) == 2 * 2 * 3  # A and B of 3 modules x 2 layers
    # PEFT starts B at zero; after 4 heads-only warmup steps it is still zero, then it trains.
    assert all(torch.count_nonzero(warm[name]) == 0 for name in lora_b)
    assert all(torch.count_nonzero(done[name]) > 0 for name in lora_b)
    assert any(not torch.equal(warm[name], done[name]) for name in warm if "lora_A" in name)
    heads_warm = load_file(str(checkpoints / "step-00000004" / "heads.safetensors"))
    heads_done = load_file(str(checkpoints / "step-00000006" / "heads.safetensors"))
    assert not any(name.startswith(("heads.", "target_model.")) for name in heads_done)
    assert all(not torch.equal(heads_warm[n], heads_done[n]) for n in heads_done if n.endswith("weight"))
    # The base target's weights are never checkpointed.
    assert not any("lora_" not in name for name in done)
    manifest = json.loads((checkpoints / "step-00000006" / "manifest.json").read_text())
    assert "adapter.safetensors" in manifest["files"]
    # The run's outputs: heads for the adapted target, and the PEFT adapter naming the base.
    config = json.loads((lora_run / "heads" / "config.json").read_text())
    assert "+lora:" in config["target"]["name_or_path"]
    meta = json.loads((lora_run / "adapter" / "specheads_lora.json").read_text())
    assert meta["lora"]["rank"] == 4
    assert (lora_run / "adapter" / "adapter_model.safetensors").is_file()


def test_lora_resume_is_bit_exact(target_with_tokenizer, walks, lora_run, tmp_path):
    """6 steps straight == 4 steps, a crash after step 2, and a resume to 6 (dropout on, the warmup's
    end crossed after the resume). The step-2 checkpoint is made one from before the manifest's
    adapter flag: the adapter's weights file alone says it holds one."""
    recipe = lora_recipe(tmp_path, target_with_tokenizer, walks, "b")
    assert main([str(recipe), *RUN_ARGS, "--set", "train.steps=4"]) == 0
    shutil.rmtree(tmp_path / "b" / "run" / "heads")
    (tmp_path / "b" / "run" / "checkpoints" / "latest").write_text("step-00000002\n")  # died after step 2
    shutil.rmtree(tmp_path / "b" / "run" / "checkpoints" / "step-00000004")
    manifest_path = tmp_path / "b" / "run" / "checkpoints" / "step-00000002" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest.pop("adapter") is True and "adapter.safetensors" in manifest["files"]
    manifest_path.write_text(json.dumps(manifest))
    assert main([str(recipe), *RUN_ARGS]) == 0
    for name in ("heads.safetensors", "adapter.safetensors"):
        a = load_file(str(lora_run / "checkpoints" / "step-00000006" / name))
        b = load_file(str(tmp_path / "b" / "run" / "checkpoints" / "step-00000006" / name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)


def test_resuming_a_lora_checkpoint_without_the_lora_section_fails_clearly(target_with_tokenizer, walks, lora_run,
                                                                           tmp_path, capsys):
    recipe = lora_recipe(tmp_path, target_with_tokenizer, walks, "c", extra="")
    shutil.copytree(lora_run / "checkpoints", tmp_path / "c" / "run" / "checkpoints")
    assert main([str(recipe), *RUN_ARGS]) == 2
    assert "differs in ['lora']" in capsys.readouterr().err


def test_merged_export_decodes_losslessly_against_the_merged_target(lora_run, target_with_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from specheads.heads.artefacts.export import export_merged
    from specheads.runner import load_decoder

    out = export_merged(lora_run, tmp_path / "merged")
    assert (out / "target" / "config.json").is_file() and (out / "target" / "tokenizer.json").is_file()
    config = json.loads((out / "heads" / "config.json").read_text())
    assert config["target"]["name_or_path"] == str((out / "target").resolve())
    card = (out / "heads" / "README.md").read_text()  # the model card names the merged target, not the base
    assert f"specheads serve --target {(out / 'target').resolve()} --heads {out / 'heads'}" in card
    assert "LoRA adapter" in card
    assert not list(tmp_path.glob(".merged.tmp-*"))
    merged = AutoModelForCausalLM.from_pretrained(out / "target")
    base = AutoModelForCausalLM.from_pretrained(target_with_tokenizer)
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    probe = torch.tensor([markov_walks(1, seed=5)[0]["input_ids"][:20]])
    with torch.no_grad():
        assert not torch.allclose(merged(probe).logits, base(probe).logits)  # the adapter changed the target
    decoder, _ = load_decoder(str(out / "target"), str(out / "heads"), dtype="float32", progress=False)
    for seed in range(3):
        prompt = markov_walks(1, seed=100 + seed)[0]["input_ids"][:12]
        ids = torch.tensor([prompt])
        reference = merged.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                                    min_new_tokens=20, pad_token_id=0)[0, len(prompt):].tolist()
        assert generate(decoder, prompt, max_new_tokens=20).tokens == reference

def test_merged_export_through_the_cli_and_of_a_non_lora_run(lora_run, tmp_path, capsys):
    from specheads.cli import main as cli_main

    assert cli_main(["export", str(lora_run), "--format", "merged", "--output", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "heads" / "model.safetensors").is_file()
    (tmp_path / "plain" / "heads").mkdir(parents=True)
    assert cli_main(["export", str(tmp_path / "plain"), "--format", "merged", "--output", str(tmp_path / "n")]) != 0
    assert "is not a LoRA training run" in capsys.readouterr().err


def test_dry_run_counts_the_adapter(target_with_tokenizer, walks, tmp_path):
    from specheads.training.dry_run import dry_run

    recipe_path = lora_recipe(tmp_path, target_with_tokenizer, walks, "d")
    out = io.StringIO()
    assert dry_run(load_recipe(recipe_path), recipe_path, out=out) == 0
    text = out.getvalue()
    # hidden 64, intermediate 128, 4 heads of 16 (2 kv heads): q 64->64, v 64->32, down 128->64; 2 layers.
    expected = 2 * 4 * ((64 + 64) + (64 + 32) + (128 + 64))
    assert re.search(rf"lora adapter \(trainable\)\s+{expected:,}", text), text
    heads = int(re.search(r"heads \(trainable\)\s+([\d,]+)", text).group(1).replace(",", ""))
    assert re.search(rf"trainable total\s+{heads + expected:,}", text)


@pytest.mark.parametrize("extra, message", [
    ("lora:\n  rnak: 4\n", "lora.rnak: unknown key; did you mean 'rank'?"),
    ("lora:\n  rank: 0\n", "lora.rank: expected a positive int"),
    ("lora:\n  dropout: 1.5\n", "lora.dropout: expected a number in [0, 1)"),
    ("lora:\n  target_modules: []\n", "lora.target_modules: expected a non-empty list"),
    ("lora:\n  lm_loss_weight: -1\n", "lora.lm_loss_weight: expected a number >= 0"),
    ("lora:\n  rank: 4\ntrain:\n  zero_stage: 3\n", "does not support train.zero_stage 3"),
    ("lora:\n  rank: 4\ndata:\n  feature_cache: /nowhere\n", "data.feature_cache: a feature cache holds"),
    ("lora:\n  rank: 4\ntrain:\n  precision: bf16\n", "target.dtype: with lora"),
])
def test_bad_lora_settings_fail_naming_the_key(tmp_path, extra, message):
    path = tmp_path / "r.yaml"
    path.write_text("target:\n  name_or_path: /x\n" + extra)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert message in str(err.value)


def test_unknown_target_modules_fail_listing_the_real_ones(target_with_tokenizer, walks, tmp_path, capsys):
    recipe = lora_recipe(tmp_path, target_with_tokenizer, walks, "e", extra="lora:\n  target_modules: [qkv]\n")
    assert main([str(recipe), *RUN_ARGS]) == 2
    err = capsys.readouterr().err
    assert "lora.target_modules" in err and "q_proj" in err
