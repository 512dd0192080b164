"""`specheads bench`: vanilla vs speculative vs peer decoding on one prompt set, one process.

    specheads bench --target T [--heads H [--heads H2 ...]] [--prompts FILE.jsonl] [--max-new-tokens N]
                    [--tree-nodes 8,16,32] [--draft-model D] [--prompt-lookup-num-tokens N] [--lookup-num-tokens N]
                    [--store DIR|learn] [--passes N] [--turns 1|2]
                    [--output-json OUT.json|-] [--plot OUT.png] [--limit N] [--per-category N] [--dtype D]
                    [--device auto|cpu|cuda[:N]] [--enforce-eager]
                    [--llama-cpp DIR [--llama-cpp-draft-max N] [--llama-cpp-draft-p-min P] [--llama-cpp-args "FLAGS"]]

Prompts: Spec-Bench `question.jsonl` (question_id, category, turns); the first turn of
each, through the target tokenizer's chat template when it has one, else raw text (--turns 2:
then the second turns, after the reference's first replies).
Default: the shipped set (prompts/default.jsonl, 6 categories).

Methods: hf-greedy (the reference), engine-plain (speculation off), engine-heads[tuned,N]
(the heads directory's tree: the one `specheads tune` chose, or [stored,N] for an untuned
calibrated tree), engine-heads[calibrated,N] per --tree-nodes entry (N draft nodes from the
calibrated accuracy; "prior" when the heads carry no calibration). Several heads
directories (--heads A --heads B, or --heads A,B) are benched side by side in the same run
and named engine-<kind>[...] (engine-medusa[tuned,3], engine-eagle3[tuned,5]);
engine-lookup[N] (the engine's own n-gram lookup drafts, no heads) and engine-<heads>+lookup[...]
(each heads directory's first tree plus lookup; serving/decode/lookup.py), both off with
--lookup-num-tokens 0; with --store DIR (a store of the target's replies, `specheads data store`),
engine-store[N] (drafts from the store alone) and engine-<heads>+lookup+store[...] (each heads directory's
first tree, lookup and the store; serving/decode/store.py), each learning the replies it serves
(--store learn: from those alone; --passes 2 serves the prompts twice, the second pass reported
apart); hf-prompt-lookup[N] (off with
--prompt-lookup-num-tokens 0), hf-assisted (--draft-model,
which must share the target's tokenizer). How each metric is measured: bench/harness.py.

--llama-cpp DIR (built llama.cpp binaries: `specheads llama-cpp build` prints where) adds llama.cpp
rows on the same prompt ids: llama.cpp-plain (the target converted to GGUF, f32 when the bench runs
fp32, else bf16), llama.cpp-ngram, and llama.cpp-<heads>[N] per EAGLE-3 heads weights (drafting
N tokens with --spec-type draft-eagle3; directories that differ only in their tree share one),
each through its own llama-server on 127.0.0.1, one after another; identity there is against
llama.cpp-plain. --llama-cpp-draft-p-min P drafts only while the draft's top probability is
>= P (--spec-draft-p-min; the row is named [N,p=P]); --llama-cpp-args passes more llama-server
flags to every llama.cpp row (say "--poll 0"). See bench/llama_cpp.py. JSON: "llama_cpp":
{"config", "methods": [{"name", "kind", "server_args", "overall": SUMMARY}]}.

On a CUDA device every engine method verifies through CUDA graphs and the tree-attention
kernel (the HF methods run as transformers does) unless --enforce-eager.

JSON (--output-json PATH; `-` prints it on stdout and the tables on stderr), schema "specheads.bench/1":
    {"schema": "specheads.bench/1",
     "config": {"target", "heads", "prompts", "max_new_tokens", "num_prompts", "device",
                "cuda_graphs",       # every engine method verified through graphs + kernel (CUDA, no --enforce-eager)
                "dtype",             # what every method ran in ("auto" resolved), HF baselines included
                "dtype_requested",   # --dtype as given
                "layout",            # "packed" | "plain": the engine's linear weights (heads/target/cpu_layout.py)
                "tie_tolerance",     # only when an output differs: bench/divergence.py
                "chat_template": bool, "torch", "transformers"},
     "step_costs": [StepCostTable JSON (bench/step_costs.py), + "heads": label per heads directory],
     "categories": [str, ...],              # in first-seen order
     "reference": "hf-greedy",
     "tuning": {label: tuning.json of that heads dir (bench/tune.py) or null},
     "methods": [{
        "name": str, "kind": "hf-greedy" | "engine-plain" | "engine-heads" | "engine-heads+lookup"
                | "engine-lookup" | "engine-heads+store" | "engine-store" | "hf-prompt-lookup" | "hf-assisted",
        "tree": null | {"source": "heads-dir-tuned" | "heads-dir" | "heads-dir-default" | "calibrated" | "prior",
                        "num_nodes": int, "num_draft_nodes": int, "max_depth": int,
                        "heads": str, "head_kind": str,    # heads label and kind
                        "lookup_num_tokens": int,          # 0 unless engine-heads+lookup (or +store with lookup)
                        "store_num_tokens": int},          # 0 unless engine-heads+store
        "overall": SUMMARY, "by_category": {category: SUMMARY},
        "prompts": [{"question_id", "category", "num_prompt_tokens", "num_tokens", "seconds", "steps",
                     "accepted_tokens", "identical": bool,
                     "first_difference": null | {"position", "reference_token", "method_token",
                                                 "gap",        # |fp32 logit difference| of the two tokens
                                                 "near_tie"}}]}]}
    SUMMARY = {"num_prompts", "num_tokens", "seconds", "tokens_per_s",
               "speedup": float | null,      # tokens/s over hf-greedy's on the same prompts
               "itl_p50_ms", "itl_p90_ms", "ttft_mean_ms",
               "steps", "drafted_tokens": int | null, "accepted_tokens",
               "alpha": float | null,        # null: no drafting, or not observable (HF peers)
               "tau": float | null, "acceptance_by_depth": [float, ...],
               "num_identical": int, "identical": bool,   # token-for-token vs hf-greedy
               "divergence": {"num_different", "first_difference_mean", "num_near_tie", "num_not_near_tie"},
                                                          # overall only, when an output differs
               "num_fallbacks": int,   # requests the engine switched to plain decoding (--no-fallback: 0)
               "lookup_accepted": int, # accepted draft tokens that came from n-gram lookup chains
               "store_accepted": int}  # accepted draft tokens that came from reply-store chains
"""

from __future__ import annotations

import sys

from specheads.errors import UserError
from specheads.options import (STORE_HELP, add_device_options, add_lookup_option, add_output_json_option,
                               add_store_option, apply_device_options, human_output, write_json_report)
from specheads.runner import DTYPE_HELP, HEADS_HELP, TARGET_HELP


def int_list(text: str, option: str, example: str) -> list[int]:
    """A comma- or space-separated list of positive integers given to `option`."""
    try:
        values = [int(part) for part in text.replace(" ", ",").split(",") if part]
    except ValueError as err:
        raise ValueError(f"{option} expects comma-separated integers like {example}, got {text!r}") from err
    if not values or min(values) < 1:
        raise ValueError(f"{option} expects positive integers, got {text!r}")
    return values


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark plain, speculative and peer decoding on one prompt set")
    p.add_argument("--target", required=True,
                   help=TARGET_HELP)
    p.add_argument("--heads", action="append", default=[], metavar="DIR[,DIR...]",
                   help=HEADS_HELP + " (repeatable or comma-separated: benched side by side); "
                        "omit to bench only plain decoding and the peers")
    p.add_argument("--prompts", help="Spec-Bench question.jsonl (default: the shipped 6-category set)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--per-category", type=int, default=None, metavar="N",
                   help="use only the first N prompts of each category (applied before --limit)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--turns", type=int, default=1, choices=(1, 2),
                   help="2: after the first turns, decode each prompt's second turn (MT-bench's), its conversation "
                        "holding the reference's first reply; reported as 'CATEGORY (turn 2)'")
    p.add_argument("--passes", type=int, default=1, metavar="N",
                   help="serve the prompts N times over, in order; pass k's figures are its own categories, "
                        "'CATEGORY (pass k)': a workload that repeats (a learning store drafts pass 2 from pass 1)")
    p.add_argument("--tree-nodes", action="append", default=[], metavar="N[,N...]",
                   help="also bench calibrated trees of N draft nodes (repeatable or comma-separated)")
    p.add_argument("--prompt-lookup-num-tokens", type=int, default=10,
                   help="HF prompt-lookup draft length (0: skip prompt lookup)")
    add_lookup_option(p, 10, "the engine's n-gram lookup draft length, benched alone (engine-lookup) and with each "
                             "heads directory (engine-<heads>+lookup); 0: skip")
    add_store_option(p, STORE_HELP + ": benched alone (engine-store) and with each heads directory and lookup "
                                     "(engine-<heads>+lookup+store)")
    p.add_argument("--draft-model", help="small draft model for HF assisted generation (same tokenizer)")
    add_output_json_option(p, old_json="path")
    p.add_argument("--plot", metavar="OUT.png",
                   help="write a PNG of charts (acceptance by depth; speedup vs tree size; tokens/s per method "
                        "over prompts); needs matplotlib: pip install matplotlib")
    p.add_argument("--no-warmup", action="store_true", help="skip the short warm-up decode per method")
    p.add_argument("--no-fallback", action="store_true",
                   help="never let the engine switch a request to plain decoding (measures the heads themselves)")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    add_device_options(p)
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modeling code")
    p.add_argument("--llama-cpp", metavar="DIR", help="also bench llama.cpp (plain, n-gram, drafting with the EAGLE-3 "
                   "heads) from the llama-server in DIR, DIR/bin or DIR/build/bin")
    p.add_argument("--llama-cpp-draft-max", type=int, default=3, metavar="N",
                   help="draft tokens per llama.cpp EAGLE-3 step (--spec-draft-n-max)")
    p.add_argument("--llama-cpp-draft-p-min", type=float, default=0.0, metavar="P",
                   help="llama.cpp drafts only while the draft's top probability is >= P (--spec-draft-p-min; "
                        "default 0: always N tokens)")
    p.add_argument("--llama-cpp-args", metavar="FLAGS", help='more llama-server flags for every llama.cpp row, '
                   'as one shell-quoted string (e.g. "--poll 0")')


def run(args) -> int:
    from specheads.bench.prompts import encode_prompts, load_prompts, next_turn_prompts

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.passes < 1:
        raise ValueError(f"--passes must be >= 1, got {args.passes}")
    if args.passes > 1 and args.turns > 1:
        raise ValueError("--passes and --turns 2 do not combine: bench the repeats and the second turns apart")
    for flag, value in (("--lookup-num-tokens", args.lookup_num_tokens),
                        ("--prompt-lookup-num-tokens", args.prompt_lookup_num_tokens)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0 (0: skip that method), got {value}")
    apply_device_options(args)
    tree_nodes = [n for text in args.tree_nodes for n in int_list(text, "--tree-nodes", "8,16,32")]
    heads_dirs = [part for text in args.heads for part in text.split(",") if part.strip()]
    if tree_nodes and not heads_dirs:
        raise ValueError("--tree-nodes needs --heads")
    if args.plot:  # matplotlib is an optional extra: say so before the bench, not after it
        from specheads.bench.plot import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as err:
            raise UserError(f"--plot: {err}") from err
    llama_cpp_extra = []  # --llama-cpp-args as llama-server flags
    if args.llama_cpp is not None:  # a missing or too-old llama.cpp, or a bad flag, fails before any model loads
        from specheads.bench.llama_cpp import find_server, server_args
        from specheads.heads.artefacts.llama_cpp_serve import check_draft

        find_server(args.llama_cpp)
        check_draft(args.llama_cpp_draft_max, args.llama_cpp_draft_p_min)
        llama_cpp_extra = server_args(args.llama_cpp_args)
    prompts = load_prompts(args.prompts, limit=args.limit, per_category=args.per_category)
    # (read first: a bad prompts file fails before any model loads)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from specheads.bench.harness import format_report, heads_label, not_near_ties, run_bench
    from specheads.bench.step_costs import StepCostTable
    from specheads.heads.artefacts.heads_dir import load_heads, read_heads_config, read_tuning
    from specheads.heads.target.adapter import TargetAdapter
    from specheads.runner import check_store, load_target_and_tokenizer, resolve_target_name, store_drafter

    for directory in heads_dirs:  # a missing or foreign heads dir fails before the target loads
        read_heads_config(directory)
    check_store(args.store)  # so does a missing or corrupt store
    target, tokenizer = load_target_and_tokenizer(args.target, heads=heads_dirs, dtype=args.dtype, device=args.device,
                                                  trust_remote_code=args.trust_remote_code)
    store = store_drafter(args.store, None, target, tokenizer)
    heads_list, tuning = [], {}
    for directory in heads_dirs:
        module, heads_config = load_heads(directory, target=target.identity, device=args.device, dtype=target.dtype)
        # One directory keeps the short names engine-heads[...]; several are named by kind.
        label = "heads" if len(heads_dirs) == 1 else heads_label(heads_config, directory,
                                                                  {label for label, _, _ in heads_list})
        heads_list.append((label, module, heads_config))
        tuning[label] = read_tuning(directory)
    draft_model = None
    if args.draft_model:
        draft_path = resolve_target_name(args.draft_model)
        draft_model = AutoModelForCausalLM.from_pretrained(draft_path, dtype=target.dtype,
                                                           trust_remote_code=args.trust_remote_code)
        draft_model.to(args.device).eval()
    encoded = repeat_passes(encode_prompts(tokenizer, prompts), args.passes)
    config = {"target": args.target, "heads": heads_dirs or None, "prompts": args.prompts or "default",
              "store": args.store, "passes": args.passes, "turns": args.turns,
              "dtype_requested": args.dtype, "device": args.device, "cuda_graphs": args.cuda_graphs,
              "chat_template": bool(getattr(tokenizer, "chat_template", None)),
              "torch": torch.__version__, "transformers": transformers.__version__}
    later: list = []  # the second turns (--turns 2), built from the reference's first replies

    def next_turns(_, runs) -> list:
        later.extend(next_turn_prompts(tokenizer, prompts, [run.tokens for run in runs]))
        return later

    report = run_bench(target, encoded, args.max_new_tokens, config=config, warmup=not args.no_warmup,
                       log=lambda msg: print(msg, file=sys.stderr, flush=True), heads_list=heads_list,
                       tree_nodes=tree_nodes, fallback=not args.no_fallback,
                       cuda_graphs="capture" if args.cuda_graphs else None,
                       eos_token_id=tokenizer.eos_token_id,
                       prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
                       lookup_num_tokens=args.lookup_num_tokens, draft_model=draft_model, store=store,
                       next_turns=None if args.turns == 1 else next_turns,
                       scorer=lambda: TargetAdapter.from_pretrained(target.identity.name_or_path, dtype="float32",
                                                                    device=args.device,
                                                                    trust_remote_code=args.trust_remote_code))
    report["tuning"] = tuning
    if args.llama_cpp is not None:
        report["llama_cpp"] = llama_cpp_rows(args, llama_cpp_extra, report, encoded + later, target, heads_list,
                                             heads_dirs)
    report["step_costs"] = step_costs(target, heads_list)
    out = human_output(args)
    print(format_report(report), file=out)
    if "llama_cpp" in report:
        from specheads.bench.llama_cpp import format_llama_cpp

        print("\n" + format_llama_cpp(report["llama_cpp"]), file=out)
    for table in report["step_costs"]:
        print(f"\n### {'step costs with ' + table['heads'] if 'heads' in table else 'step costs'}\n\n"
              + StepCostTable.from_json(table).format(), file=out)
    if args.output_json:
        write_json_report(args.output_json, report)
    if args.plot:
        from specheads.bench.plot import write_plots

        write_plots(report, args.plot)
        print(f"plots: {args.plot}", file=sys.stderr)
    bugs = not_near_ties(report)
    if bugs:
        print(f"error: output differs from hf-greedy where the fp32 target has no near-tie, for {bugs}: that is not "
              f"rounding but a bug (tolerance {report['config']['tie_tolerance']} logits, bench/divergence.py)",
              file=sys.stderr)
    return 0


def repeat_passes(prompts: list, passes: int) -> list:
    """The prompts, then again for each later pass with its category marked '(pass k)'."""
    import dataclasses

    return prompts + [dataclasses.replace(prompt, category=f"{prompt.category} (pass {k})")
                      for k in range(2, passes + 1) for prompt in prompts]


def step_costs(target, heads_list: list[tuple]) -> list[dict]:
    """The step-cost table (bench/step_costs.py) of the target alone, or with each heads directory."""
    from specheads.bench.step_costs import measure_step_costs

    if not heads_list:
        return [measure_step_costs(target).to_json()]
    return [dict(measure_step_costs(target, module, config).to_json(), heads=label)
            for label, module, config in heads_list]


def llama_cpp_rows(args, extra_args: list[str], report: dict, encoded, target, heads_list: list[tuple],
                   heads_dirs: list[str]) -> dict:
    """bench/llama_cpp.py's rows: the converter beside DIR if it has one, else the pinned source's."""
    import torch

    from specheads.bench.llama_cpp import bench_llama_cpp
    from specheads.data.tiny_target import default_cache_dir
    from specheads.heads.artefacts.export_llama_cpp import LlamaCppError, find_converter, pinned_source

    try:
        converter = find_converter(args.llama_cpp)
    except LlamaCppError:
        converter = find_converter(pinned_source(default_cache_dir()))
    eagle3 = [(label, directory) for (label, _, config), directory in zip(heads_list, heads_dirs)
              if config.kind == "eagle3"]
    if len(eagle3) < len(heads_dirs):
        print("bench: llama.cpp drafts with EAGLE-3 heads only; the other heads get no llama.cpp row",
              file=sys.stderr)
    return bench_llama_cpp(args.llama_cpp, report, encoded, args.max_new_tokens,
                           target_dir=target.identity.name_or_path, heads=eagle3, converter=converter,
                           outtype="f32" if target.dtype == torch.float32 else "bf16",
                           draft_max=args.llama_cpp_draft_max, draft_p_min=args.llama_cpp_draft_p_min,
                           extra_args=extra_args,
                           log=lambda msg: print(msg, file=sys.stderr, flush=True))
