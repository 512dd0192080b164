"""The training processes: rank, world and device, the process group, SIGTERM between steps, and
the mean of a per-rank figure over ranks.

Works in one process without a launcher (rank/world default to 0/1) and under
`deepspeed --num_gpus N --module specheads.train RECIPE.yaml`; on CPU ranks the process group
uses the backend DeepSpeed's CPU accelerator names (gloo, or ccl when oneCCL is installed).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch


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
    build_comm_op()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               verbose=False)
    return Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))


def shutdown_distributed() -> None:
    """Wait for every rank, then destroy the process group, while the interpreter is whole.

    Left to the interpreter's teardown, gloo's worker threads can outlive it: a rank that
    finished its run then dies with "terminate called without an active exception" (SIGABRT)
    and the launcher reports the whole run failed. For runs that finished or stopped cleanly
    (every rank gets here); a no-op where no group was started."""
    if not torch.distributed.is_initialized():
        return
    import deepspeed.comm

    if torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
    deepspeed.comm.destroy_process_group()


def build_comm_op() -> None:
    """DeepSpeed's shared-memory comm op (CPU ranks), built here before DeepSpeed asks for it.

    DeepSpeed compiles it on a machine's first run (about a minute) behind torch's FileBaton: a
    `lock` file in the build directory that its holder removes when done. A run killed during the
    build leaves the file, and every later run on the machine waits for it forever. Built here
    under a lock the OS releases when its holder dies, any baton found is one left behind, since
    every run of ours builds under that lock (DeepSpeed then reuses the loaded op): it is removed,
    saying so in one line. Ranks started together build once and the others wait and load it."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from filelock import FileLock
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return  # DeepSpeed does not build it either
    build_dir = Path(_get_build_directory(builder.name, verbose=False))
    with FileLock(str(build_dir) + ".specheads.lock"):
        baton = build_dir / "lock"
        if baton.exists():
            print(f"specheads: removed {baton}, left by a build of DeepSpeed's {builder.name} op that was "
                  "stopped before it finished", file=sys.stderr)
            baton.unlink(missing_ok=True)
        builder.load(verbose=False)


def train_device() -> str:
    """This rank's device as DeepSpeed's accelerator names it ("cuda:N" on GPU ranks, "cpu" on CPU
    ranks). The frozen target and every batch live there; deepspeed.initialize puts the heads there."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def mean_over_ranks(*tensors: torch.Tensor) -> list[torch.Tensor]:
    packed = torch.stack([t.float() for t in tensors])  # [n, K]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(packed)
        packed /= torch.distributed.get_world_size()
    return list(packed)


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
