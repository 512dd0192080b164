"""train.precision bf16 on a CPU rank: the heads' forward and loss under torch.autocast(bf16) over
an fp32 engine (training/ds_config.py, cpu_autocast). Its losses stay within BF16_TOLERANCE of the
fp32 run's for the same seed and data, a killed run resumes bit-identically in each dtype, and
the fp32 losses are untouched (tests/training/test_pinned_losses.py pins them)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from specheads.train import main
from specheads.training import steps, trainer
from specheads.training.config import load_recipe
from specheads.training.ds_config import build_ds_config, cpu_autocast

from test_feature_cache import EAGLE, recipe_for
from test_pinned_losses import RUN_ARGS, run_losses, walks  # noqa: F401 (fixture)

# Relative difference of any head's (TTT step's) KL, bf16 autocast vs fp32, over the first
# 4 steps on the tiny target (KL about 4-5 nats): bf16's 8-bit mantissa rounds every matmul input
# by up to 2**-9 relative; measured at most 0.015% (Medusa) and 0.08% (EAGLE-3).
BF16_TOLERANCE = 5e-3


def hex_to_tensor(rows: list[list[str]]) -> torch.Tensor:
    return torch.tensor([[float.fromhex(x) for x in row] for row in rows])


@pytest.mark.parametrize("heads", ["medusa", "eagle3"])
def test_bf16_losses_agree_with_fp32(heads, tiny_llama_dir, walks, tmp_path, monkeypatch):  # noqa: F811
    extra = EAGLE if heads == "eagle3" else ""
    fp32 = hex_to_tensor(run_losses(recipe_for(tmp_path, tiny_llama_dir, walks, "a", extra), monkeypatch))
    bf16 = hex_to_tensor(run_losses(recipe_for(tmp_path, tiny_llama_dir, walks, "b", extra), monkeypatch,
                                    "train.precision=bf16"))
    assert not torch.equal(bf16, fp32)  # bf16 really ran
    torch.testing.assert_close(bf16, fp32, rtol=BF16_TOLERANCE, atol=0.0)


def test_bf16_on_a_cpu_is_autocast_over_an_fp32_engine(tiny_llama_dir, walks, tmp_path):  # noqa: F811
    recipe = load_recipe(recipe_for(tmp_path, tiny_llama_dir, walks, "c", ""), ["train.precision=bf16"])
    assert cpu_autocast(recipe.train, "cpu") and not cpu_autocast(recipe.train, "cuda:0")
    assert not cpu_autocast(recipe.train, "cpu", lora=True)  # LoRA keeps DeepSpeed's bf16
    assert "bf16" not in build_ds_config(recipe.train, 1, autocast=True)
    assert build_ds_config(recipe.train, 1)["bf16"] == {"enabled": True}


@pytest.mark.parametrize("precision,zero_stage", [("fp32", 2), ("bf16", 0), ("bf16", 2)])
def test_a_killed_run_resumes_bit_identically(precision, zero_stage, tiny_llama_dir, walks, tmp_path,  # noqa: F811
                                              monkeypatch):
    args = [f"train.precision={precision}", f"train.zero_stage={zero_stage}", "train.save_every=2"]
    straight = recipe_for(tmp_path, tiny_llama_dir, walks, "straight", EAGLE)
    losses = run_losses(straight, monkeypatch, *args)
    resumed = recipe_for(tmp_path, tiny_llama_dir, walks, "resumed", EAGLE)
    run_losses(resumed, monkeypatch, *args)
    checkpoints = tmp_path / "resumed" / "run" / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000004")  # the run died after step 2's checkpoint
    shutil.rmtree(tmp_path / "resumed" / "run" / "heads")
    (checkpoints / "latest").write_text("step-00000002\n")
    seen = []
    real_step = steps.train_step
    monkeypatch.setattr(trainer, "train_step", lambda *a, **k: seen.append(real_step(*a, **k)) or seen[-1])
    assert main([str(resumed), *RUN_ARGS, *[x for arg in args for x in ("--set", arg)]]) == 0
    assert [[float(x).hex() for x in loss.tolist()] for loss, _, _ in seen] == losses[2:]
    a = load_file(str(tmp_path / "straight" / "run" / "heads" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "run" / "heads" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
