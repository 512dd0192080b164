"""Crash-safe training checkpoints for the DeepSpeed engine that trains the heads.

Layout under `<output_dir>/checkpoints/`:

    latest                    text: the name of the newest complete checkpoint
    step-00000040/
        heads.safetensors     full fp32 head weights (gathered from the ZeRO partitions)
        adapter.safetensors   LoRA runs only: the adapter's full fp32 weights (names as in
                              the target model; the frozen base weights are never saved)
        rank-00000.pt         per rank: its optimizer state (its ZeRO partition), loss-scaler
        rank-00001.pt         state and RNG states; tensors and plain values only
        manifest.json         step, sampler position, scheduler and engine counters, world
                              size, ZeRO stage, precision, the recipe, the file list, the
                              adapter flag (true: a LoRA run) and the W&B run id
                              (wandb_run_id) the run logs to

Protocol: every rank writes into `.tmp-step-N/`; after a barrier rank 0 checks that all
files are there, writes the manifest, renames the directory to `step-N` and only then
rewrites `latest` (temp file + rename). So `latest` never names a partial checkpoint, and
a directory that `latest` does not name is never loaded. A checkpoint named by `latest`
that lacks a file is an error, not a silent restart.

Disk space: before writing, each rank compares its part's size (the tensors it saves; rank 0
adds the weights) with the free space where it writes (shutil.disk_usage), and a write that
runs out of space anyway (ENOSPC or EDQUOT from Python, safetensors' "No space left on device",
torch.save's "unexpected pos" / "PytorchStreamWriter failed writing file" while the disk is
full) is caught. Either way every rank raises DiskFullError together (the ranks agree by an
all-reduce where they would otherwise wait at a barrier), its one line naming the directory,
what the checkpoint needs and what is free; the partial checkpoint is removed, and `latest`
still names the last whole checkpoint, so re-running the same command after freeing space
resumes from it exactly.

Loading uses safetensors and `torch.load(weights_only=True)`. DeepSpeed's optimizer
state dicts hold a few Python objects (the loss scaler, ZeRO's stage enum and fragment
maps); they are saved as plain values and restored onto the live optimizer's objects.
Resuming needs the same world size, ZeRO stage and precision as the run that saved.
"""

from __future__ import annotations

import enum
import errno
import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specheads.heads import atomic

CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
WEIGHTS = "heads.safetensors"
ADAPTER_WEIGHTS = "adapter.safetensors"
KEEP_LAST = 2  # complete checkpoints kept on disk
UNSAVED = "<specheads: restored from the live optimizer>"
HEADROOM = 1 << 20  # bytes a checkpoint part needs beyond its tensors (zip, pickle and JSON records)
# What writers say when the disk fills: safetensors (Rust I/O errors), torch.save's zip writer
OUT_OF_SPACE = ("No space left on device", "Disk quota exceeded", "(os error 28)", "(os error 122)")
TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed writing file", "file write failed")


class CheckpointError(RuntimeError):
    """A checkpoint named by `latest` that cannot be resumed from, or one that could not be saved."""


class DiskFullError(CheckpointError):
    """The disk (or quota) ran out while saving a checkpoint; nothing was published and `latest`
    still names the last whole checkpoint. The message is one line."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


# ---------------------------------------------------------------------------- distributed

def _rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


# ---------------------------------------------------------------------------- plain state

def to_plain(obj):
    """A copy of `obj` that torch.load(weights_only=True) can read: tensors, numbers, strings,
    containers. Enums become their values; other objects become the UNSAVED marker."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, enum.Enum):
        return obj.value
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {key: to_plain(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_plain(value) for value in obj)
    return UNSAVED


def from_plain(saved, live):
    """Undo to_plain against the live optimizer's state dict: markers take the live object,
    enum values become the live enum type."""
    if isinstance(saved, str) and saved == UNSAVED:
        return live
    if isinstance(live, enum.Enum):
        return type(live)(saved)
    if isinstance(saved, dict):
        live = live if isinstance(live, dict) else {}
        return {key: from_plain(value, live.get(key)) for key, value in saved.items()}
    if isinstance(saved, (list, tuple)):
        live = live if isinstance(live, (list, tuple)) and len(live) == len(saved) else [None] * len(saved)
        return type(saved)(from_plain(value, other) for value, other in zip(saved, live))
    return saved


def _scaler_state(optimizer) -> dict:
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is None:
        return {}
    return {key: value for key, value in vars(scaler).items() if isinstance(value, (bool, int, float))}


def _rng_state() -> dict:
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(), "python_version": version, "python_state": list(internal),
            "python_gauss": gauss}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python_state"]), state["python_gauss"]))


# ---------------------------------------------------------------------------- weights

def has_adapter(manifest: dict) -> bool:
    """Whether a checkpoint holds a LoRA adapter: its manifest's `adapter` flag. Manifests written
    before the flag existed say it by listing the adapter's weights file."""
    return manifest.get("adapter", ADAPTER_WEIGHTS in manifest["files"])


def trained_state(engine, adapter: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """The trained weights, full fp32 -> (heads state, adapter state or None). Collective under
    ZeRO: every rank must call it. adapter: the engine trains LoRA's JointModel, of which only
    checkpoint_names() are kept, so the frozen base target is never gathered or saved."""
    state = _full_state_dict(engine, engine.module.checkpoint_names() if adapter else None)
    if not adapter:
        return state, None
    from specheads.training.lora import split_state

    return split_state(state)


def _full_state_dict(engine, keep: set[str] | None) -> dict[str, torch.Tensor]:
    """The engine module's full fp32 weights (only the names in `keep` when given)."""
    from deepspeed.utils import safe_get_full_fp32_param

    masters = _unfused_masters(engine.optimizer)
    state = {}
    for name, param in engine.module.named_parameters():
        if keep is not None and name not in keep:
            continue
        full = safe_get_full_fp32_param(param)  # ZeRO 1-3: gathered fp32 master; else None
        if full is None:
            full = masters.get(id(param), param)
        state[name] = full.detach().to("cpu", torch.float32).clone()
    saved = set(engine.module.state_dict(keep_vars=True))  # names only: persistent buffers, no gather
    for name, buffer in engine.module.named_buffers():
        if name in saved and (keep is None or name in keep):
            state[name] = buffer.detach().to("cpu").clone()
    return state


def _unfused_masters(optimizer) -> dict[int, torch.Tensor]:
    """fp32 masters of DeepSpeed's ZeRO-0 fp16/bf16 optimizer, keyed by id(low-precision param)."""
    low, high = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if not low or not high:
        return {}
    return {id(p16): p32 for group16, group32 in zip(low, high) for p16, p32 in zip(group16, group32)}


# ---------------------------------------------------------------------------- save

def save_checkpoint(output_dir: str | os.PathLike, engine, step: int, sampler_state: dict,
                    recipe_dict: dict, precision: str, extra: dict | None = None, adapter: bool = False) -> Path:
    """Collective: all ranks call it at the same step. Returns the checkpoint directory.
    `extra` (JSON values, rank 0's) is merged into the manifest, e.g. the W&B run id.
    adapter: the engine trains a LoRA adapter too (trained_state), saved beside the heads.
    Out of disk space: DiskFullError on every rank (module docstring)."""
    rank, world_size = _rank_world()
    root = Path(output_dir) / CHECKPOINTS_DIR
    name = checkpoint_name(step)
    tmp = root / f".tmp-{name}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    tmp.mkdir(parents=True, exist_ok=True)  # ranks on another node's disk
    heads_weights, adapter_weights = trained_state(engine, adapter)  # collective under ZeRO
    rank_state = {"optimizer": to_plain(engine.optimizer.state_dict()),
                  "loss_scaler": _scaler_state(engine.optimizer), "rng": _rng_state()}
    need = state_bytes(rank_state) + HEADROOM
    if rank == 0:
        need += state_bytes([heads_weights, adapter_weights]) + HEADROOM
    problem = free_space_problem(tmp, need)
    if problem is None:
        problem = _out_of_space(lambda: _torch_save(rank_state, tmp / rank_file(rank), need), tmp, need)
    _stop_if_any_rank_failed(problem, engine, root, name)
    if rank == 0:
        problem = _out_of_space(lambda: _publish(root, name, engine, step, sampler_state, recipe_dict, precision,
                                                 extra, adapter, heads_weights, adapter_weights), tmp, need)
    _stop_if_any_rank_failed(problem, engine, root, name)
    return root / name


def _publish(root: Path, name: str, engine, step: int, sampler_state: dict, recipe_dict: dict, precision: str,
             extra: dict | None, adapter: bool, heads_weights: dict, adapter_weights: dict | None) -> None:
    """Rank 0, after every rank wrote its file: weights, manifest, rename into place, then `latest`."""
    _, world_size = _rank_world()
    tmp, final = root / f".tmp-{name}", root / name
    save_file(heads_weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
    atomic.fsync(tmp / WEIGHTS)
    files = [WEIGHTS] + [rank_file(r) for r in range(world_size)]
    if adapter:
        save_file(adapter_weights, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        atomic.fsync(tmp / ADAPTER_WEIGHTS)
        files.append(ADAPTER_WEIGHTS)
    missing = [f for f in files if not (tmp / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {tmp} is missing {missing} after all ranks wrote; not publishing it")
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    manifest = {
        "step": step, "world_size": world_size, "zero_stage": engine.zero_optimization_stage(),
        "precision": precision, "sampler": sampler_state, "scheduler": scheduler,
        "engine": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                   "skipped_steps": engine.skipped_steps},
        "files": files, "adapter": adapter, "recipe": recipe_dict, **(extra or {}),
    }
    atomic.write_text(tmp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    atomic.fsync(tmp)
    atomic.replace_dir(tmp, final)
    atomic.fsync(root)
    atomic.write_text(root / LATEST, name + "\n")
    _prune(root, keep=name)


def state_bytes(obj) -> int:
    """Bytes of the tensors in `obj` (nested dicts, lists, tuples), each storage counted once:
    what torch.save or safetensors writes, less their few records."""
    storages = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sum(storages.values())


def free_space_problem(directory: Path, need: int) -> str | None:
    """Why `need` bytes will not fit where `directory` is (its filesystem's free space), or None."""
    free = shutil.disk_usage(directory).free
    return None if free >= need else f"needs about {_size(need)} in {directory.parent}, which has {_size(free)} free"


def _torch_save(obj, path: Path, need: int) -> None:
    """torch.save, atomically; its writer's "unexpected pos" while the disk is full becomes ENOSPC
    (judged while the partial file still holds the space it took)."""
    with atomic.temp_path(path) as tmp:
        try:
            torch.save(obj, tmp)
        except RuntimeError as err:
            written = tmp.stat().st_size if tmp.exists() else 0
            if any(marker in str(err) for marker in TORCH_WRITE_FAILED) and \
                    shutil.disk_usage(tmp.parent).free < max(need - written, HEADROOM):
                raise OSError(errno.ENOSPC, f"No space left on device (torch.save: {err})") from err
            raise


def _out_of_space(write, directory: Path, need: int) -> str | None:
    """Run write(); -> None when it wrote, the one-line reason when the disk or quota ran out.
    Any other failure propagates."""
    try:
        write()
    except (OSError, SafetensorError) as err:
        quota = getattr(err, "errno", None) == errno.EDQUOT or "quota" in str(err).lower()
        if getattr(err, "errno", None) not in (errno.ENOSPC, errno.EDQUOT) and \
                not any(marker in str(err) for marker in OUT_OF_SPACE):
            raise
        free = shutil.disk_usage(directory.parent).free
        what = "ran over the disk quota" if quota else "ran out of disk space"
        return (f"{what} while being written (it needs about {_size(need)} in {directory.parent}; {_size(free)} is "
                "free now)")
    return None


def _stop_if_any_rank_failed(problem: str | None, engine, root: Path, name: str) -> None:
    """Collective: raise DiskFullError on every rank when any rank had a problem; rank 0 first
    removes the partial checkpoint so the space it took is free again."""
    if _all_ranks_ok(problem is None, engine):
        return
    rank, _ = _rank_world()
    latest = root / LATEST
    named = latest.read_text().strip() if latest.is_file() else ""
    if rank == 0:
        shutil.rmtree(root / f".tmp-{name}", ignore_errors=True)
        if named != name:  # renamed into place but never named by `latest`
            shutil.rmtree(root / name, ignore_errors=True)
    kept = f"`latest` still names {named}" if named else "there was no earlier checkpoint, so a re-run starts over"
    reason = problem or "could not be written by another rank (out of disk space: see its error line)"
    raise DiskFullError(f"disk full: checkpoint {name} {reason}; it was not saved. Nothing was lost: {kept}. Free "
                        "space there and re-run the same command to resume")


def stop_if_heads_not_written(problem: str | None, engine, heads_dir: Path, output_dir: str | os.PathLike) -> None:
    """Collective, after rank 0 wrote the final heads directory (`problem`: why it could not,
    from write_problem, else None): DiskFullError on every rank, in one line naming what is kept
    (the final checkpoint, from which a re-run of the same command writes the heads), as a
    checkpoint that does not fit does. A barrier for all ranks either way."""
    if _all_ranks_ok(problem is None, engine):
        return
    latest = Path(output_dir) / CHECKPOINTS_DIR / LATEST
    named = latest.read_text().strip() if latest.is_file() else ""
    kept = f"the final checkpoint {named} is kept" if named else "there is no checkpoint, so a re-run starts over"
    reason = problem or "could not be written by rank 0 (out of disk space: see its error line)"
    raise DiskFullError(f"disk full: the heads directory {heads_dir} {reason}; it was not written. Nothing was lost: "
                        f"{kept}. Free space there and re-run the same command to write the heads from it")


def write_problem(write, directory: Path, need: int) -> str | None:
    """Run write() (it writes `directory`, about `need` bytes) -> None when it wrote, the one-line
    reason when the disk or quota ran out; any other failure propagates."""
    return _out_of_space(write, directory, need)


def _all_ranks_ok(ok: bool, engine) -> bool:
    """Whether every rank is ok (one rank alone: `ok`); a barrier for all ranks either way."""
    _, world_size = _rank_world()
    if world_size == 1:
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=getattr(engine, "device", None) or "cpu")
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.item() == 0.0


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def _prune(root: Path, keep: str) -> None:
    complete = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name <= keep)
    for old in complete[:-KEEP_LAST]:
        shutil.rmtree(old, ignore_errors=True)


def clean_partial(output_dir: str | os.PathLike) -> None:
    """Remove temp directories a killed run left behind (rank 0, before training starts)."""
    for tmp in (Path(output_dir) / CHECKPOINTS_DIR).glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- load

def latest_checkpoint(output_dir: str | os.PathLike) -> tuple[Path, dict] | None:
    """(directory, manifest) of the checkpoint `latest` names; None when there is no `latest`."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    directory = root / name
    if not name or not (directory / MANIFEST).is_file():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a complete checkpoint (no {MANIFEST}); "
                              f"delete {root} to start over")
    manifest = json.loads((directory / MANIFEST).read_text())
    missing = [f for f in manifest["files"] if not (directory / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {directory} is missing {missing}; delete {root} to start over")
    return directory, manifest


def load_checkpoint(directory: Path, manifest: dict, engine, heads: torch.nn.Module, precision: str,
                    grad_accum: int, adapter: bool = False) -> None:
    """Restore weights, optimizer, scheduler, engine counters and RNG into `engine` (all ranks).
    heads: the heads inside the engine; adapter: whether this run trains a LoRA adapter too (the
    engine's module is then LoRA's JointModel), which must match the checkpoint's flag."""
    rank, world_size = _rank_world()
    stage = engine.zero_optimization_stage()
    saved = (manifest["world_size"], manifest["zero_stage"], manifest["precision"])
    if saved != (world_size, stage, precision):
        raise CheckpointError(
            f"checkpoint {directory} was written with world size {saved[0]}, ZeRO stage {saved[1]}, precision "
            f"{saved[2]!r}; this run has {world_size}, {stage}, {precision!r}. Resume with the same settings, "
            "or use a new train.output_dir")
    if has_adapter(manifest) != adapter:
        raise CheckpointError(f"checkpoint {directory} was written by a run {'without' if adapter else 'with'} a "
                              f"LoRA adapter; this run has {'one' if adapter else 'none'}. Resume with the same lora "
                              "section, or use a new train.output_dir")
    if stage < 3:  # ZeRO-3 restores its partitioned weights from the optimizer's fp32 partitions
        dtype = next(heads.parameters()).dtype
        weights = load_file(str(directory / WEIGHTS))
        # Only floating tensors take the module's dtype: int64 d2t / bool t2d must stay exact.
        heads.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()})
        if adapter:
            from specheads.training.lora import load_adapter_state

            load_adapter_state(engine.module.target_model, load_file(str(directory / ADAPTER_WEIGHTS)),
                               str(directory / ADAPTER_WEIGHTS))
    per_rank = [torch.load(directory / rank_file(r), map_location="cpu", weights_only=True)
                for r in range(world_size)]
    live = engine.optimizer.state_dict()
    optimizer_states = [from_plain(state["optimizer"], live) for state in per_rank]
    if engine.zero_optimization():
        engine.optimizer.load_state_dict(state_dict_list=optimizer_states, load_optimizer_states=True,
                                         load_from_fp32_weights=True)
    elif engine.bfloat16_enabled() or engine.fp16_enabled():  # not bf16 by autocast: that engine is fp32
        engine.optimizer.load_state_dict(optimizer_states[rank], load_optimizer_states=True)
    else:
        engine.optimizer.load_state_dict(optimizer_states[rank])
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for key, value in per_rank[rank]["loss_scaler"].items():
        setattr(scaler, key, value)
    if engine.lr_scheduler is not None and manifest["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(manifest["scheduler"])
    counters = manifest["engine"]
    engine.global_steps = counters["global_steps"]
    engine.global_samples = counters["global_samples"]
    engine.skipped_steps = counters["skipped_steps"]
    engine.micro_steps = manifest["step"] * grad_accum
    _set_rng_state(per_rank[rank]["rng"])
