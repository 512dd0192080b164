"""`specheads export`: heads directories to the layouts other engines load, and back.

    export_heads(HEADS_DIR, "eagle3" | "medusa" | "vllm-medusa", OUT)
    import_heads(FOREIGN_DIR, OUT, target=None)

Formats (key names and config fields in heads/artefacts/export_medusa.py and heads/artefacts/export_eagle3.py):

| format      | heads kind | for                    | config.json marker                         | weights file(s)                  |
|-------------|------------|------------------------|--------------------------------------------|----------------------------------|
| eagle3      | eagle3     | vLLM, SGLang           | architectures ["LlamaForCausalLMEagle3"]   | model.safetensors                |
| medusa      | medusa     | Medusa, TGI, TRT-LLM   | medusa_num_heads, medusa_num_layers        | medusa_lm_head.safetensors + .pt |
| vllm-medusa | medusa     | vLLM (method "medusa") | architectures ["MedusaModel"]              | model.safetensors                |
| llama.cpp   | eagle3     | llama.cpp draft-eagle3 | (GGUF: general.architecture "eagle3")      | heads.gguf (+ target.gguf)       |

llama.cpp is the eagle3 layout passed through llama.cpp's own converter; it needs the target's HF
directory and a llama.cpp source, so it has its own entry point, heads/artefacts/export_llama_cpp.py.

Every export also writes a "specheads" block (our full HeadsConfig) into config.json, which
the engines ignore. Import reads it back, so specheads -> foreign -> specheads is exact
(weights bitwise, every config field). Heads trained elsewhere have no such block; then the
target identity (architecture, sizes, layer count, name) comes from `target`: a TargetIdentity,
or a model directory / hub id whose config.json is read (no weights are loaded). With both,
`target` wins and the heads are checked to fit it. Medusa heads tap the target's final
state (tap = number of target layers); EAGLE-3 taps come from the checkpoint (see
export_eagle3.py for the layer-id conventions), and EAGLE-3 heads that do not record a
draft depth get num_heads = IMPORTED_EAGLE_DEPTH (serving's default tree depth). The
EAGLE-1/2 kind "eagle" (one tap, no fc) has no export format.

All writes are atomic: the output directory is built under a temporary name beside OUT and
renamed into place. Every output carries a model card (README.md, heads/artefacts/model_card.py) for its
layout. HEADS_DIR and FOREIGN_DIR may be Hugging Face Hub repo ids (heads_dir.resolve_heads_dir).

LoRA runs (training/lora.py) change the target, so their heads only fit the adapted target.
`export_merged(RUN_DIR, OUT)` (`specheads export RUN_DIR --format merged --output OUT`) loads
the base target named in RUN_DIR/adapter/specheads_lora.json, applies the PEFT adapter,
merges it into the weights (merge_and_unload) and writes OUT/target (save_pretrained, with
the base's tokenizer) and OUT/heads (the run's heads, their target identity now naming
OUT/target). Serve OUT/target with OUT/heads; the output is lossless w.r.t. the merged
target, which is not the original target.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from specheads.heads import atomic
from specheads.heads.artefacts import export_eagle3, export_medusa, model_card
from specheads.heads.artefacts.heads_dir import (CONFIG_NAME, FORMAT_NAME, FORMAT_VERSION, WEIGHTS_NAME, HeadsConfig,
                                                 build_heads, read_heads_config, resolve_heads_dir, write_weights_dir)
from specheads.heads.target.adapter import DTYPES, TargetIdentity

FORMATS = {  # format -> (heads kind, weights file name)
    "eagle3": ("eagle3", WEIGHTS_NAME),
    "medusa": ("medusa", export_medusa.MEDUSA_WEIGHTS_NAME),
    "vllm-medusa": ("medusa", WEIGHTS_NAME),
}
TORCH_TWINS = {"medusa": export_medusa.MEDUSA_TORCH_WEIGHTS_NAME}  # also torch.save'd: Medusa's runtime reads it
_TO_FOREIGN = {"eagle3": export_eagle3.to_eagle3, "medusa": export_medusa.to_medusa,
               "vllm-medusa": export_medusa.to_vllm_medusa}
# What a Hub id given to import_heads fetches: the config and every weights file a layout may use.
IMPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME, export_medusa.MEDUSA_WEIGHTS_NAME, export_medusa.MEDUSA_TORCH_WEIGHTS_NAME,
                "medusa_lm_head.bin", "model.pt", "model.bin", "pytorch_model.bin")
IMPORTED_EAGLE_DEPTH = 4  # num_heads (draft depth) of EAGLE-3 heads that do not record one
EXPECTED_LAYOUTS = (
    "EAGLE-3 (config.json architectures [\"LlamaForCausalLMEagle3\"] + model.safetensors), "
    "Medusa (config.json with medusa_num_heads and medusa_num_layers + medusa_lm_head.safetensors), "
    "vLLM Medusa (config.json architectures [\"MedusaModel\"] + model.safetensors)"
)


def export_heads(heads_dir: str | os.PathLike, fmt: str, out_dir: str | os.PathLike) -> Path:
    """Write the heads in `heads_dir` to `out_dir` in foreign format `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {sorted(FORMATS)}")
    heads_dir = resolve_heads_dir(heads_dir)
    config = read_heads_config(heads_dir)
    kind = FORMATS[fmt][0]
    if config.kind != kind:
        formats = [f for f, (k, _) in FORMATS.items() if k == config.kind]
        raise ValueError(f"format {fmt!r} holds {kind} heads, but {str(heads_dir)!r} holds {config.kind} heads; "
                         + (f"formats for {config.kind} heads: {formats}" if formats
                            else f"{config.kind} heads have no export format"))
    weights = Path(heads_dir) / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"heads directory {str(heads_dir)!r} has no {WEIGHTS_NAME}")
    foreign_config, foreign_state = _TO_FOREIGN[fmt](config.to_dict(), load_file(str(weights)))
    foreign_config.setdefault("specheads", config.to_dict())
    return write_weights_dir(out_dir, foreign_config, foreign_state, FORMATS[fmt][1], TORCH_TWINS.get(fmt),
                             card=config, layout=fmt)


def detect_format(config: dict, source: str = "config.json") -> str:
    """Which foreign layout a config.json describes; a ValueError naming the known ones otherwise."""
    architectures = config.get("architectures") or []
    if config.get("format") == FORMAT_NAME:
        raise ValueError(f"{source} is already a specheads heads directory; nothing to import")
    if any(a in export_eagle3.EAGLE3_ARCHITECTURES for a in architectures):
        return "eagle3"
    if export_medusa.VLLM_MEDUSA_ARCHITECTURE in architectures or config.get("model_type") == "medusa":
        return "vllm-medusa"
    if "medusa_num_heads" in config:
        return "medusa"
    hint = ""
    if "speculators_model_type" in config:
        hint = " (this is a `speculators` config; its layout is not supported)"
    raise ValueError(f"{source} is an unknown heads layout{hint} (architectures={architectures}, "
                     f"keys {sorted(config)[:12]}); expected one of: {EXPECTED_LAYOUTS}")


def import_heads(foreign_dir: str | os.PathLike, out_dir: str | os.PathLike,
                 target: TargetIdentity | str | os.PathLike | None = None) -> Path:
    """Read heads in a foreign layout (auto-detected) into a specheads heads directory."""
    foreign_dir = resolve_heads_dir(foreign_dir, IMPORT_FILES)
    foreign = _read_json(foreign_dir / CONFIG_NAME)
    fmt = detect_format(foreign, str(foreign_dir / CONFIG_NAME))
    state = _read_weights(foreign_dir, FORMATS[fmt][1])
    embedded = foreign.get("specheads")
    identity = resolve_target(target) if target is not None else None
    if identity is None and embedded is None:
        raise ValueError(f"{str(foreign_dir)!r} ({fmt}) does not record its target model; pass the target "
                         "(--target MODEL_DIR_OR_HUB_ID) the heads were trained on")
    if identity is None:
        identity = TargetIdentity(**embedded["target"])
    source = f"{fmt} heads at {str(foreign_dir)!r}"
    if fmt == "eagle3":
        fields, state = export_eagle3.from_eagle3(foreign, state, identity.num_layers, source)
    else:
        convert = export_medusa.from_medusa if fmt == "medusa" else export_medusa.from_vllm_medusa
        fields, state = convert(foreign, state, source)
        fields["tap_layers"] = [identity.num_layers]
    config = _heads_config(FORMATS[fmt][0], fields, identity, embedded, state)
    config.check_fits(identity, source=source)
    _check_loads(config, state, source)
    return write_weights_dir(out_dir, config.to_dict(), state, WEIGHTS_NAME, card=config)


def resolve_target(target: TargetIdentity | str | os.PathLike) -> TargetIdentity:
    """A TargetIdentity from itself, or from a model directory / hub id's config (no weights)."""
    if isinstance(target, TargetIdentity):
        return target
    from transformers import AutoConfig

    from specheads.heads.target.adapter import check_target_exists

    check_target_exists(str(target))
    return TargetIdentity.from_config(AutoConfig.from_pretrained(str(target)), str(target))


def _heads_config(kind: str, fields: dict, identity: TargetIdentity, embedded: dict | None,
                  state: dict[str, torch.Tensor]) -> HeadsConfig:
    """Build a HeadsConfig from the format's fields; extras (tree, calibration) from `embedded`."""
    names = {f.name: f for f in dataclasses.fields(HeadsConfig)}
    values = {name: value for name, value in (embedded or {}).items() if name in names}
    values.update({name: value for name, value in fields.items() if name in names})
    values.update(kind=kind, format=FORMAT_NAME, format_version=FORMAT_VERSION)
    values["target"] = dataclasses.asdict(identity)
    if embedded is None:
        floating = next(t for t in state.values() if t.is_floating_point())
        values["dtype"] = str(floating.dtype).removeprefix("torch.")
    # EAGLE heads from elsewhere: one layer, drafted to the serving default depth.
    values.setdefault("num_heads", IMPORTED_EAGLE_DEPTH)
    values.setdefault("num_layers", 1)
    dropped = sorted(set(fields) - set(names) - set(export_eagle3.OPTIONAL_FIELDS))
    if dropped:
        raise ValueError(f"this specheads HeadsConfig has no fields {dropped} for {kind} heads")
    required = [name for name, f in names.items() if name not in values
                and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        raise ValueError(f"cannot fill HeadsConfig fields {required} for imported {kind} heads")
    return HeadsConfig.from_dict(values, source=f"imported {kind} heads")


def _check_loads(config: HeadsConfig, state: dict[str, torch.Tensor], source: str) -> None:
    """The imported state must load strictly into the module the config builds."""
    expected = {k: tuple(v.shape) for k, v in build_heads(config).state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source} does not convert to a {config.kind} head of its config: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    wrong = {k: (tuple(v.shape), expected[k]) for k, v in state.items() if tuple(v.shape) != expected[k]}
    if wrong:
        raise ValueError(f"{source}: tensors (shape, needed) {wrong} do not fit {config.kind} heads of its config")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{str(path.parent)!r} has no {path.name}; expected heads in one of: "
                                f"{EXPECTED_LAYOUTS}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    return raw


def _read_weights(directory: Path, name: str) -> dict[str, torch.Tensor]:
    """The named safetensors file, or its `.pt`/`.bin` twin loaded with weights_only=True."""
    path = directory / name
    if path.is_file():
        return load_file(str(path))
    for alt in (path.with_suffix(".pt"), path.with_suffix(".bin"), directory / "pytorch_model.bin"):
        if alt.is_file():
            state = torch.load(alt, map_location="cpu", weights_only=True)
            return {k: v for k, v in state.items()}
    raise FileNotFoundError(f"{str(directory)!r} has no {name} (nor a .pt/.bin twin)")


MERGED_TARGET_SUBDIR = "target"
MERGED_HEADS_SUBDIR = "heads"
ADAPTER_SUBDIR = "adapter"  # what training/lora.py writes beside the run's heads
LORA_META = "specheads_lora.json"


def export_merged(run_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """A LoRA run dir (heads/ + adapter/) -> OUT/target (merged model + tokenizer) + OUT/heads."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    adapter_dir, heads_dir = run_dir / ADAPTER_SUBDIR, run_dir / MERGED_HEADS_SUBDIR
    if not (adapter_dir / LORA_META).is_file():
        raise FileNotFoundError(f"{str(run_dir)!r} is not a LoRA training run: no {ADAPTER_SUBDIR}/{LORA_META}; "
                                "--format merged takes a run's train.output_dir from a recipe with a lora section "
                                "(heads of a frozen-target run need no merge: serve them with their target)")
    config = read_heads_config(heads_dir)
    base = json.loads((adapter_dir / LORA_META).read_text())
    trust = bool(base.get("trust_remote_code", False))
    model = AutoModelForCausalLM.from_pretrained(base["resolved_path"], dtype=_torch_dtype(base["dtype"]),
                                                 trust_remote_code=trust)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    try:
        tokenizer = AutoTokenizer.from_pretrained(base["resolved_path"], trust_remote_code=trust)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"the base target {base['resolved_path']!r} has no loadable tokenizer ({err}); "
                                "the merged target must ship one to be served") from None
    with atomic.staged_dir(out_dir) as tmp:
        merged.save_pretrained(tmp / MERGED_TARGET_SUBDIR)
        tokenizer.save_pretrained(tmp / MERGED_TARGET_SUBDIR)
        identity = TargetIdentity.from_config(merged.config, str((out_dir / MERGED_TARGET_SUBDIR).resolve()),
                                              type(merged).__name__)
        config.check_fits(identity, source=f"heads at {str(heads_dir)!r}")
        config.target = identity
        shutil.copytree(heads_dir, tmp / MERGED_HEADS_SUBDIR)  # weights and any extras (tuning.json); new config
        atomic.write_text(tmp / MERGED_HEADS_SUBDIR / CONFIG_NAME, json.dumps(config.to_dict(), indent=2) + "\n")
        model_card.write_card(tmp / MERGED_HEADS_SUBDIR, config, published=out_dir / MERGED_HEADS_SUBDIR)
    return out_dir


def _torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"{LORA_META}: dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]
