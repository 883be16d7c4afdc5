"""Longest matches of every position of one shard in another, by a merge-join of their sorted
suffix arrays: linear in both shards, with no binary search per position.

For position t of shard S: L(t), the longest suffix of t's document ending at t (at most cap
tokens) that occurs in shard O, and [lo, hi), that suffix's interval of O's suffix array
((0, n_O) where L = 0, (0, 0) at separators): the same answers as searching O position by
position (``index.kernels.match_lengths``).

  1. merge   walk S's and O's suffix arrays together, comparing at most cap tokens (never
             past a SEP): each S suffix p gets its insertion rank ins[p] among O's suffixes
             and its common prefix with the O suffixes either side, whose maximum is the
             longest prefix of p occurring in O (matching statistics);
  2. lengths L(t) from the matching statistics (``feature_kernels.match_lengths_from_ms``);
  3. bounds  the interval of T[t-L+1..t] is the run of O ranks around ins[t-L+1] whose
             common prefix stays >= L: a left and a right sweep over O's capped lcp array,
             with a stack of previous (next) smaller values, answer every t in S's rank order.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from teragram.index import packed
from teragram.index.engine import Index

from . import feature_kernels as FK

_NB = dict(cache=True, nogil=True)


@nb.njit(inline="always")
def lcp_cmp(TA, a, TB, b, cap, sep):
    """(common prefix, sign): sign < 0 if suffix a < suffix b within cap tokens, 0 if they
    agree on cap tokens or through a SEP, > 0 otherwise."""
    k = 0
    while k < cap:
        x = TA[a + k]
        y = TB[b + k]
        if x != y:
            return k, -1 if x < y else 1
        if x == sep:
            return k, 0
        k += 1
    return cap, 0


@nb.njit(**_NB)
def adjacent_lcp(T, sa, cap, sep, lcp):
    """lcp[r] = capped common prefix of ranks r-1 and r (lcp[0] = 0); lcp has len(sa) + 1
    entries, the last 0 (the end of the array bounds every run)."""
    lcp[0] = 0
    for r in range(1, sa.shape[0]):
        lcp[r] = lcp_cmp(T, sa[r - 1], T, sa[r], cap, sep)[0]
    lcp[sa.shape[0]] = 0


@nb.njit(**_NB)
def merge_join(TS, saS, TO, saO, cap, sep, ins, la, lb, ms):
    """Per S position p: ins[p] (O suffixes before it), la[p] / lb[p] (common prefix with the
    O suffixes at ranks ins-1 / ins), ms[p] = max of the two."""
    j = 0
    nO = saO.shape[0]
    for r in range(saS.shape[0]):
        p = saS[r]
        while j < nO and lcp_cmp(TO, saO[j], TS, p, cap, sep)[1] < 0:
            j += 1
        ins[p] = j
        a = lcp_cmp(TS, p, TO, saO[j - 1], cap, sep)[0] if j > 0 else 0
        b = lcp_cmp(TS, p, TO, saO[j], cap, sep)[0] if j < nO else 0
        la[p] = a
        lb[p] = b
        ms[p] = a if a > b else b


@nb.njit(inline="always")
def _below(stack_r, stack_v, size, lam):
    """Rank of the topmost stack entry whose value is < lam (values increase upward; the
    bottom entry has value 0, below every lam >= 1)."""
    lo = 0
    hi = size  # answer in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if stack_v[mid] < lam:
            lo = mid
        else:
            hi = mid
    return stack_r[lo]


@nb.njit(inline="always")
def _push(stack_r, stack_v, size, r, v):
    while size > 0 and stack_v[size - 1] >= v:
        size -= 1
    stack_r[size] = r
    stack_v[size] = v
    return size + 1


@nb.njit(**_NB)
def bounds(saS, L, first_t, ins, la, lb, lcpO, cap, lo, hi):
    """lo[t], hi[t] for every t with L[t] > 0, walking S's ranks forward (lo) then backward (hi)."""
    nS = saS.shape[0]
    nO = lcpO.shape[0] - 1
    stack_r = np.empty(cap + 2, np.int64)
    stack_v = np.empty(cap + 2, np.int64)
    size = 0
    nxt = 0
    for rs in range(nS):
        p = saS[rs]
        t = first_t[p]
        if t < 0:
            continue
        j = ins[p]
        while nxt < j:  # the previous-smaller stack over O ranks 0..j-1
            size = _push(stack_r, stack_v, size, nxt, lcpO[nxt])
            nxt += 1
        while t < L.shape[0] and L[t] > 0 and t - L[t] + 1 == p:
            lo[t] = j if la[p] < L[t] else _below(stack_r, stack_v, size, L[t])
            t += 1
    size = 0
    nxt = nO
    for rs in range(nS - 1, -1, -1):
        p = saS[rs]
        t = first_t[p]
        if t < 0:
            continue
        j = ins[p]
        while nxt > j:  # the next-smaller stack over O ranks nO..j+1
            size = _push(stack_r, stack_v, size, nxt, lcpO[nxt])
            nxt -= 1
        while t < L.shape[0] and L[t] > 0 and t - L[t] + 1 == p:
            hi[t] = j if lb[p] < L[t] else _below(stack_r, stack_v, size, L[t])
            t += 1


@nb.njit(**_NB)
def _first_t(L, first_t):
    for t in range(L.shape[0]):
        if L[t] > 0:
            p = t - L[t] + 1
            if first_t[p] < 0:
                first_t[p] = t


def _unpacked_sa(shard) -> np.ndarray:
    out = np.empty(shard.sa.count, np.int64)
    packed.unpack_range(shard.sa.words, shard.sa.width, 0, shard.sa.count, out)
    return out


def other_shard_matches(idx: Index, shard: int, other: int, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(L, lo, hi), each (n_positions of shard,) int64: the longest match of every position of
    `shard` in shard `other` and its interval there (documents matched separately)."""
    s, o = idx.shards[shard], idx.shards[other]
    TS, TO = np.asarray(s.tok), np.asarray(o.tok)
    n = len(TS)
    saS, saO = _unpacked_sa(s), _unpacked_sa(o)
    lcpO = np.empty(len(saO) + 1, np.uint8)
    adjacent_lcp(TO, saO, cap, idx.sep, lcpO)
    ins = np.zeros(n, np.int64)
    la = np.zeros(n, np.uint8)
    lb = np.zeros(n, np.uint8)
    ms = np.zeros(n, np.uint8)
    merge_join(TS, saS, TO, saO, cap, idx.sep, ins, la, lb, ms)
    L = np.zeros(n, np.int64)
    FK.match_lengths_from_ms(ms, np.asarray(s.starts).astype(np.int64), cap, L)
    del ms
    first_t = np.full(n, -1, np.int64)
    _first_t(L, first_t)
    lo = np.zeros(n, np.int64)
    hi = np.zeros(n, np.int64)
    bounds(saS, L, first_t, ins, la, lb, lcpO, cap, lo, hi)
    zero = (L == 0) & (TS != idx.sep)
    hi[zero] = len(saO)
    return L, lo, hi


# ---- all shards at once: one suffix array of the whole index, by merging --------------------
#
# Every exclude-doc or causal feature of a position depends only on the order of the index's
# suffixes up to `cap` tokens (never through a SEP) and on their common prefixes: the merge of
# the shards' suffix arrays, with its lcp array, is that of one shard holding the whole index,
# and the one-shard kernels answer every shard from it. A pair of shards costs a merge-join of
# both; merging all of them in a balanced tree costs log2(shards) passes over the index.
#
# Merging uses "key lcps": the key of a suffix is its first tokens up to cap or through its
# SEP; K(x, y) is the position where the keys of x and y differ, or KEY_EQUAL where they are
# equal (common prefix cap, or both reach a SEP there). Adjacent key lcps of two sorted lists
# decide most steps of the merge without reading a token (the lcp-merge of Ng and Kakehi).

KEY_EQUAL = 255  # a key lcp never reaches it otherwise: cap <= 255, so differences are < 255


@nb.njit(**_NB)
def key_lengths(T, sep, cap, out):
    """out[p] = the length of p's key: tokens before the next SEP, at most cap."""
    d = 0
    for p in range(T.shape[0] - 1, -1, -1):
        if T[p] == sep:
            d = 0
        elif d < cap:
            d += 1
        out[p] = d


@nb.njit(**_NB)
def key_lcp(sa, lcp, klen, out):
    """Key lcps of adjacent ranks from capped, SEP-stopped lcps (kasai_capped's): equal keys
    where the common prefix is both suffixes' whole key."""
    if sa.shape[0]:
        out[0] = 0
    for r in range(1, sa.shape[0]):
        h = lcp[r]
        out[r] = KEY_EQUAL if h == klen[sa[r]] and h == klen[sa[r - 1]] else h


@nb.njit(**_NB)
def lcp_from_key_lcp(sa, h, klen, lcp):
    """Back to capped, SEP-stopped lcps (in place allowed): equal keys share the whole key."""
    for r in range(sa.shape[0]):
        lcp[r] = klen[sa[r]] if h[r] == KEY_EQUAL else h[r]


@nb.njit(inline="always")
def _key_cmp_from(T, x, y, k, cap, sep):
    """(K(x, y), whether x goes first: x < y or equal keys), knowing the keys agree up to k."""
    while k < cap:
        a = T[x + k]
        b = T[y + k]
        if a != b:
            return k, a < b
        if a == sep:
            return KEY_EQUAL, True
        k += 1
    return KEY_EQUAL, True


@nb.njit(**_NB)
def lcp_merge(T, A, hA, B, hB, cap, sep, C, hC):
    """Merge the key-sorted suffix lists A and B (positions in T, adjacent key lcps hA, hB)
    into C with its key lcps hC; equal keys keep A's first. kl = K(A[i], B[j]) and which of
    the two goes first are carried from step to step: the next head's key lcp with the one
    just taken decides against kl which goes next, and tokens are read only on a tie with kl
    (from position kl on), as in the lcp-merge of Ng and Kakehi."""
    na = A.shape[0]
    nb_ = B.shape[0]
    i = 0
    j = 0
    o = 0
    pa = 0  # K(last output, A[i]) and K(last output, B[j]): the next output's key lcp
    pb = 0
    kl, a_first = _key_cmp_from(T, A[0], B[0], 0, cap, sep) if na > 0 and nb_ > 0 else (0, True)
    while i < na and j < nb_:
        if a_first:
            C[o] = A[i]
            hC[o] = pa
            o += 1
            pb = kl
            i += 1
            if i < na:
                h = hA[i]
                pa = h
                if h < kl:  # A[i] leaves A[i-1] (and so B[j]) upward before kl
                    kl = h
                    a_first = False
                elif h == kl and kl != KEY_EQUAL:
                    kl, a_first = _key_cmp_from(T, A[i], B[j], kl, cap, sep)
                # h > kl: A[i] still below B[j], at kl; both KEY_EQUAL: still a tie
        else:
            C[o] = B[j]
            hC[o] = pb
            o += 1
            pa = kl
            j += 1
            if j < nb_:
                h = hB[j]
                pb = h
                if h < kl:
                    kl = h
                    a_first = True
                elif h == kl:
                    kl, a_first = _key_cmp_from(T, A[i], B[j], kl, cap, sep)
    while i < na:
        C[o] = A[i]
        hC[o] = pa
        o += 1
        i += 1
        if i < na:
            pa = hA[i]
    while j < nb_:
        C[o] = B[j]
        hC[o] = pb
        o += 1
        j += 1
        if j < nb_:
            pb = hB[j]


def shard_key_lcps(T: np.ndarray, sa: np.ndarray, klen: np.ndarray, cap: int, sep: int) -> np.ndarray:
    """Key lcps of adjacent ranks of one shard (T, sa, klen: the shard's own), by Kasai."""
    rank = np.empty(len(T), sa.dtype)
    FK.rank_and_doc(sa, np.array([0, len(T)], np.int64), rank, np.empty(len(T), np.int32), np.empty(len(sa), np.int32))
    h = np.empty(len(sa), np.uint8)
    FK.kasai_capped(T, sa, rank, sep, cap, h)
    key_lcp(sa, h, klen, h)
    return h


def merged_suffix_array(T: np.ndarray, parts: list[tuple[np.ndarray, np.ndarray]], cap: int, sep: int) -> tuple[np.ndarray, np.ndarray]:
    """(sa, h): the key-sorted merge of the suffix lists `parts` ((positions in T, their key
    lcps) each), merged pairwise in a balanced tree; parts are consumed."""
    parts = list(parts)
    while len(parts) > 1:
        nxt = []
        for a in range(0, len(parts) - 1, 2):
            (A, hA), (B, hB) = parts[a], parts[a + 1]
            C = np.empty(len(A) + len(B), A.dtype)
            hC = np.empty(len(C), np.uint8)
            lcp_merge(T, A, hA, B, hB, cap, sep, C, hC)
            nxt.append((C, hC))
            parts[a] = parts[a + 1] = None  # free the inputs as the level goes
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0]
