"""Training metrics: stdout always, Weights & Biases when the recipe says `tracking: wandb`.

Only rank 0 reports. Lines go through a `write` function (training/progress.py: above the
progress bar on a terminal, plain print otherwise); W&B gets the same metrics dict. wandb is
imported lazily, so `tracking: none` never loads it. A resumed run continues the same W&B
run: a fresh run generates an id (new_run_id), every checkpoint manifest stores it as
`wandb_run_id`, and a run resumed from a checkpoint passes the stored id with resume="allow"
to wandb.init. (A run killed before its first checkpoint starts a new W&B run when re-run:
nothing of it was kept either.) Offline use
follows wandb's own switch (WANDB_MODE=offline); the offline run directory's name ends in
the id.
"""

from __future__ import annotations

import uuid
from pathlib import Path


def new_run_id() -> str:
    """A W&B run id (8 lowercase alphanumerics, like wandb.util.generate_id) without importing wandb."""
    return uuid.uuid4().hex[:8]


def _print(line: str) -> None:
    print(line, flush=True)


class Tracker:
    """Writes one line per logged step; subclasses also send the metrics somewhere."""

    def __init__(self, total_steps: int, write=_print):
        self.total_steps, self.write = total_steps, write

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.write(format_metrics(step, self.total_steps, metrics))

    def summary(self, values: dict) -> None:
        """End-of-run values (calibration); printed, not plotted."""

    def finish(self) -> None:
        pass


class SilentTracker(Tracker):
    """What ranks other than 0 get."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass


class WandbTracker(Tracker):
    def __init__(self, total_steps: int, project: str, entity: str | None, run_name: str | None,
                 config: dict, output_dir: Path, run_id: str, write=_print):
        super().__init__(total_steps, write)
        import wandb

        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.run = wandb.init(project=project, entity=entity, name=run_name, config=config,
                              dir=str(output_dir), id=run_id, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        super().log(step, metrics)
        self.run.log(metrics, step=step)

    def summary(self, values: dict) -> None:
        for key, value in values.items():
            self.run.summary[key] = value

    def finish(self) -> None:
        self.run.finish()


def make_tracker(tracking: str, wandb_config, recipe_dict: dict, output_dir: Path, total_steps: int,
                 rank: int, run_id: str | None = None, write=_print) -> Tracker:
    """run_id: the W&B run to continue (from the checkpoint manifest) or to start; write: where
    the lines go (Progress.write)."""
    if rank != 0:
        return SilentTracker(total_steps)
    if tracking == "wandb":
        return WandbTracker(total_steps, wandb_config.project, wandb_config.entity, wandb_config.run_name,
                            recipe_dict, output_dir, run_id or new_run_id(), write)
    return Tracker(total_steps, write)


def format_metrics(step: int, total_steps: int, metrics: dict[str, float]) -> str:
    """'step 10/100 loss 2.31 | head loss 1.9 2.3 2.6 | top1 0.41 0.22 0.13 | lr 1.0e-03 | 5120 loss tok/s
    | ETA 0:03:12', or for eval metrics 'eval step 10/100 | top1 0.40 0.21 0.12 | chain tau est 1.52'."""
    if "eval/chain_tau_estimate" in metrics and "train/loss" not in metrics:
        depths = sorted((key for key in metrics if key.startswith("eval/head")),
                        key=lambda key: int(key[len("eval/head"):].split("_")[0]))
        return (f"eval step {step}/{total_steps} | top1 " + " ".join(f"{metrics[key]:.3f}" for key in depths)
                + f" | chain tau est {metrics['eval/chain_tau_estimate']:.3f}")
    heads = sorted({key.split("/")[1].split("_")[0] for key in metrics if key.startswith("train/head")},
                   key=lambda name: int(name[4:]))
    parts = [f"step {step}/{total_steps} loss {metrics.get('train/loss', float('nan')):.4f}"]
    if heads:
        parts.append("head loss " + " ".join(f"{metrics[f'train/{h}_loss']:.3f}" for h in heads))
        parts.append("top1 " + " ".join(f"{metrics[f'train/{h}_top1']:.3f}" for h in heads))
    if "train/lm_loss" in metrics:
        parts.append(f"lm loss {metrics['train/lm_loss']:.4f}")
    if "train/lr" in metrics:
        parts.append(f"lr {metrics['train/lr']:.2e}")
    if "train/loss_tokens_per_s" in metrics:
        parts.append(f"{metrics['train/loss_tokens_per_s']:.0f} loss tok/s")
    if "train/eta_s" in metrics:
        parts.append(f"ETA {format_duration(metrics['train/eta_s'])}")
    return " | ".join(parts)


def format_duration(seconds: float) -> str:
    """3723.4 -> '1:02:03' (hours may pass 24: '26:00:00')."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def step_metrics(head_loss: list[float], head_top1: list[float], lr: float, progress: dict[str, float]) -> dict:
    """The logged step's metrics; progress: Progress.figures() (loss tok/s, ETA)."""
    metrics = {"train/loss": sum(head_loss) / len(head_loss), "train/lr": lr, **progress}
    for k, (loss, top1) in enumerate(zip(head_loss, head_top1)):
        metrics[f"train/head{k}_loss"] = loss
        metrics[f"train/head{k}_top1"] = top1
    return metrics


def estimated_chain_tau(top1: list[float]) -> float:
    """Expected tokens per target forward for a chain draft of len(top1) tokens:

        tau = 1 + sum_{d=1..D} prod_{i=1..d} p_i

    p_i is depth i's held-out top-1 agreement with the target's greedy token (head i-1 for
    Medusa, draft step i-1 for EAGLE). The 1 is the target's own token; the draft token at
    depth d is accepted only when depths 1..d all agree, approximated by the product of the
    per-depth rates (independence is assumed; p_i is measured given a correct prefix)."""
    tau, run = 1.0, 1.0
    for p in top1:
        run *= p
        tau += run
    return tau


def eval_metrics(top1: list[float]) -> dict:
    metrics = {f"eval/head{k}_top1": p for k, p in enumerate(top1)}
    metrics["eval/chain_tau_estimate"] = estimated_chain_tau(top1)
    return metrics
