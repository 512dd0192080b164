"""The recipe's parts: frozen pydantic models, one per part, each field's bounds declared once
on its type, and the rules that tie parts together (`check_combinations`, run by Recipe).

    target:    TargetConfig     which frozen LM the heads are trained on
    heads:     HeadsSpec        head kind and sizes
    data:      DataConfig       where the text comes from and how it is packed
    train:     TrainConfig      steps, batch, optimiser, precision, ZeRO stage, checkpoints
    tracking:  "wandb" | "none"
    wandb:     WandbConfig      used when tracking is "wandb"
    calibrate: CalibrateConfig  held-out acceptance measurement and tree size
    lora:      LoraConfig       optional: Medusa-2 joint training of a LoRA adapter on the
                                target (absent or null = the target stays frozen)

Every model forbids unknown keys, is frozen (`section.replace(key=value)` makes a validated
copy) and strict (no "10" for an int, no true for a number; a float field takes an int and
YAML 1.1's `3e-4` string). Each field type carries `Expected`, the words its error uses, and
`as_recipe_error` turns pydantic's errors into one RecipeError line naming the dotted key:
`train.micro_batch_size: expected a positive int, got 'x'`. Files, profiles, `--set`
overrides and the JSON schema: training/config.py.
"""

from __future__ import annotations

import difflib
import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from specheads.data.chat import THINKING_MODES


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the dotted key and what would be right."""


@dataclass(frozen=True)
class Expected:
    """Metadata on a field type: what an error message says the field expects."""

    text: str


def _as_float(value):
    """`lr: 1` means 1.0, and `lr: 3e-4` (which YAML 1.1 reads as a string) means 0.0003."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    return value


NonBlank = Annotated[str, Field(pattern=r"\S")]
SPLIT_PATTERN = r"^[A-Za-z0-9_.-]+(\[[^\[\]]*\])?(\+[A-Za-z0-9_.-]+(\[[^\[\]]*\])?)*$"
SPLIT_TEXT = "a datasets split such as 'train', 'train[:1%]' or 'validation[100:200]'"

PositiveInt = Annotated[int, Field(gt=0), Expected("a positive int")]
NonNegativeInt = Annotated[int, Field(ge=0), Expected("an int >= 0")]
OptionalPositiveInt = Annotated[Annotated[int, Field(gt=0)] | None, Expected("a positive int or null")]
# The bounds come before the string parsing, so that they reach the float's own schema.
PositiveNumber = Annotated[float, Field(gt=0), BeforeValidator(_as_float), Expected("a number > 0")]
NonNegativeNumber = Annotated[float, Field(ge=0), BeforeValidator(_as_float), Expected("a number >= 0")]
Fraction = Annotated[float, Field(gt=0, lt=1), BeforeValidator(_as_float), Expected("a number in (0, 1)")]
FractionOrZero = Annotated[float, Field(ge=0, lt=1), BeforeValidator(_as_float), Expected("a number in [0, 1)")]
Temperature = Annotated[float, Field(ge=0, le=2), BeforeValidator(_as_float),
                        Expected("a number in [0, 2] (0 = greedy)")]
NonEmptyStr = Annotated[NonBlank, Expected("a non-empty string")]
OptionalStr = Annotated[NonBlank | None, Expected("a string or null")]
Split = Annotated[str, Field(pattern=SPLIT_PATTERN), Expected(SPLIT_TEXT)]
OptionalSplit = Annotated[Annotated[str, Field(pattern=SPLIT_PATTERN)] | None, Expected(SPLIT_TEXT + ", or null")]
LayerList = Annotated[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None,
                      Expected("a non-empty list of ints >= 0, or null")]
ModuleNames = Annotated[Literal["all-linear"] | Annotated[list[NonBlank], Field(min_length=1)],
                        Expected("a non-empty list of module names (strings), or 'all-linear'")]
def _thinking_from_yaml(value):
    """YAML 1.1 reads `thinking: on` / `off` as booleans: true means "on", false "off"."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


Thinking = Annotated[Literal[THINKING_MODES], BeforeValidator(_thinking_from_yaml),
                     Expected("one of " + ", ".join(repr(mode) for mode in THINKING_MODES))]
ZeroStage = Annotated[int, Field(ge=0, le=3), Expected("one of [0, 1, 2, 3]")]  # an int: Literal[0, ...] takes true
# random.seed takes any int, but numpy's and torch's generators stop at 32 bits.
Seed = Annotated[int, Field(ge=0, lt=2**32), Expected("an int with 0 <= seed < 2**32 (4294967296)")]


class Section(BaseModel):
    """One part of a recipe."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    def to_dict(self) -> dict:
        return self.model_dump()

    def replace(self, **changes):
        """A copy with `changes`, validated as loading validates (dataclasses.replace for a model)."""
        key = next((name for name in Recipe.model_fields if section_type(Recipe, name) is type(self)), None)
        return validated(type(self), {**self.model_dump(), **changes}, (key,) if key else ())


class TargetConfig(Section):
    name_or_path: NonEmptyStr = Field(description="a local model directory, a hub id, a .gguf file (or a directory "
                                                  "holding one), embedded:tiny or embedded:smollm2")
    # "auto": the device's fast dtype for training (bf16 on a GPU or a CPU with native bf16, else
    # fp32; resolved when training starts: training/trainer.py resolve_auto). Training keeps fp32 as
    # its default: the frozen teacher's outputs are the heads' targets.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False


class HeadsSpec(Section):
    """Medusa uses num_heads/num_layers; EAGLE ("eagle3", and the EAGLE-1/2 variant "eagle")
    uses num_layers and the rest. Sizes left null are the target's."""

    kind: Literal["medusa", "eagle3", "eagle"] = "medusa"
    num_heads: PositiveInt = Field(4, description="Medusa heads")
    num_layers: NonNegativeInt = Field(1, description="Medusa: residual blocks per head; EAGLE: decoder layers "
                                       "(1 = EAGLE-3's own; more load in vLLM, not in SGLang, llama.cpp or the "
                                       "official EAGLE code)")
    ttt_steps: PositiveInt = Field(7, description="EAGLE: draft steps unrolled in training (= tree depth)")
    ttt_step_weight: PositiveNumber = Field(0.8, description="EAGLE: step j's loss is weighted by this ** j")
    feature_loss_weight: NonNegativeNumber = Field(1.0, description="EAGLE-1/2: weight of the feature regression")
    draft_vocab_size: OptionalPositiveInt = Field(None, description="most frequent training tokens the heads "
                                                  "predict (clamped to the vocab); null = EAGLE-3: 32000, Medusa: "
                                                  "the full vocab")
    tap_layers: LayerList = Field(None, description="EAGLE-3: target layer inputs fused; null = inputs of layers "
                                                    "2, N//2, N-3")
    num_attention_heads: OptionalPositiveInt = Field(None, description="EAGLE: null = the target's")
    num_kv_heads: OptionalPositiveInt = Field(None, description="EAGLE: null = the target's")
    intermediate_size: OptionalPositiveInt = Field(None, description="EAGLE: null = the target's")
    init_from: OptionalStr = Field(None, description="a heads directory (a run's <output_dir>/heads) whose weights "
                                   "and draft vocab this run starts from, to go on training them on this recipe's "
                                   "data; its kind, sizes, tap layers and draft vocab size must be this recipe's")


class DataConfig(Section):
    source: NonEmptyStr = Field("embedded:stdlib", description="embedded:stdlib, embedded:chat (built chat prompts "
                                "+ the target's own replies, cached), a local .jsonl/.json/.parquet file, or a "
                                "datasets name")
    chat_prompts: PositiveInt = Field(1000, description="embedded:chat: prompts the target replies to")
    chat_max_new_tokens: PositiveInt = Field(256, description="embedded:chat: the longest reply generated")
    chat_self_instruct_fraction: FractionOrZero = Field(0.0, description="embedded:chat: the share of prompts the "
                                                        "target writes itself (data/self_instruct.py), filtered; "
                                                        "0 = templates only")
    chat_self_instruct_temperature: Temperature = Field(0.0, description="embedded:chat: 0 = the target writes its "
                                                        "prompts greedily (at most one per kind x subject x "
                                                        "instruction); above 0 they are sampled (seeded), so their "
                                                        "number is not capped")
    text_field: NonEmptyStr = "text"
    tokenizer: OptionalStr = Field(None, description="tokenizer path or hub id; null = the target's")
    seq_len: PositiveInt = 256
    # Held-out data for calibration: eval_source if set, else embedded:stdlib's held-out
    # split, else the last eval_fraction of the (shuffled) source records.
    eval_source: OptionalStr = None
    eval_fraction: Fraction = 0.05
    max_records: OptionalPositiveInt = None
    # A conversation longer than seq_len is cut to seq_len (and counted) when true, else
    # skipped and reported as "longer than seq_len". Never silent either way.
    truncate: bool = True
    # datasets split expressions (`train`, `train[:1%]`, `validation`) for datasets names and
    # local .jsonl/.json/.parquet files (a local file's one split is called `train`).
    split: Split = Field("train", description="datasets split of source, e.g. train or train[:1%]")
    eval_split: OptionalSplit = Field(None, description="datasets split held out for eval/calibration (of "
                                      "eval_source if set, else of source); null = eval_source / eval_fraction")
    thinking: Thinking = Field("default", description="chat records: the template's thinking mode (Qwen3's "
                               "enable_thinking): on, off, or default (the template's own; a template without the "
                               "switch takes only default). off leaves a record's reasoning out")
    feature_cache: OptionalStr = Field(None, description="directory written by `specheads data cache`, or `auto` "
                                       "(built from the training blocks on first use, in the specheads cache): "
                                       "train from the cached target taps + logits instead of running the target")


class TrainConfig(Section):
    steps: PositiveInt = Field(100, description="optimizer steps")
    micro_batch_size: PositiveInt = Field(8, description="blocks per rank per micro step")
    grad_accum: PositiveInt = 1
    lr: PositiveNumber = 1e-3
    weight_decay: NonNegativeNumber = 0.0
    warmup_steps: NonNegativeInt = 0
    scheduler: Literal["cosine", "constant"] = "cosine"
    grad_clip: NonNegativeNumber = Field(1.0, description="0 disables clipping")
    # "auto": bf16 on a GPU or a CPU with native bf16, fp32 elsewhere (resolved when training starts)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "fp32"
    zero_stage: ZeroStage = 0
    seed: Seed = 0
    save_every: PositiveInt = Field(100, description="steps between checkpoints (one is always written at the end)")
    log_every: PositiveInt = 10
    eval_every: NonNegativeInt = Field(0, description="steps between held-out evals (acceptance, tau); 0 = off")
    eval_batches: PositiveInt = Field(2, description="held-out batches of micro_batch_size blocks per eval")
    output_dir: NonEmptyStr = "runs/medusa"
    # ZeRO-Offload: optimizer state (+ its step) on the CPU needs ZeRO 1-3; parameters on the
    # CPU need ZeRO-3. Trades GPU memory for PCIe traffic (see training/ds_config.py).
    offload_optimizer: Literal["none", "cpu"] = Field("none", description="ZeRO 1-3: keep optimizer state on the CPU")
    offload_params: Literal["none", "cpu"] = Field("none", description="ZeRO-3: keep partitioned parameters on the CPU")
    skip_repeated_ngram: NonNegativeInt = Field(
        0, description="0 = off; n >= 2: a loss token that ends an n-gram seen earlier in its block carries no "
                       "loss (serving's n-gram lookup drafts those; training/steps.py)")


class WandbConfig(Section):
    project: NonEmptyStr = "specheads"
    entity: OptionalStr = None
    run_name: OptionalStr = None


class CalibrateConfig(Section):
    num_nodes: PositiveInt = Field(16, description="draft-tree node budget")
    max_rank: PositiveInt = Field(4, description="top-k candidates measured per head")
    eval_batches: PositiveInt = Field(8, description="held-out batches of train.micro_batch_size blocks")


class LoraConfig(Section):
    """Medusa-2 joint training: a PEFT LoRA adapter on the target trains with the heads under
    heads loss + lm_loss_weight * the target's LM loss (training/lora.py says why CE)."""

    rank: PositiveInt = Field(16, description="LoRA rank r")
    alpha: PositiveNumber = Field(32.0, description="LoRA scaling numerator (scale = alpha / rank)")
    dropout: FractionOrZero = 0.05
    target_modules: ModuleNames = Field(["q_proj", "k_proj", "v_proj", "o_proj"],
                                        description="module names that get an adapter, or 'all-linear'")
    lm_loss_weight: NonNegativeNumber = Field(0.2, description="weight of the target's own next-token CE")
    heads_warmup_steps: NonNegativeInt = Field(0, description="first steps train the heads only (adapter frozen)")


class Recipe(Section):
    """A training recipe: one section per part (training/config.py loads it from YAML)."""

    target: TargetConfig
    heads: HeadsSpec = Field(default_factory=HeadsSpec)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    tracking: Literal["wandb", "none"] = "none"
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    calibrate: CalibrateConfig = Field(default_factory=CalibrateConfig)
    lora: LoraConfig | None = Field(None, description="Medusa-2 joint training of a LoRA adapter on the target; "
                                                         "absent or null = the target stays frozen")

    @model_validator(mode="before")
    @classmethod
    def _empty_sections_take_defaults(cls, raw: Any) -> Any:
        """`train:` with nothing under it is train's defaults (`lora: null` stays null: off)."""
        if not isinstance(raw, dict):
            return raw
        plain = {name for name, field in cls.model_fields.items() if field.annotation is section_type(cls, name)}
        return {key: {} if value is None and key in plain else value for key, value in raw.items()}

    @model_validator(mode="after")
    def _combinations(self) -> Recipe:
        check_combinations(self)
        return self


def check_combinations(recipe: Recipe) -> None:
    """Values that are fine alone but not together; the message names both keys."""
    train = recipe.train
    if train.skip_repeated_ngram == 1:
        raise RecipeError("train.skip_repeated_ngram: 1 would drop every token seen before; use 0 (off) or an "
                          "n-gram length >= 2 (6 in the EAGLE-3 recipes)")
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
        from specheads.heads.target.adapter import resolve_dtype  # the one dtype table; lazily: no torch here

        if resolve_dtype(recipe.target.dtype) != resolve_dtype(train.precision):
            wanted = str(resolve_dtype(train.precision)).removeprefix("torch.")
            raise RecipeError(f"target.dtype: with lora the target trains inside the DeepSpeed engine, which "
                              f"runs it in train.precision {train.precision!r}; set target.dtype: {wanted} "
                              f"(got {recipe.target.dtype!r}) or change train.precision")


def section_type(cls: type[Section], name: str) -> type[Section] | None:
    """The section model that field `name` of `cls` holds (also an optional `X | None` one), or
    None for a value (or no such field)."""
    field = cls.model_fields.get(name)
    annotation = field.annotation if field is not None else None
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, Section):
            return candidate
    return None


def expected(field: FieldInfo) -> str:
    """What a value field takes, in an error message's words."""
    marks = [mark for mark in field.metadata if isinstance(mark, Expected)]
    if marks:
        return marks[-1].text
    if field.annotation is bool:
        return "true or false"
    if typing.get_origin(field.annotation) is Literal:
        return f"one of {list(typing.get_args(field.annotation))}"
    raise TypeError(f"a recipe field of type {field.annotation} needs an Expected(...) in its type")


def unknown_key(dotted: str, known: list[str]) -> RecipeError:
    close = difflib.get_close_matches(dotted.rsplit(".", 1)[-1], known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    where = dotted.rsplit(".", 1)[0] + " " if "." in dotted else ""
    return RecipeError(f"{dotted}: unknown key; {hint}known keys in {where or 'a recipe '}are {known}")


def validated(cls: type[Section], raw: Any, prefix: tuple[str, ...] = ()):
    """`raw` validated as `cls` (which sits at the dotted `prefix` of a recipe); a RecipeError if not."""
    try:
        return cls.model_validate(raw)
    except ValidationError as err:
        raise as_recipe_error(err, cls, raw, prefix) from None


def as_recipe_error(err: ValidationError, cls: type[Section], raw: Any, prefix: tuple[str, ...] = ()) -> RecipeError:
    """Pydantic's first error (an unknown key first) as one line: the dotted key, what it got,
    what it expects. A cross-field rule's RecipeError comes back as it was raised."""
    errors = err.errors(include_url=False)
    first = next((error for error in errors if error["type"] == "extra_forbidden"), errors[0])
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, RecipeError):
        return cause
    names = list(prefix)
    for depth, part in enumerate(first["loc"]):
        dotted = ".".join([*names, str(part)])
        if part not in cls.model_fields:
            if first["type"] == "extra_forbidden":
                return unknown_key(dotted, sorted(cls.model_fields))
            return RecipeError(f"{dotted}: {first['msg']}")
        names.append(part)
        section = section_type(cls, part)
        if section is None:
            field = cls.model_fields[part]
            if first["type"] == "missing":
                return RecipeError(f"{dotted}: required, expected {expected(field)}"
                                   + (f" ({field.description})" if field.description else ""))
            # An error inside the value (a list item, a union's member) reports the whole value.
            got = first["input"] if depth == len(first["loc"]) - 1 else _raw_at(raw, names[len(prefix):])
            return RecipeError(f"{dotted}: expected {expected(field)}, got {got!r}")
        cls = section
    dotted = ".".join(names) or "recipe"
    if first["type"] == "missing":
        return RecipeError(f"{dotted}: required section is missing")
    return RecipeError(f"{dotted}: expected a mapping of keys to values, got {first['input']!r}")


def _raw_at(raw: Any, keys: list[str]) -> Any:
    for key in keys:
        raw = raw.get(key) if isinstance(raw, dict) else getattr(raw, key, None)
    return raw
