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
import os
import shutil
import subprocess
from pathlib import Path

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


@functools.cache
def compile_library(name: str, source: str) -> ctypes.CDLL | None:
    """`source` built and loaded (module docstring), or None without a working C compiler."""
    compiler = shutil.which("cc")
    if compiler is None:
        return None
    key = hashlib.sha256("\n".join([source, " ".join(FLAGS), os.path.realpath(compiler), cpu_flags()]).encode())
    library = f"{name}.so"

    def build(staging: Path) -> None:
        (staging / f"{name}.c").write_text(source)
        subprocess.run([compiler, *FLAGS, str(staging / f"{name}.c"), "-o", str(staging / library)],
                       check=True, capture_output=True, text=True)

    try:
        built = atomic.build_once(atomic.default_cache_dir() / "kernels" / f"{name}-{key.hexdigest()[:16]}", build)
    except subprocess.CalledProcessError:
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
