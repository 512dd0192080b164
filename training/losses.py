"""Self-distillation losses: Medusa heads, and EAGLE heads under the training-time test.

Head k (0-based) at position t predicts token t+k+2. The target's own distribution for
that token is softmax(target logits at position t+k+1), so head k is trained with
KL(p_target[t+k+1] || q_head_k[t]) for t in [0, T-k-2], on positions where both t and
t+k+1 are real tokens (with a draft vocab, p_target restricted to it and renormalised, as
for EAGLE). KL and soft cross-entropy have the same gradient; KL is reported
because 0 means "the head is the target".

EAGLE (eagle_ttt_loss): step j of the unrolled head at position t predicts token t+2+j, so
it is scored against softmax(target logits at t+1+j) restricted to the draft vocab (the
target ids of the draft ids, renormalised), on positions where t and t+1+j are real
tokens. Step j is weighted step_weight**j. The EAGLE-1/2 variant adds a smooth-L1
regression of the step's output feature to the target's feature at t+1+j.

Shape legend: K heads, B batch, T positions, V vocab, N selected positions, J unrolled
steps, Vd draft vocab, H hidden.
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


@dataclass
class Teacher:
    """The target's distribution over the draft vocab at every position, computed once per micro
    step and sliced per head / TTT step (head k and step j read rows t+1+k / t+1+j of the same
    block). Row-wise ops give the same bits on the whole block as on any slice of it.

    log_p [B, T, Vd]: log-softmax of the target's logits restricted to the draft vocab (fp32);
    p [B, T, Vd]: its exp; argmax [B, T]: the target's argmax over the FULL vocab (target ids)."""

    log_p_BTV: torch.Tensor
    p_BTV: torch.Tensor
    argmax_BT: torch.Tensor

    @classmethod
    def from_draft_logits(cls, draft_logits_BTV: torch.Tensor, argmax_BT: torch.Tensor) -> "Teacher":
        """Logits already restricted to the draft vocab [B, T, Vd] + the full-vocab argmax [B, T]."""
        log_p = F.log_softmax(draft_logits_BTV.float(), dim=-1)
        return cls(log_p, log_p.exp(), argmax_BT)

    @classmethod
    def from_logits(cls, logits_BTV: torch.Tensor, draft_ids_V: torch.Tensor | None) -> "Teacher":
        """Full-vocab logits [B, T, V]; draft_ids [Vd] (target id of each draft id) or None (Vd = V)."""
        logits_BTV = logits_BTV.float()
        draft_BTV = logits_BTV if draft_ids_V is None else logits_BTV.index_select(-1, draft_ids_V)
        return cls.from_draft_logits(draft_BTV, logits_BTV.argmax(-1))

    def rows(self, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log_p, p, argmax) of positions start.. (views)."""
        return self.log_p_BTV[:, start:], self.p_BTV[:, start:], self.argmax_BT[:, start:]


def as_teacher(teacher, draft_ids_V: torch.Tensor | None) -> Teacher:
    return teacher if isinstance(teacher, Teacher) else Teacher.from_logits(teacher, draft_ids_V)


def _restricted_kl(head_BNV: torch.Tensor, teacher: Teacher, start: int, mask_BN: torch.Tensor,
                   draft_ids_V: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One head (or step): KL(teacher restricted to the draft vocab || head), masked mean.

    head [B, N, Vd] over the draft vocab, scored against the teacher's rows start..start+N;
    draft_ids [Vd] (target id of each draft id) or None when Vd = V. -> (loss, top-1 agreement
    with the teacher's full-vocab argmax, counted positions, mask as float [B, N])."""
    head_BNV = head_BNV.float()
    log_p, p, teacher_argmax_BN = teacher.rows(start)
    mask_BN = mask_BN.to(torch.float32)
    log_q = F.log_softmax(head_BNV, dim=-1)
    kl_BN = (p * (log_p - log_q)).sum(-1)  # [B, N]
    count = mask_BN.sum()
    denom = count.clamp(min=1.0)
    head_argmax_BN = head_BNV.argmax(-1)
    if draft_ids_V is not None:
        head_argmax_BN = draft_ids_V[head_argmax_BN]
    agree_BN = (head_argmax_BN == teacher_argmax_BN).to(torch.float32)
    return (kl_BN * mask_BN).sum() / denom, (agree_BN * mask_BN).sum() / denom, count, mask_BN


def medusa_distill_loss(head_logits_KBTV: torch.Tensor, target_logits_BTV: torch.Tensor | Teacher,
                        loss_mask_BT: torch.Tensor, draft_ids_V: torch.Tensor | None = None) -> DistillOutput:
    """head logits [K, B, T, Vd] (Vd = V, or the draft vocab of draft_ids [Vd]); the target's
    logits [B, T, V], or its Teacher over the same draft vocab."""
    num_heads, _, seq_len, _ = head_logits_KBTV.shape
    if seq_len < num_heads + 2:
        raise ValueError(f"blocks of {seq_len} tokens are too short for {num_heads} heads: head k needs "
                         f"positions t and t+k+1, so seq_len must be >= num_heads + 2 = {num_heads + 2}")
    teacher = as_teacher(target_logits_BTV, draft_ids_V)
    losses, top1s, counts = [], [], []
    # unbind, not [k]: the backward of K selects would each fill a zero gradient of all K heads
    for k, head_BTV in enumerate(head_logits_KBTV.unbind(0)):
        num_pos = seq_len - k - 1  # positions t in [0, T-k-2]
        loss, top1, count, _ = _restricted_kl(
            head_BTV[:, :num_pos],  # positions t
            teacher, k + 1,  # positions t+k+1
            loss_mask_BT[:, :num_pos] & loss_mask_BT[:, k + 1:], draft_ids_V)
        losses.append(loss)
        top1s.append(top1)
        counts.append(count)
    head_loss = torch.stack(losses)  # [K]
    return DistillOutput(
        loss=head_loss.mean(),
        head_loss=head_loss.detach(),
        head_top1=torch.stack(top1s).detach(),
        head_count=torch.stack(counts).detach(),
    )


def eagle_ttt_loss(head_logits_JBTV: torch.Tensor, target_logits_BTV: torch.Tensor | Teacher,
                   loss_mask_BT: torch.Tensor,
                   draft_ids_V: torch.Tensor, step_weight: float = 0.8, features_JBTH: torch.Tensor | None = None,
                   target_features_BTH: torch.Tensor | None = None, feature_weight: float = 1.0) -> DistillOutput:
    """Per-step KL(target restricted to the draft vocab || head), weighted sum over steps.

    draft_ids [Vd]: the target id of every draft id. With features and target_features, each
    step also regresses its output feature to the target's feature at t+1+j (EAGLE-1/2).
    head_loss/head_top1/head_count are per step [J]; top-1 compares the head's argmax
    (as a target id) with the target's argmax over the full vocab.
    """
    num_steps, _, seq_len, _ = head_logits_JBTV.shape
    if seq_len < num_steps + 2:
        raise ValueError(f"blocks of {seq_len} tokens are too short for {num_steps} draft steps: seq_len must be "
                         f">= ttt_steps + 2 = {num_steps + 2}")
    teacher = as_teacher(target_logits_BTV, draft_ids_V)
    losses, objectives, top1s, counts = [], [], [], []
    for j, head_BTV in enumerate(head_logits_JBTV.unbind(0)):  # unbind: see medusa_distill_loss
        num_pos = seq_len - j - 1  # positions t in [0, T-j-2]
        loss, top1, count, mask_BN = _restricted_kl(
            head_BTV[:, :num_pos],  # positions t
            teacher, j + 1,  # positions t+1+j
            loss_mask_BT[:, :num_pos] & loss_mask_BT[:, j + 1:], draft_ids_V)
        objective = loss
        if features_JBTH is not None and target_features_BTH is not None:
            regress_BN = F.smooth_l1_loss(features_JBTH[j, :, :num_pos].float(),
                                          target_features_BTH[:, j + 1:].float(), reduction="none").mean(-1)
            objective = objective + feature_weight * (regress_BN * mask_BN).sum() / count.clamp(min=1.0)
        losses.append(loss)
        objectives.append(objective * step_weight ** j)
        top1s.append(top1)
        counts.append(count)
    total_weight = sum(step_weight ** j for j in range(num_steps))
    return DistillOutput(
        loss=torch.stack(objectives).sum() / total_weight,
        head_loss=torch.stack(losses).detach(),
        head_top1=torch.stack(top1s).detach(),
        head_count=torch.stack(counts).detach(),
    )

