"""Continuation statistics of many documents at once against a whole index, in bulk.

For every position t of every document and each of several caps on the match length: the
longest suffix of the document's text up to t (at most `cap` tokens) that occurs in the index,
how often it occurs, how often the token after t follows it, and its most frequent
continuation. These are the numbers `Index.score(doc, top_k=1, max_len=cap, targets=True)`
gives position by position; here no step is taken per position in Python:

1. per shard and cap, the match lengths and suffix-array intervals of every position in one
   two-pointer pass per document (kernels.match_lengths_docs);
2. the shards merged: the longest length wins, and only the shards that hold it count;
3. positions (of all caps) that share a context are grouped: a context is one string, known by
   its length and its interval in the first shard that holds it. The short contexts repeat
   a lot and have the large intervals, so each distinct context's next-token histogram is
   computed once, summed over the shards in a dense scratch (one galloping search per distinct
   next token, kernels.block_end), and read by every position in its group.

Step 3 runs on `threads` threads (the kernel releases the GIL).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numba as nb
import numpy as np

from . import kernels as K
from .packed import get

UNCAPPED = 1 << 62
CHUNK = 1 << 19  # positions per pass: bounds the per-shard interval arrays


@dataclass
class Continuations:
    """Per position: match length, its count, the count followed by the next token (EOS at a
    document's end), and the most frequent continuation (count desc, then id asc) and its count.
    Length 0: no suffix occurs; the statistics are the unigram's (count = all positions)."""

    length: np.ndarray
    count: np.ndarray
    target_cnt: np.ndarray
    top: np.ndarray
    top_cnt: np.ndarray


@nb.njit(cache=True, nogil=True)
def _histograms(toks, words, widths, sep, eos, lo, hi, d, grp, pos, target, out_tcnt, out_top, out_topc, scratch, touched):
    """For each context u (rows of lo/hi: its interval per shard, empty where the shard lacks
    it; d[u] its length): its next-token histogram over the shards, then each of its positions
    pos[grp[u]:grp[u+1]] reads its target's count and the top continuation. scratch is zero
    on entry and exit; a document's end (SEP) counts as EOS, which the stream never holds."""
    for u in range(lo.shape[0]):
        nt = 0
        for s in range(len(toks)):
            a = lo[u, s]
            b = hi[u, s]
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
        best = -1
        bc = 0
        for i in range(nt):
            c = touched[i]
            v = scratch[c]
            if v > bc or (v == bc and c < best):
                best, bc = c, v
        for j in range(grp[u], grp[u + 1]):
            p = pos[j]
            out_tcnt[p] = scratch[target[p]]
            out_top[p] = best
            out_topc[p] = bc
        for i in range(nt):
            scratch[touched[i]] = 0


def continuations(idx, ids: np.ndarray, starts: np.ndarray, caps, *, threads: int = 1) -> dict[int, Continuations]:
    """Continuations of every position of the documents ids[starts[k]:starts[k+1]], for each
    cap in caps (0: uncapped, the ∞-gram's longest match)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    caps = list(dict.fromkeys(caps))
    parts: list[dict[int, Continuations]] = []
    a = 0
    while a < len(starts) - 1:  # whole documents, about CHUNK positions at a time
        b = max(a + 1, int(np.searchsorted(starts, starts[a] + CHUNK, side="right")) - 1)
        b = min(b, len(starts) - 1)
        st = starts[a : b + 1] - starts[a]
        parts.append(_chunk(idx, ids[starts[a] : starts[b]], st, caps, threads))
        a = b
    if not parts:
        z = np.zeros(0, np.int64)
        return {c: Continuations(z, z, z, z, z) for c in caps}
    return {
        c: Continuations(*(np.concatenate([getattr(p[c], f) for p in parts]) for f in Continuations.__dataclass_fields__)) for c in caps
    }


def _chunk(idx, ids: np.ndarray, starts: np.ndarray, caps: list[int], threads: int) -> dict[int, Continuations]:
    P, S, C = len(ids), len(idx.shards), len(caps)
    V = max(idx.vocab_size, idx.eos_id + 1, int(ids.max(initial=0)) + 1)
    target = np.append(ids[1:], 0)
    target[starts[1:] - 1] = idx.eos_id  # a document's last position is followed by its end
    L = np.zeros((C, S, P), np.int64)
    lo = np.zeros((C, S, P), np.int64)
    hi = np.zeros((C, S, P), np.int64)
    for ci, cap in enumerate(caps):
        for si, s in enumerate(idx.shards):
            K.match_lengths_docs(
                s.tok, s.sa.words, s.sa.width, s.n, ids, starts, cap if cap > 0 else UNCAPPED, L[ci, si], lo[ci, si], hi[ci, si]
            )
    Lm = L.max(1)  # (C, P)
    held = (L == Lm[:, None, :]) & (Lm[:, None, :] > 0)
    lo = np.where(held, lo, 0).transpose(0, 2, 1).reshape(C * P, S)  # rows: (cap, position)
    hi = np.where(held, hi, 0).transpose(0, 2, 1).reshape(C * P, S)
    Lm = Lm.reshape(-1)
    count = (hi - lo).sum(1)
    first = held.transpose(0, 2, 1).reshape(C * P, S).argmax(1)
    rows = np.nonzero(Lm > 0)[0]
    key = np.stack([Lm[rows], first[rows], lo[rows, first[rows]]], 1)
    _, rep, inv = np.unique(key, axis=0, return_index=True, return_inverse=True)
    inv = inv.ravel()
    order = np.argsort(inv, kind="stable")
    grp = np.searchsorted(inv[order], np.arange(len(rep) + 1))
    pos = rows[order]
    u_rows = rows[rep]
    tgt = np.tile(target, C)
    tcnt = np.zeros(C * P, np.int64)
    top = np.full(C * P, -1, np.int64)
    topc = np.zeros(C * P, np.int64)
    toks = nb.typed.List([np.asarray(s.tok) for s in idx.shards])
    words = nb.typed.List([np.asarray(s.sa.words) for s in idx.shards])
    widths = np.array([s.sa.width for s in idx.shards], np.int64)
    u_lo, u_hi, u_d = lo[u_rows], hi[u_rows], Lm[u_rows]

    def run(ua: int, ub: int) -> None:
        scratch = np.zeros(V, np.int64)
        touched = np.zeros(V, np.int64)
        g = grp[ua : ub + 1]
        _histograms(
            toks, words, widths, idx.sep, idx.eos_id, u_lo[ua:ub], u_hi[ua:ub], u_d[ua:ub], g, pos, tgt, tcnt, top, topc, scratch, touched
        )

    bounds = np.linspace(0, len(rep), max(1, min(threads, len(rep))) * 8 + 1).astype(int)
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(run, bounds[:-1], bounds[1:]))
    else:
        for ua, ub in zip(bounds[:-1], bounds[1:]):
            run(ua, ub)
    none = Lm == 0  # no suffix occurs: the unigram distribution
    uni = idx.unigram
    count[none] = idx.n_positions
    tcnt[none] = np.append(uni, np.zeros(max(0, V - len(uni)), np.int64))[tgt[none]]
    top[none] = int(np.argmax(uni))
    topc[none] = int(uni.max())
    return {cap: Continuations(*(x[ci * P : (ci + 1) * P] for x in (Lm, count, tcnt, top, topc))) for ci, cap in enumerate(caps)}
