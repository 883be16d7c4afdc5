"""Index features of many documents at once against a whole index, in bulk.

For every position t of every document and each of several caps on the match length: the
longest suffix of the document's text up to t (at most `cap` tokens) that occurs in the index,
how often it occurs, how often the token after t follows it, its top-k continuations and the
token after its most recent occurrence: the `Features` that `Index.score(doc, top_k=k,
max_len=cap, targets=True)` gives position by position. Here no step is taken per position in
Python:

1. per shard and cap, the match lengths and suffix-array intervals of every position in one
   two-pointer pass per document (kernels.match_lengths_docs);
2. the shards merged: the longest length wins, and only the shards that hold it count;
3. positions (of all caps) that share a context are grouped: a context is one string, known by
   its length and its interval in the first shard that holds it. The short contexts repeat
   a lot and have the large intervals, so each distinct context's next-token histogram is
   computed once, summed over the shards in a dense scratch (one galloping search per distinct
   next token, kernels.block_end), and read by every position in its group.

Steps 1 and 3 run on `threads` threads (the kernels release the GIL).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba as nb
import numpy as np

from . import kernels as K
from .features import FIELDS, SCORE_DTYPES, Features
from .packed import get

UNCAPPED = 1 << 62
CHUNK = 1 << 18  # positions per pass: bounds the per-shard interval arrays (24 bytes per position, cap and shard)


@nb.njit(cache=True, nogil=True)
def _histograms(toks, words, widths, samaxs, offs, sep, eos, lo, hi, d, grp, pos, target, o_tcnt, o_top, o_topc, o_cont, scratch, touched):
    """For each context u (rows of lo/hi: its interval per shard, empty where the shard lacks
    it; d[u] its length): its next-token histogram over the shards, then each of its positions
    pos[grp[u]:grp[u+1]] reads its target's count, the top-k continuations (count desc, id
    asc; k = o_top.shape[1]) and the token after the most recent occurrence (latest shard,
    largest position). scratch is zero on entry and exit; a document's end (SEP) counts as
    EOS, which the stream never holds."""
    k = o_top.shape[1]
    best = np.empty(k, np.int64)
    bestc = np.empty(k, np.int64)
    for u in range(lo.shape[0]):
        nt = 0
        cont = -1
        for s in range(len(toks)):
            a = lo[u, s]
            b = hi[u, s]
            if b <= a:
                continue
            tk = toks[s]
            wd = words[s]
            w = widths[s]
            r = a
            while r < b:
                e = K.block_end(tk, wd, w, r, b, d[u])
                c = np.int64(tk[get(wd, w, r) + d[u]])
                if c == sep:
                    c = eos
                if scratch[c] == 0:
                    touched[nt] = c
                    nt += 1
                scratch[c] += e - r
                r = e
            p = K.range_max(wd, w, samaxs[s], offs[s, 0], offs[s, 1], a, b)
            cont = np.int64(tk[p + d[u]])
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


def continuations(idx, ids: np.ndarray, starts: np.ndarray, caps, *, top_k: int = 1, threads: int = 1) -> dict[int, Features]:
    """Features (with target_cnt) of every position of the documents ids[starts[k]:starts[k+1]],
    for each cap in caps (0: uncapped, the ∞-gram's longest match)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    caps = list(dict.fromkeys(caps))
    parts: list[dict[int, Features]] = []
    a = 0
    with idx.readahead():  # many searches, neighbours in suffix-array order: read-ahead pays
        while a < len(starts) - 1:  # whole documents, about CHUNK positions at a time
            b = max(a + 1, int(np.searchsorted(starts, starts[a] + CHUNK, side="right")) - 1)
            b = min(b, len(starts) - 1)
            parts.append(_chunk(idx, ids[starts[a] : starts[b]], starts[a : b + 1] - starts[a], caps, top_k, threads))
            a = b
    if not parts:
        return {c: _features(0, top_k) for c in caps}
    return {c: _combine([p[c] for p in parts]) for c in caps}


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


def _chunk(idx, ids: np.ndarray, starts: np.ndarray, caps: list[int], k: int, threads: int) -> dict[int, Features]:
    P, S, C = len(ids), len(idx.shards), len(caps)
    V = max(idx.vocab_size, idx.eos_id + 1, int(ids.max(initial=0)) + 1)
    target = np.append(ids[1:], 0)
    target[starts[1:] - 1] = idx.eos_id  # a document's last position is followed by its end
    L = np.zeros((C, S, P), np.int64)
    lo = np.zeros((C, S, P), np.int64)
    hi = np.zeros((C, S, P), np.int64)

    def lengths(job: tuple[int, int]) -> None:
        ci, si = job
        s, cap = idx.shards[si], caps[ci]
        K.match_lengths_docs(
            s.tok, s.sa.words, s.sa.width, s.n, ids, starts, cap if cap > 0 else UNCAPPED, L[ci, si], lo[ci, si], hi[ci, si]
        )

    _map(lengths, [(ci, si) for ci in range(C) for si in range(S)], threads)
    Lm = L.max(1)  # (C, P)
    held = (L == Lm[:, None, :]) & (Lm[:, None, :] > 0)
    lo = np.where(held, lo, 0).transpose(0, 2, 1).reshape(C * P, S)  # rows: (cap, position)
    hi = np.where(held, hi, 0).transpose(0, 2, 1).reshape(C * P, S)
    Lm = Lm.reshape(-1)
    first = held.transpose(0, 2, 1).reshape(C * P, S).argmax(1)
    rows = np.nonzero(Lm > 0)[0]
    key = np.stack([Lm[rows], first[rows], lo[rows, first[rows]]], 1)
    _, rep, inv = np.unique(key, axis=0, return_index=True, return_inverse=True)
    inv = inv.ravel()
    order = np.argsort(inv, kind="stable")
    grp = np.searchsorted(inv[order], np.arange(len(rep) + 1))
    pos = rows[order]
    u_rows = rows[rep]
    u_lo, u_hi, u_d = lo[u_rows], hi[u_rows], Lm[u_rows]
    tgt = np.tile(target, C)
    f = _features(C * P, k)
    f.length[:] = Lm
    f.count[:] = (hi - lo).sum(1)
    tcnt, top, topc, cont = f.target_cnt, np.full((C * P, k), -1, np.int64), np.zeros((C * P, k), np.int64), np.full(C * P, -1, np.int64)
    toks = nb.typed.List([np.asarray(s.tok) for s in idx.shards])
    words = nb.typed.List([np.asarray(s.sa.words) for s in idx.shards])
    samaxs = nb.typed.List([np.asarray(s.samax) for s in idx.shards])
    widths = np.array([s.sa.width for s in idx.shards], np.int64)
    offs = np.array([[s.off2, s.off3] for s in idx.shards], np.int64).reshape(S, 2)

    def run(ua: int, ub: int) -> None:
        scratch = np.zeros(V, np.int64)
        touched = np.zeros(V, np.int64)
        args = (u_lo[ua:ub], u_hi[ua:ub], u_d[ua:ub], grp[ua : ub + 1], pos, tgt, tcnt, top, topc, cont, scratch, touched)
        _histograms(toks, words, widths, samaxs, offs, idx.sep, idx.eos_id, *args)

    bounds = np.linspace(0, len(rep), max(1, min(threads, len(rep))) * 8 + 1).astype(int)
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
