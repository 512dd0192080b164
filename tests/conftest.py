"""Shared fixtures: tiny targets built locally and saved through the real save_pretrained /
from_pretrained paths. Nothing here touches a network.

The one place that sets the test environment: offline W&B and hub, and TRITON_INTERPRET=1
without a GPU, so that every Triton kernel runs (interpreted) on a CPU; it is set before
anything imports triton. Tests mirror the package's parts (tests/heads, tests/serving/decode,
...); a few reuse helpers from another part's test module (test_eagle3.random_head,
test_training.markov_walks), so every test folder is importable by module name.
"""

from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
for _folder in sorted(p for p in Path(__file__).resolve().parent.rglob("*") if p.is_dir() and p.name != "__pycache__"):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

TINY_VOCAB = 256


def make_tiny_model(arch: str, directory: Path, seed: int = 0, vocab_size: int = TINY_VOCAB,
                    hidden_size: int = 64, num_layers: int = 2) -> Path:
    """Save a randomly initialised tiny causal LM of `arch` ("llama", "qwen2", "qwen3") to `directory`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        arch, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config)
    # Random init gives near-uniform logits; a larger init spread makes greedy decoding less
    # tie-prone and more like a trained model's peaked distributions.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), seed=1)


@pytest.fixture(scope="session")
def embedded_target_dir() -> Path:
    """The real embedded target (trained on the stdlib), built once and cached.

    The cache lives where `specheads` keeps it (SPECHEADS_CACHE or ~/.cache/specheads), so
    the demo and the tests share one build.
    """
    from specheads.data.tiny_target import build_tiny_target

    return build_tiny_target(progress=False)


def make_byte_bpe_tokenizer(directory, texts: list[str], chat_template: str | None = None):
    """A byte-level BPE tokenizer over the full byte alphabet (any text encodes, ids < 300),
    trained on `texts` and saved into `directory` (next to a tiny model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(list(texts) * 20, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return tokenizer
