"""Medusa-2 joint training: a PEFT LoRA adapter on the target trains together with the heads.

The recipe's `lora` section turns it on (absent = frozen target); `LoraJoint` is this mode's
feature source (training/features.py). The adapter is injected into the loaded target in
place (peft.get_peft_model), so `TargetAdapter.model` runs with it; the heads and the target
model then sit in one `JointModel`, which is the module the DeepSpeed engine wraps (one
optimizer, one scheduler, one gradient clip, one checkpoint).
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
merged target (`specheads export RUN_DIR --format merged --output DIR`).

The heads see the adapted target's hidden states with gradient, so their loss also trains
the adapter (as in Medusa-2); the teacher logits are detached so the heads loss cannot pull
the target towards the heads. For the first `heads_warmup_steps` optimizer steps the target
runs under no_grad and the LM loss is left out: the adapter gets no gradient, AdamW skips
it, and only the heads learn (their random start would otherwise send large gradients into
the adapter).

ZeRO-3 is refused (recipe_models.check_combinations): there the target is a partitioned,
optimizer-less inference engine, and the adapter cannot train inside it.

Outputs of a LoRA run: `<output_dir>/heads` (for the adapted target) and
`<output_dir>/adapter` (PEFT `save_pretrained` layout + `specheads_lora.json`, naming the
base target). Checkpoints hold the adapter's weights beside the heads' (checkpoint.py).

Shape legend: B batch, T positions, V vocab, H hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specheads.heads import atomic
from specheads.heads.artefacts.export import ADAPTER_SUBDIR, LORA_META
from specheads.heads.artefacts.heads_dir import HeadsConfig
from specheads.heads.target.adapter import TargetAdapter, resolve_dtype
from specheads.training.config import RecipeError
from specheads.training.features import Features, OnlineTarget
from specheads.training.losses import DistillOutput

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
    """Heads + the adapted target model, the one module the DeepSpeed engine trains (one
    optimizer, one clip, one checkpoint). Its forward is the heads': the adapted target runs
    before it, in LoraJoint.features, so that the step calls the engine alike in every mode."""

    def __init__(self, heads: nn.Module, target: TargetAdapter):
        super().__init__()
        self.heads = heads
        self.target_model = target.model

    def forward(self, *inputs):
        return self.heads(*inputs)

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


class LoraJoint(OnlineTarget):
    """LoRA joint training as a feature source (training/features.py): the adapted target runs on
    every micro batch, with grad once heads_warmup_steps are over (before that under no_grad:
    the adapter gets no gradient and AdamW skips it), and its LM loss joins the objective."""

    adapter = True

    def __init__(self, target: TargetAdapter, blocks, tap_layers: list[int], lora_cfg, base: dict, log=print):
        super().__init__(target, blocks, tap_layers)
        self.cfg, self.base = lora_cfg, base
        self.peft_model = apply_lora(target, lora_cfg)
        self.adapter_on = False
        self.lm_loss_sum, self.lm_loss_count = 0.0, 0  # LM loss of the micro steps since the last report
        log(f"LoRA adapter: {count_lora_params(target.model):,} trainable parameters in the target (rank "
            f"{lora_cfg.rank}, modules {lora_cfg.target_modules}); heads-only warmup {lora_cfg.heads_warmup_steps} "
            "steps")

    def attach(self, heads: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
        """-> one JointModel over heads + target; only the heads and the adapter train."""
        self.heads, self.joint = heads, JointModel(heads, self.target)
        adapter = [p for n, p in self.target.model.named_parameters() if "lora_" in n]
        return self.joint, list(heads.parameters()) + adapter

    @contextlib.contextmanager
    def step(self, step: int):
        self.adapter_on = step > self.cfg.heads_warmup_steps
        self.joint.train()  # LoRA dropout on; held-out eval and calibration want the target in eval mode
        yield
        self.target.model.eval()

    def features(self, indices: list[int]) -> Features:
        input_ids_BT, loss_mask_BT = (tensor.to(self.target.device) for tensor in self.blocks.batch(indices))
        with contextlib.nullcontext() if self.adapter_on else torch.no_grad():
            out = self.target(input_ids_BT, self.tap_layers)
        # The teacher is detached, so the heads loss cannot pull the target towards the heads; the
        # taps keep their grad, so the heads loss also trains the adapter (as in Medusa-2).
        return Features(input_ids_BT, loss_mask_BT, out.logits.detach(), torch.cat(out.taps, dim=-1),
                        self.heads.draft_to_target(), logits_BTV=out.logits)

    def objective(self, result: DistillOutput, features: Features) -> torch.Tensor:
        if not self.adapter_on:
            return result.loss
        lm = lm_loss(features.logits_BTV, features.input_ids_BT, features.loss_mask_BT)
        self.lm_loss_sum, self.lm_loss_count = self.lm_loss_sum + float(lm.detach()), self.lm_loss_count + 1
        return result.loss + self.cfg.lm_loss_weight * lm

    def metrics(self) -> dict[str, float]:
        """The adapted target's own LM loss (this rank's) since the last call."""
        if not self.lm_loss_count:
            return {}
        mean = self.lm_loss_sum / self.lm_loss_count
        self.lm_loss_sum, self.lm_loss_count = 0.0, 0
        return {"train/lm_loss": mean}

    def finish(self, config: HeadsConfig, output_dir: Path, log) -> HeadsConfig:
        """Write `<output_dir>/adapter`; the heads record the target as "<base>+lora:<adapter>"."""
        directory = save_adapter(self.peft_model, Path(output_dir) / ADAPTER_SUBDIR, self.base)
        log(f"wrote {directory} (serve the merged target: specheads export {output_dir} --format merged --output DIR)")
        name = f"{config.target.name_or_path}+lora:{directory.resolve()}"
        return dataclasses.replace(config, target=dataclasses.replace(config.target, name_or_path=name))


def adapter_base(target_cfg, target_path: str, device: str, lora_cfg) -> dict:
    """specheads_lora.json: the base target the adapter merges into."""
    return {"name_or_path": target_cfg.name_or_path,
            "resolved_path": str(Path(target_path).resolve()) if Path(target_path).exists() else target_path,
            "dtype": str(resolve_dtype(target_cfg.dtype, device)).removeprefix("torch."),
            "trust_remote_code": target_cfg.trust_remote_code, "lora": lora_cfg.to_dict()}


def save_adapter(peft_model, directory: Path, base: dict) -> Path:
    """PEFT save_pretrained + specheads_lora.json (the base target to merge into), atomically."""
    with atomic.staged_dir(directory) as tmp:
        peft_model.save_pretrained(str(tmp))
        atomic.write_text(tmp / LORA_META, json.dumps(base, indent=2) + "\n")
    return Path(directory)
