"""The Medusa distillation loop on a DeepSpeed engine.

DeepSpeed wraps the heads only; the frozen target runs inside every micro step under
no_grad (no feature cache), so its hidden states and logits are always those of the
current block. Works in one process without a launcher (rank/world default to 0/1) and
under `deepspeed --num_gpus N --module specheads.train RECIPE.yaml`; on CPU ranks the
process group uses the backend DeepSpeed's CPU accelerator names (gloo, or ccl when
oneCCL is installed).

One run: recipe -> target -> data -> heads -> engine -> resume from `latest` if present ->
steps (log, checkpoint) -> final checkpoint -> calibration on held-out data (rank 0) ->
`<output_dir>/heads`. Re-running the same command after a crash continues from the last
complete checkpoint and ends at the same step.

Shape legend: K heads, B micro batch, T seq_len, H hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging

from specheads.data.text import BlockSampler, PackedBlocks, load_text_data
from specheads.heads.heads_dir import HeadsConfig, build_heads, save_heads
from specheads.heads.target import TargetAdapter, check_target_exists
from specheads.training import checkpoint
from specheads.training.calibrate import calibrate
from specheads.training.config import Recipe, RecipeError
from specheads.training.ds_config import build_ds_config
from specheads.training.losses import medusa_distill_loss
from specheads.training.tracking import make_tracker, step_metrics

HEADS_SUBDIR = "heads"
# Recipe keys that must match a checkpoint to resume from it (they shape the state or the data).
RESUME_KEYS = ("target", "heads", "data", "train.micro_batch_size", "train.grad_accum", "train.seed",
               "train.zero_stage", "train.precision")


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int


def init_distributed() -> Dist:
    """Launcher-less defaults, then DeepSpeed's process group on its accelerator's backend."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    local_size = int(os.environ.get("LOCAL_SIZE", "1"))
    if local_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))  # ranks share the cores
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               verbose=False)
    return Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _say(dist: Dist, message: str) -> None:
    if dist.rank == 0:
        print(f"specheads train: {message}", flush=True)


def _resolve_target(name_or_path: str) -> str:
    if name_or_path.startswith("embedded:"):
        from specheads.data.tiny_target import resolve_target

        return resolve_target(name_or_path, progress=True)
    return name_or_path


def _recorded_name(name_or_path: str) -> str:
    """What the heads directory records: embedded/hub names as given, local paths absolute."""
    path = Path(name_or_path).expanduser()
    return str(path.resolve()) if path.exists() else name_or_path


def _eos_token_id(target: TargetAdapter) -> int | None:
    eos = getattr(target.text_config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) and eos else eos


def _check_resumable(manifest: dict, recipe: Recipe, directory: Path) -> None:
    saved, current = manifest["recipe"], recipe.to_dict()
    differ = []
    for key in RESUME_KEYS:
        section, _, name = key.partition(".")
        old, new = saved.get(section, {}), current[section]
        if name:
            old, new = old.get(name), new[name]
        if old != new:
            differ.append(key)
    if differ:
        raise checkpoint.CheckpointError(
            f"{directory} was written by a run whose recipe differs in {differ}; resume with the same "
            "values, or use a new train.output_dir")


def train_step(engine, target: TargetAdapter, blocks: PackedBlocks, sampler: BlockSampler,
               grad_accum: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One optimizer step (grad_accum micro steps) -> head loss [K], head top-1 [K], tokens."""
    dtype = next(engine.module.parameters()).dtype
    loss_sum, top1_sum, num_tokens = 0.0, 0.0, 0
    for _ in range(grad_accum):
        input_ids_BT, loss_mask_BT = blocks.batch(sampler.next_indices())
        with torch.no_grad():
            out = target(input_ids_BT, [target.num_layers])  # taps[0]: final post-norm hidden [B, T, H]
        logits_KBTV = engine(out.taps[0].to(dtype))
        result = medusa_distill_loss(logits_KBTV, out.logits, loss_mask_BT)
        engine.backward(result.loss)
        engine.step()
        loss_sum = loss_sum + result.head_loss
        top1_sum = top1_sum + result.head_top1
        num_tokens += int(loss_mask_BT.sum())
    return loss_sum / grad_accum, top1_sum / grad_accum, num_tokens


def _mean_over_ranks(*tensors: torch.Tensor) -> list[torch.Tensor]:
    packed = torch.stack([t.float() for t in tensors])  # [n, K]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(packed)
        packed /= torch.distributed.get_world_size()
    return list(packed)


def run(recipe: Recipe) -> Path:
    """Train, checkpoint, calibrate; returns the heads directory (written by rank 0)."""
    if recipe.data.seq_len < recipe.heads.num_heads + 2:
        raise RecipeError(f"data.seq_len: expected at least heads.num_heads + 2 = {recipe.heads.num_heads + 2} "
                          f"(head k scores position t against t+k+1), got {recipe.data.seq_len}")
    target_path = _resolve_target(recipe.target.name_or_path)
    check_target_exists(target_path)  # fail before starting DeepSpeed
    dist = init_distributed()
    train_cfg, output_dir = recipe.train, Path(recipe.train.output_dir)
    random.seed(train_cfg.seed)
    torch.manual_seed(train_cfg.seed)

    transformers_logging.disable_progress_bar()  # one "Loading weights" bar per rank is noise
    target = TargetAdapter.from_pretrained(target_path, dtype=recipe.target.dtype,
                                           trust_remote_code=recipe.target.trust_remote_code)
    train_blocks, eval_blocks = load_text_data(recipe.data, target_path, train_cfg.seed, _eos_token_id(target),
                                               target.vocab_size, recipe.target.trust_remote_code)
    _say(dist, f"train data {train_blocks.report.summary()}")
    _say(dist, f"eval data {eval_blocks.report.summary()}")

    engine = _make_engine(recipe, target, dist)
    sampler = BlockSampler(len(train_blocks), train_cfg.micro_batch_size, train_cfg.seed, dist.rank, dist.world_size)
    start_step = _resume(recipe, engine, sampler, output_dir, dist)
    tracker = make_tracker(recipe.tracking, recipe.wandb, recipe.to_dict(), output_dir, train_cfg.steps, dist.rank)
    _say(dist, f"{dist.world_size} rank(s), ZeRO stage {train_cfg.zero_stage}, {train_cfg.precision}, "
               f"steps {start_step}->{train_cfg.steps}, output {output_dir}")

    window_start, window_tokens = time.perf_counter(), 0
    for step in range(start_step + 1, train_cfg.steps + 1):
        head_loss, head_top1, num_tokens = train_step(engine, target, train_blocks, sampler, train_cfg.grad_accum)
        window_tokens += num_tokens
        if step % train_cfg.log_every == 0 or step == train_cfg.steps:
            head_loss, head_top1 = _mean_over_ranks(head_loss, head_top1)
            elapsed = time.perf_counter() - window_start
            tracker.log(step, step_metrics(head_loss.tolist(), head_top1.tolist(), _current_lr(engine),
                                           window_tokens * dist.world_size / max(elapsed, 1e-9)))
            window_start, window_tokens = time.perf_counter(), 0
        if step % train_cfg.save_every == 0 or step == train_cfg.steps:
            checkpoint.save_checkpoint(output_dir, engine, step, sampler.state_dict(), recipe.to_dict(),
                                       train_cfg.precision)

    heads_dir = _finish(recipe, engine, target, eval_blocks, output_dir, dist, tracker)
    tracker.finish()
    return heads_dir


def _make_engine(recipe: Recipe, target: TargetAdapter, dist: Dist):
    import deepspeed

    heads = build_heads(_heads_config(recipe, target))
    heads.init_lm_heads_from(target.lm_head())
    ds_config = build_ds_config(recipe.train, dist.world_size)
    engine, _, _, _ = deepspeed.initialize(model=heads, model_parameters=list(heads.parameters()), config=ds_config)
    return engine


def _heads_config(recipe: Recipe, target: TargetAdapter) -> HeadsConfig:
    identity = dataclasses.replace(target.identity, name_or_path=_recorded_name(recipe.target.name_or_path))
    return HeadsConfig(kind=recipe.heads.kind, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                       num_heads=recipe.heads.num_heads, num_layers=recipe.heads.num_layers,
                       tap_layers=[target.num_layers], target=identity)


def _resume(recipe: Recipe, engine, sampler: BlockSampler, output_dir: Path, dist: Dist) -> int:
    """Load the checkpoint `latest` names, if any; -> the step it ends at (0 for a fresh run)."""
    if dist.rank == 0:
        checkpoint.clean_partial(output_dir)
    checkpoint.barrier()
    found = checkpoint.latest_checkpoint(output_dir)
    if found is None:
        return 0
    directory, manifest = found
    _check_resumable(manifest, recipe, directory)
    checkpoint.load_checkpoint(directory, manifest, engine, recipe.train.precision, recipe.train.grad_accum)
    sampler.load_state_dict(manifest["sampler"])
    _say(dist, f"resuming from {directory} (step {manifest['step']})")
    if manifest["step"] > recipe.train.steps:
        _say(dist, f"the checkpoint is past train.steps={recipe.train.steps}; nothing left to train")
    return manifest["step"]


def _current_lr(engine) -> float:
    return float(engine.get_lr()[0]) if engine.lr_scheduler is not None else float(engine.optimizer.param_groups[0]["lr"])


def _finish(recipe: Recipe, engine, target: TargetAdapter, eval_blocks: PackedBlocks, output_dir: Path,
            dist: Dist, tracker) -> Path:
    """Gather the weights (all ranks), calibrate on held-out data and write the heads dir (rank 0)."""
    weights = checkpoint.full_state_dict(engine)
    heads_dir = output_dir / HEADS_SUBDIR
    if dist.rank == 0:
        config = _heads_config(recipe, target)
        heads = build_heads(config)
        heads.load_state_dict(weights)
        cal = recipe.calibrate
        config.calibration, config.tree = calibrate(
            heads, target, eval_blocks.input_ids, eval_blocks.loss_mask, cal.num_nodes, cal.max_rank,
            recipe.train.micro_batch_size, cal.eval_batches, source=eval_blocks.report.source)
        save_heads(heads_dir, heads, config)
        top1 = " ".join(f"{a:.3f}" for a in config.calibration["top1"])
        _say(dist, f"held-out top-1 per head {top1}; tree of {config.tree['num_nodes']} nodes, expected "
                   f"accepted draft tokens per step {config.tree['expected_accept_length']:.3f}")
        _say(dist, f"wrote {heads_dir}")
        tracker.summary({"calibrate/expected_accept_length": config.tree["expected_accept_length"],
                         **{f"calibrate/head{k}_top1": a for k, a in enumerate(config.calibration["top1"])}})
    checkpoint.barrier()
    return heads_dir
