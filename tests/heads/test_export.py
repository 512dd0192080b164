"""heads/artefacts/export*.py and `specheads export`: the Medusa layouts out and back, exactly, detection of
the layout, atomic writes and the CLI (EAGLE-3: test_export_eagle3.py); shared helpers for both."""

import argparse
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specheads import export_cli
from specheads.heads.artefacts.export import export_heads, import_heads
from specheads.heads.artefacts.heads_dir import HeadsConfig, load_heads, save_heads
from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetIdentity

HIDDEN, VOCAB, NUM_HEADS, NUM_LAYERS = 32, 96, 3, 2
TARGET = TargetIdentity(architecture="LlamaForCausalLM", model_type="llama", hidden_size=HIDDEN,
                        vocab_size=VOCAB, num_layers=4, name_or_path="org/tiny-target")


DRAFT_VOCAB = 40  # Medusa heads with a draft vocab (vLLM's truncated_vocab_size + token_map)


def make_medusa_dir(directory, dtype=torch.float32, draft_vocab=None):
    torch.manual_seed(0)
    heads = MedusaHeads(HIDDEN, VOCAB, NUM_HEADS, NUM_LAYERS, draft_vocab_size=draft_vocab)
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_(std=0.3)
    if draft_vocab is not None:  # a scattered, ascending set of target ids
        chosen = torch.randperm(VOCAB)[:draft_vocab].sort().values
        heads.set_draft_vocab(chosen - torch.arange(draft_vocab))
    heads.to(dtype)
    config = HeadsConfig(kind="medusa", hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=NUM_HEADS,
                         num_layers=NUM_LAYERS, tap_layers=[TARGET.num_layers], target=TARGET,
                         tree={"paths": [[0], [1], [0, 0]]}, calibration={"top1": [0.5, 0.25, 0.1]},
                         dtype=str(dtype).removeprefix("torch."), draft_vocab_size=draft_vocab)
    save_heads(directory, heads, config)
    return heads, config


def read_config(directory):
    return json.loads((directory / "config.json").read_text())


def assert_same_state(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def medusa_reference_logits(weight, bias, lm_head, hidden):
    """One head computed from per-head tensors, the way Medusa/vLLM run it."""
    x = hidden
    for w, b in zip(weight, bias):
        x = x + F.silu(x @ w.T + b)
    return x @ lm_head.T


# Medusa (FasterDecoding layout) and vLLM's MedusaModel layout.

def expected_medusa_keys(fmt):
    keys = []
    for i in range(NUM_HEADS):
        for j in range(NUM_LAYERS):
            if fmt == "medusa":
                keys += [f"{i}.{j}.linear.weight", f"{i}.{j}.linear.bias"]
            else:
                keys += [f"blocks.{i}.layers.{j}.weight", f"blocks.{i}.layers.{j}.bias"]
        keys.append(f"{i}.{NUM_LAYERS}.weight" if fmt == "medusa" else f"lm_heads.{i}.weight")
    return sorted(keys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt, draft_vocab", [("medusa", None), ("vllm-medusa", None), ("vllm-medusa", DRAFT_VOCAB)])
def test_medusa_round_trip_is_exact(fmt, draft_vocab, dtype, tmp_path):
    heads, config = make_medusa_dir(tmp_path / "heads", dtype, draft_vocab)
    export_heads(tmp_path / "heads", fmt, tmp_path / "foreign")
    import_heads(tmp_path / "foreign", tmp_path / "back")

    assert read_config(tmp_path / "back") == config.to_dict()
    assert_same_state(load_file(str(tmp_path / "back" / "model.safetensors")),
                      load_file(str(tmp_path / "heads" / "model.safetensors")))
    loaded, loaded_config = load_heads(tmp_path / "back", dtype=dtype)
    assert loaded_config == config
    hidden = torch.randn(2, 5, HIDDEN, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(loaded(hidden), heads(hidden))


@pytest.mark.parametrize("fmt", ["medusa", "vllm-medusa"])
def test_medusa_export_has_documented_keys_and_semantics(fmt, tmp_path):
    heads, _ = make_medusa_dir(tmp_path / "heads")
    export_heads(tmp_path / "heads", fmt, tmp_path / "foreign")
    weights_name = "medusa_lm_head.safetensors" if fmt == "medusa" else "model.safetensors"
    # Medusa's own runtime (MedusaModel.from_pretrained) torch.loads only medusa_lm_head.pt.
    twins = ["medusa_lm_head.pt"] if fmt == "medusa" else []
    assert sorted(p.name for p in (tmp_path / "foreign").iterdir()) == \
        sorted(["README.md", "config.json", weights_name] + twins)
    state = load_file(str(tmp_path / "foreign" / weights_name))
    assert sorted(state) == expected_medusa_keys(fmt)
    for twin in twins:
        assert_same_state(torch.load(tmp_path / "foreign" / twin, weights_only=True), state)

    foreign = read_config(tmp_path / "foreign")
    specheads_block = foreign.pop("specheads")
    assert specheads_block["kind"] == "medusa"
    if fmt == "medusa":
        assert foreign == {"medusa_num_heads": NUM_HEADS, "medusa_num_layers": NUM_LAYERS,
                           "base_model_name_or_path": TARGET.name_or_path, "hidden_size": HIDDEN,
                           "vocab_size": VOCAB}
    else:
        assert foreign == {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": HIDDEN,
                           "vocab_size": VOCAB, "num_heads": NUM_HEADS, "num_hidden_layers": NUM_LAYERS,
                           "truncated_vocab_size": VOCAB, "medusa_fc_bias": True}

    # The per-head tensors compute what our stacked module computes (not just a bijection).
    hidden = torch.randn(7, HIDDEN)
    with torch.no_grad():
        ours = heads(hidden.view(1, 7, HIDDEN))[:, 0]
    for i in range(NUM_HEADS):
        if fmt == "medusa":
            weight = [state[f"{i}.{j}.linear.weight"] for j in range(NUM_LAYERS)]
            bias = [state[f"{i}.{j}.linear.bias"] for j in range(NUM_LAYERS)]
            lm_head = state[f"{i}.{NUM_LAYERS}.weight"]
        else:
            weight = [state[f"blocks.{i}.layers.{j}.weight"] for j in range(NUM_LAYERS)]
            bias = [state[f"blocks.{i}.layers.{j}.bias"] for j in range(NUM_LAYERS)]
            lm_head = state[f"lm_heads.{i}.weight"]
        torch.testing.assert_close(medusa_reference_logits(weight, bias, lm_head, hidden), ours[i],
                                   rtol=1e-5, atol=1e-5)


def test_vllm_medusa_export_of_a_draft_vocab_is_vllms_token_map(tmp_path):
    heads, _ = make_medusa_dir(tmp_path / "heads", draft_vocab=DRAFT_VOCAB)
    export_heads(tmp_path / "heads", "vllm-medusa", tmp_path / "foreign")
    foreign, state = read_config(tmp_path / "foreign"), load_file(str(tmp_path / "foreign" / "model.safetensors"))
    assert (foreign["vocab_size"], foreign["truncated_vocab_size"]) == (VOCAB, DRAFT_VOCAB)
    assert sorted(state) == sorted(expected_medusa_keys("vllm-medusa") + ["token_map"])
    assert state["token_map"].dtype == torch.int64 and torch.equal(state["token_map"], heads.token_map)
    assert state["lm_heads.0.weight"].shape == (DRAFT_VOCAB, HIDDEN)
    # vLLM's compute_logits scatters the Vd logits into a -inf full-vocab row at token_map.
    hidden = torch.randn(5, HIDDEN)
    with torch.no_grad():
        ours = heads(hidden.view(1, 5, HIDDEN))[:, 0]  # [K, 5, Vd]
    for i in range(NUM_HEADS):
        weight = [state[f"blocks.{i}.layers.{j}.weight"] for j in range(NUM_LAYERS)]
        bias = [state[f"blocks.{i}.layers.{j}.bias"] for j in range(NUM_LAYERS)]
        truncated = medusa_reference_logits(weight, bias, state[f"lm_heads.{i}.weight"], hidden)
        full = torch.full((5, VOCAB), -torch.inf)
        full[:, state["token_map"]] = truncated
        assert torch.equal(full.argmax(-1), heads.token_map[ours[i].argmax(-1)])


def test_medusa_layout_refuses_a_draft_vocab(tmp_path):
    make_medusa_dir(tmp_path / "heads", draft_vocab=DRAFT_VOCAB)
    with pytest.raises(ValueError, match="draft vocab of 40.*--format vllm-medusa"):
        export_heads(tmp_path / "heads", "medusa", tmp_path / "foreign")
    assert not (tmp_path / "foreign").exists()


def test_vllm_medusa_truncated_without_token_map_is_refused(tmp_path):
    make_medusa_dir(tmp_path / "heads", draft_vocab=DRAFT_VOCAB)
    export_heads(tmp_path / "heads", "vllm-medusa", tmp_path / "foreign")
    state = load_file(str(tmp_path / "foreign" / "model.safetensors"))
    state.pop("token_map")
    save_file(state, str(tmp_path / "foreign" / "model.safetensors"))
    with pytest.raises(ValueError, match="truncated_vocab_size=40 < vocab_size=96 but the weights have no token_map"):
        import_heads(tmp_path / "foreign", tmp_path / "back")


def write_target_config(directory):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(directory)
    return directory


def test_medusa_trained_elsewhere_needs_the_target(tmp_path):
    heads, _ = make_medusa_dir(tmp_path / "heads")
    export_heads(tmp_path / "heads", "medusa", tmp_path / "foreign")
    # Strip our block and save the weights as Medusa's training script's .pt twin.
    foreign = read_config(tmp_path / "foreign")
    foreign.pop("specheads")
    foreign.pop("hidden_size")
    foreign.pop("vocab_size")
    (tmp_path / "foreign" / "config.json").write_text(json.dumps(foreign))
    state = load_file(str(tmp_path / "foreign" / "medusa_lm_head.safetensors"))
    (tmp_path / "foreign" / "medusa_lm_head.safetensors").unlink()
    torch.save(state, tmp_path / "foreign" / "medusa_lm_head.pt")

    with pytest.raises(ValueError, match="--target"):
        import_heads(tmp_path / "foreign", tmp_path / "back")
    target_dir = write_target_config(tmp_path / "target")
    import_heads(tmp_path / "foreign", tmp_path / "back", target=str(target_dir))
    loaded, config = load_heads(tmp_path / "back")
    assert config.target.name_or_path == str(target_dir)
    assert config.target.num_layers == 3 and config.tap_layers == [3]
    assert (config.num_heads, config.num_layers, config.tree, config.dtype) == (NUM_HEADS, NUM_LAYERS, None, "float32")
    hidden = torch.randn(1, 4, HIDDEN)
    with torch.no_grad():
        assert torch.equal(loaded(hidden), heads(hidden))
    # A target the heads do not fit is named.
    with pytest.raises(ValueError, match="vocab_size"):
        import_heads(tmp_path / "foreign", tmp_path / "bad",
                     target=dataclasses.replace(TARGET, vocab_size=VOCAB + 1))


def test_vllm_medusa_without_bias_and_with_prefix(tmp_path):
    heads, _ = make_medusa_dir(tmp_path / "heads")
    with torch.no_grad():
        heads.block_bias.zero_()
    directory = tmp_path / "foreign"
    directory.mkdir()
    state = {}
    for i in range(NUM_HEADS):
        for j in range(NUM_LAYERS):
            state[f"medusa_heads.blocks.{i}.layers.{j}.weight"] = heads.block_weight[i, j].detach().clone()
        state[f"medusa_heads.lm_heads.{i}.weight"] = heads.lm_head_weight[i].detach().clone()
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(
        {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": HIDDEN, "vocab_size": VOCAB,
         "num_heads": NUM_HEADS, "num_hidden_layers": NUM_LAYERS}))
    import_heads(directory, tmp_path / "back", target=TARGET)
    loaded, _ = load_heads(tmp_path / "back")
    hidden = torch.randn(1, 3, HIDDEN)
    with torch.no_grad():
        assert torch.equal(loaded(hidden), heads(hidden))


def test_unknown_layout_names_the_expected_ones(tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="unknown heads layout") as err:
        import_heads(tmp_path / "llama", tmp_path / "out")
    for expected in ("LlamaForCausalLMEagle3", "medusa_num_heads", "MedusaModel"):
        assert expected in str(err.value)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        import_heads(tmp_path / "missing", tmp_path / "out")
    make_medusa_dir(tmp_path / "heads")
    with pytest.raises(ValueError, match="already a specheads"):
        import_heads(tmp_path / "heads", tmp_path / "out")
    with pytest.raises(ValueError, match="eagle3 heads"):
        export_heads(tmp_path / "heads", "eagle3", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_replaces_atomically(tmp_path):
    make_medusa_dir(tmp_path / "heads")
    out = tmp_path / "foreign"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    export_heads(tmp_path / "heads", "vllm-medusa", out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "heads"]  # no temp dirs left


# The CLI glue.

def run_cli(argv):
    parser = argparse.ArgumentParser(prog="specheads")
    export_cli.add_parser(parser.add_subparsers(dest="command"))
    return export_cli.run(parser.parse_args(argv))


def test_cli_export_and_import(tmp_path, capsys):
    make_medusa_dir(tmp_path / "heads")
    assert run_cli(["export", str(tmp_path / "heads"), "--format", "medusa", "--output", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "medusa_lm_head.safetensors").is_file()
    assert run_cli(["export", "--import", str(tmp_path / "m"), "--output", str(tmp_path / "back")]) == 0
    assert "imported" in capsys.readouterr().out
    assert read_config(tmp_path / "back") == read_config(tmp_path / "heads")
    with pytest.raises(ValueError, match="--format"):
        run_cli(["export", str(tmp_path / "heads"), "--output", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="only used with --import"):
        run_cli(["export", str(tmp_path / "heads"), "--format", "medusa", "--output", str(tmp_path / "x"),
                 "--target", "t"])
