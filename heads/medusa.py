"""Medusa heads: K extra next-next-token predictors on the target's last hidden state.

Head k (0-based) reads the final hidden state h_t at position t (the one the target's
lm_head turns into the prediction of token t+1) and predicts token t+k+2. Each head is L
residual SiLU blocks, x <- x + SiLU(W x + b), followed by its own lm_head initialised from
the target's, so an untrained head starts out predicting the target's next token.

The K heads are stored stacked ([K, ...] parameters) and run as batched matmuls: on a
CPU the per-step cost of K separate small modules is mostly call overhead, and drafting
runs once per decode step. `export` maps these tensors to the per-head Medusa layouts.

Shape legend: K heads, L blocks per head, N = B*T rows, B batch, T positions, H hidden,
V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        # Zero-initialised blocks are the identity, so a fresh head is the target's lm_head.
        self.block_weight = nn.Parameter(torch.zeros(num_heads, num_layers, hidden_size, hidden_size))  # [K, L, H_out, H_in]
        self.block_bias = nn.Parameter(torch.zeros(num_heads, num_layers, hidden_size))  # [K, L, H]
        self.lm_head_weight = nn.Parameter(torch.empty(num_heads, vocab_size, hidden_size))  # [K, V, H]
        nn.init.normal_(self.lm_head_weight, std=hidden_size ** -0.5)

    @torch.no_grad()
    def init_lm_heads_from(self, target_lm_head: nn.Module) -> None:
        weight = target_lm_head.weight
        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"target lm_head has shape {tuple(weight.shape)}, heads need "
                             f"({self.vocab_size}, {self.hidden_size}) (vocab, hidden)")
        self.lm_head_weight.copy_(weight.to(self.lm_head_weight.dtype).unsqueeze(0).expand_as(self.lm_head_weight))

    def features(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> per-head features after the residual blocks [K, B*T, H]."""
        x_NH = hidden_BTH.reshape(-1, self.hidden_size)
        x_KNH = x_NH.unsqueeze(0).expand(self.num_heads, -1, -1)
        for layer in range(self.num_layers):
            w_KHH = self.block_weight[:, layer]
            b_K1H = self.block_bias[:, layer].unsqueeze(1)
            x_KNH = x_KNH + F.silu(torch.baddbmm(b_K1H, x_KNH, w_KHH.transpose(1, 2)))
        return x_KNH

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> logits [K, B, T, V]."""
        batch, seq = hidden_BTH.shape[:2]
        logits_KNV = torch.bmm(self.features(hidden_BTH), self.lm_head_weight.transpose(1, 2))
        return logits_KNV.view(self.num_heads, batch, seq, self.vocab_size)
