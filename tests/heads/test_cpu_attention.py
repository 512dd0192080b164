"""The ragged CPU attention kernel (heads/target/cpu_attention.py) against a per-row PyTorch reference.

Each row reads its own keys from strided views of a longer cache, through a mask of any
shape (a plain prefix, a tree, a row that sees nothing), at the head sizes the kernel
specialises (64, 128) and one it does not (48). Tolerances as STYLE.md states them: fp32
about 1e-5, bf16 about 1e-2 (the output is rounded to bf16).

`grouped_attention` (transformers' layout, the AVX2 path's own entry) is checked at the edges
of the AVX2 path's tiles: 1..9, 16 and 33 tokens, query rows per KV head no multiple of the
3-row dot-product or the 6-row outer-product tile, keys no multiple of the 4-, 8- or 16-key
tile, head sizes 64, 128, 96 and 48 (which falls back), on one thread and on the OpenMP path
(rows cut into chunks).
"""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch

from specheads.heads.target import cpu_attention, cpu_kernels

needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler on this machine")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


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


@needs_kernel
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


@needs_kernel
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


@needs_kernel
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


@needs_kernel
def test_supports_only_what_it_computes():
    query = torch.randn(2, 1, 3, 8)
    key = torch.randn(2, 1, 5, 8)
    assert cpu_attention.supports(query, key, key)
    assert not cpu_attention.supports(query.half(), key.half(), key.half())
    assert not cpu_attention.supports(query, key.transpose(-1, -2), key)  # D not unit-strided


@needs_kernel
def test_a_mask_past_the_keys_is_refused_before_the_kernel_reads_them():
    query, key = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 5, 8)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_attention.ragged_attention(query, key, key, torch.ones(2, 1, 6, dtype=torch.bool), 1, 0.3)
    with pytest.raises(ValueError, match="the mask must be bool"):
        cpu_attention.ragged_attention(query, key, key, torch.ones(2, 1, 4, dtype=torch.int32), 1, 0.3)


def test_the_avx2_path_builds_where_this_cpu_can_run_it():
    """With a C compiler, AVX2 and FMA (and no AVX512-BF16, whose path it replaces), the kernel
    builds with its AVX2 entries: a source that no longer compiles must fail here, not turn
    the tests above into skips and the engine into its fallback."""
    flags = cpu_kernels.cpu_flags().split()
    if shutil.which("cc") is None or not {"avx2", "fma"} <= set(flags) or "avx512_bf16" in flags:
        pytest.skip("no C compiler, or this CPU has no AVX2 and FMA, or it has AVX512-BF16")
    assert cpu_attention.available()
    assert set(cpu_attention._avx2_kernels()) == {torch.float32, torch.bfloat16}


def _grouped_case(batch, num_kv_heads, group, num_tokens, head_dim, dtype, generator):
    """Engine-like operands: the query a transposed view [B, Hq, T, D] of [B, T, Hq, D], keys and
    values views of a longer cache whose unused tail is NaN (never read), rows of different
    lengths, each token seeing its row's prefix and a random part of the new keys (a tree),
    row 1 seeing nothing; the mask [B, 1, T, K + 3] is longer than the keys."""
    num_q_heads = num_kv_heads * group
    lens_B = torch.randint(1, 70, (batch,), generator=generator)
    num_keys = int(lens_B.max()) + num_tokens
    cache_k, cache_v = (torch.randn(batch, num_kv_heads, num_keys + 9, head_dim, generator=generator).to(dtype)
                        for _ in range(2))
    cache_k[:, :, num_keys:] = cache_v[:, :, num_keys:] = float("nan")
    key, value = cache_k[:, :, :num_keys], cache_v[:, :, :num_keys]
    query = torch.randn(batch, num_tokens, num_q_heads, head_dim, generator=generator).to(dtype).transpose(1, 2)
    key_K = torch.arange(num_keys + 3)
    prefix_BTK = (key_K < lens_B[:, None, None]).expand(batch, num_tokens, -1)
    new_BTK = ((key_K >= lens_B[:, None, None]) & (key_K < (lens_B + num_tokens)[:, None, None])
               & (torch.rand(batch, num_tokens, num_keys + 3, generator=generator) > 0.5))
    mask_BTK = prefix_BTK | new_BTK
    mask_BTK[1] = False
    mask_BTK[:, :, num_keys:] = True  # past the keys: ignored
    return query, key, value, mask_BTK[:, None]


def _grouped_reference(query_BHTD, key, value, mask_B1TK, scale):
    """`reference` in transformers' layout -> [B, T, Hq, D]."""
    batch, num_q_heads, num_tokens, head_dim = query_BHTD.shape
    num_kv_heads, num_keys = key.shape[1], key.shape[2]
    mask_BTK = mask_B1TK[:, 0, :, :num_keys]
    seen_BK = mask_BTK.any(dim=1)
    lens_B = torch.where(seen_BK.any(-1), num_keys - seen_BK.flip(-1).int().argmax(-1), 0)
    query_BHGD = query_BHTD.reshape(batch, num_kv_heads, -1, head_dim)
    out_BHGD = reference(query_BHGD, key, value, lens_B, mask_BTK, num_tokens, scale)
    return out_BHGD.view(batch, num_q_heads, num_tokens, head_dim).transpose(1, 2)


@contextlib.contextmanager
def _threads(num_threads):
    """One thread (no OpenMP region), or more (units spread over the threads, rows in chunks)."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_threads", [(t, 1) for t in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 33)]
                         + [(t, 2) for t in (1, 6, 8, 33)])
def test_grouped_attention_at_the_tile_edges(dtype, num_tokens, num_threads):
    generator = torch.Generator().manual_seed(num_tokens)
    # (batch, KV heads, group, head dim): rows per KV head 3T, 2T, 4T, T, 5T (dot-product tiles
    # of 3 rows, outer-product tiles of 6 from 12 rows on, and their remainders); head dims 96
    # and 48 no size the kernel specialises, 48 no multiple of 32 (the plain loops)
    for batch, num_kv_heads, group, head_dim in ((3, 2, 3, 64), (2, 1, 2, 128), (3, 1, 4, 96), (2, 2, 1, 64),
                                                 (2, 1, 5, 64), (2, 1, 3, 48)):
        query, key, value, mask = _grouped_case(batch, num_kv_heads, group, num_tokens, head_dim, dtype, generator)
        with _threads(num_threads):
            got = cpu_attention.grouped_attention(query, key, value, mask, 0.15)
        expected = _grouped_reference(query, key, value, mask, 0.15)
        assert got.shape == (batch, num_tokens, num_kv_heads * group, head_dim) and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        assert not got[1].any()  # the row that sees nothing


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_without_a_mask_reads_every_key(dtype):
    generator = torch.Generator().manual_seed(5)
    query, key, value, _ = _grouped_case(2, 3, 3, 1, 64, dtype, generator)
    key, value = key[:, :, :40], value[:, :, :40]
    everything = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    got = cpu_attention.grouped_attention(query, key, value, None, 0.125)
    torch.testing.assert_close(got.float(), _grouped_reference(query, key, value, everything, 0.125),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_kernel
def test_grouped_attention_refuses_what_does_not_fit():
    query, key = torch.randn(2, 6, 1, 64), torch.randn(2, 2, 5, 64)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_attention.grouped_attention(query, key, torch.randn(2, 2, 4, 64), None, 0.3)
    with pytest.raises(ValueError, match="the mask must be bool"):
        cpu_attention.grouped_attention(query, key, key, torch.ones(2, 1, 1, 4, dtype=torch.bool), 0.3)
    with pytest.raises(ValueError, match="the mask must be bool"):
        cpu_attention.grouped_attention(query, key, key, torch.ones(2, 2, 1, 5, dtype=torch.bool), 0.3)
