"""Whole training runs as a user or a scheduler drives them: SIGTERM preemption in a real
subprocess (stop, checkpoint, resume), the W&B run id kept across a resume, and the
periodic held-out eval. One process, no launcher; the tiny Llama and walks of test_training.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specheads.train import EXIT_STOPPED, main

from test_training import markov_walks, write_jsonl, write_recipe

RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def walks(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("walks") / "walks.jsonl", markov_walks())


def subprocess_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    return env


def test_sigterm_stops_after_the_step_with_a_checkpoint_and_a_rerun_finishes(tiny_llama_dir, walks, tmp_path):
    steps = 80  # far more than the steps run before SIGTERM lands (it is sent right after step 5)
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks, tmp_path / "run")
    overrides = ["--set", f"train.steps={steps}", "--set", "train.save_every=5", "--set", "train.log_every=1000"]
    latest = tmp_path / "run" / "checkpoints" / "latest"
    process = subprocess.Popen([sys.executable, "-m", "specheads.train", str(recipe), *overrides],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env())
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not latest.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before SIGTERM:\n" + process.communicate()[0][-3000:]
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=60)
    assert time.monotonic() - sent < 30, "SIGTERM was not handled promptly"
    assert process.returncode == EXIT_STOPPED, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    stopped = [line for line in out.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(stopped) == 1, out[-3000:]
    stopped_at = int(stopped[0].split("after step ")[1].split(";")[0])
    assert 0 < stopped_at < steps
    # The checkpoint is at the step the run reached, whether or not save_every falls on it.
    assert latest.read_text().strip() == f"step-{stopped_at:08d}"
    manifest = json.loads((latest.parent / f"step-{stopped_at:08d}" / "manifest.json").read_text())
    assert manifest["step"] == stopped_at and manifest["sampler"]["position"] == stopped_at * 8
    assert not (tmp_path / "run" / "heads").exists()

    rerun = subprocess.run([sys.executable, "-m", "specheads.train", str(recipe), *overrides], capture_output=True,
                           text=True, env=subprocess_env(), timeout=RUN_TIMEOUT_S)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "resuming from" in rerun.stdout and f"(step {stopped_at})" in rerun.stdout
    assert f"steps {stopped_at}->{steps}" in rerun.stdout
    assert latest.read_text().strip() == f"step-{steps:08d}"
    assert (tmp_path / "run" / "heads" / "model.safetensors").is_file()


def test_training_leaves_no_sigterm_handler_and_no_process_group(tiny_llama_dir, walks, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks, tmp_path / "run")
    assert main([str(recipe), "--set", "train.steps=2"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before
    # Destroyed before exit: left to the interpreter's teardown, gloo's threads can abort a
    # rank that finished (SIGABRT, "terminate called without an active exception").
    assert not torch.distributed.is_initialized()
    assert main([str(recipe), "--set", "train.steps=3"]) == 0  # a second run starts a new group


def test_a_resumed_run_continues_the_same_wandb_run(tiny_llama_dir, walks, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    import wandb

    ids = []
    real_init = wandb.init

    def recording_init(*args, **kwargs):
        ids.append((kwargs.get("id"), kwargs.get("resume")))
        return real_init(*args, **kwargs)

    monkeypatch.setattr(wandb, "init", recording_init)
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks, tmp_path / "run",
                          extra="tracking: wandb\nwandb:\n  project: specheads-tests\n")
    assert main([str(recipe), "--set", "train.steps=4", "--set", "train.save_every=2"]) == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    run_id = json.loads((checkpoints / "step-00000004" / "manifest.json").read_text())["wandb_run_id"]
    assert run_id and json.loads((checkpoints / "step-00000002" / "manifest.json").read_text())["wandb_run_id"] == run_id
    # A longer run resumes from step 4 and must log to the same W&B run.
    assert main([str(recipe), "--set", "train.steps=6", "--set", "train.save_every=2"]) == 0
    assert ids == [(run_id, "allow"), (run_id, "allow")]
    assert json.loads((checkpoints / "step-00000006" / "manifest.json").read_text())["wandb_run_id"] == run_id
    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    # wandb names offline runs offline-run-<time>-<id>, adding -1, -2 ... when two start in
    # the same second.
    assert len(runs) == 2 and all(re.search(rf"-{run_id}(-\d+)?$", r.name) for r in runs), runs
    # A fresh output dir gets a new id.
    other = write_recipe(tmp_path, tiny_llama_dir, walks, tmp_path / "other",
                         extra="tracking: wandb\nwandb:\n  project: specheads-tests\n")
    assert main([str(other), "--set", "train.steps=2"]) == 0
    assert ids[-1][0] != run_id


def test_estimated_chain_tau_is_one_plus_the_sum_of_cumulative_products():
    from specheads.training.tracking import estimated_chain_tau, eval_metrics

    assert estimated_chain_tau([]) == 1.0
    assert estimated_chain_tau([0.5, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert estimated_chain_tau([1.0, 0.0, 1.0]) == pytest.approx(2.0)
    metrics = eval_metrics([0.8, 0.5])
    assert metrics == pytest.approx({"eval/head0_top1": 0.8, "eval/head1_top1": 0.5,
                                     "eval/chain_tau_estimate": 1 + 0.8 + 0.4})


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_held_out_eval_is_logged_every_eval_every_steps(kind, tiny_llama_dir, walks, tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks, tmp_path / "run")
    overrides = ["--set", "train.steps=7", "--set", "train.eval_every=3", "--set", "train.eval_batches=1",
                 "--set", "train.log_every=1", "--set", f"heads.kind={kind}"]
    if kind == "eagle3":
        overrides += ["--set", "heads.ttt_steps=2", "--set", "heads.draft_vocab_size=64",
                      "--set", "heads.intermediate_size=32"]
    assert main([str(recipe), *overrides]) == 0
    lines = capsys.readouterr().out.splitlines()
    evals = [line for line in lines if line.startswith("eval step ")]
    assert [line.split()[2] for line in evals] == ["3/7", "6/7"], evals
    depths = 3 if kind == "medusa" else 2
    for line in evals:
        top1 = [float(x) for x in line.split("top1 ")[1].split(" |")[0].split()]
        tau = float(line.split("chain tau est ")[1])
        assert len(top1) == depths and all(0.0 <= p <= 1.0 for p in top1)
        expected, run = 1.0, 1.0
        for p in top1:
            run *= p
            expected += run
        assert tau == pytest.approx(expected, abs=2e-3)
    # Eval lines come right after that step's train line, and training continued after them.
    assert lines[lines.index(evals[0]) - 1].startswith("step 3/7 ")
    assert any(line.startswith("step 7/7 ") for line in lines)


def test_eval_every_zero_logs_no_eval(tiny_llama_dir, walks, tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks, tmp_path / "run")
    assert main([str(recipe), "--set", "train.steps=3", "--set", "train.log_every=1"]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval step")]


@pytest.mark.slow  # DeepSpeedCPUAdam is JIT-built with the host compiler on first use (about a minute)
def test_zero2_with_the_optimizer_offloaded_to_cpu_trains(tiny_llama_dir, walks, tmp_path, capsys):
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks, tmp_path / "run")
    assert main([str(recipe), "--set", "train.steps=3", "--set", "train.zero_stage=2", "--set",
                 "train.offload_optimizer=cpu", "--set", "train.log_every=1"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 2" in out and "step 3/3" in out
    assert (tmp_path / "run" / "heads" / "model.safetensors").is_file()
