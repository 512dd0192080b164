"""Medusa heads: K extra next-next-token predictors on the target's last hidden state.

Head k (0-based) reads the final hidden state h_t at position t (the one the target's
lm_head turns into the prediction of token t+1) and predicts token t+k+2. Each head is L
residual SiLU blocks, x <- x + SiLU(W x + b), followed by its own lm_head initialised from
the target's, so an untrained head starts out predicting the target's next token.

Draft vocabulary (optional, as vLLM's Medusa `token_map`): with draft_vocab_size Vd < V the
lm_heads predict only Vd target tokens, the most frequent of the training data
(heads/draft_vocab.py). `token_map` [Vd] holds their target ids in ascending order and is
saved with the weights; without a draft vocabulary it is not stored and the heads predict the
whole vocabulary. On a CPU most of a draft is the K lm_heads (three of SmolLM2's 49k x 576
read 340 MB a step), so a draft vocabulary is what makes Medusa drafting cheap.

The K heads are stored stacked ([K, ...] parameters) and run as batched matmuls: on a
CPU the per-step cost of K separate small modules is mostly call overhead, and drafting
runs once per decode step. `export` maps these tensors to the per-head Medusa layouts.

Shape legend: K heads, L blocks per head, N = B*T rows, B batch, T positions, H hidden,
V vocab, Vd draft vocab (= V without a draft vocabulary).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MedusaHeads(nn.Module):
    """K independent heads; a pure module (hidden states in, logits out)."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 draft_vocab_size: int | None = None):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got "
                             f"num_heads={num_heads}, num_layers={num_layers}")
        draft_vocab_size = vocab_size if draft_vocab_size is None else draft_vocab_size
        if not 1 <= draft_vocab_size <= vocab_size:
            raise ValueError(f"Medusa draft_vocab_size must be in [1, {vocab_size}] (the vocab), "
                             f"got {draft_vocab_size}")
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        # Draft id i is target id token_map[i]; identity (and not saved) for the full vocab.
        self.register_buffer("token_map", torch.arange(draft_vocab_size), persistent=self.truncated)
        # Zero-initialised blocks are the identity, so a fresh head is the target's lm_head.
        self.block_weight = nn.Parameter(torch.zeros(num_heads, num_layers, hidden_size, hidden_size))  # [K, L, H_out, H_in]
        self.block_bias = nn.Parameter(torch.zeros(num_heads, num_layers, hidden_size))  # [K, L, H]
        self.lm_head_weight = nn.Parameter(torch.empty(num_heads, draft_vocab_size, hidden_size))  # [K, Vd, H]
        nn.init.normal_(self.lm_head_weight, std=hidden_size ** -0.5)

    @property
    def truncated(self) -> bool:
        return self.draft_vocab_size < self.vocab_size

    @torch.no_grad()
    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor | None = None) -> None:
        """The maps of heads/draft_vocab.build_draft_vocab (t2d is implied by d2t)."""
        if tuple(d2t.shape) != (self.draft_vocab_size,):
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}, these heads have a draft vocab of "
                             f"{self.draft_vocab_size}")
        self.token_map.copy_(torch.arange(self.draft_vocab_size) + d2t.cpu())

    def draft_to_target(self) -> torch.Tensor | None:
        """[Vd] long: the target id of every draft id; None when the heads predict the full vocab."""
        return self.token_map if self.truncated else None

    @torch.no_grad()
    def init_lm_heads_from(self, target_lm_head: nn.Module) -> None:
        """Every head starts as the target's lm_head (its draft-vocab rows)."""
        weight = target_lm_head.weight
        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"target lm_head has shape {tuple(weight.shape)}, heads need "
                             f"({self.vocab_size}, {self.hidden_size}) (vocab, hidden)")
        rows = weight[self.token_map.to(weight.device)].to(self.lm_head_weight.dtype)  # [Vd, H]
        self.lm_head_weight.copy_(rows.unsqueeze(0).expand_as(self.lm_head_weight))

    def features(self, hidden_BTH: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden [B, T, H] -> per-head features after the residual blocks [K, B*T, H]; the
        first `num_heads` heads only (K = num_heads) when given."""
        num_heads = self.num_heads if num_heads is None else num_heads
        x_NH = hidden_BTH.reshape(-1, self.hidden_size)
        x_KNH = x_NH.unsqueeze(0).expand(num_heads, -1, -1)
        for layer in range(self.num_layers):
            w_KHH = self.block_weight[:num_heads, layer]
            b_K1H = self.block_bias[:num_heads, layer].unsqueeze(1)
            x_KNH = x_KNH + F.silu(torch.baddbmm(b_K1H, x_KNH, w_KHH.transpose(1, 2)))
        return x_KNH

    def forward(self, hidden_BTH: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden [B, T, H] -> logits over the draft vocab [K, B, T, Vd]; the first `num_heads`
        heads only when given (each head reads only its own weights, so they are exactly the
        first rows of the full output: a depth-1 tree pays for one head, not all K)."""
        batch, seq = hidden_BTH.shape[:2]
        num_heads = self.num_heads if num_heads is None else num_heads
        if not 1 <= num_heads <= self.num_heads:
            raise ValueError(f"num_heads must be in [1, {self.num_heads}], got {num_heads}")
        logits_KNV = torch.bmm(self.features(hidden_BTH, num_heads), self.lm_head_weight[:num_heads].transpose(1, 2))
        return logits_KNV.view(num_heads, batch, seq, self.draft_vocab_size)
