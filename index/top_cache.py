"""The top levels of a shard's suffix array, held in memory: every 2^k-th entry and the first
few tokens of its suffix.

A binary search over n ranks first searches these n / 2^k samples (contiguous, in RAM, their
prefixes compared without touching the token stream unless a pattern agrees with the whole
prefix), then finishes inside one gap of 2^k ranks of the memory-mapped arrays: the first
log2(n) - k steps of every search touch no mapped page, so a cold query reads k + 1 pages of
the suffix array instead of log2(n). The searches themselves are in fanout.py.

The builder stores the samples with the shard (top.pos.bin, top.prefix.bin: `write`), so an
index opens without reading its suffix arrays: building them means a strided read of the whole
suffix array (every page of it at this step), seconds per 2^30-token shard on a cold disk. A
shard without them (built before they existed), or whose stored samples do not match its
suffix array at the current step, gets them built in memory on first use (`load` says None).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from . import format as fmt
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


POS_FILE, PREFIX_FILE = "top.pos.bin", "top.prefix.bin"
_CHECKS = 16  # stored samples compared with the suffix array when loaded


def write(shard_dir, tok: np.ndarray, words: np.ndarray, width: int, n: int) -> None:
    """Store a shard's samples (at STEP_LOG2) beside its arrays."""
    from pathlib import Path

    t = build(tok, words, width, n, STEP_LOG2)
    fmt.write_array(Path(shard_dir) / POS_FILE, "top.pos", t.pos)
    fmt.write_array(Path(shard_dir) / PREFIX_FILE, "top.prefix", t.prefix.reshape(-1))


def load(shard_dir, tok: np.ndarray, words: np.ndarray, width: int, n: int) -> TopCache | None:
    """A shard's stored samples, read into memory, if they are there and fit this shard at the
    current STEP_LOG2: their count, type and a few of them checked against the suffix array and
    the tokens (`teragram verify` checks the files' digests); else None."""
    from pathlib import Path

    d = Path(shard_dir)
    if not ((d / POS_FILE).exists() and (d / PREFIX_FILE).exists()):
        return None
    pos = np.array(fmt.open_array(d / POS_FILE, "top.pos"), dtype=np.int64)
    prefix = np.array(fmt.open_array(d / PREFIX_FILE, "top.prefix"))
    S = -(-n // (1 << STEP_LOG2))
    if len(pos) != S or prefix.dtype != tok.dtype or len(prefix) != S * PREFIX:
        return None
    prefix = prefix.reshape(S, PREFIX)
    for i in np.linspace(0, S - 1, min(S, _CHECKS)).astype(np.int64):
        p = get(words, width, int(i) << STEP_LOG2)
        if pos[i] != p or not np.array_equal(prefix[i], np.asarray(tok[np.minimum(p + np.arange(PREFIX), len(tok) - 1)])):
            return None
    return TopCache(pos, prefix, STEP_LOG2)
