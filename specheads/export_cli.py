"""`specheads export`: convert heads to the layouts other engines load, or import them back.

    specheads export HEADS_DIR --format eagle3|medusa|vllm-medusa --output DIR
    specheads export RUN_DIR --format merged --output DIR
    specheads export HEADS_DIR --format llama.cpp --output DIR [--target T] [--llama-cpp SRC] [--outtype bf16]
    specheads export --import FOREIGN_DIR --output DIR [--target MODEL_DIR_OR_HUB_ID]

`--format merged` takes a LoRA run (train.output_dir of a recipe with a `lora` section) and
writes DIR/target (base target + adapter merged, with its tokenizer) and DIR/heads (whose
target identity names DIR/target); serve them together.

`--format llama.cpp` takes EAGLE-3 heads and writes DIR/heads.gguf (a draft for llama.cpp's
`--spec-type draft-eagle3`) and DIR/target.gguf (the target, same outtype; --no-target skips it),
both made by llama.cpp's own convert_hf_to_gguf.py (SRC: a llama.cpp checkout or `specheads
llama-cpp build`'s directory; default: llama.cpp from the pinned llama-cpp-python sdist, fetched
once into the cache). The target is the heads' recorded one unless --target names it: a local HF
directory, a Hub id (its snapshot in the Hub cache, downloaded when online), an embedded name
or a .gguf file (converted first). Serve with
    llama-server -m DIR/target.gguf -md DIR/heads.gguf --spec-type draft-eagle3
See heads/artefacts/export_llama_cpp.py for the tap convention.

The import auto-detects the layout from FOREIGN_DIR/config.json. Heads exported by specheads
carry their target identity; heads trained elsewhere need --target (only its config.json is
read; embedded names and GGUF files are resolved first, as for every --target). See
heads/artefacts/export.py for the formats.
"""

from __future__ import annotations

from specheads.options import add_renamed_option
from specheads.runner import TARGET_HELP, resolve_target_name

FORMAT_CHOICES = ("eagle3", "medusa", "vllm-medusa", "merged", "llama.cpp")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("export", help="export heads for vLLM/SGLang/TGI/TensorRT-LLM, or import them back",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("heads_dir", nargs="?", help="specheads heads directory to export")
    p.add_argument("--format", choices=FORMAT_CHOICES,
                   help="eagle3 (vLLM, SGLang), medusa (FasterDecoding layout: TGI, TensorRT-LLM), "
                        "vllm-medusa (vLLM's MedusaModel key names), merged (a LoRA run dir -> merged "
                        "target + heads), llama.cpp (EAGLE-3 heads -> GGUF draft + target for llama-server)")
    p.add_argument("--import", dest="import_dir", metavar="FOREIGN_DIR",
                   help="read heads in a foreign layout (auto-detected) into a specheads heads directory")
    add_renamed_option(p, "--output", "--out", required=True, help="output directory (replaced atomically)")
    p.add_argument("--target", help="with --import: the target the heads were trained on (needed when the heads "
                                    "do not record it); with --format llama.cpp: the target to convert (default: "
                                    f"the one the heads record): {TARGET_HELP}")
    p.add_argument("--llama-cpp", metavar="SRC", help="--format llama.cpp: a llama.cpp directory holding "
                   "convert_hf_to_gguf.py (default: the pinned llama-cpp-python sdist's, fetched once)")
    p.add_argument("--outtype", default="bf16", choices=("f32", "bf16", "f16"),
                   help="--format llama.cpp: GGUF tensor type (f32: the exact mode)")
    p.add_argument("--pre-tokenizer", metavar="NAME", help="--format llama.cpp: the llama.cpp pre-tokenizer of a "
                   "tokenizer the converter does not recognise (e.g. gpt-2 for a byte-level BPE)")
    p.add_argument("--no-target", action="store_true", help="--format llama.cpp: write heads.gguf only")


def run(args) -> int:
    from specheads.heads.artefacts.export import export_heads, import_heads

    if args.import_dir is not None:
        if args.heads_dir is not None or args.format is not None:
            raise ValueError("--import takes no HEADS_DIR or --format; use either "
                             "`export HEADS_DIR --format F --output DIR` or `export --import FOREIGN_DIR --output DIR`")
        target = resolve_target_name(args.target) if args.target is not None else None
        out = import_heads(args.import_dir, args.output, target=target)
        print(f"imported {args.import_dir} -> {out}")
        return 0
    if args.heads_dir is None or args.format is None:
        raise ValueError("export needs HEADS_DIR and --format (one of "
                         f"{', '.join(FORMAT_CHOICES)}), or --import FOREIGN_DIR")
    if args.format == "llama.cpp":
        return _export_llama_cpp(args)
    if args.target is not None:
        raise ValueError("--target is only used with --import or --format llama.cpp; exported heads carry their "
                         "own target identity")
    if args.format == "merged":
        from specheads.heads.artefacts.export import export_merged

        out = export_merged(args.heads_dir, args.output)
        print(f"merged the LoRA run {args.heads_dir} -> {out}/target (model + tokenizer) and {out}/heads")
        return 0
    out = export_heads(args.heads_dir, args.format, args.output)
    print(f"exported {args.heads_dir} as {args.format} -> {out}")
    return 0


def _export_llama_cpp(args) -> int:
    from specheads.data.tiny_target import default_cache_dir
    from specheads.heads.artefacts.export_llama_cpp import (check_target_dir, export_llama_cpp, find_converter,
                                                           pinned_source)
    from specheads.heads.artefacts.heads_dir import read_heads_config
    from specheads.heads.artefacts.llama_cpp_serve import SERVE_DRAFT_MAX, SERVE_DRAFT_P_MIN, draft_args
    from specheads.heads.artefacts.hub import local_target_dir

    config = read_heads_config(args.heads_dir)
    if config.kind != "eagle3":  # before anything is fetched or resolved
        raise ValueError(f"--format llama.cpp takes EAGLE-3 heads (llama.cpp's --spec-type draft-eagle3); "
                         f"{args.heads_dir!r} holds {config.kind} heads")
    # a Hub id becomes its snapshot in the Hub cache (downloaded when online): the converter reads files
    target = check_target_dir(local_target_dir(resolve_target_name(args.target or config.target.name_or_path)))
    source = args.llama_cpp if args.llama_cpp is not None else pinned_source(default_cache_dir())
    out = export_llama_cpp(args.heads_dir, args.output, target_dir=target, converter=find_converter(source),
                           outtype=args.outtype, pre_tokenizer=args.pre_tokenizer, with_target=not args.no_target,
                           log=print)
    served = f"-m {out}/target.gguf " if not args.no_target else "-m TARGET.gguf "
    draft = " ".join(draft_args(f"{out}/heads.gguf", SERVE_DRAFT_MAX, SERVE_DRAFT_P_MIN))
    print(f"exported {args.heads_dir} for llama.cpp -> {out}; serve with:\n"
          f"  llama-server {served}{draft}   # (+ --poll 0 on a few cores: docs/serving.md, \"llama.cpp\")")
    return 0
