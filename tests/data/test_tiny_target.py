"""The embedded target: a miniature build end to end, the cache and its lock, and the real
default build's quality (held-out loss against a unigram baseline)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import torch

from specheads.data import tiny_target
from specheads.data.tiny_target import (DEFAULT_SPEC, DEFAULT_TARGET_NAME, TinyTargetSpec,
                                        build_tiny_target, default_cache_dir, read_build_info,
                                        resolve_target)

MINI_SPEC = TinyTargetSpec(
    vocab_size=320, tokenizer_train_chars=200_000, hidden_size=32, intermediate_size=64,
    num_layers=2, num_attention_heads=4, num_key_value_heads=2, context_length=64,
    max_position_embeddings=128, num_steps=4, batch_size=4, warmup_steps=2,
    max_corpus_chars=200_000, num_eval_blocks=8)

SOURCE_TEXT = 'def f(x):\n    """Dö it ✓."""\r\n\treturn {"a": x ** 2}  # tail\n\n'


def _count_builds(monkeypatch) -> list[Path]:
    built = []
    real_build = tiny_target._build_into

    def counting_build(directory, *args, **kwargs):
        built.append(directory)
        return real_build(directory, *args, **kwargs)

    monkeypatch.setattr(tiny_target, "_build_into", counting_build)
    return built


def test_mini_build_loads_round_trips_and_is_reused(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    built = _count_builds(monkeypatch)
    path = build_tiny_target(cache_dir=tmp_path, spec=MINI_SPEC, progress=False)
    assert path.parent == tmp_path / "targets" and path.name.startswith("tiny-llama-")
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []  # no temp left

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert tokenizer.decode(tokenizer(SOURCE_TEXT)["input_ids"]) == SOURCE_TEXT
    assert tokenizer.eos_token_id == model.config.eos_token_id == model.generation_config.eos_token_id
    assert tokenizer.pad_token_id == model.generation_config.pad_token_id != tokenizer.eos_token_id
    assert model.config.vocab_size == len(tokenizer) == MINI_SPEC.vocab_size
    assert not model.config.tie_word_embeddings

    info = read_build_info(path)
    assert info["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert info["train_tokens"] == MINI_SPEC.num_steps * MINI_SPEC.batch_size * MINI_SPEC.context_length
    assert info["heldout_loss"] > 0 and info["unigram_loss"] > 0

    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_target(cache_dir=tmp_path, spec=MINI_SPEC, progress=False) == path
    assert len(built) == 1 and (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_concurrent_builders_build_once(tmp_path, monkeypatch):
    calls = []

    def fake_build(directory, spec, progress, name):
        calls.append(name)
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(tiny_target, "_build_into", fake_build)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(build_tiny_target(tmp_path, MINI_SPEC)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(paths)) == 1 and (paths[0] / "config.json").exists()
    build_tiny_target(tmp_path, MINI_SPEC, force=True)
    assert len(calls) == 2 and (paths[0] / "config.json").exists()


def test_cache_dir_and_spec_hash(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECHEADS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "specheads"
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    assert tiny_target.target_dir(spec=DEFAULT_SPEC) != tiny_target.target_dir(spec=MINI_SPEC)
    same_spec = dataclasses.replace(MINI_SPEC)
    assert tiny_target.target_dir(spec=same_spec) == tiny_target.target_dir(spec=MINI_SPEC)
    assert tiny_target.target_dir(tmp_path, MINI_SPEC).parent == tmp_path / "targets"


def test_resolve_target_passes_other_names_through():
    assert resolve_target("org/model") == "org/model"
    assert resolve_target("/some/local/dir") == "/some/local/dir"
    assert DEFAULT_TARGET_NAME == "embedded:tiny"


def test_embedded_target_is_a_real_language_model(embedded_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = read_build_info(embedded_target_dir)
    assert info["heldout_loss"] < info["unigram_loss"] - 1.0, info
    tokenizer = AutoTokenizer.from_pretrained(embedded_target_dir)
    model = AutoModelForCausalLM.from_pretrained(embedded_target_dir).eval()
    assert tokenizer.decode(tokenizer(SOURCE_TEXT)["input_ids"]) == SOURCE_TEXT
    prompt = tokenizer("import os\n\n\ndef ", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    new_text = tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert output.shape[1] > prompt["input_ids"].shape[1] and new_text.strip()


def test_resolve_embedded_name_uses_the_cached_build(embedded_target_dir):
    assert Path(resolve_target(DEFAULT_TARGET_NAME, progress=False)) == embedded_target_dir
