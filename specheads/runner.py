"""Loading a target (+ heads) into a ready decoder: shared by `generate`, `demo` and, later,
`serve` and `bench`. Resolves the embedded target name and checks heads fit the target
before any weights are used."""

from __future__ import annotations

# What every command's --target accepts (resolved by resolve_target_name).
TARGET_HELP = "HF model dir, hub id, .gguf file (or a dir holding one), embedded:tiny or embedded:smollm2"


def resolve_target_name(name_or_path: str, progress: bool = True) -> str:
    from specheads.data.tiny_target import resolve_target

    return resolve_target(str(name_or_path), progress=progress)


def load_decoder(target: str, heads: str | None = None, *, dtype: str = "float32", device: str = "cpu",
                 trust_remote_code: bool = False, progress: bool = True, lookup_num_tokens: int | None = None):
    """(SpeculativeDecoder, tokenizer) for a target and optional heads directory.

    lookup_num_tokens (n-gram lookup drafts, serving/decode/lookup.py): None uses what the heads
    directory records (`specheads tune` stores lookup when it made the tuned tree faster;
    nothing without heads), 0 turns it off, N > 0 drafts up to N tokens."""
    from transformers import AutoTokenizer

    from specheads.heads.heads_dir import load_heads
    from specheads.heads.target import TargetAdapter
    from specheads.serving.decode.steps import SpeculativeDecoder
    from specheads.serving.decode.dynamic import tree_from_heads_config
    from specheads.serving.decode.lookup import LookupConfig, lookup_from_tree_field

    if lookup_num_tokens is not None and lookup_num_tokens < 0:
        raise ValueError(f"--lookup must be >= 0 (0: off), got {lookup_num_tokens}")
    lookup = LookupConfig(num_tokens=lookup_num_tokens) if lookup_num_tokens else None
    path = resolve_target_name(target, progress=progress)
    adapter = TargetAdapter.from_pretrained(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    if heads is None:
        decoder = SpeculativeDecoder(adapter, lookup=lookup)
    else:  # checked against the target before anything else is loaded
        head_module, config = load_heads(heads, target=adapter.identity, device=device, dtype=adapter.dtype)
        tree, entropy_threshold = tree_from_heads_config(config)
        if lookup_num_tokens is None:
            lookup = lookup_from_tree_field(config.tree)
        decoder = SpeculativeDecoder(adapter, head_module, tree, tap_layers=config.tap_layers,
                                     entropy_threshold=entropy_threshold, lookup=lookup)
    return decoder, AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)

