"""The tree-attention kernels compiled for NVIDIA GPUs on a machine without one.

Triton's NVIDIA backend ships `ptxas` and `cuobjdump`: `triton.compile` lowers a `@triton.jit`
kernel to PTX and a cubin for any SM with no GPU present, and `cuobjdump -res-usage` reads
the cubin's registers per thread, stack (spill) bytes and shared memory. The default test
suite compiles both kernels at the plan `triton_kernel.plan` makes for every SM, dtype and
head dim we claim and a plain step and 16- and 64-node trees (tests/serving/kernels/
test_native_compile.py, a slow test: about two minutes on 2 cores), so a kernel that breaks
for the GPU, needs more shared memory than an SM has, spills, or holds fewer programs per SM
than the split rule counts on (`LaunchConfig.blocks_per_sm`), fails on a machine without a GPU;
`python -m specheads.bench.gpu.kernels --compile-report` prints the resources.

What is compiled is what would run: the launcher's own `kernel_calls` on meta tensors of a
representative layer (LAYER), specialised by the JIT's own binder for the target SM. The
JIT turns strides equal to 1 into constants and marks multiples of 16 as aligned, which
vectorises the K/V loads; a signature of plain i32s compiles another kernel with far more
registers (bf16 at head dim 128 on sm_90: 248 against 98, measured on an earlier kernel).

This compiles the kernels; it never runs them. Under TRITON_INTERPRET=1 (the CPU tests)
`triton.jit` makes interpreted functions when triton_kernel.py is imported, and those cannot
be compiled, so the test runs this module in a subprocess without it:

    python -m specheads.serving.kernels.native [--json]
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SMS = (80, 90)  # A100, H100/H200
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # bytes one block may use (opt-in maximum)
SHARED_MEMORY_PER_SM = {80: 164 * 1024, 90: 228 * 1024}  # of which each resident block reserves 1 KB
REGISTERS_PER_SM = 65536  # allocated per warp in units of 256
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
HEAD_DIMS = (64, 96, 128, 256)  # the families we claim: SmolLM2 64, Phi-3 96, Llama/Qwen/Mistral 128, Gemma 256
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# The layer the calls are built for: Llama-3.1-8B's heads at 8k context, batch 1, on a
# 132-SM GPU (H100/H200 SXM), for a plain decode step and 16- and 64-node trees, which
# between them take every BLOCK_M the launcher picks at g = 4 (16, 64, and 128 on sm_90).
LAYER = dict(batch=1, num_q_heads=32, num_kv_heads=8, prefix_len=8192)
TREES = (1, 16, 64)
NUM_SMS = 132


def cases(sms=SMS, dtypes=DTYPES, head_dims=HEAD_DIMS, trees=TREES) -> list[tuple[int, torch.dtype, int, int]]:
    """(sm, dtype, head dim, T) to compile: every SM, head dim and tree size in fp32 and bf16;
    fp16, which compiles as bf16 does (the same registers and shared memory in every row of
    a full report), at T = 16 only, which keeps the test's compile count near 100. The
    arguments narrow it (the GPU suite's check on one machine)."""
    return [(sm, dtype, head_dim, num_tree) for sm in sms for dtype in dtypes for head_dim in head_dims
            for num_tree in trees if dtype != torch.float16 or num_tree == 16 or dtypes != DTYPES]


class NoNvidiaBackend(RuntimeError):
    """The installed triton cannot compile for NVIDIA GPUs here (no backend, ptxas or cuobjdump)."""


@dataclass(frozen=True)
class Resources:
    """What one compiled kernel needs per block and per thread on its SM, and what that lets
    one SM hold at once."""

    kernel: str  # "split" | "merge"
    sm: int
    num_tree: int
    dtype: str
    head_dim: int
    blocks: str  # the kernel's block sizes, e.g. "M64 N32 D128" or "P64 D128"
    num_warps: int
    num_stages: int
    registers: int  # per thread
    stack: int  # bytes per thread; > 0 means spills (the kernels make no calls)
    shared: int  # bytes per block

    @property
    def shared_ok(self) -> bool:
        return self.shared <= SHARED_MEMORY_LIMIT[self.sm]

    def blocks_per_sm(self) -> dict[str, int]:
        """Resident blocks per SM as each resource limits them."""
        registers_per_warp = -(-self.registers * 32 // 256) * 256
        return {"registers": REGISTERS_PER_SM // registers_per_warp // self.num_warps,
                "shared": SHARED_MEMORY_PER_SM[self.sm] // (self.shared + 1024),
                "warps": min(MAX_WARPS_PER_SM // self.num_warps, MAX_BLOCKS_PER_SM)}

    @property
    def resident_blocks(self) -> int:
        """Blocks one SM holds at once: the least the resources allow."""
        return min(self.blocks_per_sm().values())

    @property
    def warps_per_sm(self) -> int:
        """Resident warps per SM (occupancy is this over MAX_WARPS_PER_SM)."""
        return self.resident_blocks * self.num_warps

    @property
    def limited_by(self) -> str:
        limits = self.blocks_per_sm()
        return min(limits, key=limits.get)


def problems(row: Resources) -> list[str]:
    """What is wrong with one compiled kernel at the launcher's configuration ([]: it fits):
    its shared memory is over the SM's, it spills, or (the split kernel) one SM holds fewer
    of its programs than the split rule counts on (LaunchConfig.blocks_per_sm)."""
    found = []
    if not row.shared_ok:
        found.append(f"{row.shared} B of shared memory, over sm_{row.sm}'s {SHARED_MEMORY_LIMIT[row.sm]} B")
    if row.stack or not 0 < row.registers <= 255:
        found.append(f"spills: {row.registers} registers, {row.stack} B of stack")
    if row.kernel == "split":
        dtype = next(dtype for dtype, name in DTYPE_NAMES.items() if name == row.dtype)
        rows_per_kv_head = LAYER["num_q_heads"] // LAYER["num_kv_heads"] * row.num_tree
        config = _kernel_module().launch_config(row.head_dim, dtype, row.sm, rows_per_kv_head)
        if row.resident_blocks < config.blocks_per_sm:
            found.append(f"{row.resident_blocks} resident programs per SM ({row.limited_by}), the split rule counts "
                         f"on {config.blocks_per_sm}")
    return found


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


def _kernel_module():
    """serving/kernels/triton_kernel.py, refused when TRITON_INTERPRET made its kernels
    interpreted functions."""
    from triton import knobs

    if knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET=1 is set: triton.jit made interpreted kernels, which cannot be "
                           "compiled; run `python -m specheads.serving.kernels.native` without it")
    from specheads.serving.kernels import triton_kernel

    return triton_kernel


def representative_calls(sm: int, dtype: torch.dtype, head_dim: int, num_tree: int):
    """(LaunchPlan, (split, merge) KernelCalls) that the launcher would make for LAYER with a
    `num_tree`-node tree at this head dim and dtype on sm_`sm`, built on meta tensors in the
    layouts the engine passes: q a transposed view of [B, T, Hq, D], K/V a [B, Hkv, S+T, D]
    cache, the prefix lengths a [B] tensor (the CUDA-graph path)."""
    kernels = _kernel_module()
    batch, prefix_len = LAYER["batch"], LAYER["prefix_len"]
    meta = dict(device="meta", dtype=dtype)
    q = torch.empty(batch, num_tree, LAYER["num_q_heads"], head_dim, **meta).transpose(1, 2)
    k, v = (torch.empty(batch, LAYER["num_kv_heads"], prefix_len + num_tree, head_dim, **meta) for _ in range(2))
    packed_mask = torch.empty(1, num_tree, -(-num_tree // 32), device="meta", dtype=torch.int32)
    prefix_lens = torch.empty(batch, device="meta", dtype=torch.long)
    out = torch.empty(batch, num_tree, LAYER["num_q_heads"], head_dim, **meta).transpose(1, 2)
    launch_plan = kernels.plan(batch, LAYER["num_q_heads"], LAYER["num_kv_heads"], num_tree, head_dim, dtype,
                               prefix_len, sm, NUM_SMS)
    calls = kernels.kernel_calls(q, k, v, packed_mask, prefix_lens, prefix_len, head_dim ** -0.5, out, launch_plan)
    return launch_plan, calls


def compile_call(call, sm: int):
    """Compile one KernelCall for sm_`sm` as `kernel[grid](...)` would on that GPU: the JIT's
    binder specialises the arguments (triton.runtime.jit's JITFunction.run, minus the launch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend_bin("ptxas")
    target = GPUTarget("cuda", sm, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(call.kernel.signature, call.kernel.params, backend)
    bound_args, specialization, options = binder(*call.args, **call.meta)
    options, signature, constexprs, attrs = call.kernel._pack_args(backend, call.meta, bound_args, specialization,
                                                                   options)
    source = triton.compiler.ASTSource(call.kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def resource_usage(compiled) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) of a compiled kernel, from
    `cuobjdump -res-usage` on its cubin."""
    with tempfile.TemporaryDirectory() as directory:
        cubin = Path(directory) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(backend_bin("cuobjdump")), "-res-usage", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    match = re.search(r"REG:(\d+)\s+STACK:(\d+)", text)
    if match is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no REG/STACK line: {text[:300]!r}")
    return int(match.group(1)), int(match.group(2))


def call_resources(call, sm: int, dtype: torch.dtype, num_tree: int) -> Resources:
    """Compile one call for sm_`sm` and read its resources."""
    compiled = compile_call(call, sm)
    registers, stack = resource_usage(compiled)
    blocks = " ".join(f"{name.removeprefix('BLOCK_')}{value}" for name, value in call.meta.items()
                      if name.startswith("BLOCK_"))
    return Resources(kernel=call.name, sm=sm, num_tree=num_tree, dtype=DTYPE_NAMES[dtype],
                     head_dim=call.meta["HEAD_DIM"],
                     blocks=blocks, num_warps=compiled.metadata.num_warps, num_stages=compiled.metadata.num_stages,
                     registers=registers, stack=stack, shared=compiled.metadata.shared)


def all_resources(**narrow) -> list[Resources]:
    """Both kernels at the launcher's plan for every case in `cases(**narrow)`."""
    return [call_resources(call, sm, dtype, num_tree) for sm, dtype, head_dim, num_tree in cases(**narrow)
            for call in representative_calls(sm, dtype, head_dim, num_tree)[1]]


def format_report(rows: list[Resources]) -> str:
    """Markdown: one row per compiled kernel."""
    lines = ["| kernel | sm | T | dtype | head dim | blocks | warps | stages | regs/thread | stack B | shared KB | "
             "blocks/SM | warps/SM | limited by | fits |",
             "|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        fits = "yes" if r.shared_ok else f"NO: over {SHARED_MEMORY_LIMIT[r.sm] // 1024} KB"
        lines.append(f"| {r.kernel} | {r.sm} | {r.num_tree} | {r.dtype} | {r.head_dim} | {r.blocks} | {r.num_warps} | "
                     f"{r.num_stages} | {r.registers} | {r.stack} | {r.shared / 1024:.1f} | {r.resident_blocks} | "
                     f"{r.warps_per_sm} | "
                     f"{r.limited_by} | {fits} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the report (or --json rows); exit 3, with the reason, when triton cannot compile
    for NVIDIA here."""
    import argparse

    p = argparse.ArgumentParser(description="compile the tree-attention kernels for sm_80/sm_90 and report "
                                            "their registers, spills, shared memory and occupancy")
    p.add_argument("--json", action="store_true", help="one JSON list of rows instead of a table")
    p.add_argument("--sms", help="comma-separated SMs (default: 80,90)")
    p.add_argument("--dtypes", help="comma-separated fp32, bf16, fp16 (default: all)")
    p.add_argument("--head-dims", help="comma-separated head dims (default: 64,96,128,256)")
    p.add_argument("--trees", help="comma-separated tree sizes (default: 1,16,64)")
    p.add_argument("--check", action="store_true", help="add each row's problems (native.problems) to the JSON")
    args = p.parse_args(argv)
    names = {name: dtype for dtype, name in DTYPE_NAMES.items()}
    narrow = {key: tuple(parse(v) for v in value.split(",")) for key, value, parse in (
        ("sms", args.sms, int), ("dtypes", args.dtypes, names.__getitem__), ("head_dims", args.head_dims, int),
        ("trees", args.trees, int)) if value}
    try:
        rows = all_resources(**narrow)
    except NoNvidiaBackend as err:
        print(f"no native NVIDIA compilation here: {err}")
        return 3
    if args.json:
        print(json.dumps([dict(asdict(row), **({"problems": problems(row)} if args.check else {})) for row in rows]))
    else:
        print(format_report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
