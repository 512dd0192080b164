"""A checkpoint that runs out of disk space (training/checkpoint.py): one line naming the
directory, what the checkpoint needs and what is free, exit status 2, nothing partial left,
`latest` still on the last whole checkpoint, and a re-run that resumes from it exactly.

The faults are injected where the bytes are written: torch.save raising what it raises on a
full disk (OSError ENOSPC, or its zip writer's "unexpected pos" while the disk reports no free
space), and a disk that reports too little free space before the save starts. Everything else
is a real training run (specheads.train.main, DeepSpeed on one CPU rank)."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specheads.train import main
from specheads.training import checkpoint

from test_training import markov_walks, write_jsonl, write_recipe

TORCH_FULL_DISK_ERROR = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"


@pytest.fixture(scope="module")
def walks_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "walks.jsonl", markov_walks())


@pytest.fixture(scope="module")
def straight_heads(tiny_llama_dir, walks_file, tmp_path_factory) -> dict:
    """The heads of an uninterrupted 20-step run (checkpoints at 10 and 20)."""
    tmp = tmp_path_factory.mktemp("straight")
    assert main([str(write_recipe(tmp, tiny_llama_dir, walks_file, tmp / "run"))]) == 0
    return load_file(str(tmp / "run" / "heads" / "model.safetensors"))


def failing_torch_save(monkeypatch, fail_on: str, error: Exception, on_failure=None):
    """torch.save that raises `error` for files under a directory named `fail_on`, after writing
    part of the file as a real writer would; other files are saved."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if fail_on in str(f):
            Path(f).write_bytes(b"PK" + b"\0" * 4096)
            if on_failure is not None:
                on_failure()
            raise error
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def assert_latest_is_step_10_and_nothing_partial(checkpoints: Path):
    assert (checkpoints / "latest").read_text().strip() == "step-00000010"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-00000010"]


def assert_resumes_to_the_straight_heads(recipe: Path, run: Path, straight_heads: dict, capsys):
    assert main([str(recipe)]) == 0
    assert "steps 10->20" in capsys.readouterr().out
    resumed = load_file(str(run / "heads" / "model.safetensors"))
    assert resumed.keys() == straight_heads.keys()
    assert all(torch.equal(resumed[name], straight_heads[name]) for name in resumed)


def test_enospc_in_a_checkpoint_is_one_line_and_loses_nothing(tiny_llama_dir, walks_file, straight_heads, tmp_path,
                                                              monkeypatch, capsys):
    recipe, run = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "run"), tmp_path / "run"
    failing_torch_save(monkeypatch, "step-00000020", OSError(errno.ENOSPC, "No space left on device"))
    assert main([str(recipe)]) == 2
    line = error_line(capsys.readouterr().err)
    checkpoints = run / "checkpoints"
    assert line.startswith("specheads train: error: disk full: checkpoint step-00000020 ran out of disk space")
    assert f"in {checkpoints};" in line and "needs about" in line and "is free now" in line
    assert "`latest` still names step-00000010" in line and "re-run the same command" in line
    assert_latest_is_step_10_and_nothing_partial(checkpoints)
    monkeypatch.undo()
    assert_resumes_to_the_straight_heads(recipe, run, straight_heads, capsys)
    card = (run / "heads" / "README.md").read_text()  # the final save writes the model card
    assert "library_name: specheads" in card and "tokens with loss" in card


def test_enospc_writing_the_final_heads_is_one_line_and_a_rerun_writes_them(tiny_llama_dir, walks_file,
                                                                           straight_heads, tmp_path, monkeypatch,
                                                                           capsys):
    from safetensors import SafetensorError

    from specheads.heads.artefacts import heads_dir

    recipe, run = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "run"), tmp_path / "run"

    def full_disk(tensors, filename, metadata=None):  # what safetensors raises when the disk fills
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(heads_dir, "save_file", full_disk)
    assert main([str(recipe)]) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"specheads train: error: disk full: the heads directory {run / 'heads'} ran out of disk "
                           "space while being written")
    assert "the final checkpoint step-00000020 is kept" in line and "re-run the same command" in line
    assert not (run / "heads").exists() and not list(run.glob(".heads.tmp-*"))
    monkeypatch.undo()
    assert main([str(recipe)]) == 0  # from the final checkpoint: calibration and the heads only
    resumed = load_file(str(run / "heads" / "model.safetensors"))
    assert all(torch.equal(resumed[name], straight_heads[name]) for name in straight_heads)


def test_torchs_unexpected_pos_on_a_full_disk_is_disk_full(tiny_llama_dir, walks_file, straight_heads, tmp_path,
                                                           monkeypatch, capsys):
    recipe, run = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "run"), tmp_path / "run"
    real_usage, disk = shutil.disk_usage, {"full": False}

    def disk_usage(path):  # the filesystem as it is once the writer has filled it
        usage = real_usage(path)
        return usage._replace(free=0) if disk["full"] else usage

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", disk_usage)
    failing_torch_save(monkeypatch, "step-00000020", RuntimeError(TORCH_FULL_DISK_ERROR),
                       on_failure=lambda: disk.update(full=True))
    assert main([str(recipe)]) == 2
    line = error_line(capsys.readouterr().err)
    assert "disk full: checkpoint step-00000020 ran out of disk space" in line and "0 B is free now" in line
    assert_latest_is_step_10_and_nothing_partial(run / "checkpoints")
    monkeypatch.undo()
    assert_resumes_to_the_straight_heads(recipe, run, straight_heads, capsys)


def test_the_same_torch_error_with_free_space_is_not_called_disk_full(tiny_llama_dir, walks_file, tmp_path,
                                                                      monkeypatch):
    recipe = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "run")
    failing_torch_save(monkeypatch, "step-00000010", RuntimeError(TORCH_FULL_DISK_ERROR))
    with pytest.raises(RuntimeError, match="unexpected pos"):  # a bug or an I/O error: its traceback stays
        main([str(recipe), "--set", "train.steps=10"])


def test_too_little_free_space_is_refused_before_writing(tiny_llama_dir, walks_file, straight_heads, tmp_path,
                                                         monkeypatch, capsys):
    recipe, run = write_recipe(tmp_path, tiny_llama_dir, walks_file, tmp_path / "run"), tmp_path / "run"
    real_usage, real_save = shutil.disk_usage, torch.save
    saved = []

    def disk_usage(path):  # 1 KiB free once step 10's checkpoint is whole
        usage = real_usage(path)
        return usage._replace(free=1024) if "step-00000020" in str(path) else usage

    def save(obj, f, *args, **kwargs):
        saved.append(str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(torch, "save", save)
    assert main([str(recipe)]) == 2
    line = error_line(capsys.readouterr().err)
    need = checkpoint.state_bytes(torch.load(run / "checkpoints" / "step-00000010" / "rank-00000.pt",
                                             weights_only=True))
    assert "disk full: checkpoint step-00000020 needs about" in line
    assert f"in {run / 'checkpoints'}, which has 1.0 KiB free" in line and "`latest` still names step-00000010" in line
    assert need > 1024 and not any("step-00000020" in name for name in saved)  # refused before writing
    assert_latest_is_step_10_and_nothing_partial(run / "checkpoints")
    monkeypatch.undo()
    assert_resumes_to_the_straight_heads(recipe, run, straight_heads, capsys)


def test_state_bytes_counts_each_storage_once():
    weight = torch.zeros(10, 4)  # 160 bytes
    state = {"a": weight, "view": weight[2:], "nested": [torch.zeros(3, dtype=torch.int64), {"x": 1.5}]}
    assert checkpoint.state_bytes(state) == 160 + 24


TWO_RANKS = """
import sys, types
from pathlib import Path
import torch.distributed as dist
from specheads.training import checkpoint
dist.init_process_group("gloo")
rank, root = dist.get_rank(), Path(sys.argv[1])
problem = "ran out of disk space while being written (test)" if rank == 1 else None
try:
    checkpoint._stop_if_any_rank_failed(problem, types.SimpleNamespace(device="cpu"), root, "step-00000020")
    print("no error")
except checkpoint.DiskFullError as err:
    print(err)
dist.destroy_process_group()
"""


def test_one_ranks_full_disk_stops_every_rank_with_one_line(tmp_path):
    """Two gloo ranks: rank 1's disk is full, rank 0's is not; both raise DiskFullError together
    (neither waits forever at a barrier) and rank 0 removes the partial checkpoint."""
    root = tmp_path / "checkpoints"
    (root / ".tmp-step-00000020").mkdir(parents=True)
    (root / ".tmp-step-00000020" / "rank-00000.pt").write_bytes(b"partial")
    (root / "latest").write_text("step-00000010\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(root)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)})
             for rank in range(2)]
    outputs = [process.communicate(timeout=120)[0].strip() for process in ranks]
    assert all(process.returncode == 0 for process in ranks)
    assert outputs[0].startswith("disk full: checkpoint step-00000020 could not be written by another rank")
    assert outputs[1].startswith("disk full: checkpoint step-00000020 ran out of disk space while being written")
    assert all("`latest` still names step-00000010" in out and "\n" not in out for out in outputs)
    assert sorted(p.name for p in root.iterdir()) == ["latest"]
