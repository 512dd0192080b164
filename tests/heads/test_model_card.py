"""Model cards (heads/artefacts/model_card.py): every heads directory and every export carries a README.md
whose YAML header the Hub reads and whose body says what the heads are, what they were trained
on, how well they draft by depth and how each runtime serves them. The specheads commands in a
card are parsed by the real `specheads` parser, so a renamed flag fails here."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shlex

import pytest
import torch
import yaml

from specheads.cli import build_parser
from specheads.heads.artefacts import model_card
from specheads.heads.artefacts.export import export_heads, import_heads
from specheads.heads.artefacts.heads_dir import (HeadsConfig, build_heads, check_writable, read_heads_config,
                                                 save_heads, update_tree)

from test_export import TARGET, make_medusa_dir
from test_export_eagle3 import DRAFT_VOCAB, EAGLE_HEADS, EAGLE_KV_HEADS, HIDDEN, INTERMEDIATE, VOCAB

CALIBRATION = {"accuracy": [[0.61, 0.12, 0.05], [0.42, 0.11, 0.04], [0.27, 0.09, 0.03]], "top1": [0.61, 0.42, 0.27],
               "num_positions": [9000, 8900, 8800], "max_rank": 3, "source": "org/chat-data (held-out)"}
TRAINING = {"data": "org/chat-data", "split": "train", "data_tokens": 123456, "steps": 200, "tokens_per_step": 4096,
            "lora": False}


def eagle3_heads(directory, tree=None, num_layers=1):
    config = HeadsConfig(kind="eagle3", hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=3, num_layers=num_layers,
                         tap_layers=[1, 2, 3], target=TARGET, num_attention_heads=EAGLE_HEADS,
                         num_kv_heads=EAGLE_KV_HEADS, intermediate_size=INTERMEDIATE, draft_vocab_size=DRAFT_VOCAB,
                         rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=512,
                         calibration=CALIBRATION, training=TRAINING,
                         tree=tree or {"paths": [[0], [1], [0, 0], [0, 1], [0, 0, 0]], "num_nodes": 5,
                                       "expected_accepted_draft_tokens": 1.234})
    torch.manual_seed(0)
    heads = build_heads(config)
    save_heads(directory, heads, config)
    return config


def split_card(text: str) -> tuple[dict, str]:
    assert text.startswith("---\n")
    header, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(header), body


def commands_in(body: str) -> list[str]:
    """Every shell line of the card's ```bash blocks."""
    blocks = body.split("```bash\n")[1:]
    return [line for block in blocks for line in block.split("\n```")[0].splitlines()]


def assert_specheads_commands_parse(body: str) -> int:
    parser, count = build_parser(), 0
    for line in commands_in(body):
        if line.startswith("specheads "):
            parser.parse_args(shlex.split(line)[1:])  # SystemExit on an unknown flag
            count += 1
    return count


def test_eagle3_card_header_and_body(tmp_path):
    eagle3_heads(tmp_path / "heads")
    meta, body = split_card((tmp_path / "heads" / "README.md").read_text())
    assert meta["library_name"] == "specheads" and meta["base_model"] == "org/tiny-target"
    assert {"specheads", "speculative-decoding", "eagle3"} <= set(meta["tags"])
    assert meta["license"] == "other" and meta["datasets"] == ["org/chat-data"]
    # the Hub's `other` names the license and links it: here the target's page, where its license is
    assert meta["license_name"] == "tiny-target-license"
    assert meta["license_link"] == "https://huggingface.co/org/tiny-target"
    for expected in ("`org/tiny-target`", "EAGLE-3", "1 decoder layer(s)", "tap layer(s) 1, 2, 3",
                     f"draft vocab {DRAFT_VOCAB} of {VOCAB}", "123,456 tokens with loss",
                     "200 steps x 4,096 tokens = 819,200 tokens processed", "org/chat-data (held-out)",
                     "| 1 | 0.610 | 0.780 | 9,000 |", "| 3 | 0.270 | 0.390 | 8,800 |",
                     "expected accepted draft tokens per step 1.234", "set `license`"):
        assert expected in body, expected
    lines = commands_in(body)
    heads = str(tmp_path / "heads")
    assert f"specheads serve --target org/tiny-target --heads {heads}" in lines
    vllm = next(line for line in lines if line.startswith("vllm serve org/tiny-target --speculative-config "))
    assert json.loads(shlex.split(vllm)[-1]) == {"method": "eagle3", "model": f"{heads}-eagle3",
                                                 "num_speculative_tokens": 3}
    assert (f"python -m sglang.launch_server --model-path org/tiny-target --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {heads}-eagle3 --speculative-num-steps 3 --speculative-eagle-topk 2 "
            "--speculative-num-draft-tokens 6") in lines
    assert (f"llama-server -m {heads}-gguf/target.gguf -md {heads}-gguf/heads.gguf --spec-type draft-eagle3 "
            "--spec-draft-n-max 8 --spec-draft-p-min 0.8") in lines
    assert f"specheads export {heads} --format eagle3 --output {heads}-eagle3" in lines
    assert f"specheads export {heads} --format llama.cpp --output {heads}-gguf" in lines
    assert assert_specheads_commands_parse(body) == 4  # serve, and the export before vLLM, SGLang, llama.cpp


def test_medusa_card_names_the_runtimes_that_load_medusa(tmp_path):
    make_medusa_dir(tmp_path / "heads")
    meta, body = split_card((tmp_path / "heads" / "README.md").read_text())
    assert "medusa" in meta["tags"] and "datasets" not in meta
    assert "Medusa: 3 heads (draft depths 1-3), 2 residual block(s)" in body
    assert "| 1 | 0.500 |" in body and "not recorded" in body  # top-1 only; no training record
    lines = commands_in(body)
    heads = str(tmp_path / "heads")
    vllm = next(line for line in lines if line.startswith("vllm serve"))
    assert json.loads(shlex.split(vllm)[-1])["method"] == "medusa"
    assert f"text-generation-launcher --model-id {heads}-medusa" in lines
    assert any(line.startswith("python examples/medusa/convert_checkpoint.py") and "--num_medusa_heads 3" in line
               for line in lines)
    assert f"python -m medusa.inference.cli --model {heads}-medusa" in lines
    assert assert_specheads_commands_parse(body) == 5


def test_medusa_heads_with_a_draft_vocab_point_at_vllm_only(tmp_path):
    make_medusa_dir(tmp_path / "heads", draft_vocab=40)
    body = split_card((tmp_path / "heads" / "README.md").read_text())[1]
    assert "--format vllm-medusa" in body and "text-generation-launcher" not in body
    assert "not available: these heads predict a draft vocab" in body


@pytest.mark.parametrize("fmt, runtimes", [("eagle3", ["vllm serve", "python -m sglang.launch_server",
                                                       "python convert_hf_to_gguf.py", "specheads export --import"]),
                                           ("medusa", ["text-generation-launcher", "python -m medusa.inference.cli",
                                                       "specheads export --import"]),
                                           ("vllm-medusa", ["vllm serve", "specheads export --import"])])
def test_every_export_carries_a_card_for_its_layout(fmt, runtimes, tmp_path):
    if fmt == "eagle3":
        eagle3_heads(tmp_path / "heads")
    else:
        make_medusa_dir(tmp_path / "heads")
    out = export_heads(tmp_path / "heads", fmt, tmp_path / "out")
    meta, body = split_card((out / "README.md").read_text())
    assert meta["library_name"] == "specheads" and meta["base_model"] == "org/tiny-target"
    lines = commands_in(body)
    for runtime in runtimes:
        assert any(line.startswith(runtime) for line in lines), runtime
    assert not any(f"--format {fmt}" in line for line in lines)  # already in this layout
    assert assert_specheads_commands_parse(body) >= 2
    back = import_heads(out, tmp_path / "back")  # the import writes a heads directory's card
    assert "specheads serve --target" in (back / "README.md").read_text()


def test_a_llama_cpp_export_card_serves_its_ggufs(tmp_path):
    config = eagle3_heads(tmp_path / "heads")
    (tmp_path / "gguf").mkdir()
    model_card.write_card(tmp_path / "gguf", config, "llama.cpp")
    meta, body = split_card((tmp_path / "gguf" / "README.md").read_text())
    assert "gguf" in meta["tags"]
    assert f"llama-server -m TARGET.gguf -md {tmp_path / 'gguf'}/heads.gguf" in body  # no target.gguf beside it
    (tmp_path / "gguf" / "target.gguf").write_bytes(b"GGUF")
    model_card.write_card(tmp_path / "gguf", config, "llama.cpp")
    assert f"llama-server -m {tmp_path / 'gguf'}/target.gguf" in (tmp_path / "gguf" / "README.md").read_text()


def test_runtimes_that_cannot_load_the_heads_say_why(tmp_path):
    config = dataclasses.replace(eagle3_heads(tmp_path / "heads"), num_layers=2)
    commands = model_card.serve_commands(config, "h")
    assert "vllm serve" in commands["vLLM"]
    assert commands["SGLang"].startswith("# not available: SGLang loads one-layer EAGLE-3 drafts")
    assert commands["llama.cpp"].startswith("# not available")
    eagle12 = dataclasses.replace(config, kind="eagle", tap_layers=[4], num_layers=1)
    assert set(model_card.serve_commands(eagle12, "h")) == {"specheads", "vLLM, SGLang, llama.cpp"}


@pytest.mark.parametrize("tree, expected", [
    ({"dynamic": {"depth": 5, "top_k": 8, "num_nodes": 48}}, (5, 8, 49)),  # SGLang's own shape, one to one
    ({"paths": [[0], [0, 0], [0, 0, 0]]}, (3, 1, 4)),  # a chain: num-draft-tokens = steps + 1
    ({"paths": [[0], [1], [2], [0, 0]]}, (2, 3, 5)),
    ({"paths": [list(p) for n in (1, 2, 3) for p in itertools.product((0, 1), repeat=n)]}, (3, 2, 11)),  # 14 capped
    (None, (3, 1, 4)),  # no tree: a chain of the trained depth
])
def test_sglang_flags_follow_the_stored_tree(tree, expected, tmp_path):
    config = eagle3_heads(tmp_path / "heads")
    assert model_card.sglang_tree(dataclasses.replace(config, tree=tree)) == expected


def test_the_targets_license_is_taken_from_its_card_on_disk(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "README.md").write_text("---\nlicense: apache-2.0\n---\n# a model\n")
    config = eagle3_heads(tmp_path / "heads")
    local = dataclasses.replace(config, target=dataclasses.replace(TARGET, name_or_path=str(tmp_path / "target")))
    meta, body = split_card(model_card.card_text(local, tmp_path / "heads"))
    assert meta["license"] == "apache-2.0" and "base_model" not in meta  # a local path is no Hub id
    assert "`apache-2.0`, the target's" in body


def test_a_shipped_recipes_target_has_its_license_and_an_unknown_local_one_none(tmp_path):
    config = eagle3_heads(tmp_path / "heads")
    llama = dataclasses.replace(config, target=dataclasses.replace(TARGET,
                                                                   name_or_path="meta-llama/Llama-3.1-8B-Instruct"))
    meta, body = split_card(model_card.card_text(llama, tmp_path / "heads"))
    assert meta["license"] == "llama3.1" and "license_name" not in meta and "`llama3.1`, the target's" in body
    local = dataclasses.replace(config, target=dataclasses.replace(TARGET, name_or_path=str(tmp_path / "mine")))
    meta, body = split_card(model_card.card_text(local, tmp_path / "heads"))
    assert "license" not in meta and "set `license`" in body  # never an `other` that names nothing


def test_the_eagle3_layouts_llama_cpp_command_downloads_a_hub_target(tmp_path):
    eagle3_heads(tmp_path / "heads")
    out = export_heads(tmp_path / "heads", "eagle3", tmp_path / "out")
    body = split_card((out / "README.md").read_text())[1]
    assert '--target-model-dir "$(hf download org/tiny-target)"' in body  # the converter reads a local directory


def test_tune_rewrites_the_card_and_refuses_a_hub_id(tmp_path):
    eagle3_heads(tmp_path / "heads")
    tree = {"dynamic": {"depth": 4, "top_k": 2, "num_nodes": 6},
            "tuned": {"setting": "dynamic-4x2", "device": "cpu", "torch_threads": 2, "tokens_per_s": 55.5,
                      "speedup_vs_plain": 1.8, "tau": 2.1, "step_cost": 1.0, "sweep": "tuning.json"}}
    update_tree(tmp_path / "heads", tree, {"winner": "dynamic-4x2"})
    body = split_card((tmp_path / "heads" / "README.md").read_text())[1]
    assert "Stored tree: dynamic (EAGLE-2), depth 4, top-2, 6 nodes." in body
    assert "55.5 tok/s, 1.80x plain decoding" in body
    assert "--speculative-num-steps 4 --speculative-eagle-topk 2 --speculative-num-draft-tokens 7" in body
    assert read_heads_config(tmp_path / "heads").tree == tree
    with pytest.raises(ValueError, match="is a Hub repo id.*hf download org/heads --local-dir DIR"):
        check_writable("org/heads")
    check_writable(tmp_path / "heads")
