"""The C source of heads/target/cpu_attention.py's AVX2 + FMA path (bf16 and fp32), generated:
its register tiles written out per shape, its driver per element type (`avx2_source`)."""

from __future__ import annotations

# The AVX2 + FMA path, compiled where AVX512-BF16 is not. Its register tiles are written out per
# shape, as named variables: GCC keeps arrays of __m256 on the stack.
KINDS = {"bf16": "uint16_t", "f32": "float"}  # C element types
# bf16 widens a 256-bit load of 16 values into two fp32 vectors, the even and the odd elements
# (a shift or a mask: no shuffle); the queries are stored in that order, so the dot product is
# the same. Per kind: dims per step, and per vector of a step its query offset and its keys.
SCORE_STEPS = {"bf16": (16, ((0, "bf16_even(k{u} + d)"), (8, "bf16_odd(k{u} + d)"))),
               "f32": (8, ((0, "_mm256_loadu_ps(k{u} + d)"),))}
# The 4 vectors of 32 dims of value row vj (bf16: even and odd elements, undone at the store).
# A tile of 3 rows holds 12 accumulators, 3 probabilities and a value vector: the odd elements
# take two shifts there (bf16_odd_shifts) instead of a mask, which would need a 17th register
# (GCC then kept an accumulator on the stack, at half the throughput).
VALUE_LOADS = {"bf16": ("bf16_even(vj)", "bf16_odd(vj)", "bf16_even(vj + 16)", "bf16_odd(vj + 16)"),
               "f32": ("_mm256_loadu_ps(vj)", "_mm256_loadu_ps(vj + 8)", "_mm256_loadu_ps(vj + 16)",
                       "_mm256_loadu_ps(vj + 24)")}
ROW_TILE = 3  # query rows per tile
SCORE_KEYS = {3: 4, 2: 4, 1: 8}  # query rows per score tile -> keys per tile (12, 8, 8 accumulators)
# From OUTER_ROWS query rows on, scores take outer-product tiles instead: OUTER_TILE rows x 16 keys
# (12 accumulators), each a query value broadcast times 16 keys' values of one dim, over keys
# transposed into fp32 [dim][16] once for all the rows; no horizontal sums. Scores alone, bf16,
# 300 keys: 24 rows 4.1 -> 5.0 G FMA/s, 192 rows 4.0 -> 5.8 (12 rows 4.4; 6 rows 3.5, slower).
OUTER_ROWS = 12
OUTER_TILE = 6
KEY_BLOCK_BYTES = 16384  # keys scored against every query row while they sit in L1
# Prefetch distances: score tiles read keys, and the values' same rows into L2, PREFETCH_BYTES
# ahead; value tiles read values PREFETCH_ROWS rows ahead. A decode step's caches come from
# memory (the weights stream through L3 between layers): SmolLM2's shapes, bf16, one row x 1
# token over 300 keys, each call on another layer's cache: 35 -> 25 us a call on one core.
PREFETCH_BYTES = 2048
PREFETCH_ROWS = 16
# Query rows x keys x dims from which a call spreads over the OpenMP threads: below, the fork and
# join cost more than they save (SmolLM2's shapes, bf16, 2 threads: one row x 1 token over
# 100 keys, 58K, 10.6 us in one thread, 12.0 us in two; over 200 keys 15.6 and 14.7 us).
PARALLEL_WORK = 1 << 16


def _score_tile(kind: str, rows: int) -> str:
    """C of score_<kind>_<rows>: s[r][j] = q[r] . k[j] for `rows` query rows and keys [j0, j1), in
    tiles of SCORE_KEYS[rows] keys; a tile's keys past `last` read key `last` (their scores land
    in the row's padding). q: fp32 rows, stride qs, scaled, in the kind's element order; vp: the
    values, only prefetched (the value tiles read them next)."""
    ctype, (step, vectors), keys = KINDS[kind], SCORE_STEPS[kind], SCORE_KEYS[rows]
    acc = [f"a{r}_{u}" for r in range(rows) for u in range(keys)]
    lines = [f"static NOINLINE void score_{kind}_{rows}(const float* q, int64_t qs, const {ctype}* kp,",
             f"                                    const {ctype}* vp, int j0, int j1, int last, int dim, float* s,",
             "                                    int64_t ss) {",
             f"    for (int j = j0; j < j1; j += {keys}) {{"]
    lines += [f"        const {ctype}* k{u} = kp + (int64_t)(j + {u} <= last ? j + {u} : last) * dim;"
              for u in range(keys)]
    lines += [f"        for (int64_t b = 0; b < (int64_t)sizeof({ctype}) * {keys} * dim; b += 64) {{  /* rows j.. */",
              "            _mm_prefetch((const char*)(kp + (int64_t)j * dim) + PREFETCH + b, _MM_HINT_T0);",
              "            _mm_prefetch((const char*)(vp + (int64_t)j * dim) + PREFETCH + b, _MM_HINT_T1);",
              "        }"]
    lines += ["        __m256 " + ", ".join(f"{a} = _mm256_setzero_ps()" for a in acc) + ";",
              f"        for (int d = 0; d < dim; d += {step}) {{"]
    for offset, load in vectors:
        lines += ["            {",
                  "                const __m256 " + ", ".join(f"q{r} = _mm256_loadu_ps(q + {r} * qs + d + {offset})"
                                                            for r in range(rows)) + ";"]
        for u in range(keys):
            lines.append(f"                const __m256 x{u} = {load.format(u=u)};")
            lines.append("                " + " ".join(f"a{r}_{u} = _mm256_fmadd_ps(q{r}, x{u}, a{r}_{u});"
                                                       for r in range(rows)))
        lines.append("            }")
    lines.append("        }")
    lines += [f"        _mm_storeu_ps(s + {r} * ss + j + {u}, "
              f"sum4_256(a{r}_{u}, a{r}_{u + 1}, a{r}_{u + 2}, a{r}_{u + 3}));"
              for r in range(rows) for u in range(0, keys, 4)]
    return "\n".join(lines + ["    }", "}"])


def _outer_tile(rows: int) -> str:
    """C of outer_<rows>: s[r][0..16) = q[r] . kt[.][0..16) for `rows` query rows (q: fp32, in
    order, stride qs; kt: 16 keys transposed, [dim][16] fp32)."""
    acc = [f"a{r}_{h}" for r in range(rows) for h in (0, 1)]
    lines = [f"static NOINLINE void outer_{rows}(const float* q, int64_t qs, const float* kt, int dim, float* s,",
             "                             int64_t ss) {",
             "    __m256 " + ", ".join(f"{a} = _mm256_setzero_ps()" for a in acc) + ";",
             "    for (int d = 0; d < dim; d++) {",
             "        const __m256 k0 = _mm256_loadu_ps(kt + d * 16), k1 = _mm256_loadu_ps(kt + d * 16 + 8);",
             "        __m256 b;"]
    lines += [f"        b = _mm256_broadcast_ss(q + {r} * qs + d); a{r}_0 = _mm256_fmadd_ps(b, k0, a{r}_0); "
              f"a{r}_1 = _mm256_fmadd_ps(b, k1, a{r}_1);" for r in range(rows)]
    lines.append("    }")
    lines += [f"    _mm256_storeu_ps(s + {r} * ss, a{r}_0); _mm256_storeu_ps(s + {r} * ss + 8, a{r}_1);"
              for r in range(rows)]
    return "\n".join(lines + ["}"])


def _value_tile(kind: str, rows: int) -> str:
    """C of value_<kind>_<rows>: o[r][0..31] = sum_j p[r][j] v[j][0..31] over keys [0, L) for
    `rows` rows (p: fp32, stride ps; v: 32 dims of key 0, key j at v + j * dim). One row sums
    even and odd keys apart: its 4 accumulators alone would wait on the FMA latency."""
    ctype, loads = KINDS[kind], VALUE_LOADS[kind]
    if rows == 3:
        loads = tuple(load.replace("bf16_odd(", "bf16_odd_shifts(") for load in loads)
    sets = 2 if rows == 1 else 1
    acc = [f"a{s}{r}_{i}" for s in range(sets) for r in range(rows) for i in range(4)]
    lines = [f"static NOINLINE void value_{kind}_{rows}(const float* p, int64_t ps, const {ctype}* v, int dim,",
             f"                                    int L, {ctype}* const* o) {{",
             "    __m256 " + ", ".join(f"{a} = _mm256_setzero_ps()" for a in acc) + ";",
             "    int j = 0;",
             f"    for (; j + {sets} <= L; j += {sets}) {{"]
    for s in range(sets):
        lines += ["        {",
                  f"            const {ctype}* vj = v + (int64_t)(j + {s}) * dim;",
                  f"            for (int b = 0; b < (int)sizeof({ctype}) * 32; b += 64)",
                  f"                _mm_prefetch((const char*)(vj + PREFETCH_ROWS * (int64_t)dim) + b, _MM_HINT_T0);",
                  "            const __m256 " + ", ".join(f"p{r} = _mm256_broadcast_ss(p + {r} * ps + j + {s})"
                                                        for r in range(rows)) + ";"]
        for i, load in enumerate(loads):
            lines.append(f"            const __m256 x{i} = {load};")
            lines.append("            " + " ".join(f"a{s}{r}_{i} = _mm256_fmadd_ps(x{i}, p{r}, a{s}{r}_{i});"
                                                   for r in range(rows)))
        lines.append("        }")
    lines.append("    }")
    if sets == 2:
        lines += ["    if (j < L) {",
                  f"        const {ctype}* vj = v + (int64_t)j * dim;",
                  "        const __m256 p0 = _mm256_broadcast_ss(p + j);"]
        lines += [f"        a00_{i} = _mm256_fmadd_ps({load}, p0, a00_{i});" for i, load in enumerate(loads)]
        lines.append("    }")
        lines += [f"    a00_{i} = _mm256_add_ps(a00_{i}, a10_{i});" for i in range(4)]
    lines += [f"    store_{kind}_32(o[{r}], a0{r}_0, a0{r}_1, a0{r}_2, a0{r}_3);" for r in range(rows)]
    return "\n".join(lines + ["}"])


AVX2_COMMON = r"""
#if defined(__AVX2__) && defined(__FMA__) && !defined(FAST_BF16)
#include <immintrin.h>
#define AVX2_PATH 1
/* Tiles are compiled apart from their callers: inlined, GCC keeps the callers' constants in
   registers across the tile's loop and spills an accumulator instead. */
#define NOINLINE __attribute__((noinline))

/* The lane sums of four vectors, as one 4-lane vector. */
static inline __m128 sum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    const __m256 abcd = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
static inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline float hsum8(__m256 x) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

/* 16 bf16 values at p as fp32: elements 0, 2, .., 14 (even) or 1, 3, .., 15 (odd). */
static inline __m256 bf16_even(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)p), 16));
}
static inline __m256 bf16_odd(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i*)p),
                                                _mm256_set1_epi32((int)0xffff0000u)));
}
static inline __m256 bf16_odd_shifts(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i*)p), 16), 16));
}
/* bf16_store, 8 lanes: the bf16 bits in each lane's low half (a NaN kept a quiet NaN). */
static inline __m256i bf16_bits8(__m256 v) {
    const __m256i x = _mm256_castps_si256(v), top = _mm256_srli_epi32(x, 16);
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)),
                                                         _mm256_and_si256(top, _mm256_set1_epi32(1))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
}
/* bf16_round, 8 lanes, for finite values (probabilities). */
static inline __m256 bf16_round8(__m256 v) {
    const __m256i x = _mm256_castps_si256(v);
    const __m256i up = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(x, 16),
                                                                                     _mm256_set1_epi32(1)));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(x, up), _mm256_set1_epi32((int)0xffff0000u)));
}
static inline void store_bf16_16(uint16_t* o, __m256 lo, __m256 hi) {  /* lo: o[0..7], hi: o[8..15] */
    const __m256i packed = _mm256_packus_epi32(bf16_bits8(lo), bf16_bits8(hi));  /* 128-bit lanes: lo, hi halves */
    _mm256_storeu_si256((__m256i*)o, _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
}
/* 32 output dims from a bf16 value tile: even and odd elements of dims 0..15, then of 16..31. */
static inline void store_bf16_32(uint16_t* o, __m256 even0, __m256 odd0, __m256 even1, __m256 odd1) {
    __m256 a = _mm256_unpacklo_ps(even0, odd0), b = _mm256_unpackhi_ps(even0, odd0);  /* dims 0-3 8-11, 4-7 12-15 */
    store_bf16_16(o, _mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    a = _mm256_unpacklo_ps(even1, odd1); b = _mm256_unpackhi_ps(even1, odd1);
    store_bf16_16(o + 16, _mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
static inline void store_f32_32(float* o, __m256 a, __m256 b, __m256 c, __m256 d) {
    _mm256_storeu_ps(o, a); _mm256_storeu_ps(o + 8, b); _mm256_storeu_ps(o + 16, c); _mm256_storeu_ps(o + 24, d);
}

/* 8 rows of 8 floats -> their transpose, row i at o + i * os. */
static inline void transpose8(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4, __m256 r5, __m256 r6, __m256 r7,
                              float* o, int64_t os) {
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
    _mm256_storeu_ps(o, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_storeu_ps(o + os, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_storeu_ps(o + 2 * os, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_storeu_ps(o + 3 * os, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_storeu_ps(o + 4 * os, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_storeu_ps(o + 5 * os, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_storeu_ps(o + 6 * os, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_storeu_ps(o + 7 * os, _mm256_permute2f128_ps(s3, s7, 0x31));
}
/* 8 bf16 values at p as fp32, in order. */
static inline __m256 bf16_load8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* exp_nonpositive, 8 lanes: the same polynomial, so that probabilities round alike. */
static inline __m256 exp8_nonpositive(__m256 x) {
    const __m256 t = _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(-126.0f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(0.000154035304f), f, _mm256_set1_ps(0.00133335581f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.00961812911f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.0555041087f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.240226507f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.693147180f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                                                _mm256_set1_epi32(127)), 23));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), _mm256_mul_ps(p, scale));
}

/* One query row's scores s[0..L) -> its probabilities, in place: keys that m (the row's mask,
   or NULL) hides score -inf; probabilities rounded to bf16 where round_bf16 (the values product
   takes them as a bf16 matmul would). A row that sees nothing gets zeros; returns whether it saw. */
static int softmax_row(float* s, int L, const uint8_t* m, int round_bf16) {
    const int L8 = L & ~7;
    const __m256 hidden = _mm256_set1_ps(-INFINITY);
    __m256 top8 = hidden;
    int j = 0;
    for (; j < L8; j += 8) {
        __m256 x = _mm256_loadu_ps(s + j);
        if (m) {
            const __m256i seen = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(m + j)));
            x = _mm256_blendv_ps(hidden, x, _mm256_castsi256_ps(_mm256_cmpgt_epi32(seen, _mm256_setzero_si256())));
            _mm256_storeu_ps(s + j, x);
        }
        top8 = _mm256_max_ps(top8, x);
    }
    float top = hmax8(top8);
    for (; j < L; j++) {
        if (m && !m[j]) s[j] = -INFINITY;
        top = s[j] > top ? s[j] : top;
    }
    if (top == -INFINITY) {
        memset(s, 0, sizeof(float) * (size_t)L);
        return 0;
    }
    const __m256 top_v = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    for (j = 0; j < L8; j += 8) {
        const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), top_v));
        _mm256_storeu_ps(s + j, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = hsum8(sum8);
    for (; j < L; j++) { const float e = exp_nonpositive(s[j] - top); s[j] = e; sum += e; }
    const float inv = 1.0f / sum;
    const __m256 inv_v = _mm256_set1_ps(inv);
    for (j = 0; j < L8; j += 8) {
        const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(s + j), inv_v);
        _mm256_storeu_ps(s + j, round_bf16 ? bf16_round8(p) : p);
    }
    for (; j < L; j++) s[j] = round_bf16 ? bf16_round(s[j] * inv) : s[j] * inv;
    return 1;
}

/* Per-thread scratch, grown as needed and kept (OpenMP's threads outlive the calls). */
static __thread float* scratch_buffer;
static __thread size_t scratch_floats;
static float* scratch(size_t floats) {
    if (floats > scratch_floats) {
        free(scratch_buffer);
        scratch_buffer = aligned_alloc(64, (sizeof(float) * floats + 63) & ~(size_t)63);
        if (!scratch_buffer) abort();
        scratch_floats = floats;
    }
    return scratch_buffer;
}

/* A call's operands (ragged_attention_avx2_*), packed by Python's struct (CALL_LAYOUT) and read
   in place: one ctypes argument instead of 27 typed ones, 0.8 us a call instead of 3.8. Strides
   in elements; query row g of KV head h is query head h * group + g / tokens at token g % tokens. */
typedef struct {
    int64_t q, q_b, q_kv, q_head, q_tok;          /* query [B, Hkv * group, T, D], unit stride in D */
    int64_t k, k_b, k_kv, v, v_b, v_kv;            /* keys, values [B, Hkv, >= num_keys, D] (D-contiguous rows) */
    int64_t mask, mask_b, mask_t;                  /* bool [B, T, >= num_keys], unit stride in keys; or 0 */
    int64_t out, o_b, o_kv, o_head, o_tok;         /* output, laid out as the query */
    int64_t num_keys, batch, heads, group, tokens, dim, threads;
    float scale;
} call_t;
"""

AVX2_KIND = r"""
/* q row (dim values) -> fp32, times scale, in the score tiles' element order. */
static inline void widen_q_bf16(const uint16_t* q, float* out, int dim, float scale) {
    const __m256 sv = _mm256_set1_ps(scale);
    for (int d = 0; d < dim; d += 16) {
        _mm256_storeu_ps(out + d, _mm256_mul_ps(bf16_even(q + d), sv));
        _mm256_storeu_ps(out + d + 8, _mm256_mul_ps(bf16_odd(q + d), sv));
    }
}
static inline void widen_q_f32(const float* q, float* out, int dim, float scale) {
    const __m256 sv = _mm256_set1_ps(scale);
    for (int d = 0; d < dim; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(q + d), sv));
}
/* The same in order, for the outer-product tiles. */
static inline void widen_q_in_order_bf16(const uint16_t* q, float* out, int dim, float scale) {
    const __m256 sv = _mm256_set1_ps(scale);
    for (int d = 0; d < dim; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(bf16_load8(q + d), sv));
}
#define widen_q_in_order_f32 widen_q_f32
static inline __m256 load8_bf16(const uint16_t* p) { return bf16_load8(p); }
static inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
"""

AVX2_DRIVER = r"""
/* Scores s[r][j] of query rows [g0, g0 + rows) (q at the (row, head) base) against keys [0, L):
   the rows widened into qf [rows][dim], then every row against a block of keys while the keys
   sit in L1, in dot-product tiles. */
static void score_dot_KIND(const T* q, int64_t q_head, int64_t q_tok, const T* kp, const T* vp, int L, int g0,
                           int rows, int tokens, int dim, float scale, float* qf, float* s, int64_t ss) {
    for (int r = 0; r < rows; r++) {
        const int g = g0 + r;
        widen_q_KIND(q + (g / tokens) * q_head + (g % tokens) * q_tok, qf + (size_t)r * dim, dim, scale);
    }
    int block = KEY_BLOCK / (dim * (int)sizeof(T)) & ~7;
    block = block < 8 ? 8 : block;
    for (int kb = 0; kb < L; kb += block) {
        const int ke = kb + block < L ? kb + block : L;
        for (int r = 0; r < rows; r += ROWS) {
            const float* qr = qf + (size_t)r * dim;
            float* sr = s + r * ss;
            switch (rows - r) {
            case 1: score_KIND_1(qr, dim, kp, vp, kb, ke, L - 1, dim, sr, ss); break;
            case 2: score_KIND_2(qr, dim, kp, vp, kb, ke, L - 1, dim, sr, ss); break;
            default: score_KIND_3(qr, dim, kp, vp, kb, ke, L - 1, dim, sr, ss);
            }
        }
    }
}

/* The same in outer-product tiles (OUTER_ROWS rows or more): each 16 keys (past L - 1: key
   L - 1 again, scores in the padding) transposed into kt [dim][16] (after qf's rows), then every
   row against them. */
static void score_outer_KIND(const T* q, int64_t q_head, int64_t q_tok, const T* kp, const T* vp, int L, int g0,
                             int rows, int tokens, int dim, float scale, float* qf, float* s, int64_t ss) {
    for (int r = 0; r < rows; r++) {
        const int g = g0 + r;
        widen_q_in_order_KIND(q + (g / tokens) * q_head + (g % tokens) * q_tok, qf + (size_t)r * dim, dim, scale);
    }
    float* kt = s + (size_t)rows * ss;
    for (int j = 0; j < L; j += 16) {
        for (int64_t b = 0; b < (int64_t)sizeof(T) * 16 * dim; b += 64) {  /* rows j.. are contiguous */
            _mm_prefetch((const char*)(kp + (int64_t)j * dim) + PREFETCH + b, _MM_HINT_T0);
            _mm_prefetch((const char*)(vp + (int64_t)j * dim) + PREFETCH + b, _MM_HINT_T1);
        }
        for (int half = 0; half < 16; half += 8) {
            const T* k[8];
            for (int u = 0; u < 8; u++) k[u] = kp + (int64_t)(j + half + u < L ? j + half + u : L - 1) * dim;
            for (int d = 0; d < dim; d += 8)
                transpose8(load8_KIND(k[0] + d), load8_KIND(k[1] + d), load8_KIND(k[2] + d), load8_KIND(k[3] + d),
                           load8_KIND(k[4] + d), load8_KIND(k[5] + d), load8_KIND(k[6] + d), load8_KIND(k[7] + d),
                           kt + (int64_t)d * 16 + half, 16);
        }
        for (int r = 0; r < rows; r += OUTER_TILE) {
            const float* qr = qf + (size_t)r * dim;
            float* sr = s + r * ss + j;
            switch (rows - r < OUTER_TILE ? rows - r : OUTER_TILE) {
            case 1: outer_1(qr, dim, kt, dim, sr, ss); break;
            case 2: outer_2(qr, dim, kt, dim, sr, ss); break;
            case 3: outer_3(qr, dim, kt, dim, sr, ss); break;
            case 4: outer_4(qr, dim, kt, dim, sr, ss); break;
            case 5: outer_5(qr, dim, kt, dim, sr, ss); break;
            default: outer_6(qr, dim, kt, dim, sr, ss);
            }
        }
    }
}

/* Query rows [g0, g0 + rows) of one (batch row, KV head) against its keys [0, L): q and o at the
   (row, head) base, kp, vp its keys and values, mp its mask rows. Scores, then the softmax per
   row, then the values product per tile of rows and 32 dims. */
static void attend_KIND(const T* q, int64_t q_head, int64_t q_tok, const T* kp, const T* vp, const uint8_t* mp,
                        int64_t mask_t, int L, int g0, int rows, int tokens, int dim, float scale,
                        T* o, int64_t o_head, int64_t o_tok) {
    if (L == 0) {  /* nothing visible to any row */
        for (int r = 0; r < rows; r++) {
            const int g = g0 + r;
            memset(o + (g / tokens) * o_head + (g % tokens) * o_tok, 0, sizeof(T) * (size_t)dim);
        }
        return;
    }
    const int64_t ss = ((int64_t)L + 15) & ~(int64_t)15;  /* a score row, padded for the key tiles */
    float* qf = scratch((size_t)rows * ((size_t)dim + (size_t)ss) + 16 * (size_t)dim);
    float* s = qf + (size_t)rows * dim;
    if (rows >= OUTER_ROWS)
        score_outer_KIND(q, q_head, q_tok, kp, vp, L, g0, rows, tokens, dim, scale, qf, s, ss);
    else
        score_dot_KIND(q, q_head, q_tok, kp, vp, L, g0, rows, tokens, dim, scale, qf, s, ss);
    for (int r = 0; r < rows; r++)
        softmax_row(s + r * ss, L, mp ? mp + ((g0 + r) % tokens) * mask_t : 0, sizeof(T) == 2);
    for (int r = 0; r < rows; r += ROWS) {
        const int tile = rows - r < ROWS ? rows - r : ROWS;
        T* out[ROWS];
        for (int i = 0; i < tile; i++) {
            const int g = g0 + r + i;
            out[i] = o + (g / tokens) * o_head + (g % tokens) * o_tok;
        }
        for (int dc = 0; dc < dim; dc += 32) {
            T* const oc[ROWS] = {out[0] + dc, tile > 1 ? out[1] + dc : 0, tile > 2 ? out[2] + dc : 0};
            switch (tile) {
            case 1: value_KIND_1(s + r * ss, ss, vp + dc, dim, L, oc); break;
            case 2: value_KIND_2(s + r * ss, ss, vp + dc, dim, L, oc); break;
            default: value_KIND_3(s + r * ss, ss, vp + dc, dim, L, oc);
            }
        }
    }
}

/* The whole call (call_t): units of (batch row, KV head, chunk of query rows), on the OpenMP
   threads where the work pays for the fork (PARALLEL_WORK); few rows and heads are cut into
   chunks of query rows so that every thread gets some. dim: a multiple of 32. */
static void unit_KIND(const call_t* c, int chunk, int per_task, int64_t u) {
    const int64_t task = u / per_task, b = task / c->heads, h = task % c->heads;
    const int G = (int)(c->group * c->tokens), g0 = (int)(u % per_task) * chunk;
    const uint8_t* mp = c->mask ? (const uint8_t*)(intptr_t)c->mask + b * c->mask_b : 0;
    const int L = row_length(mp, c->mask_t, (int)c->tokens, (int)c->num_keys);
    attend_KIND((const T*)(intptr_t)c->q + b * c->q_b + h * c->q_kv, c->q_head, c->q_tok,
                (const T*)(intptr_t)c->k + b * c->k_b + h * c->k_kv,
                (const T*)(intptr_t)c->v + b * c->v_b + h * c->v_kv,
                mp, c->mask_t, L, g0, G - g0 < chunk ? G - g0 : chunk, (int)c->tokens, (int)c->dim, c->scale,
                (T*)(intptr_t)c->out + b * c->o_b + h * c->o_kv, c->o_head, c->o_tok);
}

void ragged_attention_avx2_KIND(const call_t* c) {
    const int G = (int)(c->group * c->tokens), threads = (int)c->threads;
    const int64_t tasks = c->batch * c->heads;
    const int parallel = threads > 1 && tasks * G * c->num_keys * c->dim >= PARALLEL;
    int chunk = G;
    if (parallel && tasks < 4 * threads) {  /* chunks of whole tiles */
        const int tile = G >= OUTER_ROWS ? OUTER_TILE : ROWS;
        const int tiles = (G + tile - 1) / tile, wanted = (int)((4 * threads + tasks - 1) / tasks);
        const int parts = wanted < tiles ? wanted : tiles;
        chunk = tile * ((tiles + parts - 1) / parts);
    }
    const int per_task = (G + chunk - 1) / chunk;
    const int64_t units = tasks * per_task;
    if (!parallel) {
        for (int64_t u = 0; u < units; u++) unit_KIND(c, chunk, per_task, u);
        return;
    }
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t u = 0; u < units; u++) unit_KIND(c, chunk, per_task, u);
}
"""


def avx2_source() -> str:
    """The AVX2 section of heads/target/cpu_attention.py's SOURCE: helpers, then per kind its tiles and driver."""
    defines = {"ROWS": ROW_TILE, "OUTER_ROWS": OUTER_ROWS, "OUTER_TILE": OUTER_TILE, "KEY_BLOCK": KEY_BLOCK_BYTES,
               "PREFETCH": PREFETCH_BYTES, "PREFETCH_ROWS": PREFETCH_ROWS, "PARALLEL": PARALLEL_WORK}
    parts = [AVX2_COMMON.replace("#define AVX2_PATH 1", "#define AVX2_PATH 1\n" + "\n".join(
        f"#define {name} {value}" for name, value in defines.items())), AVX2_KIND]
    parts += [_outer_tile(rows) for rows in range(1, OUTER_TILE + 1)]
    for kind, ctype in KINDS.items():
        parts += [_score_tile(kind, rows) for rows in (1, 2, 3)] + [_value_tile(kind, rows) for rows in (1, 2, 3)]
        parts += [f"#define T {ctype}", AVX2_DRIVER.replace("KIND", kind), "#undef T"]
    return "\n".join(parts) + "\n#endif\n"
