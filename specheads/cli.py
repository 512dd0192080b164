"""The `specheads` command line.

    specheads train RECIPE [--set dotted.key=value ...] [--dry-run]    (RECIPE: a shipped name or a YAML path)
    specheads recipes [NAME]
    specheads generate --target T [--heads H] --prompt TEXT [--max-new-tokens N] [--store DIR] [--output-json PATH|-]
    specheads demo [--target embedded:smollm2|embedded:tiny] [--workdir DIR]
    specheads export HEADS_DIR --format eagle3|medusa|vllm-medusa|merged|llama.cpp --output DIR
    specheads export --import FOREIGN_DIR --output DIR [--target T]
    specheads serve --target T [--heads H] [--host H] [--port N] [--api-key KEY] [--max-concurrency N]
    specheads bench --target T [--heads H] [--prompts FILE.jsonl] [--output-json PATH] [--plot OUT.png]
    specheads tune --target T --heads H [--prompts FILE.jsonl] [--budget-s S]
    specheads data regenerate --target T --input FILE --output FILE
    specheads data cache --target T --input SOURCE --taps 2,5,8 --output DIR
    specheads llama-cpp build

Every command that runs a model takes `--device` (default auto: CUDA when torch sees a GPU,
else the CPU) and, where the engine decodes, replays CUDA graphs on a GPU unless
`--enforce-eager`; both are resolved by specheads/runner.py. The shared option names and the
parser conventions (defaults in every --help, no abbreviations, deprecated spellings):
specheads/options.py. `build_parser()` returns the whole parser tree, `train` included.

Every subcommand imports its machinery lazily so `specheads --help` is instant. User
errors (bad paths, mismatched heads, bad recipes, a model or file that cannot be read or
written: OSError, transformers' load errors among them) print one clear line and exit 2
(specheads/errors.py); bugs keep their traceback. `specheads train ...` hands its arguments,
`--help` included, to specheads/train.py's own parser (the one `python -m specheads.train`
and the deepspeed launcher use).
"""

from __future__ import annotations

import argparse
import sys

from specheads import __version__
from specheads.errors import EXIT_USER_ERROR, UserError, one_line
from specheads.options import (Parser, add_device_options, add_lookup_option, add_output_json_option,
                               add_store_option, apply_device_options, write_json_report)
from specheads.runner import DTYPE_HELP, HEADS_HELP, TARGET_HELP


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with (or without) heads and print alpha, tau, tokens/s")
    p.add_argument("--target", required=True,
                   help=TARGET_HELP)
    p.add_argument("--heads", help=HEADS_HELP + "; omit for plain decoding")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens generated")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    add_device_options(p)
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modeling code")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable); the output ends before it")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples losslessly")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens of this mass")
    p.add_argument("--top-k", type=int, default=0, help="keep the K likeliest tokens (0: all)")
    p.add_argument("--seed", type=int, help="seed for sampling (reproducible output)")
    p.add_argument("--no-speculate", action="store_true", help="plain decoding even with heads")
    add_lookup_option(p, old="--lookup")
    add_store_option(p)
    add_output_json_option(p, old_json="switch")


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="fetch or build the embedded target, distil data, train heads with DeepSpeed, "
                                    "tune, bench them against HF greedy and prompt lookup")
    p.add_argument("--target", default="embedded:smollm2", choices=["embedded:smollm2", "embedded:tiny"],
                   help="embedded:smollm2 (a real chat model, about 16 min on 2 cores) or embedded:tiny (the quick path)")
    p.add_argument("--workdir", default="runs/demo",
                   help="where the demo's data, heads, checkpoints and bench report go (reused by the next run)")
    p.add_argument("--recipe", default=None,
                   help="recipe to train instead of the demo's own (a shipped name or a YAML path; its target must "
                        "be --target's). Default: smollm2-135m-eagle3 for embedded:smollm2; tiny-medusa and "
                        "tiny-eagle3 for embedded:tiny (the recipe replaces tiny-medusa)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted recipe override, repeatable")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt in tune and bench")
    add_device_options(p)
    p.add_argument("--retrain", action="store_true",
                   help="distil, train and tune again: deletes the demo's own outputs in --workdir first "
                        "(never a file the demo did not write)")


def _add_recipes(sub) -> None:
    p = sub.add_parser("recipes", help="list the shipped recipes (`specheads train NAME` trains one)",
                       description="List the recipes shipped with specheads, or print one (a copy to edit: "
                                   "specheads recipes NAME > my-recipe.yaml).")
    p.add_argument("name", nargs="?", help="print this recipe's YAML instead of the list")


def build_parser() -> argparse.ArgumentParser:
    """The whole `specheads` parser tree (every subcommand, `train` included); main() uses it
    for every command but `train`, which goes to specheads/train.py's parser of the same options."""
    from specheads import bench_cli, data_cli, export_cli, llama_cpp_cli, serve_cli, train, tune_cli

    parser = Parser(prog="specheads", description="Train speculative-decoding heads (Medusa, EAGLE-3) on a frozen "
                    "Hugging Face model and serve it faster with them. `specheads COMMAND --help` for a command's "
                    "options.")
    parser.add_argument("--version", action="version", version=f"specheads {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train.add_arguments(sub.add_parser("train", help="train heads from a recipe (DeepSpeed)",
                                       description=train.DESCRIPTION))
    _add_recipes(sub)
    _add_generate(sub)
    _add_demo(sub)
    bench_cli.add_parser(sub)
    tune_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    export_cli.add_parser(sub)
    data_cli.add_parser(sub)
    llama_cpp_cli.add_parser(sub)
    return parser


def cmd_generate(args) -> int:
    from specheads.runner import load_decoder

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    apply_device_options(args)
    decoder, tokenizer = load_decoder(args.target, args.heads, dtype=args.dtype, device=args.device,
                                      trust_remote_code=args.trust_remote_code,
                                      lookup_num_tokens=args.lookup_num_tokens, cuda_graphs=args.cuda_graphs,
                                      store=args.store)
    prompt_ids = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    if not prompt_ids:
        raise UserError("--prompt is empty after tokenization; give at least one token of text")
    from specheads.serving.server.text_stream import stream_text
    from specheads.serving.decode.sampling import SamplingParams

    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        stream = stream_text(decoder, tokenizer, prompt_ids, args.max_new_tokens, stop=args.stop,
                             eos_token_id=tokenizer.eos_token_id, sampling=sampling,
                             speculate=not args.no_speculate)
    except ValueError as error:
        raise UserError(str(error)) from error
    streaming = args.output_json != "-"  # the text on stdout, unless the JSON report goes there
    if streaming:
        print(args.prompt, end="", flush=True)
    pieces = []
    for delta in stream:
        pieces.append(delta.text)
        if streaming:
            print(delta.text, end="", flush=True)
    text, result = "".join(pieces), stream.result
    stats = result.stats
    report = {"text": text, "num_tokens": len(result.tokens), "finish_reason": result.finish_reason,
              "speculative": decoder.speculates and not args.no_speculate,
              "alpha": stats.alpha,
              "tau": stats.tau, "tokens_per_s": stats.tokens_per_s, "steps": stats.steps,
              "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
              "fallback": stats.fallback, "fallback_reason": stats.fallback_reason,
              "lookup_accepted": stats.lookup_accepted, "store_accepted": stats.store_accepted}
    if streaming:
        print()
        acceptance = f"alpha={stats.alpha:.3f} tau={stats.tau:.2f}" if stats.speculative_steps \
            else "no speculative step"  # alpha and tau measure drafts (serving/decode/stats.py)
        print(f"\n[{len(result.tokens)} tokens, finish={result.finish_reason}] {acceptance} "
              f"tokens/s={stats.tokens_per_s:.1f}", file=sys.stderr)
    if args.output_json is not None:
        write_json_report(args.output_json, report)
    return 0


def cmd_recipes(args) -> int:
    from specheads.train import format_recipes, resolve_recipe

    if args.name is None:
        print(format_recipes())
    else:
        print(resolve_recipe(args.name).read_text(), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from specheads.train import main as train_main

        return train_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "recipes":
            return cmd_recipes(args)
        if args.command == "tune":
            from specheads import tune_cli

            return tune_cli.run(args)
        if args.command == "bench":
            from specheads import bench_cli

            return bench_cli.run(args)
        if args.command == "serve":
            from specheads import serve_cli

            return serve_cli.run(args)
        if args.command == "data":
            from specheads import data_cli

            return data_cli.run(args)
        if args.command == "export":
            from specheads import export_cli

            return export_cli.run(args)
        if args.command == "llama-cpp":
            from specheads import llama_cpp_cli

            return llama_cpp_cli.run(args)
        if args.command == "demo":
            from specheads.demo import run_demo

            return run_demo(args)
    except (UserError, OSError, ValueError) as err:  # OSError: a model or file that cannot be read or written
        print(f"specheads {args.command}: error: {one_line(err)}", file=sys.stderr)
        return EXIT_USER_ERROR
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
