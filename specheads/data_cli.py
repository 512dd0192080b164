"""`specheads data ...`: data preparation commands.

    specheads data prompts --output FILE [--num N] [--seed S] [--self-instruct --target T
        [--self-instruct-fraction F] [--self-instruct-temperature X]] [--context-from FILE [--context-fraction F]]
    specheads data report --input FILE [--target T | --tokenizer PATH] [--draft-vocab-size N --eval-replies FILE ...]
    specheads data regenerate --target T --input FILE --output FILE [--batch-size N] [--max-new-tokens N]
                              [--thinking default|on|off] [--device auto|cpu|cuda[:N]] [--enforce-eager]
    specheads data regenerate --server URL [--server URL ...] [--target SERVED_NAME] --input FILE --output FILE
                              [--server-concurrency N] [--retry-minutes M] [--request-timeout S] [--api-key KEY]
                              [--temperature T] [--top-p P] [--top-k K] [--seed S] [--max-new-tokens N] [--thinking M]
    specheads data cache --target T --input SOURCE --taps 2,5,8 --output DIR [--max-gb G] [--top-k K]
    specheads data store --input REPLIES.jsonl --target T --output DIR [--tokenizer PATH] [--thinking MODE]
                         [--mark-tokens N]

--device defaults to auto (CUDA when torch sees a GPU, else the CPU); on a CUDA device
regenerate replays its decode steps as CUDA graphs unless --enforce-eager. With --server,
regenerate loads nothing: OpenAI-compatible servers (vLLM, SGLang, `specheads serve`) make
the replies (data/remote_replies.py); a record a server refuses (4xx) goes to
OUTPUT.rejects.jsonl with the server's message and the run goes on; it exits 1 when a record's
request kept failing for --retry-minutes (the output holds the records before it; a rerun
resumes there).

`add_parser(subparsers)` registers the "data" command on the top-level parser and
`run(args)` executes it (the returned int is the exit status). Machinery is imported
lazily. User errors print one line on stderr and return EXIT_USER_ERROR (2;
specheads/errors.py).
"""

from __future__ import annotations

import argparse
import sys

from specheads.errors import EXIT_USER_ERROR, UserError, one_line
from specheads.options import add_device_options, add_renamed_option, apply_device_options
from specheads.runner import DTYPE_HELP, TARGET_HELP

THINKING_HELP = ("chat template thinking mode: default, on or off; on/off set enable_thinking (Qwen3's switch), "
                 "default leaves the template's own (as a recipe's data.thinking)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("data", help="prepare training data: self-distillation, hidden-state cache")
    sub = parser.add_subparsers(dest="data_command", required=True)

    p = sub.add_parser("prompts", help="write chat prompts built locally (data/chat_prompts.py) for regenerate")
    p.add_argument("--output", required=True, help="output .jsonl of {id, category, turns} records")
    p.add_argument("--num", type=int, default=6000, help="number of prompts (distinct first turns)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt mix (and of sampled self-instruct)")
    p.add_argument("--follow-up-fraction", type=float, default=0.5,
                   help="fraction of prompts with a second user turn (multi-turn replies)")
    p.add_argument("--third-turn-fraction", type=float, default=0.5,
                   help="fraction of those with a second turn that also get a third")
    p.add_argument("--self-instruct", action="store_true",
                   help="have --target write part of the prompts (data/self_instruct.py), filtered; rejects printed")
    p.add_argument("--target", default=None, help="with --self-instruct: " + TARGET_HELP)
    p.add_argument("--self-instruct-fraction", type=float, default=0.2,
                   help="with --self-instruct: the largest share of prompts the target writes")
    p.add_argument("--self-instruct-temperature", type=float, default=0.0,
                   help="with --self-instruct: 0 = greedy (one prompt at most per kind x subject x instruction); "
                        "above 0, sampled with seeds drawn from --seed, so the share is not capped")
    p.add_argument("--context-from", action="append", default=[], metavar="FILE",
                   help="chat or text records whose texts become passages of context tasks (data/context_prompts.py: "
                        "extract, summarize, answer from, rewrite a long text); repeatable")
    p.add_argument("--context-fraction", type=float, default=0.25,
                   help="with --context-from: the share of prompts that are context tasks")
    p.add_argument("--eval-prompts", action="append", default=[], metavar="FILE",
                   help="evaluation prompts (question.jsonl) whose turns must not appear (MT-bench is always checked); "
                        "repeatable")
    p.add_argument("--batch-size", type=int, default=96, help="with --self-instruct: sequences per forward")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    add_device_options(p, graphs=False)
    p.add_argument("--trust-remote-code", action="store_true", help="with --self-instruct: allow the target's own code")

    p = sub.add_parser("report", help="tokens, turns, distinct prompts and draft-vocab coverage of chat data")
    p.add_argument("--input", required=True, help="chat records (regenerate's output): .jsonl/.json/.parquet")
    p.add_argument("--target", default=None, help="whose tokenizer counts tokens: " + TARGET_HELP)
    p.add_argument("--tokenizer", default=None, help="tokenizer path (instead of --target)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft vocab: this many most frequent reply tokens of --input (plus EOS)")
    add_renamed_option(p, "--eval-replies", "--eval", action="append", default=[], metavar="FILE",
                       help="evaluation replies (.jsonl chat or text records) whose tokens the draft vocab should cover; "
                            "repeatable")
    p.add_argument("--thinking", default="default", help=THINKING_HELP)
    p.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer's own code")

    p = sub.add_parser("regenerate", help="rewrite assistant turns with the target (self-distillation, resumable)")
    p.add_argument("--target", default=None,
                   help=TARGET_HELP + "; with --server, the served model name (default: the one the servers serve)")
    p.add_argument("--input", required=True, help="chat records: .jsonl/.json/.parquet or a datasets name")
    p.add_argument("--output", required=True, help="output .jsonl (a rerun resumes it)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the target's)")
    p.add_argument("--batch-size", type=int, default=96,
                   help="records per resumable batch; their replies decode together, this many sequences per forward")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest reply, in tokens")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches (rerun continues)")
    p.add_argument("--thinking", default="default", help=THINKING_HELP)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    add_device_options(p)
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modeling code")
    _add_server_options(p)

    p = sub.add_parser("cache", help="cache target hidden states + logits over packed blocks (safetensors shards)")
    p.add_argument("--target", required=True,
                   help=TARGET_HELP)
    add_renamed_option(p, "--input", "--data", required=True, help="data source, as in a recipe's data.source")
    p.add_argument("--taps", required=True, help="comma-separated tap layers, e.g. 2,5,8")
    add_renamed_option(p, "--output", "--out", required=True, help="output directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the target's)")
    p.add_argument("--text-field", default="text", help="the text field of plain-text records")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per packed block")
    p.add_argument("--max-records", type=int, default=None, help="use only the first N records")
    p.add_argument("--top-k", type=int, default=-1, help="logits kept per position; 0 = full, -1 = auto by vocab")
    p.add_argument("--max-gb", type=float, default=50.0, help="refuse to start above this estimated size")
    p.add_argument("--batch-size", type=int, default=8, help="blocks per target forward")
    p.add_argument("--blocks-per-shard", type=int, default=256, help="blocks per safetensors shard")
    p.add_argument("--thinking", default="default", help=THINKING_HELP)
    p.add_argument("--dtype", default="float32", help=DTYPE_HELP)
    add_device_options(p, graphs=False)
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modeling code")

    p = sub.add_parser("store", help="index the target's replies (regenerate's output) as a draft source for serving "
                                     "(--store of generate, serve, bench, tune)")
    p.add_argument("--input", required=True, help="chat records whose assistant turns are the target's replies "
                                                  "(regenerate's output): .jsonl/.json/.parquet or a datasets name")
    p.add_argument("--target", required=True, help="the target the replies are from: " + TARGET_HELP)
    p.add_argument("--output", required=True, help="the store's directory (written whole, replacing one there)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the target's)")
    p.add_argument("--thinking", default="default", help=THINKING_HELP)
    p.add_argument("--mark-tokens", type=int, default=None,
                   help="store each reply after this many tokens of its prompt's tail (the template's assistant "
                        "header), so replies' openings are drafted too; 0: bare replies (default 8)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer's own code")
    return parser


# regenerate's options that only its --server path has: dest -> (flag, its default there)
SERVER_OPTIONS = {"server_concurrency": ("--server-concurrency", 8), "retry_minutes": ("--retry-minutes", 10.0),
                  "request_timeout": ("--request-timeout", 600.0), "api_key": ("--api-key", None),
                  "temperature": ("--temperature", 0.0), "top_p": ("--top-p", 1.0), "top_k": ("--top-k", 0),
                  "seed": ("--seed", None)}
# ... and the local path's options, which a server decides for itself
LOCAL_OPTIONS = {"tokenizer": ("--tokenizer", None), "dtype": ("--dtype", "auto"), "device": ("--device", "auto"),
                 "cuda_graphs": ("--enforce-eager", None), "trust_remote_code": ("--trust-remote-code", False)}


def _add_server_options(p) -> None:
    p.add_argument("--server", action="append", default=[], metavar="URL",
                   help="an OpenAI-compatible server (vLLM, SGLang, specheads serve) that makes the replies, e.g. "
                        "http://127.0.0.1:8000; repeatable: requests are spread over them. Nothing loads locally")
    p.add_argument("--server-concurrency", type=int, default=None, metavar="N",
                   help="with --server: requests in flight per server (default 8)")
    p.add_argument("--retry-minutes", type=float, default=None, metavar="M",
                   help="with --server: how long a failed request keeps being retried, with exponential backoff and "
                        "jitter, before the run stops at its record (default 10)")
    p.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help="with --server: seconds one reply may take (default 600)")
    p.add_argument("--api-key", default=None,
                   help="with --server: the servers' API key (default: the OPENAI_API_KEY environment variable)")
    p.add_argument("--temperature", type=float, default=None,
                   help="with --server: 0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=None,
                   help="with --server: nucleus sampling, keep the top tokens of this mass (default 1)")
    p.add_argument("--top-k", type=int, default=None,
                   help="with --server: keep the K likeliest tokens (default 0: all)")
    p.add_argument("--seed", type=int, default=None,
                   help="with --server: seed for sampling; each request gets one drawn from it (reproducible)")


def _prompts(args) -> int:
    from specheads.data.chat_prompts import build_prompts, normalize, write_records
    from specheads.runner import resolve_target_name

    if not 0 <= args.context_fraction <= 1:
        raise ValueError(f"--context-fraction must be in [0, 1], got {args.context_fraction}")
    if args.self_instruct and args.target is None:
        raise ValueError("--self-instruct needs --target (the model that writes the prompts)")
    if args.self_instruct:
        apply_device_options(args)
    num_context = round(args.num * args.context_fraction) if args.context_from else 0
    num_rest = args.num - num_context
    if not num_rest:
        records = []
    elif not args.self_instruct:
        records = build_prompts(num_rest, seed=args.seed, follow_up_fraction=args.follow_up_fraction,
                                third_turn_fraction=args.third_turn_fraction)
    else:
        from specheads.data.self_instruct import mixed_prompts

        records, _ = mixed_prompts(num_rest, resolve_target_name(args.target),
                                   self_instruct_fraction=args.self_instruct_fraction, seed=args.seed,
                                   follow_up_fraction=args.follow_up_fraction,
                                   third_turn_fraction=args.third_turn_fraction, eval_paths=args.eval_prompts,
                                   temperature=args.self_instruct_temperature, batch_size=args.batch_size,
                                   dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code)
    if args.context_from:
        from specheads.data.context_prompts import REJECT_REASONS, context_prompts, mixed_in, source_texts, usable_texts
        from specheads.data.self_instruct import evaluation_turns, format_rejects

        texts, refused = usable_texts(source_texts(args.context_from), evaluation_turns(args.eval_prompts))
        print(f"context: {len(texts)} source texts usable; refused: {format_rejects(refused, REJECT_REASONS)}")
        context = context_prompts(num_context, texts, seed=args.seed, follow_up_fraction=args.follow_up_fraction,
                                  taken={normalize(r["turns"][0]) for r in records})
        records = mixed_in(records, context, seed=args.seed)
    path = write_records(args.output, records)
    print(f"prompts: wrote {len(records)} prompt records to {path}"
          + (f" ({num_context} context tasks)" if args.context_from else ""))
    return 0


def _check_inputs(args) -> None:
    """--target's name and --input, both cheap to check: before any target is built or loaded
    (embedded:tiny builds for minutes on a slow machine the first time)."""
    from specheads.data.text import check_source
    from specheads.runner import check_target_name

    if args.target is not None:
        check_target_name(args.target)
    check_source(args.input)


def _report(args) -> int:
    from specheads.data.chat_prompts import format_report, report_chat_data
    from specheads.runner import resolve_target_name

    if (args.target is None) == (args.tokenizer is None):
        raise ValueError("give one of --target or --tokenizer (whose tokens are counted)")
    if args.eval_replies and not args.draft_vocab_size:
        raise ValueError("--eval-replies needs --draft-vocab-size (the draft vocab whose coverage is measured)")
    _check_inputs(args)
    tokenizer = args.tokenizer or resolve_target_name(args.target)
    print(format_report(report_chat_data(args.input, tokenizer, args.draft_vocab_size, args.eval_replies,
                                         thinking=args.thinking, trust_remote_code=args.trust_remote_code)))
    return 0


def _regenerate(args) -> int:
    from specheads.data.regenerate import regenerate
    from specheads.runner import resolve_target_name

    if args.server:
        return _regenerate_with_servers(args)
    given = [flag for dest, (flag, default) in SERVER_OPTIONS.items() if getattr(args, dest) not in (None, default)]
    if given:
        raise ValueError(f"{', '.join(given)} apply to --server only (the local path decodes greedily); "
                         "add --server URL or leave them out")
    if args.target is None:
        raise ValueError("give --target (the model whose replies are made), or --server URL (a server that makes them)")
    apply_device_options(args)
    _check_inputs(args)
    progress = regenerate(resolve_target_name(args.target), args.input, args.output, tokenizer_path=args.tokenizer,
                          batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                          device=args.device, trust_remote_code=args.trust_remote_code, max_batches=args.max_batches,
                          cuda_graphs="capture" if args.cuda_graphs else None, thinking=args.thinking)
    print(f"regenerate: {args.output}: {progress.summary()}")
    return 0


def _regenerate_with_servers(args) -> int:
    import os

    from specheads.data.remote_replies import Sampling, regenerate_with_servers

    given = [flag for dest, (flag, default) in LOCAL_OPTIONS.items() if getattr(args, dest) != default]
    if given:
        raise ValueError(f"{', '.join(given)} do not apply with --server: the server loads the model and applies "
                         "its own chat template; leave them out")
    options = {dest: default if getattr(args, dest) is None else getattr(args, dest)
               for dest, (_, default) in SERVER_OPTIONS.items()}
    sampling = Sampling(options["temperature"], options["top_p"], options["top_k"], options["seed"])
    run = regenerate_with_servers(args.server, args.input, args.output, model=args.target,
                                  max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                  max_batches=args.max_batches, thinking=args.thinking, sampling=sampling,
                                  concurrency=options["server_concurrency"], retry_minutes=options["retry_minutes"],
                                  request_timeout_s=options["request_timeout"],
                                  api_key=options["api_key"] or os.environ.get("OPENAI_API_KEY"))
    print(f"regenerate: {args.output}: {run.summary()}")
    return 1 if run.requests.failed_records else 0


def _cache(args) -> int:
    from specheads.data.feature_cache import write_cache
    from specheads.data.text import build_blocks, load_records
    from specheads.heads.target.adapter import TargetAdapter
    from specheads.runner import resolve_target_name

    try:
        taps = [int(t) for t in args.taps.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--taps: expected comma-separated layer numbers like 2,5,8, got {args.taps!r}") from None
    apply_device_options(args)
    _check_inputs(args)
    path = resolve_target_name(args.target)
    target = TargetAdapter.from_pretrained(path, dtype=args.dtype, device=args.device,
                                           trust_remote_code=args.trust_remote_code)
    records = load_records(args.input)[:args.max_records]
    eos = target.config.eos_token_id if isinstance(target.config.eos_token_id, int) else None
    blocks = build_blocks(args.input, records, args.text_field, args.seq_len, args.tokenizer or path,
                          eos_token_id=eos, vocab_size=target.vocab_size, trust_remote_code=args.trust_remote_code,
                          thinking=args.thinking)
    print(f"cache data {blocks.report.summary()}")
    manifest = write_cache(target, blocks, taps, args.output, top_k=args.top_k, batch_size=args.batch_size,
                           blocks_per_shard=args.blocks_per_shard, max_gb=args.max_gb)
    print(f"feature cache: {manifest}")
    return 0


def _store(args) -> int:
    from specheads.data.reply_store import MARK_TOKENS, build_store
    from specheads.runner import resolve_target_name

    _check_inputs(args)
    manifest, report = build_store(args.input, resolve_target_name(args.target), args.output,
                                   tokenizer_path=args.tokenizer, thinking=args.thinking,
                                   trust_remote_code=args.trust_remote_code,
                                   mark_tokens=MARK_TOKENS if args.mark_tokens is None else args.mark_tokens)
    print(f"store: {args.output}: {report.summary(manifest)} "
          f"({manifest.index_bytes / max(manifest.num_tokens, 1):.1f} bytes per token)")
    return 0


def run(args) -> int:
    try:
        if args.data_command == "prompts":
            return _prompts(args)
        if args.data_command == "report":
            return _report(args)
        if args.data_command == "regenerate":
            return _regenerate(args)
        if args.data_command == "cache":
            return _cache(args)
        if args.data_command == "store":
            return _store(args)
    except (UserError, ValueError, OSError) as err:  # DataError is a ValueError
        print(f"specheads data {args.data_command}: error: {one_line(err)}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"specheads data: unknown command {args.data_command!r}", file=sys.stderr)
    return EXIT_USER_ERROR
