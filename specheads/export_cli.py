"""`specheads export`: convert heads to the layouts other engines load, or import them back.

    specheads export HEADS_DIR --format eagle3|medusa|vllm-medusa --out DIR
    specheads export RUN_DIR --format merged --out DIR
    specheads export --import FOREIGN_DIR --out DIR [--target MODEL_DIR_OR_HUB_ID]

`--format merged` takes a LoRA run (train.output_dir of a recipe with a `lora` section) and
writes DIR/target (base target + adapter merged, with its tokenizer) and DIR/heads (whose
target identity names DIR/target); serve them together.

The import auto-detects the layout from FOREIGN_DIR/config.json. Heads exported by specheads
carry their target identity; heads trained elsewhere need --target (only its config.json is
read; embedded names and GGUF files are resolved first, as for every --target). See
heads/export.py for the formats.
"""

from __future__ import annotations

from specheads.runner import TARGET_HELP, resolve_target_name

FORMAT_CHOICES = ("eagle3", "medusa", "vllm-medusa", "merged")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("export", help="export heads for vLLM/SGLang/TGI/TensorRT-LLM, or import them back",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("heads_dir", nargs="?", help="specheads heads directory to export")
    p.add_argument("--format", choices=FORMAT_CHOICES,
                   help="eagle3 (vLLM, SGLang), medusa (FasterDecoding layout: TGI, TensorRT-LLM), "
                        "vllm-medusa (vLLM's MedusaModel key names), merged (a LoRA run dir -> merged "
                        "target + heads)")
    p.add_argument("--import", dest="import_dir", metavar="FOREIGN_DIR",
                   help="read heads in a foreign layout (auto-detected) into a specheads heads directory")
    p.add_argument("--out", required=True, help="output directory (replaced atomically)")
    p.add_argument("--target", help="with --import: the target the heads were trained on (needed when the heads "
                                    f"do not record it): {TARGET_HELP}")


def run(args) -> int:
    from specheads.heads.export import export_heads, import_heads

    if args.import_dir is not None:
        if args.heads_dir is not None or args.format is not None:
            raise ValueError("--import takes no HEADS_DIR or --format; use either "
                             "`export HEADS_DIR --format F --out DIR` or `export --import FOREIGN_DIR --out DIR`")
        target = resolve_target_name(args.target) if args.target is not None else None
        out = import_heads(args.import_dir, args.out, target=target)
        print(f"imported {args.import_dir} -> {out}")
        return 0
    if args.heads_dir is None or args.format is None:
        raise ValueError("export needs HEADS_DIR and --format (one of "
                         f"{', '.join(FORMAT_CHOICES)}), or --import FOREIGN_DIR")
    if args.target is not None:
        raise ValueError("--target is only used with --import; exported heads carry their own target identity")
    if args.format == "merged":
        from specheads.heads.export import export_merged

        out = export_merged(args.heads_dir, args.out)
        print(f"merged the LoRA run {args.heads_dir} -> {out}/target (model + tokenizer) and {out}/heads")
        return 0
    out = export_heads(args.heads_dir, args.format, args.out)
    print(f"exported {args.heads_dir} as {args.format} -> {out}")
    return 0
