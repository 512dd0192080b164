"""The DeepSpeed JSON, generated from the recipe's TrainConfig (never the other way round).

The optimizer is DeepSpeed's "AdamW" with `torch_adam: true`, i.e. torch.optim.AdamW,
which runs on CPU ranks (DeepSpeed's fused/CPU Adam ops would need a compiler toolchain
and, for the fused one, CUDA). The scheduler steps once per optimizer step.

ZeRO-Offload (train.offload_optimizer / train.offload_params = "cpu") maps onto
zero_optimization.offload_optimizer / offload_param {"device": "cpu", "pin_memory": true}.
With the optimizer offloaded, `torch_adam` is dropped so DeepSpeed steps the CPU-resident
fp32 state with its vectorised DeepSpeedCPUAdam (JIT-built with the host C++ compiler on first
use, cached afterwards); torch's AdamW would be several times slower there. Parameter
offload needs ZeRO-3 (config.check_combinations refuses it otherwise).
"""

from __future__ import annotations

from specheads.training.config import TrainConfig

ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
NEVER = 10**9  # steps_per_print: DeepSpeed's own step logging is replaced by tracking.py


def build_ds_config(train: TrainConfig, world_size: int) -> dict:
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
    if train.precision == "bf16":
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
