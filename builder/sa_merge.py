"""Merge a shard's sorted suffix-array parts into sa.bin, samax.bin and unigram.bin, streaming.

The parts (``sa.parts/NNNN.bin``, sorted in the shard order of ``builder/sa.py``, with the lcp
of each entry and the one before in ``NNNN.lcp``) are read in fixed-size buffers and merged by
an lcp-aware loser tree: a new head and a stored loser both know their common prefix with the
last output, so one of them wins without reading a token unless the two are equal, and a
comparison starts past them. Comparisons read the shard's tokens (memory-mapped: they are the
one thing held whole); long shared prefixes, such as duplicated documents, are read about once
instead of at every comparison. The merged array is bit-packed and its
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
LCP_MAX = sa_mod.LCP_MAX


HINT_SLOTS = 1 << 16  # remembered matches (2 MB)
HINT_MIN = 16  # matches at least this long are remembered
HINT_BLOCK = 12  # a match is filed under each 4096-position block it covers


def new_hints() -> np.ndarray:
    """(HINT_SLOTS, 4) int64 rows (d, block, start, end): tok[i] == tok[i + d] for start <= i < end."""
    return np.full((HINT_SLOTS, 4), -1, np.int64)


@nb.njit(inline="always")
def _slot(d, block):
    return (d * np.int64(0x9E3779B1) + block * np.int64(0x85EBCA77)) & np.int64(HINT_SLOTS - 1)


@nb.njit(inline="always")
def _compare_from(tok, sep, a, b, h, hints):
    """(suffix a before suffix b, their common prefix), comparing from offset h (known equal).

    Text repeated in two parts makes each of its positions meet its copy once; comparing
    every such pair from scratch costs the square of the repeat's length. So each long match
    is remembered by its diagonal d = b - a, as a run of positions where the text equals
    itself shifted by d, filed under every block of positions it covers; a later pair on that
    diagonal inside the run starts at the run's end: a repeat costs about its length.
    """
    lo = a if a < b else b
    d = (b - a) if a < b else (a - b)
    s = _slot(d, lo >> HINT_BLOCK)
    if hints[s, 0] == d and hints[s, 1] == lo >> HINT_BLOCK and hints[s, 2] <= lo < hints[s, 3] and hints[s, 3] - lo > h:
        h = hints[s, 3] - lo
    k = h
    while True:
        x = tok[a + k]
        y = tok[b + k]
        if x != y or x == sep:
            break
        k += 1
    if k >= HINT_MIN:
        end = lo + k
        for block in range(lo >> HINT_BLOCK, ((end - 1) >> HINT_BLOCK) + 1):
            s = _slot(d, block)
            if not (hints[s, 0] == d and hints[s, 1] == block and hints[s, 2] <= lo and hints[s, 3] >= end):
                hints[s, 0] = d
                hints[s, 1] = block
                hints[s, 2] = lo
                hints[s, 3] = end
    if x != y:
        return x < y, k
    return a < b, k


@nb.njit(inline="always")
def _exhausted(pos, lens, done, p):
    return done[p] and pos[p] >= lens[p]


@nb.njit(cache=True, nogil=True)
def replay(tok, sep, loser, loser_lcp, winner, bufs, pos, lens, done, p, h, hints):
    """Part p's new head, whose common prefix with the last output is h, plays its way up the
    tree. Every loser on the path holds its common prefix with the last output as well, so a
    match reads tokens only when both prefixes are equal, and then from that offset on.
    Prefixes saturate at LCP_MAX (meaning "at least"), which keeps every decision exact."""
    K = loser.shape[0]
    c = p
    hc = h
    node = (K + p) >> 1
    while node >= 1:
        o = loser[node]
        ho = loser_lcp[node]
        if o < 0 or _exhausted(pos, lens, done, o):
            o_wins = False
        elif c < 0 or _exhausted(pos, lens, done, c):
            o_wins = True
        elif ho != hc:
            o_wins = ho > hc  # the one agreeing longer with the last output is smaller
        else:
            o_wins, g = _compare_from(tok, sep, bufs[o, pos[o]], bufs[c, pos[c]], hc, hints)
            g = min(g, LCP_MAX)
            if o_wins:
                hc = g  # c, the loser, keeps its prefix with o; o goes on with ho
            else:
                loser_lcp[node] = g
        if o_wins:
            loser[node] = c
            loser_lcp[node], hc = hc, ho
            c = o
        node >>= 1
    winner[0] = c


@nb.njit(cache=True, nogil=True)
def merge_some(tok, sep, loser, loser_lcp, winner, bufs, lcps, pos, lens, done, out, n_out, hints):
    """Output winners into out[n_out:] until out is full, a part's buffer runs out, or all
    parts are. Returns (n_out, part): the part to refill (then replay it), or -1."""
    while n_out < out.shape[0]:
        w = winner[0]
        if w < 0 or _exhausted(pos, lens, done, w):
            return n_out, -1
        out[n_out] = bufs[w, pos[w]]
        n_out += 1
        pos[w] += 1
        if pos[w] == lens[w] and not done[w]:
            return n_out, w
        h = np.int64(lcps[w, pos[w]]) if pos[w] < lens[w] else 0
        replay(tok, sep, loser, loser_lcp, winner, bufs, pos, lens, done, w, h, hints)
    return n_out, -1


@nb.njit(cache=True, nogil=True)
def build_tree(tok, sep, loser, loser_lcp, winner, bufs, pos, lens, done, hints):
    """Play the first heads of all parts bottom-up (each against the empty string, common
    prefix 0): every node keeps its loser and the loser's common prefix with the winner."""
    K = loser.shape[0]
    players = np.full(2 * K, -1, np.int64)
    for i in range(K):
        if i < bufs.shape[0] and not _exhausted(pos, lens, done, i):
            players[K + i] = i
    for node in range(K - 1, 0, -1):
        a = players[2 * node]
        b = players[2 * node + 1]
        g = 0
        if a < 0:
            a_wins = False
        elif b < 0:
            a_wins = True
        else:
            a_wins, g = _compare_from(tok, sep, bufs[a, pos[a]], bufs[b, pos[b]], 0, hints)
            g = min(g, LCP_MAX)
        players[node] = a if a_wins else b
        loser[node] = b if a_wins else a
        loser_lcp[node] = g
    winner[0] = players[1]


def _tree(n_parts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A loser tree over n_parts leaves, rounded up to a power of two (-1: no player)."""
    K = 2
    while K < n_parts:
        K *= 2
    return np.full(K, -1, np.int64), np.zeros(K, np.int64), np.full(1, -1, np.int64)


class _PartReader:
    """Sequential reads of one part and its lcp values into buffer rows (no mapping: pages
    are not kept)."""

    def __init__(self, path: Path, lcp_path: Path, count: int):
        self.files = []
        for p, kind in ((path, "sa.part"), (lcp_path, "sa.part.lcp")):
            h = fmt.read_header(p)
            if h.kind != kind or h.count != count:
                raise BuildError(
                    f"{p}: corrupt suffix-array part (holds {h.kind!r} of {h.count}, expected {kind!r} of {count}); delete it and rerun"
                )
            f = open(p, "rb")
            f.seek(fmt.HEADER_SIZE)
            self.files.append((f, np.dtype(fmt._DTYPES[h.dtype]).newbyteorder("<")))
        self.left = count

    def fill(self, row: np.ndarray, lcp_row: np.ndarray) -> int:
        k = min(self.left, len(row))
        for (f, dtype), dst in zip(self.files, (row, lcp_row)):
            raw = f.read(k * dtype.itemsize)
            if len(raw) != k * dtype.itemsize:
                raise BuildError(f"{f.name}: truncated suffix-array part")
            dst[:k] = np.frombuffer(raw, dtype=dtype)
        self.left -= k
        return k

    def close(self) -> None:
        for f, _ in self.files:
            f.close()


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
    buf_len = max(1024, sa_mod.MERGE_BUFFER_BYTES // 2 // 10 // max(1, n_parts))  # half: entries and lcps
    readers = [_PartReader(sa_mod.part_path(shard_dir, i), sa_mod.lcp_path(shard_dir, i), c) for i, c in enumerate(plan_counts)]
    bufs = np.zeros((n_parts, buf_len), dtype=np.int64)
    lcps = np.zeros((n_parts, buf_len), dtype=np.uint16)
    pos = np.zeros(n_parts, dtype=np.int64)
    lens = np.zeros(n_parts, dtype=np.int64)
    done = np.zeros(n_parts, dtype=np.bool_)

    def fill(i: int) -> None:
        lens[i], pos[i] = readers[i].fill(bufs[i], lcps[i]), 0
        done[i] = readers[i].left == 0

    out = np.empty(CHUNK, dtype=np.int64)
    bm_dtype = np.uint32 if len(tok) < 2**32 else np.uint64
    levels: list[list[np.ndarray]] = [[] for _ in fmt.SAMAX_BLOCKS]
    writer = fmt.StreamWriter(shard_dir / "sa.bin", "sa", "packed", total, width)
    bar = tqdm(total=total, unit="suf", unit_scale=True, desc=f"merge {n_parts} parts", disable=not progress)

    def emit(n_out: int) -> None:
        """Pack and write out[:n_out] (out full, or the last entries) and its block maxima."""
        chunk = out[:n_out]
        words = packed.pack(chunk, width)
        # a full chunk is a whole number of words (CHUNK % 64 == 0); the last one keeps
        # pack's spare word, which ends the stream
        writer.write(words if n_out < CHUNK else words[: CHUNK * width // 64])
        for lv, m in zip(levels, _levels(chunk)):
            lv.append(m.astype(bm_dtype))
        bar.update(n_out)

    try:
        if n_parts == 1:  # nothing to merge: the part's order is the shard's
            scratch = np.empty(CHUNK, dtype=np.uint16)
            while True:
                k = readers[0].fill(out, scratch)
                emit(k)
                if k < CHUNK:
                    break
        else:
            for i in range(n_parts):
                fill(i)
            loser, loser_lcp, winner = _tree(n_parts)
            hints = new_hints()
            build_tree(tok, sep, loser, loser_lcp, winner, bufs, pos, lens, done, hints)
            n_out = 0
            while True:
                n_out, p = merge_some(tok, sep, loser, loser_lcp, winner, bufs, lcps, pos, lens, done, out, n_out, hints)
                if p >= 0:
                    fill(p)  # its first entry's lcp is with the entry just output
                    replay(tok, sep, loser, loser_lcp, winner, bufs, pos, lens, done, p, int(lcps[p, 0]) if lens[p] else 0, hints)
                    continue
                emit(n_out)  # out is full, or every part is merged
                if n_out < CHUNK:
                    break
                n_out = 0
        writer.close()
    finally:
        bar.close()
        for r in readers:
            r.close()
    fmt.write_array(shard_dir / "samax.bin", "samax", np.concatenate([np.concatenate(lv) for lv in levels]))


def write_unigram(shard_dir: Path, tok: np.ndarray, sep: int, vocab: int) -> int:
    """unigram.bin from the tokens, read in chunks; returns the number of real tokens."""
    counts = np.zeros(vocab, dtype=np.int64)
    step = 1 << 24
    for lo in range(0, len(tok), step):
        c = np.asarray(tok[lo : lo + step])
        counts += np.bincount(c[c != sep], minlength=vocab)[:vocab]
    fmt.write_array(Path(shard_dir) / "unigram.bin", "unigram", counts.astype(np.uint64))
    return int(counts.sum())
