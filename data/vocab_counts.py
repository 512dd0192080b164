"""Token counts over the packed training blocks, for the EAGLE-3 draft vocabulary
(heads/draft_vocab.py). A token is counted where it is a prediction target: position t's
token counts when the loss mask is set at t.

Shape legend: N blocks, T seq_len, V vocab.
"""

from __future__ import annotations

import torch


def count_tokens(input_ids_NT: torch.Tensor, loss_mask_NT: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """-> counts [V] int64 of the token ids under the loss mask."""
    ids = input_ids_NT[loss_mask_NT.bool()]
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise ValueError(f"token id {int(ids.max())} is outside the vocab of {vocab_size}")
    return torch.bincount(ids.long(), minlength=vocab_size)
