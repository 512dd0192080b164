"""The Triton kernels' launch plan (how the prefix is split to fill a GPU, and that the grid
depends on the bound on S only) and their 16-bit arithmetic: bf16 runs the GPU's rounding
emulated under TRITON_INTERPRET (triton_kernel.DotMode.EMULATED), and is held to the
flash-rounded reference and to SDPA's bf16 error.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from test_tree_attention import make_inputs, random_tree_mask, relative_error, run_triton

from specheads.serving.kernels import triton_kernel
from specheads.serving.kernels.tree_attention import (
    tree_attention,
    tree_attention_flash_reference,
    tree_attention_reference,
)

# Llama-3.1-8B's attention at 8k context, batch 1, on an H100/H200 (132 SMs of sm_90).
LLAMA_8B = dict(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
HOPPER_SMS = 132


def llama_plan(num_tree: int, max_prefix_len: int = 8192, **overrides) -> triton_kernel.LaunchPlan:
    shape = dict(LLAMA_8B, **overrides)
    return triton_kernel.plan(shape["batch"], shape["num_q_heads"], shape["num_kv_heads"], num_tree,
                              shape["head_dim"], shape["dtype"], max_prefix_len, 90, HOPPER_SMS)


def split_programs(launch_plan: triton_kernel.LaunchPlan, batch: int = 1, num_kv_heads: int = 8) -> int:
    return math.prod(launch_plan.split_grid(batch, num_kv_heads))


# --- launch plan ------------------------------------------------------------------------

@pytest.mark.parametrize("num_tree", [1, 16, 64])
def test_batch_one_fills_every_sm_once(num_tree):
    # The old rule gave every T <= 16 the same 264 programs of 64 rows (60 of them padding at
    # T = 1) for 132 one-program SMs; now the split kernel fills every SM's slots once.
    launch_plan = llama_plan(num_tree)
    config = launch_plan.config
    slots = HOPPER_SMS * config.blocks_per_sm
    programs_per_part = launch_plan.row_blocks * 8
    programs = split_programs(launch_plan)
    assert programs <= slots  # one wave: no program waits for a slot
    capped = launch_plan.num_prefix_splits == math.ceil(8192 / triton_kernel.MIN_SPLIT_KEYS)
    assert capped or programs > slots - programs_per_part  # one more split would not fit
    assert config.block_m <= max(16, 2 * 4 * num_tree)  # no block more than half padding


def test_plan_for_the_report():
    # The launch the shapes get (B = 1, Hkv = 8, g = 4, D = 128, bf16, S = 8192, 132 SMs).
    summary = {t: (llama_plan(t).config.block_m, llama_plan(t).row_blocks, llama_plan(t).num_prefix_splits,
                   split_programs(llama_plan(t))) for t in (1, 16, 64)}
    assert summary == {1: (16, 1, 48, 392), 16: (64, 1, 32, 264), 64: (128, 2, 7, 128)}


def test_split_count_depends_on_the_bound_only():
    # A CUDA graph captures the grid at max_prefix_len; the real S grows below it.
    assert llama_plan(16, 4096).num_prefix_splits == llama_plan(16, 4096).num_prefix_splits
    assert llama_plan(1, 100).num_prefix_splits == 1
    assert llama_plan(1, 0).num_prefix_splits == 0
    assert triton_kernel.prefix_splits(300, 4, 4, llama_plan(1).config, split_size=64) == 5
    with pytest.raises(ValueError, match="split_size"):
        triton_kernel.prefix_splits(300, 4, 4, llama_plan(1).config, split_size=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_serves_every_prefix_below_its_bound(dtype, monkeypatch):
    # The graph path: prefix lengths as a device tensor under a fixed bound. The plan is the
    # same for every length, and each length's result is right, including lengths that
    # leave splits without a key (3 keys: one key block for 4 splits) and S = 0.
    plans = []
    real_launch = triton_kernel.launch
    monkeypatch.setattr(triton_kernel, "launch", lambda *a, **kw: plans.append(real_launch(*a, **kw)) or plans[-1])
    bound = 200
    q, k, v, _ = make_inputs(2, 2, 2, 5, bound, 32, dtype, seed=21)
    tree_mask = random_tree_mask(5, torch.Generator().manual_seed(22))
    for lengths in ([0, 3], [17, 64], [130, 199], [bound, 1]):
        out = run_triton(q, k, v, torch.tensor(lengths), tree_mask, max_prefix_len=bound, split_size=50)
        ref = tree_attention_reference(q.float(), k.float(), v.float(), lengths, tree_mask)
        assert relative_error(out, ref) <= (1e-5 if dtype == torch.float32 else 1e-2)
    assert len(plans) == 4 and len(set(plans)) == 1 and plans[0].num_prefix_splits == 4


# --- 16-bit arithmetic ------------------------------------------------------------------

def row_ulps(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in units of the last place of each row's largest |ref| (bf16: 8 bits)."""
    top = ref.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    return (out.float() - ref.float()).abs() / 2.0 ** (torch.floor(torch.log2(top)) - 7)


def sdpa_bf16(q, k, v, prefix_len: int, tree_mask: torch.Tensor) -> torch.Tensor:
    """PyTorch's SDPA on the bf16 inputs (the dense mask, GQA expanded)."""
    num_tree, group = q.shape[2], q.shape[1] // k.shape[1]
    mask = torch.ones(num_tree, prefix_len + num_tree, dtype=torch.bool)
    mask[:, prefix_len:] = tree_mask
    keys, values = (x[:, :, :prefix_len + num_tree].repeat_interleave(group, dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def test_bf16_runs_the_gpu_arithmetic_under_the_interpreter():
    assert triton_kernel.dot_mode(torch.bfloat16) == triton_kernel.DotMode.EMULATED
    assert triton_kernel.dot_mode(torch.float16) == triton_kernel.DotMode.NATIVE
    assert triton_kernel.dot_mode(torch.float32) == triton_kernel.DotMode.EXACT_FP32


# (B, Hkv, g, T, S, D) and a spread of q: 4 makes the softmax peaked, as in a trained model.
BF16_CASES = [(1, 2, 2, 17, 37, 32, 1.0), (2, 1, 4, 3, 300, 16, 1.0), (1, 2, 1, 33, 5, 64, 4.0),
              (1, 2, 4, 64, 500, 64, 4.0), (1, 8, 4, 16, 700, 128, 1.0)]


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: "B{}Hkv{}g{}T{}S{}D{}x{}".format(*c))
def test_bf16_rounds_like_flash_attention(case):
    *shape, spread = case
    q, k, v, tree_mask = make_inputs(*shape, torch.float32, seed=sum(shape))
    q, k, v = (q * spread).bfloat16(), k.bfloat16(), v.bfloat16()
    prefix_len = shape[4]
    out = tree_attention(q, k, v, prefix_len, tree_mask, impl="triton")
    flash = tree_attention_flash_reference(q, k, v, prefix_len, tree_mask)
    exact = tree_attention_reference(q.float(), k.float(), v.float(), prefix_len, tree_mask)
    sdpa = sdpa_bf16(q, k, v, prefix_len, tree_mask)
    # Within an ulp of the flash-rounded reference: p rounded against a running max, not the row's.
    assert row_ulps(out, flash).max() <= 1.0
    # As close to the exact result as SDPA's bf16 output is. Truncating p or the output (the
    # interpreter's own bf16 cast) doubles the error and fails here.
    assert relative_error(out, exact) <= 1.05 * relative_error(sdpa, exact)


def test_flash_reference_is_the_reference_in_fp32():
    q, k, v, tree_mask = make_inputs(1, 2, 2, 9, 40, 32, torch.float32, seed=5)
    assert relative_error(tree_attention_flash_reference(q, k, v, 40, tree_mask),
                          tree_attention_reference(q, k, v, 40, tree_mask)) < 1e-6


def test_bf16_tree_verify_logits_are_as_close_as_sdpas():
    # One tree-verify forward of a bf16 tiny Llama: through the kernel its logits are as close
    # to the same weights run in fp32 as SDPA's are, and nearer SDPA's than either is to fp32.
    import copy

    from test_tree_attention import _prefilled, _tiny_llama

    from specheads.serving.kernels.tree_attention import pack_tree_mask, register_tree_attention

    bf16 = _tiny_llama("sdpa").bfloat16()
    exact, kernel = copy.deepcopy(bf16).float(), copy.deepcopy(bf16)
    kernel.set_attn_implementation(register_tree_attention())
    generator = torch.Generator().manual_seed(8)
    prompt_1S = torch.randint(0, 128, (1, 30), generator=generator)
    tree_mask = random_tree_mask(11, generator)
    tokens_1T = torch.randint(0, 128, (1, 11), generator=generator)
    position_ids = (30 + tree_mask.sum(dim=1) - 1)[None]
    dense = torch.ones(1, 1, 11, 41, dtype=torch.bool)
    dense[0, 0, :, 30:] = tree_mask
    logits = {}
    with torch.no_grad():
        for name, model in (("exact", exact), ("sdpa", bf16), ("kernel", kernel)):
            _, cache = _prefilled(model, prompt_1S)
            extra = dict(tree_mask=pack_tree_mask(tree_mask), prefix_len=30, tree_attention_impl="triton") \
                if name == "kernel" else dict(attention_mask=dense)
            logits[name] = model(tokens_1T, position_ids=position_ids, past_key_values=cache, **extra).logits.float()
    kernel_error, sdpa_error = (relative_error(logits[name], logits["exact"]) for name in ("kernel", "sdpa"))
    assert kernel_error <= 1.1 * sdpa_error
    assert relative_error(logits["kernel"], logits["sdpa"]) < 0.5 * sdpa_error
    assert torch.equal(logits["kernel"].argmax(-1), logits["sdpa"].argmax(-1))
