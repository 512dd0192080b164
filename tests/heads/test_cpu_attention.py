"""The ragged CPU attention kernel (heads/target/cpu_attention.py) against a per-row PyTorch reference.

Each row reads its own keys from strided views of a longer cache, through a mask of any
shape (a plain prefix, a tree, a row that sees nothing), at the head sizes the kernel
specialises (64, 128) and one it does not (48). Tolerances as STYLE.md states them: fp32
about 1e-5, bf16 about 1e-2 (the output is rounded to bf16).
"""

from __future__ import annotations

import pytest
import torch

from specheads.heads.target import cpu_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler on this machine")


def reference(query_BHGD, key, value, lens_B, mask_BTK, num_tokens, scale):
    """Dense fp32 softmax attention, one row at a time; a row that sees nothing gets zeros."""
    out = torch.zeros(query_BHGD.shape, dtype=torch.float32)
    rows_G = torch.arange(query_BHGD.shape[2]) % num_tokens  # query row g is token g % T
    for b, length in enumerate(lens_B.tolist()):
        scores = query_BHGD[b].float() @ key[b, :, :length].float().transpose(-1, -2) * scale  # [H, G, L]
        visible_GL = mask_BTK[b, rows_G, :length]
        scores = scores.masked_fill(~visible_GL, float("-inf"))
        out[b] = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ value[b, :, :length].float()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_ragged_attention_matches_the_reference(dtype, head_dim, num_tokens):
    generator = torch.Generator().manual_seed(head_dim + num_tokens)
    batch, num_kv_heads, group, capacity = 6, 2, 3, 90
    cache_k, cache_v = (torch.randn(batch, num_kv_heads, capacity, head_dim, generator=generator).to(dtype)
                        for _ in range(2))
    lens_B = torch.tensor([1, 37, 80, 12, 64, 80])
    num_keys = int(lens_B.max())
    key, value = cache_k[:, :, :num_keys], cache_v[:, :, :num_keys]  # views: rows strided by the capacity
    query = torch.randn(batch, num_kv_heads, group * num_tokens, head_dim, generator=generator).to(dtype)
    mask_BTK = torch.rand(batch, num_tokens, num_keys, generator=generator) > 0.4  # any pattern, a tree's too
    mask_BTK &= torch.arange(num_keys) < lens_B[:, None, None]  # each row's keys end at its length
    mask_BTK[3] = False  # a row that sees nothing
    got = cpu_attention.ragged_attention(query, key, value, mask_BTK, num_tokens, 0.2)
    expected = reference(query, key, value, lens_B, mask_BTK, num_tokens, 0.2)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
    assert not got[3].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows_beside_short_ones(dtype):
    """Rows of a decode batch far apart in length (a third turn beside a first one)."""
    generator = torch.Generator().manual_seed(3)
    batch, num_kv_heads, head_dim = 4, 3, 64
    lens_B = torch.tensor([1500, 3, 700, 1501])
    key, value = (torch.randn(batch, num_kv_heads, 1600, head_dim, generator=generator).to(dtype)[:, :, :1501]
                  for _ in range(2))
    query = torch.randn(batch, num_kv_heads, 3, head_dim, generator=generator).to(dtype)
    mask_BTK = torch.arange(1501)[None, None, :] < lens_B[:, None, None]
    got = cpu_attention.ragged_attention(query, key, value, mask_BTK, 1, 0.125)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), reference(query, key, value, lens_B, mask_BTK, 1, 0.125),
                               atol=tolerance, rtol=tolerance)


def test_keys_past_a_rows_length_are_never_read():
    """Garbage (NaN) past each row's length changes nothing: the kernel stops at the last key
    the row's mask shows."""
    batch, num_kv_heads, head_dim = 3, 1, 64
    lens_B = torch.tensor([5, 9, 2])
    key = torch.randn(batch, num_kv_heads, 12, head_dim)
    value = torch.randn(batch, num_kv_heads, 12, head_dim)
    for b, length in enumerate(lens_B.tolist()):
        key[b, :, length:] = value[b, :, length:] = float("nan")
    query = torch.randn(batch, num_kv_heads, 2, head_dim)
    mask_BTK = torch.arange(12)[None, None, :] < lens_B[:, None, None]
    got = cpu_attention.ragged_attention(query, key, value, mask_BTK, 1, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference(query, key, value, lens_B, mask_BTK, 1, 0.125), atol=1e-5, rtol=1e-5)


def test_supports_only_what_it_computes():
    query = torch.randn(2, 1, 3, 8)
    key = torch.randn(2, 1, 5, 8)
    assert cpu_attention.supports(query, key, key)
    assert not cpu_attention.supports(query.half(), key.half(), key.half())
    assert not cpu_attention.supports(query, key.transpose(-1, -2), key)  # D not unit-strided


def test_a_mask_past_the_keys_is_refused_before_the_kernel_reads_them():
    query, key = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 5, 8)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_attention.ragged_attention(query, key, key, torch.ones(2, 1, 6, dtype=torch.bool), 1, 0.3)
    with pytest.raises(ValueError, match="the mask must be bool"):
        cpu_attention.ragged_attention(query, key, key, torch.ones(2, 1, 4, dtype=torch.int32), 1, 0.3)
