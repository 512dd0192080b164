"""`specheads train`: train speculative-decoding heads from a recipe.

    specheads train RECIPE [--profile cpu|gpu] [--set dotted.key=value ...]
    deepspeed --num_gpus 8 --module specheads.train RECIPE [--set ...]
    specheads train RECIPE --dry-run [--world-size N]

RECIPE is a shipped recipe's name (`specheads recipes` lists them: eagle3-llama-3.1-8b-instruct)
or a YAML path; a path that exists wins over a name.

`--dry-run` builds the target and heads on the meta device from the target's config.json
and prints parameter counts, a per-GPU memory estimate and the DeepSpeed JSON, without
loading weights or starting DeepSpeed (training/dry_run.py).

One process trains on one device. On a machine with several GPUs, started without a launcher
(no RANK, LOCAL_RANK or WORLD_SIZE in the environment), `specheads train` does not quietly
use one of them: it stops before loading anything and prints the `deepspeed --num_gpus N
--module specheads.train ...` command that uses all of them (CUDA_VISIBLE_DEVICES=0 picks one).
It does not start that launcher itself: the launcher is where ports, hostfiles and
--include/--exclude are set, and a SIGTERM must reach the ranks, not a wrapper.

The deepspeed launcher adds `--local_rank=N`; it is accepted and ignored (the rank comes
from the environment). User errors (bad recipe, missing target, unusable data, a
checkpoint that does not fit) print one line to stderr and return EXIT_USER_ERROR (2, as
every specheads command; specheads/errors.py); bugs keep their traceback.

SIGTERM (a scheduler's preemption, `kill PID`) stops training cleanly: the step in flight
finishes, a whole checkpoint is saved at that step, a message names it, and the process
exits with EXIT_STOPPED = 75 (EX_TEMPFAIL: "try again"), not 0, so `train && serve`
does not go on without heads. Re-running the same command resumes from that checkpoint.

After a run that finished or stopped cleanly the ranks meet, destroy their process group
(left to the interpreter's exit, gloo's threads can abort a rank that finished) and unlink
their DeepSpeed CPU shared-memory allreduce buffers, which DeepSpeed leaves in /dev/shm
(66 MB a rank a run).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from importlib import resources
from pathlib import Path

from specheads.errors import EXIT_USER_ERROR, UserError

EXIT_STOPPED = 75
DESCRIPTION = "Train heads from a recipe (DeepSpeed)."
# Set by the deepspeed launcher (and torchrun) in every rank's environment.
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`specheads train`'s options, on its own parser and on `specheads`' subcommand."""
    parser.add_argument("recipe", help="a shipped recipe's name (`specheads recipes` lists them) or a recipe YAML")
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


def _parser() -> argparse.ArgumentParser:
    from specheads.options import Parser

    parser = Parser(prog="specheads train", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def shipped_recipes() -> dict[str, Path]:
    """The recipes the package ships (specheads.recipes): name (the file's stem) -> path."""
    files = [entry for entry in resources.files("specheads.recipes").iterdir() if entry.name.endswith(".yaml")]
    return {Path(entry.name).stem: Path(str(entry)) for entry in sorted(files, key=lambda e: Path(e.name).stem)}


def resolve_recipe(name_or_path: str | os.PathLike) -> Path:
    """A recipe file: `name_or_path` itself when it exists, else the shipped recipe of that
    name (with or without .yaml, or as recipes/NAME.yaml: the path in a clone that the shipped
    recipes' own comments use)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_recipes()
    name = path.name.removesuffix(".yaml") if path.parent in (Path("."), Path("recipes")) else None
    if name in shipped:
        return shipped[name]
    raise UserError(f"recipe {str(name_or_path)!r} does not exist: not a file, nor a shipped recipe's name "
                    f"({', '.join(shipped)}; `specheads recipes` lists them)")


def format_recipes() -> str:
    """`specheads recipes`: each shipped recipe's name, head kind and target, one a line."""
    import yaml

    rows = []
    for name, path in shipped_recipes().items():
        raw = yaml.safe_load(path.read_text()) or {}
        heads, lora = raw.get("heads") or {}, " + LoRA" if raw.get("lora") else ""
        rows.append((name, f"{heads.get('kind', 'medusa')}{lora}", (raw.get("target") or {}).get("name_or_path", "")))
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'NAME':<{width}}  {'HEADS':<14}  TARGET"]
    lines += [f"{name:<{width}}  {kind:<14}  {target}" for name, kind, target in rows]
    lines += ["", "train one: specheads train NAME  (check its fit first: --dry-run; print it: specheads recipes NAME)"]
    return "\n".join(lines)


def multi_gpu_command(argv: list[str], num_gpus: int, environ=os.environ) -> str | None:
    """The deepspeed command that trains on all `num_gpus` GPUs, when this process would use
    just one of them: several GPUs and no launcher (LAUNCHER_ENV unset); else None."""
    if num_gpus < 2 or any(name in environ for name in LAUNCHER_ENV):
        return None
    return shlex.join(["deepspeed", "--num_gpus", str(num_gpus), "--module", "specheads.train", *argv])


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


def main(argv: list[str] | None = None, *, single_process: bool = False) -> int:
    """single_process: train in this one process even where several GPUs would be refused
    (`specheads demo`'s small heads)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    from specheads.data.text import DataError
    from specheads.training.checkpoint import CheckpointError
    from specheads.training.config import RecipeError, load_recipe

    try:
        recipe_path = resolve_recipe(args.recipe)
        recipe = load_recipe(recipe_path, args.overrides, profile=args.profile)
        if args.dry_run:
            from specheads.training.dry_run import dry_run

            return dry_run(recipe, recipe_path, args.world_size)
        if not single_process:
            _refuse_one_of_several_gpus(argv)
        from specheads.training.trainer import TrainingStopped, run

        try:
            run(recipe)
        except TrainingStopped as stopped:
            _end_ranks()
            print(f"specheads train: {stopped}", file=sys.stderr, flush=True)
            return EXIT_STOPPED
        _end_ranks()
    except (UserError, RecipeError, DataError, CheckpointError, FileNotFoundError) as err:
        rank = os.environ.get("RANK", "0")
        prefix = "" if os.environ.get("WORLD_SIZE", "1") == "1" else f"[rank {rank}] "
        print(f"specheads train: error: {prefix}{err}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


def _end_ranks() -> None:
    """After a run that finished or stopped cleanly: the process group goes while the interpreter
    is whole (training/distributed.py), then this rank's shared-memory buffer."""
    from specheads.training.distributed import shutdown_distributed

    shutdown_distributed()
    release_shm_buffer()


def _refuse_one_of_several_gpus(argv: list[str]) -> None:
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    command = multi_gpu_command(argv, num_gpus)
    if command is not None:
        raise UserError(f"this machine has {num_gpus} GPUs and one process trains on one; train on all of them "
                        f"with `{command}` (or on one: CUDA_VISIBLE_DEVICES=0 specheads train ...)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
