"""`specheads demo`: the whole product end to end on the embedded tiny target.

1. build (or reuse) the embedded target: a small Llama trained on the stdlib sources;
2. self-distillation data: corpus prompts continued by the target's own greedy decoding
   (data/regenerate.py distill_text), because at decode time the heads see exactly that;
3. train Medusa heads and 4. an EAGLE-3 head on it, both with DeepSpeed (the shipped tiny
   recipes);
5. tune both (bench/tune.py): measure tree sizes on this machine, store the fastest;
6. bench (bench/harness.py) HF greedy, the engine without heads, both heads (alone and with
   the engine's n-gram lookup drafts), that lookup alone and HF prompt lookup on the shipped
   prompt set, check outputs are identical, print the table and how to serve the fastest.

Every step reuses its output from an earlier run in --workdir unless --retrain.
"""

from __future__ import annotations

import shutil
import sys
import time
from importlib import resources
from pathlib import Path

# Self-distillation data size and tuning budget: sized so the whole demo fits 15 minutes on
# 2 CPU cores, the target build (~200 s) included.
DISTILL_RECORDS = 960
DISTILL_NEW_TOKENS = 128
TUNE_BUDGET_S = 45.0
TUNE_PROMPTS = 8
BENCH_LIMIT = None  # all prompts of the shipped set
DEMO_HEADS = {"medusa": "tiny-medusa.yaml", "eagle3": "tiny-eagle3.yaml"}
HEADS_KINDS = ("engine-heads", "engine-heads+lookup")  # bench method kinds that use the heads
# On top of the recipes (whose step budgets are equal, for comparing the methods): more steps
# on the distilled data, and EAGLE-3 unrolled only as deep as a CPU can afford to draft
# (each draft level is one head forward, ~0.6 ms on 2 cores).
DEMO_OVERRIDES = {"medusa": ["train.steps=1000", "train.save_every=1000"],  # 400 steps: tau 2.68, 1000: 2.86
                  "eagle3": ["train.steps=300", "train.save_every=300", "heads.ttt_steps=4"]}


def recipe_path(name: str) -> Path:
    return Path(str(resources.files("specheads.recipes") / name))


def default_recipe() -> Path:
    return recipe_path(DEMO_HEADS["medusa"])


def _step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def build_target() -> str:
    from specheads.data.tiny_target import read_build_info, resolve_target

    path = resolve_target("embedded:tiny", progress=True)
    info = read_build_info(path)
    print(f"target: {path}\n  {info.get('num_parameters', 0) / 1e6:.2f}M parameters, vocab "
          f"{info.get('vocab_size')}, held-out loss {info.get('heldout_loss', float('nan')):.3f} nats "
          f"(unigram baseline {info.get('unigram_loss', float('nan')):.3f})")
    return path


def distill_data(target_path: str, workdir: Path) -> Path:
    from specheads.data.regenerate import distill_text

    return distill_text(target_path, str(workdir / "distill.jsonl"), num_records=DISTILL_RECORDS,
                        max_new_tokens=DISTILL_NEW_TOKENS)


def train_heads(args, workdir: Path, kind: str, data: Path | None) -> Path:
    """Train one kind of heads into workdir/<kind>; -> its heads directory."""
    from specheads.train import main as train_main

    run_dir = workdir / kind
    heads_dir = run_dir / "heads"
    if (heads_dir / "config.json").exists() and not args.retrain:
        print(f"reusing {kind} heads in {heads_dir} (pass --retrain to train again)")
        return heads_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    recipe = args.recipe if (args.recipe and kind == "medusa") else str(recipe_path(DEMO_HEADS[kind]))
    overrides = ["--set", f"train.output_dir={run_dir}", *sum((["--set", o] for o in DEMO_OVERRIDES[kind]), [])]
    if data is not None:  # all distilled records (the recipes cap stdlib files at max_records)
        overrides += ["--set", f"data.source={data}", "--set", "data.max_records=null"]
    rc = train_main([recipe, *overrides, *sum((["--set", o] for o in args.overrides), [])])
    if rc != 0:
        raise RuntimeError(f"training the {kind} heads failed with exit status {rc}")
    return heads_dir


def tune_heads(target, tokenizer, heads_dir: Path, max_new_tokens: int, retune: bool) -> dict | None:
    from specheads.bench.prompts import encode_prompts, load_prompts
    from specheads.bench.tune import format_tuning, tune_heads_dir
    from specheads.heads.heads_dir import read_heads_config, read_tuning

    if not retune and (read_heads_config(heads_dir).tree or {}).get("tuned"):
        report = read_tuning(heads_dir)
        print(f"reusing the tuned tree of {heads_dir} (pass --retrain to tune again)")
        return report
    # Every other prompt of the shipped set: the bench below decodes all of them.
    prompts = [p.input_ids for p in encode_prompts(tokenizer, load_prompts())][1::2][:TUNE_PROMPTS]
    report = tune_heads_dir(target, str(heads_dir), prompts, max_new_tokens=max_new_tokens,
                            budget_s=TUNE_BUDGET_S, eos_token_id=tokenizer.eos_token_id)
    print(format_tuning(report))
    return report


def bench(target, tokenizer, heads_dirs: dict[str, Path], max_new_tokens: int) -> dict:
    from specheads.bench.harness import format_report, run_bench
    from specheads.bench.prompts import encode_prompts, load_prompts
    from specheads.heads.heads_dir import load_heads

    heads_list = []
    for label, directory in heads_dirs.items():
        module, config = load_heads(directory, target=target.identity, device=target.device, dtype=target.dtype)
        heads_list.append((label, module, config))
    prompts = encode_prompts(tokenizer, load_prompts(limit=BENCH_LIMIT))
    report = run_bench(target, prompts, max_new_tokens, config={"target": "embedded:tiny",
                                                                "heads": [str(d) for d in heads_dirs.values()]},
                       heads_list=heads_list, eos_token_id=tokenizer.eos_token_id, fallback=False,
                       log=lambda msg: print(msg, flush=True))
    print(format_report(report).split("\n### by category")[0])
    return report


def check_targets(report: dict) -> list[str]:
    """The demo's goals, each as a line 'ok' or 'MISSED'; heads alone and heads + n-gram lookup
    (serving/lookup.py) are reported apart."""
    methods = {m["name"]: m["overall"] for m in report["methods"]}
    speculative = [m for m in report["methods"] if m["kind"] in HEADS_KINDS]
    lookup = next((s for name, s in methods.items() if name.startswith("hf-prompt-lookup")), None)
    best = max(speculative, key=lambda m: m["overall"]["speedup"] or 0.0, default=None)
    lines = []
    if best is not None:
        speedup = best["overall"]["speedup"] or 0.0
        lines.append(f"{'ok' if speedup >= 2.0 else 'MISSED'}: best speculative speedup over HF greedy "
                     f"{speedup:.2f}x, {best['name']} (goal >= 2x)")
    for m in speculative:
        if m["tree"]["head_kind"] != "eagle3":
            continue
        eagle = m["overall"]
        if m["kind"] == "engine-heads":
            lines.append(f"{'ok' if (eagle['tau'] or 0) >= 3 else 'MISSED'}: EAGLE-3 tau {eagle['tau']:.2f} (goal >= 3)")
        if lookup:
            beats = eagle["tokens_per_s"] > lookup["tokens_per_s"]
            lines.append(f"{'ok' if beats else 'MISSED'}: {m['name']} {eagle['tokens_per_s']:.0f} tok/s vs HF prompt "
                         f"lookup {lookup['tokens_per_s']:.0f} tok/s")
    same = all(s["identical"] for s in methods.values())
    lines.append(f"{'ok' if same else 'MISSED'}: every output identical to HF greedy")
    return lines


def lookup_flag(heads_dir: Path, lookup_num_tokens: int) -> str:
    """The `--lookup` option serve needs for that much lookup, given what tune stored."""
    from specheads.heads.heads_dir import read_heads_config
    from specheads.serving.lookup import lookup_from_tree_field

    stored = lookup_from_tree_field(read_heads_config(heads_dir).tree)
    if (stored.num_tokens if stored else 0) == lookup_num_tokens:
        return ""
    return f" --lookup {lookup_num_tokens}"


def run_demo(args) -> int:
    from transformers import AutoTokenizer

    from specheads.heads.target import TargetAdapter

    start = time.perf_counter()
    workdir = Path(args.workdir)
    if args.retrain and workdir.exists():
        shutil.rmtree(workdir)
    _step("1/6 embedded target (built once, then cached)")
    target_path = build_target()
    _step(f"2/6 self-distillation data: {DISTILL_RECORDS} corpus prompts continued by the target (greedy)")
    data = distill_data(target_path, workdir)
    heads_dirs = {}
    for number, kind in ((3, "medusa"), (4, "eagle3")):
        _step(f"{number}/6 train {'Medusa heads' if kind == 'medusa' else 'an EAGLE-3 head'} with DeepSpeed")
        heads_dirs[kind] = train_heads(args, workdir, kind, data)
    target = TargetAdapter.from_pretrained(target_path)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    _step(f"5/6 tune both: tree sizes measured on this machine ({TUNE_BUDGET_S:.0f} s each)")
    for kind, directory in heads_dirs.items():
        tune_heads(target, tokenizer, directory, args.max_new_tokens, args.retrain)
    _step(f"6/6 bench: shipped prompt set x {args.max_new_tokens} new tokens, greedy, all methods interleaved "
          "(engine fallback to plain decoding off: every step speculates)")
    report = bench(target, tokenizer, heads_dirs, args.max_new_tokens)
    print()
    print("\n".join(check_targets(report)))
    print(f"demo wall time: {time.perf_counter() - start:.0f} s")
    fastest = max((m for m in report["methods"] if m["kind"] in HEADS_KINDS),
                  key=lambda m: m["overall"]["tokens_per_s"] or 0.0)
    kind = fastest["tree"]["head_kind"]
    print(f"\nServe the fastest method here ({fastest['name']}; OpenAI-compatible HTTP):\n"
          f"  specheads serve --target embedded:tiny --heads {heads_dirs[kind]}"
          f"{lookup_flag(heads_dirs[kind], fastest['tree'].get('lookup_num_tokens', 0))}\n"
          "Or generate / bench it yourself:\n"
          f"  specheads generate --target embedded:tiny --heads {heads_dirs['medusa']} --prompt 'def main(' "
          "--max-new-tokens 64\n"
          f"  specheads bench --target embedded:tiny --heads {heads_dirs['medusa']} --heads {heads_dirs['eagle3']}")
    if not all(m["overall"]["identical"] for m in report["methods"]):
        print("error: speculative output differed from HF greedy output", file=sys.stderr)
        return 1
    return 0
