"""The AVX2 bf16 kernel (heads/target/cpu_gemm.py) computes what torch computes: bit for bit where
every sum is exact in fp32 (small integers: any summation order gives the same fp32 sum, so only a
rounding in the wrong place, a wrong row, column or token, or a lost bias can differ), and within
bf16 rounding on random inputs; for every epilogue, 1 to 32 tokens and more (a prefill), shapes
off its tiles (rows no multiple of 16, odd columns), several weights side by side, strided
inputs, and on the OpenMP path. It refuses what it cannot take with a one-line error."""

from __future__ import annotations

import pytest
import torch

from specheads.heads.target import cpu_gemm, cpu_gemv

needs_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler, or this CPU has no AVX2 and FMA")
TOKENS = list(range(1, 33)) + [37, 100]
SHAPES = [("plain", [13]), ("plain", [8, 3, 5]), ("plain", [40]), ("residual", [7]), ("residual", [33]),
          ("glu", [6, 6]), ("glu", [17, 17])]


def _exact_case(epilogue: str, rows: list[int], cols: int, tokens: int, generator: torch.Generator):
    """Integer weights and quarter-integer inputs: every product and partial sum is exact in fp32."""
    def ints(shape, bound, scale=1.0):
        return (torch.randint(-bound, bound + 1, shape, generator=generator) * scale).to(torch.bfloat16)

    weights = [ints((r, cols), 4) for r in rows]
    bias = ints((sum(rows),), 8)
    x = ints((tokens, cols), 3, 0.25)
    out_features = rows[0] if epilogue == "glu" else sum(rows)
    residual = ints((tokens, out_features), 64, 0.5) if epilogue == "residual" else None
    return weights, bias, x, residual


def _call(op, x, residual):
    return op(x, residual) if residual is not None else op(x)


@needs_kernel
@pytest.mark.parametrize("epilogue,rows", SHAPES)
@pytest.mark.parametrize("cols", [16, 45, 96])
def test_exact_sums_equal_torch_bit_for_bit(epilogue, rows, cols):
    generator = torch.Generator().manual_seed(cols)
    for tokens in TOKENS:
        weights, bias_O, x, residual = _exact_case(epilogue, rows, cols, tokens, generator)
        bias_O = bias_O if tokens % 2 else None  # with and without a bias, alternately
        got = _call(cpu_gemm.PackedBf16Linear(weights, bias_O, epilogue), x, residual)
        want = cpu_gemv.reference(x, weights, bias_O, epilogue, residual)
        if epilogue == "glu":  # SiLU's exp is an approximation as close as libm's: one bf16 step at most
            assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=0), tokens
        else:
            assert torch.equal(got, want), (tokens, (got.float() - want.float()).abs().max())


@needs_kernel
@pytest.mark.parametrize("epilogue,rows", SHAPES)
def test_random_inputs_within_bf16_rounding(epilogue, rows):
    generator = torch.Generator().manual_seed(1)
    cols = 100
    for tokens in (1, 4, 8, 13, 32):
        weights = [(torch.randn(r, cols, generator=generator) * cols ** -0.5).to(torch.bfloat16) for r in rows]
        bias = torch.randn(sum(rows), generator=generator).to(torch.bfloat16)
        x = torch.randn(tokens, cols, generator=generator).to(torch.bfloat16)
        out_features = rows[0] if epilogue == "glu" else sum(rows)
        residual = torch.randn(tokens, out_features, generator=generator).to(torch.bfloat16) \
            if epilogue == "residual" else None
        got = _call(cpu_gemm.PackedBf16Linear(weights, bias, epilogue), x, residual).float()
        want = cpu_gemv.reference(x, weights, bias, epilogue, residual).float()
        # sums in another order may round to the neighbouring bf16, and one rounding after
        # (residual, SiLU, product) adds one more step
        assert ((got - want).abs() <= 2 ** -6 * want.abs() + 2 ** -8 * want.abs().max()).all()


@needs_kernel
@pytest.mark.parametrize("epilogue,rows", [("plain", [301, 66, 66]), ("residual", [257]), ("glu", [299, 299])])
def test_rows_split_over_threads_and_strided_inputs(epilogue, rows):
    """Over the parallel threshold each thread takes a share of the units; a row-strided input
    and residual (views into wider tensors), 3-D as the decoder passes them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 3))
    try:
        generator = torch.Generator().manual_seed(7)
        weights, bias, x, residual = _exact_case(epilogue, rows, 272, 6, generator)
        wide = torch.zeros(6, 300, dtype=torch.bfloat16)
        wide[:, 10:282] = x
        op = cpu_gemm.PackedBf16Linear(weights, bias, epilogue)
        if residual is not None:
            wide_residual = torch.zeros(6, residual.shape[1] + 5, dtype=torch.bfloat16)
            wide_residual[:, 2:-3] = residual
            got = op(wide[:, 10:282].view(2, 3, 272), wide_residual[:, 2:-3].view(2, 3, -1))
        else:
            got = op(wide[:, 10:282].view(2, 3, 272))
    finally:
        torch.set_num_threads(threads)
    want = cpu_gemv.reference(x, weights, bias, epilogue, residual).view(2, 3, -1)
    if epilogue == "glu":
        assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(got, want)


@needs_kernel
def test_non_finite_values_round_as_torch_casts():
    """A NaN stays a NaN (not an infinity) and infinities stay infinite."""
    weights = [torch.ones(16, 16, dtype=torch.bfloat16)]
    x = torch.zeros(3, 16, dtype=torch.bfloat16)
    x[0, 0], x[1, 0], x[2, 0] = float("nan"), float("inf"), -float("inf")
    got = cpu_gemm.PackedBf16Linear(weights)(x)
    assert torch.isnan(got[0]).all() and (got[1] == float("inf")).all() and (got[2] == -float("inf")).all()


@needs_kernel
def test_bad_input_is_refused_with_what_would_be_right():
    weight = torch.zeros(8, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"CPU bf16 \[rows, 32\]"):
        cpu_gemm.PackedBf16Linear([weight, weight.float()])
    with pytest.raises(ValueError, match="glu epilogue takes two weights of one shape"):
        cpu_gemm.PackedBf16Linear([weight, weight[:4]], None, "glu")
    with pytest.raises(ValueError, match="epilogue in"):
        cpu_gemm.PackedBf16Linear([weight], None, "gelu")
    with pytest.raises(ValueError, match=r"bias must be bf16 \[8\]"):
        cpu_gemm.PackedBf16Linear([weight], torch.zeros(7, dtype=torch.bfloat16))
    residual_op = cpu_gemm.PackedBf16Linear([weight], None, "residual")
    with pytest.raises(ValueError, match=r"takes CPU bf16 \[\.\.\., 32\] and a residual"):
        residual_op(torch.zeros(2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not match"):
        residual_op(torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"takes CPU bf16 \[\.\.\., 32\]"):
        cpu_gemm.PackedBf16Linear([weight])(torch.zeros(2, 32))


def test_without_the_kernel_an_op_is_refused_at_build(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_library", lambda: None)
    assert not cpu_gemm.available()
    with pytest.raises(RuntimeError, match="not built on this machine"):
        cpu_gemm.PackedBf16Linear([torch.zeros(4, 32, dtype=torch.bfloat16)])


def test_the_kernel_builds_where_this_cpu_and_compiler_can_run_it():
    """On a machine with a C compiler, AVX2 and FMA the kernel builds: a source that no longer
    compiles must fail here, not turn these tests into skips and the decoder into its fallback."""
    import shutil

    from specheads.heads.target import cpu_kernels

    flags = cpu_kernels.cpu_flags().split()
    if shutil.which("cc") is None or not {"avx2", "fma"} <= set(flags):
        pytest.skip("no C compiler, or this CPU has no AVX2 and FMA")
    assert cpu_gemm.available()


def test_a_kernel_that_cannot_be_built_says_so_once_and_a_read_only_cache_is_worked_around(tmp_path, monkeypatch,
                                                                                           caplog):
    """No compiler, or a source that does not compile: one line naming the kernel and what runs
    instead, and None (the callers' fallback). A cache directory that cannot be written: the
    kernel is built in a temporary directory for this process."""
    import logging
    import shutil

    from specheads.heads.target import cpu_kernels

    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    caplog.set_level(logging.WARNING, logger="specheads.cpu_kernels")
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("SPECHEADS_CACHE", str(blocker / "cache"))  # mkdir under a file fails, even as root
    built = cpu_kernels.compile_library("cpu_gemm", "int answer(void) { return 42; }  /* read-only cache */\n")
    assert built is not None and built.answer() == 42
    assert "cannot write the kernel cache" in caplog.text
    monkeypatch.delenv("SPECHEADS_CACHE")
    caplog.clear()
    assert cpu_kernels.compile_library("cpu_gemm", "int broken(void) { return }\n") is None
    [line] = caplog.messages
    assert "the cpu_gemm kernel did not build" in line and "error" in line and "oneDNN" in line
    caplog.clear()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert cpu_kernels.compile_library("cpu_attention", "int unused(void) { return 0; }\n") is None
    [line] = caplog.messages
    assert "no C compiler" in line and "batched matmuls" in line
