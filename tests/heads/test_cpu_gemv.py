"""The bf16 row kernel (heads/target/cpu_gemv.py) computes what its torch reference computes, within
bf16 rounding, for each epilogue and for shapes off its tiles (columns no multiple of 32, rows
no multiple of 4, 1..9 tokens, one weight or several side by side), on one thread and on the
OpenMP path; it refuses what it cannot take with a one-line error."""

from __future__ import annotations

import pytest
import torch

from specheads.heads.target import cpu_gemv

needs_kernel = pytest.mark.skipif(not cpu_gemv.available(),
                                  reason="no C compiler, or this CPU has no AVX512-BF16 (callers keep oneDNN)")
# Per element: |kernel - reference| <= RTOL |reference| + ATOL max |reference|. The sums run in
# another order than torch's, so a projection may round to the neighbouring bf16 (2^-8 of it),
# and a rounding after it (residual sum, SiLU, product) adds one more; an output from a wrong row,
# column or token is off by about the largest value.
RTOL = 2 ** -6
ATOL = 2 ** -8


def _random(shape, generator, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * scale).to(torch.bfloat16)


def _case(epilogue: str, rows: list[int], cols: int, tokens: int, bias: bool, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weights = [_random((r, cols), generator, cols ** -0.5) for r in rows]
    out_features = rows[0] if epilogue == "glu" else sum(rows)
    bias_O = _random((sum(rows),), generator) if bias else None
    x_TK = _random((tokens, cols), generator)
    residual = _random((tokens, out_features), generator) if epilogue == "residual" else None
    return weights, bias_O, x_TK, residual


def _assert_close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    error = (got.float() - want.float()).abs()
    bound = RTOL * want.float().abs() + ATOL * want.float().abs().max()
    assert bool((error <= bound).all()), f"max error {error.max().item():.4g}, over bound at {(error > bound).sum()}"


@needs_kernel
@pytest.mark.parametrize("epilogue,rows", [("plain", [13]), ("plain", [8, 3, 5]), ("residual", [7]),
                                           ("glu", [6, 6])])
@pytest.mark.parametrize("cols", [32, 45, 96, 100])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 9])
def test_kernel_matches_its_torch_reference(epilogue, rows, cols, tokens):
    for bias in (False, True):
        weights, bias_O, x_TK, residual = _case(epilogue, rows, cols, tokens, bias, seed=cols * 10 + tokens)
        op = cpu_gemv.RowLinear(weights, bias_O, epilogue)
        got = op(x_TK, residual) if residual is not None else op(x_TK)
        _assert_close_in_bf16(got, cpu_gemv.reference(x_TK, weights, bias_O, epilogue, residual))


@needs_kernel
@pytest.mark.parametrize("epilogue,rows", [("plain", [301, 66, 66]), ("residual", [257]), ("glu", [299, 299])])
def test_kernel_splits_rows_over_threads(epilogue, rows, monkeypatch):
    """Over PARALLEL_ELEMENTS, each thread takes a share of the 4-row units (shares that end
    inside one weight and start in the next); 3-D input as the decoder passes it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 3))
    try:
        weights, bias_O, x_TK, residual = _case(epilogue, rows, 272, 6, True, seed=7)
        assert sum(rows) * 272 >= cpu_gemv.PARALLEL_ELEMENTS
        op = cpu_gemv.RowLinear(weights, bias_O, epilogue)
        x_BTK = x_TK.view(2, 3, 272)
        got = op(x_BTK, residual.view(2, 3, -1)) if residual is not None else op(x_BTK)
    finally:
        torch.set_num_threads(threads)
    want = cpu_gemv.reference(x_TK, weights, bias_O, epilogue, residual)
    _assert_close_in_bf16(got, want.view(2, 3, -1))


@needs_kernel
def test_kernel_reads_strided_inputs():
    """A row-strided input (a slice of a wider tensor) and residual, as a view, not copied."""
    generator = torch.Generator().manual_seed(3)
    weight = _random((9, 40), generator)
    wide = _random((5, 64), generator)
    residual_wide = _random((5, 20), generator)
    op = cpu_gemv.RowLinear([weight], None, "residual")
    got = op(wide[:, 8:48], residual_wide[:, 2:11])
    _assert_close_in_bf16(got, cpu_gemv.reference(wide[:, 8:48], [weight], None, "residual", residual_wide[:, 2:11]))


@needs_kernel
def test_bad_input_is_refused_with_what_would_be_right():
    generator = torch.Generator().manual_seed(0)
    weight = _random((8, 32), generator)
    with pytest.raises(ValueError, match="contiguous CPU bf16"):
        cpu_gemv.RowLinear([weight.float()])
    with pytest.raises(ValueError, match="contiguous CPU bf16"):
        cpu_gemv.RowLinear([weight.t()])
    with pytest.raises(ValueError, match="glu epilogue takes two weights of one shape"):
        cpu_gemv.RowLinear([weight, weight[:4].contiguous()], None, "glu")
    with pytest.raises(ValueError, match="epilogue in"):
        cpu_gemv.RowLinear([weight], None, "gelu")
    with pytest.raises(ValueError, match=r"bias must be contiguous bf16 \[8\]"):
        cpu_gemv.RowLinear([weight], _random((7,), generator))
    residual_op = cpu_gemv.RowLinear([weight], None, "residual")
    with pytest.raises(ValueError, match=r"takes CPU bf16 \[\.\.\., 32\] and a residual"):
        residual_op(_random((2, 32), generator))
    with pytest.raises(ValueError, match="does not match"):
        residual_op(_random((2, 32), generator), _random((3, 8), generator))
    with pytest.raises(ValueError, match=r"takes CPU bf16 \[\.\.\., 32\]"):
        cpu_gemv.RowLinear([weight])(_random((2, 31), generator))



def test_without_the_kernel_an_op_is_refused_at_build(monkeypatch):
    """Where the kernel is not built the decoder keeps oneDNN (tests/heads/test_cpu_decoder.py);
    building an op anyway says why it cannot run."""
    monkeypatch.setattr(cpu_gemv, "_library", lambda: None)
    assert not cpu_gemv.available()
    with pytest.raises(RuntimeError, match="not built on this machine"):
        cpu_gemv.RowLinear([torch.zeros(4, 32, dtype=torch.bfloat16)])


def test_the_kernels_build_where_this_cpu_and_compiler_can_run_them():
    """On a machine with a C compiler and AVX512-BF16, the row kernel and the ragged attention
    kernel both build: a source that no longer compiles must fail here, not turn the kernels'
    tests into skips and the engine into its fallback."""
    import shutil

    from specheads.heads.target import cpu_attention, cpu_kernels

    if shutil.which("cc") is None or "avx512_bf16" not in cpu_kernels.cpu_flags().split():
        pytest.skip("no C compiler, or this CPU has no AVX512-BF16")
    assert cpu_gemv.available()
    assert cpu_attention.available()
