"""The heads distillation loop (Medusa, and EAGLE with the training-time test) on a
DeepSpeed engine.

By default DeepSpeed wraps the heads only and the frozen target runs inside every micro step
under no_grad, so its hidden states and logits are always those of the current block (the
two other modes, LoRA joint and feature cache, are below). Works in one process without a
launcher (rank/world default to 0/1) and under
`deepspeed --num_gpus N --module specheads.train RECIPE.yaml`; on CPU ranks the process
group uses the backend DeepSpeed's CPU accelerator names (gloo, or ccl when oneCCL is
installed).

One run: recipe -> target -> data -> heads -> engine -> resume from `latest` if present ->
steps (log, eval every train.eval_every, checkpoint) -> final checkpoint -> calibration on
held-out data (rank 0) -> `<output_dir>/heads`. Re-running the same command after a crash
continues from the last complete checkpoint and ends at the same step.

Device: the frozen target and every batch go to DeepSpeed's accelerator device for this
rank (get_accelerator().current_device_name(): "cuda:N", or "cpu" on CPU ranks).
SIGTERM during the step loop: the step finishes, a checkpoint is saved at it, and run()
raises TrainingStopped (specheads.train exits 75); the handler is installed only around
the loop and the previous one restored. ZeRO-3 (train.zero_stage=3) also partitions the
frozen target across ranks (_load_target); every rank then takes part in every target
forward, calibration included.

EAGLE heads: the target returns the tap layers' hidden states and logits; the head is
unrolled heads.ttt_steps times on its own features (heads/eagle3.py, Eagle3Head.forward)
and scored per step (training/losses.py, eagle_ttt_loss). The EAGLE-3 draft vocab, and a
Medusa one when heads.draft_vocab_size is below the vocab, is the most frequent training
tokens (data/vocab_counts.py, heads/draft_vocab.py).

LoRA joint mode (recipe section `lora`, training/lora.py): the engine wraps a JointModel of
the heads and the adapted target; checkpoints add the adapter; the run also writes
`<output_dir>/adapter`. Feature-cache mode (`data.feature_cache: DIR` or `auto`, training/cached.py): the
step loop reads cached taps + logits instead of running the target. Data splits
(`data.split`, `data.eval_split`): training/data_split.py.

Shape legend: K heads, B micro batch, T seq_len, H hidden, V vocab, J draft steps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging

from specheads.data.text import BlockSampler, PackedBlocks
from specheads.data.vocab_counts import count_tokens
from specheads.heads.draft_vocab import build_draft_vocab
from specheads.heads.export import ADAPTER_SUBDIR
from specheads.heads.heads_dir import HeadsConfig, build_heads, save_heads
from specheads.heads.target import TargetAdapter, check_target_exists, resolve_dtype
from specheads.training import checkpoint
from specheads.training import lora as lora_mode
from specheads.training.cached import AUTO as AUTO_CACHE, build_auto_cache, open_cache
from specheads.training.calibrate import calibrate, measure_accuracy
from specheads.training.config import Recipe, RecipeError
from specheads.training.data_split import load_training_data
from specheads.training.ds_config import build_ds_config, cpu_autocast
from specheads.training.head_kinds import HeadKind, head_kind
from specheads.training.steps import StepMode, train_step
from specheads.training.tracking import eval_metrics, make_tracker, new_run_id, step_metrics

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


class StopRequest:
    """SIGTERM -> a flag checked between steps (installed for the training loop only; the previous
    handler is restored on exit). Under several ranks the flag is OR-ed over ranks every step, so
    all ranks stop after the same step even when the signal reaches them at different times."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def should_stop(self, device) -> bool:
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            return bool(flag.item() > 0)
        return self.requested


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


def train_device() -> str:
    """This rank's device as DeepSpeed's accelerator names it ("cuda:N" on GPU ranks, "cpu" on CPU
    ranks). The frozen target and every batch live there; deepspeed.initialize puts the heads there."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _say(dist: Dist, message: str) -> None:
    if dist.rank == 0:
        print(f"specheads train: {message}", flush=True)


def _resolve_target(name_or_path: str) -> str:
    """The one resolution path (data/tiny_target.py): embedded names, GGUF files and directories."""
    from specheads.data.tiny_target import resolve_target
    from specheads.heads.gguf import GGUFError

    try:
        return resolve_target(name_or_path, progress=True)
    except GGUFError as err:
        raise RecipeError(f"target.name_or_path: {err}") from err


def _materialize_chat_source(recipe: Recipe, target_path: str) -> Recipe:
    """data.source embedded:chat -> the cached file of the target's own chat replies, generated
    here on first use (every rank waits on the same lock; data/chat_prompts.py)."""
    from specheads.data.chat_prompts import EMBEDDED_CHAT, self_distilled_chat

    if EMBEDDED_CHAT not in (recipe.data.source, recipe.data.eval_source):
        return recipe
    replies = str(self_distilled_chat(target_path, recipe.data.chat_prompts, recipe.data.chat_max_new_tokens,
                                      seed=recipe.train.seed,
                                      self_instruct_fraction=recipe.data.chat_self_instruct_fraction))
    data = recipe.data.replace(**{name: replies for name in ("source", "eval_source")
                                  if getattr(recipe.data, name) == EMBEDDED_CHAT})
    return recipe.replace(data=data)


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


def held_out_top1(engine, kind: HeadKind, target: TargetAdapter, eval_blocks: PackedBlocks, recipe: Recipe,
                  tap_layers: list[int]) -> list[float]:
    """Per-depth top-1 agreement of the heads with the target's greedy tokens on held-out blocks:
    train.eval_batches batches of micro_batch_size, evenly spaced over the held-out set (the same
    blocks every time). Every rank runs the same forwards (ZeRO-3 gathers the heads' weights
    collectively), so every rank gets the same numbers."""
    heads = engine.module.heads if recipe.lora is not None else engine.module
    try:
        with torch.no_grad():
            accuracy, _ = measure_accuracy(heads, kind, target, eval_blocks.input_ids.to(target.device),
                                           eval_blocks.loss_mask.to(target.device), 1,
                                           recipe.train.micro_batch_size, recipe.train.eval_batches, tap_layers)
    finally:
        heads.train()  # measure_accuracy switched it to eval mode
    return [row[0] for row in accuracy]


def _mean_over_ranks(*tensors: torch.Tensor) -> list[torch.Tensor]:
    packed = torch.stack([t.float() for t in tensors])  # [n, K]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(packed)
        packed /= torch.distributed.get_world_size()
    return list(packed)


def run(recipe: Recipe) -> Path:
    """Train, checkpoint, calibrate; returns the heads directory (written by rank 0)."""
    kind = head_kind(recipe.heads)
    kind.check_seq_len(recipe.data.seq_len)
    target_path = _resolve_target(recipe.target.name_or_path)
    check_target_exists(target_path)  # fail before starting DeepSpeed
    recipe = _materialize_chat_source(recipe, target_path)
    dist = init_distributed()
    train_cfg, output_dir = recipe.train, Path(recipe.train.output_dir)
    random.seed(train_cfg.seed)
    torch.manual_seed(train_cfg.seed)

    transformers_logging.disable_progress_bar()  # one "Loading weights" bar per rank is noise
    target, target_engine = _load_target(recipe, target_path, dist)
    train_blocks, eval_blocks = load_training_data(recipe.data, target_path, train_cfg.seed, _eos_token_id(target),
                                                   target.vocab_size, recipe.target.trust_remote_code)
    tap_layers = _heads_config(recipe, target).tap_layers
    mode = StepMode(lora=recipe.lora, autocast=cpu_autocast(train_cfg, train_device(), recipe.lora is not None))
    if recipe.data.feature_cache is not None:
        directory = recipe.data.feature_cache
        if directory == AUTO_CACHE:
            directory = build_auto_cache(target, target_path, train_blocks, tap_layers,
                                         train_cfg.micro_batch_size, log=lambda message: _say(dist, message))
        mode.cache = open_cache(directory, target, tap_layers, recipe.data.seq_len)
        train_blocks = mode.cache.blocks()  # the cache's blocks are the training data
    _say(dist, f"train data {train_blocks.report.summary()}")
    _say(dist, f"eval data {eval_blocks.report.summary()}")

    peft_model = lora_mode.apply_lora(target, recipe.lora) if recipe.lora is not None else None
    if peft_model is not None:
        _say(dist, f"LoRA adapter: {lora_mode.count_lora_params(target.model):,} trainable parameters in the target "
                   f"(rank {recipe.lora.rank}, modules {recipe.lora.target_modules}); heads-only warmup "
                   f"{recipe.lora.heads_warmup_steps} steps")
    engine = _make_engine(recipe, target, dist, train_blocks)
    sampler = BlockSampler(len(train_blocks), train_cfg.micro_batch_size, train_cfg.seed, dist.rank, dist.world_size)
    start_step, manifest = _resume(recipe, engine, sampler, output_dir, dist)
    # The W&B run this training run logs to: the checkpoint's when resuming, else a new one. Only
    # rank 0's id is used (it writes the manifest and is the only rank that reports).
    run_id = (manifest or {}).get("wandb_run_id") or new_run_id()
    tracker = make_tracker(recipe.tracking, recipe.wandb, recipe.to_dict(), output_dir, train_cfg.steps, dist.rank,
                           run_id)
    _say(dist, f"{dist.world_size} rank(s), ZeRO stage {train_cfg.zero_stage}, {train_cfg.precision}"
               f"{' (autocast over fp32 weights)' if mode.autocast else ''}, "
               f"steps {start_step}->{train_cfg.steps}, output {output_dir}")

    def save(step: int) -> Path:
        return checkpoint.save_checkpoint(output_dir, engine, step, sampler.state_dict(), recipe.to_dict(),
                                          train_cfg.precision, extra={"wandb_run_id": run_id})

    window_start, window_tokens = time.perf_counter(), 0
    with StopRequest() as stop:
        for step in range(start_step + 1, train_cfg.steps + 1):
            mode.adapter_on = recipe.lora is not None and step > recipe.lora.heads_warmup_steps
            head_loss, head_top1, num_tokens = train_step(engine, target, train_blocks, sampler,
                                                         train_cfg.grad_accum, kind, tap_layers, mode)
            window_tokens += num_tokens
            if step % train_cfg.log_every == 0 or step == train_cfg.steps:
                head_loss, head_top1 = _mean_over_ranks(head_loss, head_top1)
                elapsed = time.perf_counter() - window_start
                metrics = step_metrics(head_loss.tolist(), head_top1.tolist(), _current_lr(engine),
                                       window_tokens * dist.world_size / max(elapsed, 1e-9))
                if mode.lm_loss_count:  # LoRA: the adapted target's own LM loss (this rank's)
                    metrics["train/lm_loss"] = mode.lm_loss_sum / mode.lm_loss_count
                    mode.lm_loss_sum, mode.lm_loss_count = 0.0, 0
                tracker.log(step, metrics)
                window_start, window_tokens = time.perf_counter(), 0
            if train_cfg.eval_every and step % train_cfg.eval_every == 0:
                tracker.log(step, eval_metrics(held_out_top1(engine, kind, target, eval_blocks, recipe, tap_layers)))
            stopping = stop.should_stop(target.device)  # collective when there are several ranks
            if step % train_cfg.save_every == 0 or step == train_cfg.steps or stopping:
                saved = save(step)
            if stopping and step < train_cfg.steps:
                _say(dist, f"SIGTERM: stopping after step {step}; saved {saved}")
                tracker.finish()
                raise TrainingStopped(step, saved)

    heads_dir = _finish(recipe, engine, target, eval_blocks, output_dir, dist, tracker,
                        partitioned_target=target_engine is not None, peft_model=peft_model,
                        target_path=target_path)
    tracker.finish()
    return heads_dir


def _load_target(recipe: Recipe, target_path: str, dist: Dist):
    """-> (target, its DeepSpeed engine or None).

    ZeRO stages 0-2: the whole frozen target on this rank's device. ZeRO-3: the target is built
    and loaded under DeepSpeed's ZeRO-3 context (transformers' HfDeepSpeedConfig, alive during
    from_pretrained), so each rank holds 1/world of every weight (param.ds_tensor), and it is
    wrapped by an optimizer-less DeepSpeed engine whose ZeRO-3 hooks gather each module's
    weights around its forward. Every rank must then run every target forward (training,
    eval and calibration all do)."""
    kwargs = {"dtype": recipe.target.dtype, "device": train_device(),
              "trust_remote_code": recipe.target.trust_remote_code}
    if recipe.train.zero_stage != 3:
        return TargetAdapter.from_pretrained(target_path, **kwargs), None
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


def _gathered(target: TargetAdapter, module):
    """A context in which `module`'s full weights are present (ZeRO-3 targets; collective)."""
    import contextlib

    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _make_engine(recipe: Recipe, target: TargetAdapter, dist: Dist, train_blocks: PackedBlocks):
    import deepspeed

    heads = build_heads(_heads_config(recipe, target))
    if head_kind(recipe.heads).takes_draft_vocab(heads):
        # The same maps on every rank: counts over all training blocks.
        counts_V = count_tokens(train_blocks.input_ids, train_blocks.loss_mask, target.vocab_size)
        heads.set_draft_vocab(*build_draft_vocab(counts_V, heads.draft_vocab_size, [_eos_token_id(target)]))
    with _gathered(target, target.lm_head()):
        heads.init_lm_heads_from(target.lm_head())
    ds_config = build_ds_config(recipe.train, dist.world_size,
                                autocast=cpu_autocast(recipe.train, train_device(), recipe.lora is not None))
    module, params = heads, list(heads.parameters())
    if recipe.lora is not None:  # one engine over heads + adapted target; only heads + adapter train
        module = lora_mode.JointModel(heads, target, head_kind(recipe.heads),
                                      _heads_config(recipe, target).tap_layers)
        params = params + [p for n, p in target.model.named_parameters() if "lora_" in n]
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=params, config=ds_config)
    return engine


def _heads_config(recipe: Recipe, target: TargetAdapter) -> HeadsConfig:
    """The heads config of the recipe's head kind for this target (also the dry run's)."""
    identity = dataclasses.replace(target.identity, name_or_path=_recorded_name(recipe.target.name_or_path))
    return head_kind(recipe.heads).heads_config(target, identity)


def _resume(recipe: Recipe, engine, sampler: BlockSampler, output_dir: Path, dist: Dist) -> tuple[int, dict | None]:
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
    checkpoint.load_checkpoint(directory, manifest, engine, recipe.train.precision, recipe.train.grad_accum)
    sampler.load_state_dict(manifest["sampler"])
    _say(dist, f"resuming from {directory} (step {manifest['step']})")
    if manifest["step"] > recipe.train.steps:
        _say(dist, f"the checkpoint is past train.steps={recipe.train.steps}; nothing left to train")
    return manifest["step"], manifest


def _current_lr(engine) -> float:
    if engine.lr_scheduler is not None:
        return float(engine.get_lr()[0])
    return float(engine.optimizer.param_groups[0]["lr"])


def _finish(recipe: Recipe, engine, target: TargetAdapter, eval_blocks: PackedBlocks, output_dir: Path,
            dist: Dist, tracker, partitioned_target: bool = False, peft_model=None, target_path: str = "") -> Path:
    """Gather the weights (all ranks), calibrate on held-out data and write the heads dir (rank 0).
    A ZeRO-3 target needs every rank in its forwards, so then every rank calibrates (the same
    blocks, the same numbers) and rank 0 writes. LoRA runs calibrate on the adapted target and
    also write `<output_dir>/adapter`; their heads record the target as "<base>+lora:<adapter>"."""
    weights = checkpoint.full_state_dict(engine)
    heads_dir = output_dir / HEADS_SUBDIR
    if peft_model is not None:
        weights, _ = lora_mode.split_state(weights)
        target.model.eval()
    if dist.rank == 0 or partitioned_target:
        config = _heads_config(recipe, target)
        if peft_model is not None:
            adapter_dir = (output_dir / ADAPTER_SUBDIR).resolve()
            config.target = dataclasses.replace(config.target,
                                                name_or_path=f"{config.target.name_or_path}+lora:{adapter_dir}")
        heads = build_heads(config)
        saved = heads.state_dict()  # non-persistent buffers (rotary inv_freq) stay as built
        heads.load_state_dict({k: v for k, v in weights.items() if k in saved})
        heads.to(target.device)
        cal = recipe.calibrate
        config.calibration, config.tree = calibrate(
            heads, head_kind(recipe.heads), target, eval_blocks.input_ids.to(target.device),
            eval_blocks.loss_mask.to(target.device), cal.num_nodes, cal.max_rank, recipe.train.micro_batch_size,
            cal.eval_batches, config.tap_layers, source=eval_blocks.report.source)
        if dist.rank != 0:
            checkpoint.barrier()
            return heads_dir
        if peft_model is not None:
            base = {"name_or_path": recipe.target.name_or_path, "resolved_path": str(Path(target_path).resolve())
                    if Path(target_path).exists() else target_path,
                    "dtype": str(resolve_dtype(recipe.target.dtype, train_device())).removeprefix("torch."),
                    "trust_remote_code": recipe.target.trust_remote_code, "lora": recipe.lora.to_dict()}
            lora_mode.save_adapter(peft_model, output_dir / ADAPTER_SUBDIR, base)
            _say(dist, f"wrote {output_dir / ADAPTER_SUBDIR} (serve the merged target: specheads export "
                       f"{output_dir} --format merged --out DIR)")
        save_heads(heads_dir, heads, config)
        top1 = " ".join(f"{a:.3f}" for a in config.calibration["top1"])
        _say(dist, f"held-out top-1 per head {top1}; tree of {config.tree['num_nodes']} nodes, expected "
                   f"accepted draft tokens per step {config.tree['expected_accept_length']:.3f}")
        _say(dist, f"wrote {heads_dir}")
        tracker.summary({"calibrate/expected_accept_length": config.tree["expected_accept_length"],
                         **{f"calibrate/head{k}_top1": a for k, a in enumerate(config.calibration["top1"])}})
    checkpoint.barrier()
    return heads_dir
