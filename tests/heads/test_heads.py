"""heads/: the target adapter, Medusa heads, the heads directory and tree-path expansion."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from specheads.heads.artefacts.heads_dir import HeadsConfig, load_heads, read_heads_config, save_heads
from specheads.heads.medusa import MedusaHeads
from specheads.heads.target.adapter import TargetAdapter, TargetIdentity, check_target_exists
from specheads.heads.tree_paths import expand_paths, expected_accepted_draft_tokens


def medusa_config(target: TargetIdentity, num_heads=3, num_layers=2) -> HeadsConfig:
    return HeadsConfig(kind="medusa", hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                       num_heads=num_heads, num_layers=num_layers, tap_layers=[target.num_layers],
                       target=target, tree={"paths": [[0], [1], [0, 0]]})


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_adapter_taps_match_hidden_states_and_logits(fixture, request):
    target = TargetAdapter.from_pretrained(request.getfixturevalue(fixture))
    assert all(not p.requires_grad for p in target.model.parameters())
    ids = torch.randint(0, target.vocab_size, (2, 9))
    out = target(ids, [0, 1, target.num_layers])
    ref = target.model(ids, output_hidden_states=True)
    assert out.logits.shape == (2, 9, target.vocab_size)
    torch.testing.assert_close(out.taps[1], ref.hidden_states[1])
    # The last tap is the post-norm state the lm_head consumes.
    torch.testing.assert_close(target.lm_head()(out.taps[2]), ref.logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="out of range"):
        target.check_taps([target.num_layers + 1])


def test_missing_target_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        TargetAdapter.from_pretrained(tmp_path / "does-not-exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_target_exists(str(tmp_path / "empty"))


def test_medusa_heads_are_distinct_and_start_as_target_lm_head(tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, num_heads=3, num_layers=2)
    heads.init_lm_heads_from(target.lm_head())
    hidden = torch.randn(2, 5, target.hidden_size)
    logits = heads(hidden)
    assert logits.shape == (3, 2, 5, target.vocab_size)
    # Zero-initialised residual blocks: each fresh head equals the target's lm_head.
    for k in range(3):
        torch.testing.assert_close(logits[k], target.lm_head()(hidden))
    # Heads are independent (no weight shared between heads or blocks, the `[Block()] * n`
    # bug): perturbing head 1, block 1 changes head 1 only, and matches a per-head loop.
    with torch.no_grad():
        heads.block_weight[1, 1].normal_(std=0.5)
        heads.block_bias[1, 1].normal_(std=0.5)
    logits = heads(hidden)
    torch.testing.assert_close(logits[0], target.lm_head()(hidden))
    torch.testing.assert_close(logits[2], target.lm_head()(hidden))
    x = hidden
    for layer in range(2):
        x = x + torch.nn.functional.silu(x @ heads.block_weight[1, layer].T + heads.block_bias[1, layer])
    torch.testing.assert_close(logits[1], x @ heads.lm_head_weight[1].T)
    assert not torch.allclose(logits[1], logits[0])
    # The first n heads alone (a tree n deep reads no more) are the first n rows, exactly.
    assert torch.equal(heads(hidden, num_heads=2), logits[:2])
    with pytest.raises(ValueError, match=r"num_heads must be in \[1, 3\]"):
        heads(hidden, num_heads=4)
    with pytest.raises(ValueError, match="num_heads"):
        MedusaHeads(32, 64, num_heads=0)


def test_medusa_heads_with_a_draft_vocab_predict_its_target_rows(tmp_path, tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    vocab, draft = target.vocab_size, 40
    heads = MedusaHeads(target.hidden_size, vocab, num_heads=2, num_layers=1, draft_vocab_size=draft)
    assert "token_map" not in MedusaHeads(target.hidden_size, vocab, 2).state_dict()  # full vocab: as before
    chosen = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:draft].sort().values
    heads.set_draft_vocab(chosen - torch.arange(draft))
    heads.init_lm_heads_from(target.lm_head())
    assert torch.equal(heads.draft_to_target(), chosen)
    hidden = torch.randn(2, 5, target.hidden_size)
    logits = heads(hidden)
    assert logits.shape == (2, 2, 5, draft)
    for k in range(2):  # a fresh head is the target's lm_head on the draft vocab's rows
        torch.testing.assert_close(logits[k], target.lm_head()(hidden)[..., chosen])
    config = dataclasses.replace(medusa_config(target.identity, 2, 1), draft_vocab_size=draft)
    save_heads(tmp_path / "heads", heads, config)
    loaded, loaded_config = load_heads(tmp_path / "heads", target=target.identity)
    assert loaded_config.draft_vocab_size == draft and torch.equal(loaded.draft_to_target(), chosen)
    torch.testing.assert_close(loaded(hidden), logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="draft_vocab_size must be in \\[1, 256\\]"):
        MedusaHeads(32, 256, 2, draft_vocab_size=257)


def test_heads_directory_round_trip(tmp_path, tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    heads = MedusaHeads(target.hidden_size, target.vocab_size, 3, 2)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    config = medusa_config(target.identity)
    out = save_heads(tmp_path / "heads", heads, config)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["heads"]  # no temp dirs left behind
    loaded, loaded_config = load_heads(out, target=target.identity)
    assert loaded_config == config
    hidden = torch.randn(1, 4, target.hidden_size)
    torch.testing.assert_close(loaded(hidden), heads(hidden), rtol=0, atol=0)
    # Saving again replaces the directory whole.
    save_heads(tmp_path / "heads", heads, config)
    assert [p.name for p in tmp_path.iterdir()] == ["heads"]


def test_written_artefacts_have_ordinary_modes(tmp_path, tiny_llama_dir):
    """Heads directories, atomic files and cache entries are readable as an open()/mkdir()
    under the umask would make them, not mkstemp/mkdtemp's owner-only 0600/0700."""
    import stat

    from specheads.heads.atomic import build_once, write_text

    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    old = os.umask(0o022)
    try:
        heads_dir = save_heads(tmp_path / "heads", MedusaHeads(target.hidden_size, target.vocab_size, 2, 1),
                               medusa_config(target.identity, 2, 1))
        write_text(tmp_path / "report.json", "{}")
        cache = build_once(tmp_path / "cache" / "entry", lambda d: (d / "weights.bin").write_bytes(b"1"))
    finally:
        os.umask(old)
    mode = lambda path: stat.S_IMODE(path.stat().st_mode)  # noqa: E731
    assert [mode(heads_dir), mode(cache)] == [0o755, 0o755]
    assert {p.name: mode(p) for p in [*heads_dir.iterdir(), *cache.iterdir(), tmp_path / "report.json"]} == \
        {"config.json": 0o644, "model.safetensors": 0o644, "README.md": 0o644, "weights.bin": 0o644,
         "report.json": 0o644}


def test_heads_of_another_target_fail_naming_both_values(tmp_path, tiny_llama_dir, tiny_qwen2_dir):
    llama = TargetAdapter.from_pretrained(tiny_llama_dir)
    heads = MedusaHeads(llama.hidden_size, llama.vocab_size, 2, 1)
    save_heads(tmp_path / "h", heads, medusa_config(llama.identity, 2, 1))
    qwen = TargetAdapter.from_pretrained(tiny_qwen2_dir).identity
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_heads(tmp_path / "h", target=qwen)
    bigger = TargetIdentity(**{**llama.identity.__dict__, "hidden_size": 96, "vocab_size": 300})
    with pytest.raises(ValueError) as err:
        load_heads(tmp_path / "h", target=bigger)
    assert "hidden_size: heads were trained for 64, the target has 96" in str(err.value)
    assert "vocab_size: heads were trained for 256, the target has 300" in str(err.value)


def test_bad_heads_config_is_refused(tmp_path, tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    save_heads(tmp_path / "h", MedusaHeads(64, 256, 2, 1), medusa_config(target.identity, 2, 1))
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps({**raw, "surprise": 1}))
    with pytest.raises(ValueError, match="unknown keys \\['surprise'\\]"):
        read_heads_config(tmp_path / "h")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_heads_config(tmp_path)


def test_expand_paths_is_best_first_and_prefix_closed():
    acc = [[0.6, 0.1, 0.05], [0.4, 0.1, 0.05], [0.3, 0.08]]
    paths = expand_paths(acc, 8)
    assert set(paths) == {(0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0), (0, 0, 0)}
    assert all(p[:-1] in paths for p in paths if len(p) > 1)
    expected = 0.6 + 0.24 + 0.1 + 0.072 + 0.06 + 0.05 + 0.04 + 0.03
    assert expected_accepted_draft_tokens(paths, acc) == pytest.approx(expected)
    assert expand_paths(acc, 1) == [(0,)]
    with pytest.raises(ValueError, match="num_nodes"):
        expand_paths(acc, 0)


def test_import_specheads_is_light():
    code = ("import sys, specheads, specheads.cli; "
            "heavy = [m for m in ('deepspeed', 'wandb', 'datasets', 'fastapi', 'torch') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
