"""Draft-vocabulary maps for EAGLE-3 heads: the `draft_vocab_size` most frequent target
tokens of the training data (always including EOS) get draft ids, in ascending target-id
order.

    d2t [Vd] int64: target_id = draft_id + d2t[draft_id]   (EAGLE-3 checkpoint convention)
    t2d [V]  bool:  True for target ids that have a draft id

Token counting lives in data/vocab_counts.py; this module only turns counts into maps.
"""

from __future__ import annotations

import torch

DEFAULT_DRAFT_VOCAB_SIZE = 32000


def build_draft_vocab(counts_V: torch.Tensor, draft_vocab_size: int,
                      always_include: list[int] | tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [V] -> (d2t [Vd], t2d [V]); Vd = min(draft_vocab_size, V)."""
    vocab_size = int(counts_V.shape[0])
    size = min(draft_vocab_size, vocab_size)
    if size < 1:
        raise ValueError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    scores = counts_V.double().clone()
    forced = [t for t in always_include if t is not None and 0 <= t < vocab_size]
    if len(set(forced)) > size:
        raise ValueError(f"draft vocab of {size} cannot hold the {len(set(forced))} tokens it must include")
    scores[forced] = float("inf")
    # Stable order: ties go to the lower target id, so maps are reproducible.
    order = torch.sort(-scores, stable=True).indices[:size]
    chosen = order.sort().values  # [Vd] ascending target ids
    d2t = chosen - torch.arange(size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d
