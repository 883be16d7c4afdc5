"""The next-token histograms of a shard's frequent contexts, stored with the shard.

Bulk scoring and next-token distributions need, for a context, the tokens that follow it and
how often. In a suffix array the suffixes of a context's interval are sorted by the token that
follows, so the histogram is one galloping search per distinct next token (kernels.block_end):
cheap for a rare context, but a short, frequent one (`the`, `) {`, a newline) has thousands of
continuations in every shard, and held-out text asks for such contexts at nearly every
position. Every such histogram is computed once, when the shard is built, and read back here.

Which contexts: every context with at least MIN_COUNT occurrences in the shard at which its
occurrences continue differently. These are the branching nodes of the shard's suffix tree
with MIN_COUNT leaves or more: a context's interval is the interval of the node at or below it,
and a context inside an edge (its node deeper) has a single continuation. So the table is
keyed by interval, and a context whose interval it lacks, or that sits inside an edge, is
enumerated as before: it has fewer than MIN_COUNT occurrences, or one continuation. There are
at most 2n / MIN_COUNT such nodes (their subtrees' leaves are disjoint), found by one descent
from the first tokens that skips unary stretches by comparing the interval's first and last
suffixes. No context holding a document separator is ever asked for, so the descent stops at
one.

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

MIN_COUNT = 1024  # occurrences in the shard from which a branching context's histogram is stored
NODES_FILE, HIST_FILE = "contexts.nodes.bin", "contexts.hist.bin"


@nb.njit(cache=True)
def _grow(a, need):
    if need <= a.shape[0]:
        return a
    b = np.empty(max(need, 2 * a.shape[0]), a.dtype)
    b[: a.shape[0]] = a
    return b


@nb.njit(cache=True)
def _descend(tok, words, w, n, sep, min_count):
    """The branching contexts of at least min_count occurrences: rows (lo, hi, depth, hist
    end) in the order found, and the histograms' (token, block end) pairs."""
    nodes = np.empty(1024 * 4, np.int64)
    hist = np.empty(1 << 16, np.int64)
    m = 0
    e = 0
    stack = np.empty(3 * 1024, np.int64)
    sp = 0
    r = 0  # the first tokens' blocks: intervals with one token in common
    while r < n:
        b = K.block_end(tok, words, w, r, n, 0)
        if b - r >= min_count and tok[get(words, w, r)] != sep:
            stack = _grow(stack, 3 * (sp + 1))
            stack[3 * sp], stack[3 * sp + 1], stack[3 * sp + 2] = r, b, 1
            sp += 1
        r = b
    last = len(tok) - 1
    while sp > 0:
        sp -= 1
        lo, hi, d = stack[3 * sp], stack[3 * sp + 1], stack[3 * sp + 2]
        p, q = get(words, w, lo), get(words, w, hi - 1)
        while p + d < last and q + d < last and tok[p + d] == tok[q + d] and tok[p + d] != sep:
            d += 1  # every suffix of the interval shares the first and last ones' common prefix
        if tok[p + d] == sep and tok[q + d] == sep:
            continue  # every occurrence ends its document here: one continuation, nothing past it
        r = lo
        while r < hi:
            b = K.block_end(tok, words, w, r, hi, d)
            c = np.int64(tok[get(words, w, r) + d])
            hist = _grow(hist, 2 * e + 2)
            hist[2 * e], hist[2 * e + 1] = c, b
            e += 1
            if b - r >= min_count and c != sep:
                stack = _grow(stack, 3 * (sp + 1))
                stack[3 * sp], stack[3 * sp + 1], stack[3 * sp + 2] = r, b, d + 1
                sp += 1
            r = b
        nodes = _grow(nodes, 4 * m + 4)
        nodes[4 * m], nodes[4 * m + 1], nodes[4 * m + 2], nodes[4 * m + 3] = lo, hi, d, e
        m += 1
    return nodes[: 4 * m].reshape(m, 4), hist[: 2 * e].reshape(e, 2)


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
    b = M
    while a < b:  # then the first with its hi >= hi (the rows from lo are sorted by hi)
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


def build(tok: np.ndarray, words: np.ndarray, width: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A shard's table: nodes (M, 4) int64 rows (lo, hi, depth, end) sorted by (lo, hi), and
    the histograms (E, 2) int64 (token, block end), each node's run ending at its `end`."""
    sep = fmt.separator(tok.dtype)
    raw, hist = _descend(tok, words, width, n, sep, MIN_COUNT)
    if not len(raw):
        return np.zeros((0, 4), np.int64), np.zeros((0, 2), np.int64)
    starts = np.concatenate([[0], raw[:-1, 3]])
    order = np.lexsort((raw[:, 1], raw[:, 0]))
    runs = [hist[a:b] for a, b in zip(starts[order], raw[order, 3])]
    ends = np.cumsum([len(x) for x in runs]).astype(np.int64)
    return np.stack([raw[order, 0], raw[order, 1], raw[order, 2], ends], axis=1), np.concatenate(runs)


def write(shard_dir, tok: np.ndarray, words: np.ndarray, width: int, n: int) -> dict:
    """Store a shard's table beside its arrays; returns its size."""
    nodes, hist = build(tok, words, width, n)
    fmt.write_array(Path(shard_dir) / NODES_FILE, "contexts.nodes", nodes.reshape(-1))
    fmt.write_array(Path(shard_dir) / HIST_FILE, "contexts.hist", hist.reshape(-1).astype(np.uint32 if n < 1 << 32 else np.uint64))
    return {"context_nodes": len(nodes), "context_entries": len(hist)}


@dataclass(frozen=True)
class Contexts:
    """A shard's stored histograms (memory-mapped)."""

    nodes: np.ndarray  # (M, 4): lo, hi, depth, end
    hist: np.ndarray  # (E, 2): token, block end (uint32 or uint64)
    min_count: int  # the fewest occurrences of a stored context

    def find(self, lo: int, hi: int, d: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The stored (tokens, counts) after the d-token context of interval [lo, hi), or None
        where the table does not hold it (then it has fewer than MIN_COUNT occurrences or a
        single continuation)."""
        a, b = stored_run(self.nodes, lo, hi, d)
        if a < 0:
            return None
        h = self.hist[a:b].astype(np.int64)
        return h[:, 0], np.diff(h[:, 1], prepend=lo)


NONE = Contexts(np.zeros((0, 4), np.int64), np.zeros((0, 2), np.uint32), 1 << 62)  # a shard without a table


def load(shard_dir) -> Contexts | None:
    """A shard's table, if it was stored (shards built before it have none)."""
    d = Path(shard_dir)
    if not ((d / NODES_FILE).exists() and (d / HIST_FILE).exists()):
        return None
    nodes = np.asarray(fmt.open_array(d / NODES_FILE, "contexts.nodes")).reshape(-1, 4)
    hist = np.asarray(fmt.open_array(d / HIST_FILE, "contexts.hist")).reshape(-1, 2)
    return Contexts(nodes, hist, int((nodes[:, 1] - nodes[:, 0]).min(initial=1 << 62)))
