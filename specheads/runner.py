"""Loading a target (+ tokenizer, + heads) for the CLI: `load_target_and_tokenizer` is the one
place a command's `--target` becomes a loaded target and its tokenizer (generate, serve, bench,
tune, demo), and `load_decoder` builds a ready decoder on it. Embedded names (`embedded:tiny`,
`embedded:smollm2`) and GGUF files are resolved first; heads are checked against the target
before their weights are used.

Where a command runs is decided here too, once for every command: `resolve_device` turns
`--device` ("auto", the default: CUDA when torch sees a GPU, else the CPU) into a device, and
`resolve_cuda_graphs` decides whether verify forwards replay CUDA graphs (on by default on a
CUDA device, off with `--enforce-eager`).

`specheads train` loads its target in training/trainer.py instead: docs/architecture.md lets training/
import heads and data but not this package, and under ZeRO-3 the load runs inside DeepSpeed's
context. It resolves names through the same data/tiny_target.resolve_target."""

from __future__ import annotations

import os
from typing import Sequence

from specheads.errors import UserError

# What every command's --target accepts (resolved by resolve_target_name).
TARGET_HELP = "HF model dir, hub id, .gguf file (or a dir holding one), embedded:tiny or embedded:smollm2"
# What every command's --heads accepts (heads/artefacts/heads_dir.py resolve_heads_dir)
HEADS_HELP = ("a heads directory (config.json + model.safetensors), a Hugging Face Hub repo id (org/name: the Hub "
              "cache first, fetched into it when online) or embedded:smollm2-eagle3 (EAGLE-3 heads for "
              "embedded:smollm2 that ship with specheads)")
# What every command's --dtype accepts: the long names of heads/target/adapter.py's DTYPES, which also
# takes fp32, bf16, fp16 (not imported here: `specheads --help` must not import torch).
DTYPE_HELP = ("auto | float32 | bfloat16 | float16 (auto, the default: bfloat16 on a GPU, on a CPU with native bf16, "
              "and for inference on an AVX2 CPU where the fused CPU forward runs the model (bf16 weights, fp32 sums); "
              "else float32. float32 is the exact mode, token-identical to the target's own greedy decoding; bfloat16 "
              "may part from it after a near-tie of the target's logits)")


def resolve_target_name(name_or_path: str, progress: bool = True) -> str:
    """What `--target` names, as a local directory or a Hub id from_pretrained loads
    (data/tiny_target.resolve_target: embedded names built, GGUF files converted), after
    check_target_name."""
    from specheads.data.tiny_target import resolve_target

    check_target_name(name_or_path)
    return resolve_target(str(name_or_path), progress=progress)


def check_target_name(name_or_path: str) -> None:
    """Fail in one line (FileNotFoundError), before anything builds, converts or loads, for a
    `--target` that cannot be loaded: an unknown embedded name, a local path that is not there,
    a Hub id that is neither in the Hub cache nor on the Hub (heads/artefacts/hub.py; offline, the Hub is
    not asked). A Hub id's config.json is fetched into the cache on the way."""
    from specheads.data.tiny_target import EMBEDDED_TARGETS
    from specheads.heads.artefacts.hub import check_hub_target, is_hub_id

    name = str(name_or_path)
    if name.startswith("embedded:"):
        if name not in EMBEDDED_TARGETS:
            raise FileNotFoundError(f"unknown embedded target {name!r}; expected one of {', '.join(EMBEDDED_TARGETS)}")
        return
    if is_hub_id(name):
        check_hub_target(name)
    elif not os.path.exists(os.path.expanduser(name)):
        raise FileNotFoundError(f"target {name!r} does not exist: expected a local model directory (config.json + "
                                "weights), a .gguf file, embedded:tiny, embedded:smollm2, or a Hub id like "
                                "'meta-llama/Llama-3.1-8B-Instruct'")


def load_target_and_tokenizer(name_or_path: str, *, heads: Sequence[str] = (), dtype: str = "auto",
                              device: str = "cpu", trust_remote_code: bool = False, progress: bool = True):
    """(TargetAdapter, tokenizer) for anything `--target` accepts (TARGET_HELP), ready for
    inference: in `dtype` ("auto": the device's fast dtype) with its linear weights packed
    where that pays (heads/target/cpu_layout.py).

    Each directory in `heads` is checked against the target as soon as the target's config is
    known, before the tokenizer loads, so heads for another model fail with both values named
    rather than on whatever the tokenizer lacks. The adapter's identity records the resolved
    path (a local directory or a hub id)."""
    from transformers import AutoTokenizer

    target = load_inference_target(name_or_path, heads=heads, dtype=dtype, device=device,
                                   trust_remote_code=trust_remote_code, progress=progress)
    return target, AutoTokenizer.from_pretrained(target.identity.name_or_path, trust_remote_code=trust_remote_code)


def load_inference_target(name_or_path: str, *, heads: Sequence[str] = (), dtype: str = "auto", device: str = "cpu",
                          trust_remote_code: bool = False, progress: bool = True):
    """The TargetAdapter of `load_target_and_tokenizer`, without the tokenizer (step costs)."""
    from specheads.heads.artefacts.heads_dir import read_heads_config
    from specheads.heads.target.adapter import TargetAdapter

    path = resolve_target_name(name_or_path, progress=progress)
    target = TargetAdapter.from_pretrained(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                           pack_weights="auto")
    for directory in heads:
        read_heads_config(directory).check_fits(target.identity, source=f"heads at {str(directory)!r}")
    return target


STORE_OFF = "none"  # --store none: no reply store, even where the heads directory records one
STORE_LEARN = "learn"  # --store learn: no built store, drafts from the replies served so far (and the prompt)
DEVICE_HELP = "auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N"
ENFORCE_EAGER_HELP = ("run every forward eagerly, as vLLM's --enforce-eager: no CUDA graphs (by default, on a CUDA "
                      "device, the engine's forwards are captured once per shape and replayed, verifying with the "
                      "tree-attention kernel: serving/decode/graphs.py)")


def resolve_device(device: str = "auto") -> str:
    """The device a command runs on, from its --device: "auto" is "cuda" when
    torch.cuda.is_available(), else "cpu"; an explicit CUDA device must be one torch sees.
    Checked before any model loads."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise UserError(f"--device {device!r} is not a device; use auto, cpu, cuda or cuda:N") from err
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: torch sees no CUDA device (torch {torch.__version__}, CUDA build "
                            f"{torch.version.cuda}); use --device cpu, or auto")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise UserError(f"--device {device}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def resolve_cuda_graphs(device: str, requested: bool | None = None) -> bool:
    """Whether verify forwards replay CUDA graphs on `device` (a resolved one): by default
    (None) on a CUDA device and off elsewhere; False (--enforce-eager) off; True (asked for
    explicitly) on, which needs a CUDA device."""
    on_cuda = device.startswith("cuda")
    if requested is None:
        return on_cuda
    if requested and not on_cuda:
        raise UserError(f"CUDA graphs need a CUDA device (they record GPU work), got --device {device}")
    return requested


def load_decoder(target: str, heads: str | None = None, *, dtype: str = "auto", device: str = "cpu",
                 trust_remote_code: bool = False, progress: bool = True, lookup_num_tokens: int | None = None,
                 cuda_graphs: bool = False, store: str | None = None):
    """(SpeculativeDecoder, tokenizer) for a target and optional heads directory.

    lookup_num_tokens (n-gram lookup drafts, serving/decode/lookup.py): None uses what the heads
    directory records (`specheads tune` stores lookup when it made the tuned tree faster;
    nothing without heads), 0 turns it off, N > 0 drafts up to N tokens.
    store (a reply store's directory, serving/decode/store.py): None uses what the heads
    directory records (`specheads tune` stores it when it made the tree faster), "none" turns
    it off, "learn" drafts from the replies served so far alone (no built store). A store is
    checked against the target and its tokenizer before it is used.
    cuda_graphs: verify through captured CUDA graphs and the tree-attention kernel (a CUDA
    device only; on an H200 a SmolLM2-shaped forward went from 30 ms eager to 3.1 ms)."""
    if cuda_graphs and not str(device).startswith("cuda"):
        raise ValueError(f"cuda_graphs needs a CUDA device (CUDA graphs record GPU work), got device {device!r}")
    from specheads.heads.artefacts.heads_dir import load_heads
    from specheads.serving.decode.config import SpeculativeDecoder, TreeSpec
    from specheads.serving.decode.lookup import LookupConfig

    if lookup_num_tokens is not None and lookup_num_tokens < 0:
        raise ValueError(f"--lookup-num-tokens must be >= 0 (0: off), got {lookup_num_tokens}")
    lookup = LookupConfig(num_tokens=lookup_num_tokens) if lookup_num_tokens else None
    check_store(store)
    adapter, tokenizer = load_target_and_tokenizer(target, heads=[heads] if heads is not None else [], dtype=dtype,
                                                   device=device, trust_remote_code=trust_remote_code,
                                                   progress=progress)
    graphs = dict(cuda_graphs="capture", attn_impl="tree") if cuda_graphs else {}
    if heads is None:
        drafter = store_drafter(store, None, adapter, tokenizer)
        decoder = SpeculativeDecoder(adapter, lookup=lookup, store=drafter, **graphs)
    else:
        head_module, config = load_heads(heads, target=adapter.identity, device=device, dtype=adapter.dtype)
        spec = TreeSpec.from_heads_config(config)
        if lookup_num_tokens is None:
            lookup = spec.lookup
        drafter = store_drafter(store, spec, adapter, tokenizer, heads)
        if spec.plain:
            import sys

            tuned = (config.tree or {}).get("tuned") or {}
            print(f"specheads: decoding plainly: `specheads tune` found no tree of these heads faster than plain "
                  f"decoding on {tuned.get('device', 'its machine')} (tune them again on this machine to re-measure)",
                  file=sys.stderr)
            decoder = SpeculativeDecoder(adapter, lookup=lookup, store=drafter, **graphs)
        else:
            decoder = SpeculativeDecoder(adapter, head_module, spec.tree, tap_layers=config.tap_layers,
                                         entropy_threshold=spec.entropy_threshold, lookup=lookup, store=drafter,
                                         **graphs)
    return decoder, tokenizer


def check_store(store: str | None) -> None:
    """A missing or corrupt reply store fails here, before any target loads (None, STORE_OFF: none)."""
    from specheads.heads.artefacts.reply_store import ReplyStore

    if store is not None and store not in (STORE_OFF, STORE_LEARN):
        ReplyStore(store)


def store_drafter(store: str | None, spec, target, tokenizer, heads: str | None = None):
    """The StoreDrafter (serving/decode/store.py) of `store` (a directory; None: the one the
    heads directory's TreeSpec records, a relative path being relative to the heads directory;
    STORE_OFF: none) for `target` and its tokenizer, with the recorded settings; None for no store."""
    from pathlib import Path

    from specheads.serving.decode.store import StoreConfig, StoreDrafter, open_store

    if store is None and spec is not None and spec.store_path is not None:
        store = spec.store_path if spec.store_path == STORE_LEARN else \
            str(Path(heads).expanduser() / spec.store_path)  # an absolute recorded path stays as it is
    if store is None or store == STORE_OFF:
        return None
    config = spec.store if spec is not None and spec.store is not None else StoreConfig()
    if store == STORE_LEARN:
        if not config.learn_tokens:
            raise ValueError("--store learn drafts from the replies it learns, but the recorded store settings have "
                             "learn_tokens 0: give a store directory, or tune again with --store learn")
        return StoreDrafter(None, config)
    return StoreDrafter(open_store(store, target.identity, tokenizer), config)

