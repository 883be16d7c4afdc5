"""Exclude-doc length + continuation of a sharded index from the merged suffix array of all its
shards, one chunk of bounded memory at a time.

Every exclude-doc feature depends only on the order of the index's suffixes up to `cap` tokens
and on their common prefixes (builder/cross_shard.py), so the shards' suffix arrays merged give
the answers of one shard holding the whole index. The merged order is cut into chunks by key:
a block (the suffixes that share a prefix of depth j) that holds more positions than a chunk may
is split by the token that follows its prefix, its children grouped in key order into chunks,
and a child still too large is split the same way one token deeper. A chunk is one range of
ranks per shard, merged on its own and answered by the one-shard kernels. A suffix outside the
chunk shares at most j tokens with one inside, so what crosses a chunk boundary is the business
of the chunk's ancestors, the split blocks of depth 1..j that hold it. Each is summarised by its
largest position, that position's document and the largest position of another document, read
off every shard's block maxima (samax.bin) without visiting its positions, and

  - a match start p in the chunk shares at least i tokens with another document when the
    ancestor of depth i holds a document other than p's;
  - a position t whose match (start p, length L <= j) is the whole ancestor of depth L takes
    that ancestor's most recent position outside p's document.

Two passes over the chunks: the first finds every match start's longest prefix found in another
document (from which every length follows), the second the most recent occurrences and their
continuations; with a scratch directory each chunk's merge is written there by the first pass
and read back by the second (about 5 bytes per position on disk), else merged again. Memory:
the index's tokens (mapped from a scratch file when a directory is given), a byte per position
for the lengths, a token per position for the continuations, and one chunk at a time,
CHUNK_BYTES_PER_POSITION per position of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numba as nb
import numpy as np
from teragram.index import kernels as IK
from teragram.index.engine import Index
from teragram.index.packed import get
from tqdm import tqdm

from . import cross_shard
from . import feature_kernels as FK

_NB = dict(cache=True, nogil=True)
CHUNK_BYTES_PER_POSITION = 40  # one chunk's arrays: merged positions and lcps (twice while merging), documents, runs, occurrences
_DOC_SHIFT = 12  # the document lookup table holds the document of every 4096th position


@dataclass(frozen=True)
class Block:
    """The suffixes sharing a prefix of `depth` tokens: one range of ranks [lo, hi) per shard."""

    depth: int
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Chunk:
    """Consecutive children of a split block, merged and answered together; ancestors: the
    split blocks holding it, of depth 1, 2, ..., depth (indices into the plan's blocks)."""

    ranges: tuple[tuple[int, int], ...]
    ancestors: tuple[int, ...]

    @property
    def depth(self) -> int:
        return len(self.ancestors)

    @property
    def positions(self) -> int:
        return sum(hi - lo for lo, hi in self.ranges)


def _children(idx: Index, depth: int, ranges) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The block's children in key order (the next token after its prefix, SEP last): their
    tokens (k,), and per shard the rank ranges begin, end (k, shards)."""
    hists = [idx.shards[s].blocks(lo, hi, depth) if hi > lo else (np.zeros(0, np.int64),) * 2 for s, (lo, hi) in enumerate(ranges)]
    toks = np.unique(np.concatenate([t for t, _ in hists]))
    counts = np.zeros((len(toks), len(ranges)), np.int64)
    for s, (t, c) in enumerate(hists):
        counts[np.searchsorted(toks, t), s] = c
    end = np.array([lo for lo, _ in ranges], np.int64) + np.cumsum(counts, axis=0)
    return toks, end - counts, end


def plan_chunks(idx: Index, max_positions: int, cap: int) -> tuple[list[Chunk], list[Block]]:
    """Chunks of at most max_positions positions covering every suffix once, in key order, and
    the split blocks they lie in. A block of depth cap cannot be split (its keys are equal) and
    goes whole into a chunk, however large."""
    whole = tuple((0, s.n) for s in idx.shards)
    if sum(s.n for s in idx.shards) <= max_positions:
        return [Chunk(whole, ())], []
    chunks: list[Chunk] = []
    blocks: list[Block] = []

    def split(depth: int, ranges, ancestors: tuple[int, ...]) -> None:
        toks, begin, end = _children(idx, depth, ranges)
        sizes = (end - begin).sum(axis=1)
        k0, size = 0, 0

        def emit(k1: int) -> None:
            if k1 > k0:
                chunks.append(Chunk(tuple(zip(begin[k0].tolist(), end[k1 - 1].tolist())), ancestors))

        for k in range(len(toks)):
            deeper = sizes[k] > max_positions and toks[k] != idx.sep and depth + 1 < cap
            if deeper or (size + sizes[k] > max_positions and k > k0):
                emit(k)
                k0, size = k, 0
            if deeper:
                child = tuple(zip(begin[k].tolist(), end[k].tolist()))
                blocks.append(Block(depth + 1, child))
                split(depth + 1, child, (*ancestors, len(blocks) - 1))
                k0 = k + 1
                continue
            size += int(sizes[k])
        emit(len(toks))

    split(0, whole, ())
    return chunks, blocks


# ---- kernels ---------------------------------------------------------------------------------


@nb.njit(**_NB)
def max_below(words, width, samax, off2, off3, lo, hi, thr):
    """Largest suffix-array value < thr over ranks [lo, hi) of a packed suffix array, skipping
    every block of 64, 4096 or 262144 ranks whose maximum (samax) is below thr; -1 if none."""
    best = np.int64(-1)
    r = lo
    while r < hi:
        v = np.int64(-1)
        if (r & 262143) == 0 and r + 262144 <= hi and np.int64(samax[off3 + (r >> 18)]) < thr:
            step, v = 262144, np.int64(samax[off3 + (r >> 18)])
        elif (r & 4095) == 0 and r + 4096 <= hi and np.int64(samax[off2 + (r >> 12)]) < thr:
            step, v = 4096, np.int64(samax[off2 + (r >> 12)])
        elif (r & 63) == 0 and r + 64 <= hi and np.int64(samax[r >> 6]) < thr:
            step, v = 64, np.int64(samax[r >> 6])
        else:
            step = 1
            x = get(words, width, r)
            if x < thr:
                v = x
        if v > best:
            best = v
        r += step
    return best


@nb.njit(**_NB)
def _unpack_key_lcps(words, width, lo, hi, off, T, cap, sep, sa, h):
    """sa = ranks [lo, hi) of one shard as positions in T (+ off), h their adjacent key lcps
    (cross_shard's KEY_EQUAL for equal keys; h[0] = 0), by direct comparison."""
    for i in range(hi - lo):
        sa[i] = get(words, width, lo + i) + off
    if hi > lo:
        h[0] = 0
    for i in range(1, hi - lo):
        k, sign = cross_shard.lcp_cmp(T, sa[i - 1], T, sa[i], cap, sep)
        h[i] = cross_shard.KEY_EQUAL if sign == 0 else k


@nb.njit(**_NB)
def _plain_lcps(T, sa, h, cap, sep):
    """Key lcps to capped, SEP-stopped lcps, in place: equal keys share the whole key."""
    for r in range(sa.shape[0]):
        if h[r] == cross_shard.KEY_EQUAL:
            k = 0
            while k < cap and T[sa[r] + k] != sep:
                k += 1
            h[r] = k


@nb.njit(**_NB)
def _documents(sa, starts, table, out):
    """out[r] = the document of position sa[r] (starts: every document's first position, then
    the end; table: the document of every 2**_DOC_SHIFT-th position)."""
    for r in range(sa.shape[0]):
        p = sa[r]
        d = table[p >> _DOC_SHIFT]
        while starts[d + 1] <= p:
            d += 1
        out[r] = d


@nb.njit(**_NB)
def _ms_floor(sa, sadoc, anc_d1, anc_m2, ms):
    """Raise each match start's other-document prefix to the depth of its deepest ancestor
    holding another document than its own."""
    depth = anc_d1.shape[0]
    for r in range(sa.shape[0]):
        d = sadoc[r]
        for i in range(depth, 0, -1):
            if anc_d1[i - 1] != d or anc_m2[i - 1] >= 0:
                if ms[sa[r]] < i:
                    ms[sa[r]] = i
                break


@nb.njit(**_NB)
def _runs(sa, length, cap, runr, base):
    """runr[r]: the positions t whose match starts at sa[r] (t - length[t] + 1 = sa[r]), a
    contiguous run found within cap positions, packed as runs_by_rank packs it (-1: none);
    base[r]: the run's first slot when the chunk's runs are numbered in rank order. Returns
    the number of slots."""
    total = np.int64(0)
    for r in range(sa.shape[0]):
        p = np.int64(sa[r])
        first = np.int64(-1)
        cnt = np.int64(0)
        for t in range(p, p + cap):  # length is 0 at a separator, whose start t + 1 ends the scan
            s = t - np.int64(length[t]) + 1
            if s > p:
                break
            if s == p:
                if first < 0:
                    first = t
                cnt += 1
        base[r] = total
        runr[r] = first * 256 + cnt if cnt else -1
        total += cnt
    return total


@nb.njit(**_NB)
def _continuations(T, sa, sadoc, runr, base, pos, anc_m1, anc_d1, anc_m2, sep, eos, cont):
    """cont[t] for every run: the token after the most recent occurrence, from the chunk's own
    sweep (pos) where the match is longer than the chunk's depth, else from the ancestor of
    the match's depth (its most recent position outside the start's document)."""
    depth = anc_d1.shape[0]
    for r in range(sa.shape[0]):
        x = runr[r]
        if x < 0:
            continue
        f = x >> 8
        p = np.int64(sa[r])
        d = sadoc[r]
        for k in range(x & 255):
            t = f + k
            L = t - p + 1
            if L <= depth:
                q = anc_m1[L - 1] if anc_d1[L - 1] != d else anc_m2[L - 1]
            else:
                q = pos[base[r] + k]
            if q >= 0:
                cont[t] = FK._next_tok(T, q + L, sep, eos)


# ---- the passes ------------------------------------------------------------------------------


class _Merged:
    """The index as one text (T, global positions and documents) and its chunks' merges."""

    def __init__(self, idx: Index, cap: int, tokens_file: Path | None):
        self.idx, self.cap, self.sep = idx, cap, idx.sep
        self.offs = np.cumsum([0] + [s.tok.shape[0] for s in idx.shards]).astype(np.int64)
        n = int(self.offs[-1])
        self.pos_dtype = np.uint32 if n < 2**32 else np.int64  # positions: half the bytes to move where they fit
        dtype = np.dtype(idx.manifest["token_dtype"])
        if tokens_file is None:
            self.T = np.empty(n, dtype)  # anonymous: numpy gives it huge pages
        else:
            self.T = np.memmap(tokens_file, dtype=dtype, mode="w+", shape=(n,))
        for s, a in zip(idx.shards, self.offs[:-1]):
            self.T[a : a + s.tok.shape[0]] = s.tok
        self.starts = np.concatenate([np.asarray(s.starts[:-1]).astype(np.int64) + a for s, a in zip(idx.shards, self.offs)] + [[n]])
        self.table = (np.searchsorted(self.starts, np.arange(0, n, 1 << _DOC_SHIFT), side="right") - 1).astype(np.int64)

    def chunk(self, c: Chunk) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sa, lcp, sadoc) of the chunk: its suffixes in key order with their capped lcps
        (0 at its first rank) and documents."""
        parts = []
        for s, (lo, hi), off in zip(self.idx.shards, c.ranges, self.offs[:-1]):
            if hi > lo:
                sa, h = np.empty(hi - lo, self.pos_dtype), np.empty(hi - lo, np.uint8)
                _unpack_key_lcps(s.sa.words, s.sa.width, lo, hi, off, self.T, self.cap, self.sep, sa, h)
                parts.append((sa, h))
        sa, lcp = cross_shard.merged_suffix_array(self.T, parts, self.cap, self.sep)
        _plain_lcps(self.T, sa, lcp, self.cap, self.sep)
        sadoc = np.empty(len(sa), np.int32)
        _documents(sa, self.starts, self.table, sadoc)
        return sa, lcp, sadoc

    def summaries(self, blocks: list[Block]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(largest position, its document, largest position of another document: -1 if none)
        of each block. Every position of the largest's document lies at or after that
        document's start, so the other documents' largest is the largest position below it."""
        m1, d1, m2 = (np.full(len(blocks), -1, np.int64) for _ in range(3))
        for b, blk in enumerate(blocks):
            for s, (lo, hi), off in zip(self.idx.shards, blk.ranges, self.offs[:-1]):
                if hi > lo:
                    m1[b] = max(m1[b], IK.range_max(s.sa.words, s.sa.width, s.samax, s.off2, s.off3, lo, hi) + off)
            d1[b] = np.searchsorted(self.starts, m1[b], side="right") - 1
            thr = self.starts[d1[b]]
            for s, (lo, hi), off in zip(self.idx.shards, blk.ranges, self.offs[:-1]):
                if hi > lo and thr > off:
                    v = max_below(s.sa.words, s.sa.width, s.samax, s.off2, s.off3, lo, hi, thr - off)
                    if v >= 0:
                        m2[b] = max(m2[b], v + off)
        return m1, d1, m2


def layout(idx: Index, memory_bytes: int, scratch: bool) -> tuple[bool, int]:
    """(tokens mapped from a scratch file, positions per chunk) for a memory budget: the lengths
    and continuations of the whole index stay in memory; its tokens too when, with them, half
    the budget is left for chunks, else (given a scratch directory) they are mapped from a file
    there, page cache the kernel may evict."""
    n = idx.n_positions
    itemsize = np.dtype(idx.manifest["token_dtype"]).itemsize
    whole = n * (1 + itemsize)
    in_file = scratch and whole + n * itemsize > memory_bytes // 2
    whole += 0 if in_file else n * itemsize
    return in_file, max(0, (memory_bytes - whole) // CHUNK_BYTES_PER_POSITION)


def exclude_doc_lengths_conts(
    idx: Index,
    cap: int,
    *,
    memory_bytes: int,
    max_chunk_positions: int | None = None,
    scratch: Path | None = None,
    progress: bool = False,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict]:
    """Per shard (length (n,) uint8, cont (n,) token dtype, the separator meaning none): the
    exclude-doc features of every position against every other document of the index; and
    timings and sizes."""
    t0 = time.time()
    in_file, chunk_positions = layout(idx, memory_bytes, scratch is not None)
    tokens_file = None
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
        for f in scratch.glob("chunk-*"):  # a killed run's leftovers
            f.unlink()
        tokens_file = scratch / "tokens.tmp" if in_file else None
    m = _Merged(idx, cap, tokens_file)
    chunks, blocks = plan_chunks(idx, max(1, max_chunk_positions or chunk_positions), cap)
    m1, d1, m2 = m.summaries(blocks)
    stats = {"chunks": len(chunks), "split_blocks": len(blocks), "largest_chunk": max(c.positions for c in chunks)}
    stats |= {"tokens_in_file": tokens_file is not None, "memory_bytes": memory_bytes}
    stats["prepare_s"] = time.time() - t0

    def ancestors(c: Chunk) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a = np.array(c.ancestors, np.int64)
        return m1[a], d1[a], m2[a]

    n = len(m.T)

    def merged(k: int, c: Chunk, again: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if scratch is None:
            return m.chunk(c)
        f_sa, f_lcp = scratch / f"chunk-{k:06d}.sa", scratch / f"chunk-{k:06d}.lcp"
        if not again:
            sa, lcp, sadoc = m.chunk(c)
            sa.tofile(f_sa)
            lcp.tofile(f_lcp)
            return sa, lcp, sadoc
        sa, lcp = np.fromfile(f_sa, m.pos_dtype), np.fromfile(f_lcp, np.uint8)  # read back, sequentially
        f_sa.unlink()
        f_lcp.unlink()
        sadoc = np.empty(len(sa), np.int32)
        _documents(sa, m.starts, m.table, sadoc)
        return sa, lcp, sadoc

    length = np.zeros(n, np.uint8)  # first the longest other-document prefix of each match start
    t = time.time()
    for k, c in enumerate(tqdm(chunks, desc="exclude-doc lengths", unit="chunk", disable=not progress)):
        sa, lcp, sadoc = merged(k, c, again=False)
        FK.longest_other_doc(sa, lcp, sadoc, length)
        if c.depth:
            _, a_d1, a_m2 = ancestors(c)
            _ms_floor(sa, sadoc, a_d1, a_m2, length)
    for s, a in zip(idx.shards, m.offs[:-1]):  # documents never span shards
        ms = length[a : a + s.tok.shape[0]].copy()
        FK.match_lengths_from_ms(ms, np.asarray(s.starts).astype(np.int64), cap, length[a : a + s.tok.shape[0]])
        del ms
    stats["lengths_s"] = time.time() - t
    t = time.time()
    cont = np.full(n, idx.sep, m.T.dtype)
    for k, c in enumerate(tqdm(chunks, desc="exclude-doc continuations", unit="chunk", disable=not progress)):
        sa, lcp, sadoc = merged(k, c, again=True)
        runr, base = np.empty(len(sa), np.int64), np.empty(len(sa), np.int64)
        pos = np.full(_runs(sa, length, cap, runr, base), -1, np.int64)
        FK.recent_other_doc(sa, lcp, sadoc, runr, base, pos)
        del lcp
        _continuations(m.T, sa, sadoc, runr, base, pos, *ancestors(c), idx.sep, idx.eos_id, cont)
    stats["continuations_s"] = time.time() - t
    out = [(length[a : a + s.tok.shape[0]], cont[a : a + s.tok.shape[0]]) for s, a in zip(idx.shards, m.offs[:-1])]
    if tokens_file is not None:
        del m
        tokens_file.unlink()
    stats["total_s"] = time.time() - t0
    return out, stats
