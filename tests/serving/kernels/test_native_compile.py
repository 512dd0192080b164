"""Every Triton kernel in serving/kernels/ compiles natively for sm_80 and sm_90, with no GPU,
as the launcher would run it (triton_kernel.launch_config's choice, bound by the JIT's own
binder to a representative layer's tensors), for fp32, bf16 and fp16 at head dims 64, 96, 128
and 256, and fits the SM's shared memory. The CPU tests run the kernels interpreted, which
cannot see a kernel that breaks only when compiled (serving/kernels/native.py). The compiles
run in one subprocess without TRITON_INTERPRET (about a minute on 2 cores with an empty triton
cache); skipped, with the reason, only when triton has no NVIDIA backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specheads.serving.kernels import native, triton_kernel
from specheads.serving.kernels.tree_attention import SPLIT_MULTIPLE, tree_attention, tree_attention_reference

NO_BACKEND = 3  # native.main's exit code when triton cannot compile for NVIDIA here


@pytest.fixture(scope="module")
def compiled_rows() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "specheads.serving.kernels.native", "--json"], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode == NO_BACKEND:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-3000:]  # a compile error fails here, with triton's message
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("sm", native.SMS)
@pytest.mark.parametrize("dtype", native.DTYPES, ids=native.DTYPE_NAMES.get)
@pytest.mark.parametrize("head_dim", native.HEAD_DIMS)
def test_kernels_compile_for_the_gpu_and_fit_its_shared_memory(compiled_rows, sm, dtype, head_dim):
    name = native.DTYPE_NAMES[dtype]
    rows = {r["kernel"]: r for r in compiled_rows if (r["sm"], r["dtype"], r["head_dim"]) == (sm, name, head_dim)}
    assert sorted(rows) == ["merge", "split"]
    for row in rows.values():
        resources = native.Resources(**row)
        assert resources.shared_ok, (f"{row['kernel']} kernel at {name}, head dim {head_dim} needs "
                                     f"{row['shared']} B of shared memory, over sm_{sm}'s "
                                     f"{native.SHARED_MEMORY_LIMIT[sm]} B")
        assert 0 < resources.registers <= 255 and resources.warps_per_sm > 0
    # Compiled at what the launcher would run on that SM.
    config = triton_kernel.launch_config(head_dim, dtype, sm)
    split, merge = rows["split"], rows["merge"]
    assert (split["blocks"], split["num_warps"], split["num_stages"]) == \
        (f"M{config.block_m} N{config.block_n} D{config.block_d}", config.num_warps, config.num_stages)
    assert merge["blocks"].endswith(f" D{config.block_d}") and merge["num_warps"] == config.merge_num_warps


@pytest.mark.parametrize("sm", [*native.SMS, 86, 100])
@pytest.mark.parametrize("dtype", native.DTYPES, ids=native.DTYPE_NAMES.get)
@pytest.mark.parametrize("head_dim", [16, 32, *native.HEAD_DIMS])
def test_every_configuration_keeps_the_split_rule(sm, dtype, head_dim):
    config = triton_kernel.launch_config(head_dim, dtype, sm)
    assert SPLIT_MULTIPLE % config.block_n == 0  # prefix splits end on a key block boundary
    assert config.block_d >= head_dim and config.block_d & (config.block_d - 1) == 0  # tl.arange: power of 2


def test_the_launcher_runs_launch_config(monkeypatch):
    # One owner: launch() asks launch_config (here at the interpreter's SM) and runs its answer.
    asked = []
    chosen = triton_kernel.LaunchConfig(block_m=16, block_n=16, block_d=32, num_warps=4, num_stages=1,
                                        merge_num_warps=1)

    def spy(head_dim, dtype, sm):
        asked.append((head_dim, dtype, sm))
        return chosen

    monkeypatch.setattr(triton_kernel, "launch_config", spy)
    launched = []
    real_calls = triton_kernel.kernel_calls
    monkeypatch.setattr(triton_kernel, "kernel_calls", lambda *a: launched.append(a[-1]) or real_calls(*a))
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 32, generator=generator)
    k, v = (torch.randn(1, 1, 70, 32, generator=generator) for _ in range(2))
    tree_mask = torch.ones(3, 3, dtype=torch.bool).tril()
    out = tree_attention(q, k, v, 67, tree_mask, impl="triton")
    ref = tree_attention_reference(q, k, v, 67, tree_mask)
    assert asked == [(32, torch.float32, triton_kernel.INTERPRETER_SM)] and launched == [chosen]
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5
