"""Acceptance calibration after training: per-head top-k accuracy on held-out data and the
static draft tree chosen from it.

accuracy[depth][rank] is the fraction of held-out positions t where the rank-`rank`
candidate of head `depth` (at t) equals the target's greedy token for position t+depth+2,
i.e. argmax of the target's logits at t+depth+1 (teacher-forced on the held-out text, the
usual Medusa approximation). The tree is heads.tree_paths.expand_paths(accuracy, num_nodes).

EAGLE heads: the head is unrolled num_depths steps on its own features exactly as in
training (Eagle3Head.forward); step j is depth j+1, and its rank-r candidate (as a target
id) at position t is scored against the target's greedy token for position t+j+2.

Shape legend: K heads, B batch, T positions, V vocab, R ranks measured.
"""

from __future__ import annotations

import torch
from torch import nn

from specheads.heads.target import TargetAdapter
from specheads.heads.eagle3 import Eagle3Head, next_token_embeddings
from specheads.heads.tree_paths import expand_paths, expected_accept_length


@torch.no_grad()
def measure_accuracy(heads: nn.Module, target: TargetAdapter, input_ids_NT: torch.Tensor,
                     loss_mask_NT: torch.Tensor, max_rank: int, batch_size: int, max_batches: int,
                     tap_layers: list[int] | None = None, num_depths: int | None = None,
                     ) -> tuple[list[list[float]], list[int]]:
    """-> accuracy [K][R] and the number of positions each head was scored on [K]."""
    if isinstance(heads, Eagle3Head):
        return measure_eagle_accuracy(heads, target, input_ids_NT, loss_mask_NT, max_rank, batch_size,
                                      max_batches, tap_layers, num_depths)
    heads.eval()
    dtype = next(heads.parameters()).dtype
    num_heads = heads.num_heads
    max_rank = min(max_rank, heads.draft_vocab_size)
    draft_ids = heads.draft_to_target()  # [Vd] target ids, or None for the full vocab
    # Accumulated on the host: batches live on the target's device (a GPU in real runs).
    hits_KR = torch.zeros(num_heads, max_rank, dtype=torch.float64)
    counts_K = torch.zeros(num_heads, dtype=torch.float64)
    # At most max_batches * batch_size blocks, evenly spaced so that every part of the held-out
    # data (not just its first documents) is measured.
    num_blocks = min(input_ids_NT.shape[0], max_batches * batch_size)
    chosen = torch.linspace(0, input_ids_NT.shape[0] - 1, num_blocks).round().long()  # [n]
    for input_ids_BT, mask_BT in zip(input_ids_NT[chosen].split(batch_size), loss_mask_NT[chosen].split(batch_size)):
        out = target(input_ids_BT, [target.num_layers])
        greedy_BT = out.logits.argmax(-1)  # [B, T] target's prediction of token t+1
        logits_KBTV = heads(out.taps[0].to(dtype))
        candidates_KBTR = logits_KBTV.topk(max_rank, dim=-1).indices  # [K, B, T, R] best first
        if draft_ids is not None:
            candidates_KBTR = draft_ids[candidates_KBTR]  # draft ids -> target ids
        seq_len = input_ids_BT.shape[1]
        for k in range(num_heads):
            num_pos = seq_len - k - 1
            if num_pos <= 0:
                continue
            truth_BN = greedy_BT[:, k + 1:]  # [B, T-k-1] target's token for t+k+2
            mask_BN = mask_BT[:, :num_pos] & mask_BT[:, k + 1:]  # [B, T-k-1]
            hit_BNR = candidates_KBTR[k, :, :num_pos] == truth_BN.unsqueeze(-1)  # [B, T-k-1, R]
            hits_KR[k] += (hit_BNR & mask_BN.unsqueeze(-1)).sum((0, 1)).double().cpu()
            counts_K[k] += mask_BN.sum().double().cpu()
    accuracy_KR = hits_KR / counts_K.clamp(min=1).unsqueeze(-1)
    return accuracy_KR.tolist(), [int(c) for c in counts_K.tolist()]


def _evenly_spaced(input_ids_NT, loss_mask_NT, batch_size: int, max_batches: int):
    num_blocks = min(input_ids_NT.shape[0], max_batches * batch_size)
    chosen = torch.linspace(0, input_ids_NT.shape[0] - 1, num_blocks).round().long()  # [n]
    return zip(input_ids_NT[chosen].split(batch_size), loss_mask_NT[chosen].split(batch_size))


@torch.no_grad()
def measure_eagle_accuracy(head: nn.Module, target: TargetAdapter, input_ids_NT: torch.Tensor,
                           loss_mask_NT: torch.Tensor, max_rank: int, batch_size: int, max_batches: int,
                           tap_layers: list[int], num_depths: int) -> tuple[list[list[float]], list[int]]:
    """-> accuracy [J][R] (step j = depth j+1) and positions scored per depth [J]."""
    head.eval()
    dtype = next(head.parameters()).dtype
    max_rank = min(max_rank, head.draft_vocab_size)
    draft_ids = head.draft_to_target()
    hits_JR = torch.zeros(num_depths, max_rank, dtype=torch.float64)
    counts_J = torch.zeros(num_depths, dtype=torch.float64)
    for input_ids_BT, mask_BT in _evenly_spaced(input_ids_NT, loss_mask_NT, batch_size, max_batches):
        out = target(input_ids_BT, tap_layers)
        greedy_BT = out.logits.argmax(-1)  # [B, T]
        taps = torch.cat(out.taps, dim=-1).to(dtype)
        logits_JBTV, _ = head(taps, next_token_embeddings(target.embeddings(), input_ids_BT).to(dtype), num_depths)
        candidates_JBTR = draft_ids[logits_JBTV.topk(max_rank, dim=-1).indices]
        seq_len = input_ids_BT.shape[1]
        for j in range(num_depths):
            num_pos = seq_len - j - 1
            if num_pos <= 0:
                continue
            truth_BN = greedy_BT[:, j + 1:]
            mask_BN = mask_BT[:, :num_pos] & mask_BT[:, j + 1:]
            hit_BNR = candidates_JBTR[j, :, :num_pos] == truth_BN.unsqueeze(-1)
            hits_JR[j] += (hit_BNR & mask_BN.unsqueeze(-1)).sum((0, 1)).double().cpu()
            counts_J[j] += mask_BN.sum().double().cpu()
    accuracy_JR = hits_JR / counts_J.clamp(min=1).unsqueeze(-1)
    return accuracy_JR.tolist(), [int(c) for c in counts_J.tolist()]


def calibrate(heads: nn.Module, target: TargetAdapter, input_ids_NT: torch.Tensor, loss_mask_NT: torch.Tensor,
              num_nodes: int, max_rank: int, batch_size: int, max_batches: int, source: str = "",
              tap_layers: list[int] | None = None, num_depths: int | None = None) -> tuple[dict, dict]:
    """-> (calibration, tree) as stored in HeadsConfig.calibration and HeadsConfig.tree.

    EAGLE heads need tap_layers (their config's) and num_depths (steps to unroll)."""
    accuracy, counts = measure_accuracy(heads, target, input_ids_NT, loss_mask_NT, max_rank, batch_size, max_batches,
                                        tap_layers, num_depths)
    paths = expand_paths(accuracy, num_nodes)
    calibration = {
        "accuracy": accuracy,  # [depth][rank]
        "top1": [row[0] for row in accuracy],
        "num_positions": counts,
        "max_rank": len(accuracy[0]),
        "source": source,
    }
    tree = {
        "paths": [list(path) for path in paths],
        "num_nodes": len(paths),
        "expected_accept_length": expected_accept_length(paths, accuracy),
    }
    return calibration, tree
