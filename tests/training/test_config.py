"""Recipes are strict: unknown keys and bad values fail with the dotted key; overrides use
dotted keys; recipes are frozen; every shipped recipe loads; the committed JSON schema is the
models' own; the DeepSpeed JSON is generated from the recipe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from specheads.training.config import Recipe, RecipeError, dotted_keys, load_recipe, recipe_from_dict, schema_text
from specheads.training.ds_config import build_ds_config
from specheads.training.recipe_models import expected, section_type

from conftest import REPO

RECIPES_DIR = REPO / "recipes"

MINIMAL = "target:\n  name_or_path: some/model\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_minimal_recipe_gets_defaults(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL))
    assert recipe.target.name_or_path == "some/model"
    assert recipe.heads.kind == "medusa"
    assert recipe.tracking == "none"
    assert recipe.train.zero_stage == 0


@pytest.mark.parametrize("text, dotted", [
    (MINIMAL + "train:\n  stepz: 10\n", "train.stepz"),
    (MINIMAL + "lora:\n  rnak: 8\n", "lora.rnak"),  # the optional section forbids unknown keys too
    (MINIMAL + "train:\n  steps: 0\n  stepz: 10\n", "train.stepz"),  # an unknown key is named first
    (MINIMAL + "trian:\n  steps: 10\n", "trian"),
    (MINIMAL + "heads:\n  num_heads: 2\n  depth: 3\n", "heads.depth"),
    ("target:\n  name_or_path: x\n  revision: main\n", "target.revision"),
])
def test_unknown_key_names_the_dotted_key(tmp_path, text, dotted):
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, text))
    message = str(err.value)
    assert message.startswith(f"{dotted}: unknown key")
    assert "known keys" in message and "\n" not in message


def test_unknown_key_suggests_the_close_one(tmp_path):
    with pytest.raises(RecipeError, match="did you mean 'steps'"):
        load_recipe(write(tmp_path, MINIMAL + "train:\n  stepz: 10\n"))


@pytest.mark.parametrize("text, message", [
    (MINIMAL + "train:\n  micro_batch_size: x\n", "train.micro_batch_size: expected a positive int, got 'x'"),
    (MINIMAL + "train:\n  steps: 0\n", "train.steps: expected a positive int, got 0"),
    (MINIMAL + "train:\n  steps: 2.5\n", "train.steps: expected a positive int, got 2.5"),
    (MINIMAL + "train:\n  steps: true\n", "train.steps: expected a positive int, got True"),
    (MINIMAL + "train:\n  precision: fp8\n", "train.precision: expected one of ['auto', 'fp32', 'bf16', 'fp16'], got 'fp8'"),
    (MINIMAL + "train:\n  zero_stage: 4\n", "train.zero_stage: expected one of [0, 1, 2, 3], got 4"),
    (MINIMAL + "train:\n  lr: -1\n", "train.lr: expected a number > 0, got -1.0"),
    (MINIMAL + "tracking: tensorboard\n", "tracking: expected one of ['wandb', 'none'], got 'tensorboard'"),
    (MINIMAL + "data:\n  eval_fraction: 1.5\n", "data.eval_fraction: expected a number in (0, 1), got 1.5"),
    (MINIMAL + "data:\n  chat_self_instruct_fraction: 1\n",
     "data.chat_self_instruct_fraction: expected a number in [0, 1), got 1"),
    (MINIMAL + "data:\n  chat_self_instruct_temperature: 2.5\n",
     "data.chat_self_instruct_temperature: expected a number in [0, 2] (0 = greedy), got 2.5"),
    (MINIMAL + "train: 5\n", "train: expected a mapping of keys to values, got 5"),
    ("heads:\n  num_heads: 2\n", "target: required section is missing"),
    ("target:\n  dtype: float32\n", "target.name_or_path: required"),
    # Stricter than the hand-written checks were: no float for an int choice, no infinity.
    (MINIMAL + "train:\n  zero_stage: 1.0\n", "train.zero_stage: expected one of [0, 1, 2, 3], got 1.0"),
    (MINIMAL + "train:\n  zero_stage: true\n", "train.zero_stage: expected one of [0, 1, 2, 3], got True"),
    (MINIMAL + "train:\n  lr: .inf\n", "train.lr: expected a number > 0, got inf"),
    (MINIMAL + "train:\n  steps: '10'\n", "train.steps: expected a positive int, got '10'"),
    (MINIMAL + "train:\n  lr: fast\n", "train.lr: expected a number > 0, got 'fast'"),
    (MINIMAL + "heads:\n  tap_layers: [2, -1]\n",
     "heads.tap_layers: expected a non-empty list of ints >= 0, or null, got [2, -1]"),
    (MINIMAL + "lora:\n  target_modules: [q_proj, '']\n",
     "lora.target_modules: expected a non-empty list of module names (strings), or 'all-linear', got ['q_proj', '']"),
    (MINIMAL + "lora: 3\n", "lora: expected a mapping of keys to values, got 3"),
])
def test_bad_value_names_key_and_expectation(tmp_path, text, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, text))
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("seed, accepted", [(-1, False), (0, True), (2**32 - 1, True), (2**32, False)])
def test_the_seed_is_a_32_bit_int(tmp_path, seed, accepted):
    path = write(tmp_path, MINIMAL + f"train:\n  seed: {seed}\n")
    if accepted:
        assert load_recipe(path).train.seed == seed
        return
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(err.value) == f"train.seed: expected an int with 0 <= seed < 2**32 (4294967296), got {seed}"


def test_recipes_are_frozen_and_replace_makes_a_validated_copy(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL))
    with pytest.raises(ValidationError, match="frozen"):
        recipe.train.steps = 5
    with pytest.raises(ValidationError, match="frozen"):
        recipe.lora = None
    data = recipe.data.replace(eval_fraction=0.2)
    assert (data.eval_fraction, recipe.data.eval_fraction) == (0.2, 0.05)
    assert recipe.replace(data=data).data == data and recipe.data.eval_fraction == 0.05
    with pytest.raises(RecipeError, match=r"^data\.eval_fraction: expected a number in \(0, 1\), got 2\.0$"):
        recipe.data.replace(eval_fraction=2)
    with pytest.raises(RecipeError, match="^train.stepz: unknown key; did you mean 'steps'"):
        recipe.train.replace(stepz=3)
    with pytest.raises(RecipeError, match="^lora: LoRA joint training does not support train.zero_stage 3"):
        recipe.replace(lora={}, train=recipe.train.replace(zero_stage=3))  # cross-section rules run again


def test_every_value_says_what_it_expects():
    for dotted in dotted_keys():
        section, _, name = dotted.partition(".")
        cls = section_type(Recipe, section) if name else Recipe
        assert expected(cls.model_fields[name or section]), dotted


def test_the_committed_schema_is_the_models_own():
    committed = (RECIPES_DIR / "recipe.schema.json").read_text()
    regenerate = [sys.executable, "-m", "specheads.training.config", "--schema"]
    assert committed == schema_text(), f"regenerate it: {' '.join(regenerate[1:])} > recipes/recipe.schema.json"
    assert subprocess.run(regenerate, capture_output=True, text=True, check=True).stdout == committed


@pytest.mark.parametrize("text, flagged", [
    (MINIMAL, None),
    (MINIMAL + "train:\n  stepz: 10\n", "stepz"),
    (MINIMAL + "train:\n  seed: 4294967296\n", "4294967296"),
    (MINIMAL + "heads:\n  kind: hydra\n", "hydra"),
    (MINIMAL + "profiles:\n  cpu:\n    train.steps: 5\n", None),
    (MINIMAL + "profiles:\n  cpu:\n    train.stepz: 5\n", "train.stepz"),
])
def test_the_schema_flags_what_loading_refuses(text, flagged):
    """What an editor shows: the schema refuses unknown keys (profiles' dotted keys too) and bounds."""
    import jsonschema
    import yaml

    validator = jsonschema.Draft7Validator(json.loads((RECIPES_DIR / "recipe.schema.json").read_text()))
    errors = [error.message for error in validator.iter_errors(yaml.safe_load(text))]
    assert (errors == []) if flagged is None else any(flagged in message for message in errors), errors


def test_float_fields_accept_yaml_exponents(tmp_path):
    # YAML 1.1 reads `3e-4` as a string; a learning rate written that way must still work.
    recipe = load_recipe(write(tmp_path, MINIMAL + "train:\n  lr: 3e-4\n  weight_decay: 0\n"))
    assert recipe.train.lr == pytest.approx(3e-4)
    assert recipe.train.weight_decay == 0.0 and isinstance(recipe.train.weight_decay, float)


@pytest.mark.parametrize("value, thinking", [("off", "off"), ("on", "on"), ('"off"', "off"), ("default", "default"),
                                             ("false", "off"), ("true", "on")])
def test_thinking_takes_on_off_and_default_as_yaml_writes_them(tmp_path, value, thinking):
    # YAML 1.1 reads a bare on/off as a boolean; the recipe means the words.
    assert load_recipe(write(tmp_path, MINIMAL + f"data:\n  thinking: {value}\n")).data.thinking == thinking
    assert load_recipe(write(tmp_path, MINIMAL), [f"data.thinking={value}"]).data.thinking == thinking


@pytest.mark.parametrize("value", ["maybe", "1", "null", "[on]"])
def test_thinking_refuses_anything_else_naming_the_key(tmp_path, value):
    with pytest.raises(RecipeError, match=r"^data.thinking: expected one of 'default', 'on', 'off', got "):
        load_recipe(write(tmp_path, MINIMAL + f"data:\n  thinking: {value}\n"))


def test_dotted_overrides(tmp_path):
    path = write(tmp_path, MINIMAL + "train:\n  steps: 100\n")
    recipe = load_recipe(path, ["train.steps=10", "train.lr=0.01", "tracking=wandb", "wandb.project=p",
                                "data.max_records=null", "heads.num_heads=2"])
    assert recipe.train.steps == 10
    assert recipe.train.lr == pytest.approx(0.01)
    assert recipe.tracking == "wandb"
    assert recipe.wandb.project == "p"  # a section absent from the YAML
    assert recipe.data.max_records is None
    assert recipe.heads.num_heads == 2


@pytest.mark.parametrize("override, message", [
    ("train.stepz=10", "train.stepz: unknown key"),
    ("trainer.steps=10", "trainer: unknown key"),
    ("train.steps.max=10", "train.steps: is a value, not a section"),
    ("train=10", "train: is a section"),
    ("train.steps=x", "train.steps: expected a positive int, got 'x'"),
    ("train.steps", "override 'train.steps': expected dotted.key=value"),
])
def test_bad_overrides(tmp_path, override, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, MINIMAL), [override])
    assert str(err.value).startswith(message)


def test_missing_or_broken_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(write(tmp_path, "target: [unclosed\n"))


def test_recipe_dict_round_trip(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL), ["train.steps=7", "calibrate.num_nodes=5"])
    raw = recipe.to_dict()
    assert raw["train"]["steps"] == 7 and raw["calibrate"]["num_nodes"] == 5
    assert recipe_from_dict(raw) == recipe


def test_every_shipped_recipe_loads():
    recipes = sorted(RECIPES_DIR.glob("*.yaml"))
    assert recipes, f"no recipes in {RECIPES_DIR}"
    for path in recipes:
        recipe = load_recipe(path)
        assert isinstance(recipe, Recipe)
        first_line = path.read_text().splitlines()[0]
        assert first_line.startswith("#") and "specheads" in first_line, f"{path.name}: first line must be its launch command"


def test_ds_config_is_generated_from_the_recipe(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL), [
        "train.micro_batch_size=4", "train.grad_accum=3", "train.zero_stage=2", "train.precision=bf16",
        "train.grad_clip=0.5", "train.lr=0.002", "train.weight_decay=0.1", "train.warmup_steps=5",
        "train.steps=50"])
    config = build_ds_config(recipe.train, world_size=2)
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 4 * 3 * 2
    assert config["zero_optimization"] == {"stage": 2}
    assert config["bf16"] == {"enabled": True} and "fp16" not in config
    assert config["gradient_clipping"] == 0.5
    optimizer = config["optimizer"]
    assert optimizer["type"] == "AdamW" and optimizer["params"]["torch_adam"] is True
    assert optimizer["params"]["lr"] == 0.002 and optimizer["params"]["weight_decay"] == 0.1
    assert config["scheduler"]["type"] == "WarmupCosineLR"
    assert config["scheduler"]["params"]["total_num_steps"] == 50
    assert config["scheduler"]["params"]["warmup_num_steps"] == 5

    constant = build_ds_config(load_recipe(write(tmp_path, MINIMAL), [
        "train.scheduler=constant", "train.warmup_steps=3", "train.precision=fp16"]).train, world_size=1)
    assert constant["scheduler"]["type"] == "WarmupLR"
    assert constant["fp16"]["enabled"] is True and "bf16" not in constant
    no_warmup = build_ds_config(load_recipe(write(tmp_path, MINIMAL), ["train.scheduler=constant"]).train, 1)
    assert "scheduler" not in no_warmup


def test_offload_options_map_into_the_deepspeed_config(tmp_path):
    base = build_ds_config(load_recipe(write(tmp_path, MINIMAL), ["train.zero_stage=2"]).train, 1)
    assert "offload_optimizer" not in base["zero_optimization"] and base["optimizer"]["params"]["torch_adam"]
    optimizer_off = build_ds_config(load_recipe(write(tmp_path, MINIMAL), [
        "train.zero_stage=2", "train.offload_optimizer=cpu"]).train, 1)
    assert optimizer_off["zero_optimization"] == {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert "torch_adam" not in optimizer_off["optimizer"]["params"]  # DeepSpeedCPUAdam steps the CPU state
    both = build_ds_config(load_recipe(write(tmp_path, MINIMAL), [
        "train.zero_stage=3", "train.offload_optimizer=cpu", "train.offload_params=cpu"]).train, 1)
    assert both["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert both["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


@pytest.mark.parametrize("overrides, message", [
    (["train.offload_params=cpu", "train.zero_stage=2"], "train.offload_params: 'cpu' needs train.zero_stage 3"),
    (["train.offload_optimizer=cpu"], "train.offload_optimizer: 'cpu' needs ZeRO, but train.zero_stage is 0"),
    (["train.offload_optimizer=nvme"], "train.offload_optimizer: expected one of ['none', 'cpu']"),
    (["train.offload_params=yes"], "train.offload_params: expected one of ['none', 'cpu']"),
])
def test_bad_offload_settings_fail_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, MINIMAL), overrides)
    assert message in str(err.value)


def test_optional_lora_section_is_off_when_absent_or_null_and_takes_overrides(tmp_path):
    assert load_recipe(write(tmp_path, MINIMAL)).lora is None
    assert load_recipe(write(tmp_path, MINIMAL + "lora: null\n")).lora is None
    recipe = load_recipe(write(tmp_path, MINIMAL), ["lora.rank=8", "lora.target_modules=all-linear"])
    assert recipe.lora.rank == 8 and recipe.lora.target_modules == "all-linear"
    assert recipe.to_dict()["lora"]["alpha"] == 32.0
    assert load_recipe(write(tmp_path, MINIMAL + "lora: {}\n")).lora.target_modules == [
        "q_proj", "k_proj", "v_proj", "o_proj"]
