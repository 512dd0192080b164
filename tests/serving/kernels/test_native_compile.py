"""Every Triton kernel in serving/kernels/ compiles natively for sm_80 and sm_90, with no GPU,
at the launch configuration the launcher picks (triton_kernel.launch_config), for fp32, bf16
and fp16 at head dims 64, 96, 128 and 256, and fits the SM's shared memory. The CPU tests run
the kernels interpreted, which cannot see a kernel that breaks only when compiled
(serving/kernels/native.py). The compiles run in one subprocess without TRITON_INTERPRET
(about a minute on 2 cores); skipped, with the reason, only when triton has no NVIDIA backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specheads.serving.kernels import native
from specheads.serving.kernels.triton_kernel import launch_config

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
@pytest.mark.parametrize("dtype", native.DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("head_dim", native.HEAD_DIMS)
def test_kernels_compile_for_the_gpu_and_fit_its_shared_memory(compiled_rows, sm, dtype, head_dim):
    name = str(dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16") \
        .replace("float16", "fp16")
    rows = [r for r in compiled_rows if (r["sm"], r["dtype"], r["head_dim"]) == (sm, name, head_dim)]
    assert sorted(r["kernel"] for r in rows) == ["merge", "split"]
    config = launch_config(head_dim, dtype)
    for row in rows:
        resources = native.Resources(**row)
        assert resources.shared_ok, (f"{row['kernel']} kernel at {name}, head dim {head_dim} needs "
                                     f"{row['shared']} B of shared memory, over sm_{sm}'s "
                                     f"{native.SHARED_MEMORY_LIMIT[sm]} B")
        assert 0 < resources.registers <= 255 and resources.occupancy > 0
        if row["kernel"] == "split":  # compiled at what the launcher would run
            assert (row["block_m"], row["num_warps"]) == (config.block_m, config.num_warps)


def test_the_launch_configuration_is_one_function():
    assert launch_config(64, torch.bfloat16).block_m == 32
    assert launch_config(128, torch.bfloat16).block_m == 16  # 32 rows spilled on sm_90
    assert launch_config(96, torch.float16).block_d == 128  # tl.arange needs a power of two
    assert (launch_config(256, torch.float32).block_m, launch_config(256, torch.float32).num_warps) == (16, 8)
