"""Bulk features of many documents through an index held by a Ray cluster (index/cluster.py):
exactly index/bulk.py's `continuations` of one process holding every shard, computed by the
holders beside their shards.

Two rounds per chunk of documents, each one call to a holder of every group:
1. each holder finds, for every cap and position, its own shards' match length and intervals
   (bulk.match_intervals) and keeps them; the client takes the longest of the groups'. As for
   the ∞-gram (cluster.py), a group whose length equals the longest holds the match and counts,
   and the others hold none of it.
2. the holders that hold a position's match group their positions by context (as bulk.py does)
   and return each context's whole next-token histogram over their shards, and the token after
   its most recent occurrence with the place of the latest shard holding it. The client adds
   the histograms of a context over the groups (a context is known by its length and its
   interval in the first shard that holds it), and reads off the count, the target's count,
   the top k (count desc, id asc) and the continuation of the latest shard.
Positions that match nothing read the index's unigram counts, as bulk.py's do.
"""

from __future__ import annotations

import contextlib

import numba as nb
import numpy as np

from . import kernels as K
from .bulk import CHUNK, READAHEAD_MIN, UNCAPPED, match_intervals
from .features import FIELDS, SCORE_DTYPES, Features
from .packed import get


@nb.njit(cache=True, nogil=True)
def _context_histograms(
    toks, words, widths, samaxs, offs, sep, eos, lo, hi, d, out_off, out_tok, out_cnt, out_n, latest, cont, scratch, touched
):
    """For each context u (rows of lo/hi: its interval per shard, empty where the shard lacks
    it; d[u] its length): its next-token histogram over the shards into out_tok/out_cnt from
    out_off[u] (out_n[u] entries, in no order), the last shard holding it (latest[u]) and the
    token after its most recent occurrence there (cont[u]). A document's end (SEP) counts as
    EOS; scratch is zero on entry and exit."""
    for u in range(lo.shape[0]):
        nt = 0
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
            c = np.int64(tk[p + d[u]])
            cont[u] = eos if c == sep else c
            latest[u] = s
        for i in range(nt):
            out_tok[out_off[u] + i] = touched[i]
            out_cnt[out_off[u] + i] = scratch[touched[i]]
            scratch[touched[i]] = 0
        out_n[u] = nt


def holder_lengths(holder, key, ids: np.ndarray, starts: np.ndarray, caps: list[int]) -> np.ndarray:
    """Round 1 on a holder: its shards' match length per cap and position, (C, P) int64; the
    intervals are kept under `key` for round 2."""
    idx = holder.idx
    with idx.readahead() if len(ids) >= READAHEAD_MIN else contextlib.nullcontext():
        lengths, lo, hi = match_intervals(idx, ids, starts, caps, 1)
    holder.kept = (key, lengths, lo, hi)
    return lengths


def holder_histograms(holder, key, ids: np.ndarray, starts: np.ndarray, caps: list[int], longest: np.ndarray) -> tuple:
    """Round 2 on a holder: for the rows (cap * P + position) whose longest match its shards
    hold, (rows, each row's context, per context: its first shard's place and interval start,
    the latest shard's place and its continuation, the histograms' offsets, tokens and counts)."""
    if getattr(holder, "kept", (None,))[0] != key:  # a replica that did not run round 1 for it
        holder_lengths(holder, key, ids, starts, caps)
    _, lengths, lo, hi = holder.kept
    holder.kept = None
    idx, places = holder.idx, np.asarray(holder.places, np.int64)
    C, P, S = lo.shape
    L = longest.reshape(-1)
    rows = np.flatnonzero((lengths.reshape(-1) == L) & (L > 0))
    if len(rows) == 0:
        z = np.zeros(0, np.int64)
        return rows, z, z, z, z, z, np.zeros(1, np.int64), z, z
    lo, hi = lo.reshape(C * P, S)[rows], hi.reshape(C * P, S)[rows]
    held = hi > lo
    lo, hi = np.where(held, lo, 0), np.where(held, hi, 0)
    first = held.argmax(1)
    fl = lo[np.arange(len(rows)), first]
    ctx_key = np.stack([L[rows], first, fl])
    u_key, u_row, ctx = np.unique(ctx_key, axis=1, return_index=True, return_inverse=True)
    u_lo, u_hi, u_d = lo[u_row], hi[u_row], L[rows][u_row]
    V = max(idx.vocab_size, idx.eos_id + 1)
    room = np.minimum((u_hi - u_lo).sum(1), V)
    off = np.concatenate([[0], np.cumsum(room)])
    tok, cnt = np.zeros(int(off[-1]), np.int64), np.zeros(int(off[-1]), np.int64)
    n, latest, cont = np.zeros(len(u_row), np.int64), np.zeros(len(u_row), np.int64), np.zeros(len(u_row), np.int64)
    sh = idx.shards
    _context_histograms(
        nb.typed.List([np.asarray(s.tok) for s in sh]),
        nb.typed.List([np.asarray(s.sa.words) for s in sh]),
        np.array([s.sa.width for s in sh], np.int64),
        nb.typed.List([np.asarray(s.samax) for s in sh]),
        np.array([[s.off2, s.off3] for s in sh], np.int64).reshape(len(sh), 2),
        idx.sep, idx.eos_id, u_lo, u_hi, u_d, off, tok, cnt, n, latest, cont, np.zeros(V, np.int64), np.zeros(V, np.int64),
    )  # fmt: skip
    keep = np.arange(len(tok)) - np.repeat(off[:-1], room) < np.repeat(n, room)
    return (
        rows,
        ctx.reshape(-1),
        places[u_key[1]],
        u_key[2],
        places[latest],
        cont,
        np.concatenate([[0], np.cumsum(n)]),
        tok[keep],
        cnt[keep],
    )


def continuations(cidx, ids: np.ndarray, starts: np.ndarray, caps, *, top_k: int = 1) -> dict[int, Features]:
    """bulk.continuations through a ClusterIndex: Features (with target_cnt) of every position of
    the documents ids[starts[k]:starts[k+1]], for each cap in caps (<= 0: uncapped)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    asked = list(dict.fromkeys(caps))
    caps = sorted({max(int(c), 0) for c in asked}, key=lambda c: c if c > 0 else UNCAPPED)
    parts: list[dict[int, Features]] = []
    a = 0
    while a < len(starts) - 1:  # whole documents, about CHUNK positions at a time
        b = min(max(a + 1, int(np.searchsorted(starts, starts[a] + CHUNK, side="right")) - 1), len(starts) - 1)
        parts.append(_chunk(cidx, ids[starts[a] : starts[b]], starts[a : b + 1] - starts[a], caps, top_k))
        a = b
    if not parts:
        return {c: _empty(0, top_k) for c in asked}
    return {c: Features(*(np.concatenate([getattr(p[max(int(c), 0)], f) for p in parts]) for f in (*FIELDS, "target_cnt"))) for c in asked}


def _empty(n: int, k: int) -> Features:
    f = Features.empty(n, k, SCORE_DTYPES)
    return Features(f.length, f.cont, f.count, f.topk_ids, f.topk_cnt, np.zeros(n, np.int64))


def _chunk(cidx, ids: np.ndarray, starts: np.ndarray, caps: list[int], k: int) -> dict[int, Features]:
    """One chunk's features per cap: the two rounds, then the merge."""
    G, C, P = len(cidx.groups), len(caps), len(ids)
    key = cidx.next_key()
    lengths = cidx.run_all(("bulk_lengths", key, ids, starts, caps))
    L = np.max(np.stack([lengths[g] for g in range(G)]), axis=0)  # (C, P)
    got = cidx.run_all(("bulk_histograms", key, ids, starts, caps, L))
    target = np.append(ids[1:], 0)
    target[starts[1:] - 1] = cidx.eos_id  # a document's last position is followed by its end
    tgt = np.tile(target, C)
    f = _empty(C * P, k)
    f.length[:] = L.reshape(-1)
    # a context's global key: its length and its interval start in the first shard holding it
    rows = np.concatenate([got[g][0] for g in range(G)])
    fp = np.concatenate([got[g][2][got[g][1]] for g in range(G)])
    flo = np.concatenate([got[g][3][got[g][1]] for g in range(G)])
    order = np.lexsort((flo, fp, rows))
    firsts = order[np.diff(rows[order], prepend=-1) != 0]
    row_key = np.full((C * P, 2), -1, np.int64)
    row_key[rows[firsts], 0], row_key[rows[firsts], 1] = fp[firsts], flo[firsts]
    hit = np.flatnonzero(row_key[:, 0] >= 0)
    ctx_of_row = np.full(C * P, -1, np.int64)
    if len(hit):
        _, row_ctx = np.unique(np.stack([f.length[hit], row_key[hit, 0], row_key[hit, 1]]), axis=1, return_inverse=True)
        ctx_of_row[hit] = row_ctx.reshape(-1)
    n_ctx = int(ctx_of_row.max(initial=-1)) + 1
    # every group's histograms, each under its context's global id
    hist_ctx, hist_tok, hist_cnt, best_place, best_cont = [], [], [], np.full(n_ctx, -1, np.int64), np.full(n_ctx, -1, np.int64)
    for g in range(G):
        g_rows, g_ctx, _, _, g_latest, g_cont, g_off, g_tok, g_cnt = got[g]
        _, one = np.unique(g_ctx, return_index=True)
        gid = ctx_of_row[g_rows[one]]  # the global id of each of the group's contexts
        hist_ctx.append(np.repeat(gid, np.diff(g_off)))
        hist_tok.append(g_tok)
        hist_cnt.append(g_cnt)
        later = g_latest > best_place[gid]
        best_place[gid[later]], best_cont[gid[later]] = g_latest[later], g_cont[later]
    hc, ht, hn = np.concatenate(hist_ctx), np.concatenate(hist_tok), np.concatenate(hist_cnt)
    V = max(cidx.vocab_size, cidx.eos_id + 1, int(ids.max(initial=0)) + 1)
    u, inv = np.unique(hc * V + ht, return_inverse=True)
    sums = np.zeros(len(u), np.int64)
    np.add.at(sums, inv, hn)
    uc, ut = u // V, u % V
    # per context: the count, the top k (count desc, id asc), the continuation; per row: the target's count
    total = np.zeros(n_ctx, np.int64)
    np.add.at(total, uc, sums)
    top, topc = np.full((n_ctx, k), -1, np.int64), np.zeros((n_ctx, k), np.int64)
    o = np.lexsort((ut, -sums, uc))
    rank = np.arange(len(o)) - np.searchsorted(uc[o], uc[o], side="left")
    sel = o[rank < k]
    top[uc[sel], rank[rank < k]], topc[uc[sel], rank[rank < k]] = ut[sel], sums[sel]
    f.count[hit] = total[ctx_of_row[hit]]
    f.cont[hit] = best_cont[ctx_of_row[hit]]
    f.topk_ids[hit], f.topk_cnt[hit] = top[ctx_of_row[hit]], topc[ctx_of_row[hit]]
    if len(hit):
        want = ctx_of_row[hit] * V + tgt[hit]
        j = np.minimum(np.searchsorted(u, want), len(u) - 1)
        f.target_cnt[hit] = np.where(u[j] == want, sums[j], 0)
    none = f.length == 0  # no suffix occurs: the unigram distribution
    uni = cidx.unigram
    f.count[none] = cidx.n_positions
    f.target_cnt[none] = np.append(uni, np.zeros(max(0, V - len(uni)), np.int64))[tgt[none]]
    nz = np.nonzero(uni)[0]
    best = nz[np.lexsort((nz, -uni[nz]))][:k]
    f.topk_ids[none, : len(best)] = best
    f.topk_cnt[none, : len(best)] = uni[best]
    return {cap: Features(*(getattr(f, n)[ci * P : (ci + 1) * P] for n in (*FIELDS, "target_cnt"))) for ci, cap in enumerate(caps)}
