"""The search of a reply store: frequency-scored continuations of a context, SuffixDecoding's way.

A `SuffixIndex` is token sequences, each followed by SEPARATOR, and the suffix array of their
tokens (the positions of every non-separator token, sorted by the suffix that starts there):
the reply store's files (heads/artefacts/reply_store.py, memory-mapped), one segment of the
replies a server learns as it serves, or one request's prompt (serving/decode/store.py).

`propose(groups, context, settings)` drafts one chain for a context. Each group is a list of
indexes searched as one body of text (the store and the learned replies; a request's prompt):

1. For every match length m up to max_match, the suffix-array range of the context's last m
   tokens in each index (two binary searches per length). Their occurrence count, summed over
   the group, can only fall as m grows; the longest m with any occurrence is the match.
2. Candidates: from the longest match down to min_match, each length where the count changes
   (a length whose count equals the next longer one's has the same occurrences, shifted, and a
   shorter cap: it cannot score higher), at most max_candidates of them.
3. A candidate's chain, token by token, from its occurrences (at most max_occurrences per index,
   evenly spaced over the range, each weighing range / taken, so an index keeps its share): the
   next token with the largest weight among the occurrences that followed the chain so far
   (ties: the smallest id); its probability is that weight's share times its parent's. The chain
   stops where the most likely next step ends the reply, where the probability would fall under
   min_probability, or at its cap: ceil(tokens_per_match x m) tokens, at most num_tokens (a
   long match earns a long draft, a short one a short draft).
4. A candidate's score is the sum of its tokens' probabilities (the tokens it expects to get
   accepted); the best over all groups and lengths is proposed (ties: the longer match, the
   earlier group).

Step 1 finds the longest match by bisection on m (a suffix that occurs has every shorter one
occur), then only the lengths the candidates need. The search runs as native code (one C call
per context, built once per machine by heads/target/cpu_kernels.py `compile_library`): about
30 us a context on a 1M-token store, where the same rule in Python takes about 1.5 ms
(`python -m specheads.bench.tools.reply_store_cost`). Without a C compiler the Python rule runs
(`propose_reference`), with identical results (tests/heads/test_suffix_search.py compares them).
"""

from __future__ import annotations

import ctypes
import math
import threading
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Sequence

import numpy as np

SEPARATOR = 0xFFFFFFFF  # ends every sequence; above every token id, so it sorts last


@dataclass(frozen=True)
class SearchSettings:
    """num_tokens: the longest chain; max_match / min_match: the longest context suffix matched
    and the shortest that proposes; max_occurrences: occurrences read per index and candidate;
    min_probability: a chain stops before a token below it; tokens_per_match: the chain's cap
    per matched token; max_candidates: match lengths scored."""

    num_tokens: int = 10
    max_match: int = 16
    min_match: int = 2
    max_occurrences: int = 64
    min_probability: float = 0.1
    tokens_per_match: float = 1.0
    max_candidates: int = 4


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # the chain, [] for none
    match: int  # the match length it continues (0: none)
    score: float  # its tokens' probabilities summed
    group: int  # the group it came from (-1: none)


NONE = Proposal([], 0, 0.0, -1)


class SuffixIndex:
    """Sequences and their suffix array (module doc). tokens: [N] uint32 values (big-endian
    '>u4' where they come from a store file, native otherwise), every sequence followed by
    SEPARATOR, the last entry one; suffix_array: [num_suffixes] int32 or int64 positions."""

    def __init__(self, tokens: np.ndarray, suffix_array: np.ndarray):
        if tokens.dtype not in (np.dtype(">u4"), np.dtype("<u4")) or suffix_array.dtype not in \
                (np.dtype("<i4"), np.dtype("<i8")):
            raise ValueError(f"a suffix index takes uint32 tokens and int32/int64 positions, got {tokens.dtype} "
                             f"and {suffix_array.dtype}")
        self.tokens = tokens
        self.suffix_array = suffix_array
        self.num_suffixes = int(suffix_array.shape[0])
        self.num_tokens = int(tokens.shape[0])
        # what the native search reads (C's Index): where the arrays are, their sizes and layouts
        self.record = (tokens.ctypes.data, suffix_array.ctypes.data, self.num_tokens, self.num_suffixes,
                       int(tokens.dtype.byteorder == ">"), int(suffix_array.dtype.itemsize == 8))

    @classmethod
    def build(cls, sequences: Sequence[Sequence[int]]) -> "SuffixIndex":
        """An index of `sequences` (lists of token ids; empty ones are left out)."""
        parts = [np.asarray(seq, dtype=np.int64) for seq in sequences if len(seq)]
        if not parts:
            return cls(np.full(1, SEPARATOR, dtype="<u4"), np.zeros(0, dtype="<i8"))
        return cls.of_tokens(separated(parts))

    @classmethod
    def of_tokens(cls, tokens: np.ndarray) -> "SuffixIndex":
        """An index of `tokens` ([N] '<u4', sequences each followed by SEPARATOR: `separated`)."""
        return cls(tokens, suffix_positions(tokens).astype("<i8"))

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """[lo, hi): the suffix-array range of the suffixes that start with `pattern`, narrowed
        token by token (the range of pattern[:k + 1] lies inside that of pattern[:k])."""
        lo, hi = 0, self.num_suffixes
        tokens = self.tokens
        for offset, token in enumerate(pattern):
            def at(position, offset=offset):  # the suffix's token at `offset`; -1 past the end sorts first
                position = int(position) + offset
                return int(tokens[position]) if position < tokens.shape[0] else -1

            lo, hi = bisect_left(self.suffix_array, token, lo, hi, key=at), \
                bisect_right(self.suffix_array, token, lo, hi, key=at)
            if lo >= hi:
                return lo, lo
        return lo, hi


def separated(sequences: Sequence[np.ndarray]) -> np.ndarray:
    """[sum of lengths + len(sequences)] '<u4': each sequence (non-empty, int ids) followed by
    SEPARATOR, the layout of every index (and of a store's tokens.bin)."""
    ends = np.cumsum([sequence.size + 1 for sequence in sequences]) - 1  # each sequence's separator
    return np.insert(np.concatenate(sequences), ends - np.arange(len(sequences)), SEPARATOR).astype("<u4")


def suffix_positions(tokens: np.ndarray) -> np.ndarray:
    """[N] int64: the suffix array of `separated` tokens, without the separators' positions (a
    match never starts on one)."""
    order = suffix_array(tokens)
    return order[tokens[order] != SEPARATOR]


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """[N] int64: the positions of `tokens` ([N] unsigned ids) sorted by the suffix starting
    there (a suffix that ends first sorts first), by prefix doubling: after the round of width k
    every position's rank orders its first 2k tokens. O(N log N) per round, one round per
    doubling of the longest repeat."""
    num = int(tokens.shape[0])
    if num == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64).reshape(-1)
    width = 1
    while True:
        second = np.zeros(num, dtype=np.int64)  # 0: past the end, before every real rank
        second[:num - width] = rank[width:] + 1
        key = rank * (num + 1) + second
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        new_rank = np.empty(num, dtype=np.int64)
        new_rank[order] = np.concatenate([[0], np.cumsum(sorted_key[1:] != sorted_key[:-1])])
        rank = new_rank
        if int(rank.max()) == num - 1 or width >= num:
            return order
        width *= 2


# --- the rule in Python (module doc) -------------------------------------------------------


def propose_reference(groups: Sequence[Sequence[SuffixIndex]], context: Sequence[int],
                      settings: SearchSettings) -> Proposal:
    """The module doc's rule, written plainly: the fallback without a C compiler, and the
    reference the native search is tested against."""
    width = min(settings.max_match, len(context))
    best = NONE
    for group_id, group in enumerate(groups):
        ranges = [[index.find(context[len(context) - m:]) for m in range(1, width + 1)] for index in group]
        counts = [sum(hi - lo for lo, hi in (per[m - 1] for per in ranges)) for m in range(1, width + 1)]
        taken, last_count = 0, -1
        for m in range(width, settings.min_match - 1, -1):
            count = counts[m - 1]
            if count == 0 or count == last_count:
                continue
            last_count = count
            samples = []  # (index, position after the match, weight), in index then range order
            for index, per in zip(group, ranges):
                lo, hi = per[m - 1]
                size = hi - lo
                if size <= 0:
                    continue
                num = min(size, settings.max_occurrences)
                for j in range(num):
                    samples.append((index, int(index.suffix_array[lo + (j * size) // num]) + m, size / num))
            tokens, score = _chain(samples, min(settings.num_tokens, math.ceil(settings.tokens_per_match * m)),
                                   settings.min_probability)
            if tokens and score > best.score:
                best = Proposal(tokens, m, score, group_id)
            taken += 1
            if taken == settings.max_candidates:
                break
    return best


def _chain(samples: list, cap: int, min_probability: float) -> tuple[list[int], float]:
    chain, probability, score = [], 1.0, 0.0
    while len(chain) < cap and samples:
        weights: dict[int, float] = {}
        total = 0.0
        for index, position, weight in samples:
            token = int(index.tokens[position + len(chain)])
            weights[token] = weights.get(token, 0.0) + weight
            total += weight
        token = min(weights, key=lambda t: (-weights[t], t))
        share = probability * (weights[token] / total)
        if token == SEPARATOR or share < min_probability:
            break
        probability = share
        score += probability
        samples = [s for s in samples if int(s[0].tokens[s[1] + len(chain)]) == token]
        chain.append(token)
    return chain, score


# --- the native search ----------------------------------------------------------------------

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#define SEP 0xFFFFFFFFu

typedef struct {
    const uint32_t *tokens; const void *positions; int64_t num_tokens; int64_t num_suffixes;
    int32_t big_endian; int32_t wide;
} Index;

static inline uint32_t tok(const Index *x, int64_t i) {
    if (i >= x->num_tokens) return 0; /* never read: every sequence ends with SEP */
    uint32_t v = x->tokens[i];
    return x->big_endian ? __builtin_bswap32(v) : v;
}
static inline int64_t pos(const Index *x, int64_t k) {
    return x->wide ? ((const int64_t *)x->positions)[k] : (int64_t)((const int32_t *)x->positions)[k];
}
/* the token at offset `at` of the suffix at k, -1 past the end (sorts first) */
static inline int64_t at(const Index *x, int64_t k, int64_t offset) {
    int64_t p = pos(x, k) + offset;
    return p < x->num_tokens ? (int64_t)tok(x, p) : -1;
}

/* [lo, hi) of the suffixes that start with pattern[0..m), narrowed token by token */
static void find(const Index *x, const int64_t *pattern, int64_t m, int64_t *lo_out, int64_t *hi_out) {
    int64_t lo = 0, hi = x->num_suffixes;
    for (int64_t o = 0; o < m && lo < hi; o++) {
        int64_t t = pattern[o], l = lo, r = hi;
        while (l < r) { int64_t mid = l + (r - l) / 2; if (at(x, mid, o) < t) l = mid + 1; else r = mid; }
        int64_t first = l;
        r = hi;
        while (l < r) { int64_t mid = l + (r - l) / 2; if (at(x, mid, o) <= t) l = mid + 1; else r = mid; }
        lo = first; hi = l;
    }
    *lo_out = lo; *hi_out = lo < hi ? hi : lo;
}

typedef struct { const Index *x; int64_t p; double w; } Sample;

/* the chain of one candidate (module doc, step 3) -> its length; its score in *score */
static int64_t chain(Sample *s, int64_t n, int64_t cap, double min_p, int64_t *out, double *score,
                     uint32_t *dtok, double *dw) {
    double prob = 1.0; *score = 0.0;
    int64_t len = 0;
    while (len < cap && n > 0) {
        int64_t nd = 0; double total = 0.0;
        for (int64_t i = 0; i < n; i++) {
            uint32_t t = tok(s[i].x, s[i].p + len);
            int64_t d = 0;
            while (d < nd && dtok[d] != t) d++;
            if (d == nd) { dtok[nd] = t; dw[nd] = 0.0; nd++; }
            dw[d] += s[i].w; total += s[i].w;
        }
        int64_t b = 0;
        for (int64_t d = 1; d < nd; d++) if (dw[d] > dw[b] || (dw[d] == dw[b] && dtok[d] < dtok[b])) b = d;
        double share = prob * (dw[b] / total);
        if (dtok[b] == SEP || share < min_p) break;
        prob = share; *score += prob;
        uint32_t t = dtok[b];
        int64_t kept = 0;
        for (int64_t i = 0; i < n; i++) if (tok(s[i].x, s[i].p + len) == t) s[kept++] = s[i];
        n = kept;
        out[len++] = t;
    }
    return len;
}

typedef struct {
    int64_t num_tokens, max_match, min_match, max_occ, max_candidates;
    double min_p, per_match;
} Params;

typedef struct {  /* sized for num_indexes indexes: ranges 3 * num_indexes * max_match (lo, hi, known), samples
                     and dtok/dw num_indexes * max_occ, out/work num_tokens, info 3 (score, match, group) */
    int64_t *ranges; Sample *samples; uint32_t *dtok; double *dw; int64_t *out; int64_t *work; double *info;
} Work;

/* the occurrences of the context's last m tokens in index k (found once, then remembered) */
static int64_t *range_of(const Index *indexes, int64_t k, int64_t m, const int64_t *context, int64_t context_len,
                         const Params *p, int64_t *ranges) {
    int64_t *r = ranges + 3 * (k * p->max_match + m - 1);
    if (!r[2]) { find(&indexes[k], context + context_len - m, m, r, r + 1); r[2] = 1; }
    return r;
}

static int64_t count_of(const Index *indexes, int64_t first, int64_t last, int64_t m, const int64_t *context,
                        int64_t context_len, const Params *p, int64_t *ranges) {
    int64_t count = 0;
    for (int64_t k = first; k < last; k++) {
        int64_t *r = range_of(indexes, k, m, context, context_len, p, ranges);
        count += r[1] - r[0];
    }
    return count;
}

/* The module doc's rule for one context -> the chain's length (0: none), the chain in w->out.
   indexes[k] belongs to group[k] (groups numbered from 0, each index's group >= the one before). */
int64_t suffix_propose(const Index *indexes, const int32_t *group, int64_t num_indexes, const int64_t *context,
                       int64_t context_len, const Params *p, const Work *w) {
    int64_t width = p->max_match < context_len ? p->max_match : context_len, best_len = 0;
    double best_score = 0.0;
    w->info[0] = 0.0; w->info[1] = 0.0; w->info[2] = -1.0;
    memset(w->ranges, 0, sizeof(int64_t) * 3 * num_indexes * p->max_match);
    for (int64_t first = 0; first < num_indexes;) {
        int64_t last = first;
        while (last < num_indexes && group[last] == group[first]) last++;
        /* the longest match: a suffix that occurs has every shorter one occur, so bisect on m */
        int64_t lo = p->min_match, hi = width, longest = 0;
        while (lo <= hi) {
            int64_t mid = lo + (hi - lo) / 2;
            if (count_of(indexes, first, last, mid, context, context_len, p, w->ranges) > 0) { longest = mid; lo = mid + 1; }
            else hi = mid - 1;
        }
        int64_t taken = 0, last_count = -1;
        for (int64_t m = longest; m >= p->min_match && longest && taken < p->max_candidates; m--) {
            int64_t count = count_of(indexes, first, last, m, context, context_len, p, w->ranges), n = 0;
            if (count == last_count) continue;
            last_count = count;
            for (int64_t k = first; k < last; k++) {
                int64_t *r = range_of(indexes, k, m, context, context_len, p, w->ranges), size = r[1] - r[0];
                if (size <= 0) continue;
                int64_t num = size < p->max_occ ? size : p->max_occ;
                for (int64_t j = 0; j < num; j++) {
                    w->samples[n].x = &indexes[k];
                    w->samples[n].p = pos(&indexes[k], r[0] + (j * size) / num) + m;
                    w->samples[n].w = (double)size / (double)num;
                    n++;
                }
            }
            int64_t cap = (int64_t)ceil(p->per_match * (double)m);
            if (cap > p->num_tokens) cap = p->num_tokens;
            double score;
            int64_t len = chain(w->samples, n, cap, p->min_p, w->work, &score, w->dtok, w->dw);
            if (len > 0 && score > best_score) {
                best_score = score; best_len = len;
                for (int64_t i = 0; i < len; i++) w->out[i] = w->work[i];
                w->info[0] = score; w->info[1] = (double)m; w->info[2] = (double)group[first];
            }
            taken++;
        }
        first = last;
    }
    return best_len;
}
"""


# The C structs as numpy records (building these is microseconds; ctypes structures took a millisecond)
_INDEX = np.dtype([("tokens", "<u8"), ("positions", "<u8"), ("num_tokens", "<i8"), ("num_suffixes", "<i8"),
                   ("big_endian", "<i4"), ("wide", "<i4")])
_PARAMS = np.dtype([(name, "<i8") for name in ("num_tokens", "max_match", "min_match", "max_occ", "max_candidates")]
                   + [("min_p", "<f8"), ("per_match", "<f8")])
SAMPLE_BYTES = 24  # C's Sample: a pointer, an int64, a double

_library = None
_workspaces = threading.local()  # one workspace per thread, grown to the largest call it has seen


def _native():
    """The compiled search, or None (no C compiler: the Python rule runs)."""
    global _library
    if _library is None:
        from specheads.heads.target.cpu_kernels import compile_library

        library = compile_library("suffix_search", SOURCE)
        if library is not None:
            pointer, i64 = ctypes.c_void_p, ctypes.c_int64
            library.suffix_propose.restype = i64
            library.suffix_propose.argtypes = [pointer, pointer, i64, pointer, i64, pointer, pointer]
        _library = library or False
    return _library or None


class _Workspace:
    """The C search's scratch arrays, for up to num_indexes indexes and these settings' sizes;
    `pointers` is C's Work struct (seven pointers)."""

    def __init__(self, num_indexes: int, settings: SearchSettings):
        self.key = (num_indexes, settings.max_match, settings.max_occurrences, settings.num_tokens)
        num_samples = num_indexes * settings.max_occurrences
        self.ranges = np.zeros(3 * num_indexes * settings.max_match, dtype=np.int64)
        self.samples = np.zeros(num_samples * SAMPLE_BYTES, dtype=np.uint8)
        self.dtok = np.zeros(num_samples, dtype=np.uint32)
        self.dw = np.zeros(num_samples, dtype=np.float64)
        self.out = np.zeros(settings.num_tokens, dtype=np.int64)
        self.work = np.zeros(settings.num_tokens, dtype=np.int64)
        self.info = np.zeros(3, dtype=np.float64)
        self.pointers = np.array([a.ctypes.data for a in (self.ranges, self.samples, self.dtok, self.dw, self.out,
                                                          self.work, self.info)], dtype=np.uint64)

    @staticmethod
    def get(num_indexes: int, settings: SearchSettings) -> "_Workspace":
        """This thread's workspace, large enough."""
        have = getattr(_workspaces, "one", None)
        need = (num_indexes, settings.max_match, settings.max_occurrences, settings.num_tokens)
        if have is None or any(n > h for n, h in zip(need, have.key)):
            size = need if have is None else tuple(max(n, h) for n, h in zip(need, have.key))
            have = _workspaces.one = _Workspace(size[0], SearchSettings(num_tokens=size[3], max_match=size[1],
                                                                        max_occurrences=size[2]))
        return have


class Searcher:
    """`propose` over a fixed list of groups, with the native call's arguments built once."""

    def __init__(self, groups: Sequence[Sequence[SuffixIndex]], settings: SearchSettings, native: bool = True):
        self.groups = [list(group) for group in groups]
        self.settings = settings
        self.library = _native() if native else None
        self._indexes = [index for group in self.groups for index in group]  # kept alive while the C side reads them
        if self.library is None or not self._indexes:
            return
        self._records = np.array([index.record for index in self._indexes], dtype=_INDEX)
        self._group = np.array([g for g, group in enumerate(self.groups) for _ in group], dtype=np.int32)
        s = settings
        self._params = np.array((s.num_tokens, s.max_match, s.min_match, s.max_occurrences, s.max_candidates,
                                 s.min_probability, s.tokens_per_match), dtype=_PARAMS)

    def propose(self, context: Sequence[int]) -> Proposal:
        s = self.settings
        if self.library is None or not self._indexes:
            return propose_reference(self.groups, context, s)
        context_arr = np.ascontiguousarray(context[-s.max_match:], dtype=np.int64)
        work = _Workspace.get(len(self._indexes), s)
        length = self.library.suffix_propose(self._records.ctypes.data, self._group.ctypes.data, len(self._indexes),
                                             context_arr.ctypes.data, context_arr.shape[0], self._params.ctypes.data,
                                             work.pointers.ctypes.data)
        if not length:
            return NONE
        return Proposal(work.out[:length].tolist(), int(work.info[1]), float(work.info[0]), int(work.info[2]))
