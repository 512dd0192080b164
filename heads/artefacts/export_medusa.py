"""Medusa heads to and from the two foreign Medusa layouts.

Both are pure functions on (config dict, state dict); `heads/artefacts/export.py` does the file IO.

"medusa" -- the FasterDecoding/Medusa layout, which its own runtime, TGI and TensorRT-LLM load:
    config.json                  {"medusa_num_heads": K, "medusa_num_layers": L,
                                  "base_model_name_or_path": ..., "hidden_size": H, "vocab_size": V}
    medusa_lm_head.safetensors   "{i}.{j}.linear.weight" [H, H], "{i}.{j}.linear.bias" [H]
                                 (block j < L of head i), "{i}.{L}.weight" [V, H] (head i's lm_head)
    medusa_lm_head.pt            the same tensors, torch.save'd
  Medusa builds head i as nn.Sequential(ResBlock x L, nn.Linear(H, V, bias=False)), hence the
  index L for the lm_head; ResBlock is x + SiLU(linear(x)), the same block as ours. Import
  also accepts a "medusa_head." key prefix and the .pt file alone.

  Who reads what (checked against FasterDecoding/Medusa commit e2a5d20c048a; TensorRT-LLM's
  tensorrt_llm/models/medusa/weight.py load_medusa_hf, commit 27712aa7720a; TGI's
  server/text_generation_server/models/__init__.py get_model, a stored copy whose commit was
  not recorded):
  - Medusa's own runtime (medusa/model/medusa_model.py and medusa_model_legacy.py,
    MedusaModel.from_pretrained) reads only medusa_lm_head.pt, with torch.load and
    load_state_dict(strict=False); its trainer (medusa/train/train_legacy.py) writes only the
    .safetensors. So export writes both. Because of strict=False a misnamed key would leave a
    head randomly initialised with no error: the key names above are its state_dict's.
  - That runtime takes config.json through MedusaConfig (medusa_num_layers,
    base_model_name_or_path, from which it loads the target and tokenizer) and then builds
    medusa_num_heads = 5 heads whatever the file says (a "TODO: fix the uploaded config" in
    from_pretrained): heads beyond ours stay untrained, so give it medusa_choices no deeper
    than K. It also builds each head's L blocks as `[ResBlock(H)] * L`, one shared block, so
    with L > 1 it loads only the last block's weights; TGI and TensorRT-LLM load all L.
  - base_model_name_or_path is the target name the heads recorded; an `embedded:` or GGUF
    target has no name these loaders resolve, so point it at the converted HF directory.
  - TGI reads medusa_lm_head.safetensors; TensorRT-LLM reads the .pt if present, else the
    .safetensors.
  None of them has a draft vocabulary: heads trained with one are refused for this format.

"vllm-medusa" -- the key names of vLLM's `MedusaModel` (vllm/model_executor/models/medusa.py at
vLLM commit 01dbb08195ca, vllm/transformers_utils/configs/medusa.py):
    config.json        {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": H,
                        "vocab_size": V, "num_heads": K, "num_hidden_layers": L,
                        "truncated_vocab_size": Vd, "medusa_fc_bias": true}
    model.safetensors  "blocks.{i}.layers.{j}.weight" [H, H], "blocks.{i}.layers.{j}.bias" [H],
                       "lm_heads.{i}.weight" [Vd, H], and with a draft vocab (Vd < V)
                       "token_map" [Vd] int64 (the target id of each draft id)
  vLLM builds the block linears with bias=getattr(config, "medusa_fc_bias", False), so the flag
  must be true for our biases to load. Its load_weights skips names it does not know without
  a word, so these names are its named_parameters'. A draft vocab is vLLM's own truncated
  vocabulary: it reads `token_map` when truncated_vocab_size < vocab_size and scatters the Vd
  logits into the full vocab, which is what our drafter does. On import we also accept what
  vLLM's loader accepts: a "medusa_heads." key prefix, no biases (medusa_fc_bias false: zero
  biases), and `original_lm_head` (one "lm_heads.0.weight" shared by all heads).

Shape legend: K heads, L blocks per head, H hidden, V vocab, Vd draft vocab (= V without one).
"""

from __future__ import annotations

import torch

MEDUSA_WEIGHTS_NAME = "medusa_lm_head.safetensors"
MEDUSA_TORCH_WEIGHTS_NAME = "medusa_lm_head.pt"  # what Medusa's own runtime reads
VLLM_MEDUSA_ARCHITECTURE = "MedusaModel"


def _medusa_shapes(config: dict, state: dict[str, torch.Tensor]) -> tuple[int, int]:
    num_heads, num_layers = config["num_heads"], config["num_layers"]
    draft_vocab = config.get("draft_vocab_size") or config["vocab_size"]
    expected = {"block_weight": (num_heads, num_layers, config["hidden_size"], config["hidden_size"]),
                "block_bias": (num_heads, num_layers, config["hidden_size"]),
                "lm_head_weight": (num_heads, draft_vocab, config["hidden_size"])}
    if draft_vocab < config["vocab_size"]:
        expected["token_map"] = (draft_vocab,)
    if set(state) != set(expected):
        raise ValueError(f"Medusa heads have keys {sorted(state)}, expected {sorted(expected)}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(f"Medusa tensor {name} has shape {tuple(state[name].shape)}, the config says {shape}")
    return num_heads, num_layers


def _per_head_tensors(state: dict[str, torch.Tensor], num_heads: int, num_layers: int, block: str,
                      lm_head: str) -> dict[str, torch.Tensor]:
    """Split our stacked Medusa tensors into per-head ones named by the key templates
    (`block` takes {i} head and {j} block; `lm_head` takes {i})."""
    out = {}
    for i in range(num_heads):
        for j in range(num_layers):
            out[block.format(i=i, j=j) + ".weight"] = state["block_weight"][i, j].clone()
            out[block.format(i=i, j=j) + ".bias"] = state["block_bias"][i, j].clone()
        out[lm_head.format(i=i) + ".weight"] = state["lm_head_weight"][i].clone()
    return out


def to_medusa(config: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """specheads Medusa (config dict, state) -> FasterDecoding/Medusa (config, state)."""
    num_heads, num_layers = _medusa_shapes(config, state)
    if "token_map" in state:
        raise ValueError(f"these Medusa heads predict a draft vocab of {config['draft_vocab_size']} tokens, which the "
                         "FasterDecoding/Medusa layout (Medusa, TGI, TensorRT-LLM) cannot hold; export "
                         "--format vllm-medusa (vLLM reads it as token_map), or train with heads.draft_vocab_size null")
    out = _per_head_tensors(state, num_heads, num_layers, block="{i}.{j}.linear", lm_head=f"{{i}}.{num_layers}")
    foreign = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
               "base_model_name_or_path": config["target"]["name_or_path"],
               "hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"]}
    return foreign, out


def to_vllm_medusa(config: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """specheads Medusa (config dict, state) -> vLLM MedusaModel (config, state)."""
    num_heads, num_layers = _medusa_shapes(config, state)
    out = _per_head_tensors(state, num_heads, num_layers, block="blocks.{i}.layers.{j}", lm_head="lm_heads.{i}")
    if "token_map" in state:
        out["token_map"] = state["token_map"].clone()
    foreign = {"architectures": [VLLM_MEDUSA_ARCHITECTURE], "model_type": "medusa",
               "hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"],
               "num_heads": num_heads, "num_hidden_layers": num_layers,
               "truncated_vocab_size": config.get("draft_vocab_size") or config["vocab_size"], "medusa_fc_bias": True}
    return foreign, out


def _stack(get, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int,
           source: str) -> dict[str, torch.Tensor]:
    """Stack per-head tensors; `get(kind, i, j)` returns a tensor or None when absent."""
    lm_heads = [get("lm_head", i, None) for i in range(num_heads)]
    missing = [i for i, t in enumerate(lm_heads) if t is None]
    if missing:
        raise ValueError(f"{source} has no lm_head weight for Medusa heads {missing}")
    dtype = lm_heads[0].dtype
    weight = torch.zeros(num_heads, num_layers, hidden_size, hidden_size, dtype=dtype)
    bias = torch.zeros(num_heads, num_layers, hidden_size, dtype=dtype)
    for i in range(num_heads):
        for j in range(num_layers):
            w = get("weight", i, j)
            if w is None:
                raise ValueError(f"{source} has no weight for block {j} of Medusa head {i}")
            weight[i, j] = _checked(w, (hidden_size, hidden_size), f"block {j} of head {i}", source)
            b = get("bias", i, j)
            if b is not None:
                bias[i, j] = _checked(b, (hidden_size,), f"bias of block {j} of head {i}", source)
    lm_head = torch.stack([_checked(t, (vocab_size, hidden_size), f"lm_head of head {i}", source)
                           for i, t in enumerate(lm_heads)])
    return {"block_weight": weight, "block_bias": bias, "lm_head_weight": lm_head}


def _checked(tensor: torch.Tensor, shape: tuple, what: str, source: str) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{source}: {what} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


def _count(state: dict, pattern_prefix, index: int) -> int:
    """How many distinct values the `index`-th dotted field of keys takes (keys with `pattern_prefix`)."""
    return len({k.split(".")[index] for k in state if k.startswith(pattern_prefix)})


def from_medusa(foreign: dict, state: dict[str, torch.Tensor],
                source: str = "Medusa heads") -> tuple[dict, dict[str, torch.Tensor]]:
    """FasterDecoding/Medusa (config, state) -> (sizes dict, specheads Medusa state)."""
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    for key in ("medusa_num_heads", "medusa_num_layers"):
        if not isinstance(foreign.get(key), int):
            raise ValueError(f"{source}: config.json needs an integer {key!r}, got {foreign.get(key)!r}")
    num_heads, num_layers = foreign["medusa_num_heads"], foreign["medusa_num_layers"]
    lm_head0 = state.get(f"0.{num_layers}.weight")
    if lm_head0 is None:
        raise ValueError(f"{source} has no key '0.{num_layers}.weight' (head 0's lm_head for "
                         f"medusa_num_layers={num_layers}); keys start {sorted(state)[:6]}")
    vocab_size, hidden_size = lm_head0.shape
    present_heads = {k.split(".")[0] for k in state}
    if present_heads != {str(i) for i in range(num_heads)}:
        raise ValueError(f"{source}: weights hold heads {sorted(present_heads)}, "
                         f"config says medusa_num_heads={num_heads}")

    def get(kind, i, j):
        key = {"lm_head": f"{i}.{num_layers}.weight", "weight": f"{i}.{j}.linear.weight",
               "bias": f"{i}.{j}.linear.bias"}[kind]
        return state.get(key)

    sizes = {"num_heads": num_heads, "num_layers": num_layers, "hidden_size": hidden_size,
             "vocab_size": vocab_size}
    _check_sizes(foreign, sizes, ("hidden_size", "vocab_size"), source)
    return sizes, _stack(get, num_heads, num_layers, hidden_size, vocab_size, source)


def from_vllm_medusa(foreign: dict, state: dict[str, torch.Tensor],
                     source: str = "vLLM Medusa heads") -> tuple[dict, dict[str, torch.Tensor]]:
    """vLLM MedusaModel (config, state) -> (sizes dict, specheads Medusa state)."""
    state = {k.removeprefix("medusa_heads."): v for k, v in state.items()}
    for key in ("num_heads", "num_hidden_layers", "hidden_size", "vocab_size"):
        if not isinstance(foreign.get(key), int):
            raise ValueError(f"{source}: config.json needs an integer {key!r}, got {foreign.get(key)!r}")
    num_heads, num_layers = foreign["num_heads"], foreign["num_hidden_layers"]
    hidden_size, vocab_size = foreign["hidden_size"], foreign["vocab_size"]
    truncated = foreign.get("truncated_vocab_size") or vocab_size
    token_map = state.pop("token_map", None)
    if truncated < vocab_size and token_map is None:
        raise ValueError(f"{source}: truncated_vocab_size={truncated} < vocab_size={vocab_size} but the weights "
                         "have no token_map (the target id of each draft id)")
    if truncated == vocab_size:
        token_map = None  # vLLM ignores a token_map unless the vocab is truncated
    elif tuple(token_map.shape) != (truncated,) or token_map.is_floating_point():
        raise ValueError(f"{source}: token_map must be [{truncated}] integer target ids, got "
                         f"{tuple(token_map.shape)} {token_map.dtype}")
    shared_lm_head = bool(foreign.get("original_lm_head", False))
    found_heads = _count(state, "blocks.", 1)
    if num_layers and found_heads != num_heads:
        raise ValueError(f"{source}: weights hold {found_heads} blocks, config says num_heads={num_heads}")

    def get(kind, i, j):
        if kind == "lm_head":
            return state.get("lm_heads.0.weight" if shared_lm_head else f"lm_heads.{i}.weight",
                             state.get("lm_head.weight") if shared_lm_head else None)
        return state.get(f"blocks.{i}.layers.{j}.{kind}")

    sizes = {"num_heads": num_heads, "num_layers": num_layers, "hidden_size": hidden_size,
             "vocab_size": vocab_size, "draft_vocab_size": None if token_map is None else truncated}
    stacked = _stack(get, num_heads, num_layers, hidden_size, truncated, source)
    if token_map is not None:
        stacked["token_map"] = token_map.long()
    return sizes, stacked


def _check_sizes(foreign: dict, sizes: dict, names: tuple[str, ...], source: str) -> None:
    for name in names:
        if name in foreign and foreign[name] != sizes[name]:
            raise ValueError(f"{source}: config.json says {name}={foreign[name]}, the weights have {sizes[name]}")
