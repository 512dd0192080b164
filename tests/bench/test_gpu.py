"""On a CUDA GPU (`pytest -m gpu`, off by default): the GPU suite's parity and lossless
sections (bench/gpu_suite.py) at their full sizes, with the Triton kernel compiled, not
interpreted. The whole suite with timings is `python -m specheads.bench.gpu_suite --out DIR`.
"""

from __future__ import annotations

import os

import pytest
import torch

from specheads.bench import gpu_suite

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def ctx():
    assert os.environ.get("TRITON_INTERPRET") != "1", "unset TRITON_INTERPRET: on a GPU the kernel must compile"
    return gpu_suite.make_context(torch.device("cuda"), tiny=False)


def test_kernel_matches_reference_on_cuda(ctx):
    with torch.no_grad():
        result = gpu_suite.section_parity(ctx)
    failed = [row for row in result["rows"] if not row["passed"]]
    assert result["all_passed"] and not failed, failed
    assert {row["dtype"] for row in result["rows"]} == {"float32", "bfloat16", "float16"}


def test_greedy_is_lossless_on_cuda(ctx):
    with torch.no_grad():
        result = gpu_suite.section_lossless(ctx)
    mismatched = [row for row in result["rows"] if row["dtype"] == "float32" and not all(row["identical_per_prompt"])]
    assert result["lossless"] and not mismatched, mismatched
    oracle = next(row for row in result["rows"] if row["decoder"] == "medusa-oracle+kernel")
    assert oracle["tau"] > 1.5  # the kernel path really verified multi-token paths
