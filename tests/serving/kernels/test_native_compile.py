"""Every Triton kernel in serving/kernels/ compiles natively for sm_80 and sm_90, with no GPU,
as the launcher would run it (triton_kernel.plan's choice, bound by the JIT's own binder to a
representative layer's tensors), for fp32, bf16 and fp16 at head dims 64, 96, 128 and 256,
for a plain step and 16- and 64-node trees (native.cases): it fits the SM's shared memory,
does not spill, and one SM holds as many of its split programs as the split rule counts on
(LaunchConfig.blocks_per_sm). The CPU tests
run the kernels interpreted, which cannot see a kernel that breaks only when compiled
(serving/kernels/native.py). The compiles run in one subprocess without TRITON_INTERPRET
(a few minutes on 2 cores with an empty triton cache); skipped, with the reason, only when
triton has no NVIDIA backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specheads.serving.kernels import native, triton_kernel
from specheads.serving.kernels.tree_attention import tree_attention, tree_attention_reference

NO_BACKEND = 3  # native.main's exit code when triton cannot compile for NVIDIA here


@pytest.fixture(scope="module")
def compiled_rows() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "specheads.serving.kernels.native", "--json"], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode == NO_BACKEND:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-3000:]  # a compile error fails here, with triton's message
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # compiles 72 kernels for sm80/sm90 (about 2 minutes); -m slow runs it
@pytest.mark.parametrize("sm,dtype,head_dim,num_tree", native.cases(),
                         ids=lambda c: native.DTYPE_NAMES[c] if isinstance(c, torch.dtype) else str(c))
def test_kernels_compile_for_the_gpu_and_fit_its_sm(compiled_rows, sm, dtype, head_dim, num_tree):
    name = native.DTYPE_NAMES[dtype]
    rows = {r["kernel"]: r for r in compiled_rows
            if (r["sm"], r["dtype"], r["head_dim"], r["num_tree"]) == (sm, name, head_dim, num_tree)}
    assert sorted(rows) == ["merge", "split"]
    for row in rows.values():
        resources = native.Resources(**row)
        assert resources.shared_ok, (f"{row['kernel']} kernel at {name}, head dim {head_dim} needs "
                                     f"{row['shared']} B of shared memory, over sm_{sm}'s "
                                     f"{native.SHARED_MEMORY_LIMIT[sm]} B")
        assert 0 < resources.registers <= 255 and resources.stack == 0, f"{row['kernel']} spills: {row}"
    # Compiled at what the launcher would run on that SM, which holds the programs the split rule counts.
    rows_per_kv_head = native.LAYER["num_q_heads"] // native.LAYER["num_kv_heads"] * num_tree
    config = triton_kernel.launch_config(head_dim, dtype, sm, rows_per_kv_head)
    split, merge = rows["split"], rows["merge"]
    assert (split["blocks"], split["num_warps"], split["num_stages"]) == \
        (f"M{config.block_m} N{config.block_n} D{config.block_d}", config.num_warps, config.num_stages)
    assert native.Resources(**split).resident_blocks >= config.blocks_per_sm
    assert merge["blocks"].endswith(f" D{config.block_d}") and merge["num_warps"] == config.merge_num_warps


@pytest.mark.parametrize("sm", [*native.SMS, 86, 100])
@pytest.mark.parametrize("dtype", native.DTYPES, ids=native.DTYPE_NAMES.get)
@pytest.mark.parametrize("head_dim", [16, 32, *native.HEAD_DIMS])
@pytest.mark.parametrize("rows", [1, 4, 16, 17, 64, 256, 2048])
def test_every_configuration_is_a_valid_launch(sm, dtype, head_dim, rows):
    config = triton_kernel.launch_config(head_dim, dtype, sm, rows)
    assert config.block_d >= head_dim and config.block_d & (config.block_d - 1) == 0  # tl.arange: power of 2
    assert 16 <= config.block_m <= 128 and config.block_m & (config.block_m - 1) == 0  # tl.dot's least M is 16
    assert config.block_m <= max(16, 2 * rows)  # no block more than half padding
    assert config.block_n in (16, 32, 64) and config.blocks_per_sm >= 1  # tl.dot's least K is 16


def test_the_launcher_runs_launch_config(monkeypatch):
    # One owner: launch() asks launch_config (here at the interpreter's SM) and runs its answer.
    asked = []
    chosen = triton_kernel.LaunchConfig(block_m=16, block_n=16, block_d=32, num_warps=4, num_stages=1,
                                        merge_num_warps=1, blocks_per_sm=1)

    def spy(head_dim, dtype, sm, rows):
        asked.append((head_dim, dtype, sm, rows))
        return chosen

    monkeypatch.setattr(triton_kernel, "launch_config", spy)
    launched = []
    real_calls = triton_kernel.kernel_calls
    monkeypatch.setattr(triton_kernel, "kernel_calls", lambda *a: launched.append(a[-1].config) or real_calls(*a))
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 32, generator=generator)
    k, v = (torch.randn(1, 1, 70, 32, generator=generator) for _ in range(2))
    tree_mask = torch.ones(3, 3, dtype=torch.bool).tril()
    out = tree_attention(q, k, v, 67, tree_mask, impl="triton")
    ref = tree_attention_reference(q, k, v, 67, tree_mask)
    assert asked == [(32, torch.float32, triton_kernel.INTERPRETER_SM, 6)] and launched == [chosen]
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5
