"""`specheads train`: train speculative-decoding heads from a recipe.

    python -m specheads.train RECIPE.yaml [--profile cpu|gpu] [--set dotted.key=value ...]
    deepspeed --num_gpus 2 --module specheads.train RECIPE.yaml [--set ...]
    python -m specheads.train RECIPE.yaml --dry-run [--world-size N]

`--dry-run` builds the target and heads on the meta device from the target's config.json
and prints parameter counts, a per-GPU memory estimate and the DeepSpeed JSON, without
loading weights or starting DeepSpeed (training/dry_run.py).

The deepspeed launcher adds `--local_rank=N`; it is accepted and ignored (the rank comes
from the environment). User errors (bad recipe, missing target, unusable data, a
checkpoint that does not fit) print one line to stderr and return EXIT_USER_ERROR (2, as
every specheads command; specheads/errors.py); bugs keep their traceback.

SIGTERM (a scheduler's preemption, `kill PID`) stops training cleanly: the step in flight
finishes, a whole checkpoint is saved at that step, a message names it, and the process
exits with EXIT_STOPPED = 75 (EX_TEMPFAIL: "try again"), not 0, so `train && serve`
does not go on without heads. Re-running the same command resumes from that checkpoint.

After a run that finished or stopped cleanly each rank unlinks its DeepSpeed CPU
shared-memory allreduce buffer, which DeepSpeed leaves in /dev/shm (66 MB a rank a run).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from specheads.errors import EXIT_USER_ERROR

EXIT_STOPPED = 75


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specheads train", description="Train heads from a recipe (DeepSpeed).")
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny-medusa.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe value by its dotted key, e.g. --set train.steps=10 (repeatable)")
    parser.add_argument("--profile", default="auto",
                        help="the recipe profile to apply (e.g. cpu, gpu); auto: gpu when CUDA is available")
    parser.add_argument("--dry-run", action="store_true",
                        help="print parameter counts, a per-GPU memory estimate and the DeepSpeed config; "
                             "load no weights, start nothing")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="GPUs for the --dry-run estimate (default: WORLD_SIZE, else the recipe's launch line)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def release_shm_buffer() -> None:
    """Unlink this rank's /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>.

    DeepSpeed's CPU comm (ops/csrc/cpu/comm/shm.cpp) creates one per rank when the process
    group starts and never unlinks it, so every multi-rank CPU run left 66 MB a rank in
    /dev/shm until it was full. Every rank maps every buffer while the group starts, and a
    mapping outlives its name, so after a run that got past its first collective this is
    safe; a run that failed earlier keeps its buffers (a peer may still be opening them).
    """
    port, rank = os.environ.get("MASTER_PORT"), os.environ.get("RANK")
    if port is None or rank is None:
        return
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_{port}_{rank}"
    with contextlib.suppress(FileNotFoundError):
        (Path("/dev/shm") / name).unlink()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    from specheads.data.text import DataError
    from specheads.training.checkpoint import CheckpointError
    from specheads.training.config import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides, profile=args.profile)
        if args.dry_run:
            from specheads.training.dry_run import dry_run

            return dry_run(recipe, args.recipe, args.world_size)
        from specheads.training.trainer import TrainingStopped, run

        try:
            run(recipe)
        except TrainingStopped as stopped:
            release_shm_buffer()
            print(f"specheads train: {stopped}", file=sys.stderr, flush=True)
            return EXIT_STOPPED
        release_shm_buffer()
    except (RecipeError, DataError, CheckpointError, FileNotFoundError) as err:
        rank = os.environ.get("RANK", "0")
        prefix = "" if os.environ.get("WORLD_SIZE", "1") == "1" else f"[rank {rank}] "
        print(f"specheads train: error: {prefix}{err}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
