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
from .engine import DIST_CACHE_ELEMENTS
from .features import FIELDS, SCORE_DTYPES, Features
from .packed import get

HEAVY = 1 << 12  # a context this frequent: its histogram read through the index's kept ones, its summary kept by the client


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
        nt = np.int64(0)  # an int64, not a literal 0: the kernels it is passed to compile once (a literal compiles its own)
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


def holder_lengths(holder, key, ids: np.ndarray, starts: np.ndarray, caps: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Round 1 on a holder: its shards' match length per cap and position, and the match's place
    in the first of its shards holding it (shard place << 40 | interval start; -1 without a
    match), both (C, P) int64; the intervals are kept under `key` for round 2."""
    idx = holder.idx
    with idx.readahead() if len(ids) >= READAHEAD_MIN else contextlib.nullcontext():
        lengths, lo, hi = match_intervals(idx, ids, starts, caps, 1)
    holder.kept = (key, lengths, lo, hi)
    held = hi > lo
    first = held.argmax(2)
    where = np.asarray(holder.places, np.int64)[first] << 40 | np.take_along_axis(lo, first[..., None], 2)[..., 0]
    return lengths, np.where((lengths > 0) & held.any(2), where, -1)


def holder_histograms(holder, key, ids, starts, caps: list[int], longest: np.ndarray, skip: np.ndarray, heavy: int) -> tuple:
    """Round 2 on a holder: for the rows (cap * P + position) whose longest match its shards
    hold, but those in skip (the client has their context), (rows, each row's context, per
    context: the latest shard's place and its continuation, the histograms' offsets, tokens and
    counts). A context of at least `heavy` occurrences is read through the index's kept
    histograms (Index.segs_dist)."""
    kept = getattr(holder, "kept", None)
    if kept is None or kept[0] != key:  # a replica that did not run round 1 for it
        holder_lengths(holder, key, ids, starts, caps)
    _, lengths, lo, hi = holder.kept
    holder.kept = None
    idx, places = holder.idx, np.asarray(holder.places, np.int64)
    C, P, S = lo.shape
    L = longest.reshape(-1)
    rows = np.flatnonzero((lengths.reshape(-1) == L) & (L > 0) & ~skip)
    if len(rows) == 0:
        z = np.zeros(0, np.int64)
        return rows, z, z, z, np.zeros(1, np.int64), z, z
    lo, hi = lo.reshape(C * P, S)[rows], hi.reshape(C * P, S)[rows]
    held = hi > lo
    lo, hi = np.where(held, lo, 0), np.where(held, hi, 0)
    first = held.argmax(1)
    fl = lo[np.arange(len(rows)), first]
    ctx_key = np.stack([L[rows], first, fl])
    _, u_row, ctx = np.unique(ctx_key, axis=1, return_index=True, return_inverse=True)
    u_lo, u_hi, u_d = lo[u_row], hi[u_row], L[rows][u_row]
    V = max(idx.vocab_size, idx.eos_id + 1)
    occ = (u_hi - u_lo).sum(1)
    light = np.flatnonzero(occ < heavy)
    heavy = np.flatnonzero(occ >= heavy)  # the frequent contexts' histograms are kept by the index (Index.segs_dist)
    kept = {}
    for u in heavy.tolist():
        segs = list(zip(u_lo[u].tolist(), u_hi[u].tolist()))
        kept[u] = (*idx.segs_dist(segs, int(u_d[u])), idx.latest_cont(segs, int(u_d[u])), max(s for s, (a, b) in enumerate(segs) if b > a))
    room = np.minimum(occ, V)
    room[heavy] = [len(kept[u][0]) for u in heavy.tolist()]
    off = np.concatenate([[0], np.cumsum(room)])
    tok, cnt = np.zeros(int(off[-1]), np.int64), np.zeros(int(off[-1]), np.int64)
    n, latest, cont = np.zeros(len(u_row), np.int64), np.zeros(len(u_row), np.int64), np.zeros(len(u_row), np.int64)
    for u, (t, c, cu, lu) in kept.items():
        tok[off[u] : off[u] + len(t)], cnt[off[u] : off[u] + len(t)] = t, c
        n[u], cont[u], latest[u] = len(t), cu, lu
    sh = idx.shards
    ln, llatest, lcont = np.zeros(len(light), np.int64), np.zeros(len(light), np.int64), np.zeros(len(light), np.int64)
    _context_histograms(
        nb.typed.List([np.asarray(s.tok) for s in sh]),
        nb.typed.List([np.asarray(s.sa.words) for s in sh]),
        np.array([s.sa.width for s in sh], np.int64),
        nb.typed.List([np.asarray(s.samax) for s in sh]),
        np.array([[s.off2, s.off3] for s in sh], np.int64).reshape(len(sh), 2),
        idx.sep, idx.eos_id, u_lo[light], u_hi[light], u_d[light], off[light], tok, cnt, ln, llatest, lcont, np.zeros(V, np.int64), np.zeros(V, np.int64),
    )  # fmt: skip
    n[light], latest[light], cont[light] = ln, llatest, lcont
    keep = np.arange(len(tok)) - np.repeat(off[:-1], room) < np.repeat(n, room)
    return rows, ctx.reshape(-1), places[latest], cont, np.concatenate([[0], np.cumsum(n)]), tok[keep], cnt[keep]


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
    first = cidx.run_all(("bulk_lengths", key, ids, starts, caps))
    lengths = np.stack([first[g][0].reshape(-1) for g in range(G)])  # (G, C * P)
    L = lengths.max(0)
    # a context is known by its length and its place in the first shard holding it
    row_key = np.where((lengths == L) & (L > 0), np.stack([first[g][1].reshape(-1) for g in range(G)]), np.iinfo(np.int64).max).min(0)
    hit = np.flatnonzero(L > 0)
    ctx_of_row = np.full(C * P, -1, np.int64)
    ctx_key = np.zeros((2, 0), np.int64)
    if len(hit):
        ctx_key, inv = np.unique(np.stack([L[hit], row_key[hit]]), axis=1, return_inverse=True)
        ctx_of_row[hit] = inv.reshape(-1)
    n_ctx = ctx_key.shape[1]
    summaries = [cidx.summaries.get((int(a), int(b), k)) for a, b in ctx_key.T.tolist()]  # kept with their top k
    known = np.array([x is not None for x in summaries], bool)
    skip = np.zeros(C * P, bool)
    skip[hit] = known[ctx_of_row[hit]]
    got = cidx.run_all(("bulk_histograms", key, ids, starts, caps, L, skip, HEAVY))
    # the groups' histograms of the contexts not known, added, each under its context's id
    hist_ctx, hist_tok, hist_cnt, best_place, cont = [], [], [], np.full(n_ctx, -1, np.int64), np.full(n_ctx, -1, np.int64)
    for g in range(G):
        g_rows, g_ctx, g_latest, g_cont, g_off, g_tok, g_cnt = got[g]
        _, one = np.unique(g_ctx, return_index=True)
        gid = ctx_of_row[g_rows[one]]  # the id of each of the group's contexts
        hist_ctx.append(np.repeat(gid, np.diff(g_off)))
        hist_tok.append(g_tok)
        hist_cnt.append(g_cnt)
        later = g_latest > best_place[gid]
        best_place[gid[later]], cont[gid[later]] = g_latest[later], g_cont[later]
    V = max(cidx.vocab_size, cidx.eos_id + 1, int(ids.max(initial=0)) + 1)
    u, inv = np.unique(np.concatenate(hist_ctx) * V + np.concatenate(hist_tok), return_inverse=True)
    sums = np.zeros(len(u), np.int64)
    np.add.at(sums, inv, np.concatenate(hist_cnt))
    uc, ut = u // V, u % V
    total = np.zeros(n_ctx, np.int64)
    np.add.at(total, uc, sums)
    top, topc = np.full((n_ctx, k), -1, np.int64), np.zeros((n_ctx, k), np.int64)
    o = np.lexsort((ut, -sums, uc))  # per context: count desc, id asc
    rank = np.arange(len(o)) - np.searchsorted(uc[o], uc[o], side="left")
    sel = o[rank < k]
    top[uc[sel], rank[rank < k]], topc[uc[sel], rank[rank < k]] = ut[sel], sums[sel]
    # the known contexts from the client's summaries; the new frequent ones kept for the next chunk
    bounds = np.searchsorted(uc, np.arange(n_ctx + 1))
    for c in np.flatnonzero(known).tolist():
        total[c], top[c], topc[c], cont[c] = summaries[c][2:]
    for c in np.flatnonzero(~known & (total >= HEAVY)).tolist():
        _keep(
            cidx,
            (int(ctx_key[0, c]), int(ctx_key[1, c]), k),
            (
                ut[bounds[c] : bounds[c + 1]].copy(),
                sums[bounds[c] : bounds[c + 1]].copy(),
                total[c],
                top[c].copy(),
                topc[c].copy(),
                cont[c],
            ),
        )
    known_c = np.flatnonzero(known)
    kt = [summaries[c][0] for c in known_c.tolist()]
    ku = np.concatenate(
        [np.zeros(0, np.int64)] + [c * V + t for c, t in zip(known_c.tolist(), kt)]
    )  # sorted: contexts ascending, tokens sorted
    ks = np.concatenate([np.zeros(0, np.int64)] + [summaries[c][1] for c in known_c.tolist()])
    target = np.append(ids[1:], 0)
    target[starts[1:] - 1] = cidx.eos_id  # a document's last position is followed by its end
    tgt = np.tile(target, C)
    f = _empty(C * P, k)
    f.length[:] = L
    f.count[hit], f.cont[hit] = total[ctx_of_row[hit]], cont[ctx_of_row[hit]]
    f.topk_ids[hit], f.topk_cnt[hit] = top[ctx_of_row[hit]], topc[ctx_of_row[hit]]
    for keys, counts in ((u, sums), (ku, ks)):
        if len(keys):
            want = ctx_of_row[hit] * V + tgt[hit]
            j = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
            f.target_cnt[hit] += np.where(keys[j] == want, counts[j], 0)
    none = f.length == 0  # no suffix occurs: the unigram distribution
    uni = cidx.unigram
    f.count[none] = cidx.n_positions
    f.target_cnt[none] = np.append(uni, np.zeros(max(0, V - len(uni)), np.int64))[tgt[none]]
    nz = np.nonzero(uni)[0]
    best = nz[np.lexsort((nz, -uni[nz]))][:k]
    f.topk_ids[none, : len(best)] = best
    f.topk_cnt[none, : len(best)] = uni[best]
    return {cap: Features(*(getattr(f, n)[ci * P : (ci + 1) * P] for n in (*FIELDS, "target_cnt"))) for ci, cap in enumerate(caps)}


def _keep(cidx, key: tuple, summary: tuple) -> None:
    """Keep a frequent context's merged histogram and summary on the client; all are dropped
    when they would pass the index's bound (engine.DIST_CACHE_ELEMENTS entries)."""
    if cidx.summary_elements + len(summary[0]) > DIST_CACHE_ELEMENTS:
        cidx.summaries.clear()
        cidx.summary_elements = 0
    cidx.summaries[key] = summary
    cidx.summary_elements += len(summary[0])
