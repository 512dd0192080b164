"""heads/artefacts/export_eagle3.py through heads/artefacts/export.py: the EAGLE-3 layout (one layer, and vLLM's
multi-layer drafts) out and back, exactly. Synthetic states carry the module's parameter names
and shapes; the real module is used where its arithmetic matters."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specheads.heads.artefacts import export_eagle3
from specheads.heads.artefacts.export import detect_format, export_heads, import_heads
from specheads.heads.artefacts.heads_dir import HeadsConfig, build_heads, eagle_heads_config, load_heads, save_heads
from specheads.heads.target.adapter import TargetAdapter

from test_export import HIDDEN, TARGET, VOCAB, assert_same_state, read_config

EAGLE_HEADS, EAGLE_KV_HEADS, INTERMEDIATE, DRAFT_VOCAB = 4, 2, 64, 40


def eagle3_fields():
    return {"hidden_size": HIDDEN, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
            "num_attention_heads": EAGLE_HEADS, "num_kv_heads": EAGLE_KV_HEADS,
            "intermediate_size": INTERMEDIATE, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def eagle3_state():
    torch.manual_seed(1)
    head_dim = HIDDEN // EAGLE_HEADS
    shapes = {
        "fc.weight": (HIDDEN, 3 * HIDDEN),
        "midlayer.input_layernorm.weight": (HIDDEN,),
        "midlayer.hidden_norm.weight": (HIDDEN,),
        "midlayer.self_attn.q_proj.weight": (EAGLE_HEADS * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": (EAGLE_KV_HEADS * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": (EAGLE_KV_HEADS * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": (HIDDEN, EAGLE_HEADS * head_dim),
        "midlayer.post_attention_layernorm.weight": (HIDDEN,),
        "midlayer.mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
        "midlayer.mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        "midlayer.mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        "norm.weight": (HIDDEN,),
        "lm_head.weight": (DRAFT_VOCAB, HIDDEN),
    }
    state = {name: torch.randn(shape) for name, shape in shapes.items()}
    draft_to_target = torch.sort(torch.randperm(VOCAB)[:DRAFT_VOCAB]).values
    state["d2t"] = draft_to_target - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_to_target] = True
    state["t2d"] = t2d
    return state


def eagle3_config(taps=(1, 2, 3)):
    return {"kind": "eagle3", **eagle3_fields(), "tap_layers": list(taps), "target": dataclasses.asdict(TARGET),
            "dtype": "float32", "max_position_embeddings": 2048}


def test_eagle3_layout_keys_config_and_round_trip():
    config, state = eagle3_config(), eagle3_state()
    foreign, foreign_state = export_eagle3.to_eagle3(config, state)
    assert list(foreign_state) == list(export_eagle3.EAGLE3_WEIGHT_NAMES)
    assert sorted(foreign_state) == sorted(state)
    assert foreign == {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_attention_heads": EAGLE_HEADS,
        "num_key_value_heads": EAGLE_KV_HEADS, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "hidden_act": "silu", "norm_before_residual": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32", "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True},
    }
    assert detect_format(foreign) == "eagle3"
    fields, back = export_eagle3.from_eagle3(foreign, foreign_state, TARGET.num_layers)
    assert fields == {**eagle3_fields(), "max_position_embeddings": 2048, "tap_layers": [1, 2, 3], "num_layers": 1}
    assert_same_state(back, state)
    # d2t really maps draft ids to target ids: the t2d set.
    targets = torch.arange(DRAFT_VOCAB) + back["d2t"]
    assert torch.equal(torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, targets, True), back["t2d"])


def test_eagle3_export_lets_the_official_eagle_runtime_load_the_target_embeddings(tiny_llama_dir):
    # SafeAILab/EAGLE cnets.Model copies the target's embed_tokens only when the config has no
    # target_hidden_size, and loads the file with strict=False: the field must be absent.
    target = TargetAdapter.from_pretrained(str(tiny_llama_dir))
    config = eagle_heads_config(target, num_steps=2, draft_vocab_size=DRAFT_VOCAB).to_dict()
    assert config["max_position_embeddings"] == target.text_config.max_position_embeddings == 512
    state = build_heads(HeadsConfig.from_dict(config)).state_dict()
    foreign, _ = export_eagle3.to_eagle3(config, state)
    assert "target_hidden_size" not in foreign
    assert foreign["max_position_embeddings"] == 512  # the target's own, not a fixed 8192
    # Heads written before HeadsConfig recorded it still export, with the engines' fallback.
    del config["max_position_embeddings"]
    assert export_eagle3.to_eagle3(config, state)[0]["max_position_embeddings"] == 8192


def test_eagle3_layer_id_conventions():
    """ours: tap i = input of layer i. vLLM: same (top-level key). SGLang: output of layer id (nested key)."""
    num_layers = 32
    assert export_eagle3.taps_to_vllm_ids([2, 16, 29], num_layers) == [2, 16, 29]
    assert export_eagle3.taps_to_sglang_ids([2, 16, 29], num_layers) == [1, 15, 28]
    # SpecForge writes the SGLang convention: [1, 15, 28] means target layers 2, 16, 29's inputs.
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28], "use_aux_hidden_state": True}}
    assert export_eagle3.taps_from_foreign(nested, num_layers, "x") == [2, 16, 29]
    top = {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}
    assert export_eagle3.taps_from_foreign(top, num_layers, "x") == [2, 16, 29]
    both = {**nested, "eagle_aux_hidden_state_layer_ids": [2, 16, 29]}
    assert export_eagle3.taps_from_foreign(both, num_layers, "x") == [2, 16, 29]
    with pytest.raises(ValueError, match="different target layers"):
        export_eagle3.taps_from_foreign({**nested, "eagle_aux_hidden_state_layer_ids": [1, 15, 28]}, num_layers, "x")
    # No ids: both engines' default, (2, L // 2, L - 3) as inputs of layers.
    assert export_eagle3.taps_from_foreign({}, num_layers, "x") == [2, 16, 29]
    with pytest.raises(ValueError, match="--target"):
        export_eagle3.taps_from_foreign({}, None, "x")
    with pytest.raises(ValueError, match="no EAGLE-3 layer id"):
        export_eagle3.taps_to_vllm_ids([0, 2, num_layers], num_layers)


def test_tap_i_is_what_vllm_captures_before_layer_i(tiny_llama_dir):
    """Our tap i is the input of decoder layer i, the state vLLM/SGLang capture as
    `hidden_states + residual` before running layer i; the converters rely on it."""
    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    captured = {}

    def capture(index):
        def hook(module, args, kwargs):
            captured[index] = (args[0] if args else kwargs["hidden_states"]).clone()
        return hook

    layers = target.model.model.layers
    handles = [layer.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        ids = torch.randint(0, target.vocab_size, (1, 6))
        out = target(ids, list(range(1, target.num_layers)))
    finally:
        for handle in handles:
            handle.remove()
    for position, tap in enumerate(range(1, target.num_layers)):
        assert torch.equal(out.taps[position], captured[tap])


def test_eagle3_import_fills_identity_maps_and_refuses_bad_configs():
    state = eagle3_state()
    state["lm_head.weight"] = torch.randn(VOCAB, HIDDEN)
    del state["d2t"], state["t2d"]
    state["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN)
    foreign = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": HIDDEN, "vocab_size": VOCAB,
               "intermediate_size": INTERMEDIATE, "num_attention_heads": EAGLE_HEADS, "rms_norm_eps": 1e-5,
               "rope_theta": 500000.0, "num_hidden_layers": 1}
    fields, back = export_eagle3.from_eagle3(foreign, state, 32)
    assert fields["draft_vocab_size"] == VOCAB and fields["num_kv_heads"] == EAGLE_HEADS
    assert fields["tap_layers"] == [2, 16, 29]
    assert torch.equal(back["d2t"], torch.zeros(VOCAB, dtype=torch.int64))
    assert bool(back["t2d"].all()) and "embed_tokens.weight" not in back
    with pytest.raises(ValueError, match=r"head of 2 layer\(s\).*missing \['layers.1.input_layernorm.weight'"):
        export_eagle3.from_eagle3({**foreign, "num_hidden_layers": 2}, state, 32)
    with pytest.raises(ValueError, match="num_hidden_layers=0; expected a whole number >= 1"):
        export_eagle3.from_eagle3({**foreign, "num_hidden_layers": 0}, state, 32)
    with pytest.raises(ValueError, match="missing"):
        export_eagle3.from_eagle3(foreign, {"fc.weight": state["fc.weight"]}, 32)
    with pytest.raises(ValueError, match="not exportable"):
        export_eagle3.to_eagle3(eagle3_config(), {**eagle3_state(), "extra": torch.zeros(1)})
    for bad in ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, {"norm_before_residual": True},
                {"hidden_act": "gelu"}, {"attention_bias": True}):
        with pytest.raises(ValueError, match="cannot be imported exactly"):
            export_eagle3.from_eagle3({**foreign, **bad}, state, 32)


def real_heads(num_heads: int, num_layers: int, seed: int, std: float):
    """The real EAGLE-3 module of eagle3_config()'s sizes, with random weights -> (heads, config)."""
    names = {f.name for f in dataclasses.fields(HeadsConfig)}
    values = {name: value for name, value in eagle3_config().items() if name in names}
    config = HeadsConfig(**{**values, "target": TARGET, "num_heads": num_heads, "num_layers": num_layers})
    heads = build_heads(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_(std=std)
    return heads, config


def test_eagle3_directory_round_trip_with_the_real_module(tmp_path):
    heads, config = real_heads(num_heads=1, num_layers=1, seed=2, std=0.3)
    assert sorted(heads.state_dict()) == sorted(export_eagle3.EAGLE3_WEIGHT_NAMES)
    save_heads(tmp_path / "heads", heads, config)
    export_heads(tmp_path / "heads", "eagle3", tmp_path / "foreign")
    import_heads(tmp_path / "foreign", tmp_path / "back")
    assert read_config(tmp_path / "back") == config.to_dict()
    assert_same_state(load_file(str(tmp_path / "back" / "model.safetensors")),
                      load_file(str(tmp_path / "heads" / "model.safetensors")))
    loaded, _ = load_heads(tmp_path / "back")
    assert_same_state(loaded.state_dict(), heads.state_dict())

    # Trained elsewhere: no specheads block, the target from --target, SGLang-style ids only.
    foreign = read_config(tmp_path / "foreign")
    del foreign["specheads"], foreign["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "foreign" / "config.json").write_text(json.dumps(foreign))
    with pytest.raises(ValueError, match="--target"):
        import_heads(tmp_path / "foreign", tmp_path / "elsewhere")
    import_heads(tmp_path / "foreign", tmp_path / "elsewhere", target=TARGET)
    loaded, imported = load_heads(tmp_path / "elsewhere", target=TARGET)
    assert imported.kind == "eagle3" and imported.tap_layers == [1, 2, 3]
    assert (imported.num_heads, imported.num_layers, imported.tree) == (4, 1, None)
    assert_same_state(loaded.state_dict(), heads.state_dict())


def vllm_style_forward(state, config, embeds, feature, positions):
    """vLLM's multi-layer EAGLE-3 arithmetic (models/llama_eagle3.py), written out from the
    exported names: layer 0 reads [input_layernorm(embeds) ; hidden_norm(feature)] with the
    feature as residual; layer i >= 1 fuses the residual add into input_layernorm(h, residual);
    the final norm adds the last residual. Causal rows, no cache. -> (pre-norm state, logits)."""
    eps, heads, kv_heads = config.rms_norm_eps, config.num_attention_heads, config.num_kv_heads
    head_dim = config.hidden_size // heads

    def norm(x, name):
        return state[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x):  # [1, h, T, D]
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = positions[0].float()[:, None] * inv
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        return x * cos + torch.cat([-x[..., head_dim // 2:], x[..., :head_dim // 2]], -1) * sin

    def attention(x, p):
        q, k, v = (F.linear(x, state[f"{p}self_attn.{n}_proj.weight"]) for n in "qkv")
        q = rope(q.view(1, -1, heads, head_dim).transpose(1, 2))
        k = rope(k.view(1, -1, kv_heads, head_dim).transpose(1, 2))
        v = v.view(1, -1, kv_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.linear(out.transpose(1, 2).reshape(1, q.shape[2], -1), state[f"{p}self_attn.o_proj.weight"])

    hidden = residual = None
    for i in range(config.num_layers):
        p = f"layers.{i}."
        if i == 0:
            x, residual = torch.cat([norm(embeds, p + "input_layernorm.weight"),
                                     norm(feature, p + "hidden_norm.weight")], -1), feature
        else:
            residual = hidden + residual
            x = norm(residual, p + "input_layernorm.weight")
        residual = attention(x, p) + residual
        x = norm(residual, p + "post_attention_layernorm.weight")
        gate, up = F.linear(x, state[p + "mlp.gate_proj.weight"]), F.linear(x, state[p + "mlp.up_proj.weight"])
        hidden = F.linear(F.silu(gate) * up, state[p + "mlp.down_proj.weight"])
    prenorm = hidden + residual
    return prenorm, F.linear(norm(prenorm, "norm.weight"), state["lm_head.weight"])


def test_a_two_layer_head_exports_in_vllms_multi_layer_layout_and_round_trips(tmp_path):
    heads, config = real_heads(num_heads=2, num_layers=2, seed=4, std=0.2)
    foreign, foreign_state = export_eagle3.to_eagle3(config.to_dict(), heads.state_dict())
    assert foreign["num_hidden_layers"] == 2
    # Every parameter vLLM's two-layer draft builds, under the name it loads ("midlayer." -> "layers.0.").
    per_layer = ["input_layernorm", "hidden_norm", "post_attention_layernorm"]
    per_layer = [f"{n}.weight" for n in per_layer] + [f"self_attn.{n}_proj.weight" for n in "qkvo"] \
        + [f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    vllm_names = {name.replace("midlayer.", "layers.0.") for name in foreign_state}
    assert vllm_names == {f"layers.{i}.{n}" for i in range(2) for n in per_layer} \
        | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert torch.equal(foreign_state["layers.1.hidden_norm.weight"], torch.ones(HIDDEN))  # built, never read
    assert foreign_state["layers.1.self_attn.q_proj.weight"].shape[1] == HIDDEN  # layers >= 1 read h only

    # What vLLM computes from those tensors is what the head computes.
    renamed = {name.replace("midlayer.", "layers.0."): t for name, t in foreign_state.items()}
    torch.manual_seed(5)
    taps, embeds = torch.randn(1, 7, 3 * HIDDEN), torch.randn(1, 7, HIDDEN)
    positions = torch.arange(7)[None]
    with torch.no_grad():
        feature = heads.fuse(taps)
        ours, (keys, values) = heads.step(embeds, feature, positions)
        theirs, their_logits = vllm_style_forward(renamed, config, embeds, feature, positions)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(heads.logits(ours), their_logits, rtol=1e-4, atol=1e-4)
    assert keys.shape[0] == values.shape[0] == 2  # one cache per layer

    save_heads(tmp_path / "heads", heads, config)
    export_heads(tmp_path / "heads", "eagle3", tmp_path / "foreign")
    import_heads(tmp_path / "foreign", tmp_path / "back")
    assert read_config(tmp_path / "back") == config.to_dict()
    loaded, _ = load_heads(tmp_path / "back")
    assert_same_state(loaded.state_dict(), heads.state_dict())
    foreign = read_config(tmp_path / "foreign")  # trained elsewhere: the layer count from num_hidden_layers
    del foreign["specheads"]
    (tmp_path / "foreign" / "config.json").write_text(json.dumps(foreign))
    import_heads(tmp_path / "foreign", tmp_path / "elsewhere", target=TARGET)
    loaded, imported = load_heads(tmp_path / "elsewhere", target=TARGET)
    assert imported.num_layers == 2
    assert_same_state(loaded.state_dict(), heads.state_dict())
