"""The top levels of a shard's suffix array, held in memory: every 2^k-th entry and the first
few tokens of its suffix.

A binary search over n ranks first searches these n / 2^k samples (contiguous, in RAM, their
prefixes compared without touching the token stream unless a pattern agrees with the whole
prefix), then finishes inside one gap of 2^k ranks of the memory-mapped arrays: the first
log2(n) - k steps of every search touch no mapped page, so a cold query reads k + 1 pages of
the suffix array instead of log2(n). The searches themselves are in fanout.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

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
