"""EAGLE-3 heads: the checkpoint layout, save/load, draft vocab, the training-time test,
drafting consistent with training, and lossless greedy decoding with EAGLE drafting.

Tiny random targets (Llama, Qwen2; 4 layers so the three taps differ) and random heads.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from specheads.data.vocab_counts import count_tokens
from specheads.heads.draft_vocab import build_draft_vocab
from specheads.heads.eagle3 import Eagle3Head, default_tap_layers, next_token_embeddings
from specheads.heads.artefacts.export_eagle3 import LAYER_WEIGHT_NAMES
from specheads.heads.artefacts.heads_dir import HeadsConfig, build_heads, load_heads, read_heads_config, save_heads
from specheads.heads.target.adapter import TargetAdapter
from specheads.serving.decode.config import SpeculativeDecoder, TreeSpec
from specheads.serving.decode.engine import BatchEngine
from specheads.serving.decode.sequence import SequenceRequest
from specheads.serving.decode.generate import generate
from specheads.serving.decode.trees import DraftTree
from specheads.training.losses import eagle_ttt_loss

from conftest import REPO, TINY_VOCAB, make_tiny_model

NUM_PROMPTS = 20
NUM_NEW = 24
NUM_LAYERS = 4
DRAFT_VOCAB = 200
TREE_PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]

EXPECTED_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request, tmp_path_factory) -> TargetAdapter:
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(f"eagle-{request.param}"),
                           seed=3, num_layers=NUM_LAYERS)
    return TargetAdapter.from_pretrained(path)


def eagle_config(target: TargetAdapter, kind: str = "eagle3", num_layers: int = 1) -> HeadsConfig:
    text = target.text_config
    taps = default_tap_layers(target.num_layers) if kind == "eagle3" else [target.num_layers]
    return HeadsConfig(kind=kind, hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_heads=4,
                       num_layers=num_layers, tap_layers=taps, target=target.identity,
                       num_attention_heads=text.num_attention_heads, num_kv_heads=text.num_key_value_heads,
                       intermediate_size=text.intermediate_size,
                       draft_vocab_size=DRAFT_VOCAB if kind == "eagle3" else target.vocab_size,
                       rope_theta=10000.0, rms_norm_eps=1e-6)


def random_head(target: TargetAdapter, seed: int = 0, kind: str = "eagle3",
                num_layers: int = 1) -> tuple[Eagle3Head, HeadsConfig]:
    config = eagle_config(target, kind, num_layers)
    torch.manual_seed(seed)
    head = build_heads(config)
    with torch.no_grad():
        for param in head.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
    counts = torch.randint(0, 1000, (target.vocab_size,))
    head.set_draft_vocab(*build_draft_vocab(counts, head.draft_vocab_size, [2]))
    return head.eval(), config


def prompts(num: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY_VOCAB, (int(torch.randint(4, 30, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(num)]


def hf_greedy(target: TargetAdapter, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_parameter_names_are_the_eagle3_checkpoint_layout(target):
    head, config = random_head(target)
    assert set(head.state_dict()) == EXPECTED_KEYS
    hidden = target.hidden_size
    assert tuple(head.fc.weight.shape) == (hidden, 3 * hidden)
    assert tuple(head.midlayer.self_attn.q_proj.weight.shape)[1] == 2 * hidden
    assert tuple(head.lm_head.weight.shape) == (DRAFT_VOCAB, hidden)
    assert head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool
    eagle, _ = random_head(target, kind="eagle")  # EAGLE-1/2: one tap, no fc, full vocab
    assert set(eagle.state_dict()) == EXPECTED_KEYS - {"fc.weight"}


def test_loaded_head_gives_the_saved_modules_output(target, tmp_path):
    head, config = random_head(target)
    save_heads(tmp_path / "heads", head, config)
    loaded, loaded_config = load_heads(tmp_path / "heads", target=target.identity)
    assert loaded_config == read_heads_config(tmp_path / "heads")
    assert loaded_config.kind == "eagle3" and loaded_config.tap_layers == config.tap_layers
    ids = torch.tensor([prompts(1, seed=5)[0]])
    with torch.no_grad():
        out = target(ids, config.tap_layers)
        taps = torch.cat(out.taps, dim=-1)
        embeds = next_token_embeddings(target.embeddings(), ids)
        expected, _ = head(taps, embeds, 3)
        got, _ = loaded(taps, embeds, 3)
    assert torch.isfinite(got).all()
    assert torch.equal(got, expected)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)


def test_draft_vocab_keeps_the_most_frequent_tokens_and_eos():
    counts = torch.tensor([5, 0, 0, 9, 7, 1, 3, 8])
    d2t, t2d = build_draft_vocab(counts, 4, always_include=[2])
    kept = torch.arange(4) + d2t
    assert kept.tolist() == [2, 3, 4, 7]  # ascending target ids: EOS 2 plus the top-3 counts
    assert t2d.nonzero().flatten().tolist() == kept.tolist()
    full_d2t, full_t2d = build_draft_vocab(counts, 100)  # clamped to the vocab: identity
    assert full_d2t.tolist() == [0] * 8 and full_t2d.all()
    ids = torch.tensor([[1, 1, 2, 3], [3, 3, 0, 0]])
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    assert count_tokens(ids, mask, 5).tolist() == [0, 2, 1, 3, 0]


def test_ttt_loss_per_step_and_mask():
    torch.manual_seed(0)
    num_steps, batch, seq, vocab = 3, 2, 8, 10
    draft_ids = torch.tensor([0, 2, 3, 5, 9])
    target_logits = torch.randn(batch, seq, vocab)
    # A head that copies the target's restricted logits at t+1+j has zero loss at every step.
    head_logits = torch.stack([torch.nn.functional.pad(target_logits[:, 1 + j:], (0, 0, 0, 1 + j))[..., draft_ids]
                               for j in range(num_steps)])
    mask = torch.ones(batch, seq, dtype=torch.bool)
    result = eagle_ttt_loss(head_logits, target_logits, mask, draft_ids)
    assert result.head_loss.shape == (num_steps,)
    assert result.head_loss.abs().max() < 1e-5
    assert result.head_count.tolist() == [batch * (seq - 1 - j) for j in range(num_steps)]
    worse = eagle_ttt_loss(head_logits + torch.randn_like(head_logits), target_logits, mask, draft_ids)
    assert (worse.head_loss > 0).all() and worse.loss > 0


@pytest.mark.parametrize("num_layers", [1, 2])
def test_unrolled_training_forward_matches_one_step_at_a_time(target, num_layers):
    """Step j of the TTT forward at position t == feeding the head its own step j-1 feature
    with explicit keys: step-0 rows <= t plus rows t of steps 1..j (the diagonal mask)."""
    head, config = random_head(target, num_layers=num_layers)
    ids = torch.tensor([prompts(1, seed=9)[0] + [7, 8, 9]])
    seq = ids.shape[1]
    with torch.no_grad():
        taps = torch.cat(target(ids, config.tap_layers).taps, dim=-1)
        embeds = next_token_embeddings(target.embeddings(), ids)
        logits, _ = head(taps, embeds, 3)
        t = seq - 4
        feature0, (k0, v0) = head.step(embeds[:, :t + 1], head.fuse(taps[:, :t + 1]),
                                       torch.arange(t + 1)[None])
        feature, keys, values = feature0[:, -1:], k0, v0
        for j in range(1, 3):
            mask = torch.ones(1, 1, 1, keys.shape[-2] + 1, dtype=torch.bool)
            feature, (k, v) = head.step(embeds[:, t + j:t + j + 1], feature, torch.tensor([[t + j]]),
                                        (keys, values), mask)
            keys, values = torch.cat([keys, k], -2), torch.cat([values, v], -2)
            torch.testing.assert_close(head.logits(feature)[0, 0], logits[j, 0, t], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_drafting_matches_the_training_forward_across_commits(target, monkeypatch, num_layers):
    """Every drafted node equals the TTT forward's candidate over the committed tokens plus
    the node's ancestors, also after commits of several tokens (the head cache's update, every
    layer's). Runs the engine's own step; the drafter's tree is checked, then the target's greedy
    tokens are put on the tree's first path ([0], [0, 0], [0, 0, 0]; its depth-4 node made wrong)
    so that each step commits four positions."""
    head, config = random_head(target, seed=1, num_layers=num_layers)
    tree = DraftTree.from_paths(TREE_PATHS)
    decoder = SpeculativeDecoder(target, head, tree, tap_layers=config.tap_layers)
    prompt = prompts(1, seed=11)[0]
    greedy = hf_greedy(target, prompt, 16)
    draft_ids = head.draft_to_target()
    engine = BatchEngine(decoder, max_batch_size=1, max_cache_len=len(prompt) + 16 + decoder.max_tree_nodes)
    seq = engine.check(SequenceRequest(prompt, 16))
    engine.add(seq)
    first_path = [TREE_PATHS.index([0] * depth) + 1 for depth in range(1, 5)]  # node 0 is the root
    drafter = engine.device_step.heads  # the engine's own copy of the decoder's drafter
    real_draft, checked = drafter.draft, []

    def check_then_force(rows, roots_n, lens_n, key_bound):
        drafts = real_draft(rows, roots_n, lens_n, key_bound)
        tree_tokens, context = drafts.tokens[0], prompt + seq.tokens  # the committed tokens, then the root
        assert int(tree_tokens[0]) == seq.tokens[-1]
        for node in range(1, tree.num_nodes):  # the training forward on committed + ancestors' tokens
            chain, parent = [], int(tree.parents[node])
            while parent > 0:
                chain.append(int(tree_tokens[parent]))
                parent = int(tree.parents[parent])
            ids = torch.tensor([context + chain[::-1]])
            taps = torch.cat(target(ids, config.tap_layers).taps, dim=-1)
            depth = int(tree.depths[node])
            logits, _ = head(taps, next_token_embeddings(target.embeddings(), ids), depth)
            ranked = logits[depth - 1, 0, len(context) - 2].topk(tree.max_rank + 1).indices
            assert int(tree_tokens[node]) == int(draft_ids[ranked[int(tree.ranks[node])]])
        checked.append(len(context))
        forced, following = drafts.tokens.clone(), greedy[len(seq.tokens):][:4]
        forced[0, first_path[:3]] = torch.tensor(following[:3])
        forced[0, first_path[3]] = (following[3] + 1) % target.vocab_size
        return dataclasses.replace(drafts, tokens=forced)

    monkeypatch.setattr(drafter, "draft", check_then_force)
    for _ in range(3):
        assert len(engine.step()[seq.seq_id]) == 4  # three forced tokens accepted, plus the bonus
        assert seq.tokens == greedy[:len(seq.tokens)]
    assert checked == [len(prompt) + 1 + 4 * step for step in range(3)]


def test_lossless_greedy_with_random_eagle3_heads(target):
    head, config = random_head(target)
    decoder = SpeculativeDecoder(target, head, DraftTree.from_paths(TREE_PATHS), tap_layers=config.tap_layers)
    for prompt in prompts(NUM_PROMPTS, seed=1):
        result = generate(decoder, prompt, NUM_NEW)
        assert result.tokens == hf_greedy(target, prompt, NUM_NEW)


def test_lossless_greedy_with_an_eagle_1_2_variant_head(target):
    head, config = random_head(target, seed=2, kind="eagle")
    decoder = SpeculativeDecoder(target, head, DraftTree.chain(3), tap_layers=config.tap_layers)
    for prompt in prompts(5, seed=2):
        assert generate(decoder, prompt, NUM_NEW).tokens == hf_greedy(target, prompt, NUM_NEW)


def test_eagle_config_needs_its_sizes_and_old_medusa_configs_still_load(target):
    config = eagle_config(target).to_dict()
    config["num_kv_heads"] = None
    with pytest.raises(ValueError, match="num_kv_heads"):
        HeadsConfig.from_dict(config)
    medusa = HeadsConfig(kind="medusa", hidden_size=64, vocab_size=256, num_heads=2, num_layers=1,
                         tap_layers=[4], target=target.identity).to_dict()
    for key in ("num_attention_heads", "num_kv_heads", "intermediate_size", "draft_vocab_size", "rope_theta",
                "rms_norm_eps"):
        medusa.pop(key)  # a config written before EAGLE existed
    assert HeadsConfig.from_dict(medusa).kind == "medusa"


# ---------------------------------------------------------------------------- training runs

def write_eagle_recipe(tmp_path, target_dir, source, output_dir, steps: int, kind: str = "eagle3",
                       num_layers: int = 1) -> Path:
    path = tmp_path / f"{kind}-{steps}.yaml"
    path.write_text(f"""\
target:
  name_or_path: {target_dir}
heads:
  kind: {kind}
  num_layers: {num_layers}
  ttt_steps: 3
  draft_vocab_size: 100
data:
  source: {source}
  seq_len: 64
train:
  steps: {steps}
  micro_batch_size: 8
  lr: 0.01
  warmup_steps: 2
  save_every: 10
  log_every: 10
  output_dir: {output_dir}
calibrate:
  num_nodes: 8
  max_rank: 3
  eval_batches: 2
""")
    return path


@pytest.fixture(scope="module")
def walks(tmp_path_factory):
    from test_training import markov_walks, write_jsonl

    return write_jsonl(tmp_path_factory.mktemp("eagle-data") / "walks.jsonl", markov_walks())


def test_eagle3_training_calibrates_decodes_losslessly_and_resumes_exactly(tiny_llama_dir, walks, tmp_path):
    from safetensors.torch import load_file

    from specheads.train import main

    assert main([str(write_eagle_recipe(tmp_path, tiny_llama_dir, walks, tmp_path / "straight", 20))]) == 0
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    head, config = load_heads(tmp_path / "straight" / "heads", target=target.identity)
    assert config.kind == "eagle3" and config.num_heads == 3 and config.draft_vocab_size == 100
    assert config.tap_layers == default_tap_layers(target.num_layers)
    assert len(config.calibration["accuracy"]) == 3 and config.tree["num_nodes"] >= 1
    assert bool(head.t2d[2]) and int(head.t2d.sum()) == 100  # EOS always in the draft vocab
    decoder = SpeculativeDecoder(target, head, TreeSpec.from_heads_config(config).tree, tap_layers=config.tap_layers)
    for prompt in [[5, 9, 17], [40, 41], [60, 12, 13, 30]]:
        assert generate(decoder, prompt, 16).tokens == hf_greedy(target, prompt, 16)

    # 20 steps, a "crash" after step 10's checkpoint, then resumed: the same head as straight.
    resumed = write_eagle_recipe(tmp_path, tiny_llama_dir, walks, tmp_path / "resumed", 20)
    assert main([str(resumed)]) == 0
    checkpoints = tmp_path / "resumed" / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000020")
    shutil.rmtree(tmp_path / "resumed" / "heads")
    (checkpoints / "latest").write_text("step-00000010\n")
    assert main([str(resumed)]) == 0
    a = load_file(str(tmp_path / "straight" / "heads" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "heads" / "model.safetensors"))
    assert a.keys() == b.keys() == EXPECTED_KEYS
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_eagle_1_2_variant_trains_with_feature_regression_and_decodes(tiny_llama_dir, walks, tmp_path):
    from specheads.train import main

    assert main([str(write_eagle_recipe(tmp_path, tiny_llama_dir, walks, tmp_path / "run", 4, kind="eagle"))]) == 0
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    head, config = load_heads(tmp_path / "run" / "heads", target=target.identity)
    assert config.kind == "eagle" and config.tap_layers == [target.num_layers]
    assert head.fc is None and config.draft_vocab_size == target.vocab_size
    decoder = SpeculativeDecoder(target, head, TreeSpec.from_heads_config(config).tree, tap_layers=config.tap_layers)
    assert generate(decoder, [5, 9, 17], 12).tokens == hf_greedy(target, [5, 9, 17], 12)


def test_a_two_layer_eagle3_head_trains_calibrates_and_decodes_losslessly(tiny_llama_dir, walks, tmp_path):
    from specheads.train import main

    recipe = write_eagle_recipe(tmp_path, tiny_llama_dir, walks, tmp_path / "run", 6, num_layers=2)
    assert main([str(recipe)]) == 0
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    head, config = load_heads(tmp_path / "run" / "heads", target=target.identity)
    assert config.num_layers == 2 and list(head.layers) == ["1"]
    assert set(head.state_dict()) == EXPECTED_KEYS | {f"layers.1.{name}" for name in LAYER_WEIGHT_NAMES}
    assert len(config.calibration["accuracy"]) == 3
    decoder = SpeculativeDecoder(target, head, TreeSpec.from_heads_config(config).tree, tap_layers=config.tap_layers)
    for prompt in [[5, 9, 17], [60, 12, 13, 30]]:
        assert generate(decoder, prompt, 12).tokens == hf_greedy(target, prompt, 12)


# ---------------------------------------------------------------------------- must-show

@pytest.mark.slow
def test_eagle3_beats_medusa_on_tau_with_the_same_data_and_budget(embedded_target_dir, tmp_path):
    """The shipped tiny recipes (same data, same steps) on the embedded target: EAGLE-3's tau
    with real greedy decoding of held-out prompts is higher than Medusa's. About 5 minutes."""
    import random

    from transformers import AutoTokenizer

    from specheads.data.corpus import stdlib_texts
    from specheads.train import main

    recipes = REPO / "recipes"
    target = TargetAdapter.from_pretrained(embedded_target_dir)
    tokenizer = AutoTokenizer.from_pretrained(embedded_target_dir)
    rng = random.Random(0)
    texts = [t for t in stdlib_texts("heldout") if len(t) > 2000]
    held_out = []
    for i in range(16):
        ids = tokenizer(texts[i % len(texts)], add_special_tokens=False)["input_ids"]
        start = rng.randrange(0, len(ids) - 64)
        held_out.append(ids[start:start + rng.randrange(8, 40)])
    tau = {}
    for name in ("tiny-medusa", "tiny-eagle3"):
        out = tmp_path / name
        assert main([str(recipes / f"{name}.yaml"), "--set", f"train.output_dir={out}", "--set", "train.zero_stage=0",
                     "--set", f"target.name_or_path={embedded_target_dir}"]) == 0
        heads, config = load_heads(out / "heads", target=target.identity)
        decoder = SpeculativeDecoder(target, heads, TreeSpec.from_heads_config(config).tree, tap_layers=config.tap_layers,
                                     fallback=None)  # tau must not depend on measured step times
        stats = None
        for prompt in held_out:
            result = generate(decoder, prompt, 80)
            assert result.tokens == hf_greedy(target, prompt, 80)
            stats = result.stats if stats is None else stats.merge(result.stats)
        tau[name] = stats.tau
    assert tau["tiny-eagle3"] > tau["tiny-medusa"], tau
