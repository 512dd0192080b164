"""Recipes: YAML files that map 1:1 onto the frozen pydantic models of
training/recipe_models.py, one per part (target, heads, data, train, tracking, wandb,
calibrate, optional lora). This module loads them: a file, its chosen profile, then `--set`
overrides, and writes the JSON schema editors validate recipes with.

Loading is strict: an unknown key or a bad value raises RecipeError naming the key's
dotted path (`train.micro_batch_size: expected a positive int, got 'x'`). Overrides use
the same dotted paths (`--set train.steps=10`); their values are parsed as YAML scalars.

Editors: recipes/recipe.schema.json is generated from the models (a test keeps it current):

    python -m specheads.training.config --schema > recipes/recipe.schema.json

Each shipped recipe names it in a `# yaml-language-server: $schema=recipe.schema.json`
comment, which the YAML language server (VS Code's YAML extension, yamlls in Neovim, ...)
reads to flag unknown keys and bad values and to complete keys as you type.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from specheads.training.recipe_models import (CalibrateConfig, DataConfig, HeadsSpec, LoraConfig, Recipe,
                                              RecipeError, TargetConfig, TrainConfig, WandbConfig, section_type,
                                              unknown_key, validated)

__all__ = ["CalibrateConfig", "DataConfig", "HeadsSpec", "LoraConfig", "Recipe", "RecipeError", "TargetConfig",
           "TrainConfig", "WandbConfig", "apply_override", "apply_profile", "dotted_keys", "load_recipe",
           "parse_override", "recipe_from_dict", "recipe_schema", "schema_text"]


def recipe_from_dict(raw: dict) -> Recipe:
    """A recipe mapping (a loaded YAML file, or a checkpoint's recorded `Recipe.to_dict()`) -> Recipe."""
    return validated(Recipe, raw)


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
    """Set `dotted` in the raw recipe mapping, checking the path against the models."""
    parts = dotted.split(".")
    cls, node = Recipe, raw
    for depth, name in enumerate(parts):
        here = ".".join(parts[:depth + 1])
        if name not in cls.model_fields:
            raise unknown_key(here, sorted(cls.model_fields))
        section = section_type(cls, name)
        if depth == len(parts) - 1:
            if section is not None:
                raise RecipeError(f"{here}: is a section; override one of its keys, e.g. "
                                  f"{here}.{next(iter(section.model_fields))}=...")
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


def dotted_keys() -> list[str]:
    """Every key a profile or `--set` may name: `tracking`, `train.steps`, ..."""
    keys = []
    for name in Recipe.model_fields:
        section = section_type(Recipe, name)
        keys += [f"{name}.{key}" for key in section.model_fields] if section else [name]
    return keys


def recipe_schema() -> dict:
    """The JSON schema of a recipe file: the models' own, plus `profiles`, whose keys are the
    dotted keys. It uses nothing past draft 7, the newest the YAML language server reads."""
    schema = Recipe.model_json_schema()
    schema["properties"]["profiles"] = {
        "description": "named sets of dotted.key: value overrides, applied before --set; chosen with --profile",
        "type": "object",
        "additionalProperties": {"type": "object", "propertyNames": {"enum": dotted_keys()}},
    }
    return {"$schema": "http://json-schema.org/draft-07/schema#", **schema}


def schema_text() -> str:
    """What recipes/recipe.schema.json holds."""
    return json.dumps(recipe_schema(), indent=2) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--schema"]:
        sys.exit("usage: python -m specheads.training.config --schema > recipes/recipe.schema.json")
    sys.stdout.write(schema_text())
