"""The next-token histograms of a shard's frequent contexts, stored with the shard.

Bulk scoring and next-token distributions need, for a context, the tokens that follow it and
how often. In a suffix array the suffixes of a context's interval are sorted by the token that
follows, so the histogram is one galloping search per distinct next token (kernels.block_end):
cheap for a rare context, but a short, frequent one (`the`, `) {`, a newline) has thousands of
continuations in every shard, and held-out text asks for such contexts at nearly every
position. Every such histogram is computed once, when the shard is built, and read back here.

Which contexts: every context with at least min_count(n) occurrences in the shard (of n
positions) at which its occurrences continue differently. These are the branching nodes of the
shard's suffix tree with that many leaves or more: a context's interval is the interval of the
node at or below it, and a context inside an edge (its node deeper) has a single continuation.
So the table is keyed by interval, and a context whose interval it lacks, or that sits inside an
edge, is enumerated as before: it has fewer occurrences, or one continuation. They are found by
one descent from the first tokens that skips unary stretches by comparing the interval's first
and last suffixes, and written out a buffer at a time (`chunks`), so the build holds a few
buffers, not the table. Their number is not bounded by n / min_count(n): text repeated many
times makes a chain of them, one per position where a copy departs (the first 2^30-token
shard of the 2.43B-token index, with much duplicated code, stores 4.3M contexts and 50M
continuations: 0.54 GB beside 6.9 GB of arrays). No context holding a document separator is
ever asked for, so the descent stops at one.

Files (beside the shard's arrays): contexts.nodes.bin, int64 rows (lo, hi, depth, end) sorted
by interval, where end is the end of the node's run in contexts.hist.bin; that holds (token,
block end) pairs, tokens ascending with SEP last as kernels.next_token_blocks gives them, each
with the rank where its block of the interval ends (uint32, or uint64 in a shard of at least
2^32 positions): a count is the difference of two ends, and the interval of the context one
token longer is read off without a search (`child`), so a search walks down the stored
contexts before it touches the suffix array (index/matching.py). A shard without the files
(built before them) enumerates every context, with the same answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numba as nb
import numpy as np

from . import format as fmt
from . import kernels as K
from .packed import get

MIN_COUNT = 64  # the fewest occurrences of a stored context, in any shard
PER_LOG2 = 20  # and at least one per 2^20 positions of its shard (1024 in a 2^30-position shard)
LINEAR = 16  # a context with this few occurrences left is read occurrence by occurrence, not galloped through


def min_count(n: int) -> int:
    """The fewest occurrences of a context whose histogram a shard of n positions stores. In
    proportion to n, so that an index stores the same contexts (by frequency) whatever its
    sharding: the 2.43B-token index in 12 shards of 210M positions stores contexts of >= 200
    occurrences per shard, as the same tokens in 3 shards of 2^30 store those of >= 1024; at a
    fixed 1024 the 12 shards enumerated every mid-frequency context (held-out estimates: 2.4 s
    of histograms per 63k tokens, 1.3 s at 200, 1.0 s at 64, measured on copies of that index
    with each table; the tables 1.3, 2.7 and 5.1 GB beside 13.2 GB of arrays)."""
    return max(MIN_COUNT, n >> PER_LOG2)


NODES_FILE, HIST_FILE = "contexts.nodes.bin", "contexts.hist.bin"


@nb.njit(cache=True)
def _grow(a, need):
    if need <= a.shape[0]:
        return a
    b = np.empty((max(need, 2 * a.shape[0]),) + a.shape[1:], a.dtype)
    b[: a.shape[0]] = a
    return b


@nb.njit(cache=True)
def _first_blocks(tok, words, w, n, sep, min_count):
    """The stack the descent starts from: the first tokens' blocks of >= min_count suffixes
    (intervals with one token in common), rows (lo, hi, depth 1), the first block on top."""
    rows = np.empty((1024, 3), np.int64)
    k = 0
    r = np.int64(0)  # an int64, not a literal 0: the kernels it is passed to compile once (a literal compiles its own)
    while r < n:
        b = K.block_end(tok, words, w, r, n, np.int64(0))
        if b - r >= min_count and tok[get(words, w, r)] != sep:
            rows = _grow(rows, k + 1)
            rows[k, 0], rows[k, 1], rows[k, 2] = r, b, 1
            k += 1
        r = b
    return rows[:k][::-1].copy()


@nb.njit(cache=True)
def _descend(tok, words, w, sep, min_count, st, stack, grp, ghist, out_nodes, out_hist):
    """The branching contexts of >= min_count occurrences, in the table's order, a buffer at a
    time: fills out_nodes (lo, hi, depth, end) and out_hist (token, block end) and returns
    (stack, grp, ghist, out_nodes, rows, out_hist, entries) with its state in st (stack
    size, pending rows, pending entries, entries written before); call again while st[0] or st[1].

    The stack is popped in preorder (children pushed last first), which is the table's order
    (lo ascending, then hi) but for the nodes sharing a lo: a chain of first children, popped
    shallowest first and stored deepest first. So a chain is held back (grp, ghist) until the
    next pop leaves it, then written reversed."""
    sp, gm, ge, e_all = st[0], st[1], st[2], st[3]
    m = e = 0
    last = len(tok) - 1
    while True:
        if gm > 0 and (sp == 0 or stack[sp - 1, 0] != grp[0, 0]):  # the chain is complete
            if m + gm > out_nodes.shape[0] or e + ge > out_hist.shape[0]:
                if m > 0:
                    break  # the caller writes the buffers out, then calls again
                out_nodes = _grow(out_nodes, gm)
                out_hist = _grow(out_hist, ge)
            at = ge
            for i in range(gm - 1, -1, -1):
                a = at - grp[i, 3]
                for j in range(a, at):
                    out_hist[e, 0], out_hist[e, 1] = ghist[j, 0], ghist[j, 1]
                    e += 1
                e_all += grp[i, 3]
                out_nodes[m, 0], out_nodes[m, 1], out_nodes[m, 2], out_nodes[m, 3] = grp[i, 0], grp[i, 1], grp[i, 2], e_all
                m += 1
                at = a
            gm = ge = 0
        if sp == 0:
            break
        sp -= 1
        lo, hi, d = stack[sp, 0], stack[sp, 1], stack[sp, 2]
        p, q = get(words, w, lo), get(words, w, hi - 1)
        while p + d < last and q + d < last and tok[p + d] == tok[q + d] and tok[p + d] != sep:
            d += 1  # every suffix of the interval shares the first and last ones' common prefix
        if tok[p + d] == sep and tok[q + d] == sep:
            continue  # every occurrence ends its document here: one continuation, nothing past it
        r, sp0, g0 = lo, sp, ge
        while r < hi:
            b = K.block_end(tok, words, w, r, hi, d)
            c = np.int64(tok[get(words, w, r) + d])
            ghist = _grow(ghist, ge + 1)
            ghist[ge, 0], ghist[ge, 1] = c, b
            ge += 1
            if b - r >= min_count and c != sep:
                stack = _grow(stack, sp + 1)
                stack[sp, 0], stack[sp, 1], stack[sp, 2] = r, b, d + 1
                sp += 1
            r = b
        stack[sp0:sp] = stack[sp0:sp][::-1].copy()  # the first child on top
        grp = _grow(grp, gm + 1)
        grp[gm, 0], grp[gm, 1], grp[gm, 2], grp[gm, 3] = lo, hi, d, ge - g0
        gm += 1
    st[0], st[1], st[2], st[3] = sp, gm, ge, e_all
    return stack, grp, ghist, out_nodes, m, out_hist, e


def _hist_dtype(n: int):
    """The block ends' type in a shard of n positions (an end can be n itself)."""
    return np.uint32 if n < 1 << 32 else np.uint64


def chunks(tok: np.ndarray, words: np.ndarray, width: int, n: int, rows: int = 1 << 20):
    """A shard's table in order, a buffer at a time: (nodes, hist) pieces of about `rows` rows
    (nodes int64 (lo, hi, depth, end); hist (token, block end), uint32 below 2^32 positions,
    else uint64), so that building it takes a few buffers of memory, whatever the table's size."""
    sep = fmt.separator(tok.dtype)
    st = np.zeros(4, np.int64)
    least = min_count(n)
    stack = _first_blocks(tok, words, width, n, sep, least)
    st[0] = len(stack)
    grp, ghist = np.empty((64, 4), np.int64), np.empty((1024, 2), np.int64)
    out_nodes = np.empty((max(rows // 8, 1), 4), np.int64)
    out_hist = np.empty((rows, 2), _hist_dtype(n))
    while st[0] or st[1]:
        stack, grp, ghist, out_nodes, m, out_hist, e = _descend(tok, words, width, sep, least, st, stack, grp, ghist, out_nodes, out_hist)
        yield out_nodes[:m], out_hist[:e]


@nb.njit(cache=True, nogil=True)
def stored_run(nodes, lo, hi, d):
    """The run [a, b) of the histogram entries stored for the d-token context of interval
    [lo, hi), or (-1, -1) where the table does not hold it. nodes: rows (lo, hi, depth, end)
    sorted by (lo, hi)."""
    M = nodes.shape[0]
    a, b = 0, M
    while a < b:  # the first row from lo
        m = (a + b) >> 1
        if nodes[m, 0] < lo:
            a = m + 1
        else:
            b = m
    step = 1
    b = a
    while b < M and nodes[b, 0] == lo and nodes[b, 1] < hi:  # then the first with its hi >= hi:
        a = b + 1  # the rows from lo are few and sorted by hi, so gallop from the first
        b = a + step
        step *= 2
    b = min(b, M)
    while a < b:
        m = (a + b) >> 1
        if nodes[m, 0] == lo and nodes[m, 1] < hi:
            a = m + 1
        else:
            b = m
    if a < M and nodes[a, 0] == lo and nodes[a, 1] == hi and nodes[a, 2] == d:
        return (nodes[a - 1, 3] if a > 0 else 0), nodes[a, 3]
    return -1, -1


@nb.njit(cache=True, nogil=True)
def child(nodes, hist, lo, hi, d, x):
    """The interval of the d-token context of [lo, hi) followed by token x, read from the table:
    (a, b), empty (0, 0) if x never follows it; (-1, -1) if the table does not hold the context."""
    e0, e1 = stored_run(nodes, lo, hi, d)
    if e0 < 0:
        return -1, -1
    a, b = e0, e1
    while a < b:  # the first entry whose token is >= x
        m = (a + b) >> 1
        if np.int64(hist[m, 0]) < x:
            a = m + 1
        else:
            b = m
    if a == e1 or np.int64(hist[a, 0]) != x:
        return 0, 0
    return (np.int64(hist[a - 1, 1]) if a > e0 else lo), np.int64(hist[a, 1])


@nb.njit(cache=True, nogil=True)
def add(c, n, sep, eos, scratch, touched, nt):
    """Count n more of next token c (SEP as EOS) into scratch; returns the distinct tokens so far."""
    if c == sep:
        c = eos
    if scratch[c] == 0:
        touched[nt] = c
        nt += 1
    scratch[c] += n
    return nt


@nb.njit(cache=True, nogil=True)
def count_shard(tk, wd, w, node, hist, min_count, sep, eos, a, b, d, scratch, touched, nt):
    """Add the next tokens after one shard's interval [a, b) of a d-token context into scratch:
    read from the shard's stored histogram where it holds the context (below), else
    one read per occurrence for a few of them, else one galloping search per distinct token."""
    r = a
    if b - a >= min_count:
        e0, e1 = stored_run(node, a, b, d)
        for e in range(e0, e1):  # (token, end of its block); none when not stored (e0 = -1 = e1)
            nt = add(np.int64(hist[e, 0]), np.int64(hist[e, 1]) - r, sep, eos, scratch, touched, nt)
            r = np.int64(hist[e, 1])
    if b - r <= LINEAR:
        for q in range(r, b):
            nt = add(np.int64(tk[get(wd, w, q) + d]), np.int64(1), sep, eos, scratch, touched, nt)
        return nt
    while r < b:
        e = K.block_end(tk, wd, w, r, b, d)
        nt = add(np.int64(tk[get(wd, w, r) + d]), e - r, sep, eos, scratch, touched, nt)
        r = e
    return nt


def build(tok: np.ndarray, words: np.ndarray, width: int, n: int, rows: int = 1 << 20) -> tuple[np.ndarray, np.ndarray]:
    """A shard's whole table in memory (tests): nodes (M, 4) int64 rows (lo, hi, depth, end)
    sorted by (lo, hi), and the histograms (E, 2) (token, block end)."""
    parts = [(a.copy(), b.copy()) for a, b in chunks(tok, words, width, n, rows)]
    nodes = [a for a, _ in parts] or [np.zeros((0, 4), np.int64)]
    hist = [b for _, b in parts] or [np.zeros((0, 2), _hist_dtype(n))]
    return np.concatenate(nodes), np.concatenate(hist)


def write(shard_dir, tok: np.ndarray, words: np.ndarray, width: int, n: int) -> dict:
    """Store a shard's table beside its arrays, streamed a buffer at a time; returns its size."""
    d = Path(shard_dir)
    nodes = fmt.StreamWriter(d / NODES_FILE, "contexts.nodes", "int64", None)
    hist = fmt.StreamWriter(d / HIST_FILE, "contexts.hist", _hist_dtype(n).__name__, None)
    for a, b in chunks(tok, words, width, n):
        nodes.write(a)
        hist.write(b)
    nodes.close()
    hist.close()
    return {"context_nodes": nodes.written // 4, "context_entries": hist.written // 2, "context_min_count": min_count(n)}


@dataclass(frozen=True)
class Contexts:
    """A shard's stored histograms (memory-mapped)."""

    nodes: np.ndarray  # (M, 4): lo, hi, depth, end
    hist: np.ndarray  # (E, 2): token, block end (uint32 or uint64)
    min_count: int  # the fewest occurrences of a stored context

    def find(self, lo: int, hi: int, d: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The stored (tokens, counts) after the d-token context of interval [lo, hi), or None
        where the table does not hold it (then it has fewer than min_count(n) occurrences or a
        single continuation)."""
        a, b = stored_run(self.nodes, lo, hi, d)
        if a < 0:
            return None
        h = self.hist[a:b].astype(np.int64)
        return h[:, 0], np.diff(h[:, 1], prepend=lo)


NONE = Contexts(np.zeros((0, 4), np.int64), np.zeros((0, 2), np.uint32), 1 << 62)  # a shard without a table


def load(shard_dir, least: int) -> Contexts | None:
    """A shard's table, if it was stored (shards built before it have none), looked up for
    contexts of at least `least` occurrences: the threshold it was stored at (its shard's marker
    records it; any value answers the same, a context below it or not stored is enumerated).
    Not the smallest stored interval: finding it read every node (0.16 s for the 2.43B index's
    12 tables on a warm page cache, all 0.9 GB of them from the disk on a cold one)."""
    d = Path(shard_dir)
    if not ((d / NODES_FILE).exists() and (d / HIST_FILE).exists()):
        return None
    nodes = np.asarray(fmt.open_array(d / NODES_FILE, "contexts.nodes")).reshape(-1, 4)
    hist = np.asarray(fmt.open_array(d / HIST_FILE, "contexts.hist")).reshape(-1, 2)
    return Contexts(nodes, hist, least)
