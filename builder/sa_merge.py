"""Merge a shard's sorted suffix-array parts into sa.bin, samax.bin and unigram.bin, streaming.

The parts (``sa.parts/NNNN.bin``, sorted in the shard order of ``builder/sa.py``) are read in
fixed-size buffers, each entry with a 64-bit key of its suffix's first tokens, and merged with a
binary heap that compares keys and reads the shard's tokens (memory-mapped: they are the one
thing held whole) only past equal keys. The merged array is bit-packed and its
block maxima computed chunk by chunk: chunks are a multiple of the largest samax block, so each
chunk's maxima are final. Nothing proportional to the shard is held but the tokens.
"""

from __future__ import annotations

from pathlib import Path

import numba as nb
import numpy as np
from teragram.index import format as fmt
from teragram.index import packed
from teragram.index.errors import BuildError
from tqdm import tqdm

from . import sa as sa_mod

CHUNK = fmt.SAMAX_BLOCKS[-1] * 4  # merged entries per output chunk (1M)


_NO_SEP = 0xFFFF  # key flag: no separator among the key's tokens


@nb.njit(cache=True, nogil=True)
def make_keys(tok, sep, key_tokens, bits, positions, keys):
    """keys[i]: the first key_tokens tokens of suffix positions[i] (zeros after a SEP), then
    16 bits holding the offset of that SEP (or _NO_SEP). Keys order suffixes as their tokens
    do, so most comparisons of the merge read no token."""
    for i in range(positions.shape[0]):
        p = positions[i]
        key = np.uint64(0)
        flag = _NO_SEP
        for k in range(key_tokens):
            t = np.uint64(0) if flag != _NO_SEP else np.uint64(tok[p + k])
            if flag == _NO_SEP and tok[p + k] == sep:
                flag = k
            key = (key << np.uint64(bits)) | t
        keys[i] = (key << np.uint64(16)) | np.uint64(flag)


@nb.njit(inline="always")
def _less(tok, sep, key_tokens, bufs, keys, pa, ia, pb, ib):
    """Suffix bufs[pa, ia] before suffix bufs[pb, ib]: by tokens through the SEP, then by
    position (keys first, tokens past the key only when the keys are equal)."""
    ka = keys[pa, ia]
    kb = keys[pb, ib]
    a = bufs[pa, ia]
    b = bufs[pb, ib]
    if ka != kb:
        return ka < kb
    if (ka & np.uint64(0xFFFF)) != np.uint64(_NO_SEP):  # equal through a SEP in the key
        return a < b
    k = key_tokens
    while True:
        x = tok[a + k]
        y = tok[b + k]
        if x != y:
            return x < y
        if x == sep:
            return a < b
        k += 1


@nb.njit(inline="always")
def _head_less(tok, sep, kt, bufs, keys, pos, p, q):
    return _less(tok, sep, kt, bufs, keys, p, pos[p], q, pos[q])


@nb.njit(cache=True, nogil=True)
def _sift_down(tok, sep, kt, heap, size, bufs, keys, pos, i):
    while True:
        c = 2 * i + 1
        if c >= size:
            return
        if c + 1 < size and _head_less(tok, sep, kt, bufs, keys, pos, heap[c + 1], heap[c]):
            c += 1
        if _head_less(tok, sep, kt, bufs, keys, pos, heap[c], heap[i]):
            heap[i], heap[c] = heap[c], heap[i]
            i = c
        else:
            return


@nb.njit(cache=True, nogil=True)
def heapify(tok, sep, kt, heap, size, bufs, keys, pos):
    for i in range(size // 2 - 1, -1, -1):
        _sift_down(tok, sep, kt, heap, size, bufs, keys, pos, i)


@nb.njit(cache=True, nogil=True)
def merge_some(tok, sep, kt, heap, size, bufs, keys, pos, lens, out, n_out):
    """Pop the smallest head into out[n_out:] until out is full or a part's buffer runs out.

    Returns (n_out, size, part): part is the index of the part whose buffer ran out (it has
    been taken off the heap; the caller refills it and pushes it back), or -1.
    """
    while size > 0 and n_out < out.shape[0]:
        p = heap[0]
        out[n_out] = bufs[p, pos[p]]
        n_out += 1
        pos[p] += 1
        if pos[p] == lens[p]:
            size -= 1
            heap[0] = heap[size]
            _sift_down(tok, sep, kt, heap, size, bufs, keys, pos, 0)
            return n_out, size, p
        _sift_down(tok, sep, kt, heap, size, bufs, keys, pos, 0)
    return n_out, size, -1


@nb.njit(cache=True, nogil=True)
def push(tok, sep, kt, heap, size, bufs, keys, pos, p):
    heap[size] = p
    i = size
    while i > 0:
        parent = (i - 1) // 2
        if _head_less(tok, sep, kt, bufs, keys, pos, heap[i], heap[parent]):
            heap[i], heap[parent] = heap[parent], heap[i]
            i = parent
        else:
            break
    return size + 1


class _PartReader:
    """Sequential reads of one part file into a buffer row (no mapping: pages are not kept)."""

    def __init__(self, path: Path, count: int):
        h = fmt.read_header(path)
        if h.kind != "sa.part" or h.count != count:
            raise BuildError(f"{path}: corrupt suffix-array part (holds {h.kind!r} of {h.count}, expected {count}); delete it and rerun")
        self.f = open(path, "rb")
        self.f.seek(fmt.HEADER_SIZE)
        self.dtype = np.dtype(fmt._DTYPES[h.dtype]).newbyteorder("<")
        self.left = count

    def fill(self, row: np.ndarray) -> int:
        k = min(self.left, len(row))
        raw = self.f.read(k * self.dtype.itemsize)
        if len(raw) != k * self.dtype.itemsize:
            raise BuildError(f"{self.f.name}: truncated suffix-array part")
        row[:k] = np.frombuffer(raw, dtype=self.dtype)
        self.left -= k
        return k

    def close(self) -> None:
        self.f.close()


def _levels(chunk: np.ndarray) -> list[np.ndarray]:
    """Block maxima of one chunk at each samax level (blocks padded with -1, as block_max)."""
    out = []
    cur = chunk
    prev = 1
    for b in fmt.SAMAX_BLOCKS:
        step = b // prev
        pad = (-len(cur)) % step
        if pad:
            cur = np.concatenate([cur, np.full(pad, -1, dtype=np.int64)])
        cur = cur.reshape(-1, step).max(axis=1) if len(cur) else cur
        out.append(cur)
        prev = b
    return out


def merge_parts(shard_dir: Path, plan_counts: list[int], tok: np.ndarray, sep: int, width: int, *, progress: bool = False) -> None:
    """Merge the parts into sa.bin and samax.bin (uint32 values below 2^32 positions)."""
    shard_dir = Path(shard_dir)
    total = sum(plan_counts)
    n_parts = len(plan_counts)
    buf_len = max(1024, sa_mod.MERGE_BUFFER_BYTES // 4 // 16 // max(1, n_parts))  # entries and keys: a quarter
    readers = [_PartReader(sa_mod.part_path(shard_dir, i), c) for i, c in enumerate(plan_counts)]
    bufs = np.zeros((n_parts, buf_len), dtype=np.int64)
    keys = np.zeros((n_parts, buf_len), dtype=np.uint64)
    bits = tok.dtype.itemsize * 8
    kt = 48 // bits  # tokens in a key: 3 of 16 bits, 1 of 32

    def fill(i: int) -> int:
        got = readers[i].fill(bufs[i])
        make_keys(tok, sep, kt, bits, bufs[i, :got], keys[i, :got])
        return got

    pos = np.zeros(n_parts, dtype=np.int64)
    lens = np.zeros(n_parts, dtype=np.int64)
    heap = np.zeros(n_parts, dtype=np.int64)
    size = 0
    for i in range(n_parts):
        lens[i] = fill(i)
        if lens[i]:
            heap[size] = i
            size += 1
    heapify(tok, sep, kt, heap, size, bufs, keys, pos)
    out = np.empty(CHUNK, dtype=np.int64)
    levels: list[list[np.ndarray]] = [[] for _ in fmt.SAMAX_BLOCKS]
    writer = fmt.StreamWriter(shard_dir / "sa.bin", "sa", "packed", total, width)
    bar = tqdm(total=total, unit="suf", unit_scale=True, desc=f"merge {n_parts} parts", disable=not progress)
    n_out = 0
    try:
        while True:
            n_out, size, p = merge_some(tok, sep, kt, heap, size, bufs, keys, pos, lens, out, n_out)
            if p >= 0:
                got = fill(p)
                if got:
                    lens[p], pos[p] = got, 0
                    size = push(tok, sep, kt, heap, size, bufs, keys, pos, p)
            if n_out == CHUNK or (size == 0 and p < 0):
                chunk = out[:n_out]
                words = packed.pack(chunk, width)
                # a full chunk is a whole number of words (CHUNK % 64 == 0); the last one keeps
                # pack's spare word, which ends the stream
                writer.write(words if n_out < CHUNK else words[: CHUNK * width // 64])
                for lv, m in zip(levels, _levels(chunk)):
                    lv.append(m)
                bar.update(n_out)
                if n_out < CHUNK:
                    break
                n_out = 0
        writer.close()
    finally:
        bar.close()
        for r in readers:
            r.close()
    bm = np.concatenate([np.concatenate(lv) for lv in levels])
    bm_dtype = np.uint32 if len(tok) < 2**32 else np.uint64
    fmt.write_array(shard_dir / "samax.bin", "samax", bm.astype(bm_dtype))


def write_unigram(shard_dir: Path, tok: np.ndarray, sep: int, vocab: int) -> int:
    """unigram.bin from the tokens, read in chunks; returns the number of real tokens."""
    counts = np.zeros(vocab, dtype=np.int64)
    step = 1 << 24
    for lo in range(0, len(tok), step):
        c = np.asarray(tok[lo : lo + step])
        counts += np.bincount(c[c != sep], minlength=vocab)[:vocab]
    fmt.write_array(Path(shard_dir) / "unigram.bin", "unigram", counts.astype(np.uint64))
    return int(counts.sum())
