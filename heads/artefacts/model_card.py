"""Model cards: the README.md that every heads directory and every export carries, so heads can
be shared on the Hugging Face Hub (`hf upload ORG/NAME DIR`) and read by the people who load them.

    write_card(directory, config, layout)   DIR/README.md, atomically (heads/atomic.py)
    card_text(config, directory, layout)    the same text
    serve_commands(config, directory, layout) -> {runtime: shell command}

`layout` is what the directory holds: "specheads" (a heads directory), or an export format of
heads/artefacts/export.py ("eagle3", "medusa", "vllm-medusa", "llama.cpp"). The card is the Hub's YAML
metadata header (library_name, base_model when the target is a Hub id, license, tags, datasets
when the training data is a Hub dataset) and a body: the target, the head kind and its sizes
and taps, the training data and tokens (HeadsConfig.training), held-out accuracy by draft depth
(HeadsConfig.calibration), the stored tree, and one serve command per runtime that loads this
layout. The license is the target's own when its model card is on disk (a local target
directory, or the Hub cache: nothing is downloaded), since the heads are trained on its
outputs; otherwise "other", and the body says to set it.

The runtimes' flags were checked against their own code:
  - vLLM, commit 002e77c1f0ef: vllm/config/speculative.py SpeculativeConfig (`method` takes
    "eagle3" and "medusa"; `model`; `num_speculative_tokens`), passed as `vllm serve TARGET
    --speculative-config JSON`; model_executor/models/registry.py maps the export's
    architecture LlamaForCausalLMEagle3 to Eagle3LlamaForCausalLM.
  - SGLang, python/sglang/srt/server_args.py at commit 001067fffe33: --speculative-algorithm
    EAGLE3, --speculative-draft-model-path (a directory or a Hub id), --speculative-num-steps,
    --speculative-eagle-topk, --speculative-num-draft-tokens, which counts the root and is set
    to num-steps + 1 when topk is 1. SGLang loads one-layer EAGLE-3 drafts only.
  - llama.cpp as vendored in llama-cpp-python 0.3.36 (the one heads/artefacts/export_llama_cpp.py
    converts with): common/arg.cpp -md, --spec-type draft-eagle3, --spec-draft-n-max,
    --spec-draft-p-min; the flags come from llama_cpp_serve.draft_args.
  - Medusa layouts: the loaders named in heads/artefacts/export_medusa.py (TGI's get_model reads
    medusa_num_heads and base_model_name_or_path; TensorRT-LLM's
    examples/medusa/convert_checkpoint.py takes --medusa_model_dir and --num_medusa_heads;
    Medusa's own runtime `python -m medusa.inference.cli --model DIR`; vLLM method "medusa").

The SGLang tree flags come from the stored tree: a dynamic (EAGLE-2) tree maps onto them one
to one (depth, top_k, num_nodes + 1); a static tree gives its depth, its widest rank and its
node count (capped at what SGLang's top-k expansion can produce).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from specheads.heads import atomic
from specheads.heads.target.adapter import _looks_like_hub_id

CARD_NAME = "README.md"
LAYOUTS = ("specheads", "eagle3", "medusa", "vllm-medusa", "llama.cpp")
KIND_NAMES = {"medusa": "Medusa", "eagle3": "EAGLE-3", "eagle": "EAGLE-1/2"}
TARGET_PLACEHOLDER = "TARGET_HF_DIR"  # for engines that cannot take the recorded target name
# The licenses of the targets specheads ships recipes for (their Hub model cards' `license`), used
# when the target's own card is not on disk; keys in lower case
KNOWN_LICENSES = {"meta-llama/llama-3.1-8b-instruct": "llama3.1", "meta-llama/llama-3.3-70b-instruct": "llama3.3",
                  "qwen/qwen3-8b": "apache-2.0", "huggingfacetb/smollm2-135m-instruct": "apache-2.0",
                  "embedded:smollm2": "apache-2.0"}


def write_card(directory: str | os.PathLike, config, layout: str = "specheads",
               published: str | os.PathLike | None = None) -> Path:
    """Write DIR/README.md for `config` (a HeadsConfig) in `layout`, atomically, after the
    directory's other files. `published`: the path the commands name when DIR is a staging
    directory (default DIR). A llama.cpp card serves DIR's target.gguf when DIR has one."""
    from specheads.heads.artefacts.llama_cpp_serve import TARGET_NAME

    path = Path(directory) / CARD_NAME
    target_gguf = (Path(directory) / TARGET_NAME).is_file()
    atomic.write_text(path, card_text(config, published if published is not None else directory, layout,
                                      target_gguf=target_gguf))
    return path


def card_text(config, directory: str | os.PathLike, layout: str = "specheads", target_gguf: bool = True) -> str:
    """The card of `config` (a HeadsConfig) for a directory at `directory` holding `layout`;
    target_gguf: a llama.cpp export that holds target.gguf too."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown model card layout {layout!r}; expected one of {list(LAYOUTS)}")
    sections = [_title(config, layout), _summary(config, layout), _acceptance(config),
                _serving(serve_commands(config, directory, layout, target_gguf), config, str(directory)),
                _license_note(config)]
    return _header(config, layout) + "\n" + "\n\n".join(s for s in sections if s) + "\n"


# ---------------------------------------------------------------------------- metadata header

def _header(config, layout: str) -> str:
    from huggingface_hub import ModelCardData

    target = config.target.name_or_path
    license_fields = target_license(target) or _license_link(target)
    tags = ["specheads", "speculative-decoding", config.kind] + (["gguf"] if layout == "llama.cpp" else [])
    data = (config.training or {}).get("data")
    metadata = ModelCardData(library_name="specheads", base_model=target if _is_hub_id(target) else None,
                             tags=tags, datasets=[data] if data and _is_hub_id(data) else None, **license_fields)
    return f"---\n{metadata.to_yaml()}\n---\n"


def _is_hub_id(name: str) -> bool:
    return bool(name) and _looks_like_hub_id(name) and not Path(name).expanduser().exists()


def _license_link(target: str) -> dict:
    """The header's license when the target's is not known: a Hub target's card is where it is
    (the Hub's `other` needs a name and a link); anything else gets no license field (the body
    says to set one) rather than an `other` that names nothing."""
    if not _is_hub_id(target):
        return {}
    return {"license": "other", "license_name": f"{target.split('/')[1].lower()}-license",
            "license_link": f"https://huggingface.co/{target}"}


def target_license(name_or_path: str) -> dict | None:
    """{"license": ..., and license_name / license_link when given} from the target's own model
    card: a local directory's README.md, or a Hub id's README.md in the local Hub cache (never
    downloaded); else the license of a target specheads ships a recipe for (KNOWN_LICENSES).
    None when none of these names one."""
    import yaml
    from huggingface_hub import metadata_load, try_to_load_from_cache

    readme = Path(name_or_path).expanduser() / CARD_NAME
    if not readme.is_file() and _is_hub_id(name_or_path):
        cached = try_to_load_from_cache(name_or_path, CARD_NAME)
        readme = Path(cached) if isinstance(cached, str) else readme
    if not readme.is_file():
        known = KNOWN_LICENSES.get(str(name_or_path).lower())
        return {"license": known} if known else None
    try:
        metadata = metadata_load(readme) or {}
    except (ValueError, OSError, yaml.YAMLError):  # a README without a parsable YAML header
        return None
    fields = {key: metadata[key] for key in ("license", "license_name", "license_link") if metadata.get(key)}
    return fields if isinstance(fields.get("license"), str) else None


# ---------------------------------------------------------------------------- body

def _title(config, layout: str) -> str:
    kind = KIND_NAMES.get(config.kind, config.kind)
    what = {"specheads": "heads", "eagle3": "heads (EAGLE-3 layout for vLLM and SGLang)",
            "medusa": "heads (Medusa layout for TGI, TensorRT-LLM and Medusa)",
            "vllm-medusa": "heads (vLLM's Medusa layout)", "llama.cpp": "heads (GGUF draft for llama.cpp)"}[layout]
    return (f"# {kind} {what} for `{config.target.name_or_path}`\n\n"
            f"Speculative-decoding heads trained with specheads on the frozen target "
            f"`{config.target.name_or_path}`. The heads draft tokens and the target verifies them, so the output "
            "is the target's own: greedy decoding token for token, sampling with the target's distribution.")


def _summary(config, layout: str) -> str:
    target = config.target
    rows = [("target", f"`{target.name_or_path}` ({target.architecture}, {target.num_layers} layers, hidden "
                       f"{target.hidden_size}, vocab {target.vocab_size})"),
            ("heads", _kind_line(config)),
            ("training data", _training_line(config.training)),
            ("held-out data", _held_out_line(config.calibration)),
            ("dtype", config.dtype),
            ("this directory", _layout_line(layout))]
    return "## Summary\n\n| | |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)


def _kind_line(config) -> str:
    if config.kind == "medusa":
        vocab = f"; draft vocab {config.draft_vocab_size} of {config.vocab_size}" if config.draft_vocab_size else ""
        return (f"Medusa: {config.num_heads} heads (draft depths 1-{config.num_heads}), {config.num_layers} "
                f"residual block(s) each, reading the target's final hidden state (tap {config.tap_layers[0]}){vocab}")
    taps = ", ".join(str(t) for t in config.tap_layers)
    return (f"{KIND_NAMES.get(config.kind, config.kind)}: {config.num_layers} decoder layer(s) (heads "
            f"{config.num_attention_heads}, kv heads {config.num_kv_heads}, MLP {config.intermediate_size}) fusing "
            f"target tap layer(s) {taps} (tap i = the input of target layer i); draft vocab "
            f"{config.draft_vocab_size} of {config.vocab_size}; trained for {config.num_heads} draft depths")


def _training_line(training: dict | None) -> str:
    if not training:
        return "not recorded (heads written before specheads recorded it, or imported)"
    parts = [f"`{training.get('data')}`" + (f" (split `{training['split']}`)" if training.get("split") else "")]
    if training.get("data_tokens") is not None:
        parts.append(f"{training['data_tokens']:,} tokens with loss")
    if training.get("steps") is not None and training.get("tokens_per_step") is not None:
        parts.append(f"{training['steps']:,} steps x {training['tokens_per_step']:,} tokens = "
                     f"{training['steps'] * training['tokens_per_step']:,} tokens processed")
    if training.get("lora"):
        parts.append("with a LoRA adapter on the target (serve the merged target: `specheads export RUN "
                     "--format merged`)")
    return "; ".join(parts)


def _held_out_line(calibration: dict | None) -> str:
    if not calibration:
        return "not calibrated"
    positions = calibration.get("num_positions") or []
    scored = f"{positions[0]:,} positions scored at depth 1" if positions else ""
    source = f"`{calibration['source']}`" if calibration.get("source") else ""
    return ", ".join(part for part in (source, scored) if part) or "not recorded"


def _layout_line(layout: str) -> str:
    return {"specheads": "a specheads heads directory (config.json + model.safetensors)",
            "eagle3": "an EAGLE-3 checkpoint (config.json + model.safetensors) as vLLM and SGLang load it",
            "medusa": "a Medusa checkpoint (config.json + medusa_lm_head.safetensors/.pt)",
            "vllm-medusa": "a vLLM MedusaModel checkpoint (config.json + model.safetensors)",
            "llama.cpp": "GGUF files for llama-server: heads.gguf (the draft), target.gguf when exported"}[layout]


def _acceptance(config) -> str:
    calibration = config.calibration or {}
    # accuracy[depth][rank]: each position hits at most one rank, so a row's sum is its top-R accuracy
    rows = calibration.get("accuracy") or [[top1] for top1 in calibration.get("top1") or []]
    lines = ["## Held-out acceptance by depth", ""]
    if not rows:
        lines.append("Not measured: these heads carry no calibration.")
    else:
        max_rank = max(len(row) for row in rows)
        positions = calibration.get("num_positions") or []
        columns = ["depth", "top-1"] + ([f"top-{max_rank}"] if max_rank > 1 else []) + \
            (["positions"] if positions else [])
        lines += ["Teacher-forced on held-out text: at depth d the head's top candidates are compared with the "
                  "target's own greedy token d steps ahead.", "",
                  "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for depth, row in enumerate(rows, start=1):
            cells = [str(depth), f"{row[0]:.3f}"] + ([f"{sum(row):.3f}"] if max_rank > 1 else [])
            if positions:
                cells.append(f"{positions[depth - 1]:,}" if depth - 1 < len(positions) else "")
            lines.append("| " + " | ".join(cells) + " |")
    tree = config.tree or {}
    if tree.get("paths") or tree.get("dynamic"):
        lines += ["", _tree_line(tree)]
    return "\n".join(lines)


def _tree_line(tree: dict) -> str:
    if tree.get("dynamic"):
        shape = tree["dynamic"]
        text = (f"Stored tree: dynamic (EAGLE-2), depth {shape['depth']}, top-{shape['top_k']}, "
                f"{shape['num_nodes']} nodes.")
    else:
        depth, top_k, nodes = _static_shape(tree["paths"])
        text = f"Stored tree: static, {nodes} nodes, depth {depth}, widest rank {top_k}"
        if tree.get("expected_accepted_draft_tokens") is not None:
            text += f"; expected accepted draft tokens per step {tree['expected_accepted_draft_tokens']:.3f}"
        text += "."
    tuned = tree.get("tuned")
    if tuned:
        text += (f" Tuned by `specheads tune` on {tuned.get('device')} ({tuned.get('torch_threads')} threads): "
                 f"{tuned.get('tokens_per_s', 0):.1f} tok/s, {tuned.get('speedup_vs_plain', 0):.2f}x plain decoding.")
    return text


# ---------------------------------------------------------------------------- serving

def _serving(commands: dict[str, str], config, directory: str) -> str:
    lines = ["## Serving", "",
             f"Commands name this directory as `{directory}`; once it is on the Hub, its repo id works in its place "
             "(specheads, vLLM and SGLang resolve Hub ids)."]
    if _engine_target(config) == TARGET_PLACEHOLDER:
        lines.append(f"The target `{config.target.name_or_path}` is a specheads name: vLLM, SGLang and llama.cpp "
                     f"need a Hugging Face model directory in place of {TARGET_PLACEHOLDER}.")
    for runtime, command in commands.items():
        lines += ["", f"**{runtime}**", "", "```bash", command, "```"]
    return "\n".join(lines)


def serve_commands(config, directory: str | os.PathLike, layout: str = "specheads",
                   target_gguf: bool = True) -> dict[str, str]:
    """One shell command (or two, on two lines) per runtime that serves these heads from a
    directory in `layout`; a runtime that cannot load them gets a comment saying why."""
    directory = str(directory)
    if layout == "llama.cpp":
        return {"llama.cpp": _llama_server(directory, with_target=target_gguf)}
    if config.kind == "medusa":
        return _medusa_commands(config, directory, layout)
    return _eagle_commands(config, directory, layout)


def _q(value) -> str:
    return shlex.quote(str(value))


def _specheads_serve(config, heads: str) -> str:
    return f"specheads serve --target {_q(config.target.name_or_path)} --heads {_q(heads)}"


def _specheads_export(source: str, fmt: str, out: str) -> str:
    return f"specheads export {_q(source)} --format {fmt} --output {_q(out)}"


def _specheads_import(source: str, out: str) -> str:
    return f"specheads export --import {_q(source)} --output {_q(out)}"


def _engine_target(config) -> str:
    name = config.target.name_or_path
    return TARGET_PLACEHOLDER if name.startswith("embedded:") or name.endswith(".gguf") or not name else name


def _target_model_dir(config) -> str:
    """llama.cpp's converter reads the target from a local directory: a Hub id's snapshot path,
    as `hf download` prints it."""
    target = _engine_target(config)
    return f'"$(hf download {_q(target)})"' if _is_hub_id(target) else _q(target)


def _vllm(config, model: str, method: str, num_tokens: int) -> str:
    spec = json.dumps({"method": method, "model": model, "num_speculative_tokens": num_tokens})
    return f"vllm serve {_q(_engine_target(config))} --speculative-config {_q(spec)}"


def _sglang(config, model: str) -> str:
    steps, top_k, draft_tokens = sglang_tree(config)
    return (f"python -m sglang.launch_server --model-path {_q(_engine_target(config))} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {_q(model)} --speculative-num-steps {steps} "
            f"--speculative-eagle-topk {top_k} --speculative-num-draft-tokens {draft_tokens}")


def _llama_server(gguf_dir: str, with_target: bool = True) -> str:
    from specheads.heads.artefacts.llama_cpp_serve import (DRAFT_NAME, SERVE_DRAFT_MAX, SERVE_DRAFT_P_MIN, TARGET_NAME,
                                                           draft_args)

    target = f"{gguf_dir}/{TARGET_NAME}" if with_target else "TARGET.gguf"
    draft = " ".join(_q(arg) for arg in draft_args(f"{gguf_dir}/{DRAFT_NAME}", SERVE_DRAFT_MAX, SERVE_DRAFT_P_MIN))
    return f"llama-server -m {_q(target)} {draft}"


def _eagle_commands(config, directory: str, layout: str) -> dict[str, str]:
    commands = {}
    exported = directory if layout == "eagle3" else f"{directory}-eagle3"
    export_step = "" if layout == "eagle3" else _specheads_export(directory, "eagle3", exported) + "\n"
    if layout == "specheads":
        commands["specheads"] = _specheads_serve(config, directory)
    else:
        commands["specheads"] = _specheads_import(directory, f"{directory}-specheads") + "\n" + \
            _specheads_serve(config, f"{directory}-specheads")
    if config.kind != "eagle3":
        commands["vLLM, SGLang, llama.cpp"] = (f"# not available: {KIND_NAMES[config.kind]} heads have no export "
                                               "format (train heads.kind: eagle3 for these runtimes)")
        return commands
    depth = sglang_tree(config)[0]
    commands["vLLM"] = export_step + _vllm(config, exported, "eagle3", depth)
    one_layer = config.num_layers == 1
    commands["SGLang"] = export_step + _sglang(config, exported) if one_layer else (
        f"# not available: SGLang loads one-layer EAGLE-3 drafts, these heads have {config.num_layers} layers")
    if not one_layer or len(config.tap_layers) != 3:
        commands["llama.cpp"] = ("# not available: llama.cpp's EAGLE-3 drafter has one decoder layer and fuses 3 "
                                 f"target layers; these heads have {config.num_layers} layer(s), taps "
                                 f"{config.tap_layers}")
    elif layout == "specheads":
        gguf_dir = f"{directory}-gguf"
        commands["llama.cpp"] = (f"specheads export {_q(directory)} --format llama.cpp --output {_q(gguf_dir)}\n"
                                 + _llama_server(gguf_dir))
    else:
        commands["llama.cpp"] = (f"python convert_hf_to_gguf.py {_q(directory)} --target-model-dir "
                                 f"{_target_model_dir(config)} --outfile heads.gguf --outtype bf16\n"
                                 + _llama_server(".", with_target=False))
    return commands


def _medusa_commands(config, directory: str, layout: str) -> dict[str, str]:
    commands = {}
    if layout == "specheads":
        commands["specheads"] = _specheads_serve(config, directory)
    else:
        imported = f"{directory}-specheads"
        commands["specheads"] = _specheads_import(directory, imported) + "\n" + _specheads_serve(config, imported)
    vllm_dir = directory if layout == "vllm-medusa" else f"{directory}-vllm-medusa"
    vllm_step = "" if layout == "vllm-medusa" else _specheads_export(directory, "vllm-medusa", vllm_dir) + "\n"
    if layout in ("specheads", "vllm-medusa"):
        commands["vLLM"] = vllm_step + _vllm(config, vllm_dir, "medusa", config.num_heads)
    if config.draft_vocab_size and config.draft_vocab_size < config.vocab_size:
        if layout == "specheads":
            commands["TGI, TensorRT-LLM, Medusa"] = ("# not available: these heads predict a draft vocab, which the "
                                                     "Medusa layout cannot hold (vLLM reads it as token_map)")
        return commands
    if layout not in ("specheads", "medusa"):
        return commands
    medusa_dir = directory if layout == "medusa" else f"{directory}-medusa"
    medusa_step = "" if layout == "medusa" else _specheads_export(directory, "medusa", medusa_dir) + "\n"
    target = _engine_target(config)
    commands["TGI"] = medusa_step + f"text-generation-launcher --model-id {_q(medusa_dir)}"
    commands["TensorRT-LLM"] = (medusa_step + f"python examples/medusa/convert_checkpoint.py --model_dir {_q(target)} "
                                f"--medusa_model_dir {_q(medusa_dir)} --num_medusa_heads {config.num_heads} "
                                "--output_dir tllm_checkpoint --dtype float16\n"
                                "trtllm-build --checkpoint_dir tllm_checkpoint --speculative_decoding_mode medusa "
                                "--output_dir tllm_engine")
    commands["Medusa"] = medusa_step + f"python -m medusa.inference.cli --model {_q(medusa_dir)}"
    return commands


def sglang_tree(config) -> tuple[int, int, int]:
    """(--speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens) from the
    stored tree; the depth is also vLLM's num_speculative_tokens (a chain of that length)."""
    tree = config.tree or {}
    if tree.get("dynamic"):
        shape = tree["dynamic"]
        depth, top_k, nodes = shape["depth"], shape["top_k"], shape["num_nodes"]
    elif tree.get("paths"):
        depth, top_k, nodes = _static_shape(tree["paths"])
    else:
        depth, top_k, nodes = config.num_heads, 1, config.num_heads
    if top_k == 1:
        return depth, 1, depth + 1
    reachable = top_k + (depth - 1) * top_k * top_k  # SGLang's candidates: k at depth 1, k*k below
    return depth, top_k, min(nodes, reachable) + 1


def _static_shape(paths: list[list[int]]) -> tuple[int, int, int]:
    """(depth, widest rank + 1, nodes) of a static tree given as rank paths."""
    return max(len(p) for p in paths), max(max(p) for p in paths) + 1, len(paths)


def _license_note(config) -> str:
    found = target_license(config.target.name_or_path)
    if found:
        return (f"## License\n\n`{found['license']}`, the target's: the heads are trained on "
                f"`{config.target.name_or_path}`'s outputs. Check that it fits how you share them.")
    where = (f" The header links the target's page ({_license_link(config.target.name_or_path)['license_link']}) "
             "for it." if _is_hub_id(config.target.name_or_path) else "")
    return ("## License\n\nNot recorded: the target's model card was not on disk when this card was written. The "
            "heads are trained on the target's outputs, so its license applies; set `license` in the header above "
            f"before publishing.{where}")
