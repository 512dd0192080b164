"""Pinned losses: the per-step losses of short fp32 runs on the tiny target, bit for bit.

A refactor or a speed-up of the training path must leave these exactly as they are (torchtitan's
rule: the loss is bit-identical under a fixed seed). Four runs of STEPS steps each: Medusa
online, EAGLE-3 online, EAGLE-3 from a feature cache (full logits, and top-16 logits), and
Medusa-2 with LoRA. What is pinned is every step's per-head (per TTT step) KL that train_step
returns, as float.hex() of the float32 value.

Bit for bit on one machine; across CPUs, torch's GEMMs pick other kernels (other summation
orders), so a loss may land a float32 ulp or two away: seen once (2026-11-26, on another host
of the 2-core VM), where three of the five runs moved by 1 ulp. The check allows
MAX_ULPS float32 ulps (a relative 1e-6), and says when the match was not exact; a change of
loss, data order, seed or precision moves these in the second or third digit, far past that.

When a change is meant to alter the numbers (a new loss, another data order), re-pin with
    SPECHEADS_REPIN=1 pytest tests/training/test_pinned_losses.py -s
which prints the new table, and say in the commit why they moved.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch

from specheads.train import main
from specheads.training import steps, trainer

from test_feature_cache import EAGLE, build_cache, recipe_for
from test_lora import LORA, target_with_tokenizer  # noqa: F401 (fixture)
from test_training import markov_walks, write_jsonl

STEPS = 4
MAX_ULPS = 8  # float32 ulps a pinned loss may move across machines (module doc)
RUN_ARGS = [arg for override in (f"train.steps={STEPS}", "train.micro_batch_size=4", "train.warmup_steps=2",
                                  "train.save_every=100", "train.log_every=100", "calibrate.eval_batches=1",
                                  "calibrate.num_nodes=4") for arg in ("--set", override)]

# run name -> per step, the per-head (per TTT step) losses as float.hex()
PINNED = {
    'medusa': [
        ['0x1.2f67e00000000p+2', '0x1.3199760000000p+2', '0x1.2d96d80000000p+2'],
        ['0x1.3ae4660000000p+2', '0x1.2ffd2e0000000p+2', '0x1.2e74f60000000p+2'],
        ['0x1.2ac8de0000000p+2', '0x1.0e4c2e0000000p+2', '0x1.2c94240000000p+2'],
        ['0x1.25f4c20000000p+2', '0x1.25fdf60000000p+2', '0x1.3036860000000p+2'],
    ],
    'eagle3': [
        ['0x1.376a4c0000000p+2', '0x1.255b280000000p+2', '0x1.39a92a0000000p+2'],
        ['0x1.363e380000000p+2', '0x1.2529320000000p+2', '0x1.2f053e0000000p+2'],
        ['0x1.3a49200000000p+2', '0x1.270f780000000p+2', '0x1.3119da0000000p+2'],
        ['0x1.02079e0000000p+2', '0x1.f1f64a0000000p+1', '0x1.0390860000000p+2'],
    ],
    'eagle3-cache-topall': [
        ['0x1.376a4c0000000p+2', '0x1.255b280000000p+2', '0x1.39a92a0000000p+2'],
        ['0x1.363e380000000p+2', '0x1.2529320000000p+2', '0x1.2f053e0000000p+2'],
        ['0x1.3a49200000000p+2', '0x1.270f780000000p+2', '0x1.3119da0000000p+2'],
        ['0x1.02079e0000000p+2', '0x1.f1f64a0000000p+1', '0x1.0390860000000p+2'],
    ],
    'eagle3-cache-top16': [
        ['0x1.79e9fc0000000p+2', '0x1.6750a80000000p+2', '0x1.804df60000000p+2'],
        ['0x1.7a07ee0000000p+2', '0x1.65d4180000000p+2', '0x1.73b9a20000000p+2'],
        ['0x1.7cc6680000000p+2', '0x1.65c30c0000000p+2', '0x1.70c8740000000p+2'],
        ['0x1.43938e0000000p+2', '0x1.367c3a0000000p+2', '0x1.44fc0c0000000p+2'],
    ],
    'medusa-lora': [
        ['0x1.2f67e00000000p+2', '0x1.3199760000000p+2', '0x1.2d96d80000000p+2'],
        ['0x1.3ae4660000000p+2', '0x1.2ffd2e0000000p+2', '0x1.2e74f60000000p+2'],
        ['0x1.2ac8de0000000p+2', '0x1.0e4c2e0000000p+2', '0x1.2c94240000000p+2'],
        ['0x1.25b08c0000000p+2', '0x1.261e500000000p+2', '0x1.303b620000000p+2'],
    ],
}


@pytest.fixture(scope="module")
def walks(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("pinned-data") / "walks.jsonl", markov_walks(num_records=60))


def run_losses(recipe: Path, monkeypatch, *overrides: str) -> list[list[str]]:
    """Train STEPS steps through specheads.train.main; -> every step's head losses as float.hex()."""
    seen = []
    real_step = steps.train_step  # the original, not an earlier test's wrapper

    def recording_step(*args, **kwargs):
        head_loss, head_top1, num_tokens = real_step(*args, **kwargs)
        seen.append([float(x).hex() for x in head_loss.to(torch.float32).tolist()])
        return head_loss, head_top1, num_tokens

    monkeypatch.setattr(trainer, "train_step", recording_step)
    args = [str(recipe), *RUN_ARGS]
    for override in overrides:
        args += ["--set", override]
    assert main(args) == 0
    assert len(seen) == STEPS
    return seen


def ulps_apart(a: str, b: str) -> int:
    """How many float32 values lie between two float.hex() losses (both >= 0: a KL)."""
    a_bits, b_bits = (struct.unpack("<i", struct.pack("<f", float.fromhex(x)))[0] for x in (a, b))
    return abs(a_bits - b_bits)


def distance(losses: list[list[str]], pinned: list[list[str]]) -> int:
    """The largest ulp distance between two runs' losses, step by step and head by head."""
    assert [len(step) for step in losses] == [len(step) for step in pinned], "another number of steps or heads"
    return max(ulps_apart(a, b) for step, pinned_step in zip(losses, pinned) for a, b in zip(step, pinned_step))


def check(name: str, losses: list[list[str]]) -> None:
    if os.environ.get("SPECHEADS_REPIN"):
        print(f"\n    {name!r}: {losses!r},")
        return
    apart = distance(losses, PINNED[name])
    assert apart <= MAX_ULPS, (f"{name}: the fp32 losses moved by up to {apart} float32 ulps (re-pin only if that "
                               f"is intended): {losses}")
    if apart:
        print(f"{name}: within {apart} float32 ulp(s) of the pinned losses, not bit for bit (another CPU's kernels)")


def test_the_check_fails_on_a_real_change():
    """The ulp allowance covers kernel choice, not a changed loss: a relative 1e-5 fails."""
    pinned = PINNED["eagle3"]
    nudged = [[float.hex(float(struct.unpack("<f", struct.pack("<f", float.fromhex(x) * (1 + 1e-5)))[0]))
               for x in step] for step in pinned]
    assert distance(pinned, pinned) == 0
    assert distance(nudged, pinned) > MAX_ULPS
    with pytest.raises(AssertionError, match="moved by up to"):
        check("eagle3", nudged)


def test_medusa_online(tiny_llama_dir, walks, tmp_path, monkeypatch):
    check("medusa", run_losses(recipe_for(tmp_path, tiny_llama_dir, walks, "m", ""), monkeypatch))


def test_eagle3_online(tiny_llama_dir, walks, tmp_path, monkeypatch):
    check("eagle3", run_losses(recipe_for(tmp_path, tiny_llama_dir, walks, "e", EAGLE), monkeypatch))


@pytest.mark.parametrize("top_k", [None, 16])
def test_eagle3_from_the_feature_cache(top_k, tiny_llama_dir, walks, tmp_path, monkeypatch):
    recipe = recipe_for(tmp_path, tiny_llama_dir, walks, "c", EAGLE)
    cache = build_cache(recipe, tmp_path / "cache", top_k=top_k)
    losses = run_losses(recipe, monkeypatch, f"data.feature_cache={cache}")
    check(f"eagle3-cache-top{top_k or 'all'}", losses)


def test_medusa_lora(target_with_tokenizer, walks, tmp_path, monkeypatch):  # noqa: F811
    recipe = recipe_for(tmp_path, target_with_tokenizer, walks, "l", LORA.replace("heads_warmup_steps: 4",
                                                                                  "heads_warmup_steps: 2"))
    check("medusa-lora", run_losses(recipe, monkeypatch))
