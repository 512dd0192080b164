"""Medusa distillation in one process (no launcher): data pipeline, loss, sampler, a real
training run through specheads.train.main, exact resume, and the user-error exits.

The target is conftest's tiny random Llama (vocab 256, no tokenizer), so the training data
is pre-tokenized: walks of a fixed random successor map over 64 tokens. The future of a
walk is a function of its current token, so what the target predicts k+1 tokens ahead is
learnable from one hidden state, and trained heads must beat untrained ones clearly.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specheads.data.text import DataError, build_blocks
from specheads.heads.artefacts.heads_dir import load_heads
from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter
from specheads.train import main
from specheads.training.calibrate import measure_accuracy
from specheads.training.config import HeadsSpec
from specheads.training.head_kinds import head_kind
from specheads.training.losses import medusa_distill_loss

NUM_HEADS = 3


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def markov_walks(num_records: int = 300, seed: int = 0) -> list[dict]:
    tokens = list(range(4, 68))
    successors = tokens[:]
    random.Random(0).shuffle(successors)  # one successor map for every seed
    step = dict(zip(tokens, successors))
    rng = random.Random(seed)
    records = []
    for _ in range(num_records):
        token, ids = rng.choice(tokens), []
        for _ in range(rng.randrange(30, 90)):
            ids.append(token)
            token = step[token]
        records.append({"input_ids": ids})
    return records


def make_tokenizer(directory: Path) -> Path:
    """A tiny byte-level BPE (vocab < 256, so ids fit the tiny target) saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:150], show_progress=False)
    backend.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20 + ["import os\nprint('hi')\n"] * 20,
                                trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    tokenizer.save_pretrained(directory)
    return directory


def write_recipe(tmp_path: Path, target: Path, source: Path, output_dir: Path, extra: str = "") -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"""\
target:
  name_or_path: {target}
heads:
  num_heads: {NUM_HEADS}
  num_layers: 1
data:
  source: {source}
  seq_len: 64
train:
  steps: 20
  micro_batch_size: 8
  lr: 0.01
  warmup_steps: 5
  save_every: 10
  log_every: 10
  output_dir: {output_dir}
calibrate:
  num_nodes: 8
  max_rank: 3
  eval_batches: 4
{extra}""")
    return path


@pytest.fixture(scope="module")
def walks_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "walks.jsonl", markov_walks())


# ---------------------------------------------------------------------------- loss

def test_loss_is_zero_and_agreement_one_when_heads_copy_the_target():
    torch.manual_seed(0)
    target_logits_BTV = torch.randn(2, 10, 16)
    # Head k at position t must reproduce the target's logits at t+k+1.
    head_logits_KBTV = torch.stack([torch.roll(target_logits_BTV, -(k + 1), dims=1) for k in range(3)])
    mask_BT = torch.ones(2, 10, dtype=torch.bool)
    out = medusa_distill_loss(head_logits_KBTV, target_logits_BTV, mask_BT)
    assert out.head_loss.shape == (3,) and out.head_top1.shape == (3,)
    assert torch.allclose(out.head_loss, torch.zeros(3), atol=1e-6)
    assert torch.equal(out.head_top1, torch.ones(3))
    assert out.head_count.tolist() == [2 * 9, 2 * 8, 2 * 7]  # positions t in [0, T-k-2]

    shifted = medusa_distill_loss(head_logits_KBTV.roll(1, dims=2), target_logits_BTV, mask_BT)
    assert (shifted.head_loss > 0.1).all()


def test_loss_over_a_draft_vocab_scores_the_renormalised_teacher():
    torch.manual_seed(0)
    target_logits_BTV = torch.randn(2, 10, 16)
    draft_ids = torch.tensor([1, 4, 5, 9, 12, 15])  # [Vd]
    # Heads that copy the target's logits on the draft vocab: zero KL to the teacher restricted
    # to it and renormalised, though far from the full-vocab teacher.
    head_logits_KBTV = torch.stack([torch.roll(target_logits_BTV, -(k + 1), dims=1)[..., draft_ids]
                                    for k in range(3)])
    mask_BT = torch.ones(2, 10, dtype=torch.bool)
    out = medusa_distill_loss(head_logits_KBTV, target_logits_BTV, mask_BT, draft_ids)
    assert torch.allclose(out.head_loss, torch.zeros(3), atol=1e-6)
    # Top-1 compares the head's draft id, as a target id, with the teacher's full-vocab argmax.
    in_vocab = torch.isin(target_logits_BTV.argmax(-1), draft_ids)  # [B, T]
    expected = [in_vocab[:, k + 1:].float().mean() for k in range(3)]
    torch.testing.assert_close(out.head_top1, torch.stack(expected))
    assert 0 < out.head_top1.min() and out.head_top1.max() < 1


def test_loss_respects_the_mask():
    torch.manual_seed(0)
    target_logits_BTV = torch.randn(1, 8, 16)
    head_logits_KBTV = torch.stack([torch.roll(target_logits_BTV, -(k + 1), dims=1) for k in range(2)])
    mask_BT = torch.ones(1, 8, dtype=torch.bool)
    mask_BT[:, 5:] = False  # padding
    garbage = head_logits_KBTV.clone()
    garbage[:, :, 4:] = torch.randn_like(garbage[:, :, 4:]) * 10  # only masked-out pairs change
    out = medusa_distill_loss(garbage, target_logits_BTV, mask_BT)
    assert torch.allclose(out.head_loss, torch.zeros(2), atol=1e-6)
    assert out.head_count.tolist() == [4, 3]


def test_loss_rejects_blocks_too_short_for_the_heads():
    with pytest.raises(ValueError, match="seq_len must be >= num_heads \\+ 2"):
        medusa_distill_loss(torch.zeros(4, 1, 5, 8), torch.zeros(1, 5, 8), torch.ones(1, 5, dtype=torch.bool))


# ---------------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def trained(tiny_llama_dir, walks_file, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("trained")
    recipe = write_recipe(tmp, tiny_llama_dir, walks_file, tmp / "run")
    assert main([str(recipe), "--set", "train.steps=100", "--set", "train.save_every=50"]) == 0
    return tmp / "run"


def test_training_writes_a_heads_dir_with_a_tree(trained, tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    heads, config = load_heads(trained / "heads", target=target.identity)
    assert config.kind == "medusa" and config.num_heads == NUM_HEADS
    assert config.tap_layers == [target.num_layers]
    assert config.target.name_or_path == str(Path(tiny_llama_dir).resolve())
    tree = config.tree
    assert set(tree) == {"paths", "num_nodes", "expected_accepted_draft_tokens"}
    assert 1 <= len(tree["paths"]) == tree["num_nodes"] <= 8
    assert all(len(p) <= NUM_HEADS and all(0 <= r < 3 for r in p) for p in tree["paths"])
    assert tree["expected_accepted_draft_tokens"] > 0
    accuracy = config.calibration["accuracy"]
    assert len(accuracy) == NUM_HEADS and all(len(row) == 3 for row in accuracy)
    assert (trained / "checkpoints" / "latest").read_text().strip() == "step-00000100"


def test_trained_heads_agree_with_the_target_far_more_than_untrained(trained, tiny_llama_dir, walks_file):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    heads, config = load_heads(trained / "heads")
    walks = markov_walks(num_records=40, seed=123)  # unseen walks of the same successor map
    blocks = build_blocks("eval", walks, "text", 64, None, eos_token_id=2)
    untrained = MedusaHeads(target.hidden_size, target.vocab_size, NUM_HEADS, 1)
    untrained.init_lm_heads_from(target.lm_head())
    medusa, taps = head_kind(HeadsSpec(kind="medusa", num_heads=NUM_HEADS)), config.tap_layers
    before, _ = measure_accuracy(untrained, medusa, target, blocks.input_ids, blocks.loss_mask, 1, 8, 8, taps)
    after, _ = measure_accuracy(heads, medusa, target, blocks.input_ids, blocks.loss_mask, 1, 8, 8, taps)
    before_top1, after_top1 = [row[0] for row in before], [row[0] for row in after]
    for k in range(NUM_HEADS):
        assert after_top1[k] > before_top1[k] + 0.08, (before_top1, after_top1)
    assert sum(after_top1) > 2 * sum(before_top1), (before_top1, after_top1)


def test_resume_from_a_checkpoint_is_exact(tiny_llama_dir, walks_file, tmp_path, capsys):
    """Training 20 steps straight and 10 + (crash) + 10 resumed give bit-identical heads."""
    straight = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "straight")
    assert main([str(straight)]) == 0
    resumed = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "resumed")
    assert main([str(resumed)]) == 0
    checkpoints = tmp_path / "resumed" / "checkpoints"
    # Pretend the run died after step 10's checkpoint: drop step 20 and leave a partial temp dir.
    shutil.rmtree(checkpoints / "step-00000020")
    shutil.rmtree(tmp_path / "resumed" / "heads")
    (checkpoints / "latest").write_text("step-00000010\n")
    (checkpoints / ".tmp-step-00000020").mkdir()
    assert main([str(resumed)]) == 0
    assert not (checkpoints / ".tmp-step-00000020").exists()
    a = load_file(str(tmp_path / "straight" / "heads" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "heads" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    manifest = json.loads((checkpoints / "step-00000020" / "manifest.json").read_text())
    assert manifest["step"] == 20
    assert manifest["sampler"]["position"] == 20 * 8  # steps x micro batch x grad accum x ranks
    # Re-running a finished run trains nothing and rewrites the same heads.
    assert main([str(straight)]) == 0
    assert "steps 20->20" in capsys.readouterr().out
    again = load_file(str(tmp_path / "straight" / "heads" / "model.safetensors"))
    assert all(torch.equal(a[name], again[name]) for name in a)


def test_a_checkpoint_missing_files_is_never_loaded(tiny_llama_dir, walks_file, tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "run")
    assert main([str(recipe), "--set", "train.steps=10"]) == 0
    (tmp_path / "run" / "checkpoints" / "step-00000010" / "rank-00000.pt").unlink()
    assert main([str(recipe), "--set", "train.steps=10"]) == 2
    assert "missing ['rank-00000.pt']" in capsys.readouterr().err


def test_a_run_that_never_published_latest_starts_fresh(tiny_llama_dir, walks_file, tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "run")
    partial = tmp_path / "run" / "checkpoints" / "step-00000010"
    partial.mkdir(parents=True)
    (partial / "manifest.json").write_text("{}")  # a directory `latest` does not name
    assert main([str(recipe), "--set", "train.steps=10", "--set", "train.save_every=100"]) == 0
    out = capsys.readouterr().out
    assert "resuming" not in out and "steps 0->10" in out


def test_text_data_with_a_separate_tokenizer_trains(tiny_llama_dir, tmp_path):
    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    source = write_jsonl(tmp_path / "code.jsonl", [{"text": f"def f(x):\n    return x + {i}\n"} for i in range(40)])
    recipe = write_recipe(tmp_path, tiny_llama_dir, source, tmp_path / "run")
    assert main([str(recipe), "--set", f"data.tokenizer={tokenizer_dir}", "--set", "train.steps=4"]) == 0
    _, config = load_heads(tmp_path / "run" / "heads")
    assert config.tree["num_nodes"] >= 1


def test_wandb_tracking_logs_offline_and_stdout_gets_the_metrics(tiny_llama_dir, walks_file, tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "run",
                          extra="tracking: wandb\nwandb:\n  project: specheads-tests\n")
    assert main([str(recipe), "--set", "train.steps=2", "--set", "train.log_every=1"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("step 2/2"))
    assert "head loss" in line and "top1" in line and "lr " in line and "loss tok/s" in line and "| ETA " in line
    assert len(line.split("top1 ")[1].split(" |")[0].split()) == NUM_HEADS
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    run_id = manifest["wandb_run_id"]
    runs = list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


# ---------------------------------------------------------------------------- user errors

def test_empty_dataset_exits_nonzero_with_a_clear_message(tiny_llama_dir, tmp_path, capsys):
    source = write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"title": "x"}])
    recipe = write_recipe(tmp_path, tiny_llama_dir, source, tmp_path / "run")
    assert main([str(recipe)]) == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("specheads train: error:")]
    assert len(errors) == 1, stderr
    assert "blank.jsonl' is empty: 2 records" in errors[0]
    assert "empty 'text': 1" in errors[0] and "missing field 'text': 1" in errors[0]
    assert "Traceback" not in stderr


def test_unknown_recipe_key_exits_nonzero_naming_it(tiny_llama_dir, walks_file, tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "run", extra="train_extra: 1\n")
    assert main([str(recipe)]) == 2
    assert "train_extra: unknown key" in capsys.readouterr().err
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "run")
    assert main([str(recipe), "--set", "train.micro_batch=2"]) == 2
    assert "train.micro_batch: unknown key" in capsys.readouterr().err


def test_missing_target_exits_nonzero(walks_file, tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    recipe = write_recipe(tmp_path, missing, walks_file, tmp_path / "run")
    assert main([str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "does not exist" in err and "Traceback" not in err


def test_launcher_local_rank_argument_is_accepted(tmp_path, capsys):
    assert main([str(tmp_path / "absent.yaml"), "--local_rank=0"]) == 2
    assert "absent.yaml' does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------------------- data.split

def numbered_records(count: int) -> list[dict]:
    """Record i is the token ids [4 + i % 60] * 10, so a block's first id names its record."""
    return [{"input_ids": [4 + i % 60] * 10} for i in range(count)]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_data_split_and_eval_split_select_records_through_load_dataset(tmp_path, suffix):
    from specheads.training.config import recipe_from_dict
    from specheads.training.data_split import load_training_data

    path = tmp_path / f"records{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, numbered_records(40))
    else:
        import datasets

        datasets.Dataset.from_list(numbered_records(40)).to_parquet(str(path))
    recipe = recipe_from_dict({"target": {"name_or_path": "x"}, "data": {
        "source": str(path), "seq_len": 11, "split": "train[:25%]", "eval_split": "train[90%:]"}})
    train, held_out = load_training_data(recipe.data, None, seed=0, eos_token_id=2)
    # One record (10 ids + EOS) per 11-token block: the blocks are exactly the split's records.
    assert sorted(int(block[0]) for block in train.input_ids) == [4 + i for i in range(10)]
    assert sorted(int(block[0]) for block in held_out.input_ids) == [4 + i for i in range(36, 40)]
    assert "[train[:25%]]" in train.report.source and "[train[90%:]]" in held_out.report.source
    # Without eval_split the held-out part is the last eval_fraction of the split's records.
    data = recipe.data.replace(eval_split=None, eval_fraction=0.2)
    train, held_out = load_training_data(data, None, seed=0, eos_token_id=2)
    assert len(train) == 8 and len(held_out) == 2
    assert {int(b[0]) for b in train.input_ids} | {int(b[0]) for b in held_out.input_ids} == set(range(4, 14))


def test_bad_splits_fail_naming_the_split_and_source(tmp_path):
    from specheads.training.config import RecipeError, recipe_from_dict
    from specheads.training.data_split import load_training_data

    path = write_jsonl(tmp_path / "r.jsonl", numbered_records(5))
    recipe = recipe_from_dict({"target": {"name_or_path": "x"}, "data": {"source": str(path), "split": "validation"}})
    with pytest.raises(DataError, match=r"cannot load split 'validation' of data source '.*r\.jsonl'"):
        load_training_data(recipe.data, None, seed=0, eos_token_id=2)
    recipe = recipe_from_dict({"target": {"name_or_path": "x"}, "data": {"split": "train[:10%]"}})
    with pytest.raises(DataError, match="embedded:stdlib is not a datasets source"):
        load_training_data(recipe.data, None, seed=0)
    with pytest.raises(RecipeError, match="data.split: expected a datasets split"):
        recipe_from_dict({"target": {"name_or_path": "x"}, "data": {"split": "train[:1%"}})


def test_a_recipe_trains_on_a_split(tiny_llama_dir, walks_file, tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "run",
                          extra="")
    assert main([str(recipe), "--set", "train.steps=2", "--set", "data.split=train[:50%]",
                 "--set", "data.eval_split=train[95%:]"]) == 0
    out = capsys.readouterr().out
    assert f"train data {walks_file} [train[:50%]]: 150/150 records used" in out
    assert f"eval data {walks_file} [train[95%:]]: 15/15 records used" in out


def test_a_checkpoint_from_before_the_new_recipe_keys_still_resumes(tiny_llama_dir, walks_file, tmp_path, capsys):
    """Manifests written before data.split/eval_split/feature_cache, lora and the adapter flag
    existed hold no such keys; they mean the defaults, so the run resumes instead of reporting a
    changed recipe or a LoRA adapter."""
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "run")
    assert main([str(recipe), "--set", "train.steps=2", "--set", "train.save_every=2"]) == 0
    manifest_path = tmp_path / "run" / "checkpoints" / "step-00000002" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for key in ("split", "eval_split", "feature_cache"):
        del manifest["recipe"]["data"][key]
    del manifest["recipe"]["lora"]
    assert manifest.pop("adapter") is False
    manifest_path.write_text(json.dumps(manifest))
    assert main([str(recipe), "--set", "train.steps=3", "--set", "train.save_every=2"]) == 0
    assert "resuming from" in capsys.readouterr().out
    assert main([str(recipe), "--set", "train.steps=4", "--set", "data.split=train[:50%]"]) == 2
    assert "differs in ['data']" in capsys.readouterr().err
