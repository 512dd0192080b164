"""EAGLE-3 heads to and from the EAGLE-3 checkpoint layout that vLLM and SGLang load.

Pure functions on (config dict, state dict); `heads/artefacts/export.py` does the file IO.

Weights (model.safetensors) are the EAGLE-3 module's own names, unchanged:
    fc.weight [H, 3H], midlayer.input_layernorm.weight [H], midlayer.hidden_norm.weight [H],
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2H], midlayer.self_attn.o_proj.weight,
    midlayer.post_attention_layernorm.weight [H], midlayer.mlp.{gate,up,down}_proj.weight,
    norm.weight [H], lm_head.weight [draft_vocab, H], d2t [draft_vocab] int64
    (target_id = draft_id + d2t[draft_id]), t2d [vocab] bool.
  vLLM (models/llama_eagle3.py) renames "midlayer." to "layers.0.", "d2t" to
  draft_id_to_target_id, and skips t2d; SGLang (models/llama_eagle3.py) reads the same names.
  On import, an "embed_tokens.weight" (a frozen copy of the target's embeddings some trainers
  save) is dropped, since specheads heads use the target's own embeddings.
  Heads of num_layers L > 1 (vLLM's multi-layer drafts) add layers.{i}.* for i = 1..L-1, the
  names vLLM's LlamaModel gives its layer i: input_layernorm, self_attn.{q,k,v,o}_proj (q/k/v
  [*, H]), post_attention_layernorm, mlp.{gate,up,down}_proj, and a hidden_norm.weight of ones
  that vLLM builds into every layer, reads only in layer 0, and refuses to leave unloaded
  (export writes it; import drops it). SGLang, the official EAGLE code and llama.cpp load
  one layer only (SGLang: "EAGLE3 currently only supports 1 layer").

config.json (a Llama config):
    architectures ["LlamaForCausalLMEagle3"], model_type "llama", hidden_size,
    intermediate_size, num_attention_heads, num_key_value_heads, num_hidden_layers (L),
    vocab_size (the target's), draft_vocab_size, rms_norm_eps, rope_theta,
    max_position_embeddings (the target's own), hidden_act "silu", norm_before_residual false,
    tie_word_embeddings false, torch_dtype,
    eagle_aux_hidden_state_layer_ids, eagle_config {eagle_aux_hidden_state_layer_ids,
    use_aux_hidden_state: true}, and a "specheads" block (our own config, so a round trip
    keeps the tree, calibration and target identity; engines ignore it).

Fields that loaders read differently (checked against these commits):
  - `target_hidden_size` is NOT written. The official EAGLE runtime (SafeAILab/EAGLE
    eagle/model/cnets.py, Model.__init__, commit cb7e0841fe0c) copies the target's
    embed_tokens into the draft only when the config has no `target_hidden_size`, and
    ea_model.py loads the draft's weights with strict=False: with the field present and no
    embed_tokens.weight in the file, it would draft from random embeddings with no error.
    Official EAGLE-3 checkpoints, EAGLE's trainer and SpecForge leave it out when it equals
    hidden_size, which specheads heads always do; vLLM and SGLang default it to hidden_size.
  - `max_position_embeddings` is the target's (HeadsConfig.max_position_embeddings): older
    vLLM and SGLang size the draft's rope cache from it, EAGLE's cnets.py too. Heads
    directories written before that field existed get DEFAULT_MAX_POSITION_EMBEDDINGS.

Tap layer ids: the two engines read different keys with different meanings.
  - specheads: tap i = hidden_states[i] = the input of target decoder layer i.
  - vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` and captures
    `hidden_states + residual` before layer i runs (LlamaModel.forward,
    v1/worker eagle3_utils.get_eagle3_aux_layers_from_config): the input of layer i, so
    vLLM id == our tap.
  - SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and captures before layer
    id + 1 (LlamaForCausalLM.set_eagle3_layers_to_capture: "for the ith layer, it takes the
    output of the (i-1)th layer"): the output of layer id, so SGLang id == our tap - 1. This
    is also what SpecForge writes.
  Export writes both keys (vLLM looks at the top-level key first, so it never sees the
  nested one). Import prefers the top-level key, else the nested key + 1, else the engines'
  shared default taps (2, L // 2, L - 3) for a target with L layers. Tap 0 (the embeddings)
  and tap L (the final normed state) have no EAGLE-3 id and are refused on export.

speculators (vLLM's format library), checked with speculators 0.9.0's converter,
speculators.convert.convert_model(algorithm="eagle3") (Eagle3Converter.convert), and its model
class Eagle3DraftModel (tests/heads/test_speculators.py, slow; speculators pins transformers <= 5.19,
so it runs in its own venv): the converter takes this layout unchanged (midlayer.* ->
layers.0.*, d2t and t2d kept; without embed_tokens.weight vLLM and the draft model use the
verifier's embeddings, though Eagle3DraftModel.from_pretrained may leave them uninitialised,
see tests/heads/speculators_roundtrip.py), and the converted model drafts what Eagle3Head drafts.
But the converter reads neither tap key from config.json (nor norm_before_residual, whose
default, false, is ours), only from its arguments, so pass the top-level ids:
    speculators convert OUT --algorithm eagle3 --verifier TARGET
        --algorithm-kwargs '{"eagle_aux_hidden_state_layer_ids": [...]}'    (one command line)
TARGET (the target's directory or hub id) must have a readable config.json; the converted
config names it as the verifier. Without the ids the converted config has none, and vLLM
(transformers_utils/configs/speculators/algos.py) and speculators use (2, L // 2, L - 3),
right only for heads on those taps.

Import refuses what specheads' Eagle3Head would compute differently (rope_scaling,
norm_before_residual true, a non-SiLU MLP, biases, head_dim * heads != hidden).

Shape legend: H hidden, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import torch

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
DEFAULT_MAX_POSITION_EMBEDDINGS = 8192  # only for heads written before HeadsConfig recorded the target's

EAGLE3_WEIGHT_NAMES = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)
LAYER_WEIGHT_NAMES = (  # of layer i >= 1, after "layers.{i}."
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
VLLM_ONLY_NAME = "hidden_norm.weight"  # of layer i >= 1: built and strictly loaded by vLLM, never read


def weight_names(num_layers: int) -> tuple[str, ...]:
    """Our EAGLE-3 state names for a head of num_layers decoder layers."""
    return EAGLE3_WEIGHT_NAMES + tuple(f"layers.{i}.{name}" for i in range(1, num_layers)
                                       for name in LAYER_WEIGHT_NAMES)


# specheads field -> foreign config key; all required both ways.
CONFIG_FIELDS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "draft_vocab_size": "draft_vocab_size",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
}
# Copied when our config has them; the engines have defaults otherwise.
OPTIONAL_FIELDS = ("max_position_embeddings",)


def taps_to_vllm_ids(taps: list[int], num_target_layers: int) -> list[int]:
    """Our taps -> vLLM's `eagle_aux_hidden_state_layer_ids` (both: input of layer i)."""
    bad = [t for t in taps if not 1 <= t <= num_target_layers - 1]
    if bad:
        raise ValueError(f"tap layers {bad} have no EAGLE-3 layer id: vLLM and SGLang capture the input of "
                         f"layers 1..{num_target_layers - 1} (the embeddings, tap 0, and the final normed "
                         f"state, tap {num_target_layers}, cannot be captured)")
    return list(taps)


def taps_to_sglang_ids(taps: list[int], num_target_layers: int) -> list[int]:
    """Our taps -> SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` (output of layer id)."""
    return [t - 1 for t in taps_to_vllm_ids(taps, num_target_layers)]


def default_taps(num_target_layers: int) -> list[int]:
    """The taps vLLM and SGLang use when a checkpoint names none (both as inputs of layers)."""
    return [2, num_target_layers // 2, num_target_layers - 3]


def taps_from_foreign(foreign: dict, num_target_layers: int | None, source: str) -> list[int]:
    top = foreign.get("eagle_aux_hidden_state_layer_ids")
    nested = (foreign.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top and nested and list(top) != [i + 1 for i in nested]:
        raise ValueError(f"{source}: eagle_aux_hidden_state_layer_ids={list(top)} (vLLM: input of layer i) and "
                         f"eagle_config.eagle_aux_hidden_state_layer_ids={list(nested)} (SGLang: output of layer i) "
                         "name different target layers; remove the one that is wrong")
    if top:
        return [int(i) for i in top]
    if nested:
        return [int(i) + 1 for i in nested]
    if num_target_layers is None:
        raise ValueError(f"{source} names no tap layers (eagle_aux_hidden_state_layer_ids); pass --target so the "
                         "engines' default taps (2, L // 2, L - 3) can be computed from the target's layer count")
    return default_taps(num_target_layers)


def to_eagle3(config: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """specheads EAGLE-3 (config dict, state) -> EAGLE-3 checkpoint (config, state)."""
    missing = [name for name in CONFIG_FIELDS if name not in config]
    if missing:
        raise ValueError(f"EAGLE-3 heads config lacks {missing}; cannot write an EAGLE-3 config.json")
    num_layers = config.get("num_layers", 1)
    names = weight_names(num_layers)
    absent, unknown = _mismatch(state, names)
    if unknown or absent:
        raise ValueError(f"EAGLE-3 heads state does not match the EAGLE-3 checkpoint layout of {num_layers} "
                         f"layer(s): missing {absent}, not exportable {unknown}")
    target = config["target"]
    taps = config["tap_layers"]
    foreign = {"architectures": [EAGLE3_ARCHITECTURES[0]], "model_type": "llama", "num_hidden_layers": num_layers}
    foreign.update({key: config[name] for name, key in CONFIG_FIELDS.items()})
    foreign["max_position_embeddings"] = DEFAULT_MAX_POSITION_EMBEDDINGS
    foreign.update({name: config[name] for name in OPTIONAL_FIELDS if config.get(name) is not None})
    foreign["hidden_act"] = "silu"
    foreign["norm_before_residual"] = False  # the residual stream is the raw fused feature
    foreign["tie_word_embeddings"] = False
    foreign["torch_dtype"] = config.get("dtype", "float32")
    foreign["eagle_aux_hidden_state_layer_ids"] = taps_to_vllm_ids(taps, target["num_layers"])
    foreign["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": taps_to_sglang_ids(taps, target["num_layers"]),
                               "use_aux_hidden_state": True}
    out = {name: state[name].clone() for name in names}
    out.update({f"layers.{i}.{VLLM_ONLY_NAME}": torch.ones_like(state["norm.weight"]) for i in range(1, num_layers)})
    return foreign, out


def from_eagle3(foreign: dict, state: dict[str, torch.Tensor], num_target_layers: int | None,
                source: str = "EAGLE-3 heads") -> tuple[dict, dict[str, torch.Tensor]]:
    """EAGLE-3 checkpoint (config, state) -> (specheads fields, specheads EAGLE-3 state).

    A checkpoint without d2t/t2d (a full draft vocabulary) gets the identity maps.
    """
    num_layers = foreign.get("num_hidden_layers", 1)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{source} has num_hidden_layers={num_layers!r}; expected a whole number >= 1")
    if (foreign.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise ValueError(f"{source} has eagle_config.use_aux_hidden_state=false (an EAGLE-1/2 style draft); "
                         "specheads EAGLE-3 heads fuse three target taps through fc")
    _refuse_unsupported(foreign, source)
    fields = {}
    for name, key in CONFIG_FIELDS.items():
        if key == "draft_vocab_size" and foreign.get(key) is None:
            fields[name] = foreign.get("vocab_size")  # the engines' default: the full vocabulary
        elif key == "num_key_value_heads" and foreign.get(key) is None:
            fields[name] = foreign.get("num_attention_heads")
        else:
            fields[name] = foreign.get(key)
    missing = [CONFIG_FIELDS[name] for name, value in fields.items() if value is None]
    if missing:
        raise ValueError(f"{source}: config.json lacks {missing}")
    fields.update({name: foreign[name] for name in OPTIONAL_FIELDS if foreign.get(name) is not None})
    target_hidden = foreign.get("target_hidden_size", fields["hidden_size"])
    if target_hidden != fields["hidden_size"]:
        raise ValueError(f"{source}: target_hidden_size={target_hidden} differs from hidden_size="
                         f"{fields['hidden_size']}; specheads EAGLE-3 heads use the target's hidden size")
    fields["tap_layers"] = taps_from_foreign(foreign, num_target_layers, source)
    fields["num_layers"] = num_layers
    return fields, _eagle3_state(state, fields["vocab_size"], fields["draft_vocab_size"], num_layers, source)


def _mismatch(state: dict[str, torch.Tensor], names: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(names the state lacks, in layout order; its names outside the layout, sorted)."""
    return [name for name in names if name not in state], sorted(set(state) - set(names))


def _refuse_unsupported(foreign: dict, source: str) -> None:
    """Config options whose draft layer computes something else than specheads' Eagle3Head."""
    problems = []
    if foreign.get("rope_scaling"):
        problems.append(f"rope_scaling={foreign['rope_scaling']} (specheads EAGLE-3 heads use plain RoPE)")
    if foreign.get("norm_before_residual"):
        problems.append("norm_before_residual=true (specheads keeps the raw feature as the residual)")
    if foreign.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={foreign['hidden_act']!r} (specheads uses SiLU)")
    heads, hidden = foreign.get("num_attention_heads"), foreign.get("hidden_size")
    if foreign.get("head_dim") is not None and heads and hidden and foreign["head_dim"] * heads != hidden:
        problems.append(f"head_dim={foreign['head_dim']} with {heads} heads != hidden_size={hidden}")
    for flag in ("attention_bias", "mlp_bias"):
        if foreign.get(flag):
            problems.append(f"{flag}=true (specheads EAGLE-3 linears have no bias)")
    if problems:
        raise ValueError(f"{source} cannot be imported exactly: " + "; ".join(problems))


def _eagle3_state(state: dict[str, torch.Tensor], vocab_size: int, draft_vocab_size: int, num_layers: int,
                  source: str) -> dict[str, torch.Tensor]:
    state = dict(state)
    # EAGLE-3 trainers may save a frozen copy of the target's embeddings; specheads heads
    # read the target's own, so it is dropped. So is what vLLM builds but never reads.
    state.pop("embed_tokens.weight", None)
    for i in range(1, num_layers):
        state.pop(f"layers.{i}.{VLLM_ONLY_NAME}", None)
    if "d2t" not in state:
        if draft_vocab_size != vocab_size:
            raise ValueError(f"{source} has draft_vocab_size={draft_vocab_size} < vocab_size={vocab_size} "
                             "but no d2t map")
        state["d2t"] = torch.zeros(draft_vocab_size, dtype=torch.int64)
    if "t2d" not in state:
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[torch.arange(draft_vocab_size) + state["d2t"].to(torch.int64)] = True
        state["t2d"] = t2d
    state["d2t"] = state["d2t"].to(torch.int64)
    state["t2d"] = state["t2d"].to(torch.bool)
    names = weight_names(num_layers)
    absent, unknown = _mismatch(state, names)
    if absent or unknown:
        raise ValueError(f"{source} does not hold an EAGLE-3 head of {num_layers} layer(s) (num_hidden_layers): "
                         f"missing {absent[:8]}, unexpected {unknown[:8]}")
    return {name: state[name] for name in names}
