"""Feature sources: where a micro batch's teacher outputs and taps come from.

One source per run, chosen once by the trainer (training/trainer.py, `feature_source`):

    OnlineTarget    (default) the frozen target runs on every micro batch, under no_grad and
                    outside the heads' autocast
    CachedFeatures  (data.feature_cache, training/cached.py) the taps and logits written by
                    `specheads data cache`; the target is not run in the step loop
    LoraJoint       (the recipe's lora section, training/lora.py) the adapted target runs with
                    grad once the heads' warmup is over, and its own LM loss joins the objective

Every source offers the same members, so the step (training/steps.py) has no mode `if`:

    blocks                       the training blocks the sampler walks
    target                       the target adapter (the head kinds read its embedding table)
    heads                        the heads, once attached
    adapter                      whether the engine also trains a LoRA adapter (the checkpoint's flag)
    attach(heads)                -> the module DeepSpeed trains and its trainable parameters
    step(step)                   a context around optimizer step `step`
    features(indices)            -> Features of those blocks
    objective(result, features)  -> what backward() sees
    metrics()                    -> this source's own figures since the last call (the log line)
    finish(config, dir, log)     -> the heads config to write, after calibration (rank 0)

Shape legend: B micro batch, T seq_len, H hidden, nH taps x hidden, V vocab, Vd draft vocab.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specheads.data.text import PackedBlocks
from specheads.heads.artefacts.heads_dir import HeadsConfig
from specheads.heads.target.adapter import TargetAdapter
from specheads.training.losses import DistillOutput, Teacher


def frozen_target(device: torch.device):
    """The teacher's side of a step: no grad, and never under the heads' bf16 autocast (its
    outputs are the heads' targets; the target's dtype decides its precision)."""
    return torch.autocast(device.type, enabled=False), torch.no_grad()


@dataclass
class Features:
    """One micro batch as a feature source hands it to the head kind."""

    input_ids_BT: torch.Tensor  # [B, T]
    loss_mask_BT: torch.Tensor  # [B, T] bool
    teacher: torch.Tensor | Teacher  # the target's logits [B, T, V] (no grad), or a Teacher over the draft vocab
    taps_BTnH: torch.Tensor  # the tap layers' hidden states, concatenated in tap order, the target's dtype
    draft_ids_V: torch.Tensor | None  # [Vd] the target id of each of the heads' draft ids; None: the full vocab
    logits_BTV: torch.Tensor | None = None  # LoRA: the adapted target's logits with grad (its LM loss)


class OnlineTarget:
    """The frozen target runs on every micro batch (the default source)."""

    adapter = False

    def __init__(self, target: TargetAdapter, blocks: PackedBlocks, tap_layers: list[int]):
        self.target, self.blocks, self.tap_layers = target, blocks, list(tap_layers)
        self.heads: nn.Module | None = None

    def attach(self, heads: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
        """The heads this source feeds; -> the module DeepSpeed trains and its trainable parameters."""
        self.heads = heads
        return heads, list(heads.parameters())

    def step(self, step: int):
        return contextlib.nullcontext()

    def features(self, indices: list[int]) -> Features:
        input_ids_BT, loss_mask_BT = (tensor.to(self.target.device) for tensor in self.blocks.batch(indices))
        off, no_grad = frozen_target(self.target.device)
        with off, no_grad:
            out = self.target(input_ids_BT, self.tap_layers)
            taps_BTnH = torch.cat(out.taps, dim=-1)
        return Features(input_ids_BT, loss_mask_BT, out.logits, taps_BTnH, self.heads.draft_to_target())

    def objective(self, result: DistillOutput, features: Features) -> torch.Tensor:
        return result.loss

    def metrics(self) -> dict[str, float]:
        return {}

    def finish(self, config: HeadsConfig, output_dir: Path, log) -> HeadsConfig:
        return config
