"""Training metrics: stdout always, Weights & Biases when the recipe says `tracking: wandb`.

Only rank 0 reports. wandb is imported lazily, so `tracking: none` never loads it. A
resumed run continues the same W&B run: its id is kept in `<output_dir>/wandb_run_id`.
Offline use follows wandb's own switch (WANDB_MODE=offline).
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

from specheads.heads.heads_dir import atomic_write_text

RUN_ID_FILE = "wandb_run_id"


class Tracker:
    """Prints one line per logged step; subclasses also send the metrics somewhere."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps

    def log(self, step: int, metrics: dict[str, float]) -> None:
        print(format_metrics(step, self.total_steps, metrics), file=sys.stdout, flush=True)

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
                 config: dict, output_dir: Path):
        super().__init__(total_steps)
        import wandb

        id_file = Path(output_dir) / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        atomic_write_text(id_file, run_id + "\n")
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
                 rank: int) -> Tracker:
    if rank != 0:
        return SilentTracker(total_steps)
    if tracking == "wandb":
        return WandbTracker(total_steps, wandb_config.project, wandb_config.entity, wandb_config.run_name,
                            recipe_dict, output_dir)
    return Tracker(total_steps)


def format_metrics(step: int, total_steps: int, metrics: dict[str, float]) -> str:
    """'step 10/100 loss 2.31 | head loss 1.9 2.3 2.6 | top1 0.41 0.22 0.13 | lr 1.0e-03 | 5120 tok/s'"""
    heads = sorted({key.split("/")[1].split("_")[0] for key in metrics if key.startswith("train/head")},
                   key=lambda name: int(name[4:]))
    parts = [f"step {step}/{total_steps} loss {metrics.get('train/loss', float('nan')):.4f}"]
    if heads:
        parts.append("head loss " + " ".join(f"{metrics[f'train/{h}_loss']:.3f}" for h in heads))
        parts.append("top1 " + " ".join(f"{metrics[f'train/{h}_top1']:.3f}" for h in heads))
    if "train/lr" in metrics:
        parts.append(f"lr {metrics['train/lr']:.2e}")
    if "train/tokens_per_s" in metrics:
        parts.append(f"{metrics['train/tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


def step_metrics(head_loss: list[float], head_top1: list[float], lr: float, tokens_per_s: float) -> dict:
    metrics = {"train/loss": sum(head_loss) / len(head_loss), "train/lr": lr, "train/tokens_per_s": tokens_per_s}
    for k, (loss, top1) in enumerate(zip(head_loss, head_top1)):
        metrics[f"train/head{k}_loss"] = loss
        metrics[f"train/head{k}_top1"] = top1
    return metrics
