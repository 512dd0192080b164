"""Self-distillation losses for Medusa heads.

Head k (0-based) at position t predicts token t+k+2. The target's own distribution for
that token is softmax(target logits at position t+k+1), so head k is trained with
KL(p_target[t+k+1] || q_head_k[t]) for t in [0, T-k-2], on positions where both t and
t+k+1 are real tokens. KL and soft cross-entropy have the same gradient; KL is reported
because 0 means "the head is the target".

Shape legend: K heads, B batch, T positions, V vocab, N selected positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DistillOutput:
    loss: torch.Tensor  # [] mean of the per-head losses; what backward() sees
    head_loss: torch.Tensor  # [K] KL(target || head k), mean over counted positions, detached
    head_top1: torch.Tensor  # [K] fraction of counted positions where argmax head k == argmax target
    head_count: torch.Tensor  # [K] counted positions per head


def medusa_distill_loss(head_logits_KBTV: torch.Tensor, target_logits_BTV: torch.Tensor,
                        loss_mask_BT: torch.Tensor) -> DistillOutput:
    num_heads, _, seq_len, _ = head_logits_KBTV.shape
    if seq_len < num_heads + 2:
        raise ValueError(f"blocks of {seq_len} tokens are too short for {num_heads} heads: head k needs "
                         f"positions t and t+k+1, so seq_len must be >= num_heads + 2 = {num_heads + 2}")
    losses, top1s, counts = [], [], []
    for k in range(num_heads):
        num_pos = seq_len - k - 1  # positions t in [0, T-k-2]
        head_BNV = head_logits_KBTV[k, :, :num_pos].float()  # [B, T-k-1, V] positions t
        teacher_BNV = target_logits_BTV[:, k + 1:].float()  # [B, T-k-1, V] positions t+k+1
        mask_BN = (loss_mask_BT[:, :num_pos] & loss_mask_BT[:, k + 1:]).to(torch.float32)  # [B, T-k-1]
        log_q = F.log_softmax(head_BNV, dim=-1)  # [B, N, V]
        log_p = F.log_softmax(teacher_BNV, dim=-1)  # [B, N, V]
        kl_BN = (log_p.exp() * (log_p - log_q)).sum(-1)  # [B, N]
        count = mask_BN.sum()
        denom = count.clamp(min=1.0)
        losses.append((kl_BN * mask_BN).sum() / denom)
        agree_BN = (head_BNV.argmax(-1) == teacher_BNV.argmax(-1)).to(torch.float32)  # [B, N]
        top1s.append((agree_BN * mask_BN).sum() / denom)
        counts.append(count)
    head_loss = torch.stack(losses)  # [K]
    return DistillOutput(
        loss=head_loss.mean(),
        head_loss=head_loss.detach(),
        head_top1=torch.stack(top1s).detach(),
        head_count=torch.stack(counts).detach(),
    )
