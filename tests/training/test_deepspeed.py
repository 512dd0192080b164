"""Two CPU ranks through the real `deepspeed --num_gpus 2 --module specheads.train` launcher:
ZeRO-2 training writes a heads directory, and a run killed with SIGKILL after its first
checkpoint resumes on re-run, finishes at the configured step and ends with the same
weights as an uninterrupted run; SIGTERM to the process group stops both ranks after the same
step with a checkpoint; ZeRO-3 partitions the frozen target (each rank holds about half).

The first multi-rank DeepSpeed run on a machine JIT-builds its shm comm op (about a
minute); later runs reuse the torch extensions cache.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specheads.heads.artefacts.heads_dir import load_heads

from test_training import markov_walks, write_jsonl, write_recipe

STEPS = 60
SAVE_EVERY = 5
LAUNCH_TIMEOUT_S = 600

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_env() -> dict:
    """This process's environment minus any rank variables an in-process run left behind."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["WANDB_MODE"] = "offline"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launch(recipe: Path, *overrides: str) -> subprocess.Popen:
    port = free_port()
    # The launcher of this interpreter's deepspeed (a `deepspeed` found on PATH may be another
    # Python's, whose ranks would import another specheads or none)
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port), "--module", "specheads.train",
               str(recipe)]
    for override in overrides:
        command += ["--set", override]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=launcher_env(), start_new_session=True)
    process.master_port = port
    return process


def launch_until_first_checkpoint(recipe: Path, output_dir: Path, before: str) -> tuple[subprocess.Popen, Path]:
    """Launch the two-rank run; -> (the process, its checkpoints/latest) once it has written a
    checkpoint and still runs."""
    latest = output_dir / "checkpoints" / "latest"
    process = launch(recipe, *OVERRIDES)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not latest.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, f"the run ended before {before}:\n" + process.communicate()[0][-3000:]
    return process, latest


def shm_buffers(port: int) -> list[Path]:
    """DeepSpeed's CPU allreduce buffers of the run on `port` still in /dev/shm."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def finish(process: subprocess.Popen) -> str:
    try:
        out, _ = process.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        pytest.fail(f"deepspeed run timed out:\n{out[-4000:]}")
    assert process.returncode == 0, f"deepspeed run failed ({process.returncode}):\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds")
    walks = write_jsonl(tmp / "walks.jsonl", markov_walks())
    return tmp, tiny_llama_dir, walks


def recipe_for(setup, name: str) -> tuple[Path, Path]:
    tmp, target, walks = setup
    (tmp / name).mkdir()
    output_dir = tmp / name / "run"
    recipe = write_recipe(tmp / name, target, walks, output_dir)
    return recipe, output_dir


OVERRIDES = (f"train.steps={STEPS}", f"train.save_every={SAVE_EVERY}", "train.zero_stage=2",
             "train.micro_batch_size=4", "train.log_every=20")


@pytest.fixture(scope="module")
def uninterrupted(setup) -> tuple[Path, str]:
    recipe, output_dir = recipe_for(setup, "uninterrupted")
    process = launch(recipe, *OVERRIDES)
    out = finish(process)
    assert shm_buffers(process.master_port) == [], "the ranks left their shared-memory buffers in /dev/shm"
    return output_dir, out


def test_two_rank_zero2_run_writes_heads(uninterrupted, tiny_llama_dir):
    output_dir, out = uninterrupted
    assert "2 rank(s), ZeRO stage 2" in out, out[-3000:]
    assert out.count(f"step {STEPS}/{STEPS} ") == 1  # only rank 0 reports
    heads, config = load_heads(output_dir / "heads")
    assert config.num_heads == 3 and config.tree["num_nodes"] >= 1
    assert config.tree["expected_accepted_draft_tokens"] > 0
    manifest = json.loads((output_dir / "checkpoints" / f"step-{STEPS:08d}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["zero_stage"] == 2
    assert manifest["files"] == ["heads.safetensors", "rank-00000.pt", "rank-00001.pt"]
    # Each rank read its own micro batch of 4 per step: 2 x 4 blocks consumed per step.
    assert manifest["sampler"]["position"] == STEPS * 4 * 2
    top1 = config.calibration["top1"]
    assert min(top1) > 0.1, top1  # trained (untrained heads sit near 0.05 on this data)


def test_killed_run_resumes_and_finishes_at_the_configured_step(setup, uninterrupted):
    recipe, output_dir = recipe_for(setup, "killed")
    process, latest = launch_until_first_checkpoint(recipe, output_dir, "it could be killed")
    os.killpg(process.pid, signal.SIGKILL)  # launcher and both ranks, mid-run
    process.communicate()
    for buffer in shm_buffers(process.master_port):  # a killed rank cannot unlink its own
        buffer.unlink()
    killed_at = int(latest.read_text().strip().split("-")[1])
    assert 0 < killed_at < STEPS
    assert not (output_dir / "heads").exists()

    out = finish(launch(recipe, *OVERRIDES))
    resumed_from = [line for line in out.splitlines() if "resuming from" in line]
    assert resumed_from and f"(step {killed_at})" in resumed_from[0], out[-3000:]
    assert f"steps {killed_at}->{STEPS}" in out
    assert latest.read_text().strip() == f"step-{STEPS:08d}"
    manifest = json.loads((output_dir / "checkpoints" / f"step-{STEPS:08d}" / "manifest.json").read_text())
    assert manifest["step"] == STEPS
    _, config = load_heads(output_dir / "heads")
    assert config.tree is not None

    # Resuming is exact: the same weights as the run that was never interrupted.
    straight = load_file(str(uninterrupted[0] / "heads" / "model.safetensors"))
    resumed = load_file(str(output_dir / "heads" / "model.safetensors"))
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_two_rank_zero3_partitions_the_frozen_target_and_trains(setup, tiny_llama_dir):
    recipe, output_dir = recipe_for(setup, "zero3")
    out = finish(launch(recipe, "train.steps=10", "train.save_every=5", "train.zero_stage=3",
                        "train.micro_batch_size=4", "train.log_every=5", "train.eval_every=5"))
    assert "2 rank(s), ZeRO stage 3" in out, out[-3000:]
    # Both ranks print to one pipe, unbuffered: two reports can share a line, so match, don't split.
    found = re.findall(r"\[rank (\d)\] ZeRO-3 target: (\d+) of (\d+) parameters", out)
    resident = {int(rank): (int(local), int(total)) for rank, local, total in found}
    assert set(resident) == {0, 1}, out[-3000:]
    for local, total in resident.values():
        assert 0 < local < total and 2 * local >= total  # each rank holds about half of every weight
    assert out.count("eval step 5/10") == 1 and out.count("eval step 10/10") == 1, out[-3000:]
    _, config = load_heads(output_dir / "heads")
    assert config.num_heads == 3 and config.tree["num_nodes"] >= 1
    manifest = json.loads((output_dir / "checkpoints" / "step-00000010" / "manifest.json").read_text())
    assert manifest["zero_stage"] == 3 and manifest["world_size"] == 2


@pytest.mark.slow  # 38 s; SIGTERM in one process: tests/training/test_training_system.py, by default
def test_sigterm_stops_both_ranks_after_the_same_step_with_a_checkpoint(setup, uninterrupted):
    """SIGTERM to the whole process group (what a scheduler sends): both ranks finish the step,
    agree to stop, save one whole checkpoint at that step and exit; a re-run finishes exactly."""
    recipe, output_dir = recipe_for(setup, "sigterm")
    process, latest = launch_until_first_checkpoint(recipe, output_dir, "SIGTERM")
    os.killpg(process.pid, signal.SIGTERM)
    out, _ = process.communicate(timeout=120)
    assert process.returncode != 0  # the launcher reports an interrupted run as a failure
    stopped = re.findall(r"stopped by SIGTERM after step (\d+)", out)
    assert stopped, out[-3000:]
    stopped_at = int(stopped[0])
    assert 0 < stopped_at < STEPS and set(stopped) == {stopped[0]}  # every rank that reported agrees
    assert latest.read_text().strip() == f"step-{stopped_at:08d}"
    assert not (output_dir / "heads").exists()

    out = finish(launch(recipe, *OVERRIDES))
    assert f"steps {stopped_at}->{STEPS}" in out, out[-3000:]
    straight = load_file(str(uninterrupted[0] / "heads" / "model.safetensors"))
    resumed = load_file(str(output_dir / "heads" / "model.safetensors"))
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_a_comm_op_build_killed_midway_does_not_stop_later_runs():
    """DeepSpeed's CPU comm op builds behind a lock file that a killed build leaves behind; the
    next run waited on it forever. The run clears it, says so, and loads the op."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))
    baton = build_dir / "lock"
    build_dir.mkdir(parents=True, exist_ok=True)
    baton.touch()  # what a build killed between taking the lock and finishing leaves
    try:
        proc = subprocess.run([sys.executable, "-c", "from specheads.training.distributed import build_comm_op; "
                               "build_comm_op()"], capture_output=True, text=True, timeout=900)
    finally:
        left = baton.exists()
        baton.unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stderr
    assert f"removed {baton}" in proc.stderr
    assert not left
