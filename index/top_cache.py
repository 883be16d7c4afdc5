"""The top levels of a shard's suffix array, held in memory: every 2^k-th entry and the first
few tokens of its suffix.

A binary search over n ranks first searches these n / 2^k samples (contiguous, in RAM, their
prefixes compared without touching the token stream unless a pattern agrees with the whole
prefix), then finishes inside one gap of 2^k ranks of the memory-mapped arrays: the first
log2(n) - k steps of every search touch no mapped page, so a cold query reads k + 1 pages of
the suffix array instead of log2(n).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from . import kernels as K
from .packed import get

STEP_LOG2 = 10  # a sample every 1024 ranks: 1M samples (~24 MB) for a 2^30-token shard
PREFIX = 8  # tokens of each sample's suffix held with it


@dataclass(frozen=True)
class TopCache:
    pos: np.ndarray  # (S,) int64: suffix-array entries at ranks 0, 2^k, 2*2^k, ...
    prefix: np.ndarray  # (S, PREFIX) token dtype: the first tokens of those suffixes
    step_log2: int


@nb.njit(cache=True, nogil=True)
def _gather(words, width, step_log2, out):
    for i in range(out.shape[0]):
        out[i] = get(words, width, i << step_log2)


def build(tok: np.ndarray, words: np.ndarray, width: int, n: int, step_log2: int = STEP_LOG2) -> TopCache:
    """Read the samples of a shard's suffix array (n entries) and their prefixes."""
    pos = np.empty(-(-n // (1 << step_log2)), dtype=np.int64)
    _gather(words, width, step_log2, pos)
    # every suffix ends at a SEP and the stream ends with one, so reading past it is avoided
    # by clipping at the stream's end (the tokens past a SEP are never compared)
    idx = np.minimum(pos[:, None] + np.arange(PREFIX)[None, :], len(tok) - 1)
    return TopCache(pos, np.asarray(tok)[idx] if len(pos) else np.zeros((0, PREFIX), tok.dtype), step_log2)


@nb.njit(cache=True, nogil=True)
def _sample_ge(tok, pos, prefix, j, q, m, upper):
    """Whether sample j's suffix is >= q[:m] (> q[:m] if upper) in its first m tokens."""
    L = prefix.shape[1]
    p = pos[j]
    for k in range(m):
        t = prefix[j, k] if k < L else tok[p + k]
        if t != q[k]:
            return t > q[k]
    return not upper


@nb.njit(cache=True, nogil=True)
def _bound(tok, words, w, n, pos, prefix, step_log2, q, m, upper):
    """First rank whose suffix is >= q[:m] (> if upper): samples first, then one gap."""
    L = 0
    R = pos.shape[0]
    while L < R:  # first sample that is >= q
        mid = (L + R) >> 1
        if _sample_ge(tok, pos, prefix, mid, q, m, upper):
            R = mid
        else:
            L = mid + 1
    if L == 0:
        return 0
    lo = ((L - 1) << step_log2) + 1
    hi = L << step_log2
    if hi > n:
        hi = n
    return K.bound(tok, words, w, lo, hi, q, m, 0, upper)


@nb.njit(cache=True, nogil=True)
def find(tok, words, w, n, pos, prefix, step_log2, q, m):
    """Suffix-array interval of q[:m], as kernels.find."""
    if m == 0:
        return 0, n
    return _bound(tok, words, w, n, pos, prefix, step_log2, q, m, False), _bound(tok, words, w, n, pos, prefix, step_log2, q, m, True)


@nb.njit(cache=True, nogil=True)
def longest_suffix(tok, words, w, n, pos, prefix, step_log2, q, m):
    """Longest l such that q[m-l:] occurs; returns (l, lo, hi) with its interval.

    Occurrence is monotone in l (a suffix of an occurring string occurs), so a binary search
    over l with one find per probe (through the samples) suffices.
    """
    lo_l = 0
    hi_l = m
    best_lo = 0
    best_hi = n
    while lo_l < hi_l:
        mid = (lo_l + hi_l + 1) >> 1
        a, b = find(tok, words, w, n, pos, prefix, step_log2, q[m - mid :], mid)
        if b > a:
            lo_l = mid
            best_lo = a
            best_hi = b
        else:
            hi_l = mid - 1
    if lo_l == 0:
        return 0, 0, n
    return lo_l, best_lo, best_hi
