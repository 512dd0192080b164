"""Which errors end one sequence and which break the engine.

The engine (serving/decode/engine.py, "Faults") ends a sequence alone when stepping it raises; the
server worker (serving/server/worker.py) keeps serving. Only errors for which that would be
a lie are fatal, the ones after which no step can be trusted:

- the device is lost: `torch.AcceleratorError` (torch >= 2.8), or a RuntimeError carrying a
  CUDA/HIP, cuBLAS, cuDNN or NCCL failure, an illegal memory access or a device-side
  assert. These poison the device context: every later kernel launch fails too.
- out of memory after a retry: `EngineBroken`, raised when a decode step ran out of memory
  (`torch.OutOfMemoryError` or the host's `MemoryError`), the allocator's cache was emptied
  and the same step ran out again.
- a host sync that torch.cuda's sync debug mode "error" refused (the caller asked that a warm
  step wait for the device only where it says so: serving/decode/graphs.py `declared_sync`):
  the step broke that contract for every row.

Everything else is the sequence's own: NaN logits, a drafter bug on one row's hidden
state, a token id outside the vocabulary, a stop-sequence or detokenizer error. A
KeyboardInterrupt or SystemExit is not an `Exception` and is never caught.
"""

from __future__ import annotations

import gc

import torch

_DEVICE_LOST = ("CUDA error", "HIP error", "CUBLAS_STATUS", "cuDNN error", "CUDNN_STATUS", "NCCL error",
                "illegal memory access", "device-side assert", "device lost")
_SYNC_REFUSED = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("error")
OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryError)


class EngineBroken(RuntimeError):
    """The engine cannot step any more (see the module docstring); the server reports unhealthy."""


class SequenceFailed(RuntimeError):
    """A sequence's prefill raised a non-fatal error (the cause is chained): the request was
    valid, the engine failed on it. Never a ValueError, which means the request was refused."""


def is_fatal(err: BaseException) -> bool:
    """True for errors that break the engine, False for those that end one sequence."""
    if isinstance(err, EngineBroken):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(err, accelerator_error):
        return True
    return isinstance(err, RuntimeError) and any(marker in str(err) for marker in _DEVICE_LOST + (_SYNC_REFUSED,))


def rerun_out_of_memory(call, what: str):
    """After `call` ran out of memory once: call() again with the allocator's cache given back;
    out of memory again is EngineBroken (fatal). `what` names the call in that error."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        return call()
    except OUT_OF_MEMORY as err:
        raise EngineBroken(f"out of memory in {what}, again after emptying the allocator's cache: "
                           f"{describe(err)}") from err


def describe(err: BaseException) -> str:
    """One line for a client: the error's type and message."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {message}" if message else type(err).__name__
