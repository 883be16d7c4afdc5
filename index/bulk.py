"""Index features of many documents at once against a whole index, in bulk.

For every position t of every document and each of several caps on the match length: the
longest suffix of the document's text up to t (at most `cap` tokens) that occurs in the index,
how often it occurs, how often the token after t follows it, its top-k continuations and the
token after its most recent occurrence: the `Features` that `Index.score(doc, top_k=k,
max_len=cap, targets=True)` gives position by position. Here no step is taken per position in
Python:

1. the match lengths and every shard's suffix-array intervals of every position, all shards
   searched together: the longest match in one two-pointer pass per document, and the capped
   ones narrowed from the suffixes that start at each position (index/matching.py); a shard
   that lacks a position's match gets an empty interval;
2. the matches of the shards that hold them count, as in a one-shard index of all the text;
3. positions (of all caps) that share a context are grouped: a context is one string, known by
   its length and its interval in the first shard that holds it. The short contexts repeat
   a lot and have the large intervals, so each distinct context's next-token histogram is
   computed once, summed over the shards in a dense scratch, and read by every position in its
   group. A short context frequent in the whole index has its histogram summed over the shards
   when the index was built (index/merged.py), read in one place; elsewhere each shard's part
   is read from the shard's stored histograms where the context is frequent there
   (index/contexts.py), else enumerated: one galloping search per distinct next token
   (kernels.block_end), or one read per occurrence where there are few.

Steps 1 and 3 run on `threads` threads, by documents and by contexts (the kernels release the GIL).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import numba as nb
import numpy as np

from . import kernels as K
from .contexts import count_shard
from .features import FIELDS, SCORE_DTYPES, Features
from .matching import distinct_starts, longest_matches, narrow_starts
from .merged import tables

UNCAPPED = 1 << 62
CHUNK = 1 << 18  # positions per pass at most
READAHEAD_MIN = 1 << 14  # positions from which a call turns the kernel's read-ahead on (not one short document)
SCRATCH = 1 << 23  # and at most this many (cap, position, shard) intervals (16 bytes each, a few copies)


@nb.njit(cache=True, nogil=True)
def _histograms(
    toks,
    words,
    widths,
    samaxs,
    offs,
    nodes,
    hists,
    mins,
    sep,
    eos,
    us,
    u_rows,
    lo,
    hi,
    d,
    run,
    merged,
    grp,
    pos,
    target,
    o_tcnt,
    o_top,
    o_topc,
    o_cont,
    scratch,
    touched,
):
    """For each context u of us (row u_rows[u] of lo/hi: its interval per shard, empty where the
    shard lacks it; d[u] its length): its next-token histogram over the shards (rows run[u] of the
    index's merged histograms, where they hold it: index/merged.py), then each of its positions
    pos[grp[u]:grp[u+1]] reads its target's count, the top-k continuations (count desc, id
    asc; k = o_top.shape[1]) and the token after the most recent occurrence (latest shard,
    largest position). scratch is zero on entry and exit; a document's end (SEP) counts as
    EOS, which the stream never holds."""
    k = o_top.shape[1]
    best = np.empty(k, np.int64)
    bestc = np.empty(k, np.int64)
    for ui in range(us.shape[0]):
        u = us[ui]
        nt = np.int64(0)  # an int64, not a literal 0: the kernels it is passed to compile once (a literal compiles its own)
        cont = -1
        last = -1
        for e in range(run[u, 0], run[u, 1]):  # none where not merged (-1, -1)
            c = merged[e, 0]
            scratch[c] = merged[e, 1]
            touched[nt] = c
            nt += 1
        row = u_rows[u]
        for s in range(len(toks)):
            a = lo[row, s]
            b = hi[row, s]
            if b <= a:
                continue
            if run[u, 0] < 0:
                nt = count_shard(toks[s], words[s], widths[s], nodes[s], hists[s], mins[s], sep, eos, a, b, d[u], scratch, touched, nt)
            last = s
        if last >= 0:  # the most recent occurrence is in the latest shard holding the context
            p = K.range_max(words[last], widths[last], samaxs[last], offs[last, 0], offs[last, 1], lo[row, last], hi[row, last])
            cont = np.int64(toks[last][p + d[u]])
            if cont == sep:
                cont = eos
        for j in range(k):  # selection of the k best: k is small
            best[j] = -1
            bestc[j] = 0
            for i in range(nt):
                c = touched[i]
                v = scratch[c]
                if v > bestc[j] or (v == bestc[j] and v > 0 and c < best[j]):
                    taken = False
                    for m in range(j):
                        if best[m] == c:
                            taken = True
                    if not taken:
                        best[j] = c
                        bestc[j] = v
        for j in range(grp[u], grp[u + 1]):
            p = pos[j]
            o_tcnt[p] = scratch[target[p]]
            o_cont[p] = cont
            for m in range(k):
                o_top[p, m] = best[m]
                o_topc[p, m] = bestc[m]
        for i in range(nt):
            scratch[touched[i]] = 0


@nb.njit(cache=True, nogil=True)
def _held(length, lo, hi, count, first, first_lo):
    """For each row r of lo, hi (R, S; each shard's interval of a match of length[r]), in place:
    the intervals of the shards that lack it, and every interval of a row whose match is empty,
    set to (0, 0); count[r] the match's occurrences in all shards, first[r] the first shard that
    holds it (0 if none) and first_lo[r] its interval's start there."""
    R, S = lo.shape
    for r in range(R):
        n = 0
        f = -1
        for s in range(S):
            if length[r] > 0 and hi[r, s] > lo[r, s]:
                n += hi[r, s] - lo[r, s]
                if f < 0:
                    f = s
            else:
                lo[r, s] = 0
                hi[r, s] = 0
        count[r] = n
        first[r] = max(f, 0)
        first_lo[r] = lo[r, max(f, 0)]


@nb.njit(cache=True, nogil=True)
def _copy_rows(src_lo, src_hi, src_rows, dst_lo, dst_hi, dst_rows):
    """dst_lo[dst_rows[i]] = src_lo[src_rows[i]], the same for hi, for each i in order (rows of
    (P, S) arrays)."""
    for i in range(src_rows.shape[0]):
        a = src_rows[i]
        b = dst_rows[i]
        for s in range(src_lo.shape[1]):
            dst_lo[b, s] = src_lo[a, s]
            dst_hi[b, s] = src_hi[a, s]


def continuations(idx, ids: np.ndarray, starts: np.ndarray, caps, *, top_k: int = 1, threads: int = 1) -> dict[int, Features]:
    """Features (with target_cnt) of every position of the documents ids[starts[k]:starts[k+1]],
    for each cap in caps (<= 0: uncapped, the ∞-gram's longest match). An index held by a Ray
    cluster's actors (index/cluster.py) has its holders compute them (index/cluster_bulk.py)."""
    if hasattr(idx, "run_all"):
        return idx.continuations(ids, starts, caps, top_k=top_k)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    asked = list(dict.fromkeys(caps))
    caps = sorted({max(int(c), 0) for c in asked}, key=lambda c: c if c > 0 else UNCAPPED)  # as match_intervals wants them
    chunk = min(CHUNK, max(4096, SCRATCH // (len(caps) * len(idx.shards))))
    parts: list[dict[int, Features]] = []
    a = 0
    many = len(ids) >= READAHEAD_MIN  # many searches, neighbours in suffix-array order: read-ahead pays
    with idx.readahead() if many else contextlib.nullcontext():
        while a < len(starts) - 1:  # whole documents, about `chunk` positions at a time
            b = max(a + 1, int(np.searchsorted(starts, starts[a] + chunk, side="right")) - 1)
            b = min(b, len(starts) - 1)
            parts.append(_chunk(idx, ids[starts[a] : starts[b]], starts[a : b + 1] - starts[a], caps, top_k, threads))
            a = b
    if not parts:
        return {c: _features(0, top_k) for c in asked}
    return {c: _combine([p[max(int(c), 0)] for p in parts]) for c in asked}


def _map(fn, jobs: list, threads: int) -> None:
    """fn over the jobs, on `threads` threads (the kernels release the GIL)."""
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, jobs))
    else:
        for j in jobs:
            fn(j)


def _features(n: int, k: int) -> Features:
    f = Features.empty(n, k, SCORE_DTYPES)
    return Features(f.length, f.cont, f.count, f.topk_ids, f.topk_cnt, np.zeros(n, np.int64))


def _combine(parts: list[Features]) -> Features:
    return Features(*(np.concatenate([getattr(p, n) for p in parts]) for n in (*FIELDS, "target_cnt")))


def _rows(f: Features, a: int, b: int) -> Features:
    return Features(*(getattr(f, n)[a:b] for n in (*FIELDS, "target_cnt")))


def _doc_parts(starts: np.ndarray, n: int) -> list[np.ndarray]:
    """The document starts cut into about n runs of whole documents with as many positions."""
    cuts = np.searchsorted(starts, np.linspace(0, starts[-1], n + 1)[1:-1])
    edges = np.unique(np.concatenate([[0], cuts, [len(starts) - 1]]))
    return [starts[a : b + 1] for a, b in zip(edges[:-1], edges[1:])]


def match_intervals(idx, ids: np.ndarray, starts: np.ndarray, caps: list[int], threads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per cap (caps: positive and increasing, then 0, uncapped) and position: the match length
    and each shard's interval of the match, (C, P) and (C, P, S) twice (index/matching.py)."""
    P, S, C = len(ids), len(idx.shards), len(caps)
    ss = idx.shard_set
    known = tables(idx.merged, idx.trigrams)
    args = (ss.table, ss.first_rank, ss.pos, ss.prefix, ss.step_log2, ss.contexts, known, ids)
    m_len = np.zeros(P, np.int64)
    lo = np.zeros((C, P, S), np.int64)
    hi = np.zeros((C, P, S), np.int64)
    m_lo, m_hi = lo[C - 1], hi[C - 1]  # the uncapped match: the last row, whatever its cap
    parts = _doc_parts(starts, threads * 4 if threads > 1 else 1)
    _map(lambda st: longest_matches(*args, st, m_len, m_lo, m_hi), parts, threads)
    if caps[-1] > 0:  # every cap is capped: the last one's intervals overwrite the match's
        m_lo, m_hi = m_lo.copy(), m_hi.copy()
    cp = 0
    for ci, c in enumerate(c for c in caps if c > 0):  # increasing: each narrowed from the last
        short = m_len <= c  # the match itself
        held = np.nonzero(short)[0]
        _copy_rows(m_lo, m_hi, held, lo[ci], hi[ci], held)
        t = np.nonzero(~short)[0]
        reps, which = distinct_starts(ids, t - c + 1, c)  # each distinct string searched once, in order
        prev = (lo[ci - 1], hi[ci - 1]) if ci else (lo[ci], hi[ci])
        jobs = np.array_split(reps, threads * 4 if threads > 1 else 1)
        _map(lambda js, c=c, cp=cp, prev=prev, out=(lo[ci], hi[ci]): narrow_starts(*args, js, c, *prev, cp, *out), jobs, threads)
        _copy_rows(lo[ci], hi[ci], reps[which] + c - 1, lo[ci], hi[ci], t)  # a string's rows from its search's
        cp = c
    lengths = np.stack([np.minimum(m_len, c) if c > 0 else m_len for c in caps])
    return lengths, lo, hi


def _chunk(idx, ids: np.ndarray, starts: np.ndarray, caps: list[int], k: int, threads: int) -> dict[int, Features]:
    P, S, C = len(ids), len(idx.shards), len(caps)
    V = max(idx.vocab_size, idx.eos_id + 1, int(ids.max(initial=0)) + 1)
    target = np.append(ids[1:], 0)
    target[starts[1:] - 1] = idx.eos_id  # a document's last position is followed by its end
    Lm, lo, hi = match_intervals(idx, ids, starts, caps, threads)
    Lm = Lm.reshape(-1)
    lo, hi = lo.reshape(C * P, S), hi.reshape(C * P, S)  # rows: (cap, position)
    f = _features(C * P, k)
    first = np.empty(C * P, np.int64)
    first_lo = np.empty(C * P, np.int64)
    _held(Lm, lo, hi, f.count, first, first_lo)
    rows = np.nonzero(Lm > 0)[0]
    order = np.lexsort((first_lo[rows], first[rows], Lm[rows]))  # a context: its length and interval in the first shard holding it
    key = np.stack([Lm[rows], first[rows], first_lo[rows]])[:, order]
    new = np.ones(len(rows), bool)
    new[1:] = (key[:, 1:] != key[:, :-1]).any(0)
    grp = np.append(np.nonzero(new)[0], len(rows))
    pos = rows[order]
    u_rows = pos[grp[:-1]]
    u_d = Lm[u_rows]
    tgt = np.tile(target, C)
    f.length[:] = Lm
    tcnt, top, topc, cont = f.target_cnt, np.full((C * P, k), -1, np.int64), np.zeros((C * P, k), np.int64), np.full(C * P, -1, np.int64)
    toks = nb.typed.List([np.asarray(s.tok) for s in idx.shards])
    words = nb.typed.List([np.asarray(s.sa.words) for s in idx.shards])
    samaxs = nb.typed.List([np.asarray(s.samax) for s in idx.shards])
    widths = np.array([s.sa.width for s in idx.shards], np.int64)
    offs = np.array([[s.off2, s.off3] for s in idx.shards], np.int64).reshape(S, 2)
    nodes, hists, mins = idx.shard_set.contexts
    U = len(u_rows)
    mg = idx.merged
    if mg is None:
        u_run, m_hist = np.full((U, 2), -1, np.int64), np.zeros((0, 2), np.int64)
    else:
        u_run, m_hist = mg.runs(ids, u_rows % P, u_d), mg.hist

    def run(ua: int, ub: int) -> None:
        scratch = np.zeros(V, np.int64)
        touched = np.zeros(V, np.int64)
        args = (np.arange(ua, ub), u_rows, lo, hi, u_d, u_run, m_hist, grp, pos, tgt, tcnt, top, topc, cont, scratch, touched)
        _histograms(toks, words, widths, samaxs, offs, nodes, hists, mins, idx.sep, idx.eos_id, *args)

    bounds = np.linspace(0, U, max(1, min(threads, U)) * 8 + 1).astype(int)
    _map(lambda ab: run(*ab), list(zip(bounds[:-1], bounds[1:])), threads)
    none = Lm == 0  # no suffix occurs: the unigram distribution
    uni = idx.unigram
    f.count[none] = idx.n_positions
    tcnt[none] = np.append(uni, np.zeros(max(0, V - len(uni)), np.int64))[tgt[none]]
    nz = np.nonzero(uni)[0]
    best = nz[np.lexsort((nz, -uni[nz]))][:k]
    top[none, : len(best)] = best
    topc[none, : len(best)] = uni[best]
    f.cont[:], f.topk_ids[:], f.topk_cnt[:] = cont, top, topc
    return {cap: _rows(f, ci * P, (ci + 1) * P) for ci, cap in enumerate(caps)}
