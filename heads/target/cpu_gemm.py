"""bf16 linear layers on a CPU without native bf16 (AVX2 and FMA), for any number of rows: the
decode step, a verify, a prefill.

On such a CPU, torch's bf16 matmul is emulated (about 3x slower than fp32) and fp32 weights
are twice the bytes a decode step must stream. This kernel keeps bf16 weights and computes in
fp32, as ggml's CPU path does: each weight is widened to fp32 in registers (a shift or a mask:
bf16 is the top half of an fp32) and multiplied with fp32 FMAs.

- Weights are packed once, at build, into blocks of 8 rows x 2 columns: one 256-bit vector
  holds, for 8 rows, the pairs (w[r][2p], w[r][2p + 1]). Shifting each lane left by 16 gives the
  8 rows' fp32 weights of column 2p; masking off its low half gives column 2p + 1. A block of 16
  rows streams as two sequential runs, which the hardware prefetcher follows.
- The micro-kernel (`mk16_N`) multiplies 16 rows by N <= 6 tokens: 12 accumulators, two weight
  vectors and one broadcast token value, the 16 registers AVX2 has. Written out per N (generated
  below), not as arrays: GCC keeps such arrays on the stack, which halved the throughput.
- Tokens are cut into balanced tiles of at most 6 (8 -> 4 + 4, 16 -> 6 + 5 + 5). A group of
  units of 16 rows whose weights fit L2 is swept by every token tile before the next group, so a
  prefill reads each weight from memory once and each token tile from L1.
- The epilogue is fused and vectorised: + bias, + the residual (o and down projections), or
  SiLU(gate) * up (gate and up packed apart, each unit computes both). Outputs round where
  torch's ops round (each projection's output to bf16 after its bias, then the residual sum; SiLU's
  output, then the product), so with sums that are exact in fp32 the outputs equal torch's bit
  for bit; otherwise the sums' order differs from oneDNN's.

`PackedBf16Linear` is one fused op (heads/target/cpu_decoder.py builds four per layer and one for
the LM head); `available()` says whether the kernel is built (a C compiler and AVX2 + FMA).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from specheads.heads.target import cpu_kernels

EPILOGUES = {"plain": 0, "residual": 1, "glu": 2}
TOKEN_TILE = 6  # tokens per micro-kernel call (mk16_1 .. mk16_6)
# Weights x columns x rows from which an op spreads over the OpenMP threads.
PARALLEL_WORK = 65536
PREFETCH_BYTES = 2048
GROUP_BYTES = 256 * 1024  # weights of one group of units (fits L2 beside the token tiles)


def _micro_kernel(num_tokens: int) -> str:
    """C of mk16_<num_tokens>: out[n][0..15] = the 16 rows of a unit . x[n], for n < num_tokens.
    x is one token tile, k-major: x[k * TOKEN_TILE + n] (fp32, zero past the columns)."""
    acc = [f"a{n}_{h}" for n in range(num_tokens) for h in (0, 1)]
    lines = [f"static void mk16_{num_tokens}(const uint16_t* w0p, const uint16_t* w1p, int64_t pairs, const float* x,",
             "                           float out[TILE][16]) {",
             "    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);",
             "    __m256 " + ", ".join(f"{a} = _mm256_setzero_ps()" for a in acc) + ";",
             "    for (int64_t p = 0; p < pairs; p++, w0p += 16, w1p += 16, x += 2 * TILE) {",
             "        _mm_prefetch((const char*)w0p + PREFETCH, _MM_HINT_T0);",
             "        _mm_prefetch((const char*)w1p + PREFETCH, _MM_HINT_T0);",
             "        __m256 xb, w0, w1;"]
    for column, widen in (("", "_mm256_slli_epi32({}, 16)"), ("TILE + ", "_mm256_and_si256({}, high)")):
        lines.append(f"        w0 = _mm256_castsi256_ps({widen.format('_mm256_loadu_si256((const __m256i*)w0p)')});")
        lines.append(f"        w1 = _mm256_castsi256_ps({widen.format('_mm256_loadu_si256((const __m256i*)w1p)')});")
        for n in range(num_tokens):
            lines.append(f"        xb = _mm256_broadcast_ss(x + {column}{n}); a{n}_0 = _mm256_fmadd_ps(w0, xb, a{n}_0); "
                         f"a{n}_1 = _mm256_fmadd_ps(w1, xb, a{n}_1);")
    lines.append("    }")
    lines += [f"    _mm256_storeu_ps(out[{n}], a{n}_0); _mm256_storeu_ps(out[{n}] + 8, a{n}_1);"
              for n in range(num_tokens)]
    return "\n".join(lines + ["}"])


SOURCE = (cpu_kernels.BF16_HELPERS + cpu_kernels.EXP_HELPERS + cpu_kernels.ELEMENTWISE + r"""
#include <omp.h>
ELEMENTWISE(bf16, uint16_t, bf16_load, bf16_store, bf16_round)

typedef struct {
    const uint16_t* weights[2];  /* packed (pack_bf16); glu: gate, up */
    int64_t rows;                /* output rows (glu: of gate, = of up) */
    int64_t cols;
    const uint16_t* bias;        /* [rows] (glu: [gate rows | up rows]) or NULL */
    int64_t epilogue;            /* 0: plain, 1: + residual, 2: silu(gate x) * (up x) */
} plan_t;

int available(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* Rows in blocks of 8 (padded with zero rows to a multiple of 16), columns in pairs (a zero
   column past an odd count): block b, pair p is 8 lanes, lane j = (w[8b + j][2p], w[8b + j][2p + 1]). */
void pack_bf16(const uint16_t* w, int64_t rows, int64_t cols, uint16_t* out) {
    const int64_t blocks = 2 * ((rows + 15) / 16), pairs = (cols + 1) / 2;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t j = 0; j < 8; j++) {
                const int64_t r = 8 * b + j, k = 2 * p;
                uint16_t* o = out + ((b * pairs + p) * 8 + j) * 2;
                o[0] = r < rows ? w[r * cols + k] : 0;
                o[1] = r < rows && k + 1 < cols ? w[r * cols + k + 1] : 0;
            }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

MICRO_KERNELS

typedef void (*micro_fn)(const uint16_t*, const uint16_t*, int64_t, const float*, float[TILE][16]);
static const micro_fn MICRO[TILE] = {MICRO_TABLE};

/* 8 fp32 -> 8 bf16, round to nearest even, a NaN kept a quiet NaN (bf16_store, 8 lanes). */
static inline __m128i bf16_pack8(__m256 v) {
    const __m256i x = _mm256_castps_si256(v), top = _mm256_srli_epi32(x, 16);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)),
                                                   _mm256_and_si256(top, _mm256_set1_epi32(1))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static inline __m256 bf16_widen8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
static inline __m256 bf16_round8(__m256 v) { return bf16_widen8(bf16_pack8(v)); }
static inline __m256 bf16_load8(const uint16_t* p, int count) {
    if (count == 8) return bf16_widen8(_mm_loadu_si128((const __m128i*)p));
    uint16_t part[8] = {0};
    memcpy(part, p, sizeof(uint16_t) * (size_t)count);
    return bf16_widen8(_mm_loadu_si128((const __m128i*)part));
}
static inline void bf16_store8(uint16_t* p, __m256 v, int count) {
    if (count == 8) { _mm_storeu_si128((__m128i*)p, bf16_pack8(v)); return; }
    uint16_t part[8];
    _mm_storeu_si128((__m128i*)part, bf16_pack8(v));
    memcpy(p, part, sizeof(uint16_t) * (size_t)count);
}
/* exp_approx (cpu_kernels.EXP_HELPERS), 8 lanes: the same polynomial, so SiLU rounds alike. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm256_sub_ps(t, n);
    const float c[7] = {0.000154035304f, 0.00133335581f, 0.00961812911f, 0.0555041087f, 0.240226507f,
                        0.693147180f, 1.0f};
    __m256 p = _mm256_set1_ps(c[0]);
    for (int i = 1; i < 7; i++) p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(c[i]));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* Bias, residual or SiLU-and-multiply, rounding, store: tokens [t, t + nt) of rows [r0, r0 + valid). */
static void finish(const plan_t* p, int64_t r0, int valid, int64_t t, int nt, float sums[TILE][16],
                   float ups[TILE][16], uint16_t* out, int64_t os, const uint16_t* res, int64_t rs) {
    for (int n = 0; n < nt; n++)
        for (int h = 0; h < 2 && 8 * h < valid; h++) {
            const int count = valid - 8 * h < 8 ? valid - 8 * h : 8;
            const int64_t row = r0 + 8 * h;
            __m256 v = _mm256_loadu_ps(sums[n] + 8 * h);
            if (p->bias) v = _mm256_add_ps(v, bf16_load8(p->bias + row, count));
            if (p->epilogue == 1) {
                v = _mm256_add_ps(bf16_round8(v), bf16_load8(res + (t + n) * rs + row, count));
            } else if (p->epilogue == 2) {
                __m256 up = _mm256_loadu_ps(ups[n] + 8 * h);
                if (p->bias) up = _mm256_add_ps(up, bf16_load8(p->bias + p->rows + row, count));
                const __m256 gate = bf16_round8(v);
                const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                                      exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate))));
                v = _mm256_mul_ps(bf16_round8(silu), bf16_round8(up));
            }
            bf16_store8(out + (t + n) * os + row, v, count);
        }
}

/* Token tile i of `tiles` over `tokens`: [tokens * i / tiles, tokens * (i + 1) / tiles), balanced
   (8 -> 4 + 4, 16 -> 6 + 5 + 5). A thread's share of `count` items: [count * ith / nth, ...). */
static inline int64_t bound(int64_t tokens, int64_t tiles, int64_t i) { return tokens * i / tiles; }
static inline int64_t part(int64_t count, int ith, int nth) { return count * ith / nth; }
static inline int64_t num_tiles(int64_t tokens) { return (tokens + TILE - 1) / TILE; }

/* Tiles [t0, t1) of x [tokens][xs] bf16 -> fp32, each tile k-major [cols + 1][TILE] at
   wide + i * colsp * TILE, zero past cols and past the tile's tokens. */
static void widen(const uint16_t* x, int64_t tokens, int64_t xs, int64_t cols, int64_t t0, int64_t t1, float* wide) {
    const int64_t colsp = (cols + 1) & ~(int64_t)1, tiles = num_tiles(tokens);
    for (int64_t i = t0; i < t1; i++) {
        float* tile = wide + i * colsp * TILE;
        memset(tile, 0, sizeof(float) * (size_t)(colsp * TILE));
        for (int64_t t = bound(tokens, tiles, i); t < bound(tokens, tiles, i + 1); t++) {
            float* o = tile + (t - bound(tokens, tiles, i));
            const uint16_t* row = x + t * xs;
            for (int64_t k = 0; k < cols; k++) o[k * TILE] = bf16_load(row[k]);
        }
    }
}

/* Units [first, last) of 16 rows for every token. A group of units whose weights fit L2 is swept
   by every token tile before the next group. */
static void units(const plan_t* p, int64_t first, int64_t last, const float* wide, int64_t tokens,
                  uint16_t* out, int64_t os, const uint16_t* res, int64_t rs) {
    const int64_t pairs = (p->cols + 1) / 2, unit_elems = 2 * pairs * 16, tiles = num_tiles(tokens);
    const int64_t per_group = GROUP / (unit_elems * 2 * (p->epilogue == 2 ? 2 : 1)) + 1;
    float sums[TILE][16], ups[TILE][16];
    for (int64_t g = first; g < last; g += per_group) {
        const int64_t g_end = g + per_group < last ? g + per_group : last;
        for (int64_t i = 0; i < tiles; i++) {
            const int64_t t0 = bound(tokens, tiles, i);
            const int nt = (int)(bound(tokens, tiles, i + 1) - t0);
            const float* xt = wide + i * 2 * pairs * TILE;
            for (int64_t u = g; u < g_end; u++) {
                const int64_t r0 = 16 * u;
                const int valid = p->rows - r0 < 16 ? (int)(p->rows - r0) : 16;
                const uint16_t* w = p->weights[0] + u * unit_elems;
                MICRO[nt - 1](w, w + unit_elems / 2, pairs, xt, sums);
                if (p->epilogue == 2) {
                    const uint16_t* up = p->weights[1] + u * unit_elems;
                    MICRO[nt - 1](up, up + unit_elems / 2, pairs, xt, ups);
                }
                finish(p, r0, valid, t0, nt, sums, ups, out, os, res, rs);
            }
        }
    }
}

/* This thread's share of one linear op inside a parallel region: widen its share of the token
   tiles, wait for every thread's, then compute its share of the units. */
static void linear_share(const plan_t* p, const uint16_t* x, int64_t tokens, int64_t xs, uint16_t* out, int64_t os,
                         const uint16_t* res, int64_t rs, float* wide, int ith, int nth) {
    const int64_t tiles = num_tiles(tokens), num_units = (p->rows + 15) / 16;
    widen(x, tokens, xs, p->cols, part(tiles, ith, nth), part(tiles, ith + 1, nth), wide);
    #pragma omp barrier
    units(p, part(num_units, ith, nth), part(num_units, ith + 1, nth), wide, tokens, out, os, res, rs);
}

/* Whether an op of this many weights and tokens spreads over the threads (below, their start costs
   more than the work). */
static inline int parallel(const plan_t* p, int64_t tokens) {
    return p->rows * p->cols * (p->epilogue == 2 ? 2 : 1) * (tokens < 4 ? tokens : 4) >= PARALLEL;
}

void linear(const plan_t* p, const uint16_t* x, int64_t tokens, int64_t xs, uint16_t* out, int64_t os,
            const uint16_t* res, int64_t rs, float* wide, int threads) {
    #pragma omp parallel num_threads(threads) if (parallel(p, tokens))
    linear_share(p, x, tokens, xs, out, os, res, rs, wide, omp_get_thread_num(), omp_get_num_threads());
}

/* One decoder layer of a Llama-family model (heads/target/cpu_decoder.py): its four fused linear
   ops, its norms' weights, its shape. */
typedef struct {
    plan_t qkv, o, gate_up, down;
    const uint16_t* input_norm;  /* [hidden] */
    const uint16_t* post_norm;   /* [hidden] */
    const uint16_t* q_norm;      /* [head_dim] (Qwen3) or NULL */
    const uint16_t* k_norm;
    int64_t hidden, q_heads, kv_heads, head_dim, intermediate;
    float eps;
    const uint16_t* second_norm; /* [hidden]: EAGLE-3's first head layer, whose q/k/v read
                                    [RMSNorm(hidden) ; RMSNorm'(second)] (qkv.cols = 2 hidden); or NULL */
} layer_t;

/* The layer up to attention, in one parallel region: RMSNorm -> q, k, v (+ bias) -> Qwen3's
   q/k norms -> RoPE on q and k, in place. hidden [tokens][hidden], tokens = batch x per_row in
   order; second [tokens][hidden] where L->second_norm (its norm's output joins each row), else
   NULL; cos/sin rows of token (b, t) at b * cs_batch + t * cs_token; qkv [tokens][(Hq + 2 Hkv) D].
   normed: [tokens][qkv.cols] scratch; wide: the token tiles' scratch (`widen`). */
void attention_in(const layer_t* L, const uint16_t* hidden, const uint16_t* second, int64_t tokens, int64_t per_row,
                  const uint16_t* cos, const uint16_t* sin, int64_t cs_batch, int64_t cs_token, uint16_t* normed,
                  float* wide, uint16_t* qkv, int threads) {
    const int64_t H = L->hidden, D = L->head_dim, width = L->qkv.rows, q_size = L->q_heads * D, in = L->qkv.cols;
    #pragma omp parallel num_threads(threads) if (parallel(&L->qkv, tokens))
    {
        const int ith = omp_get_thread_num(), nth = omp_get_num_threads();
        for (int64_t r = part(tokens, ith, nth); r < part(tokens, ith + 1, nth); r++) {
            rms_row_bf16(hidden + r * H, L->input_norm, (int)H, L->eps, normed + r * in);
            if (second) rms_row_bf16(second + r * H, L->second_norm, (int)H, L->eps, normed + r * in + H);
        }
        #pragma omp barrier
        linear_share(&L->qkv, normed, tokens, in, qkv, width, NULL, 0, wide, ith, nth);
        #pragma omp barrier
        for (int64_t r = part(tokens, ith, nth); r < part(tokens, ith + 1, nth); r++) {
            uint16_t* row = qkv + r * width;
            if (L->q_norm)
                for (int64_t h = 0; h < L->q_heads + L->kv_heads; h++)
                    rms_row_bf16(row + h * D, h < L->q_heads ? L->q_norm : L->k_norm, (int)D, L->eps, row + h * D);
            const int64_t b = r / per_row, t = r % per_row, at = b * cs_batch + t * cs_token;
            rope_heads_bf16(row, (int)L->q_heads, (int)D, cos + at, sin + at);
            rope_heads_bf16(row + q_size, (int)L->kv_heads, (int)D, cos + at, sin + at);
        }
    }
}

/* The layer after attention, in one parallel region: o (+ bias) + the residual -> RMSNorm ->
   SiLU(gate) * up -> down (+ bias) + the residual. attn [tokens][Hq D]; hidden [tokens][hidden], the
   layer's input (the first residual); out [tokens][hidden], the layer's output. mid, normed
   [tokens][hidden] and act [tokens][intermediate] are scratch. */
void attention_out(const layer_t* L, const uint16_t* attn, const uint16_t* hidden, int64_t tokens, uint16_t* mid,
                   uint16_t* normed, uint16_t* act, float* wide, uint16_t* out, int threads) {
    const int64_t H = L->hidden, I = L->intermediate;
    #pragma omp parallel num_threads(threads) if (parallel(&L->gate_up, tokens))
    {
        const int ith = omp_get_thread_num(), nth = omp_get_num_threads();
        linear_share(&L->o, attn, tokens, L->o.cols, mid, H, hidden, H, wide, ith, nth);
        #pragma omp barrier
        for (int64_t r = part(tokens, ith, nth); r < part(tokens, ith + 1, nth); r++)
            rms_row_bf16(mid + r * H, L->post_norm, (int)H, L->eps, normed + r * H);
        #pragma omp barrier
        linear_share(&L->gate_up, normed, tokens, H, act, I, NULL, 0, wide, ith, nth);
        #pragma omp barrier
        linear_share(&L->down, act, tokens, I, out, H, mid, H, wide, ith, nth);
    }
}
#else
void linear(const plan_t* p, const uint16_t* x, int64_t tokens, int64_t xs, uint16_t* out, int64_t os,
            const uint16_t* res, int64_t rs, float* wide, int threads) { abort(); }
void attention_in(const void* L, const uint16_t* hidden, const uint16_t* second, int64_t tokens, int64_t per_row,
                  const uint16_t* cos, const uint16_t* sin, int64_t cs_batch, int64_t cs_token, uint16_t* normed,
                  float* wide, uint16_t* qkv, int threads) { abort(); }
void attention_out(const void* L, const uint16_t* attn, const uint16_t* hidden, int64_t tokens, uint16_t* mid,
                   uint16_t* normed, uint16_t* act, float* wide, uint16_t* out, int threads) { abort(); }
#endif
""").replace("MICRO_KERNELS", "\n".join(_micro_kernel(n) for n in range(1, TOKEN_TILE + 1))).replace(
    "MICRO_TABLE", ", ".join(f"mk16_{n}" for n in range(1, TOKEN_TILE + 1))).replace(
    "#include <omp.h>", f"#include <omp.h>\n#define TILE {TOKEN_TILE}\n#define PREFETCH {PREFETCH_BYTES}\n"
    f"#define PARALLEL {PARALLEL_WORK}\n#define GROUP {GROUP_BYTES}")


class _Plan(ctypes.Structure):
    _fields_ = [("weights", ctypes.c_void_p * 2), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("bias", ctypes.c_void_p), ("epilogue", ctypes.c_int64)]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel (heads/target/cpu_kernels.py), None where it cannot be built or this CPU
    has no AVX2 and FMA."""
    library = cpu_kernels.compile_library("cpu_gemm", SOURCE)
    if library is None or not library.available():
        return None
    library.linear.restype = None
    library.linear.argtypes = [ctypes.POINTER(_Plan), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    library.pack_bf16.restype = None
    library.pack_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return library


def available() -> bool:
    """Whether the kernel is built (or can be) on this machine."""
    return _library() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A row-major bf16 weight [rows, cols] in the kernel's layout (module docstring): a flat
    bf16 tensor of 16 * ceil(rows / 16) * 2 * ceil(cols / 2) values."""
    rows, cols = weight.shape
    packed = torch.empty(16 * ((rows + 15) // 16) * 2 * ((cols + 1) // 2), dtype=torch.bfloat16)
    _library().pack_bf16(weight.data_ptr(), rows, cols, packed.data_ptr())
    return packed


class PackedBf16Linear:
    """One fused bf16 linear op, any number of rows: x [..., cols] -> [..., out_features].

    weights: row-major bf16 [rows_i, cols] matrices whose outputs are concatenated (as one linear
    layer over their concatenated weights), packed into one copy here; bias [sum rows_i] or None.
    epilogue "plain"; "residual" (the call's `residual` [..., out_features] added after the
    projection rounds); "glu" (two weights gate and up of one shape: SiLU(gate x) * (up x),
    out_features = gate's rows). The packed copy is the op's own; the weights are not held.
    """

    def __init__(self, weights: list[torch.Tensor], bias: torch.Tensor | None = None, epilogue: str = "plain"):
        if not weights or epilogue not in EPILOGUES:
            raise ValueError(f"PackedBf16Linear takes one or more weights and an epilogue in {sorted(EPILOGUES)}, "
                             f"got {len(weights)} weights and {epilogue!r}")
        cols = weights[0].shape[-1]
        for weight in weights:
            if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2 \
                    or weight.shape[1] != cols:
                raise ValueError(f"PackedBf16Linear weights must be CPU bf16 [rows, {cols}], got {weight.dtype} "
                                 f"{tuple(weight.shape)} on {weight.device}")
        if epilogue == "glu" and (len(weights) != 2 or weights[0].shape != weights[1].shape):
            raise ValueError("PackedBf16Linear's glu epilogue takes two weights of one shape (gate, up), got "
                             f"{[tuple(w.shape) for w in weights]}")
        total = sum(w.shape[0] for w in weights)
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (total,)):
            raise ValueError(f"PackedBf16Linear's bias must be bf16 [{total}], got {bias.dtype} {tuple(bias.shape)}")
        library = _library()
        if library is None:
            raise RuntimeError("PackedBf16Linear needs the C kernel, which is not built on this machine (no C compiler "
                               "or no AVX2 and FMA): check cpu_gemm.available() first")
        with torch.no_grad():
            matrices = [w.detach().contiguous() for w in weights]
            self.packed = [pack(m) for m in matrices] if epilogue == "glu" else [pack(torch.cat(matrices))]
        self.bias = None if bias is None else bias.detach().contiguous()
        self.in_features = cols
        self.out_features = weights[0].shape[0] if epilogue == "glu" else total
        self.epilogue = epilogue
        pointers = [m.data_ptr() for m in self.packed] + [None] * (2 - len(self.packed))
        self.plan = _Plan((ctypes.c_void_p * 2)(*pointers), self.out_features, cols,
                          None if self.bias is None else self.bias.data_ptr(), EPILOGUES[epilogue])
        self._plan_ref = ctypes.byref(self.plan)
        self._linear = library.linear
        self._scratch = torch.empty(0)

    def _wide(self, tokens: int) -> torch.Tensor:
        """The fp32 token tiles' buffer (C `widen`), reused between calls."""
        size = -(-tokens // TOKEN_TILE) * (self.in_features + 1) * TOKEN_TILE
        if self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.float32)
        return self._scratch

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x_NK, out, res_NO = cpu_kernels.bf16_rows(f"PackedBf16Linear({self.epilogue})", self.in_features,
                                                  self.out_features, x, residual, self.epilogue == "residual")
        tokens = x_NK.shape[0]
        if tokens == 0:
            return out
        res_pointer, res_stride = (None, 0) if res_NO is None else (res_NO.data_ptr(), res_NO.stride(0))
        self._linear(self._plan_ref, x_NK.data_ptr(), tokens, x_NK.stride(0), out.data_ptr(), self.out_features,
                     res_pointer, res_stride, self._wide(tokens).data_ptr(), torch.get_num_threads())
        return out


class PackedBf16Module(torch.nn.Module):
    """An `nn.Linear` whose forward runs `PackedBf16Linear` (inference only: no autograd), for
    draft heads on a CPU where oneDNN cannot lay bf16 weights out (heads/target/cpu_layout.py
    `packed_for_inference`). `weight` and `bias` are the original `Parameter`s (shared)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.op = PackedBf16Linear([linear.weight], linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=cpu_gemm"
