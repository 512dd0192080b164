"""Heads that ship inside the package (heads/artefacts/heads_dir.py SHIPPED_HEADS), by name.

`embedded:smollm2-eagle3` resolves to its package directory for every reader (load, export,
model card), fits `embedded:smollm2`'s identity, stays within the 25 MB a shipped head may
weigh, and is never rewritten in place. The slow test decodes with them on the real target:
fp32 greedy identical to plain decoding, more than one token a step.
"""

from __future__ import annotations

import pytest
import torch

from specheads.heads.artefacts.heads_dir import (SHIPPED_HEADS, WEIGHTS_NAME, check_writable, load_heads,
                                                 read_heads_config, resolve_heads_dir)

NAME = "embedded:smollm2-eagle3"
MAX_SHIPPED_BYTES = 25 * 1024 * 1024


def test_the_shipped_name_resolves_to_a_whole_heads_directory():
    assert NAME in SHIPPED_HEADS
    directory = resolve_heads_dir(NAME)
    assert (directory / "config.json").is_file() and (directory / "README.md").is_file()
    assert (directory / WEIGHTS_NAME).stat().st_size <= MAX_SHIPPED_BYTES
    config = read_heads_config(NAME)
    assert config.kind == "eagle3" and config.target.name_or_path == "embedded:smollm2"
    assert (config.target.hidden_size, config.target.vocab_size, config.target.num_layers) == (576, 49152, 30)
    assert config.tree and config.tree["num_nodes"] >= 1
    # What the model card reports: trained heads (untrained ones score near 0 at depth 1)
    assert config.calibration["top1"][0] > 0.3, config.calibration["top1"]


def test_the_shipped_weights_load_into_their_config_in_every_dtype():
    heads, config = load_heads(NAME, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in heads.parameters())
    assert sum(p.numel() for p in heads.parameters()) > 1_000_000
    heads16, _ = load_heads(NAME, dtype=torch.bfloat16)
    for (name, p32), (_, p16) in zip(heads.state_dict().items(), heads16.state_dict().items()):
        if p32.is_floating_point():  # stored in bf16: the fp32 copy is exact, so it rounds back to itself
            assert torch.equal(p32.to(torch.bfloat16), p16), name


def test_an_unknown_embedded_name_is_one_line_naming_what_ships():
    with pytest.raises(FileNotFoundError, match="ships no heads of that name; it ships embedded:smollm2-eagle3"):
        read_heads_config("embedded:smollm2-medusa")


def test_shipped_heads_are_not_rewritten_in_place():
    with pytest.raises(ValueError, match=r"ship inside specheads.*cp -r .*smollm2-eagle3 DIR"):
        check_writable(NAME)


def test_a_local_directory_of_the_same_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / NAME).mkdir()
    assert resolve_heads_dir(NAME).resolve() == (tmp_path / NAME).resolve()


@pytest.mark.slow
def test_the_shipped_heads_speculate_losslessly_on_the_real_target():
    from specheads.runner import load_decoder
    from specheads.serving.decode.generate import generate

    decoder, tokenizer = load_decoder("embedded:smollm2", NAME, dtype="float32", lookup_num_tokens=0)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Give me three tips for better sleep."}],
                                         add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    heads = generate(decoder, prompt, 48, tokenizer.eos_token_id)
    plain = generate(decoder, prompt, 48, tokenizer.eos_token_id, speculate=False)
    assert heads.tokens == plain.tokens
    assert heads.stats.tau > 1.2, heads.stats
