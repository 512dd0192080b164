"""One optimizer step of the heads' training: grad_accum micro steps, each getting the target's
outputs in one of three ways (StepMode): online (the frozen target runs under no_grad), from
the offline feature cache (training/cached.py), or LoRA joint (the adapted target runs inside
the engine, training/lora.py). Split out of trainer.py, which drives the loop.

Shape legend: K heads, B micro batch, T seq_len, H hidden, V vocab, J draft steps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from specheads.data.text import BlockSampler, PackedBlocks
from specheads.heads.target import TargetAdapter
from specheads.training import lora as lora_mode
from specheads.training.cached import cached_micro_step
from specheads.training.head_kinds import frozen_target


def _online_micro_step(engine, target: TargetAdapter, input_ids_BT, loss_mask_BT, dtype, kind, tap_layers):
    off, no_grad = frozen_target(target.device)
    with off, no_grad:
        out = target(input_ids_BT, tap_layers)
        taps_BTnH = torch.cat(out.taps, dim=-1)
    inputs = kind.inputs(taps_BTnH, input_ids_BT, target, dtype)
    return kind.loss(engine(*inputs), out.logits, loss_mask_BT, engine.module.draft_to_target(), inputs)


@dataclass
class StepMode:
    """How a micro step gets the target's outputs: online (default), from a feature cache, or
    LoRA joint (the adapted target inside the engine; adapter_on is False during heads warmup)."""

    cache: object | None = None  # FeatureCache
    lora: object | None = None  # LoraConfig
    adapter_on: bool = False
    lm_loss_sum: float = 0.0  # LoRA: summed LM loss of the micro steps since the last report
    lm_loss_count: int = 0
    autocast: bool = False  # bf16 on a CPU rank: forward + loss under torch.autocast (training/ds_config.py)

    def precision_context(self, device_type: str):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=torch.bfloat16)


def train_step(engine, target: TargetAdapter, blocks: PackedBlocks, sampler: BlockSampler,
               grad_accum: int, kind, tap_layers: list[int], mode: StepMode | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One optimizer step (grad_accum micro steps) -> loss [K|J], top-1 [K|J], tokens."""
    mode = mode or StepMode()
    heads = engine.module.heads if mode.lora is not None else engine.module
    dtype = next(heads.parameters()).dtype
    if mode.lora is not None:
        engine.module.train()  # LoRA dropout on; eval/calibration switch the target back to eval
    loss_sum, top1_sum, num_tokens = 0.0, 0.0, 0
    for _ in range(grad_accum):
        indices = sampler.next_indices()
        with mode.precision_context(target.device.type):
            result, loss_mask_BT, objective = _micro_step(engine, target, blocks, indices, dtype, kind, tap_layers,
                                                          mode)
        engine.backward(objective)
        engine.step()
        loss_sum = loss_sum + result.head_loss
        top1_sum = top1_sum + result.head_top1
        num_tokens += int(loss_mask_BT.sum())
    if mode.lora is not None:
        target.model.eval()
    return loss_sum / grad_accum, top1_sum / grad_accum, num_tokens


def _micro_step(engine, target: TargetAdapter, blocks: PackedBlocks, indices: list[int], dtype, kind,
                tap_layers, mode: StepMode):
    """One micro step's forward and loss -> (loss output, loss mask [B, T], the objective to backward)."""
    if mode.cache is not None:
        result, loss_mask_BT = cached_micro_step(engine, mode.cache, indices, target, kind, tap_layers, dtype)
        objective = result.loss
    else:
        input_ids_BT, loss_mask_BT = blocks.batch(indices)
        input_ids_BT, loss_mask_BT = input_ids_BT.to(target.device), loss_mask_BT.to(target.device)
        if mode.lora is not None:
            result, lm, objective = lora_mode.joint_micro_step(engine, input_ids_BT, loss_mask_BT, kind, mode.lora,
                                                               mode.adapter_on)
            if lm is not None:
                mode.lm_loss_sum, mode.lm_loss_count = mode.lm_loss_sum + float(lm), mode.lm_loss_count + 1
        else:
            result = _online_micro_step(engine, target, input_ids_BT, loss_mask_BT, dtype, kind, tap_layers)
            objective = result.loss
    return result, loss_mask_BT, objective
