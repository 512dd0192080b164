"""Every shipped recipe loads strictly, starts with its launch command, names its JSON schema
for editors (and passes it), and dry-runs offline: target and heads built on the meta device
from the shipped config.json, parameter counts matching the published model sizes, a memory
estimate and the generated DeepSpeed JSON."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from specheads.train import main as train_main
from specheads.training.config import load_recipe
from specheads.training.dry_run import estimate_memory, launch_world_size

from conftest import REPO

RECIPES_DIR = REPO / "recipes"
RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))
assert RECIPES, f"no recipes found in {RECIPES_DIR}"  # an empty parametrization would pass silently
LAUNCH_LINE = re.compile(r"# deepspeed (--hostfile \S+ --num_nodes \d+ )?--num_gpus \d+ "
                         r"--module specheads\.train recipes/(?P<name>\S+\.yaml)( --profile gpu)?$")
# Parameter counts of the meta-built targets, cross-checked with the model cards: Llama-3.1-8B's
# well-known 8,030,261,248; Qwen3-8B's card says 8.2B total and 6.95B non-embedding (this minus
# 2 x 151936 x 4096 untied embeddings = 6,946,075,648); Llama-3.3-70B's 70.6B.
KNOWN_TARGET_PARAMS = {
    "meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248,
    "Qwen/Qwen3-8B": 8_190_735_360,
    "meta-llama/Llama-3.3-70B-Instruct": 70_553_706_496,
}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """A dry run must never reach a network: any socket connect fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def refuse(self, address, *args, **kwargs):
        raise AssertionError(f"dry run tried to connect to {address!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


def dry_run(capsys, path: Path, *extra: str) -> tuple[str, dict]:
    code = train_main([str(path), "--dry-run", *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = captured.out
    head, sep, ds_json = out.partition("\ndeepspeed config\n")
    assert sep, out
    return head, json.loads(ds_json)


def counts(head: str) -> tuple[int, int]:
    target = re.search(r"target \(frozen\)\s+([\d,]+)", head)
    heads = re.search(r"heads \(trainable\)\s+([\d,]+)", head)
    assert target and heads, head
    return int(target.group(1).replace(",", "")), int(heads.group(1).replace(",", ""))


def test_the_shipped_recipes_cover_the_targets():
    names = {p.name for p in RECIPES}
    assert {"tiny-medusa.yaml", "tiny-eagle3.yaml", "eagle3-llama-3.1-8b-instruct.yaml",
            "medusa-llama-3.1-8b-instruct.yaml", "eagle3-qwen3-8b.yaml", "medusa-qwen3-8b.yaml",
            "eagle3-llama-3.3-70b-instruct.yaml", "medusa2-lora-llama-3.1-8b-instruct.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_and_starts_with_its_launch_command(path):
    load_recipe(path)
    first = path.read_text().splitlines()[0]
    match = LAUNCH_LINE.match(first)
    assert match, f"{path.name}: first line must be its deepspeed launch command, got {first!r}"
    assert match.group("name") == path.name


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_names_its_schema_for_editors_and_keeps_to_it(path):
    """The YAML language server reads the modeline; the recipe, profiles included, passes the
    schema, so an editor flags nothing in a shipped recipe."""
    import jsonschema
    import yaml

    assert "# yaml-language-server: $schema=recipe.schema.json" in path.read_text().splitlines(), path.name
    schema = json.loads((RECIPES_DIR / "recipe.schema.json").read_text())
    errors = [f"{list(e.absolute_path)}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(yaml.safe_load(path.read_text()))]
    assert errors == [], path.name


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_profile_of_a_recipe_loads(path):
    import yaml

    profiles = yaml.safe_load(path.read_text()).get("profiles") or {}
    for name in profiles:
        load_recipe(path, profile=name)
    if profiles:
        assert set(profiles) == {"cpu", "gpu"}, path.name
        for name in profiles:  # the device's fast dtype, resolved when training starts (training/trainer.py)
            recipe = load_recipe(path, profile=name)
            assert (recipe.train.precision, recipe.target.dtype) == ("auto", "auto"), (path.name, name)


def test_profiles_are_strict(tmp_path):
    from specheads.training.config import RecipeError

    path = tmp_path / "r.yaml"
    path.write_text("target:\n  name_or_path: x\nprofiles:\n  cpu:\n    train.steps: 7\n  gpu:\n    train.stepz: 1\n")
    assert load_recipe(path, profile="cpu").train.steps == 7
    assert load_recipe(path, ["train.steps=9"], profile="cpu").train.steps == 9  # --set wins
    with pytest.raises(RecipeError, match="train.stepz"):
        load_recipe(path, profile="gpu")
    with pytest.raises(RecipeError, match="no profile 'tpu'; choose one of \\['cpu', 'gpu'\\]"):
        load_recipe(path, profile="tpu")
    path.write_text("target:\n  name_or_path: x\n")
    with pytest.raises(RecipeError, match="has no profiles"):
        load_recipe(path, profile="cpu")


def test_the_smollm2_recipes_train_on_the_targets_own_chat_replies():
    for kind in ("eagle3", "medusa"):
        recipe = load_recipe(RECIPES_DIR / f"smollm2-135m-{kind}.yaml", profile="cpu")
        assert (recipe.target.name_or_path, recipe.data.source) == ("embedded:smollm2", "embedded:chat")
        assert recipe.train.output_dir == f"runs/smollm2-135m-{kind}"


# Reply tokens a recipe names: data.chat_prompts conversations x data.chat_max_new_tokens, the most
# tokens the target may write in a conversation's first reply (later turns and early stops are not
# counted: on SmolLM2 a conversation measured about 270 tokens in all, ~220 of them reply tokens).
def named_reply_tokens(recipe) -> int:
    return recipe.data.chat_prompts * recipe.data.chat_max_new_tokens


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_the_smollm2_profiles_name_enough_reply_tokens(kind):
    """CPU: >= 1M reply tokens; GPU: the same recipe scaled to >= 10M; both in the device's fast dtype."""
    cpu = load_recipe(RECIPES_DIR / f"smollm2-135m-{kind}.yaml", profile="cpu")
    gpu = load_recipe(RECIPES_DIR / f"smollm2-135m-{kind}.yaml", profile="gpu")
    assert named_reply_tokens(cpu) >= 1_000_000, named_reply_tokens(cpu)
    assert named_reply_tokens(gpu) >= 10_000_000, named_reply_tokens(gpu)
    assert cpu.train.precision == gpu.train.precision == "auto"  # bf16 where native (CPU: autocast), else fp32
    assert cpu.data.feature_cache == "auto"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_dry_runs(capsys, path):
    recipe = load_recipe(path)
    head, ds_config = dry_run(capsys, path)
    num_target, num_heads = counts(head)
    assert num_target > 0 and num_heads > 0
    assert re.search(r"memory per GPU \(estimate\): world size \d+", head)
    assert re.search(r"total\s+[\d.]+ GiB", head)
    assert ds_config["zero_optimization"]["stage"] == recipe.train.zero_stage
    world = launch_world_size(path)
    assert ds_config["train_batch_size"] == recipe.train.micro_batch_size * recipe.train.grad_accum * world
    assert ds_config["train_micro_batch_size_per_gpu"] == recipe.train.micro_batch_size
    if recipe.train.precision == "bf16":
        assert ds_config["bf16"] == {"enabled": True}
    if recipe.target.name_or_path in KNOWN_TARGET_PARAMS:
        assert num_target == KNOWN_TARGET_PARAMS[recipe.target.name_or_path]


def test_gpu_recipes_use_hub_ids_in_bf16():
    for path in RECIPES:
        recipe = load_recipe(path)
        if recipe.target.name_or_path.startswith("embedded:"):
            continue
        assert recipe.target.name_or_path in KNOWN_TARGET_PARAMS, path.name
        assert (recipe.target.dtype, recipe.train.precision) == ("bfloat16", "bf16"), path.name


def test_the_70b_recipe_is_zero3_across_nodes(capsys):
    path = RECIPES_DIR / "eagle3-llama-3.3-70b-instruct.yaml"
    assert load_recipe(path).train.zero_stage == 3
    assert launch_world_size(path) == 32
    head, ds_config = dry_run(capsys, path)
    assert "world size 32 (the recipe's launch line)" in head
    # 70.55e9 bf16 parameters over 32 ranks: about 4.1 GiB of target weights per GPU.
    target_gib = float(re.search(r"target weights\s+([\d.]+) GiB", head).group(1))
    assert target_gib == pytest.approx(70_553_706_496 * 2 / 32 / 1024 ** 3, abs=0.01)


def test_world_size_flag_overrides_the_launch_line(capsys):
    path = RECIPES_DIR / "eagle3-llama-3.1-8b-instruct.yaml"
    head, ds_config = dry_run(capsys, path, "--world-size", "16")
    assert "world size 16 (--world-size)" in head
    recipe = load_recipe(path)
    assert ds_config["train_batch_size"] == recipe.train.micro_batch_size * recipe.train.grad_accum * 16


def test_eagle3_heads_use_the_default_taps_and_draft_vocab(capsys):
    head, _ = dry_run(capsys, RECIPES_DIR / "eagle3-llama-3.1-8b-instruct.yaml")
    assert "taps [2, 16, 29]" in head and "draft vocab 32000" in head


def test_unknown_hub_id_offline_fails_in_one_line_saying_so(capsys, tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("# deepspeed --num_gpus 8 --module specheads.train recipes/recipe.yaml\n"
                    "target:\n  name_or_path: some-org/not-shipped-7B\n")
    assert train_main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not in the local HF cache and the hub is off (HF_HUB_OFFLINE is set)" in err[0], err
    assert "not-shipped-7b.json" in err[0]


def test_offline_hub_id_uses_the_shipped_config_and_says_why(capsys):
    head, _ = dry_run(capsys, RECIPES_DIR / "eagle3-llama-3.1-8b-instruct.yaml")
    assert "llama-3.1-8b-instruct.json (the copy shipped with specheads: is not in the local HF cache and the hub " \
           "is off (HF_HUB_OFFLINE is set))" in head


def test_hub_id_dry_runs_from_the_local_hf_cache(tmp_path, tiny_llama_dir):
    """HF_HOME's cache, laid out as huggingface_hub writes it (refs/main -> snapshots/<rev>),
    offline: the dry run reads the hub id's config.json from there, in its own process so that
    huggingface_hub reads HF_HOME and HF_HUB_OFFLINE as a user's shell sets them."""
    import os
    import subprocess
    import sys

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-llama"
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("target:\n  name_or_path: acme/tiny-llama\nheads:\n  kind: medusa\n  num_heads: 2\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "WORLD_SIZE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "specheads", "train", str(recipe), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"config: {repo / 'snapshots' / revision / 'config.json'} (the hub's acme/tiny-llama)" in proc.stdout
    assert counts(proc.stdout)[1] == 2 * (64 * 64 + 64 + 256 * 64)  # the cached config's shapes: K x (block; lm_head)


def test_local_target_directory_dry_runs(capsys, tmp_path, tiny_llama_dir):
    target = tiny_llama_dir
    path = tmp_path / "recipe.yaml"
    path.write_text(f"target:\n  name_or_path: {target}\nheads:\n  kind: medusa\n  num_heads: 2\n")
    head, ds_config = dry_run(capsys, path)
    assert "world size 8 (default for a GPU recipe)" in head
    assert counts(head)[1] == 2 * (64 * 64 + 64 + 256 * 64)  # K x (block W, b; lm_head)
    assert ds_config["zero_optimization"]["stage"] == 0


def test_memory_estimate_partitions_by_zero_stage(tmp_path):
    def estimate(stage: int):
        path = tmp_path / f"z{stage}.yaml"
        path.write_text("target:\n  name_or_path: x/y\n  dtype: bfloat16\n"
                        f"train:\n  precision: bf16\n  zero_stage: {stage}\n  micro_batch_size: 1\n")
        return estimate_memory(load_recipe(path), num_target_params=1000, num_head_params=100, num_layers=2,
                               hidden_size=4, vocab_size=10, head_vocab_size=10, world_size=4)

    z0, z1, z2, z3 = (estimate(stage) for stage in range(4))
    assert (z0.target_weights, z0.head_weights, z0.gradients, z0.optimizer) == (2000, 200, 200, 1200)
    assert (z1.gradients, z1.optimizer) == (200, 300)
    assert (z2.head_weights, z2.gradients, z2.optimizer) == (200, 50, 300)
    assert (z3.target_weights, z3.head_weights, z3.gradients, z3.optimizer) == (500, 50, 50, 300)
    assert z0.activations == z3.activations > 0


def test_dry_run_shows_cpu_offload_as_host_memory(capsys):
    path = RECIPES_DIR / "eagle3-llama-3.3-70b-instruct.yaml"
    plain, _ = dry_run(capsys, path)
    head, ds_config = dry_run(capsys, path, "--set", "train.offload_optimizer=cpu", "--set",
                              "train.offload_params=cpu")
    assert ds_config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds_config["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert re.search(r"optimizer\s+0\.00 GiB", head) and re.search(r"target weights\s+0\.00 GiB", head)
    assert "offloaded to CPU (optimizer state + parameters)" in head
    assert gpu_total(head) < gpu_total(plain)


def gpu_total(dry_run_text: str) -> float:
    return float(re.search(r"total\s+([\d.]+) GiB", dry_run_text).group(1))


def test_target_dtype_auto_is_the_devices_fast_dtype(capsys, tmp_path, tiny_llama_dir, monkeypatch):
    from specheads.heads.target import cpu_layout

    path = tmp_path / "recipe.yaml"
    path.write_text(f"target:\n  name_or_path: {tiny_llama_dir}\n  dtype: auto\nheads:\n  kind: medusa\n"
                    "  num_heads: 2\n")
    monkeypatch.setattr(cpu_layout, "cpu_has_native_bf16", lambda: False)
    head, _ = dry_run(capsys, path)
    assert "vocab 256, float32)" in head
    path.write_text(path.read_text().replace("dtype: auto", "dtype: fastest"))
    assert train_main([str(path), "--dry-run"]) == 2
    assert "target.dtype" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["eagle3-qwen3-8b.yaml", "medusa-qwen3-8b.yaml"])
def test_the_qwen3_recipes_train_for_the_thinking_mode_of_their_data(name):
    # ShareGPT's replies carry no reasoning: Qwen3 with thinking off writes replies like them.
    recipe = load_recipe(RECIPES_DIR / name)
    assert recipe.data.source == "Aeala/ShareGPT_Vicuna_unfiltered" and recipe.data.thinking == "off"
