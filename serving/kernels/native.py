"""The tree-attention kernels compiled for NVIDIA GPUs on a machine without one.

Triton's NVIDIA backend ships `ptxas` and `cuobjdump`: `triton.compile` lowers a `@triton.jit`
kernel to PTX and a cubin for any SM with no GPU present, and `cuobjdump -res-usage` reads
the cubin's registers per thread, stack (spill) bytes and shared memory. The default test
suite compiles every launch configuration that `triton_kernel.launch_config` would pick
(tests/serving/kernels/test_native_compile.py), so a kernel that breaks for the GPU, or
needs more shared memory than an SM has, fails on every CI run, not only when a GPU is
lent; `python -m specheads.bench.gpu_kernels --compile-report` prints the resources.

This compiles the kernels; it never runs them. Under TRITON_INTERPRET=1 (the CPU tests)
`triton.jit` makes interpreted functions, which cannot be compiled, so the test runs this
module in a subprocess without it:

    python -m specheads.serving.kernels.native [--json]
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SMS = (80, 90)  # A100, H100/H200
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # bytes a block may use (opt-in maximum)
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = {80: 64, 90: 64}
HEAD_DIMS = (64, 96, 128, 256)  # the families we claim: Llama/Qwen/Mistral 128, SmolLM2 64, Gemma 256, Phi 96
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON_TYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_SPLIT_INTS = ("stride_qb", "stride_qh", "stride_qt", "stride_qd", "stride_kb", "stride_kh", "stride_kn",
               "stride_kd", "stride_vb", "stride_vh", "stride_vn", "stride_vd", "stride_mb", "stride_mt",
               "num_kv_heads", "num_q_heads", "group", "num_tree", "split_size", "num_prefix_splits")


class NoNvidiaBackend(RuntimeError):
    """The installed triton cannot compile for NVIDIA GPUs here (no backend, ptxas or cuobjdump)."""


@dataclass(frozen=True)
class Resources:
    """What one compiled kernel needs per block and per thread on its SM."""

    kernel: str  # "split" | "merge"
    sm: int
    dtype: str
    head_dim: int
    block_m: int | None  # split kernel only
    num_warps: int
    registers: int  # per thread
    stack: int  # bytes per thread; > 0 means spills (or a call stack)
    shared: int  # bytes per block

    @property
    def shared_ok(self) -> bool:
        return self.shared <= SHARED_MEMORY_LIMIT[self.sm]

    @property
    def blocks_per_sm(self) -> int:
        """Resident blocks per SM, limited by registers, shared memory and warps."""
        threads = 32 * self.num_warps
        by_registers = REGISTERS_PER_SM // max(1, self.registers * threads)
        by_shared = SHARED_MEMORY_LIMIT[self.sm] // self.shared if self.shared else by_registers
        by_warps = MAX_WARPS_PER_SM[self.sm] // self.num_warps
        return max(0, min(by_registers, by_shared, by_warps))

    @property
    def occupancy(self) -> float:
        """Resident warps over the SM's maximum."""
        return self.blocks_per_sm * self.num_warps / MAX_WARPS_PER_SM[self.sm]


def backend_bin(name: str) -> Path:
    """A binary of triton's NVIDIA backend (ptxas, cuobjdump), or NoNvidiaBackend."""
    try:
        import triton.backends.nvidia as nvidia
    except ImportError as err:
        raise NoNvidiaBackend(f"triton has no NVIDIA backend ({err})") from err
    path = Path(nvidia.__file__).parent / "bin" / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            raise NoNvidiaBackend(f"triton's NVIDIA backend has no {name} at {path}, and none is on PATH")
        path = Path(found)
    return path


def _kernels():
    """serving/kernels/triton_kernel.py, refused when TRITON_INTERPRET made its kernels
    interpreted functions (which cannot be compiled: run this in a process without it)."""
    from triton import knobs

    if knobs.runtime.interpret:
        raise NoNvidiaBackend("TRITON_INTERPRET=1 is set: triton.jit made interpreted kernels, which cannot be "
                              "compiled; run `python -m specheads.serving.kernels.native` without it")
    from specheads.serving.kernels import triton_kernel

    return triton_kernel


def _split_source(dtype: torch.dtype, head_dim: int, block_m: int, block_n: int, block_d: int):
    import triton

    triton_kernel = _kernels()
    element = _TRITON_TYPE[dtype]
    signature = {"q_ptr": f"*{element}", "k_ptr": f"*{element}", "v_ptr": f"*{element}", "mask_ptr": "*i32",
                 "prefix_lens_ptr": "*i32", "o_part_ptr": "*fp32", "m_part_ptr": "*fp32", "l_part_ptr": "*fp32",
                 **{name: "i32" for name in _SPLIT_INTS}, "scale": "fp32",
                 **{name: "constexpr" for name in ("HEAD_DIM", "BLOCK_M", "BLOCK_N", "BLOCK_D", "DOT_FP32")}}
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d,
                  "DOT_FP32": dtype == torch.float32}  # what launch() passes on a GPU
    return triton.compiler.ASTSource(fn=triton_kernel._tree_attn_split_kernel, signature=signature,
                                     constexprs=constexprs)


def _merge_source(dtype: torch.dtype, head_dim: int, block_d: int, block_p: int):
    import triton

    triton_kernel = _kernels()
    signature = {"o_part_ptr": "*fp32", "m_part_ptr": "*fp32", "l_part_ptr": "*fp32",
                 "out_ptr": f"*{_TRITON_TYPE[dtype]}",
                 **{name: "i32" for name in ("stride_ob", "stride_oh", "stride_ot", "stride_od", "num_q_heads",
                                             "num_tree", "num_parts")},
                 **{name: "constexpr" for name in ("HEAD_DIM", "BLOCK_P", "BLOCK_D")}}
    return triton.compiler.ASTSource(fn=triton_kernel._tree_attn_merge_kernel, signature=signature,
                                     constexprs={"HEAD_DIM": head_dim, "BLOCK_P": block_p, "BLOCK_D": block_d})


def compile_kernels(sm: int, dtype: torch.dtype, head_dim: int, block_p: int = 32):
    """Both kernels for one SM, dtype and head dim, at the launch configuration
    `triton_kernel.launch_config` picks -> [("split" | "merge", LaunchConfig, CompiledKernel)]."""
    import triton
    from triton.backends.compiler import GPUTarget

    from specheads.serving.kernels.triton_kernel import launch_config

    backend_bin("ptxas")
    config = launch_config(head_dim, dtype)
    target = GPUTarget("cuda", sm, 32)
    split = triton.compile(_split_source(dtype, head_dim, config.block_m, config.block_n, config.block_d),
                           target=target, options={"num_warps": config.num_warps})
    merge = triton.compile(_merge_source(dtype, head_dim, config.block_d, block_p), target=target)
    return [("split", config, split), ("merge", config, merge)]


def resource_usage(compiled) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) of a compiled kernel, from
    `cuobjdump -res-usage` on its cubin."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        cubin = Path(directory) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(backend_bin("cuobjdump")), "-res-usage", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    match = re.search(r"REG:(\d+)\s+STACK:(\d+)", text)
    if match is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no REG/STACK line: {text[:300]!r}")
    return int(match.group(1)), int(match.group(2))


def resources(sm: int, dtype: torch.dtype, head_dim: int) -> list[Resources]:
    """The Resources of both kernels for one SM, dtype and head dim."""
    rows = []
    for name, config, compiled in compile_kernels(sm, dtype, head_dim):
        registers, stack = resource_usage(compiled)
        rows.append(Resources(kernel=name, sm=sm, dtype=_TRITON_TYPE[dtype], head_dim=head_dim,
                              block_m=config.block_m if name == "split" else None,
                              num_warps=compiled.metadata.num_warps, registers=registers, stack=stack,
                              shared=compiled.metadata.shared))
    return rows


def format_report(rows: list[Resources]) -> str:
    """Markdown: one row per compiled kernel."""
    lines = ["| kernel | sm | dtype | head dim | BLOCK_M | warps | regs/thread | stack B | shared KB | "
             "blocks/SM | occupancy | fits |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.kernel} | {r.sm} | {r.dtype} | {r.head_dim} | {r.block_m or '-'} | {r.num_warps} | "
                     f"{r.registers} | {r.stack} | {r.shared / 1024:.1f} | {r.blocks_per_sm} | {r.occupancy:.0%} | "
                     f"{'yes' if r.shared_ok else 'NO: over ' + str(SHARED_MEMORY_LIMIT[r.sm] // 1024) + ' KB'} |")
    return "\n".join(lines)


def all_resources() -> list[Resources]:
    """Every SM x dtype x head dim we claim, at the launcher's configuration."""
    return [row for sm in SMS for dtype in DTYPES for head_dim in HEAD_DIMS for row in resources(sm, dtype, head_dim)]


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="compile the tree-attention kernels for sm_80/sm_90 and report "
                                            "their registers, spills and shared memory")
    p.add_argument("--json", action="store_true", help="one JSON list of rows instead of a table")
    args = p.parse_args(argv)
    try:
        rows = all_resources()
    except NoNvidiaBackend as err:
        print(f"no native NVIDIA compilation here: {err}")
        return 3
    print(json.dumps([asdict(row) for row in rows]) if args.json else format_report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
