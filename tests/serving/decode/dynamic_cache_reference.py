"""Test reference: tree decoding over a plain transformers DynamicCache.

The cache is a plain transformers `DynamicCache`, so any decoder-only architecture whose
layers are full-attention `DynamicLayer`s works. A verify step appends the KV entries of
all T tree nodes after the S committed ones; `commit_path` then keeps the committed
prefix plus the accepted nodes, in path order, and drops the rest. Sliding-window layers
are refused: they truncate the cache themselves, which breaks the 4-D tree mask's
[S + T] key layout.

Layer tensors (transformers 5): layer.keys / layer.values [B, kv_heads, S, D].

The engine uses the preallocated `TreeStaticCache` (serving/decode/cache.py); this
DynamicCache path is the independent reference tests/serving/decode/test_static_cache.py checks it against
(it lived in serving/kv_cache.py while the engine used it).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(config) -> DynamicCache:
    """An empty cache laid out for `config` (the target's model config)."""
    cache = DynamicCache(config=config)
    check_cache(cache)
    return cache


def check_cache(cache: DynamicCache) -> None:
    for layer_index, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError(
                f"cache layer {layer_index} is a sliding-window layer ({type(layer).__name__}); "
                "tree decoding needs full-attention layers whose cache holds every position")


def commit_path(cache: DynamicCache, prefix_len: int, accepted_node_indices: torch.Tensor | list[int]) -> None:
    """Keep positions [0, prefix_len) plus tree positions prefix_len + accepted_node_indices.

    accepted_node_indices [A]: node indices in path order (root first). The cache is changed
    in place; afterwards cache.get_seq_length() == prefix_len + A.
    """
    accepted = torch.as_tensor(accepted_node_indices, dtype=torch.long)
    num_accepted = int(accepted.shape[0])
    # An accepted path that is a prefix of the tree's node order (always so for chains, and
    # for the top-1 path of any tree) needs no gather: a slice is a view, no copy.
    is_prefix = bool(torch.equal(accepted, torch.arange(num_accepted)))
    keep = None
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None:
            continue
        if is_prefix:
            layer.keys = layer.keys[:, :, :prefix_len + num_accepted]
            layer.values = layer.values[:, :, :prefix_len + num_accepted]
            continue
        if keep is None:
            keep = torch.cat([torch.arange(prefix_len), prefix_len + accepted]).to(layer.keys.device)
        layer.keys = layer.keys.index_select(2, keep)
        layer.values = layer.values.index_select(2, keep)
