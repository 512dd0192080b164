"""Recipes: YAML files that map 1:1 onto the small dataclasses below, one per part.

    target:    TargetConfig     which frozen LM the heads are trained on
    heads:     HeadsSpec        head kind and sizes
    data:      DataConfig       where the text comes from and how it is packed
    train:     TrainConfig      steps, batch, optimiser, precision, ZeRO stage, checkpoints
    tracking:  "wandb" | "none"
    wandb:     WandbConfig      used when tracking is "wandb"
    calibrate: CalibrateConfig  held-out acceptance measurement and tree size
    lora:      LoraConfig       optional: Medusa-2 joint training of a LoRA adapter on the
                                target (absent or null = the target stays frozen)

Loading is strict: an unknown key or a bad value raises RecipeError naming the key's
dotted path (`train.micro_batch_size: expected a positive int, got 'x'`). Overrides use
the same dotted paths (`--set train.steps=10`); their values are parsed as YAML scalars.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the dotted key and what would be right."""


# A field's check is (description of what is expected, predicate). The description is the
# "expected ..." part of the error message.
Check = tuple[str, Callable[[Any], bool]]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


POSITIVE_INT: Check = ("a positive int", lambda v: _is_int(v) and v > 0)
NON_NEGATIVE_INT: Check = ("an int >= 0", lambda v: _is_int(v) and v >= 0)
OPTIONAL_POSITIVE_INT: Check = ("a positive int or null", lambda v: v is None or (_is_int(v) and v > 0))
POSITIVE_NUMBER: Check = ("a number > 0", lambda v: _is_number(v) and v > 0)
NON_NEGATIVE_NUMBER: Check = ("a number >= 0", lambda v: _is_number(v) and v >= 0)
FRACTION: Check = ("a number in (0, 1)", lambda v: _is_number(v) and 0 < v < 1)
FRACTION_OR_ZERO: Check = ("a number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1)
BOOL: Check = ("true or false", lambda v: isinstance(v, bool))
NON_EMPTY_STR: Check = ("a non-empty string", lambda v: isinstance(v, str) and bool(v.strip()))
OPTIONAL_STR: Check = ("a string or null", lambda v: v is None or (isinstance(v, str) and bool(v.strip())))
SPLIT_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+(\[[^\[\]]*\])?(\+[A-Za-z0-9_.-]+(\[[^\[\]]*\])?)*$")
SPLIT: Check = ("a datasets split such as 'train', 'train[:1%]' or 'validation[100:200]'",
                lambda v: isinstance(v, str) and bool(SPLIT_PATTERN.match(v)))
OPTIONAL_SPLIT: Check = (SPLIT[0] + ", or null", lambda v: v is None or SPLIT[1](v))
NON_EMPTY_STR_LIST: Check = ("a non-empty list of module names (strings), or 'all-linear'",
                             lambda v: v == "all-linear" or (isinstance(v, list) and bool(v) and all(
                                 isinstance(x, str) and bool(x.strip()) for x in v)))


def _as_float(value):
    """`lr: 1` means 1.0, and `lr: 3e-4` (which YAML 1.1 reads as a string) means 0.0003."""
    if _is_int(value):
        return float(value)
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    return value


def one_of(*choices) -> Check:
    return (f"one of {list(choices)}", lambda v: v in choices and not isinstance(v, bool))


def _field(default, check: Check, help: str = ""):
    return field(default=default, metadata={"check": check, "help": help})


def _required(check: Check, help: str = ""):
    return field(metadata={"check": check, "help": help})


@dataclass
class TargetConfig:
    name_or_path: str = _required(NON_EMPTY_STR, "a local model directory, a hub id, a .gguf file (or a "
                                                 "directory holding one), embedded:tiny or embedded:smollm2")
    # "auto": the device's fast dtype (bf16 on a GPU or a CPU with native bf16). Training keeps
    # fp32 as its default: the frozen teacher's outputs are the heads' targets.
    dtype: str = _field("float32", one_of("auto", "float32", "bfloat16", "float16"))
    trust_remote_code: bool = _field(False, BOOL)


OPTIONAL_INT_LIST: Check = ("a non-empty list of ints >= 0, or null",
                            lambda v: v is None or (isinstance(v, list) and bool(v)
                                                    and all(_is_int(x) and x >= 0 for x in v)))


@dataclass
class HeadsSpec:
    """Medusa uses num_heads/num_layers; EAGLE ("eagle3", and the EAGLE-1/2 variant "eagle")
    uses the rest. Sizes left null are the target's."""

    kind: str = _field("medusa", one_of("medusa", "eagle3", "eagle"))
    num_heads: int = _field(4, POSITIVE_INT, "Medusa heads")
    num_layers: int = _field(1, NON_NEGATIVE_INT, "residual blocks per Medusa head")
    ttt_steps: int = _field(7, POSITIVE_INT, "EAGLE: draft steps unrolled in training (= tree depth)")
    ttt_step_weight: float = _field(0.8, POSITIVE_NUMBER, "EAGLE: step j's loss is weighted by this ** j")
    feature_loss_weight: float = _field(1.0, NON_NEGATIVE_NUMBER, "EAGLE-1/2: weight of the feature regression")
    draft_vocab_size: int | None = _field(None, OPTIONAL_POSITIVE_INT,
                                          "most frequent training tokens the heads predict (clamped to the vocab); "
                                          "null = EAGLE-3: 32000, Medusa: the full vocab")
    tap_layers: list | None = _field(None, OPTIONAL_INT_LIST,
                                     "EAGLE-3: target layer inputs fused; null = inputs of layers 2, N//2, N-3")
    num_attention_heads: int | None = _field(None, OPTIONAL_POSITIVE_INT, "EAGLE: null = the target's")
    num_kv_heads: int | None = _field(None, OPTIONAL_POSITIVE_INT, "EAGLE: null = the target's")
    intermediate_size: int | None = _field(None, OPTIONAL_POSITIVE_INT, "EAGLE: null = the target's")


@dataclass
class DataConfig:
    source: str = _field("embedded:stdlib", NON_EMPTY_STR,
                         "embedded:stdlib, embedded:chat (built chat prompts + the target's own replies, "
                         "cached), a local .jsonl/.json/.parquet file, or a datasets name")
    chat_prompts: int = _field(1000, POSITIVE_INT, "embedded:chat: prompts the target replies to")
    chat_max_new_tokens: int = _field(256, POSITIVE_INT, "embedded:chat: the longest reply generated")
    chat_self_instruct_fraction: float = _field(0.0, FRACTION_OR_ZERO,
                                                "embedded:chat: the share of prompts the target writes itself "
                                                "(data/self_instruct.py), filtered; 0 = templates only")
    text_field: str = _field("text", NON_EMPTY_STR)
    tokenizer: str | None = _field(None, OPTIONAL_STR, "tokenizer path or hub id; null = the target's")
    seq_len: int = _field(256, POSITIVE_INT)
    # Held-out data for calibration: eval_source if set, else embedded:stdlib's held-out
    # split, else the last eval_fraction of the (shuffled) source records.
    eval_source: str | None = _field(None, OPTIONAL_STR)
    eval_fraction: float = _field(0.05, FRACTION)
    max_records: int | None = _field(None, OPTIONAL_POSITIVE_INT)
    # A conversation longer than seq_len is cut to seq_len (and counted) when true, else
    # skipped and reported as "longer than seq_len". Never silent either way.
    truncate: bool = _field(True, BOOL)
    # datasets split expressions (`train`, `train[:1%]`, `validation`) for datasets names and
    # local .jsonl/.json/.parquet files (a local file's one split is called `train`).
    split: str = _field("train", SPLIT, "datasets split of source, e.g. train or train[:1%]")
    eval_split: str | None = _field(None, OPTIONAL_SPLIT,
                                    "datasets split held out for eval/calibration (of eval_source if set, "
                                    "else of source); null = eval_source / eval_fraction as before")
    feature_cache: str | None = _field(None, OPTIONAL_STR,
                                       "directory written by `specheads data cache`, or `auto` (built from "
                                       "the training blocks on first use, in the specheads cache): train from "
                                       "the cached target taps + logits instead of running the target")


@dataclass
class TrainConfig:
    steps: int = _field(100, POSITIVE_INT, "optimizer steps")
    micro_batch_size: int = _field(8, POSITIVE_INT, "blocks per rank per micro step")
    grad_accum: int = _field(1, POSITIVE_INT)
    lr: float = _field(1e-3, POSITIVE_NUMBER)
    weight_decay: float = _field(0.0, NON_NEGATIVE_NUMBER)
    warmup_steps: int = _field(0, NON_NEGATIVE_INT)
    scheduler: str = _field("cosine", one_of("cosine", "constant"))
    grad_clip: float = _field(1.0, NON_NEGATIVE_NUMBER, "0 disables clipping")
    precision: str = _field("fp32", one_of("fp32", "bf16", "fp16"))
    zero_stage: int = _field(0, one_of(0, 1, 2, 3))
    seed: int = _field(0, NON_NEGATIVE_INT)
    save_every: int = _field(100, POSITIVE_INT, "steps between checkpoints (one is always written at the end)")
    log_every: int = _field(10, POSITIVE_INT)
    eval_every: int = _field(0, NON_NEGATIVE_INT, "steps between held-out evals (acceptance, tau); 0 = off")
    eval_batches: int = _field(2, POSITIVE_INT, "held-out batches of micro_batch_size blocks per eval")
    output_dir: str = _field("runs/medusa", NON_EMPTY_STR)
    # ZeRO-Offload: optimizer state (+ its step) on the CPU needs ZeRO 1-3; parameters on the
    # CPU need ZeRO-3. Trades GPU memory for PCIe traffic (see training/ds_config.py).
    offload_optimizer: str = _field("none", one_of("none", "cpu"), "ZeRO 1-3: keep optimizer state on the CPU")
    offload_params: str = _field("none", one_of("none", "cpu"), "ZeRO-3: keep partitioned parameters on the CPU")


@dataclass
class WandbConfig:
    project: str = _field("specheads", NON_EMPTY_STR)
    entity: str | None = _field(None, OPTIONAL_STR)
    run_name: str | None = _field(None, OPTIONAL_STR)


@dataclass
class CalibrateConfig:
    num_nodes: int = _field(16, POSITIVE_INT, "draft-tree node budget")
    max_rank: int = _field(4, POSITIVE_INT, "top-k candidates measured per head")
    eval_batches: int = _field(8, POSITIVE_INT, "held-out batches of train.micro_batch_size blocks")


@dataclass
class LoraConfig:
    """Medusa-2 joint training: a PEFT LoRA adapter on the target trains with the heads under
    heads loss + lm_loss_weight * the target's LM loss (training/lora.py says why CE)."""

    rank: int = _field(16, POSITIVE_INT, "LoRA rank r")
    alpha: float = _field(32.0, POSITIVE_NUMBER, "LoRA scaling numerator (scale = alpha / rank)")
    dropout: float = _field(0.05, ("a number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1))
    target_modules: list | str = _field(("q_proj", "k_proj", "v_proj", "o_proj"), NON_EMPTY_STR_LIST,
                                        "module names that get an adapter, or 'all-linear'")
    lm_loss_weight: float = _field(0.2, NON_NEGATIVE_NUMBER, "weight of the target's own next-token CE")
    heads_warmup_steps: int = _field(0, NON_NEGATIVE_INT, "first steps train the heads only (adapter frozen)")

    def __post_init__(self):
        if isinstance(self.target_modules, tuple):  # the default; recipes and manifests hold lists
            self.target_modules = list(self.target_modules)


@dataclass
class Recipe:
    target: TargetConfig
    heads: HeadsSpec = field(default_factory=HeadsSpec)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: str = _field("none", one_of("wandb", "none"))
    wandb: WandbConfig = field(default_factory=WandbConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    lora: LoraConfig | None = field(default=None, metadata={"optional_section": True})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _section_type(cls, f: dataclasses.Field):
    """The dataclass a field of `cls` holds (also for an optional `X | None` section), or None
    for a scalar field."""
    hint = typing.get_type_hints(cls)[f.name]
    if f.metadata.get("optional_section"):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint if dataclasses.is_dataclass(hint) else None


def _unknown_key(dotted: str, known: list[str]) -> RecipeError:
    close = difflib.get_close_matches(dotted.rsplit(".", 1)[-1], known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    where = dotted.rsplit(".", 1)[0] + " " if "." in dotted else ""
    return RecipeError(f"{dotted}: unknown key; {hint}known keys in {where or 'a recipe '}are {known}")


def _build(cls, raw, prefix: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping of keys to values, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise _unknown_key(f"{prefix}{key}", sorted(fields))
    values = {}
    for name, f in fields.items():
        dotted = f"{prefix}{name}"
        section = _section_type(cls, f)
        if section is not None:
            if f.metadata.get("optional_section") and raw.get(name) is None:
                values[name] = None  # absent or null: the feature is off
                continue
            if name not in raw and f.default_factory is dataclasses.MISSING:
                raise RecipeError(f"{dotted}: required section is missing")
            values[name] = _build(section, raw.get(name), f"{dotted}.")
            continue
        if name not in raw:
            if f.default is dataclasses.MISSING:
                raise RecipeError(f"{dotted}: required, expected {f.metadata['check'][0]}"
                                  + (f" ({f.metadata['help']})" if f.metadata.get("help") else ""))
            continue
        value = raw[name]
        expected, ok = f.metadata["check"]
        if isinstance(f.default, float):
            value = _as_float(value)
        if not ok(value):
            raise RecipeError(f"{dotted}: expected {expected}, got {value!r}")
        values[name] = value
    return cls(**values)


def recipe_from_dict(raw: dict) -> Recipe:
    recipe = _build(Recipe, raw, "")
    check_combinations(recipe)
    return recipe


def check_combinations(recipe: Recipe) -> None:
    """Values that are fine alone but not together; the message names both keys."""
    train = recipe.train
    if train.offload_optimizer != "none" and train.zero_stage == 0:
        raise RecipeError(f"train.offload_optimizer: {train.offload_optimizer!r} needs ZeRO, but train.zero_stage "
                          "is 0; set train.zero_stage to 1, 2 or 3, or train.offload_optimizer: none")
    if train.offload_params != "none" and train.zero_stage != 3:
        raise RecipeError(f"train.offload_params: {train.offload_params!r} needs train.zero_stage 3 (only ZeRO-3 "
                          f"partitions parameters), got {train.zero_stage}; set train.zero_stage: 3 or "
                          "train.offload_params: none")
    if recipe.lora is not None:
        if train.zero_stage == 3:
            raise RecipeError("lora: LoRA joint training does not support train.zero_stage 3 (the adapter would "
                              "sit inside the ZeRO-3-partitioned target, which is run as an optimizer-less "
                              "inference engine); use train.zero_stage 0, 1 or 2")
        if recipe.data.feature_cache is not None:
            raise RecipeError("data.feature_cache: a feature cache holds the frozen target's outputs, but lora "
                              "trains the target; remove data.feature_cache or the lora section")
        if recipe.train.offload_params != "none":
            raise RecipeError("train.offload_params: not supported with lora (needs ZeRO-3)")
        from specheads.heads.target import resolve_dtype  # the one dtype table; lazily: this module has no torch

        if resolve_dtype(recipe.target.dtype) != resolve_dtype(train.precision):
            wanted = str(resolve_dtype(train.precision)).removeprefix("torch.")
            raise RecipeError(f"target.dtype: with lora the target trains inside the DeepSpeed engine, which "
                              f"runs it in train.precision {train.precision!r}; set target.dtype: {wanted} "
                              f"(got {recipe.target.dtype!r}) or change train.precision")


def parse_override(text: str) -> tuple[str, Any]:
    """'train.steps=10' -> ('train.steps', 10); the value is parsed as a YAML scalar."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"override {text!r}: expected dotted.key=value, e.g. train.steps=10")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as err:
        raise RecipeError(f"{key}: cannot parse {value!r} as a YAML value ({err.__class__.__name__})") from None
    return key, parsed


def apply_override(raw: dict, dotted: str, value) -> None:
    """Set `dotted` in the raw recipe mapping, checking the path against the schema."""
    parts = dotted.split(".")
    cls, node = Recipe, raw
    for depth, name in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        here = ".".join(parts[:depth + 1])
        if name not in fields:
            raise _unknown_key(here, sorted(fields))
        section = _section_type(cls, fields[name])
        last = depth == len(parts) - 1
        if last:
            if section is not None:
                raise RecipeError(f"{here}: is a section; override one of its keys, e.g. "
                                  f"{here}.{dataclasses.fields(section)[0].name}=...")
            node[name] = value
            return
        if section is None:
            raise RecipeError(f"{here}: is a value, not a section, so {dotted} does not exist")
        child = node.get(name)
        if child is None:
            child = node[name] = {}
        elif not isinstance(child, dict):
            raise RecipeError(f"{here}: expected a mapping of keys to values, got {child!r}")
        cls, node = section, child


def apply_profile(raw: dict, profile: str | None, where: str) -> None:
    """Pop the recipe's `profiles:` (name -> {dotted.key: value}) and apply the chosen one.

    A recipe with profiles (e.g. `cpu` and `gpu`) needs one named; "auto" picks `gpu` when
    CUDA is available and the recipe has it, else `cpu`. Profile keys are checked like
    --set overrides, which are applied after them."""
    profiles = raw.pop("profiles", None)
    if profiles is None:
        if profile not in (None, "auto"):
            raise RecipeError(f"--profile {profile}: recipe {where!r} has no profiles")
        return
    if not isinstance(profiles, dict) or not all(isinstance(p, dict) for p in profiles.values()):
        raise RecipeError("profiles: expected a mapping of profile names to mappings of dotted.key: value")
    if profile in (None, "auto"):
        import torch

        profile = "gpu" if torch.cuda.is_available() and "gpu" in profiles else "cpu"
    if profile not in profiles:
        raise RecipeError(f"profiles: recipe {where!r} has no profile {profile!r}; choose one of {sorted(profiles)}")
    for dotted, value in profiles[profile].items():
        apply_override(raw, str(dotted), value)


def load_recipe(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (),
                profile: str | None = "auto") -> Recipe:
    """A recipe file -> Recipe: its chosen profile (apply_profile), then `overrides`."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {str(path)!r} does not exist (expected a YAML file, e.g. recipes/tiny-medusa.yaml)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RecipeError(f"recipe {str(path)!r} is not valid YAML: {err}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {str(path)!r}: expected a mapping at the top level, got {type(raw).__name__}")
    apply_profile(raw, profile, str(path))
    for text in overrides:
        apply_override(raw, *parse_override(text))
    return recipe_from_dict(raw)
