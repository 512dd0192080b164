"""Small C kernels for the CPU, compiled once per machine and called through ctypes.

PyTorch has no op for a few things the CPU inference path needs (heads/target/cpu_attention.py's
ragged attention; heads/target/cpu_decoder.py's fused RMSNorm, RoPE and SiLU-and-multiply). An
extension built against torch's headers takes a minute to compile; a plain C file takes a
second. `compile_library` builds one with the system C compiler (`cc -O3 -march=native
-fopenmp`) into the specheads cache, keyed by the source, the flags, the compiler and this
CPU's feature flags (so a cache shared between machines keeps one build per kind of CPU),
and returns it loaded, or None where no compiler is found or the build fails: callers then
keep their torch path.

The library links the libgomp that torch already loaded, so its OpenMP threads are torch's
threads (two OpenMP runtimes would spin against each other on a small CPU).

`BF16_HELPERS` is C for the sources: bf16 loads and stores (round to nearest even, as torch
casts) and `*_round`, the rounding that torch applies to each op's output in a dtype.
`EXP_HELPERS` is the e^x that SiLU uses wherever a kernel computes it (heads/target/cpu_decoder.py,
heads/target/cpu_gemv.py), so that they round alike.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from specheads.heads import atomic

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros")

BF16_HELPERS = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_load(uint16_t h) { uint32_t x = (uint32_t)h << 16; float f; memcpy(&f, &x, 4); return f; }
static inline uint16_t bf16_store(float f) {  /* round to nearest even, as torch casts */
    uint32_t x; memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}
static inline float bf16_round(float f) { return bf16_load(bf16_store(f)); }
static inline float f32_load(float f) { return f; }
static inline float f32_store(float f) { return f; }
static inline float f32_round(float f) { return f; }
"""

# Inside an AVX512 block (after #include <immintrin.h>): the horizontal sums both the ragged
# attention (heads/target/cpu_attention.py) and the row kernel (heads/target/cpu_gemv.py) reduce with.
AVX512_SUM4 = r"""
/* The sums of four vectors' lanes, as one 4-lane vector (one tree for four rows). */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
"""

EXP_HELPERS = r"""
/* e^x as 2^n * 2^f, f in [-0.5, 0.5], degree-6 Taylor (relative error about 1e-7, as libm's
   expf), without branches so that the loops around it vectorise (libm's expf does not: it made
   SiLU 40 us for 4 tokens of SmolLM2). Clamped to [-87, 88], where e^x stays a normal float. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = x * 1.44269504088896341f, n = rintf(t), f = t - n;
    const float p = 1.0f + f * (0.693147180f + f * (0.240226507f + f * (0.0555041087f + f * (0.00961812911f
                    + f * (0.00133335581f + f * 0.000154035304f)))));
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale; memcpy(&scale, &bits, 4);
    return p * scale;
}
"""

# The elementwise ops of a Llama-family layer, per dtype (ELEMENTWISE(suffix, type, load, store,
# round)): row functions (`rms_row_*`, `rope_heads_*`) that the fused layer of
# heads/target/cpu_gemm.py calls inside its own parallel region, and whole-tensor entry points
# (`rms_norm_*`, `head_rms_norm_*`, `rope_*`, `silu_mul_*`) for heads/target/cpu_decoder.py. Each
# rounds where transformers' torch ops round (an op's output in the dtype), so in bf16 it gives
# transformers' values, not merely close ones (SiLU's exp is an approximation as close as libm's,
# so a rare value may still round to the neighbouring bf16). An includer defines PARALLEL (the
# elements from which an entry point spreads over the OpenMP threads). Needs BF16_HELPERS and
# EXP_HELPERS before it.
ELEMENTWISE = r"""
#define ELEMENTWISE(SUFFIX, T, LOAD, STORE, ROUND)                                                   \
/* LlamaRMSNorm of one row: w * (x * rsqrt(mean(x^2) + eps)), the product rounded to T before the    \
   weight; o may be x (each output reads only its own input, after the sum). */                      \
static inline void rms_row_##SUFFIX(const T* x, const T* w, int n, float eps, T* o) {                \
    float sum = 0.0f;                                                                                \
    for (int i = 0; i < n; i++) { const float v = LOAD(x[i]); sum += v * v; }                        \
    const float inv = 1.0f / sqrtf(sum / n + eps);                                                   \
    for (int i = 0; i < n; i++) o[i] = STORE(LOAD(w[i]) * ROUND(LOAD(x[i]) * inv));                  \
}                                                                                                    \
void rms_norm_##SUFFIX(const T* x, const T* w, int64_t rows, int n, float eps, T* out) {             \
    _Pragma("omp parallel for if (rows * n >= PARALLEL)")                                            \
    for (int64_t r = 0; r < rows; r++) rms_row_##SUFFIX(x + r * n, w, n, eps, out + r * n);          \
}                                                                                                    \
/* Qwen3's q_norm / k_norm: the same RMSNorm over each head's `n` values, in place, on `heads`       \
   vectors per token with `token_stride` elements between tokens (the q or k part of qkv). */        \
void head_rms_norm_##SUFFIX(T* x, const T* w, int64_t tokens, int64_t token_stride, int heads, int n, \
                            float eps) {                                                             \
    _Pragma("omp parallel for if (tokens * heads * n >= PARALLEL)")                                  \
    for (int64_t r = 0; r < tokens * heads; r++) {                                                   \
        T* xr = x + (r / heads) * token_stride + (r % heads) * n;                                    \
        rms_row_##SUFFIX(xr, w, n, eps, xr);                                                         \
    }                                                                                                \
}                                                                                                    \
/* In place on `heads` vectors of `dim` per token: x * cos + rotate_half(x) * sin. */                 \
static void rope_heads_##SUFFIX(T* x, int heads, int dim, const T* c, const T* s) {                  \
    const int half = dim / 2;                                                                        \
    for (int h = 0; h < heads; h++) {                                                                \
        T* xh = x + (int64_t)h * dim;                                                                \
        for (int i = 0; i < half; i++) {                                                             \
            const float x1 = LOAD(xh[i]), x2 = LOAD(xh[i + half]);                                   \
            xh[i] = STORE(ROUND(x1 * LOAD(c[i])) + ROUND(-x2 * LOAD(s[i])));                         \
            xh[i + half] = STORE(ROUND(x2 * LOAD(c[i + half])) + ROUND(x1 * LOAD(s[i + half])));     \
        }                                                                                            \
    }                                                                                                \
}                                                                                                    \
void rope_##SUFFIX(T* q, T* k, int64_t qk_batch, int64_t qk_token, int q_heads, int k_heads,          \
                   const T* cos, const T* sin, int64_t cs_batch, int64_t cs_token, int batch,        \
                   int tokens, int dim) {                                                            \
    _Pragma("omp parallel for if ((int64_t)batch * tokens * (q_heads + k_heads) * dim >= PARALLEL)") \
    for (int64_t bt = 0; bt < (int64_t)batch * tokens; bt++) {                                       \
        const int64_t b = bt / tokens, t = bt % tokens;                                              \
        const T* c = cos + b * cs_batch + t * cs_token; const T* s = sin + b * cs_batch + t * cs_token; \
        rope_heads_##SUFFIX(q + b * qk_batch + t * qk_token, q_heads, dim, c, s);                    \
        rope_heads_##SUFFIX(k + b * qk_batch + t * qk_token, k_heads, dim, c, s);                    \
    }                                                                                                \
}                                                                                                    \
/* silu(gate) * up over rows of [gate | up], silu's output rounded to T as torch rounds it. */      \
void silu_mul_##SUFFIX(const T* gate_up, int64_t rows, int n, T* out) {                              \
    _Pragma("omp parallel for if (rows * n >= PARALLEL)")                                            \
    for (int64_t r = 0; r < rows; r++) {                                                             \
        const T* g = gate_up + r * 2 * n; const T* u = g + n; T* o = out + r * n;                    \
        for (int i = 0; i < n; i++) {                                                                \
            const float x = LOAD(g[i]);                                                              \
            o[i] = STORE(ROUND(x / (1.0f + exp_approx(-x))) * LOAD(u[i]));                           \
        }                                                                                            \
    }                                                                                                \
}

"""


# What runs instead when a library is not built (said once, in `compile_library`'s one line).
FALLBACKS = {"cpu_attention": "attention runs through torch's batched matmuls",
             "cpu_decoder": "RMSNorm, RoPE and SiLU run as torch ops",
             "cpu_gemv": "bf16 linear layers run through oneDNN",
             "cpu_gemm": "bf16 linear layers run through oneDNN where it takes bf16; elsewhere --dtype auto is float32"}
log = logging.getLogger("specheads.cpu_kernels")


def bf16_rows(name: str, in_features: int, out_features: int, x: torch.Tensor, residual: torch.Tensor | None,
              takes_residual: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What the bf16 linear kernels (heads/target/cpu_gemm.py, cpu_gemv.py) take, checked: x
    [..., in_features] as rows with unit column stride, a new output [..., out_features], and the
    residual's rows (None without one) -> (x_NK, out, res_NO). ValueError naming `name`."""
    if x.dtype != torch.bfloat16 or not x.is_cpu or x.shape[-1] != in_features or (residual is not None) != takes_residual:
        raise ValueError(f"{name} takes CPU bf16 [..., {in_features}]{' and a residual' if takes_residual else ''}, "
                         f"got {x.dtype} {tuple(x.shape)}{'' if residual is None else ' and a residual'}")
    x_NK = x.reshape(-1, in_features)
    if x_NK.stride(-1) != 1:
        x_NK = x_NK.contiguous()
    out = x.new_empty(x.shape[:-1] + (out_features,))
    if residual is None:
        return x_NK, out, None
    if residual.shape != out.shape or residual.dtype != torch.bfloat16 or not residual.is_cpu:
        raise ValueError(f"{name}: residual {residual.dtype} {tuple(residual.shape)} does not match the output, "
                         f"CPU bf16 {tuple(out.shape)}")
    res_NO = residual.reshape(-1, out_features)
    if res_NO.stride(-1) != 1:
        res_NO = res_NO.contiguous()
    return x_NK, out, res_NO


@functools.cache
def say_once(message: str) -> None:
    """A fallback's one line, once per process."""
    log.warning(message)


@functools.cache
def compile_library(name: str, source: str) -> ctypes.CDLL | None:
    """`source` built and loaded (module docstring), or None without a working C compiler. A
    library that cannot be built says so once, in one line naming what runs instead (FALLBACKS);
    a cache directory it cannot write to is replaced by a temporary one for this process."""
    compiler = shutil.which("cc")
    if compiler is None:
        log.warning("specheads: no C compiler (cc) on PATH, so the %s kernel is not built: %s (slower)",
                    name, FALLBACKS.get(name, "torch ops run instead"))
        return None
    key = hashlib.sha256("\n".join([source, " ".join(FLAGS), os.path.realpath(compiler), cpu_flags()]).encode())
    library = f"{name}.so"
    entry = f"{name}-{key.hexdigest()[:16]}"

    def build(staging: Path) -> None:
        (staging / f"{name}.c").write_text(source)
        subprocess.run([compiler, *FLAGS, str(staging / f"{name}.c"), "-o", str(staging / library)],
                       check=True, capture_output=True, text=True)

    try:
        try:
            built = atomic.build_once(atomic.default_cache_dir() / "kernels" / entry, build)
        except OSError as err:  # a read-only or full cache directory: build for this process alone
            log.warning("specheads: cannot write the kernel cache (%s); building %s in a temporary directory", err,
                        name)
            built = Path(tempfile.mkdtemp(prefix="specheads-kernels-")) / entry
            built.mkdir()
            build(built)
    except subprocess.CalledProcessError as err:
        first = next((line for line in (err.stderr or "").splitlines() if "error" in line), "the compiler failed")
        log.warning("specheads: the %s kernel did not build (%s): %s (slower)", name, first.strip(),
                    FALLBACKS.get(name, "torch ops run instead"))
        return None
    return ctypes.CDLL(str(built / library))


@functools.cache
def cpu_flags() -> str:
    """This CPU's feature flags: -march=native builds for them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""
