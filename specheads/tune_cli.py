"""`specheads tune`: measure draft trees on this hardware and store the fastest in the heads dir.

    specheads tune --target T --heads H [--prompts FILE.jsonl] [--max-new-tokens N] [--budget-s S]
                   [--max-settings N] [--depths 1,2,3] [--node-budgets 4,8,16] [--lookup-num-tokens N] [--store DIR]
                   [--output-json PATH|-] [--device auto|cpu|cuda[:N]] [--enforce-eager]

Prompts are Spec-Bench `question.jsonl` records (default: the shipped bench set). The
winner goes into HEADS/config.json's `tree` (used by generate, serve and bench by
default) and the whole sweep into HEADS/tuning.json. The winner is then measured with and
without n-gram lookup drafts (--lookup-num-tokens, 0: skip); lookup is stored when faster. With --store DIR (a store of
the target's replies, `specheads data store`) it is then measured with and without the store; the store's path is
stored when faster. How settings are chosen and
measured: bench/tune.py. Trees are measured as `specheads serve` runs them, on --device (default
auto: CUDA when torch sees a GPU, else the CPU), with CUDA graphs on a GPU unless --enforce-eager.
When no tree beats plain decoding here, the heads directory records that too, and generate and
serve then decode plainly with these heads until they are tuned again.
"""

from __future__ import annotations

import sys

from specheads.options import (STORE_HELP, add_device_options, add_lookup_option, add_output_json_option,
                               add_store_option, apply_device_options, human_output, write_json_report)
from specheads.runner import DTYPE_HELP, TARGET_HELP


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("tune", help="sweep draft trees on this hardware; store the fastest in the heads dir")
    p.add_argument("--target", required=True,
                   help=TARGET_HELP)
    p.add_argument("--heads", required=True, help="heads directory to tune (its config.json tree is replaced)")
    p.add_argument("--prompts", help="Spec-Bench question.jsonl (default: the shipped bench set)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt and tree")
    p.add_argument("--budget-s", type=float, default=120.0, help="measurement time budget in seconds")
    p.add_argument("--max-settings", type=int, default=16, help="most tree settings measured")
    p.add_argument("--depths", help="depth limits to sweep, e.g. 1,2,3 (default: 1..heads' depth)")
    p.add_argument("--node-budgets", help="draft-node budgets to sweep, e.g. 4,8,16")
    add_lookup_option(p, 10, "also measure the winner with n-gram lookup drafts of N tokens and store lookup when it "
                             "is faster (0: skip)")
    add_store_option(p, STORE_HELP + ": also measure the winner with it and store its path when it is faster")
    add_output_json_option(p, old_json="path")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    add_device_options(p)
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modeling code")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from specheads.bench.prompts import encode_prompts, load_prompts
    from specheads.bench.tune_candidates import NODE_BUDGETS
    from specheads.bench_cli import int_list

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.budget_s <= 0:
        raise ValueError(f"--budget-s must be > 0 seconds, got {args.budget_s}")
    if args.lookup_num_tokens < 0:
        raise ValueError(f"--lookup-num-tokens must be >= 0 (0: skip), got {args.lookup_num_tokens}")
    depths = int_list(args.depths, "--depths", "1,2,3") if args.depths else None
    budgets = tuple(int_list(args.node_budgets, "--node-budgets", "4,8,16")) if args.node_budgets else NODE_BUDGETS
    prompts = load_prompts(args.prompts, limit=args.limit)  # a bad file fails before any model loads
    apply_device_options(args)

    from specheads.bench.tune import format_tuning, slower_than_plain, tune_heads_dir
    from specheads.heads.artefacts.heads_dir import read_heads_config
    from specheads.runner import check_store, load_target_and_tokenizer, store_drafter

    read_heads_config(args.heads)  # a missing or foreign heads dir fails before the target loads
    check_store(args.store)  # so does a missing or corrupt store
    target, tokenizer = load_target_and_tokenizer(args.target, heads=[args.heads], dtype=args.dtype,
                                                  device=args.device, trust_remote_code=args.trust_remote_code)
    store = store_drafter(args.store, None, target, tokenizer)
    encoded = [p.input_ids for p in encode_prompts(tokenizer, prompts)]
    report = tune_heads_dir(target, args.heads, encoded, max_new_tokens=args.max_new_tokens, budget_s=args.budget_s,
                            eos_token_id=tokenizer.eos_token_id, max_settings=args.max_settings, depths=depths,
                            node_budgets=budgets, progress=not args.quiet, lookup_num_tokens=args.lookup_num_tokens,
                            store=store, cuda_graphs="capture" if args.cuda_graphs else None,
                            log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_tuning(report), file=human_output(args))
    print(f"\nstored tree {report['winner']!r} in {args.heads}/config.json (sweep: {args.heads}/tuning.json)",
          file=sys.stderr)
    warning = slower_than_plain(report)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if args.output_json:
        write_json_report(args.output_json, report)
    return 0
