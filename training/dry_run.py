"""`specheads train RECIPE --dry-run`: check a recipe against its target without a GPU.

Builds the frozen target and the heads from the target's config.json on the meta device
(shapes only: no weights are read, nothing is downloaded, no process group is started),
then prints the parameter counts, a per-GPU memory estimate and the DeepSpeed JSON the
real run would use, and returns 0.

The target's config comes from, in order: the embedded targets' (`embedded:tiny`: its
cached build, else its spec; `embedded:smollm2`: its cached conversion, else the shipped
config), a GGUF file's metadata (a `.gguf` target or a directory holding exactly one), a
local directory with config.json, a local .json file, a hub id's config.json through
huggingface_hub (the local HF cache first; online, that one small file is downloaded into
it; never the weights), or, when the hub cannot give it (offline: HF_HUB_OFFLINE, no
network; a gated repo without a token), the config shipped for a known hub id in
`recipes/configs/<name>.json` (`<name>` is the hub id's last part, lower-cased:
meta-llama/Llama-3.1-8B-Instruct -> llama-3.1-8b-instruct.json), which the output names
along with why the hub could not be used. Any other hub id is an error saying why, in one line.

World size for the estimate: `--world-size N`, else WORLD_SIZE from the environment, else
the `--num_gpus G [--num_nodes M]` of the recipe's launch line (its first comment, G x M),
else 8 for a hub or local target and 1 for an embedded one.

Memory per GPU, in bytes (N ranks, ZeRO stage z; P_t target and P_h head parameters):

    target weights  P_t * d_t / (N if z == 3 else 1)     d_t: bytes of target.dtype
    head weights    P_h * w   / (N if z == 3 else 1)     w: 2 for bf16/fp16 training, 4 for fp32
    gradients       P_h * w   / (N if z >= 2 else 1)
    optimizer       P_h * (m + 8) / (N if z >= 1 else 1) m: 4 (fp32 master copy) for bf16/fp16,
                                                         0 for fp32; 8 = Adam's two fp32 moments
    activations     B * T * (L + 1) * H * d_t            target hidden states (output_hidden_states,
                  + B * T * V * d_t                      no grad) and its logits
                  + J * B * T * (16 * H + 2 * V_h) * w   heads: J steps (Medusa heads, EAGLE
                                                         ttt_steps), ~16 hidden-wide tensors and
                                                         logits + their gradient per step

B micro batch, T seq_len, L layers, H hidden, V vocab, V_h the head's output vocab (the draft
vocab for EAGLE-3). The activation term is rough (attention scores, allocator slack, CUDA
context and DeepSpeed buffers are not counted); treat the total as a lower bound.

LoRA (recipe section `lora`): the adapter is injected into the meta target with PEFT, so its
parameter count is exact; its P_a parameters add to P_h in the head weight, gradient and
optimizer terms, and the target's activations are kept for backward, roughly
B * T * L * 34 * H * d_t / 2 more (the per-layer 34 * s * b * h bytes of 16-bit training
with fused attention). ZeRO-Offload (train.offload_optimizer / train.offload_params = cpu)
moves the optimizer term / the partitioned weight terms to host memory: they count 0 on the
GPU and are printed as host memory.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from specheads.heads.target.gguf import GGUFError, find_gguf_file, read_gguf_config, smollm2_target_dir
from specheads.heads.target.adapter import resolve_dtype
from specheads.training.config import Recipe, RecipeError
from specheads.training.ds_config import build_ds_config
from specheads.training.head_kinds import head_kind

DEFAULT_GPU_WORLD_SIZE = 8
GIB = 1024 ** 3
LAUNCH_GPUS = re.compile(r"--num_gpus[ =](\d+)")
LAUNCH_NODES = re.compile(r"--num_nodes[ =](\d+)")


def shipped_config_path(hub_id: str) -> Path:
    """The config.json shipped for a hub id: recipes/configs/<last part, lower-cased>.json."""
    return _configs_dir() / f"{hub_id.rsplit('/', 1)[-1].lower()}.json"


def _configs_dir() -> Path:
    import specheads.recipes

    return Path(specheads.recipes.__file__).resolve().parent / "configs"


def load_target_config(name_or_path: str, trust_remote_code: bool = False):
    """-> (transformers config, where it came from). Never downloads weights."""
    from transformers import AutoConfig

    if name_or_path.startswith("embedded:"):
        return _embedded_config(name_or_path)
    gguf_file = find_gguf_file(name_or_path)
    if gguf_file is not None:  # its metadata only: nothing is dequantized or converted
        return read_gguf_config(gguf_file), str(gguf_file)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target directory {str(path)!r} has no config.json")
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code), str(path / "config.json")
    if path.is_file() and path.suffix == ".json":
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code), str(path)
    hub_config, why_not = hub_config_file(name_or_path)
    if hub_config is not None:
        return (AutoConfig.from_pretrained(str(hub_config.parent), trust_remote_code=trust_remote_code),
                f"{hub_config} (the hub's {name_or_path})")
    shipped = shipped_config_path(name_or_path)
    if shipped.is_file():
        return (AutoConfig.from_pretrained(str(shipped), trust_remote_code=trust_remote_code),
                f"{shipped} (the copy shipped with specheads: {why_not})")
    known = sorted(p.stem for p in _configs_dir().glob("*.json"))
    raise FileNotFoundError(f"target {name_or_path!r}: no local directory of that name, and its config.json {why_not}; "
                            f"no shipped config {shipped.name} either (shipped: {', '.join(known)}). Pass a local "
                            "model directory, or run the dry run once where the hub is reachable.")


def hub_config_file(repo_id: str) -> tuple[Path | None, str]:
    """(the hub model's config.json in the local HF cache, fetched into it when online; or
    None and why not, as words that follow "its config.json")."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HFValidationError, HfHubHTTPError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError)

    try:
        return Path(hf_hub_download(repo_id, "config.json")), ""
    except HFValidationError:
        return None, "cannot come from the hub: it is not a hub id (org/name)"
    except LocalEntryNotFoundError:  # before EntryNotFoundError: it is one
        if constants.HF_HUB_OFFLINE:
            return None, "is not in the local HF cache and the hub is off (HF_HUB_OFFLINE is set)"
        return None, "is not in the local HF cache and the hub could not be reached (no network?)"
    except GatedRepoError:
        return None, "is gated on the hub: log in (`hf auth login`) with an account that has access"
    except RepositoryNotFoundError:
        return None, "cannot come from the hub: no such model there (or it is private: log in)"
    except EntryNotFoundError:
        return None, "is not in the hub repo"
    except HfHubHTTPError as err:
        return None, f"could not be fetched from the hub ({str(err).splitlines()[0]})"


def _embedded_config(name: str):
    from transformers import AutoConfig, LlamaConfig

    from specheads.data.tiny_target import (DEFAULT_SPEC, DEFAULT_TARGET_NAME, EMBEDDED_TARGETS, SMOLLM2_TARGET_NAME,
                                            default_cache_dir, target_dir)

    if name == SMOLLM2_TARGET_NAME:  # its conversion when cached, else the config shipped for it
        converted = smollm2_target_dir(default_cache_dir()) / "config.json"
        source = converted if converted.is_file() else shipped_config_path("HuggingFaceTB/SmolLM2-135M-Instruct")
        return AutoConfig.from_pretrained(str(source)), str(source)
    if name != DEFAULT_TARGET_NAME:
        raise FileNotFoundError(f"unknown embedded target {name!r}; expected one of {list(EMBEDDED_TARGETS)}")
    built = target_dir() / "config.json"
    if built.is_file():
        return AutoConfig.from_pretrained(str(built.parent)), str(built)
    spec = DEFAULT_SPEC  # not built yet: its spec (the vocab is the tokenizer's target size)
    config = LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                         intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                         num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
                         max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    return config, "the embedded target's spec (not built yet)"


def launch_world_size(recipe_path: str | os.PathLike) -> int | None:
    """G x M from the recipe's first line `# deepspeed ... --num_gpus G [--num_nodes M] ...`."""
    with open(recipe_path) as f:
        first = f.readline()
    gpus = LAUNCH_GPUS.search(first)
    if not first.startswith("#") or "deepspeed" not in first or gpus is None:
        return None
    nodes = LAUNCH_NODES.search(first)
    return int(gpus.group(1)) * (int(nodes.group(1)) if nodes else 1)


def resolve_world_size(recipe: Recipe, recipe_path: str | os.PathLike, world_size: int | None) -> tuple[int, str]:
    if world_size is not None:
        return world_size, "--world-size"
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"]), "WORLD_SIZE"
    launched = launch_world_size(recipe_path)
    if launched is not None:
        return launched, "the recipe's launch line"
    if recipe.target.name_or_path.startswith("embedded:"):
        return 1, "default for an embedded target"
    return DEFAULT_GPU_WORLD_SIZE, "default for a GPU recipe"


def build_on_meta(recipe: Recipe, config):
    """-> (target model, heads module, HeadsConfig), all parameters on the meta device."""
    from transformers import AutoModelForCausalLM

    from specheads.heads.artefacts.heads_dir import build_heads
    from specheads.heads.target.adapter import TargetAdapter, freeze
    from specheads.training.trainer import _heads_config, initial_heads

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(recipe.target.dtype),
                                                 trust_remote_code=recipe.target.trust_remote_code)
    target = TargetAdapter(freeze(model), recipe.target.name_or_path)
    heads_config = _heads_config(recipe, target)  # the trainer's own: same taps, sizes, draft vocab
    if recipe.heads.init_from is not None:
        initial_heads(recipe.heads.init_from, heads_config, head_kind(recipe.heads), check_only=True)
    with torch.device("meta"):
        heads = build_heads(heads_config)
    return target, heads, heads_config


@dataclass
class MemoryEstimate:
    """Bytes per GPU (see the module docstring for the formula)."""

    target_weights: float
    head_weights: float
    gradients: float
    optimizer: float
    activations: float
    host: float = 0.0  # offloaded to CPU memory (not in total)

    @property
    def total(self) -> float:
        return self.target_weights + self.head_weights + self.gradients + self.optimizer + self.activations


def estimate_memory(recipe: Recipe, num_target_params: int, num_head_params: int, num_layers: int,
                    hidden_size: int, vocab_size: int, head_vocab_size: int, world_size: int,
                    num_lora_params: int = 0) -> MemoryEstimate:
    """num_head_params counts every trainable parameter (heads + LoRA adapter)."""
    zero, n = recipe.train.zero_stage, world_size
    d_t = resolve_dtype(recipe.target.dtype).itemsize
    w = resolve_dtype(recipe.train.precision).itemsize
    master = 4 if recipe.train.precision != "fp32" else 0
    steps = head_kind(recipe.heads).num_depths  # Medusa heads or EAGLE draft steps, each with its logits
    tokens = recipe.train.micro_batch_size * recipe.data.seq_len
    activations = (tokens * (num_layers + 1) * hidden_size * d_t + tokens * vocab_size * d_t
                   + steps * tokens * (16 * hidden_size + 2 * head_vocab_size) * w)
    if num_lora_params:
        activations += tokens * num_layers * 34 * hidden_size * d_t / 2
    memory = MemoryEstimate(
        target_weights=num_target_params * d_t / (n if zero == 3 else 1),
        head_weights=num_head_params * w / (n if zero == 3 else 1),
        gradients=num_head_params * w / (n if zero >= 2 else 1),
        optimizer=num_head_params * (master + 8) / (n if zero >= 1 else 1),
        activations=activations,
    )
    if recipe.train.offload_optimizer == "cpu":
        memory.host, memory.optimizer = memory.host + memory.optimizer, 0.0
    if recipe.train.offload_params == "cpu":
        memory.host += memory.target_weights + memory.head_weights
        memory.target_weights = memory.head_weights = 0.0
    return memory


def dry_run(recipe: Recipe, recipe_path: str | os.PathLike, world_size: int | None = None,
            out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if world_size is not None and world_size < 1:
        raise RecipeError(f"--world-size: expected a positive int, got {world_size}")
    world, world_source = resolve_world_size(recipe, recipe_path, world_size)
    try:
        config, config_source = load_target_config(recipe.target.name_or_path, recipe.target.trust_remote_code)
    except GGUFError as err:
        raise RecipeError(f"target.name_or_path: {err}") from err
    target, heads, heads_config = build_on_meta(recipe, config)
    num_lora = 0
    if recipe.lora is not None:
        from specheads.training.lora import apply_lora, count_lora_params

        apply_lora(target, recipe.lora)  # on the meta model: exact shapes, no memory
        num_lora = count_lora_params(target.model)
    num_target = sum(p.numel() for n, p in target.model.named_parameters() if "lora_" not in n)
    num_heads = sum(p.numel() for p in heads.parameters() if p.requires_grad)
    head_vocab = heads_config.draft_vocab_size or heads_config.vocab_size
    memory = estimate_memory(recipe, num_target, num_heads + num_lora, target.num_layers, target.hidden_size,
                             target.vocab_size, head_vocab, world, num_lora)

    def say(line: str = "") -> None:
        print(line, file=out)

    say(f"dry run of {recipe_path}: shapes only (meta device), no weights loaded, nothing launched")
    say(f"target  {recipe.target.name_or_path} ({target.identity.architecture}, {target.num_layers} layers, "
        f"hidden {target.hidden_size}, vocab {target.vocab_size}, "
        f"{str(resolve_dtype(recipe.target.dtype)).removeprefix('torch.')})")
    say(f"        config: {config_source}")
    say(f"heads   {_describe_heads(heads_config)}")
    if recipe.heads.init_from is not None:
        say(f"        starting from the trained heads at {recipe.heads.init_from} (heads.init_from)")
    say("parameters")
    say(f"  target (frozen)    {num_target:>16,}")
    say(f"  heads (trainable)  {num_heads:>16,}")
    if recipe.lora is not None:
        say(f"  lora adapter (trainable) {num_lora:>10,}  (rank {recipe.lora.rank}, modules "
            f"{recipe.lora.target_modules}; this mode changes the target's outputs)")
        say(f"  trainable total    {num_heads + num_lora:>16,}")
    say(f"memory per GPU (estimate): world size {world} ({world_source}), ZeRO stage {recipe.train.zero_stage}, "
        f"{recipe.train.precision}, micro batch {recipe.train.micro_batch_size} x seq_len {recipe.data.seq_len}")
    for name in ("target_weights", "head_weights", "gradients", "optimizer", "activations"):
        say(f"  {name.replace('_', ' '):<17}{getattr(memory, name) / GIB:>10.2f} GiB")
    say(f"  {'total':<17}{memory.total / GIB:>10.2f} GiB  (lower bound: no CUDA context or allocator slack)")
    offloaded = ["optimizer state" if recipe.train.offload_optimizer == "cpu" else "",
                 "parameters" if recipe.train.offload_params == "cpu" else ""]
    if any(offloaded):
        say(f"  offloaded to CPU ({' + '.join(o for o in offloaded if o)}): {memory.host / GIB:.2f} GiB of host "
            "memory per rank")
    say("deepspeed config")
    say(json.dumps(build_ds_config(recipe.train, world), indent=2))
    return 0


def _describe_heads(config) -> str:
    if config.kind == "medusa":
        vocab = f"a draft vocab of {config.draft_vocab_size}" if config.draft_vocab_size else "the full vocab"
        return (f"medusa: {config.num_heads} heads x {config.num_layers} residual block(s) over {vocab}, "
                f"reading tap {config.tap_layers}")
    return (f"{config.kind}: {config.num_layers} decoder layer(s), taps {config.tap_layers}, {config.num_heads} "
            f"draft steps, draft vocab {config.draft_vocab_size}, attention {config.num_attention_heads}/"
            f"{config.num_kv_heads} heads, mlp {config.intermediate_size}")
