"""heads/artefacts/export_llama_cpp.py and `specheads export --format llama.cpp`: what llama.cpp's converter
reads from our EAGLE-3 export, and one-line errors for what it cannot take. No llama.cpp build
here; the conversion and llama-server itself run in tests/bench/test_llama_cpp.py (slow)."""

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_byte_bpe_tokenizer, make_tiny_model
from specheads import export_cli
from specheads.heads.artefacts.export import export_heads
from specheads.heads.artefacts.export_llama_cpp import (CONVERTER, EAGLE3_MARKER, LlamaCppError, check_target_dir,
                                                        export_llama_cpp, find_converter)
from specheads.heads.artefacts.heads_dir import build_heads, eagle_heads_config, save_heads
from specheads.heads.target.adapter import TargetAdapter

# What convert_hf_to_gguf.py reads from an EAGLE-3 checkpoint, written down from llama.cpp as
# vendored in llama-cpp-python 0.3.36 (sdist sha256 832db069...a2e), conversion/llama.py, class
# LlamaModel: __init__ (detection, config keys), index_tensors (renames), modify_tensors
# (special tensors), prepare_tensors (d2t); the Llama tensor map for the rest.
CONVERTER_EXPECTS = {
    "architectures": ["LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator", "Eagle3DraftModel"],
    # is_eagle3 = "draft_vocab_size" in hparams and hparams["num_hidden_layers"] == 1
    "detect": {"key": "draft_vocab_size", "num_hidden_layers": 1},
    # target_layers = eagle3_raw_config.get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3]
    "tap_key": "eagle_aux_hidden_state_layer_ids",
    # read with .get: absent -> the target's hidden size / false / false
    "optional": {"target_hidden_size": None, "norm_before_residual": False, "norm_before_fc": False},
    # the Llama hparams its TextModel.set_gguf_parameters and LlamaModel read
    "hparams": ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "rope_theta", "vocab_size", "max_position_embeddings", "num_hidden_layers"],
    "rename_prefix": ("midlayer.", "model.layers.0."),
    "special": {"fc.weight", "d2t", "t2d"},  # fc kept, d2t -> I64 absolute ids, t2d skipped
    "layer": {"input_layernorm.weight", "hidden_norm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
              "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"},
    "top": {"norm.weight", "lm_head.weight"},
}
NUM_LAYERS = 6
TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.", "print('hello')"]


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    """A tiny Llama with a byte-level BPE tokenizer (what the converter reads the vocab from)."""
    directory = tmp_path_factory.mktemp("llama-cpp-target")
    make_tiny_model("llama", directory, vocab_size=300, num_layers=NUM_LAYERS)
    make_byte_bpe_tokenizer(directory, TEXTS)
    return directory


def write_eagle3_heads(directory, target_dir, draft_vocab_size=64, num_layers=1):
    target = TargetAdapter.from_pretrained(target_dir)
    config = eagle_heads_config(target, num_steps=3, draft_vocab_size=draft_vocab_size, num_layers=num_layers)
    torch.manual_seed(0)
    heads = build_heads(config)
    chosen = torch.randperm(target.vocab_size)[:draft_vocab_size].sort().values
    heads.set_draft_vocab(chosen - torch.arange(draft_vocab_size),
                          torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, chosen, True))
    save_heads(directory, heads, config)
    return config


def test_eagle3_export_is_what_the_converter_reads(tiny_target_dir, tmp_path):
    config = write_eagle3_heads(tmp_path / "heads", tiny_target_dir)
    out = export_heads(tmp_path / "heads", "eagle3", tmp_path / "eagle3")
    foreign = json.loads((out / "config.json").read_text())
    expects = CONVERTER_EXPECTS
    assert foreign["architectures"][0] in expects["architectures"]
    detect = expects["detect"]
    assert detect["key"] in foreign and foreign["num_hidden_layers"] == detect["num_hidden_layers"]
    assert all(key in foreign for key in expects["hparams"])
    # Our taps are llama.cpp's ids (both: the input of layer i), under the key the converter reads.
    assert foreign[expects["tap_key"]] == config.tap_layers
    for key, default in expects["optional"].items():
        assert foreign.get(key, default) == default, key
    state = load_file(str(out / "model.safetensors"))
    old, new = expects["rename_prefix"]
    renamed = {new + name[len(old):] if name.startswith(old) else name for name in state}
    expected = expects["special"] | expects["top"] | {new + name for name in expects["layer"]}
    assert renamed == expected
    # prepare_tensors: target ids = d2t + arange, in range and unique; t2d marks the same set.
    targets = state["d2t"].to(torch.int64) + torch.arange(state["d2t"].numel())
    assert int(targets.min()) >= 0 and int(targets.max()) < foreign["vocab_size"]
    assert targets.unique().numel() == targets.numel() == foreign["draft_vocab_size"]
    assert torch.equal(state["t2d"].nonzero().flatten(), targets.sort().values)


def fake_llama_cpp(directory, knows_eagle3=True):
    (directory / "conversion").mkdir(parents=True)
    (directory / CONVERTER).write_text("# convert_hf_to_gguf.py\n")
    (directory / "conversion" / "llama.py").write_text(f'"{EAGLE3_MARKER}"\n' if knows_eagle3 else "\n")
    return directory


def test_find_converter_needs_a_llama_cpp_that_knows_eagle3(tmp_path):
    with pytest.raises(LlamaCppError, match="does not exist"):
        find_converter(tmp_path / "missing")
    with pytest.raises(LlamaCppError, match=f"no {CONVERTER}"):
        find_converter(tmp_path)
    with pytest.raises(LlamaCppError, match="too old"):
        find_converter(fake_llama_cpp(tmp_path / "old", knows_eagle3=False))
    new = fake_llama_cpp(tmp_path / "new")
    (new / "build" / "bin").mkdir(parents=True)
    assert find_converter(new / "build" / "bin") == (new / CONVERTER).resolve()  # a checkout's build/bin


def test_bad_input_is_one_line(tiny_target_dir, tmp_path):
    from test_export import make_medusa_dir

    make_medusa_dir(tmp_path / "medusa")
    converter = find_converter(fake_llama_cpp(tmp_path / "llama.cpp"))
    with pytest.raises(LlamaCppError, match="EAGLE-3 heads only"):
        export_llama_cpp(tmp_path / "medusa", tmp_path / "out", target_dir=tiny_target_dir, converter=converter)
    write_eagle3_heads(tmp_path / "heads", tiny_target_dir)
    with pytest.raises(LlamaCppError, match="local HF directory"):
        export_llama_cpp(tmp_path / "heads", tmp_path / "out", target_dir="org/not-here", converter=converter)
    write_eagle3_heads(tmp_path / "two-layers", tiny_target_dir, num_layers=2)
    with pytest.raises(LlamaCppError, match="one decoder layer .* these heads have 2"):
        export_llama_cpp(tmp_path / "two-layers", tmp_path / "out", target_dir=tiny_target_dir, converter=converter)
    no_tokenizer = tmp_path / "bare"
    make_tiny_model("llama", no_tokenizer, vocab_size=300, num_layers=NUM_LAYERS)
    with pytest.raises(LlamaCppError, match="no tokenizer"):
        check_target_dir(no_tokenizer)
    assert not (tmp_path / "out").exists()


def run_cli(argv):
    from specheads.cli import main

    return main(argv)


def test_cli_errors_are_one_line(tiny_target_dir, tmp_path, capsys):
    from test_export import make_medusa_dir

    make_medusa_dir(tmp_path / "medusa")
    assert run_cli(["export", str(tmp_path / "medusa"), "--format", "llama.cpp", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "EAGLE-3" in err and "medusa" in err
    write_eagle3_heads(tmp_path / "heads", tiny_target_dir)
    capsys.readouterr()
    argv = ["export", str(tmp_path / "heads"), "--format", "llama.cpp", "--output", str(tmp_path / "o"),
            "--target", str(tiny_target_dir)]
    assert run_cli(argv + ["--llama-cpp", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "does not exist" in err
    assert run_cli(argv + ["--llama-cpp", str(fake_llama_cpp(tmp_path / "old", knows_eagle3=False))]) == 2
    assert "too old" in capsys.readouterr().err
    assert run_cli(["export", str(tmp_path / "heads"), "--format", "llama.cpp", "--output", str(tmp_path / "o"),
                    "--target", str(tmp_path / "no-such-dir"), "--llama-cpp", str(tmp_path / "old")]) == 2
    assert f"target {str(tmp_path / 'no-such-dir')!r} does not exist: expected a local model directory" in \
        capsys.readouterr().err


def test_parser_lists_the_format():
    parser = argparse.ArgumentParser(prog="specheads")
    export_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["export", "h", "--format", "llama.cpp", "--output", "o"])
    assert (args.format, args.outtype, args.no_target) == ("llama.cpp", "bf16", False)
