"""Shared setup for the server tests (no tests here): a tiny Llama with a byte-level BPE
tokenizer and a chat template, random Medusa heads beside it (decoding is lossless, so
random heads are fine for correctness), and a real uvicorn server on a free port."""

from __future__ import annotations

import contextlib
import re

import httpx
import pytest
import torch

from conftest import make_byte_bpe_tokenizer, make_tiny_model
from specheads.heads.artefacts.heads_dir import HeadsConfig, save_heads
from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter
from specheads.runner import load_decoder
from specheads.serving.server.server import ServerThread
from specheads.serving.server.state import ServeConfig

MODEL = "tiny-test"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
                 "<think></think>{% endif %}{% endif %}")  # Qwen3's switch, as chat_template_kwargs sets it
TEXTS = ["def f(x):\n    return x + 1\n", "the cat sat on the mat\n", "import os\nprint(os.getcwd())\n"]


def make_tokenizer(directory):
    """Byte-level BPE over the full byte alphabet (any text encodes), vocab < 512."""
    return make_byte_bpe_tokenizer(directory, TEXTS, CHAT_TEMPLATE)


def build_tiny_setup(root):
    """-> (target_dir, heads_dir): a tiny Llama (vocab 512) + tokenizer, random Medusa heads."""
    target_dir = make_tiny_model("llama", root / "target", vocab_size=512)
    make_tokenizer(target_dir)
    target = TargetAdapter.from_pretrained(target_dir)
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, 3, 1)
    with torch.no_grad():  # random residual blocks: heads that sometimes agree with the target
        heads.block_weight.normal_(0.0, 0.02)
    config = HeadsConfig(kind="medusa", hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                         num_heads=3, num_layers=1, tap_layers=[target.num_layers], target=target.identity,
                         tree={"paths": [[0], [1], [0, 0], [0, 0, 0]]})
    heads_dir = save_heads(root / "heads", heads, config)
    return target_dir, heads_dir


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    return build_tiny_setup(tmp_path_factory.mktemp("server"))


@contextlib.contextmanager
def running_server(target_dir, heads_dir, lookup_num_tokens: int | None = None, store: str | None = None, **config):
    """A started ServerThread over the tiny setup (heads_dir None: no heads; store: `--store`);
    stopped (gracefully) on exit. fp32, the exact mode: responses are compared with HF's fp32 greedy."""
    config.setdefault("model_name", MODEL)
    heads = None if heads_dir is None else str(heads_dir)
    thread = ServerThread(ServeConfig(**config), lambda: load_decoder(str(target_dir), heads, dtype="float32",
                                                                      progress=False,
                                                                      lookup_num_tokens=lookup_num_tokens,
                                                                      store=store))
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()


def openai_client(server, api_key: str = "unused", timeout: float = 60.0):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments dropped)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def scrape(server, api_key: str | None = None) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(server.url + "/metrics", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    assert re.search(r"^# TYPE specheads_", response.text, re.M)
    return metric_values(response.text)
