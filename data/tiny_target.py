"""The embedded default target: a small Llama trained here, on the stdlib, and cached.

This module owns the name `embedded:tiny` and everything behind it: a byte-level BPE
tokenizer and a few-million-parameter `LlamaForCausalLM`, both trained on CPU from the
running interpreter's standard-library sources (`specheads.data.corpus`), evaluated on
the held-out split against a unigram baseline, and saved with `save_pretrained` under the
user cache (`default_cache_dir() / "targets"`). Nothing is downloaded.

The first `build_tiny_target()` takes a few minutes on 2 CPU cores; later calls return
the cached directory. Builds are atomic (temp dir + rename) and guarded by a file lock,
so concurrent processes build once. `resolve_target(name)` is how the CLI,
the demo and the tests turn the name into a local path.

Shape legend: N token-stream length, B batch, T block (context) length, V vocab size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specheads.heads.target import gguf
from specheads.heads.atomic import build_once, default_cache_dir

DEFAULT_TARGET_NAME = "embedded:tiny"
SMOLLM2_TARGET_NAME = "embedded:smollm2"  # SmolLM2-135M-Instruct, converted from its GGUF (heads/target/gguf.py)
EMBEDDED_TARGETS = (DEFAULT_TARGET_NAME, SMOLLM2_TARGET_NAME)
EOS_TOKEN = "<|endoftext|>"  # also the BOS token: documents are separated by it
PAD_TOKEN = "<|pad|>"
BUILD_INFO_FILE = "build_info.json"
BUILD_FORMAT = 1  # bump when the build changes in a way the spec does not capture


@dataclass(frozen=True)
class TinyTargetSpec:
    """Everything that determines the embedded target; its hash names the cache entry."""

    # tokenizer
    vocab_size: int = 2048
    tokenizer_train_chars: int = 4_000_000  # the BPE is trained on a seeded document subsample
    # model (Llama, GQA, untied embeddings)
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    context_length: int = 256  # training block length
    max_position_embeddings: int = 1024  # RoPE has no hard limit; quality fades past context_length
    # training (AdamW, linear warmup, cosine decay to min_lr_ratio * peak)
    # 800 x 8 x 256 = 1.6M tokens (about half an epoch), ~3.5 min on 2 idle cores. On this
    # budget batch 8 beat 16 and 4, and lr 1e-3 beat 2e-3 and 4e-3 (held-out loss).
    num_steps: int = 800
    batch_size: int = 8
    learning_rate: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # data and evaluation
    heldout_fraction: float = 0.05
    max_corpus_chars: int | None = None  # per split; None = the whole stdlib (tests use less)
    num_eval_blocks: int = 512  # held-out blocks evaluated, evenly spaced over the split
    seed: int = 0


DEFAULT_SPEC = TinyTargetSpec()


def target_dir(cache_dir: Path | None = None, spec: TinyTargetSpec = DEFAULT_SPEC) -> Path:
    """Where `spec` is cached: the hash covers the spec, the Python version (the corpus is its
    stdlib) and BUILD_FORMAT."""
    key = json.dumps({"spec": dataclasses.asdict(spec), "python": platform.python_version(),
                      "format": BUILD_FORMAT}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(cache_dir or default_cache_dir()) / "targets" / f"tiny-llama-{digest}"


def build_tiny_target(cache_dir: Path | None = None, spec: TinyTargetSpec = DEFAULT_SPEC,
                      progress: bool = True, force: bool = False) -> Path:
    """Return the cached target directory for `spec`, building it first if needed."""
    final = target_dir(cache_dir, spec)
    if final.is_dir() and not force:
        return final
    return build_once(final, lambda staging: _build_into(staging, spec, progress, final.name), force=force)


def resolve_target(name_or_path: str, progress: bool = True) -> str:
    """What a target name stands for, as a local HF directory or a hub id: the one place every
    command (generate, bench, tune, serve, train, demo, data) turns `--target` /
    `target.name_or_path` into something `from_pretrained` loads.

    `embedded:tiny` -> the cached build (built if needed); `embedded:smollm2` -> SmolLM2-135M-Instruct
    from its PyPI wheel, converted and cached (heads/target/gguf.py); a `.gguf` file, or a directory holding
    exactly one and no config.json -> its cached HF conversion; anything else as is.
    """
    if name_or_path == DEFAULT_TARGET_NAME:
        return str(build_tiny_target(progress=progress))
    if name_or_path == SMOLLM2_TARGET_NAME:
        return str(gguf.smollm2_target(default_cache_dir(), progress=progress))
    if name_or_path.startswith("embedded:"):
        raise FileNotFoundError(f"unknown embedded target {name_or_path!r}; expected one of {list(EMBEDDED_TARGETS)}")
    gguf_file = gguf.find_gguf_file(name_or_path)
    if gguf_file is not None:
        return str(gguf.convert_gguf(gguf_file, default_cache_dir(), progress=progress))
    return name_or_path


def read_build_info(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / BUILD_INFO_FILE).read_text())


def _build_into(directory: Path, spec: TinyTargetSpec, progress: bool, name: str) -> dict:
    """Train tokenizer + model, evaluate, and save everything into `directory`."""
    from specheads.data.corpus import stdlib_texts

    start = time.perf_counter()
    _say(progress, f"building the embedded target {name} (first run only, a few minutes on CPU)")
    train_texts = _cap_chars(stdlib_texts("train", spec.heldout_fraction), spec.max_corpus_chars)
    heldout_texts = _cap_chars(stdlib_texts("heldout", spec.heldout_fraction), spec.max_corpus_chars)
    tokenizer = train_tokenizer(train_texts, spec)
    train_ids = encode_stream(tokenizer, train_texts)  # [N_train]
    heldout_ids = encode_stream(tokenizer, heldout_texts)  # [N_heldout]
    num_threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model = make_model(spec, tokenizer)
            train_model(model, train_ids, spec, progress)
        eval_blocks = _eval_blocks(heldout_ids, spec)  # [B_eval, T]
        heldout_loss = heldout_cross_entropy(model, eval_blocks)
    finally:
        torch.set_num_threads(num_threads)
    unigram_loss = unigram_cross_entropy(train_ids, eval_blocks[:, 1:].reshape(-1), len(tokenizer))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    info = {
        "name": DEFAULT_TARGET_NAME,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "heldout_loss": heldout_loss,
        "unigram_loss": unigram_loss,
        "train_tokens": spec.num_steps * spec.batch_size * spec.context_length,
        "corpus_train_tokens": train_ids.numel(),
        "corpus_heldout_tokens": heldout_ids.numel(),
        "eval_tokens": eval_blocks[:, 1:].numel(),
        "build_seconds": round(time.perf_counter() - start, 1),
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "spec": dataclasses.asdict(spec),
    }
    (directory / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    _say(progress, f"held-out loss {heldout_loss:.3f} nats/token (unigram {unigram_loss:.3f}), "
                   f"{info['num_parameters'] / 1e6:.2f}M parameters, {info['build_seconds']}s")
    return info


def _say(progress: bool, message: str) -> None:
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(f"specheads: {message}")


def _cap_chars(texts: list[str], max_chars: int | None) -> list[str]:
    """The leading documents of `texts` up to `max_chars` characters (at least one)."""
    if max_chars is None:
        return texts
    kept, total = [], 0
    for text in texts:
        if kept and total + len(text) > max_chars:
            break
        kept.append(text)
        total += len(text)
    return kept


def train_tokenizer(texts: list[str], spec: TinyTargetSpec):
    """A byte-level BPE (GPT-2 style, lossless round trip) as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sample = list(texts)
    random.Random(spec.seed).shuffle(sample)
    sample = _cap_chars(sample, spec.tokenizer_train_chars)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size, special_tokens=[EOS_TOKEN, PAD_TOKEN], min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(sample, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        unk_token=None, clean_up_tokenization_spaces=False,
        model_max_length=spec.max_position_embeddings)


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one token stream [N], each document followed by EOS."""
    eos = tokenizer.eos_token_id
    ids = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def make_model(spec: TinyTargetSpec, tokenizer):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    return model


def _lr_factor(step: int, spec: TinyTargetSpec) -> float:
    """Linear warmup to 1, then cosine decay to min_lr_ratio at num_steps."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.num_steps - spec.warmup_steps)
    return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _param_groups(model, weight_decay: float) -> list[dict]:
    """Decay matrices only; norms' weights are left alone."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_model(model, train_ids: torch.Tensor, spec: TinyTargetSpec, progress: bool) -> None:
    """Fixed-step AdamW on random packed blocks [B, T] of the train stream, fp32."""
    from tqdm.auto import tqdm

    blocks = _pack(train_ids, spec.context_length)  # [num_blocks, T]
    generator = torch.Generator().manual_seed(spec.seed)
    order = torch.cat([torch.randperm(len(blocks), generator=generator)
                       for _ in range(math.ceil(spec.num_steps * spec.batch_size / len(blocks)))])
    optimizer = torch.optim.AdamW(_param_groups(model, spec.weight_decay), lr=spec.learning_rate,
                                  betas=(0.9, 0.95), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, spec))
    model.train()
    bar = tqdm(range(spec.num_steps), desc="training embedded target", disable=not progress,
               unit="step", dynamic_ncols=True)
    for step in bar:
        batch = blocks[order[step * spec.batch_size:(step + 1) * spec.batch_size]]  # [B, T]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == spec.num_steps - 1:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    model.eval()


def _pack(ids: torch.Tensor, block_len: int) -> torch.Tensor:
    """[N] -> [N // block_len, block_len]; the ragged tail is dropped."""
    num_blocks = ids.numel() // block_len
    if num_blocks == 0:
        raise ValueError(f"corpus has {ids.numel()} tokens, fewer than one block of {block_len}")
    return ids[:num_blocks * block_len].view(num_blocks, block_len)


def _eval_blocks(heldout_ids: torch.Tensor, spec: TinyTargetSpec) -> torch.Tensor:
    """Up to num_eval_blocks held-out blocks [B_eval, T], evenly spaced over the split."""
    blocks = _pack(heldout_ids, spec.context_length)
    if len(blocks) <= spec.num_eval_blocks:
        return blocks
    return blocks[torch.linspace(0, len(blocks) - 1, spec.num_eval_blocks).long()]


@torch.no_grad()
def heldout_cross_entropy(model, blocks: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over blocks [B, T]: predicts blocks[:, 1:]."""
    total, count = 0.0, 0
    for batch in blocks.split(batch_size):
        logits = model(input_ids=batch).logits[:, :-1]  # [b, T-1, V]
        targets = batch[:, 1:]  # [b, T-1]
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                 reduction="sum").item()
        count += targets.numel()
    return total / count


def unigram_cross_entropy(train_ids: torch.Tensor, eval_ids: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats) of eval_ids [M] under add-one-smoothed unigram counts of train_ids [N]."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0  # [V]
    log_probs = counts.log() - counts.sum().log()
    return -log_probs[eval_ids].mean().item()
