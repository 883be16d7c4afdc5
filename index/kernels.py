"""Numba kernels of the query engine, over one shard's memory-mapped arrays.

Arguments shared by most kernels:
  tok    (n_positions,) uint16/uint32  token stream doc0 SEP doc1 SEP ...
  words  (n_words,) uint64             bit-packed suffix array (width w, n entries)
  q      (m,) int64                    pattern; never contains SEP, so comparisons stop at a
                                       document end and never read past the stream's last SEP
An interval [lo, hi) is a range of suffix-array ranks whose suffixes share a known prefix.
"""

import numba as nb
import numpy as np

from .packed import get

_NB = dict(cache=True, nogil=True)


@nb.njit(**_NB)
def bound(tok, words, w, lo, hi, q, m, d, upper):
    """First rank in [lo, hi) whose suffix's first m tokens are >= q (> q if upper).

    All suffixes in [lo, hi) are known to share q[:d]; comparisons start at offset
    min(lcp with the left boundary, lcp with the right boundary) (Manber-Myers).
    """
    L = lo
    R = hi
    llcp = d
    rlcp = d
    while L < R:
        mid = (L + R) >> 1
        p = get(words, w, mid)
        k = llcp if llcp < rlcp else rlcp
        while k < m and tok[p + k] == q[k]:
            k += 1
        if k == m:
            less = upper
        else:
            less = tok[p + k] < q[k]
        if less:
            L = mid + 1
            llcp = k
        else:
            R = mid
            rlcp = k
    return L


@nb.njit(**_NB)
def find(tok, words, w, n, q, m):
    """Suffix-array interval of pattern q[:m] in the whole shard."""
    if m == 0:
        return 0, n
    lo = bound(tok, words, w, 0, n, q, m, 0, False)
    hi = bound(tok, words, w, lo, n, q, m, 0, True)
    return lo, hi


@nb.njit(**_NB)
def narrow(tok, words, w, lo, hi, d, c):
    """Sub-interval of [lo, hi) (all sharing a prefix of length d) whose token at offset d is c."""
    L = lo
    R = hi
    while L < R:
        mid = (L + R) >> 1
        if tok[get(words, w, mid) + d] < c:
            L = mid + 1
        else:
            R = mid
    start = L
    R = hi
    while L < R:
        mid = (L + R) >> 1
        if tok[get(words, w, mid) + d] <= c:
            L = mid + 1
        else:
            R = mid
    return start, L


@nb.njit(**_NB)
def block_end(tok, words, w, r, hi, d):
    """End of the block of ranks from r (< hi) whose token at offset d equals rank r's: a
    galloping search, O(log block) steps."""
    c = tok[get(words, w, r) + d]
    step = 1
    while r + step < hi and tok[get(words, w, r + step) + d] == c:
        step <<= 1
    L = r + (step >> 1) + 1 if step > 1 else r + 1
    R = r + step if r + step < hi else hi
    while L < R:
        mid = (L + R) >> 1
        if tok[get(words, w, mid) + d] == c:
            L = mid + 1
        else:
            R = mid
    return L


@nb.njit(**_NB)
def next_token_blocks(tok, words, w, lo, hi, d, out_tok, out_cnt):
    """Exact next-token histogram of the interval [lo, hi) (prefix length d).

    In a suffix array the suffixes of an interval are sorted by their token at offset d, so
    each distinct next token is one contiguous block (block_end). Cost O(k log(count)) for k
    distinct tokens, not O(count).
    Returns k; out_tok[:k] ascending (SEP, meaning end of document, last), out_cnt[:k]; -1
    if there are more distinct tokens than out_tok holds.
    """
    k = 0
    r = lo
    while r < hi:
        if k == out_tok.shape[0]:
            return -1
        e = block_end(tok, words, w, r, hi, d)
        out_tok[k] = tok[get(words, w, r) + d]
        out_cnt[k] = e - r
        k += 1
        r = e
    return k


@nb.njit(**_NB)
def range_max(words, w, samax, off2, off3, lo, hi):
    """Largest suffix-array value (most recent position) over ranks [lo, hi); -1 if empty.

    samax holds block maxima for blocks of 64 ranks, then 4096, then 262144 (level offsets
    off2, off3). Cost: at most ~63 entries per level edge plus n/262144 top-level blocks.
    """
    best = -1
    r = lo
    # level 0: single ranks up to a 64-boundary
    while r < hi and (r & 63) != 0:
        v = get(words, w, r)
        if v > best:
            best = v
        r += 1
    # level 1: 64-blocks up to a 4096-boundary
    while r + 64 <= hi and (r & 4095) != 0:
        v = np.int64(samax[r >> 6])
        if v > best:
            best = v
        r += 64
    # level 2: 4096-blocks up to a 262144-boundary
    while r + 4096 <= hi and (r & 262143) != 0:
        v = np.int64(samax[off2 + (r >> 12)])
        if v > best:
            best = v
        r += 4096
    # level 3: 262144-blocks
    while r + 262144 <= hi:
        v = np.int64(samax[off3 + (r >> 18)])
        if v > best:
            best = v
        r += 262144
    # back down on the right side
    while r + 4096 <= hi:
        v = np.int64(samax[off2 + (r >> 12)])
        if v > best:
            best = v
        r += 4096
    while r + 64 <= hi:
        v = np.int64(samax[r >> 6])
        if v > best:
            best = v
        r += 64
    while r < hi:
        v = get(words, w, r)
        if v > best:
            best = v
        r += 1
    return best


@nb.njit(**_NB)
def match_lengths(tok, words, w, n, ids, max_len, out_len, out_lo, out_hi):
    """For every position t of ids: the longest l <= max_len such that ids[t-l+1..t] occurs in
    the shard, and its interval. One pass with two pointers (see match_step): the match start
    only moves right, so each position costs one narrowing, plus a fresh search when it moves.
    """
    state = np.array([0, 0, n], np.int64)
    for t in range(ids.shape[0]):
        out_len[t], out_lo[t], out_hi[t] = match_step(tok, words, w, n, ids, t, max_len, state)


@nb.njit(**_NB)
def first_unordered(tok, words, w, ranks, sep):
    """First rank r in `ranks` with suffix(SA[r]) > suffix(SA[r+1]) or a bad pointer; -1 if none.

    Suffixes compare token by token; two suffixes reaching a separator together are equal as
    far as any query can tell and count as ordered.
    """
    n_tok = tok.shape[0]
    for i in range(ranks.shape[0]):
        r = ranks[i]
        a = get(words, w, r)
        b = get(words, w, r + 1)
        if a >= n_tok or b >= n_tok or tok[a] == sep or tok[b] == sep:
            return r
        k = 0
        while a + k < n_tok and b + k < n_tok:
            x = tok[a + k]
            y = tok[b + k]
            if x != y:
                if x > y:
                    return r
                break
            if x == sep:
                break
            k += 1
    return -1


@nb.njit(**_NB)
def match_step(tok, words, w, n, ids, t, max_len, state):
    """Longest match ending at position t of ids (ids[:t+1] known) and its interval, with the
    two-pointer state [i, lo, hi] (match start, interval of ids[i:t]) carried between calls.

    Extending by ids[t] narrows the interval by one token; when that fails the start advances
    and the interval of the shorter pattern is found again from scratch. Used for every
    position of a sequence (match_lengths) and one token at a time while generating."""
    i = state[0]
    lo = state[1]
    hi = state[2]
    while True:
        if t - i + 1 > max_len:
            i += 1
            lo, hi = find(tok, words, w, n, ids[i:t], t - i)
        a, b = narrow(tok, words, w, lo, hi, t - i, ids[t])
        if b > a:
            lo = a
            hi = b
            break
        i += 1
        if i > t:
            lo = 0
            hi = n
            break
        lo, hi = find(tok, words, w, n, ids[i:t], t - i)
    L = t - i + 1
    if i > t:
        L = 0
        i = t + 1
        lo = 0
        hi = n
    state[0] = i
    state[1] = lo
    state[2] = hi
    return L, lo, hi
