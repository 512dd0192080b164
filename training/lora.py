"""Medusa-2 joint training: a PEFT LoRA adapter on the target trains together with the heads.

The recipe's `lora` section turns it on (absent = frozen target). The adapter is injected
into the loaded target in place (peft.get_peft_model), so `TargetAdapter.model` runs with
it; the heads and the target model then sit in one `JointModel`, which is the module the
DeepSpeed engine wraps (one optimizer, one scheduler, one gradient clip, one checkpoint).
Only the heads' and the adapter's parameters are trainable; the base weights stay frozen.

Loss (per micro step):

    heads loss (self-distillation, teacher = the *adapted* target's logits, detached)
      + lm_loss_weight * CE(adapted target's logits at t, data token t+1) over loss-mask tokens

Why CE on the data rather than a KL to the original target: the Medusa-2 recipe trains on
the target's own regenerated replies (`specheads data regenerate`), where the next tokens
*are* the original target's greedy choices, so CE already holds the adapted target close
to the original, at no extra cost. A KL term would need a second, adapter-disabled target
forward per micro step (about 1.5x the step's compute) for a small difference on
self-distilled data. On data that is not self-distilled, CE moves the target towards that
data: this mode changes the target's outputs by design, and the result is served as the
merged target (`specheads export RUN_DIR --format merged --out DIR`).

The heads see the adapted target's hidden states with gradient, so their loss also trains
the adapter (as in Medusa-2); the teacher logits are detached so the heads loss cannot pull
the target towards the heads. For the first `heads_warmup_steps` optimizer steps the target
runs under no_grad and the LM loss is left out: the adapter gets no gradient, AdamW skips
it, and only the heads learn (their random start would otherwise send large gradients into
the adapter).

ZeRO-3 is refused (config.check_combinations): there the target is a partitioned,
optimizer-less inference engine, and the adapter cannot train inside it.

Outputs of a LoRA run: `<output_dir>/heads` (for the adapted target) and
`<output_dir>/adapter` (PEFT `save_pretrained` layout + `specheads_lora.json`, naming the
base target). Checkpoints hold the adapter's weights beside the heads' (checkpoint.py).

Shape legend: B batch, T positions, V vocab, H hidden.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specheads.heads.export import LORA_META
from specheads.heads import atomic
from specheads.heads.target import TargetAdapter
from specheads.training.config import RecipeError

HEADS_PREFIX = "heads."
TARGET_PREFIX = "target_model."


def apply_lora(target: TargetAdapter, lora_cfg):
    """Inject a LoRA adapter into target.model in place; -> the PeftModel wrapper (for saving).
    Only the adapter's parameters require grad afterwards."""
    from peft import LoraConfig, get_peft_model

    modules = lora_cfg.target_modules
    config = LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                        target_modules=modules if modules == "all-linear" else list(modules),
                        bias="none", task_type="CAUSAL_LM")
    try:
        peft_model = get_peft_model(target.model, config)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        names = sorted({name.rsplit(".", 1)[-1] for name, module in target.model.named_modules()
                        if isinstance(module, nn.Linear)})
        raise RecipeError(f"lora.target_modules {modules!r}: {str(err).splitlines()[0]} "
                         f"(linear modules of this target: {names})") from None
    for name, param in target.model.named_parameters():
        param.requires_grad_("lora_" in name)
    return peft_model


def count_lora_params(model: nn.Module) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)


class JointModel(nn.Module):
    """Heads + the adapted target model, the one module the DeepSpeed engine trains.

    forward(input_ids, adapter_grad) runs the target (taps + logits) and the heads on the inputs
    their kind (training/head_kinds.py) makes of its taps. -> (target logits [B, T, V], heads
    output, heads' inputs)."""

    def __init__(self, heads: nn.Module, target: TargetAdapter, kind, tap_layers: list[int]):
        super().__init__()
        self.heads = heads
        self.target_model = target.model
        self._target = target  # not a module attribute: the same model, reached through the adapter
        self.kind, self.tap_layers = kind, list(tap_layers)

    def forward(self, input_ids_BT: torch.Tensor, adapter_grad: bool):
        dtype = next(self.heads.parameters()).dtype
        grad = contextlib.nullcontext() if adapter_grad else torch.no_grad()
        with grad:
            out = self._target(input_ids_BT, self.tap_layers)
        inputs = self.kind.inputs(torch.cat(out.taps, dim=-1), input_ids_BT, self._target, dtype)
        return out.logits, self.heads(*inputs), inputs

    def checkpoint_names(self) -> set[str]:
        """What a checkpoint holds: every heads tensor and the adapter's parameters (not the base)."""
        names = {HEADS_PREFIX + n for n, _ in self.heads.named_parameters()}
        names |= {HEADS_PREFIX + n for n, _ in self.heads.named_buffers()}
        names |= {TARGET_PREFIX + n for n, _ in self.target_model.named_parameters() if "lora_" in n}
        return names


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A JointModel state (checkpoint_names) -> (heads state, adapter state), prefixes removed."""
    heads = {k[len(HEADS_PREFIX):]: v for k, v in state.items() if k.startswith(HEADS_PREFIX)}
    adapter = {k[len(TARGET_PREFIX):]: v for k, v in state.items() if k.startswith(TARGET_PREFIX)}
    return heads, adapter


def load_adapter_state(model: nn.Module, adapter: dict[str, torch.Tensor], source: str) -> None:
    """Copy saved adapter tensors into the live target model; every adapter parameter must match."""
    live = {n: p for n, p in model.named_parameters() if "lora_" in n}
    if set(live) != set(adapter):
        missing, unexpected = sorted(set(live) - set(adapter)), sorted(set(adapter) - set(live))
        raise ValueError(f"{source} does not match this run's LoRA adapter: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]} (lora.rank or lora.target_modules changed?)")
    with torch.no_grad():
        for name, param in live.items():
            param.copy_(adapter[name].to(param.dtype))


def lm_loss(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, loss_mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token CE over positions whose next token carries loss (loss_mask[t+1])."""
    mask_BN = loss_mask_BT[:, 1:].to(torch.float32)
    ce_BN = F.cross_entropy(logits_BTV[:, :-1].float().transpose(1, 2), input_ids_BT[:, 1:], reduction="none")
    return (ce_BN * mask_BN).sum() / mask_BN.sum().clamp(min=1.0)


def joint_micro_step(engine, input_ids_BT, loss_mask_BT, kind, lora_cfg, adapter_on: bool):
    """-> (DistillOutput of the heads, LM loss or None, the objective to backward)."""
    logits_BTV, heads_out, inputs = engine(input_ids_BT, adapter_on)
    result = kind.loss(heads_out, logits_BTV.detach(), loss_mask_BT, engine.module.heads.draft_to_target(), inputs)
    if not adapter_on:
        return result, None, result.loss
    lm = lm_loss(logits_BTV, input_ids_BT, loss_mask_BT)
    return result, lm.detach(), result.loss + lora_cfg.lm_loss_weight * lm


def save_adapter(peft_model, directory: Path, base: dict) -> Path:
    """PEFT save_pretrained + specheads_lora.json (the base target to merge into), atomically."""
    with atomic.staged_dir(directory) as tmp:
        peft_model.save_pretrained(str(tmp))
        atomic.write_text(tmp / LORA_META, json.dumps(base, indent=2) + "\n")
    return Path(directory)
