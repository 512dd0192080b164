"""Training from the offline feature cache (`data.feature_cache: DIR`, data/feature_cache.py).

The cache written by `specheads data cache` holds, per block, the token ids, loss mask, the
target's hidden states at the cached tap layers and its logits (full, or top-k). With a
cache the trainer never runs the target in the step loop: the cache's blocks are the
training data (the sampler walks them exactly as it walks packed blocks), the heads read
the cached taps and distil from the cached logits. Medusa heads need tap `num_layers`
(the final hidden state); EAGLE heads need their tap layers. EAGLE's next-token embeddings
come from the loaded target's embedding table (a lookup, not a forward).

The target is still loaded: the heads' lm_heads start from its lm_head, and held-out
evaluation and calibration run it on the recipe's eval data. A cache of another target,
other taps or another seq_len is refused (FeatureCache.check_fits). Top-k caches give the
KL over the stored k tokens (the rest at zero probability); full-logit caches give the same
losses as online training up to floating-point rounding.

CachedFeatures is this mode's feature source (training/features.py).

Shape legend: B micro batch, T seq_len, H hidden, V vocab, J draft steps.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from specheads.data.feature_cache import FeatureCache, write_cache
from specheads.data.text import PackedBlocks
from specheads.heads.target.adapter import TargetAdapter
from specheads.training.features import Features, OnlineTarget
from specheads.training.losses import Teacher


AUTO = "auto"


def auto_cache_dir(target_path: str, blocks: PackedBlocks, taps: list[int], dtype: torch.dtype) -> Path:
    """Where `data.feature_cache: auto` keeps the cache of these exact blocks: keyed by the
    target's fingerprint, the taps, the dtype and the blocks' token ids and loss masks."""
    from specheads.data.regenerate import target_fingerprint
    from specheads.data.tiny_target import default_cache_dir

    digest = hashlib.sha256(f"{target_fingerprint(target_path)}|{sorted(taps)}|{dtype}".encode())
    digest.update(blocks.input_ids.numpy().tobytes())
    digest.update(blocks.loss_mask.numpy().tobytes())
    return default_cache_dir() / "features" / f"{Path(target_path).name}-{digest.hexdigest()[:12]}"


def build_auto_cache(target: TargetAdapter, target_path: str, blocks: PackedBlocks, taps: list[int],
                     batch_size: int, log=print) -> Path:
    """`data.feature_cache: auto`: cache the target's taps + top-k logits over the training
    blocks once (one target forward per block), then reuse it on every later run of the same
    data. Built once under a lock every rank waits on, in a staging directory renamed whole
    (heads/atomic.py build_once)."""
    from specheads.heads.atomic import build_once

    directory = auto_cache_dir(target_path, blocks, taps, target.dtype)
    if directory.is_dir():
        log(f"feature cache: reusing {directory}")
        return directory
    return build_once(directory, lambda staging: write_cache(target, blocks, sorted(set(taps)), staging,
                                                             batch_size=batch_size, log=log))


def open_cache(directory: str | Path, target: TargetAdapter, taps: list[int], seq_len: int) -> FeatureCache:
    cache = FeatureCache(directory)
    cache.check_fits(target.identity, taps, seq_len)
    return cache


def cache_directory(setting: str, target: TargetAdapter, target_path: str, blocks: PackedBlocks, taps: list[int],
                    batch_size: int, log=print) -> Path:
    """data.feature_cache -> the cache's directory: the one named, or for `auto` the one built
    from (or already holding) these blocks."""
    if setting != AUTO:
        return Path(setting)
    return build_auto_cache(target, target_path, blocks, taps, batch_size, log=log)


class CachedFeatures(OnlineTarget):
    """The feature cache as a feature source (training/features.py): its blocks are the training
    data, and a micro batch's taps and teacher come from it instead of a target forward."""

    def __init__(self, cache: FeatureCache, target: TargetAdapter, tap_layers: list[int]):
        super().__init__(target, cache.blocks(), tap_layers)
        self.cache = cache

    def features(self, indices: list[int]) -> Features:
        device = self.target.device
        batch = self.cache.batch(indices)
        draft_ids_V = self.heads.draft_to_target()
        draft_BTV, argmax_BT = FeatureCache.teacher_draft_logits(batch, self.target.vocab_size, draft_ids_V)
        teacher = Teacher.from_draft_logits(draft_BTV.to(device), argmax_BT.to(device))
        taps_BTnH = torch.cat([batch[f"tap_{layer}"] for layer in self.tap_layers], dim=-1).to(device)
        return Features(batch["input_ids"].to(device), batch["loss_mask"].to(device), teacher, taps_BTnH, draft_ids_V)
