"""Bit-packed unsigned integer arrays (suffix-array pointers).

A shard of n token positions needs only ceil(log2 n) bits per suffix-array pointer: 26 bits for
a 50M-token shard, against the 32 (or 40) bits of a byte-aligned pointer. Values are stored
little-endian in a stream of uint64 words, element i occupying bits [i*w, (i+1)*w). One spare
word at the end lets every read fetch two words without a bounds check.
"""

import numba as nb
import numpy as np


def width_for(max_value: int) -> int:
    """Bits needed to store every value in [0, max_value]."""
    return max(1, int(max_value).bit_length())


def n_words(count: int, width: int) -> int:
    return (count * width + 63) // 64 + 1


@nb.njit(cache=True, nogil=True)
def pack_into(values, width, words, start):
    """Write values (int array) as elements start, start+1, ... of the packed stream."""
    mask = (np.uint64(1) << np.uint64(width)) - np.uint64(1)
    w = np.uint64(width)
    for j in range(values.shape[0]):
        v = np.uint64(values[j]) & mask
        bit = np.uint64(start + j) * w
        k = bit >> np.uint64(6)
        off = bit & np.uint64(63)
        words[k] |= v << off
        if off + w > np.uint64(64):
            words[k + 1] |= v >> (np.uint64(64) - off)


def pack(values: np.ndarray, width: int) -> np.ndarray:
    """Pack non-negative integers < 2**width into uint64 words. (n,) -> (n_words,)"""
    words = np.zeros(n_words(len(values), width), dtype=np.uint64)
    pack_into(values, width, words, 0)
    return words


@nb.njit(inline="always", nogil=True)
def get(words, width, i):
    """Element i of a packed stream, as int64."""
    w = np.uint64(width)
    bit = np.uint64(i) * w
    k = bit >> np.uint64(6)
    off = bit & np.uint64(63)
    v = words[k] >> off
    if off + w > np.uint64(64):
        v |= words[k + 1] << (np.uint64(64) - off)
    return np.int64(v & ((np.uint64(1) << w) - np.uint64(1)))


@nb.njit(cache=True, nogil=True)
def unpack_range(words, width, lo, hi, out):
    """out[: hi - lo] = elements lo..hi-1."""
    for i in range(lo, hi):
        out[i - lo] = get(words, width, i)


def unpack(words: np.ndarray, width: int, count: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """Elements [lo, hi) as an int64 array."""
    hi = count if hi is None else hi
    out = np.empty(max(0, hi - lo), dtype=np.int64)
    unpack_range(words, width, lo, hi, out)
    return out
