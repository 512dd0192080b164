"""Medusa heads to and from the two foreign Medusa layouts.

Both are pure functions on (config dict, state dict); `heads/export.py` does the file IO.

"medusa" -- the FasterDecoding/Medusa layout, which TGI and TensorRT-LLM load:
    config.json                  {"medusa_num_heads": K, "medusa_num_layers": L,
                                  "base_model_name_or_path": ..., "hidden_size": H, "vocab_size": V}
    medusa_lm_head.safetensors   "{i}.{j}.linear.weight" [H, H], "{i}.{j}.linear.bias" [H]
                                 (block j < L of head i), "{i}.{L}.weight" [V, H] (head i's lm_head)
  Medusa builds head i as nn.Sequential(ResBlock x L, nn.Linear(H, V, bias=False)), hence the
  index L for the lm_head; ResBlock is x + SiLU(linear(x)), the same block as ours. Import
  also accepts a "medusa_head." key prefix and the .pt file Medusa's trainer may write.

"vllm-medusa" -- the key names of vLLM's `MedusaModel` (vllm/model_executor/models/medusa.py,
vllm/transformers_utils/configs/medusa.py):
    config.json        {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": H,
                        "vocab_size": V, "num_heads": K, "num_hidden_layers": L,
                        "truncated_vocab_size": V, "medusa_fc_bias": true}
    model.safetensors  "blocks.{i}.layers.{j}.weight" [H, H], "blocks.{i}.layers.{j}.bias" [H],
                       "lm_heads.{i}.weight" [V, H]
  vLLM builds the block linears with bias=getattr(config, "medusa_fc_bias", False), so the flag
  must be true for our biases to load. On import we also accept what vLLM's loader accepts: a
  "medusa_heads." key prefix, no biases (medusa_fc_bias false: zero biases), and
  `original_lm_head` (one "lm_heads.0.weight" shared by all heads). A truncated vocabulary
  (token_map) has no specheads equivalent and is refused.

Shape legend: K heads, L blocks per head, H hidden, V vocab.
"""

from __future__ import annotations

import torch

MEDUSA_WEIGHTS_NAME = "medusa_lm_head.safetensors"
VLLM_MEDUSA_ARCHITECTURE = "MedusaModel"


def _medusa_shapes(config: dict, state: dict[str, torch.Tensor]) -> tuple[int, int]:
    num_heads, num_layers = config["num_heads"], config["num_layers"]
    expected = {"block_weight": (num_heads, num_layers, config["hidden_size"], config["hidden_size"]),
                "block_bias": (num_heads, num_layers, config["hidden_size"]),
                "lm_head_weight": (num_heads, config["vocab_size"], config["hidden_size"])}
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
    out = _per_head_tensors(state, num_heads, num_layers, block="{i}.{j}.linear", lm_head=f"{{i}}.{num_layers}")
    foreign = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
               "base_model_name_or_path": config["target"]["name_or_path"],
               "hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"]}
    return foreign, out


def to_vllm_medusa(config: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """specheads Medusa (config dict, state) -> vLLM MedusaModel (config, state)."""
    num_heads, num_layers = _medusa_shapes(config, state)
    out = _per_head_tensors(state, num_heads, num_layers, block="blocks.{i}.layers.{j}", lm_head="lm_heads.{i}")
    foreign = {"architectures": [VLLM_MEDUSA_ARCHITECTURE], "model_type": "medusa",
               "hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"],
               "num_heads": num_heads, "num_hidden_layers": num_layers,
               "truncated_vocab_size": config["vocab_size"], "medusa_fc_bias": True}
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
    if truncated != vocab_size or "token_map" in state:
        raise ValueError(f"{source} uses a truncated draft vocabulary (truncated_vocab_size={truncated}, "
                         f"vocab_size={vocab_size}); specheads Medusa heads predict the full vocabulary")
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
             "vocab_size": vocab_size}
    return sizes, _stack(get, num_heads, num_layers, hidden_size, vocab_size, source)


def _check_sizes(foreign: dict, sizes: dict, names: tuple[str, ...], source: str) -> None:
    for name in names:
        if name in foreign and foreign[name] != sizes[name]:
            raise ValueError(f"{source}: config.json says {name}={foreign[name]}, the weights have {sizes[name]}")
