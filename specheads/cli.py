"""The `specheads` command line.

    specheads train RECIPE.yaml [--set dotted.key=value ...]
    specheads generate --target T [--heads H] --prompt TEXT [--max-new-tokens N] [--json]
    specheads demo [--workdir DIR]
    specheads export HEADS_DIR --format eagle3|medusa|vllm-medusa|llama.cpp --out DIR
    specheads export --import FOREIGN_DIR --out DIR [--target T]
    specheads serve --target T [--heads H] [--host H] [--port N] [--api-key KEY] [--max-concurrency N]
    specheads bench --target T [--heads H] [--prompts FILE.jsonl] [--json OUT] [--plot OUT.png] [--llama-cpp DIR]
    specheads tune --target T --heads H [--prompts FILE.jsonl] [--budget-s S]
    specheads data regenerate --target T --input FILE --output FILE
    specheads data cache --target T --data SOURCE --taps 2,5,8 --out DIR
    specheads llama-cpp build

Every subcommand imports its machinery lazily so `specheads --help` is instant. User
errors (bad paths, mismatched heads, bad recipes) print one clear line and exit 2
(specheads/errors.py); bugs keep their traceback. `specheads train ...` hands its arguments,
`--help` included, to specheads/train.py's own parser (the one `python -m specheads.train`
and the deepspeed launcher use).
"""

from __future__ import annotations

import argparse
import json
import sys

from specheads.errors import EXIT_USER_ERROR, UserError
from specheads.runner import CUDA_GRAPHS_HELP, DTYPE_HELP, TARGET_HELP


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with (or without) heads and print alpha, tau, tokens/s")
    p.add_argument("--target", required=True,
                   help=TARGET_HELP)
    p.add_argument("--heads", help="heads directory (config.json + model.safetensors); omit for plain decoding")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--device", default="cpu")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modeling code")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable); the output ends before it")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples losslessly")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, help="seed for sampling (reproducible output)")
    p.add_argument("--no-speculate", action="store_true", help="plain decoding even with heads")
    p.add_argument("--lookup", type=int, default=None, metavar="N",
                   help="also draft up to N tokens by n-gram lookup in the context (0: off; "
                        "default: what `specheads tune` stored in the heads directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--cuda-graphs", action="store_true", help=CUDA_GRAPHS_HELP)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="fetch or build the embedded target, distil data, train heads with DeepSpeed, "
                                    "tune, bench them against HF greedy and prompt lookup")
    p.add_argument("--target", default="embedded:smollm2", choices=["embedded:smollm2", "embedded:tiny"],
                   help="embedded:smollm2 (a real chat model, ~25 min on 2 cores) or embedded:tiny (the quick path)")
    p.add_argument("--workdir", default="runs/demo", help="where the heads and checkpoints go")
    p.add_argument("--recipe", default=None, help="Medusa recipe to train (default: the shipped tiny-medusa.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted recipe override, repeatable")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--retrain", action="store_true", help="train even if the workdir already has heads")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specheads", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    # Listed for `specheads --help` only: main() hands `train ...` to specheads/train.py before
    # parsing, since an argparse REMAINDER here cannot take a leading option such as --help.
    sub.add_parser("train", help="train heads from a recipe (DeepSpeed)")
    _add_generate(sub)
    _add_demo(sub)
    from specheads import bench_cli, data_cli, export_cli, llama_cpp_cli, serve_cli

    bench_cli.add_parser(sub)
    from specheads import tune_cli

    tune_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    export_cli.add_parser(sub)
    data_cli.add_parser(sub)
    llama_cpp_cli.add_parser(sub)
    return parser


def cmd_generate(args) -> int:
    from specheads.runner import cuda_graphs_problem, load_decoder

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.cuda_graphs and (problem := cuda_graphs_problem(args.device)):
        raise UserError(problem)
    decoder, tokenizer = load_decoder(args.target, args.heads, dtype=args.dtype, device=args.device,
                                      trust_remote_code=args.trust_remote_code, lookup_num_tokens=args.lookup,
                                      cuda_graphs=args.cuda_graphs)
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
    if not args.json:
        print(args.prompt, end="", flush=True)
    pieces = []
    for delta in stream:
        pieces.append(delta.text)
        if not args.json:
            print(delta.text, end="", flush=True)
    text, result = "".join(pieces), stream.result
    stats = result.stats
    report = {"text": text, "num_tokens": len(result.tokens), "finish_reason": result.finish_reason,
              "speculative": (args.heads is not None or bool(args.lookup)) and not args.no_speculate,
              "alpha": stats.alpha,
              "tau": stats.tau, "tokens_per_s": stats.tokens_per_s, "steps": stats.steps,
              "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
              "fallback": stats.fallback, "fallback_reason": stats.fallback_reason,
              "lookup_accepted": stats.lookup_accepted}
    if args.json:
        print(json.dumps(report))
    else:
        print()
        acceptance = f"alpha={stats.alpha:.3f} tau={stats.tau:.2f}" if stats.speculative_steps \
            else "no speculative step"  # alpha and tau measure drafts (serving/decode/stats.py)
        print(f"\n[{len(result.tokens)} tokens, finish={result.finish_reason}] {acceptance} "
              f"tokens/s={stats.tokens_per_s:.1f}", file=sys.stderr)
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
    except (UserError, FileNotFoundError, ValueError) as err:
        print(f"specheads {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
