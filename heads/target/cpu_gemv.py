"""bf16 linear layers for a few rows at a time on a CPU with AVX512-BF16: a decode step's GEMVs and
a small verify's, in C, on the weights as the model holds them.

A decode step of a small model streams every weight once per token, so its linear layers run at
the rate the two cores read memory, not at the rate they multiply. oneDNN's packed bf16 GEMM
(heads/target/cpu_layout.py) reached about half that rate for one row (SmolLM2-135M's 121 GEMVs: 16.6 ms
where reading the same bytes took 8.6). What the kernel here does for it, as ggml's BF16 path does:

- the weights stay row-major bf16, as the model holds them (no packed copy: q, k and v are read
  from their own matrices as one op, and so are gate and up);
- a tile is 4 weight rows x up to 4 tokens, `vdpbf16ps` over 32 values a step, fp32 sums;
- each thread takes one contiguous share of the rows (no hand-offs inside an op), and each
  row of a tile prefetches PREFETCH_BYTES ahead of itself into L2: the hardware prefetcher alone
  keeps too few lines in flight per core to stream at memory rate, and that was why an earlier
  GEMV without it lost to oneDNN on cold weights;
- the epilogue is fused: + bias, + the residual (o and down projections), or SiLU(gate) * up
  (the gate/up projection, so the MLP's activation is no op of its own).

Outputs round where torch's ops round: each projection's output to bf16 (after its bias), then
the residual sum, or SiLU's output and then the product (heads/target/cpu_decoder.py's silu_mul rounds
alike). The sums themselves run in another order than oneDNN's, so outputs differ by bf16
rounding from `reference`, the same computation in torch ops.

`RowLinear` is one fused op, built once per layer (heads/target/cpu_decoder.py); `available()` says
whether the kernel is built (a C compiler and AVX512-BF16); elsewhere the caller keeps oneDNN.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from specheads.heads.target import cpu_kernels

MAX_WEIGHTS = 4  # matrices one op reads side by side (q, k, v)
EPILOGUES = {"plain": 0, "residual": 1, "glu": 2}
# Rows of weights x columns from which an op spreads over the OpenMP threads (below, starting
# them costs more than the work).
PARALLEL_ELEMENTS = 65536
PREFETCH_BYTES = 4096

SOURCE = (cpu_kernels.BF16_HELPERS + cpu_kernels.EXP_HELPERS + r"""
#include <omp.h>

typedef struct {
    const uint16_t* weights[MAX_WEIGHTS];  /* row-major [rows[i], cols] bf16 */
    int64_t rows[MAX_WEIGHTS];
    int64_t num_weights;
    int64_t cols;
    const uint16_t* bias;  /* [sum of rows] or NULL */
    int64_t epilogue;      /* 0: plain, 1: + residual, 2: silu(weights[0] x) * (weights[1] x) */
} plan_t;

int available(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
#include <immintrin.h>

""" + cpu_kernels.AVX512_SUM4 + r"""
/* sums[n][r] = sum_k w[r][k] x[n][k] for R rows (stride cols) x N tokens (stride xs). The last
   step of a row whose length is no multiple of 32 loads under a mask (zeros beyond). With
   `prefetch`, each row asks for the line PREFETCH bytes ahead of the one it reads. */
#define TILE(R, N)                                                                                   \
static void tile_##R##x##N(const uint16_t* w, int64_t cols, const uint16_t* x, int64_t xs,          \
                           int prefetch, float sums[4][4]) {                                         \
    __m512 acc[R][N];                                                                                \
    for (int r = 0; r < R; r++) for (int n = 0; n < N; n++) acc[r][n] = _mm512_setzero_ps();         \
    int64_t k = 0;                                                                                   \
    for (; k + 32 <= cols; k += 32) {                                                                \
        __m512bh xv[N];                                                                              \
        for (int n = 0; n < N; n++) xv[n] = (__m512bh)_mm512_loadu_si512(x + n * xs + k);            \
        for (int r = 0; r < R; r++) {                                                                \
            if (prefetch) _mm_prefetch((const char*)(w + r * cols + k) + PREFETCH, _MM_HINT_T1);     \
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * cols + k);                      \
            for (int n = 0; n < N; n++) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], wv, xv[n]);          \
        }                                                                                            \
    }                                                                                                \
    if (k < cols) {                                                                                  \
        const __mmask32 m = (__mmask32)((1ull << (cols - k)) - 1);                                   \
        __m512bh xv[N];                                                                              \
        for (int n = 0; n < N; n++) xv[n] = (__m512bh)_mm512_maskz_loadu_epi16(m, x + n * xs + k);   \
        for (int r = 0; r < R; r++) {                                                                \
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + r * cols + k);              \
            for (int n = 0; n < N; n++) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], wv, xv[n]);          \
        }                                                                                            \
    }                                                                                                \
    for (int n = 0; n < N; n++) {                                                                    \
        if (R == 4) _mm_storeu_ps(sums[n], sum4(acc[0][n], acc[1 % R][n], acc[2 % R][n], acc[3 % R][n])); \
        else for (int r = 0; r < R; r++) sums[n][r] = _mm512_reduce_add_ps(acc[r][n]);              \
    }                                                                                                \
}
TILE(4, 1) TILE(4, 2) TILE(4, 3) TILE(4, 4) TILE(1, 1) TILE(1, 2) TILE(1, 3) TILE(1, 4)

typedef void (*tile_fn)(const uint16_t*, int64_t, const uint16_t*, int64_t, int, float[4][4]);
static const tile_fn TILES[2][4] = {{tile_1x1, tile_1x2, tile_1x3, tile_1x4},
                                    {tile_4x1, tile_4x2, tile_4x3, tile_4x4}};

/* sums[n][r] for `nr` (1..4) rows from w over every token, 4 tokens a tile; only the first
   token tile prefetches (the others find the rows in L1). */
static void rows_sums(const uint16_t* w, int nr, int64_t cols, const uint16_t* x, int64_t xs,
                      int64_t tokens, float* sums /* [tokens][4] */) {
    float tile[4][4];
    for (int64_t t = 0; t < tokens; t += 4) {
        const int nt = tokens - t < 4 ? (int)(tokens - t) : 4;
        if (nr == 4) {
            TILES[1][nt - 1](w, cols, x + t * xs, xs, t == 0, tile);
        } else {
            for (int r = 0; r < nr; r++) {
                float one[4][4];
                TILES[0][nt - 1](w + r * cols, cols, x + t * xs, xs, t == 0, one);
                for (int n = 0; n < nt; n++) tile[n][r] = one[n][0];
            }
        }
        for (int n = 0; n < nt; n++) for (int r = 0; r < nr; r++) sums[(t + n) * 4 + r] = tile[n][r];
    }
}

/* One unit: up to 4 output columns [c0, c0 + nr) of every token. */
static void unit(const plan_t* p, int which, int64_t row, int nr, int64_t c0, const uint16_t* x, int64_t xs,
                 int64_t tokens, uint16_t* out, int64_t os, const uint16_t* res, int64_t rs, float* sums,
                 float* up) {
    const int64_t cols = p->cols;
    rows_sums(p->weights[which] + row * cols, nr, cols, x, xs, tokens, sums);
    if (p->epilogue == 2) {
        const int64_t inner = p->rows[0];
        rows_sums(p->weights[1] + row * cols, nr, cols, x, xs, tokens, up);
        for (int64_t t = 0; t < tokens; t++)
            for (int r = 0; r < nr; r++) {
                float g = sums[t * 4 + r], u = up[t * 4 + r];
                if (p->bias) { g += bf16_load(p->bias[row + r]); u += bf16_load(p->bias[inner + row + r]); }
                g = bf16_round(g); u = bf16_round(u);
                out[t * os + c0 + r] = bf16_store(bf16_round(g / (1.0f + exp_approx(-g))) * u);
            }
        return;
    }
    for (int64_t t = 0; t < tokens; t++)
        for (int r = 0; r < nr; r++) {
            float v = sums[t * 4 + r];
            if (p->bias) v += bf16_load(p->bias[c0 + r]);
            if (p->epilogue == 1) v = bf16_round(v) + bf16_load(res[t * rs + c0 + r]);
            out[t * os + c0 + r] = bf16_store(v);
        }
}

/* Units of 4 rows over the weights in order (glu: over gate's rows, each with up's), split in
   one contiguous share per thread. */
static void share(const plan_t* p, int64_t first, int64_t last, const uint16_t* x, int64_t xs, int64_t tokens,
                  uint16_t* out, int64_t os, const uint16_t* res, int64_t rs) {
    float* sums = malloc(sizeof(float) * 8 * (size_t)tokens);
    const int64_t num = p->epilogue == 2 ? 1 : p->num_weights;
    int64_t u0 = 0, c0 = 0;
    for (int64_t i = 0; i < num && u0 < last; i++) {
        const int64_t units = (p->rows[i] + 3) / 4;
        for (int64_t u = first > u0 ? first - u0 : 0; u < units && u0 + u < last; u++) {
            const int64_t row = 4 * u;
            const int nr = p->rows[i] - row < 4 ? (int)(p->rows[i] - row) : 4;
            unit(p, (int)i, row, nr, c0 + row, x, xs, tokens, out, os, res, rs, sums, sums + 4 * tokens);
        }
        u0 += units;
        c0 += p->rows[i];
    }
    free(sums);
}

void linear_rows(const plan_t* p, const uint16_t* x, int64_t tokens, int64_t xs, uint16_t* out, int64_t os,
                 const uint16_t* res, int64_t rs, int threads) {
    const int64_t num = p->epilogue == 2 ? 1 : p->num_weights;
    int64_t units = 0, rows = 0;
    for (int64_t i = 0; i < num; i++) { units += (p->rows[i] + 3) / 4; rows += p->rows[i]; }
    if (p->epilogue == 2) rows *= 2;
    #pragma omp parallel num_threads(threads) if (rows * p->cols >= PARALLEL)
    {
        const int64_t ith = omp_get_thread_num(), nth = omp_get_num_threads();
        share(p, units * ith / nth, units * (ith + 1) / nth, x, xs, tokens, out, os, res, rs);
    }
}
#else
void linear_rows(const plan_t* p, const uint16_t* x, int64_t tokens, int64_t xs, uint16_t* out, int64_t os,
                 const uint16_t* res, int64_t rs, int threads) { abort(); }
#endif
""").replace("MAX_WEIGHTS]", f"{MAX_WEIGHTS}]").replace("PARALLEL)", f"{PARALLEL_ELEMENTS})").replace(
    "#include <omp.h>", f"#include <omp.h>\n#define PREFETCH {PREFETCH_BYTES}")


class _Plan(ctypes.Structure):
    _fields_ = [("weights", ctypes.c_void_p * MAX_WEIGHTS), ("rows", ctypes.c_int64 * MAX_WEIGHTS),
                ("num_weights", ctypes.c_int64), ("cols", ctypes.c_int64), ("bias", ctypes.c_void_p),
                ("epilogue", ctypes.c_int64)]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel (heads/target/cpu_kernels.py), None where it cannot be built or this CPU has
    no AVX512-BF16."""
    library = cpu_kernels.compile_library("cpu_gemv", SOURCE)
    if library is None or not library.available():
        return None
    library.linear_rows.restype = None
    library.linear_rows.argtypes = [ctypes.POINTER(_Plan), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return library


def available() -> bool:
    """Whether the kernel is built (or can be) on this machine."""
    return _library() is not None


class RowLinear:
    """One fused bf16 linear op over a few rows: x [..., cols] -> [..., out_features].

    weights: row-major bf16 [rows_i, cols] matrices read side by side (their outputs
    concatenated, as one linear layer over their concatenated weights); bias: [sum rows_i] or
    None. epilogue "plain"; "residual" (the call's `residual` [..., out_features] added after the
    projection rounds); "glu" (two weights gate and up: SiLU(gate x) * (up x), out_features =
    gate's rows). The tensors are held, not copied.
    """

    def __init__(self, weights: list[torch.Tensor], bias: torch.Tensor | None = None, epilogue: str = "plain"):
        if not 1 <= len(weights) <= MAX_WEIGHTS or epilogue not in EPILOGUES:
            raise ValueError(f"RowLinear takes 1-{MAX_WEIGHTS} weights and an epilogue in {sorted(EPILOGUES)}, "
                             f"got {len(weights)} weights and {epilogue!r}")
        cols = weights[0].shape[1]
        for weight in weights:
            if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2 \
                    or weight.shape[1] != cols or not weight.is_contiguous():
                raise ValueError(f"RowLinear weights must be contiguous CPU bf16 [rows, {cols}], got "
                                 f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
        if epilogue == "glu" and (len(weights) != 2 or weights[0].shape != weights[1].shape):
            raise ValueError("RowLinear's glu epilogue takes two weights of one shape (gate, up), got "
                             f"{[tuple(w.shape) for w in weights]}")
        total = sum(w.shape[0] for w in weights)
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (total,) or not bias.is_contiguous()):
            raise ValueError(f"RowLinear's bias must be contiguous bf16 [{total}], got {bias.dtype} "
                             f"{tuple(bias.shape)}")
        self.weights, self.bias, self.epilogue = [w.detach() for w in weights], bias, epilogue
        self.in_features = cols
        self.out_features = weights[0].shape[0] if epilogue == "glu" else total
        self.plan = _Plan((ctypes.c_void_p * MAX_WEIGHTS)(*[w.data_ptr() for w in self.weights]),
                          (ctypes.c_int64 * MAX_WEIGHTS)(*[w.shape[0] for w in self.weights]),
                          len(weights), cols, None if bias is None else bias.data_ptr(), EPILOGUES[epilogue])
        self._plan_ref = ctypes.byref(self.plan)
        self._residual = epilogue == "residual"
        library = _library()
        if library is None:
            raise RuntimeError("RowLinear needs the C kernel, which is not built on this machine (no C compiler or "
                               "no AVX512-BF16): check cpu_gemv.available() first")
        self._linear_rows = library.linear_rows

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x_NK, out, res_NO = cpu_kernels.bf16_rows(f"RowLinear({self.epilogue})", self.in_features,
                                                  self.out_features, x, residual, self._residual)
        self._linear_rows(self._plan_ref, x_NK.data_ptr(), x_NK.shape[0], x_NK.stride(0), out.data_ptr(),
                          self.out_features, None if res_NO is None else res_NO.data_ptr(),
                          0 if res_NO is None else res_NO.stride(0), torch.get_num_threads())
        return out


def reference(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None = None,
              epilogue: str = "plain", residual: torch.Tensor | None = None) -> torch.Tensor:
    """What `RowLinear(weights, bias, epilogue)(x, residual)` computes, in torch ops (as
    transformers' modules compute it: each op's output rounded to x's dtype)."""
    projected = torch.nn.functional.linear(x, torch.cat(weights), bias)
    if epilogue == "glu":
        gate, up = projected.split(weights[0].shape[0], dim=-1)
        return torch.nn.functional.silu(gate) * up
    return projected + residual if epilogue == "residual" else projected
