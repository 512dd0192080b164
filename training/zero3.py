"""The frozen target on this rank: whole (ZeRO stages 0-2) or partitioned across ranks (ZeRO-3).

ZeRO-3 (train.zero_stage=3): the target is built and loaded under DeepSpeed's ZeRO-3 context
(transformers' HfDeepSpeedConfig, alive during from_pretrained), so each rank holds 1/world of
every weight (param.ds_tensor), and it is wrapped by an optimizer-less DeepSpeed engine whose
ZeRO-3 hooks gather each module's weights around its forward. Every rank must then run every
target forward (training, eval and calibration all do). Chosen once, in `load_target`.
"""

from __future__ import annotations

import contextlib

from specheads.heads.target.adapter import TargetAdapter
from specheads.training.config import Recipe
from specheads.training.distributed import Dist, train_device
from specheads.training.ds_config import build_ds_config


def teacher_runs_inference_layout(recipe: Recipe, device: str) -> bool:
    """Whether the frozen target loads as serving loads it (heads/target/cpu_layout.py: weights packed,
    the fused forward, the inference dtype): for target.dtype "auto" on a CPU, when nothing trains
    the target (no lora) and ZeRO-3 does not partition it. Its forward then costs what it costs at
    serving, in the dtype it serves in (bf16 on an AVX2 CPU with heads/target/cpu_gemm.py's
    kernel, where training math is fp32). Asked before "auto" is resolved (training/trainer.py)."""
    return recipe.target.dtype == "auto" and recipe.lora is None and recipe.train.zero_stage != 3 \
        and device.split(":")[0] == "cpu"


def load_target(recipe: Recipe, target_path: str, dist: Dist, inference_layout: bool = False):
    """-> (the frozen target on this rank's device, its ZeRO-3 engine or None when it is whole).
    Keep the engine while the target is used: it owns the hooks that gather the weights.
    inference_layout: `teacher_runs_inference_layout`."""
    kwargs = {"dtype": recipe.target.dtype, "device": train_device(),
              "trust_remote_code": recipe.target.trust_remote_code}
    if recipe.train.zero_stage != 3:
        return TargetAdapter.from_pretrained(target_path, pack_weights="auto" if inference_layout else False,
                                             **kwargs), None
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    config = _target_ds_config(recipe, dist)
    hf_config = HfDeepSpeedConfig(config)  # transformers holds a weak reference: keep it alive while loading
    target = TargetAdapter.from_pretrained(target_path, **kwargs)
    del hf_config  # later transformers models (none are built) would otherwise be partitioned too
    engine, _, _, _ = deepspeed.initialize(model=target.model, config=config)
    local = sum(p.ds_tensor.numel() for p in target.model.parameters() if hasattr(p, "ds_tensor"))
    total = sum(getattr(p, "ds_numel", p.numel()) for p in target.model.parameters())
    print(f"specheads train: [rank {dist.rank}] ZeRO-3 target: {local} of {total} parameters resident "
          "on this rank", flush=True)
    return target, engine


def _target_ds_config(recipe: Recipe, dist: Dist) -> dict:
    """The heads' DeepSpeed config minus optimizer and scheduler: ZeRO-3 inference for the target."""
    config = build_ds_config(recipe.train, dist.world_size)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    config["zero_optimization"].pop("offload_optimizer", None)  # no optimizer; offload_param stays
    return config


def gathered(module):
    """A context in which `module`'s full weights are present (a ZeRO-3 target's; collective)."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
