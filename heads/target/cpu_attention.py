"""Ragged grouped-query attention for a CPU: each batch row reads only its own keys, in place.

The grouped attention of heads/target/cpu_layout.py multiplies batched matrices, and oneDNN's bf16
bmm needs dense batches: it gathers every row's keys and values out of the KV cache first,
so one decode step of 96 SmolLM2 rows at a mean 270 keys moved each key three times (read,
written, read again) and the attention cost about 125 ns a row, key and layer. This kernel
reads each row's keys and values once, where the cache holds them, and never past the row's
own length: per (row, KV head) it scores the row's G = group x T query vectors against its
keys, takes the softmax, and sums the values, all in fp32 (bf16 or fp32 inputs).

Three paths, one chosen when the C is compiled:
- AVX512-BF16 (bf16 only): dot-product instructions on the bf16 values themselves (four keys'
  scores per reduction, two keys' values per instruction).
- AVX2 + FMA, where AVX512-BF16 is not (bf16 and fp32, head dims a multiple of 32): register
  tiles for the scores (3 query rows x 4 keys, dot products reduced four at a time; from 12
  rows on, 6 rows x 16 keys as outer products over keys transposed once) and 3 rows x 32 dims
  for the values (probabilities broadcast, values widened in registers: bf16 is the top half
  of an fp32, so a shift or a mask widens it), a vectorised softmax, keys and values
  prefetched, per-thread scratch. It reads the query and writes the output in transformers'
  layouts (`grouped_attention`), so a call allocates only its output. SmolLM2's shapes
  (3 KV heads, group 3, head dim 64), bf16, one layer on one Zen 3 core, a
  `grouped_attention_forward` call (the plain loops and their wrapper -> this path): one row
  x 1 token over 300 keys 66 -> 22 us, x 8 tokens 250 -> 97 us.
- plain C loops that the compiler vectorises: fp32 on AVX512-BF16 CPUs, other head dims, and
  CPUs without AVX2. 96 SmolLM2 rows at 100-800 keys (mean 410), one layer: the bmm path
  3.2-4.1 ms, the plain loops 2.0 ms, AVX512-BF16 1.0 ms.

It is C, compiled once per machine and called through ctypes (heads/target/cpu_kernels.py: PyTorch
has no op for it). Where no compiler is found, `available()` is False and heads/target/cpu_layout.py
keeps its bmm path.

Shapes (`ragged_attention`): q [B, Hkv, G, D] (query head h reads KV head h // group; row g of a
KV head is query head g // T of its group at token g % T), keys and values [B, Hkv, >= L_b, D]
with unit stride in D and D-contiguous rows (views of the cache), mask bool [B, T, K] (any
strides along B and T, unit along K) or None -> out [B, Hkv, G, D] in q's dtype.
`grouped_attention` takes q [B, Hq, T, D] and a mask [B, 1, T, >= K] and returns [B, T, Hq, D].
A row reads its keys up to the last one its mask shows (the kernel finds it: no per-layer
length pass in torch); a row whose keys are all masked gets zeros (finite, as the bmm path).
Softmax in fp32; in bf16 the probabilities are rounded to bf16 before the values product (as
a bf16 matmul takes them; the plain loops keep them in fp32), and the output to the dtype.
"""

from __future__ import annotations

import ctypes
import functools
import struct

import torch

from specheads.heads.target import cpu_kernels
from specheads.heads.target.cpu_attention_avx2 import avx2_source

SOURCE = cpu_kernels.BF16_HELPERS + r"""

/* e^x for x <= 0: 2^(x log2 e) as 2^n * 2^f, f in [-0.5, 0.5], degree-6 Taylor (rel. error ~1e-7) */
static inline float exp_nonpositive(float x) {
    float t = x * 1.44269504088896341f;
    t = t < -126.0f ? -126.0f : t;
    float n = rintf(t), f = t - n;
    float p = 1.0f + f * (0.693147180f + f * (0.240226507f + f * (0.0555041087f + f * (0.00961812911f
              + f * (0.00133335581f + f * 0.000154035304f)))));
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale; memcpy(&scale, &bits, 4);
    return x < -87.0f ? 0.0f : p * scale;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define FAST_BF16 1
static const uint16_t ZERO_ROW[256] = {0};

""" + cpu_kernels.AVX512_SUM4 + r"""
/* One (row, KV head) in bf16 with AVX512-BF16 dot products, dim a multiple of 32 up to 256:
   scores four keys at a time (one 4-way reduction instead of four), values two keys at a time
   (the pair (V[j][d], V[j+1][d]) times (p[j], p[j+1]) in one dpbf16; unpacking interleaves d
   within 128-bit lanes, undone at the store). Probabilities are rounded to bf16 for the values
   product, as a bf16 matmul would take them. s: G * L4 floats, pb: G * (L4 + 2) uint16s. */
static void attend_bf16_fast(const uint16_t* qp, const uint16_t* kp, const uint16_t* vp, const uint8_t* mp,
                             int64_t mask_t, int L, int G, int tokens, int dim, float scale, uint16_t* op,
                             float* s, uint16_t* pb) {
    const int nv = dim / 32, L4 = (L + 3) & ~3, Lp = L4 + 2;
    for (int g = 0; g < G; g++) {
        __m512bh qv[8];
        for (int v = 0; v < nv; v++) qv[v] = (__m512bh)_mm512_loadu_si512(qp + (int64_t)g * dim + 32 * v);
        float* sg = s + (int64_t)g * L4;
        for (int j = 0; j < L; j += 4) {
            __m512 acc[4];
            for (int u = 0; u < 4; u++) {
                acc[u] = _mm512_setzero_ps();
                if (j + u < L)
                    for (int v = 0; v < nv; v++)
                        acc[u] = _mm512_dpbf16_ps(acc[u], qv[v],
                                                  (__m512bh)_mm512_loadu_si512(kp + (int64_t)(j + u) * dim + 32 * v));
            }
            _mm_storeu_ps(sg + j, _mm_mul_ps(sum4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale)));
        }
        const uint8_t* mg = mp ? mp + (int64_t)(g % tokens) * mask_t : 0;
        float top = -INFINITY, sum = 0.0f;
        for (int j = 0; j < L; j++) {
            if (mg && !mg[j]) sg[j] = -INFINITY;
            top = sg[j] > top ? sg[j] : top;
        }
        uint16_t* pg = pb + (int64_t)g * Lp;
        if (top == -INFINITY) {
            for (int j = 0; j < Lp; j++) pg[j] = 0;
            continue;
        }
        for (int j = 0; j < L; j++) { float e = exp_nonpositive(sg[j] - top); sg[j] = e; sum += e; }
        const float inv = 1.0f / sum;
        for (int j = 0; j < L; j++) pg[j] = bf16_store(sg[j] * inv);
        for (int j = L; j < Lp; j++) pg[j] = 0;
    }
    for (int g = 0; g < G; g++) {
        const uint16_t* pg = pb + (int64_t)g * Lp;
        __m512 acc[16];
        for (int a = 0; a < 2 * nv; a++) acc[a] = _mm512_setzero_ps();
        for (int j = 0; j < L; j += 2) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)((uint32_t)pg[j] | ((uint32_t)pg[j + 1] << 16)));
            const uint16_t* v0 = vp + (int64_t)j * dim;
            const uint16_t* v1 = j + 1 < L ? v0 + dim : ZERO_ROW;
            for (int v = 0; v < nv; v++) {
                __m512i a = _mm512_loadu_si512(v0 + 32 * v), b = _mm512_loadu_si512(v1 + 32 * v);
                acc[2 * v] = _mm512_dpbf16_ps(acc[2 * v], (__m512bh)_mm512_unpacklo_epi16(a, b), pair);
                acc[2 * v + 1] = _mm512_dpbf16_ps(acc[2 * v + 1], (__m512bh)_mm512_unpackhi_epi16(a, b), pair);
            }
        }
        for (int v = 0; v < nv; v++) {
            float lo[16], hi[16];
            _mm512_storeu_ps(lo, acc[2 * v]);
            _mm512_storeu_ps(hi, acc[2 * v + 1]);
            for (int i = 0; i < 16; i++) {  /* element i of lane i / 4 holds d = 8 (i / 4) + i % 4 (+ 4 for hi) */
                op[(int64_t)g * dim + 32 * v + 8 * (i / 4) + i % 4] = bf16_store(lo[i]);
                op[(int64_t)g * dim + 32 * v + 8 * (i / 4) + 4 + i % 4] = bf16_store(hi[i]);
            }
        }
    }
}
#endif

/* Keys a row reads: up to the last one any of its tokens sees (every key without a mask). */
static inline int row_length(const uint8_t* mp, int64_t mask_t, int tokens, int num_keys) {
    if (!mp) return num_keys;
    for (int j = num_keys - 1; j >= 0; j--)
        for (int t = 0; t < tokens; t++)
            if (mp[t * mask_t + j]) return j + 1;
    return 0;
}

/* One (row b, KV head h): its G query vectors against its L keys (mp: its mask rows). DIM is a
   constant for the common head sizes, so the inner loops unroll; buf holds G * (2 DIM + L) + DIM
   floats. */
#define ATTEND_ONE(T, LOAD, STORE, DIM)                                                              \
    float* qf = buf; float* acc = qf + (size_t)G * DIM; float* kv = acc + (size_t)G * DIM;           \
    float* s = kv + DIM;                                                                             \
    const T* qp = q + task * G * DIM;                                                                \
    for (int i = 0; i < G * DIM; i++) { qf[i] = LOAD(qp[i]) * scale; acc[i] = 0.0f; }                \
    const T* kp = k + b * k_row + h * k_head;                                                        \
    const T* vp = v + b * v_row + h * v_head;                                                        \
    for (int j = 0; j < L; j++) {                                                                    \
        for (int d = 0; d < DIM; d++) kv[d] = LOAD(kp[(int64_t)j * DIM + d]);                        \
        for (int g = 0; g < G; g++) {                                                                \
            float dot = 0.0f;                                                                        \
            for (int d = 0; d < DIM; d++) dot += qf[g * DIM + d] * kv[d];                            \
            s[(int64_t)g * L + j] = (mp && !mp[(g % tokens) * mask_t + j]) ? -INFINITY : dot;        \
        }                                                                                            \
    }                                                                                                \
    for (int g = 0; g < G; g++) {                                                                    \
        float* sg = s + (int64_t)g * L;                                                              \
        float top = -INFINITY, sum = 0.0f;                                                           \
        for (int j = 0; j < L; j++) top = sg[j] > top ? sg[j] : top;                                 \
        if (top == -INFINITY) { for (int j = 0; j < L; j++) sg[j] = 0.0f; continue; }                \
        for (int j = 0; j < L; j++) { float e = exp_nonpositive(sg[j] - top); sg[j] = e; sum += e; } \
        const float inv = 1.0f / sum;                                                                \
        for (int j = 0; j < L; j++) sg[j] *= inv;                                                    \
    }                                                                                                \
    for (int j = 0; j < L; j++) {                                                                    \
        for (int d = 0; d < DIM; d++) kv[d] = LOAD(vp[(int64_t)j * DIM + d]);                        \
        for (int g = 0; g < G; g++) {                                                                \
            const float pj = s[(int64_t)g * L + j];                                                  \
            for (int d = 0; d < DIM; d++) acc[g * DIM + d] += pj * kv[d];                            \
        }                                                                                            \
    }                                                                                                \
    T* op = out + task * G * DIM;                                                                    \
    for (int i = 0; i < G * DIM; i++) op[i] = STORE(acc[i]);

#define RAGGED_ATTENTION(NAME, T, LOAD, STORE)                                                       \
void NAME(const T* q, const T* k, const T* v, int64_t k_row, int64_t k_head, int64_t v_row,          \
          int64_t v_head, const uint8_t* mask, int64_t mask_row, int64_t mask_t, int num_keys,          \
          int rows, int heads, int group, int tokens, int dim, float scale, T* out) {                  \
    const int G = group * tokens;                                                                    \
    _Pragma("omp parallel")                                                                          \
    {                                                                                                \
        float* buf = malloc(sizeof(float) * ((size_t)G * (2 * (size_t)dim + 2 * (size_t)num_keys + 16) + dim)); \
        _Pragma("omp for schedule(dynamic, 1)")                                                      \
        for (int64_t task = 0; task < (int64_t)rows * heads; task++) {                               \
            const int b = (int)(task / heads), h = (int)(task % heads);                              \
            const uint8_t* mp = mask ? mask + b * mask_row : 0;                                      \
            const int L = row_length(mp, mask_t, tokens, num_keys);                                  \
            if (FAST(T, dim)) {                                                                      \
                attend_fast(q + task * G * dim, k + b * k_row + h * k_head, v + b * v_row + h * v_head, \
                            mp, mask_t, L, G, tokens, dim, scale,                                    \
                            out + task * G * dim, buf, (uint16_t*)(buf + (size_t)G * (num_keys + 4))); \
            }                                                                                        \
            else if (dim == 64) { ATTEND_ONE(T, LOAD, STORE, 64) }                                   \
            else if (dim == 128) { ATTEND_ONE(T, LOAD, STORE, 128) }                                 \
            else { ATTEND_ONE(T, LOAD, STORE, dim) }                                                 \
        }                                                                                            \
        free(buf);                                                                                   \
    }                                                                                                \
}

#ifdef FAST_BF16
#define FAST(T, dim) (sizeof(T) == 2 && (dim) % 32 == 0 && (dim) <= 256)
#define attend_fast(q, k, v, m, mt, L, G, tk, d, sc, o, s, pb) \
    attend_bf16_fast((const uint16_t*)(q), (const uint16_t*)(k), (const uint16_t*)(v), m, mt, L, G, tk, d, sc, \
                     (uint16_t*)(o), s, pb)
#else
#define FAST(T, dim) 0
#define attend_fast(...) ((void)0)
#endif

RAGGED_ATTENTION(ragged_attention_bf16, uint16_t, bf16_load, bf16_store)
RAGGED_ATTENTION(ragged_attention_f32, float, f32_load, f32_store)

/* A forward's new keys and values into a KV cache: for rows b < rows, KV heads h < heads, tokens
   t < tokens, the `dim` elements (of `elem` bytes) at k + b * k_b + h * k_h + t * k_t go to
   keys + b * c_b + h * c_h + (starts[b] + t) * dim, and v's alike to values (strides in elements). */
void write_new_rows(const char* k, int64_t k_b, int64_t k_h, int64_t k_t, const char* v, int64_t v_b, int64_t v_h,
                    int64_t v_t, char* keys, char* values, int64_t c_b, int64_t c_h, const int64_t* starts,
                    int64_t rows, int64_t heads, int64_t tokens, int64_t dim, int64_t elem) {
    const size_t bytes = (size_t)(dim * elem);
    for (int64_t b = 0; b < rows; b++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t t = 0; t < tokens; t++) {
                const int64_t slot = b * c_b + h * c_h + (starts[b] + t) * dim;
                memcpy(keys + slot * elem, k + (b * k_b + h * k_h + t * k_t) * elem, bytes);
                memcpy(values + slot * elem, v + (b * v_b + h * v_h + t * v_t) * elem, bytes);
            }
}
""" + avx2_source()

DTYPES = (torch.bfloat16, torch.float32)
AVX2_NAMES = {torch.bfloat16: "ragged_attention_avx2_bf16", torch.float32: "ragged_attention_avx2_f32"}
CALL_LAYOUT = struct.Struct("=26qf")  # C call_t


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel (heads/target/cpu_kernels.py), None where it cannot be built."""
    library = cpu_kernels.compile_library("cpu_attention", SOURCE)
    if library is None:
        return None
    for name in ("ragged_attention_bf16", "ragged_attention_f32"):
        function = getattr(library, name)
        function.restype = None
        function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] \
            + [ctypes.c_int64] * 2 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p]
    library.write_new_rows.restype = None
    library.write_new_rows.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 3) * 2 + [ctypes.c_void_p] * 2 \
        + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 5
    return library


@functools.cache
def _avx2_kernels() -> dict[torch.dtype, ctypes._CFuncPtr]:
    """dtype -> the AVX2 entry (call_t), where this build has that path."""
    library = _library()
    if library is None or not hasattr(library, AVX2_NAMES[torch.float32]):
        return {}
    kernels = {}
    for dtype, name in AVX2_NAMES.items():
        function = getattr(library, name)
        function.restype = None
        function.argtypes = [ctypes.c_char_p]  # a CALL_LAYOUT bytes object, read in place
        kernels[dtype] = function
    return kernels


def available() -> bool:
    """Whether the kernel is built (or can be) on this machine."""
    return _library() is not None


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `ragged_attention` and `grouped_attention` take these tensors (CPU, bf16 or fp32,
    keys and values with unit stride in D and D-contiguous rows)."""
    dtype = query.dtype
    if not (query.is_cpu and (dtype is torch.bfloat16 or dtype is torch.float32) and key.dtype is dtype
            and value.dtype is dtype):
        return False
    key_strides, value_strides = key.stride(), value.stride()
    return (key_strides[-1] == 1 and key_strides[-2] == key.shape[-1] and value_strides[-1] == 1
            and value_strides[-2] == value.shape[-1] and available())


def grouped_attention(query_BHTD: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """transformers' layout, for heads/target/cpu_layout.py (the caller checks `supports` first):
    query [B, Hq, T, D] (any strides), keys and values [B, Hkv, K, D], mask bool [B, 1, T, >= K]
    or [B, T, >= K] (True = attend; keys past K ignored) or None (every key) -> out [B, T, Hq, D].
    Query head h reads KV head h // (Hq // Hkv). On the AVX2 path the kernel reads the query and
    writes the (contiguous) output in these layouts: the call allocates only the output, and its
    Python (this function) costs about 6 us, half of it torch.empty and ctypes; elsewhere it
    runs `ragged_attention` on a [B, Hkv, G, D] copy of the query."""
    batch, num_q_heads, num_tokens, head_dim = query_BHTD.shape
    key_batch, num_kv_heads, num_keys, key_dim = key.shape
    group = num_q_heads // num_kv_heads
    if key_batch != batch or key_dim != head_dim or group * num_kv_heads != num_q_heads or value.shape != key.shape:
        raise ValueError(f"grouped_attention: query {tuple(query_BHTD.shape)}, keys {tuple(key.shape)}, values "
                         f"{tuple(value.shape)} do not fit together")
    _check_mask(mask, batch, num_tokens, num_keys)
    kernel = AttentionCall.kernel_for(query_BHTD.dtype, head_dim)
    if kernel is None:
        query_BHGD = query_BHTD.reshape(batch, num_kv_heads, group * num_tokens, head_dim)
        mask_BTK = None if mask is None else (mask[:, 0] if mask.dim() == 4 else mask)[..., :num_keys]
        out_BHGD = ragged_attention(query_BHGD, key, value, mask_BTK, num_tokens, scale)
        return out_BHGD.view(batch, num_q_heads, num_tokens, head_dim).transpose(1, 2)
    if query_BHTD.stride(-1) != 1:
        query_BHTD = query_BHTD.contiguous()
    call = AttentionCall(kernel, num_q_heads, num_tokens, query_BHTD.stride()[:3], key, value, mask, scale)
    return call(query_BHTD.data_ptr(), key.data_ptr(), value.data_ptr())


def _check_mask(mask: torch.Tensor | None, batch: int, num_tokens: int, num_keys: int) -> None:
    """A one-line error unless mask is None or bool [batch, (1,) num_tokens, >= num_keys]."""
    if mask is not None:
        shape = mask.shape
        if mask.dtype is not torch.bool or shape[0] != batch or shape[-2] != num_tokens or shape[-1] < num_keys \
                or len(shape) != 3 and (len(shape) != 4 or shape[1] != 1):
            raise ValueError(f"grouped_attention: the mask must be bool [{batch}, (1,) {num_tokens}, >= {num_keys}], "
                             f"got {mask.dtype} {tuple(shape)}")


class AttentionCall:
    """One shape's AVX2 grouped attention (`grouped_attention`'s kernel path), its arguments packed
    once but for three pointers: the query's, the keys' and the values'. `grouped_attention` makes
    one per call; a fused forward makes one per forward (`over_qkv`) and calls it for each layer,
    with the query where the layer's q/k/v rows hold it and the keys and values where the cache
    holds them. query_strides: (batch, head, token) in elements, unit stride along D; key and value
    (any layer's: one layout for all) [B, Hkv, K, D] with D-contiguous rows; mask as
    `grouped_attention` takes it, checked by the caller. A call -> out [B, T, Hq, D]."""

    def __init__(self, kernel, num_q_heads: int, num_tokens: int, query_strides: tuple[int, int, int],
                 key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float):
        batch, num_kv_heads, num_keys, head_dim = key.shape
        group = num_q_heads // num_kv_heads
        if mask is not None and mask.stride(-1) != 1:
            mask = mask.contiguous()
        self.mask = mask  # held: the C reads it
        self.kernel, self.dtype = kernel, key.dtype
        self.out_shape = (batch, num_tokens, num_q_heads, head_dim)
        q_b, q_head, q_tok = query_strides
        self.query = (q_b, group * q_head, q_head, q_tok)
        self.keys, self.values = key.stride()[:2], value.stride()[:2]
        self.masking = (0, 0, 0) if mask is None else (mask.data_ptr(), mask.stride(0), mask.stride(-2))
        row = num_q_heads * head_dim
        self.rest = (num_tokens * row, group * head_dim, head_dim, row, num_keys, batch, num_kv_heads, group,
                     num_tokens, head_dim, torch.get_num_threads(), scale)

    @staticmethod
    def kernel_for(dtype: torch.dtype, head_dim: int):
        """The AVX2 entry for this dtype and head size, or None (not built here, or a head size
        that is no multiple of 32)."""
        return _avx2_kernels().get(dtype) if head_dim % 32 == 0 else None

    @classmethod
    def over_qkv(cls, num_q_heads: int, num_tokens: int, width: int, key: torch.Tensor, value: torch.Tensor,
                 mask: torch.Tensor | None, scale: float) -> "AttentionCall | None":
        """For layers whose query is the first Hq x D columns of q/k/v rows [B, T, width]
        (contiguous): None where the kernel does not run (dtype, head size)."""
        kernel = cls.kernel_for(key.dtype, key.shape[-1])
        if kernel is None:
            return None
        _check_mask(mask, key.shape[0], num_tokens, key.shape[2])
        return cls(kernel, num_q_heads, num_tokens, (num_tokens * width, key.shape[-1], width), key, value, mask,
                   scale)

    def __call__(self, query_pointer: int, keys_pointer: int, values_pointer: int) -> torch.Tensor:
        out = torch.empty(self.out_shape, dtype=self.dtype)
        self.kernel(CALL_LAYOUT.pack(query_pointer, *self.query, keys_pointer, *self.keys, values_pointer,
                                     *self.values, *self.masking, out.data_ptr(), *self.rest))
        return out


class RowWriter:
    """A forward's new keys and values [B, Hkv, T, D] (unit stride in D) into every layer's KV cache
    buffers, given as one view rows [L, 2, B, Hkv, K, D] (layer l's keys rows[l, 0], its values
    rows[l, 1]; D-contiguous rows), at slots [starts[b], starts[b] + T) of row b (CPU int64 [B]; the
    caller keeps every slot below K): one C call a layer for its keys and values, the layout checked
    once. A cache's `update` (a Python slice copy per row and buffer) cost about 30 us a layer of a
    SmolLM2 decode step. keys[l] and values[l]: the addresses of layer l's keys and values."""

    def __init__(self, rows_L2BHKD: torch.Tensor, starts_B: torch.Tensor):
        shape, strides = rows_L2BHKD.shape, rows_L2BHKD.stride()
        if rows_L2BHKD.dim() != 6 or strides[4:] != (shape[5], 1) or starts_B.dtype != torch.int64 \
                or starts_B.shape != (shape[2],) or not starts_B.is_contiguous():
            raise ValueError(f"RowWriter: the cache buffers must be one view [L, 2, B, Hkv, K, D] with D-contiguous "
                             f"rows, and starts int64 [B]; got {tuple(shape)} strides {strides}, starts "
                             f"{starts_B.dtype} {tuple(starts_B.shape)}")
        layers, batch, heads, dim = shape[0], shape[2], shape[3], shape[5]
        self.shape = (batch, heads, dim)
        self.dtype = rows_L2BHKD.dtype
        base, elem = rows_L2BHKD.data_ptr(), rows_L2BHKD.element_size()
        self.keys = [base + layer * strides[0] * elem for layer in range(layers)]
        self.values = [address + strides[1] * elem for address in self.keys]
        self.cache_strides = strides[2:4]
        self.starts = starts_B  # held: the C reads it
        self.new_strides = None  # the new keys' and values' strides, checked on the first call
        self._write = _library().write_new_rows

    def from_qkv(self, layer: int, qkv_BTW: torch.Tensor, k_offset: int, v_offset: int) -> None:
        """Layer `layer`'s new keys and values out of its q/k/v rows [B, T, W] (contiguous; the keys
        at columns [k_offset, k_offset + Hkv D), the values at v_offset), without views."""
        batch, heads, dim = self.shape
        tokens, width = qkv_BTW.shape[1], qkv_BTW.shape[2]
        if qkv_BTW.dtype != self.dtype or not qkv_BTW.is_contiguous() or qkv_BTW.shape[0] != batch \
                or max(k_offset, v_offset) + heads * dim > width:
            raise ValueError(f"RowWriter.from_qkv: q/k/v rows must be contiguous {self.dtype} [{batch}, T, W] with "
                             f"{heads} x {dim} keys at {k_offset} and values at {v_offset}, got {qkv_BTW.dtype} "
                             f"{tuple(qkv_BTW.shape)}")
        elem, base, strides = qkv_BTW.element_size(), qkv_BTW.data_ptr(), (tokens * width, dim, width)
        self._send(layer, base + k_offset * elem, strides, base + v_offset * elem, strides, tokens, elem)

    def __call__(self, layer: int, key_BHTD: torch.Tensor, value_BHTD: torch.Tensor) -> None:
        k_strides, v_strides = key_BHTD.stride(), value_BHTD.stride()
        if (k_strides, v_strides) != self.new_strides:
            batch, heads, dim = self.shape
            for states in (key_BHTD, value_BHTD):
                if states.dtype != self.dtype or states.stride(-1) != 1 \
                        or (states.shape[0], states.shape[1], states.shape[3]) != self.shape:
                    raise ValueError(f"RowWriter: new keys and values must be {self.dtype} [{batch}, {heads}, T, "
                                     f"{dim}] with unit stride in D, got {states.dtype} {tuple(states.shape)} "
                                     f"strides {states.stride()}")
            self.new_strides = (k_strides, v_strides)
        self._send(layer, key_BHTD.data_ptr(), k_strides[:3], value_BHTD.data_ptr(), v_strides[:3], key_BHTD.shape[2],
                   key_BHTD.element_size())

    def _send(self, layer: int, keys: int, key_strides: tuple, values: int, value_strides: tuple, tokens: int,
              elem: int) -> None:
        """The C call: new keys and values at these pointers and (batch, head, token) strides."""
        batch, heads, dim = self.shape
        self._write(keys, *key_strides, values, *value_strides, self.keys[layer], self.values[layer],
                    *self.cache_strides, self.starts.data_ptr(), batch, heads, tokens, dim, elem)


def ragged_attention(query_BHGD: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask_BTK: torch.Tensor | None, num_tokens: int, scale: float) -> torch.Tensor:
    """See the module docstring; the caller checks `supports` first. Each row reads its keys up
    to the last one its mask shows (all of them without a mask), so the mask is checked against
    the keys here: the kernel trusts it."""
    batch, num_kv_heads, num_rows, head_dim = query_BHGD.shape
    num_keys = key.shape[2] if mask_BTK is None else mask_BTK.shape[2]
    if key.shape[:2] != (batch, num_kv_heads) or key.shape[-1] != head_dim or value.shape[:-1] != key.shape[:-1] \
            or num_keys > key.shape[2] or num_rows % num_tokens:
        raise ValueError(f"ragged_attention: query {tuple(query_BHGD.shape)}, keys {tuple(key.shape)}, values "
                         f"{tuple(value.shape)}, {num_tokens} tokens, rows up to {num_keys} keys do not fit together")
    if mask_BTK is not None and (mask_BTK.dtype != torch.bool or mask_BTK.shape[:2] != (batch, num_tokens)):
        raise ValueError(f"ragged_attention: the mask must be bool [{batch}, {num_tokens}, <= {key.shape[2]}], got "
                         f"{mask_BTK.dtype} {tuple(mask_BTK.shape)}")
    if head_dim % 32 == 0 and query_BHGD.dtype in _avx2_kernels():  # in transformers' layout, [B, Hq, T, D]
        if num_keys < key.shape[2]:
            key, value = key[:, :, :num_keys], value[:, :, :num_keys]
        query_BHTD = query_BHGD.reshape(batch, -1, num_tokens, head_dim)
        out_BTHD = grouped_attention(query_BHTD, key, value, mask_BTK, scale)
        return out_BTHD.transpose(1, 2).reshape(query_BHGD.shape)
    query_BHGD = query_BHGD.contiguous()
    out = torch.empty_like(query_BHGD)
    if mask_BTK is not None:
        if mask_BTK.stride(-1) != 1:
            mask_BTK = mask_BTK.contiguous()
        mask_args = (mask_BTK.data_ptr(), mask_BTK.stride(0), mask_BTK.stride(1))
    else:
        mask_args = (None, 0, 0)
    name = "ragged_attention_bf16" if query_BHGD.dtype == torch.bfloat16 else "ragged_attention_f32"
    getattr(_library(), name)(query_BHGD.data_ptr(), key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1),
                              value.stride(0), value.stride(1), *mask_args, num_keys, batch, num_kv_heads,
                              num_rows // num_tokens, num_tokens, head_dim, scale, out.data_ptr())
    return out
