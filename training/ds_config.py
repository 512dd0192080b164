"""The DeepSpeed JSON, generated from the recipe's TrainConfig (never the other way round).

The optimizer is DeepSpeed's "AdamW" with `torch_adam: true`, i.e. torch.optim.AdamW,
which runs on CPU ranks (DeepSpeed's fused/CPU Adam ops would need a compiler toolchain
and, for the fused one, CUDA). The scheduler steps once per optimizer step.

ZeRO-Offload (train.offload_optimizer / train.offload_params = "cpu") maps onto
zero_optimization.offload_optimizer / offload_param {"device": "cpu", "pin_memory": true}.
With the optimizer offloaded, `torch_adam` is dropped so DeepSpeed steps the CPU-resident
fp32 state with its vectorised DeepSpeedCPUAdam (JIT-built with the host C++ compiler on first
use, cached afterwards); torch's AdamW would be several times slower there. Parameter
offload needs ZeRO-3 (recipe_models.check_combinations refuses it otherwise).

train.precision bf16 maps onto DeepSpeed's bf16 (bf16 weights, fp32 masters in the optimizer) on
GPU ranks. On CPU ranks (`cpu_autocast`) the engine stays fp32 and the heads' forward and loss run
under torch.autocast(bf16) instead: measured on SmolLM2's EAGLE-3 head from the feature cache
(2 cores with AVX512-BF16), both take 3.5 s a step against fp32's 7.1 s, and autocast keeps the
loss closer to fp32's (step 4: 11.4070 vs fp32 11.4035; bf16 weights 11.7218), while its
optimizer, checkpoints and resume are exactly the fp32 ones. LoRA joint runs keep DeepSpeed's
bf16 (their target trains inside the engine in train.precision's dtype).
"""

from __future__ import annotations

from specheads.training.config import TrainConfig

ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
NEVER = 10**9  # steps_per_print: DeepSpeed's own step logging is replaced by tracking.py


def cpu_autocast(train: TrainConfig, device: str, lora: bool = False) -> bool:
    """Whether this run's bf16 is torch.autocast over an fp32 engine (CPU ranks; module docstring)."""
    return train.precision == "bf16" and device.split(":")[0] == "cpu" and not lora


def build_ds_config(train: TrainConfig, world_size: int, autocast: bool = False) -> dict:
    """autocast: bf16 comes from torch.autocast (cpu_autocast), so the engine itself is fp32."""
    config = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "train_batch_size": train.micro_batch_size * train.grad_accum * world_size,
        "gradient_clipping": float(train.grad_clip),
        "steps_per_print": NEVER,
        "wall_clock_breakdown": False,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": train.lr, "betas": list(ADAM_BETAS), "eps": ADAM_EPS,
                       "weight_decay": train.weight_decay, "torch_adam": True},
        },
        "zero_optimization": {"stage": train.zero_stage},
    }
    if train.offload_optimizer == "cpu":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        del config["optimizer"]["params"]["torch_adam"]  # -> DeepSpeedCPUAdam
    if train.offload_params == "cpu":
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    scheduler = _scheduler(train)
    if scheduler is not None:
        config["scheduler"] = scheduler
    if train.precision == "bf16" and not autocast:
        config["bf16"] = {"enabled": True}
    elif train.precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                          "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    return config


def _scheduler(train: TrainConfig) -> dict | None:
    """DeepSpeed's schedulers need warmup_num_steps >= 1 (and warm up over at least 2)."""
    warmup = max(1, train.warmup_steps)
    if train.scheduler == "cosine":
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": train.steps, "warmup_num_steps": warmup,
            "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1, "warmup_type": "linear"}}
    if train.warmup_steps == 0:
        return None  # constant lr: no scheduler at all
    return {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": train.lr, "warmup_num_steps": warmup,
        "warmup_type": "linear"}}
