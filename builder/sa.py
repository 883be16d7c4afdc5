"""Suffix arrays for one shard: pydivsufsort over the token stream, separators dropped, packed.

The stream is doc0 SEP doc1 SEP ... with SEP the largest value of the token dtype, so it
compares greater than every vocabulary id: no suffix comparison, and therefore no match or
count, runs across a document end. Suffixes starting at a SEP are never the answer to a query
(queries hold vocabulary ids only), so they are dropped from the array: it has one entry per
real token.
"""

from __future__ import annotations

import numpy as np
import pydivsufsort
from teragram.index import format as fmt
from teragram.index import packed


def suffix_array(tokens: np.ndarray, sep: int) -> np.ndarray:
    """Positions of the non-separator tokens, sorted by their suffixes. (n,) -> (n - #SEP,)"""
    tokens = np.ascontiguousarray(tokens)
    if tokens.size == 0:
        return np.zeros(0, dtype=np.int64)
    sa = pydivsufsort.divsufsort(tokens)
    return sa[tokens[sa] != sep]


def block_max(sa: np.ndarray) -> np.ndarray:
    """Maxima of the suffix array over blocks of 64, 4096 and 262144 ranks, concatenated.

    Used by the engine to find the most recent occurrence (largest position) of an n-gram in
    its suffix-array interval in O(block sizes) instead of O(count).
    """
    levels = []
    cur = np.asarray(sa, dtype=np.int64)
    prev_block = 1
    for b in fmt.SAMAX_BLOCKS:
        step = b // prev_block
        pad = (-len(cur)) % step
        padded = np.concatenate([cur, np.full(pad, -1, dtype=np.int64)]) if pad else cur
        cur = padded.reshape(-1, step).max(axis=1) if len(padded) else padded
        levels.append(cur)
        prev_block = b
    out = np.concatenate(levels) if levels else np.zeros(0, dtype=np.int64)
    return out


def write_shard_arrays(shard_dir, tokens: np.ndarray, sep: int, vocab: int) -> dict:
    """Build and write sa.bin, samax.bin and unigram.bin for a shard; returns their statistics."""
    sa = suffix_array(tokens, sep)
    n_positions = len(tokens)
    width = packed.width_for(max(n_positions - 1, 0))
    fmt.write_packed(shard_dir / "sa.bin", "sa", packed.pack(sa, width), width, len(sa))
    bm = block_max(sa)
    bm_dtype = np.uint32 if n_positions < 2**32 else np.uint64
    fmt.write_array(shard_dir / "samax.bin", "samax", bm.astype(bm_dtype))
    real = tokens[tokens != sep]
    fmt.write_array(shard_dir / "unigram.bin", "unigram", np.bincount(real, minlength=vocab).astype(np.uint64))
    return {"sa_entries": int(len(sa)), "sa_width": width}
