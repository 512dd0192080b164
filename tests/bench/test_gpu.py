"""On a CUDA GPU (`pytest -m gpu`, off by default): the GPU suite's parity and lossless
sections (bench/gpu/suite.py) at their full sizes, with the Triton kernel compiled, not
interpreted; the compiled GPU decoder (heads/target/gpu_decoder.py) captured in a CUDA graph as the
engine captures it; a peaked random target of SmolLM2's shape decided beyond bf16 rounding.
The whole suite with timings is bench/gpu/run.sh (`python -m specheads.bench.gpu.suite`).
"""

from __future__ import annotations

import os

import pytest
import torch

from specheads.bench.gpu import suite as gpu_suite

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
    fp32 = {row["decoder"]: row for row in result["rows"] if row["dtype"] == "float32"}
    for name in ("medusa-oracle+kernel", "medusa-oracle+kernel+graphs+compiled"):
        assert fp32[name]["tau"] > 1.5, name  # the kernel path really verified multi-token paths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_forward_replays_in_a_cuda_graph(ctx, dtype):
    """The compiled forward captured over the static cache: its replay gives what it gives
    eagerly, and what the model's own forward gives (fp32: to rounding; bf16: to bf16's)."""
    from specheads.bench.gpu.models import adapters, prefilled_cache, random_llama, verify_call
    from specheads.serving.decode.graphs import capture

    forwards = adapters(ctx, random_llama(gpu_suite.LLAMA_TINY | dict(hidden_size=128), ctx.device, dtype))
    cache = prefilled_cache(forwards["hf"], 2, 40, 17)
    with torch.inference_mode():
        own = verify_call(forwards["hf"], cache, 16, "tree")().float()
        call = verify_call(forwards["compiled"], cache, 16, "tree")
        eager = call().float()
        graph, logits = capture(call, ctx.device)
        graph.replay()
    assert forwards["compiled"].gpu.compiles  # it compiled, and was captured compiled
    torch.testing.assert_close(logits.float(), eager, atol=0, rtol=0)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(eager, own, atol=tolerance * own.abs().max().item(), rtol=0)


def test_peaked_target_is_decided_beyond_bf16_rounding(ctx):
    from specheads.bench.gpu.models import peaked_llama

    with torch.no_grad():
        peaked = peaked_llama(ctx, gpu_suite.SMOLLM2_SHAPE)
    assert peaked.stats["decided_share"] >= 0.95 and peaked.stats["argmax_agreement"] >= 0.95, peaked.stats
