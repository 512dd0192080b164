"""The heads distillation loop (Medusa, and EAGLE with the training-time test) on a
DeepSpeed engine.

The run picks two parts once and the step (training/steps.py) only calls them: the head
kind (training/head_kinds.py: Medusa, EAGLE-3, EAGLE-1/2) and the feature source
(training/features.py: the online frozen target by default, the feature cache, or LoRA joint).
By default DeepSpeed wraps the heads only and the frozen target runs inside every micro step
under no_grad, so its hidden states and logits are always those of the current block. Works
in one process without a launcher and under `deepspeed --num_gpus N --module specheads.train
RECIPE.yaml` (training/distributed.py).

One run: recipe -> target -> data -> heads -> engine -> resume from `latest` if present ->
steps (log, eval every train.eval_every, checkpoint) -> final checkpoint -> calibration on
held-out data (rank 0) -> `<output_dir>/heads`. Re-running the same command after a crash
continues from the last complete checkpoint and ends at the same step.

Device: the frozen target and every batch go to DeepSpeed's accelerator device for this
rank (get_accelerator().current_device_name(): "cuda:N", or "cpu" on CPU ranks).
SIGTERM during the step loop: the step finishes, a checkpoint is saved at it, and run()
raises TrainingStopped (specheads.train exits 75); the handler is installed only around
the loop and the previous one restored. ZeRO-3 (train.zero_stage=3) also partitions the
frozen target across ranks (training/zero3.py); every rank then takes part in every target
forward, calibration included.

EAGLE heads: the target returns the tap layers' hidden states and logits; the head is
unrolled heads.ttt_steps times on its own features (heads/eagle3.py, Eagle3Head.forward)
and scored per step (training/losses.py, eagle_ttt_loss). The EAGLE-3 draft vocab, and a
Medusa one when heads.draft_vocab_size is below the vocab, is the most frequent training
tokens (data/vocab_counts.py, heads/draft_vocab.py). With heads.init_from, a run starts from
trained heads instead, their weights and draft vocab (fine-tuning them on new data); a
checkpoint in train.output_dir still wins, so a resumed run is the same either way.

LoRA joint mode (recipe section `lora`, training/lora.py): the engine wraps a JointModel of
the heads and the adapted target; checkpoints add the adapter; the run also writes
`<output_dir>/adapter`. Feature-cache mode (`data.feature_cache: DIR` or `auto`,
training/cached.py): the step loop reads cached taps + logits instead of running the target.
Data splits (`data.split`, `data.eval_split`): training/data_split.py.

Shape legend: K heads, B micro batch, T seq_len, H hidden, V vocab, J draft steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from pathlib import Path

import torch
from torch import nn
from transformers.utils import logging as transformers_logging

from specheads.data.text import BlockSampler, PackedBlocks
from specheads.data.vocab_counts import count_tokens
from specheads.heads.draft_vocab import build_draft_vocab
from specheads.heads.artefacts.heads_dir import HeadsConfig, build_heads, save_heads
from specheads.heads.target.adapter import TargetAdapter, check_target_exists
from specheads.training import checkpoint
from specheads.training import lora as lora_mode
from specheads.training.cached import CachedFeatures, cache_directory, open_cache
from specheads.training.calibrate import calibrate, measure_accuracy
from specheads.training.config import Recipe, RecipeError
from specheads.training.data_split import load_training_data
from specheads.training.distributed import Dist, StopRequest, init_distributed, mean_over_ranks, train_device
from specheads.training.ds_config import build_ds_config, cpu_autocast
from specheads.training.features import OnlineTarget
from specheads.training.head_kinds import HeadKind, head_kind
from specheads.training.progress import Progress
from specheads.training.steps import StepParts, bf16_autocast, train_step
from specheads.training.tracking import eval_metrics, make_tracker, new_run_id, step_metrics
from specheads.training.zero3 import gathered, load_target, teacher_runs_inference_layout

HEADS_SUBDIR = "heads"
# Recipe keys that must match a checkpoint to resume from it (they shape the state or the data).
RESUME_KEYS = ("target", "heads", "data", "train.micro_batch_size", "train.grad_accum", "train.seed",
               "train.zero_stage", "train.precision", "lora")


class TrainingStopped(Exception):
    """SIGTERM arrived: the step in flight finished, a whole checkpoint was saved, nothing else ran.
    specheads.train turns it into exit code EXIT_STOPPED; re-running the same command resumes."""

    def __init__(self, step: int, checkpoint_dir: Path):
        super().__init__(f"stopped by SIGTERM after step {step}; saved {checkpoint_dir}; "
                         "re-run the same command to continue")
        self.step, self.checkpoint_dir = step, checkpoint_dir


def run(recipe: Recipe) -> Path:
    """Train, checkpoint, calibrate; returns the heads directory (written by rank 0)."""
    kind = head_kind(recipe.heads)
    kind.check_seq_len(recipe.data.seq_len)
    target_path = _resolve_target(recipe.target.name_or_path)
    check_target_exists(target_path)  # fail before starting DeepSpeed
    recipe = _materialize_chat_source(recipe, target_path)
    inference_layout = teacher_runs_inference_layout(recipe, train_device())
    recipe = resolve_auto(recipe, target_path, train_device())
    dist = init_distributed()
    train_cfg, output_dir = recipe.train, Path(recipe.train.output_dir)
    random.seed(train_cfg.seed)
    torch.manual_seed(train_cfg.seed)

    transformers_logging.disable_progress_bar()  # one "Loading weights" bar per rank is noise
    # keep the engine: it gathers ZeRO-3 weights
    target, target_engine = load_target(recipe, target_path, dist, inference_layout)
    train_blocks, eval_blocks = load_training_data(recipe.data, target_path, train_cfg.seed, _eos_token_id(target),
                                                   target.vocab_size, recipe.target.trust_remote_code)
    config = _heads_config(recipe, target)
    # heads.init_from, read and checked before the data cache is built
    initial = None if recipe.heads.init_from is None else initial_heads(recipe.heads.init_from, config, kind)
    source = feature_source(recipe, target, target_path, train_blocks, config.tap_layers, lambda m: _say(dist, m))
    _say(dist, f"train data {source.blocks.report.summary()}")
    _say(dist, f"eval data {eval_blocks.report.summary()}")
    autocast = cpu_autocast(train_cfg, train_device(), lora=source.adapter)
    engine, heads = _make_engine(recipe, kind, config, source, target, dist, autocast, initial)
    parts = StepParts(engine, heads, kind, source, bf16_autocast(target.device.type) if autocast
                      else contextlib.nullcontext, train_cfg.skip_repeated_ngram)
    sampler = BlockSampler(len(source.blocks), train_cfg.micro_batch_size, train_cfg.seed, dist.rank,
                           dist.world_size)
    start_step, manifest = _resume(recipe, parts, sampler, output_dir, dist)
    # The W&B run this training run logs to: the checkpoint's when resuming, else a new one. Only
    # rank 0's id is used (it writes the manifest and is the only rank that reports).
    run_id = (manifest or {}).get("wandb_run_id") or new_run_id()
    _say(dist, f"{dist.world_size} rank(s), ZeRO stage {train_cfg.zero_stage}, {train_cfg.precision}"
               f"{' (autocast over fp32 weights)' if autocast else ''}, "
               f"steps {start_step}->{train_cfg.steps}, output {output_dir}")
    progress = Progress(start_step, train_cfg.steps, dist.world_size, show=dist.rank == 0)
    tracker = make_tracker(recipe.tracking, recipe.wandb, recipe.to_dict(), output_dir, train_cfg.steps, dist.rank,
                           run_id, write=progress.write)

    def save(step: int) -> Path:
        return checkpoint.save_checkpoint(output_dir, engine, step, sampler.state_dict(), recipe.to_dict(),
                                          train_cfg.precision, extra={"wandb_run_id": run_id}, adapter=source.adapter)

    try:
        _train(parts, recipe, sampler, start_step, eval_blocks, config.tap_layers, tracker, progress, save, dist)
    finally:
        progress.close()
    heads_dir = _finish(recipe, parts, config, eval_blocks, output_dir, dist, tracker,
                        partitioned_target=target_engine is not None)
    tracker.finish()
    return heads_dir


def _train(parts: StepParts, recipe: Recipe, sampler: BlockSampler, start_step: int, eval_blocks: PackedBlocks,
           tap_layers: list[int], tracker, progress: Progress, save, dist: Dist) -> None:
    """Steps start_step+1..train.steps: log every train.log_every, eval every train.eval_every,
    checkpoint every train.save_every and at the end; SIGTERM saves and raises TrainingStopped."""
    train_cfg, target = recipe.train, parts.source.target
    with StopRequest() as stop:
        for step in range(start_step + 1, train_cfg.steps + 1):
            head_loss, head_top1, num_tokens = train_step(parts, sampler, train_cfg.grad_accum, step)
            progress.step(num_tokens, head_loss.mean())
            if step % train_cfg.log_every == 0 or step == train_cfg.steps:
                head_loss, head_top1 = mean_over_ranks(head_loss, head_top1)
                metrics = step_metrics(head_loss.tolist(), head_top1.tolist(), _current_lr(parts.engine),
                                       progress.figures())
                tracker.log(step, {**metrics, **parts.source.metrics()})
            if train_cfg.eval_every and step % train_cfg.eval_every == 0:
                tracker.log(step, eval_metrics(held_out_top1(parts, target, eval_blocks, recipe, tap_layers)))
            stopping = stop.should_stop(target.device)  # collective when there are several ranks
            if step % train_cfg.save_every == 0 or step == train_cfg.steps or stopping:
                saved = save(step)
            if stopping and step < train_cfg.steps:
                progress.write(f"specheads train: SIGTERM: stopping after step {step}; saved {saved}")
                tracker.finish()
                raise TrainingStopped(step, saved)


def feature_source(recipe: Recipe, target: TargetAdapter, target_path: str, blocks: PackedBlocks,
                   tap_layers: list[int], log) -> OnlineTarget:
    """The run's one feature source (training/features.py): LoRA joint, the feature cache, or the
    online frozen target."""
    if recipe.lora is not None:
        base = lora_mode.adapter_base(recipe.target, target_path, train_device(), recipe.lora)
        return lora_mode.LoraJoint(target, blocks, tap_layers, recipe.lora, base, log=log)
    if recipe.data.feature_cache is not None:
        directory = cache_directory(recipe.data.feature_cache, target, target_path, blocks, tap_layers,
                                    recipe.train.micro_batch_size, log=log)
        return CachedFeatures(open_cache(directory, target, tap_layers, recipe.data.seq_len), target, tap_layers)
    return OnlineTarget(target, blocks, tap_layers)


def _say(dist: Dist, message: str) -> None:
    if dist.rank == 0:
        print(f"specheads train: {message}", flush=True)


def _resolve_target(name_or_path: str) -> str:
    """The one resolution path (data/tiny_target.py): embedded names, GGUF files and directories."""
    from specheads.data.tiny_target import resolve_target
    from specheads.heads.target.gguf import GGUFError

    try:
        return resolve_target(name_or_path, progress=True)
    except GGUFError as err:
        raise RecipeError(f"target.name_or_path: {err}") from err


def _materialize_chat_source(recipe: Recipe, target_path: str) -> Recipe:
    """data.source embedded:chat -> the cached file of the target's own chat replies, generated
    here on first use, on this rank's training device (every rank waits on the same lock;
    data/chat_data.py)."""
    from specheads.data.chat_data import self_distilled_chat
    from specheads.data.chat_prompts import EMBEDDED_CHAT
    from specheads.training.distributed import train_device

    if EMBEDDED_CHAT not in (recipe.data.source, recipe.data.eval_source):
        return recipe
    replies = str(self_distilled_chat(target_path, recipe.data.chat_prompts, recipe.data.chat_max_new_tokens,
                                      seed=recipe.train.seed, device=train_device(),
                                      self_instruct_fraction=recipe.data.chat_self_instruct_fraction,
                                      self_instruct_temperature=recipe.data.chat_self_instruct_temperature,
                                      thinking=recipe.data.thinking))
    data = recipe.data.replace(**{name: replies for name in ("source", "eval_source")
                                  if getattr(recipe.data, name) == EMBEDDED_CHAT})
    return recipe.replace(data=data)


def resolve_auto(recipe: Recipe, target_path: str, device: str) -> Recipe:
    """train.precision "auto" -> the training device's fast dtype (bf16 on a GPU or a CPU with
    native bf16; fp32 on any other CPU, where torch's bf16 is emulated and slower); target.dtype
    "auto" -> the same, or the dtype it serves in where the teacher loads as serving loads it
    (training/zero3.py teacher_runs_inference_layout): so that every later step, the checkpoints
    and the resume check see one concrete value."""
    from specheads.heads.target.adapter import AUTO, inference_dtype, resolve_dtype

    fast = resolve_dtype(AUTO, device)
    target, train = recipe.target, recipe.train
    if target.dtype == AUTO:
        teacher = inference_dtype(target_path, AUTO, device, target.trust_remote_code) \
            if teacher_runs_inference_layout(recipe, device) else fast
        target = target.replace(dtype=str(teacher).removeprefix("torch."))
    if train.precision == AUTO:
        train = train.replace(precision={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(fast, "fp32"))
    return recipe.replace(target=target).replace(train=train)


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
        old, new = saved.get(section, {} if name else None), current[section]
        if name:
            old, new = old.get(name), new[name]
        elif isinstance(old, dict) and isinstance(new, dict):  # keys added since: their defaults
            defaults = {name: f.get_default(call_default_factory=True)
                        for name, f in type(getattr(recipe, section)).model_fields.items() if not f.is_required()}
            old = {**{k: v for k, v in defaults.items() if k in new}, **old}
        if old != new:
            differ.append(key)
    if differ:
        raise checkpoint.CheckpointError(
            f"{directory} was written by a run whose recipe differs in {differ}; resume with the same "
            "values, or use a new train.output_dir")


def held_out_top1(parts: StepParts, target: TargetAdapter, eval_blocks: PackedBlocks, recipe: Recipe,
                  tap_layers: list[int]) -> list[float]:
    """Per-depth top-1 agreement of the heads with the target's greedy tokens on held-out blocks:
    train.eval_batches batches of micro_batch_size, evenly spaced over the held-out set (the same
    blocks every time). Every rank runs the same forwards (ZeRO-3 gathers the heads' weights
    collectively), so every rank gets the same numbers."""
    heads = parts.heads
    try:
        with torch.no_grad():
            accuracy, _ = measure_accuracy(heads, parts.kind, target, eval_blocks.input_ids.to(target.device),
                                           eval_blocks.loss_mask.to(target.device), 1,
                                           recipe.train.micro_batch_size, recipe.train.eval_batches, tap_layers)
    finally:
        heads.train()  # measure_accuracy switched it to eval mode
    return [row[0] for row in accuracy]


def _make_engine(recipe: Recipe, kind: HeadKind, config: HeadsConfig, source: OnlineTarget,
                 target: TargetAdapter, dist: Dist, autocast: bool,
                 initial: nn.Module | None = None) -> tuple[object, nn.Module]:
    """-> (the DeepSpeed engine over what the source trains, the heads inside it); `initial`:
    trained heads (heads.init_from) whose weights they start from."""
    import deepspeed

    heads = build_heads(config)
    if initial is not None:
        # Their draft vocab too: the trained lm_head's rows are those tokens, whatever this data counts.
        heads.load_state_dict(initial.state_dict())
    else:
        if kind.takes_draft_vocab(heads):
            # The same maps on every rank: counts over all training blocks.
            counts_V = count_tokens(source.blocks.input_ids, source.blocks.loss_mask, target.vocab_size)
            heads.set_draft_vocab(*build_draft_vocab(counts_V, heads.draft_vocab_size, [_eos_token_id(target)]))
        with gathered(target.lm_head()):
            heads.init_lm_heads_from(target.lm_head())
    ds_config = build_ds_config(recipe.train, dist.world_size, autocast=autocast)
    module, params = source.attach(heads)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=params, config=ds_config)
    return engine, heads


def _heads_config(recipe: Recipe, target: TargetAdapter) -> HeadsConfig:
    """The heads config of the recipe's head kind for this target (also the dry run's)."""
    identity = dataclasses.replace(target.identity, name_or_path=_recorded_name(recipe.target.name_or_path))
    return head_kind(recipe.heads).heads_config(target, identity)


# HeadsConfig fields that shape every kind's weights -> the recipe key that sets each (None: the
# target's); a head kind adds its own (HeadKind.shape_keys).
SHAPE_KEYS = {"kind": "heads.kind", "hidden_size": None, "vocab_size": None, "tap_layers": "heads.tap_layers",
              "num_attention_heads": "heads.num_attention_heads", "num_kv_heads": "heads.num_kv_heads",
              "intermediate_size": "heads.intermediate_size", "draft_vocab_size": "heads.draft_vocab_size"}


def initial_heads(directory: str, config: HeadsConfig, kind: HeadKind,
                  check_only: bool = False) -> nn.Module | None:
    """heads.init_from: the trained heads at `directory`, checked to have the shape `config`
    (this recipe's, for this target) gives; RecipeError naming each key that differs. check_only:
    the configs only, no weights read (-> None)."""
    from specheads.heads.artefacts.heads_dir import load_heads, read_heads_config

    where = f"heads.init_from={directory!r}"
    try:
        saved = read_heads_config(directory)
        saved.check_fits(config.target, source=f"the heads at {where}")
    except (FileNotFoundError, ValueError) as err:
        raise RecipeError(f"{where}: {err}") from None
    keys = SHAPE_KEYS | kind.shape_keys
    differ = [f"{name} is {getattr(saved, name)!r} there, {getattr(config, name)!r} here"
              + (f" (set {key}={getattr(saved, name)!r})" if key else "")
              for name, key in keys.items() if getattr(saved, name) != getattr(config, name)]
    if differ:
        raise RecipeError(f"{where}: those heads have another shape than this recipe's: " + "; ".join(differ))
    if check_only:
        return None
    try:
        heads, _ = load_heads(directory)
    except (FileNotFoundError, ValueError) as err:
        raise RecipeError(f"{where}: {err}") from None
    return heads


def _resume(recipe: Recipe, parts: StepParts, sampler: BlockSampler, output_dir: Path,
            dist: Dist) -> tuple[int, dict | None]:
    """Load the checkpoint `latest` names, if any; -> the step it ends at (0 for a fresh run) and
    its manifest (None for a fresh run)."""
    if dist.rank == 0:
        checkpoint.clean_partial(output_dir)
    checkpoint.barrier()
    found = checkpoint.latest_checkpoint(output_dir)
    if found is None:
        return 0, None
    directory, manifest = found
    _check_resumable(manifest, recipe, directory)
    checkpoint.load_checkpoint(directory, manifest, parts.engine, parts.heads, recipe.train.precision,
                               recipe.train.grad_accum, adapter=parts.source.adapter)
    sampler.load_state_dict(manifest["sampler"])
    _say(dist, f"resuming from {directory} (step {manifest['step']})")
    if manifest["step"] > recipe.train.steps:
        _say(dist, f"the checkpoint is past train.steps={recipe.train.steps}; nothing left to train")
    return manifest["step"], manifest


def training_record(recipe: Recipe, data_tokens: int, world_size: int) -> dict:
    """What the heads directory records about training (HeadsConfig.training; its model card
    shows it): the data, its tokens with loss, and the tokens the steps processed."""
    data, train = recipe.data, recipe.train
    return {"data": data.source, "split": data.split, "data_tokens": data_tokens, "steps": train.steps,
            "tokens_per_step": train.micro_batch_size * train.grad_accum * world_size * data.seq_len,
            "lora": recipe.lora is not None}


def _current_lr(engine) -> float:
    if engine.lr_scheduler is not None:
        return float(engine.get_lr()[0])
    return float(engine.optimizer.param_groups[0]["lr"])


def _finish(recipe: Recipe, parts: StepParts, config: HeadsConfig, eval_blocks: PackedBlocks, output_dir: Path,
            dist: Dist, tracker, partitioned_target: bool = False) -> Path:
    """Gather the weights (all ranks), calibrate on held-out data and write the heads dir (rank 0).
    A ZeRO-3 target needs every rank in its forwards, so then every rank calibrates (the same
    blocks, the same numbers) and rank 0 writes. The feature source writes what else it trained
    (LoRA: `<output_dir>/adapter`, named in the heads' target) after calibration."""
    weights, _ = checkpoint.trained_state(parts.engine, parts.source.adapter)
    heads_dir, target = output_dir / HEADS_SUBDIR, parts.source.target
    target.model.eval()  # LoRA's dropout off (a frozen target is always in eval mode)
    problem = None  # rank 0: why the heads directory could not be written (a full disk)
    if dist.rank == 0 or partitioned_target:
        heads = build_heads(config)
        saved = heads.state_dict()  # non-persistent buffers (rotary inv_freq) stay as built
        heads.load_state_dict({k: v for k, v in weights.items() if k in saved})
        heads.to(target.device)
        cal = recipe.calibrate
        config.calibration, config.tree = calibrate(
            heads, parts.kind, target, eval_blocks.input_ids.to(target.device),
            eval_blocks.loss_mask.to(target.device), cal.num_nodes, cal.max_rank, recipe.train.micro_batch_size,
            cal.eval_batches, config.tap_layers, source=eval_blocks.report.source)
    if dist.rank == 0:
        config = parts.source.finish(config, output_dir, lambda message: _say(dist, message))
        config.training = training_record(recipe, parts.source.blocks.report.num_tokens, dist.world_size)
        need = checkpoint.state_bytes(heads.state_dict()) + checkpoint.HEADROOM
        problem = checkpoint.write_problem(lambda: save_heads(heads_dir, heads, config), heads_dir, need)
    if problem is None and dist.rank == 0:
        top1 = " ".join(f"{a:.3f}" for a in config.calibration["top1"])
        _say(dist, f"held-out top-1 per head {top1}; tree of {config.tree['num_nodes']} nodes, expected "
                   f"accepted draft tokens per step {config.tree['expected_accepted_draft_tokens']:.3f}")
        _say(dist, f"wrote {heads_dir}")
        tracker.summary({"calibrate/expected_accepted_draft_tokens": config.tree["expected_accepted_draft_tokens"],
                         **{f"calibrate/head{k}_top1": a for k, a in enumerate(config.calibration["top1"])}})
    checkpoint.stop_if_heads_not_written(problem, parts.engine, heads_dir, output_dir)  # collective: a barrier too
    return heads_dir
