"""Medusa heads: K extra next-next-token predictors on the target's last hidden state.

Head k (0-based) reads the final hidden state h_t at position t (the one the target's
lm_head turns into the prediction of token t+1) and predicts token t+k+2. Each head is L
residual SiLU blocks followed by its own lm_head, initialised from the target's lm_head,
so an untrained head starts out predicting the target's next token.

Shape legend: K heads, B batch, T positions, H hidden, V vocab.
"""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    """x + SiLU(W x + b); W starts at zero so a fresh block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int):
        super().__init__()
        self.blocks = nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)])
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.blocks(hidden_BTH))


class MedusaHeads(nn.Module):
    """K independent heads; a pure module (hidden states in, logits out)."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got "
                             f"num_heads={num_heads}, num_layers={num_layers}")
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.heads = nn.ModuleList([MedusaHead(hidden_size, vocab_size, num_layers) for _ in range(num_heads)])

    @torch.no_grad()
    def init_lm_heads_from(self, target_lm_head: nn.Module) -> None:
        weight = target_lm_head.weight
        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"target lm_head has shape {tuple(weight.shape)}, heads need "
                             f"({self.vocab_size}, {self.hidden_size}) (vocab, hidden)")
        for head in self.heads:
            head.lm_head.weight.copy_(weight.to(head.lm_head.weight.dtype))

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> logits [K, B, T, V]."""
        return torch.stack([head(hidden_BTH) for head in self.heads])
