"""Acceptance calibration after training: per-head top-k accuracy on held-out data and the
static draft tree chosen from it.

accuracy[depth][rank] is the fraction of held-out positions t where the rank-`rank`
candidate of head `depth` (at t) equals the target's greedy token for position t+depth+2,
i.e. argmax of the target's logits at t+depth+1 (teacher-forced on the held-out text, the
usual Medusa approximation). The tree is heads.tree_paths.expand_paths(accuracy, num_nodes).

The head kind (training/head_kinds.py) gives the heads' inputs and draft logits, as in
training: Medusa head k is depth k+1; an EAGLE head is unrolled on its own features
(Eagle3Head.forward), and step j is depth j+1. A rank-r candidate is compared as a target id.

Shape legend: D depths (Medusa heads, EAGLE steps), B batch, T positions, V vocab, R ranks measured.
"""

from __future__ import annotations

import torch
from torch import nn

from specheads.heads.target.adapter import TargetAdapter
from specheads.heads.tree_paths import expand_paths, expected_accepted_draft_tokens


@torch.no_grad()
def measure_accuracy(heads: nn.Module, kind, target: TargetAdapter, input_ids_NT: torch.Tensor,
                     loss_mask_NT: torch.Tensor, max_rank: int, batch_size: int, max_batches: int,
                     tap_layers: list[int]) -> tuple[list[list[float]], list[int]]:
    """-> accuracy [D][R] and the number of positions each depth was scored on [D].

    kind (training/head_kinds.py) turns the target's taps into the heads' inputs and their output
    into draft logits [D, B, T, Vd]; depth d at position t is scored against the target's greedy
    token for t+d+2. At most max_batches * batch_size blocks, evenly spaced so that every part of
    the held-out data (not just its first documents) is measured."""
    heads.eval()
    dtype = next(heads.parameters()).dtype
    max_rank = min(max_rank, heads.draft_vocab_size)
    draft_ids = heads.draft_to_target()  # [Vd] target ids, or None for the full vocab
    # Accumulated on the host: batches live on the target's device (a GPU in real runs).
    hits_DR = torch.zeros(kind.num_depths, max_rank, dtype=torch.float64)
    counts_D = torch.zeros(kind.num_depths, dtype=torch.float64)
    num_blocks = min(input_ids_NT.shape[0], max_batches * batch_size)
    chosen = torch.linspace(0, input_ids_NT.shape[0] - 1, num_blocks).round().long()  # [n]
    for input_ids_BT, mask_BT in zip(input_ids_NT[chosen].split(batch_size), loss_mask_NT[chosen].split(batch_size)):
        out = target(input_ids_BT, tap_layers)
        greedy_BT = out.logits.argmax(-1)  # [B, T] target's prediction of token t+1
        inputs = kind.inputs(torch.cat(out.taps, dim=-1), input_ids_BT, target, dtype)
        candidates_DBTR = kind.draft_logits(heads(*inputs)).topk(max_rank, dim=-1).indices  # best first
        if draft_ids is not None:
            candidates_DBTR = draft_ids[candidates_DBTR]  # draft ids -> target ids
        seq_len = input_ids_BT.shape[1]
        for d in range(kind.num_depths):
            num_pos = seq_len - d - 1
            if num_pos <= 0:
                continue
            truth_BN = greedy_BT[:, d + 1:]  # [B, T-d-1] target's token for t+d+2
            mask_BN = mask_BT[:, :num_pos] & mask_BT[:, d + 1:]  # [B, T-d-1]
            hit_BNR = candidates_DBTR[d, :, :num_pos] == truth_BN.unsqueeze(-1)  # [B, T-d-1, R]
            hits_DR[d] += (hit_BNR & mask_BN.unsqueeze(-1)).sum((0, 1)).double().cpu()
            counts_D[d] += mask_BN.sum().double().cpu()
    accuracy_DR = hits_DR / counts_D.clamp(min=1).unsqueeze(-1)
    return accuracy_DR.tolist(), [int(c) for c in counts_D.tolist()]


def calibrate(heads: nn.Module, kind, target: TargetAdapter, input_ids_NT: torch.Tensor,
              loss_mask_NT: torch.Tensor, num_nodes: int, max_rank: int, batch_size: int, max_batches: int,
              tap_layers: list[int], source: str = "") -> tuple[dict, dict]:
    """-> (calibration, tree) as stored in HeadsConfig.calibration and HeadsConfig.tree."""
    accuracy, counts = measure_accuracy(heads, kind, target, input_ids_NT, loss_mask_NT, max_rank, batch_size,
                                        max_batches, tap_layers)
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
        "expected_accepted_draft_tokens": expected_accepted_draft_tokens(paths, accuracy),
    }
    return calibration, tree
