"""The CPU's fast dtype and packed linear weights (heads/target/cpu_layout.py): the packed path gives
the unpacked logits within the dtype's tolerance, `plain_weights()` really runs the original
layers, and "auto" picks fp32 on a CPU without native bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specheads.heads.target import cpu_gemm, cpu_layout
from specheads.heads.target.cpu_decoder import auto_dtype
from specheads.heads.target.cpu_layout import PackedLinear, pack_linears
from specheads.heads.target.adapter import TargetAdapter, resolve_dtype

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
# Max |logit difference| allowed between the packed and the plain layout: fp32 sums in another
# order (about 1e-5 relative); bf16 rounds its outputs to 8 bits of mantissa (about 1e-2 relative).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _logits(target: TargetAdapter, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return target(input_ids, []).logits.float()


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_logits_match_the_plain_layout(tiny_llama_dir, dtype):
    plain = TargetAdapter.from_pretrained(tiny_llama_dir, dtype=dtype)
    packed = TargetAdapter.from_pretrained(tiny_llama_dir, dtype=dtype, pack_weights=True)
    assert plain.layout == "plain" and packed.layout == "packed"
    num_linears = sum(type(m) is nn.Linear for m in plain.model.modules())
    # q, k, v, gate and up run fused (heads/target/cpu_decoder.py), packed there; the rest packed here.
    assert packed.packed.num_packed + packed.fused.num_fused == num_linears > 0
    assert sum(type(m) is nn.Linear for m in packed.model.modules()) == packed.fused.num_fused
    input_ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    expected, got = _logits(plain, input_ids), _logits(packed, input_ids)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= TOLERANCE[dtype] * scale
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@needs_onednn
def test_plain_weights_runs_the_original_layers_and_packs_again(tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir, pack_weights=True)
    lm_head = target.model.lm_head
    assert isinstance(lm_head, PackedLinear)
    assert lm_head.weight is target.lm_head().weight  # heads read the shared Parameter
    with target.plain_weights():
        assert type(target.model.lm_head) is nn.Linear
        assert target.model.lm_head.weight is lm_head.weight
        assert not any(isinstance(m, PackedLinear) for m in target.model.modules())
    assert target.model.lm_head is lm_head
    # The state dict keeps transformers' names: nothing of the packed layout leaks into it.
    unpacked = TargetAdapter.from_pretrained(tiny_llama_dir)
    assert set(target.model.state_dict()) == set(unpacked.model.state_dict())


def test_auto_packs_only_where_it_applies(tiny_llama_dir):
    assert TargetAdapter.from_pretrained(tiny_llama_dir, dtype="float16", pack_weights="auto").layout == "plain"
    expected = "packed" if torch.backends.mkldnn.is_available() else "plain"
    assert TargetAdapter.from_pretrained(tiny_llama_dir, dtype="float32", pack_weights="auto").layout == expected
    with pytest.raises(ValueError, match="pack_weights must be True, False or 'auto'"):
        TargetAdapter.from_pretrained(tiny_llama_dir, pack_weights="yes")


def test_packing_refuses_a_model_that_trains():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="frozen inference models"):
        pack_linears(model)


def test_auto_dtype_follows_the_cpu(monkeypatch):
    monkeypatch.setattr(cpu_layout, "cpu_has_native_bf16", lambda: False)
    assert auto_dtype("cpu") is torch.float32
    assert resolve_dtype("auto", "cpu") is torch.float32
    monkeypatch.setattr(cpu_layout, "cpu_has_native_bf16", lambda: True)
    assert auto_dtype("cpu") is torch.bfloat16
    assert resolve_dtype("auto") is torch.bfloat16
    assert auto_dtype("cuda") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        resolve_dtype("half-ish")


def test_auto_dtype_loads_fp32_without_native_bf16(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(cpu_layout, "cpu_has_native_bf16", lambda: False)
    assert TargetAdapter.from_pretrained(tiny_llama_dir, dtype="auto").dtype is torch.float32


class _Attention(nn.Module):
    """What transformers' SDPA function reads from an attention module."""

    def __init__(self, group: int):
        super().__init__()
        self.num_key_value_groups = group
        self.is_causal = True


@pytest.fixture(params=["kernel", "bmm"])
def attention_path(request, monkeypatch):
    """Both ways the grouped attention computes: the ragged C kernel (heads/target/cpu_attention.py)
    where it builds, and the bucketed bmm path it falls back to."""
    from specheads.heads.target import cpu_attention

    if request.param == "kernel" and not cpu_attention.available():
        pytest.skip("no C compiler on this machine")
    if request.param == "bmm":
        monkeypatch.setattr(cpu_attention, "supports", lambda *args: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,num_new", [(1, 5), (3, 1), (3, 4), (1, 1)])
def test_grouped_attention_matches_sdpa(dtype, batch, num_new, attention_path):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    generator = torch.Generator().manual_seed(batch * 10 + num_new)
    num_q_heads, num_kv_heads, head_dim, num_keys = 6, 2, 16, 20
    query = torch.randn(batch, num_new, num_q_heads, head_dim, generator=generator).to(dtype).transpose(1, 2)
    key, value = (torch.randn(batch, num_kv_heads, num_keys, head_dim, generator=generator).to(dtype)
                  for _ in range(2))
    # Each row sees its own prefix (rows of different lengths, as in a batch) plus a causal block.
    lens = torch.tensor([7, 12, 15][:batch])
    key_K = torch.arange(num_keys)
    offset = key_K - lens[:, None]
    new_BTK = (offset[:, None, :] >= 0) & (offset[:, None, :] <= torch.arange(num_new)[None, :, None])
    mask = ((key_K < lens[:, None])[:, None, :] | new_BTK)[:, None]  # [B, 1, T, K]
    module = _Attention(num_q_heads // num_kv_heads)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    got, _ = cpu_layout.grouped_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert got.shape == expected.shape == (batch, num_new, num_q_heads, head_dim)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    if num_new == 1:  # one token, no mask: every key (a decode step over a cache cut to its row)
        expected, _ = sdpa_attention_forward(module, query, key[:, :, :9], value[:, :, :9], None, scaling=0.25)
        got, _ = cpu_layout.grouped_attention_forward(module, query, key[:, :, :9], value[:, :, :9], None,
                                                      scaling=0.25)
        torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("num_new", [1, 3])
def test_grouped_attention_of_ragged_rows_matches_sdpa(num_new, attention_path):
    """Rows of lengths far apart, in no order (several buckets), one of them a padded row,
    and the scratch reused by a second, shorter call."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    generator = torch.Generator().manual_seed(num_new)
    batch, num_q_heads, num_kv_heads, head_dim, num_keys = 25, 4, 2, 8, 4000
    lens = torch.randint(1, num_keys - num_new, (batch,), generator=generator)
    key_K = torch.arange(num_keys)
    offset = key_K - lens[:, None]
    new_BTK = (offset[:, None, :] >= 0) & (offset[:, None, :] <= torch.arange(num_new)[None, :, None])
    mask = ((key_K < lens[:, None])[:, None, :] | new_BTK)[:, None]  # [B, 1, T, K]
    assert len(cpu_layout._row_buckets(mask)) > 1
    module = _Attention(num_q_heads // num_kv_heads)
    for num in (num_keys, num_keys - 50):  # the second call: a shorter key view of the same mask
        query = torch.randn(batch, num_new, num_q_heads, head_dim, generator=generator).transpose(1, 2)
        key, value = (torch.randn(batch, num_kv_heads, num_keys, head_dim, generator=generator)[:, :, :num]
                      for _ in range(2))
        visible = mask[..., :num].clone()
        visible[4] = False  # a padded row: finite, whatever it holds
        expected, _ = sdpa_attention_forward(module, query, key, value, visible, scaling=0.3)
        got, _ = cpu_layout.grouped_attention_forward(module, query, key, value, visible, scaling=0.3)
        rows = torch.arange(batch) != 4
        torch.testing.assert_close(got[rows], expected[rows], atol=1e-5, rtol=1e-5)
        assert torch.isfinite(got).all()


def test_grouped_attention_gives_a_padded_row_no_nan(attention_path):
    query = torch.randn(2, 4, 3, 8)
    key = value = torch.randn(2, 2, 5, 8)
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    mask[1] = False  # a batch row with nothing to attend to
    out, _ = cpu_layout.grouped_attention_forward(_Attention(2), query, key, value, mask)
    assert torch.isfinite(out).all()


@needs_onednn
def test_packing_swaps_sdpa_for_grouped_attention_and_plain_restores_it(tiny_llama_dir):
    target = TargetAdapter.from_pretrained(tiny_llama_dir, pack_weights=True)
    assert target.model.config._attn_implementation == cpu_layout.CPU_ATTENTION
    with target.plain_weights():
        assert target.model.config._attn_implementation == "sdpa"
    assert target.model.config._attn_implementation == cpu_layout.CPU_ATTENTION


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_packed_for_inference_share_weights_and_give_the_same_drafts(tiny_llama_dir, dtype):
    from test_eagle3 import random_head

    from specheads.heads.target.cpu_layout import packed_for_inference

    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    head, _ = random_head(target, seed=4)
    head = head.to(dtype)
    packed = packed_for_inference(head)
    kinds = (PackedLinear, cpu_gemm.PackedBf16Module)
    packs = cpu_layout.reorders(dtype) or cpu_gemm.available()  # oneDNN's layout, else the AVX2 kernel's
    assert any(isinstance(m, kinds) for m in packed.modules()) == packs
    assert not any(isinstance(m, kinds) for m in head.modules())  # the original still trains
    originals = dict(head.named_parameters())
    for name, param in packed.named_parameters():
        assert param is originals[name]  # shared, not copied
    assert packed.d2t is head.d2t
    generator = torch.Generator().manual_seed(0)
    taps = torch.randn(1, 6, 3 * target.hidden_size, generator=generator).to(dtype)
    embeds = torch.randn(1, 6, target.hidden_size, generator=generator).to(dtype)
    positions = torch.arange(6)[None]
    with torch.no_grad():
        want = head.logits(head.step(embeds, head.fuse(taps), positions)[0]).float()
        got = packed.logits(packed.step(embeds, packed.fuse(taps), positions)[0]).float()
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype] * want.abs().max(), rtol=0)


@pytest.mark.skipif(not cpu_gemm.available() or cpu_layout.reorders(torch.bfloat16),
                    reason="no AVX2 bf16 kernel here, or oneDNN runs bf16 natively (it packs the heads then)")
def test_an_eagle3_heads_layers_draft_in_two_kernel_calls_as_the_modules_compute(tiny_llama_dir):
    """A bf16 EAGLE-3 head drafts through heads/target/cpu_gemm_layer.py `PackedHeadLayer` (both
    of its layer kinds), which computes what the modules compute: random norm weights (so that
    the embedding's and the feature's norms cannot be swapped), past keys and a mask."""
    from test_eagle3 import random_head

    from specheads.heads.eagle3 import DecoderLayer, MidLayer
    from specheads.heads.target.cpu_gemm_layer import PackedHeadLayer
    from specheads.heads.target.cpu_layout import packed_for_inference

    target = TargetAdapter.from_pretrained(tiny_llama_dir)
    head, _ = random_head(target, seed=5, num_layers=2)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
    head = head.to(torch.bfloat16)
    packed = packed_for_inference(head)
    assert isinstance(packed.midlayer, PackedHeadLayer) and packed.midlayer.first
    assert all(isinstance(layer, PackedHeadLayer) and not layer.first for layer in packed.layers.values())
    assert isinstance(head.midlayer, MidLayer) and all(type(m) is DecoderLayer for m in head.layers.values())
    inside = [m for layer in [packed.midlayer, *packed.layers.values()] for m in layer.modules()]
    assert not any(isinstance(m, cpu_gemm.PackedBf16Module) for m in inside)  # packed once, in the layer
    assert isinstance(packed.lm_head, cpu_gemm.PackedBf16Module)
    hidden, past, new = target.hidden_size, 5, 3
    kv_shape = (2, 1, head.midlayer.self_attn.num_kv_heads, past, head.midlayer.self_attn.head_dim)
    past_kv = tuple(torch.randn(kv_shape, generator=generator).to(torch.bfloat16) for _ in range(2))
    mask = torch.ones(1, 1, new, past + new, dtype=torch.bool)
    mask[0, 0, :, past:] = torch.ones(new, new, dtype=torch.bool).tril()
    mask[0, 0, 1, 2] = False
    embeds = torch.randn(1, new, hidden, generator=generator).to(torch.bfloat16)
    feature = torch.randn(1, new, hidden, generator=generator).to(torch.bfloat16)
    positions = torch.arange(past, past + new)[None]
    with torch.no_grad():
        want_h, want_kv = head.step(embeds, feature, positions, past_kv, mask)
        got_h, got_kv = packed.step(embeds, feature, positions, past_kv, mask)
    for got, want in [(got_h, want_h), *zip(got_kv, want_kv)]:
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[torch.bfloat16] * want.abs().max(),
                                   rtol=0)
    # a mistake (the two norms swapped) is far outside that tolerance
    norms = packed.midlayer.layer.norms
    norms[0], norms[4] = norms[4], norms[0]
    packed.midlayer.layer.plan.input_norm, packed.midlayer.layer.plan.second_norm = \
        norms[0].data_ptr(), norms[4].data_ptr()
    with torch.no_grad():
        swapped, _ = packed.step(embeds, feature, positions, past_kv, mask)
    assert (swapped.float() - want_h.float()).abs().max() > TOLERANCE[torch.bfloat16] * want_h.abs().max()


@pytest.mark.parametrize("native_bf16", [False, True])
@pytest.mark.parametrize("avx2_kernel", [False, True])
def test_each_command_resolves_auto_to_this_cpus_fast_dtype(tiny_llama_dir, monkeypatch, native_bf16, avx2_kernel):
    """--dtype auto / target.dtype auto / train.precision auto on a CPU with and without native bf16
    (mocked) and with and without heads/target/cpu_gemm.py's AVX2 kernel: inference (generate,
    serve, bench, tune, data regenerate, and the caches of the target's replies) in bf16 wherever
    a bf16 kernel runs the model, training math in bf16 only with native bf16, and the frozen
    teacher in the dtype it serves in."""
    from specheads.data.regenerate import load_generation_target
    from specheads.heads.target import cpu_gemm
    from specheads.heads.target.adapter import inference_dtype
    from specheads.runner import load_inference_target
    from specheads.train import resolve_recipe as recipe_path
    from specheads.training.config import load_recipe
    from specheads.training.trainer import resolve_auto

    if avx2_kernel and not cpu_gemm.available():
        pytest.skip("heads/target/cpu_gemm.py's kernel is not built here")
    monkeypatch.setattr(cpu_layout, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(cpu_gemm, "available", lambda: avx2_kernel)
    inference = torch.bfloat16 if native_bf16 or avx2_kernel else torch.float32
    training = torch.bfloat16 if native_bf16 else torch.float32
    if inference is torch.bfloat16 and not native_bf16 or native_bf16 and cpu_gemm.available():
        assert load_inference_target(str(tiny_llama_dir), dtype="auto").dtype is inference  # generate, serve, ...
        assert load_generation_target(str(tiny_llama_dir)).dtype is inference  # data regenerate
    assert inference_dtype(tiny_llama_dir) is inference  # what the replies' caches key on
    assert resolve_dtype("auto", "cpu") is training  # training math, and a model loaded for training
    recipe = load_recipe(recipe_path("tiny-eagle3"), [f"target.name_or_path={tiny_llama_dir}", "target.dtype=auto",
                                                     "train.precision=auto"])
    resolved = resolve_auto(recipe, str(tiny_llama_dir), "cpu")
    assert resolved.train.precision == ("bf16" if native_bf16 else "fp32")
    assert resolved.target.dtype == str(inference).removeprefix("torch.")  # the teacher runs as it serves
    lora = load_recipe(recipe_path("tiny-medusa-lora"), ["target.dtype=auto", "train.precision=auto"])
    assert resolve_auto(lora, str(tiny_llama_dir), "cpu").target.dtype == str(training).removeprefix("torch.")
