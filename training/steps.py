"""One optimizer step of the heads' training, the same in every mode: the trainer picks the
head kind (training/head_kinds.py) and the feature source (training/features.py) once, and
the step only calls them. Split out of trainer.py, which drives the loop.

Shape legend: D depths (Medusa heads, EAGLE steps), B micro batch, T seq_len.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn

from specheads.data.text import BlockSampler
from specheads.training.features import OnlineTarget
from specheads.training.head_kinds import HeadKind


def bf16_autocast(device_type: str) -> Callable[[], ContextManager]:
    """bf16 on a CPU rank: the heads' forward and loss under torch.autocast (training/ds_config.py)."""
    return lambda: torch.autocast(device_type, dtype=torch.bfloat16)


def repeated_ngram_mask(input_ids_BT: torch.Tensor, n: int) -> torch.Tensor:
    """bool [B, T]: True where tokens t-n+1..t occurred as the same n tokens earlier in the row.

    Those are the tokens that serving's n-gram lookup drafts for free (a reply that loops, a
    later turn that repeats an earlier one). `train.skip_repeated_ngram` drops them from the
    loss: on SmolLM2's 1.8M-token chat data (46% of the loss tokens), the EAGLE-3 CPU recipe at
    1400 steps went from 0.584 to 0.606 depth-1 acceptance on MT-bench and from tau 2.00 to 2.13
    on a 15-node tree, while held-out top-1, which counts the repeats too, fell from 0.577 to
    0.540 (docs/results/2026-11-26-smollm2-training.md)."""
    repeated = torch.zeros(input_ids_BT.shape, dtype=torch.bool)
    for row, ids in enumerate(input_ids_BT.tolist()):
        seen = set()
        for end in range(n - 1, len(ids)):
            gram = tuple(ids[end - n + 1:end + 1])
            if gram in seen:
                repeated[row, end] = True
            else:
                seen.add(gram)
    return repeated.to(input_ids_BT.device)


@dataclass(frozen=True)
class StepParts:
    """What the step trains and how, chosen once per run by the trainer."""

    engine: object  # the DeepSpeed engine over the heads (LoRA: over heads + adapted target)
    heads: nn.Module  # the heads inside it
    kind: HeadKind
    source: OnlineTarget  # or a subclass: CachedFeatures, LoraJoint
    precision: Callable[[], ContextManager] = contextlib.nullcontext  # or bf16_autocast(...)
    skip_repeated_ngram: int = 0  # train.skip_repeated_ngram: 0 = off


def train_step(parts: StepParts, sampler: BlockSampler, grad_accum: int,
               step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Optimizer step `step` (grad_accum micro steps) -> loss [D], top-1 [D], loss tokens (this rank's).

    A micro step: the source's teacher outputs and taps -> the kind's inputs -> the heads (through
    the engine) -> the kind's loss -> the source's objective -> backward."""
    engine, kind, source = parts.engine, parts.kind, parts.source
    dtype = next(parts.heads.parameters()).dtype
    loss_sum, top1_sum, num_tokens = 0.0, 0.0, 0
    with source.step(step):
        for _ in range(grad_accum):
            with parts.precision():
                batch = source.features(sampler.next_indices())
                if parts.skip_repeated_ngram:
                    batch = dataclasses.replace(batch, loss_mask_BT=batch.loss_mask_BT & ~repeated_ngram_mask(
                        batch.input_ids_BT, parts.skip_repeated_ngram))
                inputs = kind.inputs(batch.taps_BTnH, batch.input_ids_BT, source.target, dtype)
                result = kind.loss(engine(*inputs), batch.teacher, batch.loss_mask_BT, batch.draft_ids_V, inputs)
                objective = source.objective(result, batch)
            engine.backward(objective)
            engine.step()
            loss_sum, top1_sum = loss_sum + result.head_loss, top1_sum + result.head_top1
            num_tokens += int(batch.loss_mask_BT.sum())
    return loss_sum / grad_accum, top1_sum / grad_accum, num_tokens
