"""Numba kernels of the bulk per-token features of one shard (see builder/features.py).

Notation: T the shard's token stream (doc0 SEP doc1 SEP ...), sa the unpacked suffix array
(starts of non-SEP positions), rank its inverse (-1 at SEP), doc[p] the document of position p,
C the match-length cap. For a position t, s = T[i*..t] is the longest allowed suffix, L = t-i*+1.
"""

import numba as nb
import numpy as np

_NB = dict(cache=True, nogil=True)

CAUSAL = 0
EXCLUDE_DOC = 1


@nb.njit(**_NB)
def rank_and_doc(sa, starts, rank, doc, sadoc):
    """Fill the inverse suffix array (-1 at separators), the document of every position, and
    sadoc[r] = doc[sa[r]] (so that the rank-order sweeps read documents sequentially).
    (Outputs are allocated by the caller: numpy gives large arrays huge pages, which matters
    for the random accesses of every kernel here; numba's own allocations do not get them.)"""
    for k in range(starts.shape[0] - 1):
        for p in range(starts[k], starts[k + 1]):
            doc[p] = k
    rank[:] = -1
    for r in range(sa.shape[0]):
        p = sa[r]
        rank[p] = r
        sadoc[r] = doc[p]


@nb.njit(**_NB)
def kasai_capped(T, sa, rank, sep, cap, lcp):
    """lcp[r] = common prefix of the suffixes at ranks r-1 and r, at most cap, never through a
    separator (so it never spans a document end). Kasai's linear scan in text order: the
    capped, separator-stopped lcp still drops by at most one from one position to the next."""
    lcp[0] = 0
    h = 0
    for i in range(T.shape[0]):
        r = rank[i]
        if r < 0:
            h = 0
            continue
        if r == 0:
            h = 0
            continue
        j = sa[r - 1]
        while h < cap and T[i + h] == T[j + h] and T[i + h] != sep:
            h += 1
        lcp[r] = h
        if h > 0:
            h -= 1


@nb.njit(**_NB)
def longest_previous(sa, lcp, ms):
    """ms[p]: longest prefix of the suffix at p that also starts at an earlier position
    (longest previous factor, Crochemore-Ilie): the max lcp with the nearest ranks on either
    side holding a smaller position, found with one stack pass over the suffix array."""
    n = sa.shape[0]
    ms[:] = 0
    stack = np.empty(n + 1, np.int64)
    up = np.zeros(n, np.uint8)  # lcp with the previous-smaller rank
    top = -1
    for r in range(n + 1):
        v = sa[r] if r < n else -1
        cur = np.int64(lcp[r]) if r < n else 0
        while top >= 0 and v < sa[stack[top]]:
            x = stack[top]
            top -= 1
            ms[sa[x]] = up[x] if up[x] > cur else cur
            if up[x] < cur:
                cur = up[x]
        if r < n:
            up[r] = cur if top >= 0 else 0
            top += 1
            stack[top] = r


@nb.njit(**_NB)
def longest_other_doc(sa, lcp, sadoc, ms):
    """ms[p]: longest prefix of the suffix at p that also starts in another document: the max
    lcp with the nearest ranks on either side from a different document (two linear passes).
    Only the positions in sa are written (the caller zeroes the others, e.g. separators)."""
    n = sa.shape[0]
    left = np.zeros(n, np.uint8)
    for r in range(1, n):
        if sadoc[r - 1] != sadoc[r]:
            left[r] = lcp[r]
        else:
            left[r] = left[r - 1] if left[r - 1] < lcp[r] else lcp[r]
    right = np.uint8(0)
    for r in range(n - 1, -1, -1):
        if r == n - 1:
            right = 0
        elif sadoc[r + 1] != sadoc[r]:
            right = lcp[r + 1]
        else:
            right = right if right < lcp[r + 1] else lcp[r + 1]
        ms[sa[r]] = left[r] if left[r] > right else right


@nb.njit(**_NB)
def match_lengths_from_ms(ms, starts, cap, out_len):
    """L(t) = t - i* + 1 with i* the smallest start in t's document such that T[i*..t] occurs
    allowed, i.e. i* + ms[i*] > t (and L <= cap). i + ms[i] never decreases, so i* only moves
    right: one pass per document."""
    for k in range(starts.shape[0] - 1):
        ds = starts[k]
        de = starts[k + 1] - 1  # the separator
        i = ds
        for t in range(ds, de):
            while i <= t and (i + np.int64(ms[i]) <= t or t - i + 1 > cap):
                i += 1
            out_len[t] = t - i + 1
        out_len[de] = 0


@nb.njit(inline="always")
def _next_tok(T, p, sep, eos):
    x = np.int64(T[p])
    return eos if x == sep else x


@nb.njit(inline="always")
def _insert_topk(ids, cnts, k, tok, c):
    """Put (tok, c) into the sorted top list (count desc, id asc) of length k if it belongs."""
    j = k - 1
    if ids[j] >= 0 and (cnts[j] > c or (cnts[j] == c and ids[j] < tok)):
        return
    while j > 0 and (ids[j - 1] < 0 or cnts[j - 1] < c or (cnts[j - 1] == c and ids[j - 1] > tok)):
        ids[j] = ids[j - 1]
        cnts[j] = cnts[j - 1]
        j -= 1
    ids[j] = tok
    cnts[j] = c


@nb.njit(inline="always")
def _ins_max(sa, d1, d2, d3, lo, hi, thr):
    """Largest value < thr among sa[lo:hi], where d1/d2/d3 hold, per block of 64/4096/262144
    ranks, the largest value < thr (-1: none): the inserted positions of the causal sweep."""
    best = np.int64(-1)
    r = lo
    while r < hi and (r & 63) != 0:
        v = np.int64(sa[r])
        if v < thr and v > best:
            best = v
        r += 1
    while r + 64 <= hi and (r & 4095) != 0:
        if d1[r >> 6] > best:
            best = d1[r >> 6]
        r += 64
    while r + 4096 <= hi and (r & 262143) != 0:
        if d2[r >> 12] > best:
            best = d2[r >> 12]
        r += 4096
    while r + 262144 <= hi:
        if d3[r >> 18] > best:
            best = d3[r >> 18]
        r += 262144
    while r + 4096 <= hi:
        if d2[r >> 12] > best:
            best = d2[r >> 12]
        r += 4096
    while r + 64 <= hi:
        if d1[r >> 6] > best:
            best = d1[r >> 6]
        r += 64
    while r < hi:
        v = np.int64(sa[r])
        if v < thr and v > best:
            best = v
        r += 1
    return best


@nb.njit(inline="always")
def _ins_count(sa, c1, c2, c3, lo, hi, thr):
    """Number of values < thr in sa[lo:hi], with c1/c2/c3 the per-block counts of them."""
    n = np.int64(0)
    r = lo
    while r < hi and (r & 63) != 0:
        n += sa[r] < thr
        r += 1
    while r + 64 <= hi and (r & 4095) != 0:
        n += c1[r >> 6]
        r += 64
    while r + 4096 <= hi and (r & 262143) != 0:
        n += c2[r >> 12]
        r += 4096
    while r + 262144 <= hi:
        n += c3[r >> 18]
        r += 262144
    while r + 4096 <= hi:
        n += c2[r >> 12]
        r += 4096
    while r + 64 <= hi:
        n += c1[r >> 6]
        r += 64
    while r < hi:
        n += sa[r] < thr
        r += 1
    return n


@nb.njit(inline="always")
def _max_below(sa, samax, off2, off3, lo, hi, thr):
    """Largest value < thr among sa[lo:hi] using the static block maxima (samax.bin): a block
    whose maximum is below thr answers at once, others are opened (cheap when few values of
    the range are >= thr, as with one document's occurrences)."""
    best = np.int64(-1)
    r = lo
    while r < hi:
        if (r & 262143) == 0 and r + 262144 <= hi and np.int64(samax[off3 + (r >> 18)]) < thr:
            step = 262144
            v = np.int64(samax[off3 + (r >> 18)])
        elif (r & 4095) == 0 and r + 4096 <= hi and np.int64(samax[off2 + (r >> 12)]) < thr:
            step = 4096
            v = np.int64(samax[off2 + (r >> 12)])
        elif (r & 63) == 0 and r + 64 <= hi and np.int64(samax[r >> 6]) < thr:
            step = 64
            v = np.int64(samax[r >> 6])
        else:
            step = 1
            v = np.int64(sa[r])
            if v >= thr:
                v = -1
        if v > best:
            best = v
        r += step
    return best


@nb.njit(inline="always")
def _heavy_exclude_doc(T, sa, samax, off2, off3, doc_ranks, a, b, d, ds, de, k):
    """own_shard's exclude-doc answer for a large interval sa[a:b] and a query in document d =
    [ds, de): (most recent occurrence outside it, its count; -1 when k = 0)."""
    best = _max_below(sa, samax, off2, off3, a, b, np.int64(T.shape[0]))
    if ds <= best < de:
        best = _max_below(sa, samax, off2, off3, a, b, ds)
    cnt = -1
    if k > 0:
        seg = doc_ranks[ds - d : de - d - 1]
        cnt = (b - a) - (np.searchsorted(seg, b) - np.searchsorted(seg, a))
    return best, cnt


@nb.njit(**_NB)
def own_shard(T, sa, rank, doc, starts, ivl_a, ivl_b, length, mode, sep, eos, k, heavy, samax, off2, off3, doc_ranks, outs, queue):
    """Most recent allowed occurrence, continuation and count of s = T[t-L+1..t], per position,
    in one pass in text order; top-k (k > 0) for small intervals. outs: the per-position
    outputs (cont, pos, count, top-k ids, top-k counts); queue: (heavy_t, heavy_a, heavy_b).

    Small intervals (at most `heavy` suffix-array entries) are scanned. Large ones:
      causal       positions are inserted as the sweep passes them (per-block maxima and
                   counts of inserted values, which only grow), so "most recent occurrence
                   before i*" is a range maximum over inserted values;
      exclude-doc  the static block maxima give the most recent occurrence; if it lies in the
                   own document, the maximum below the document's start; the count subtracts
                   the own document's occurrences, counted in its sorted ranks (doc_ranks).
    With k > 0 large intervals are also queued (heavy_t/a/b) for heavy_groups' top-k; with
    k = 0 (length and continuation only) counts of large intervals are not computed (-1).
    Returns the number queued.
    """
    out_cont, out_pos, out_cnt, out_ids, out_ids_cnt = outs
    heavy_t, heavy_a, heavy_b = queue
    n = sa.shape[0]
    d1 = np.full((n >> 6) + 1, -1, np.int64)
    d2 = np.full((n >> 12) + 1, -1, np.int64)
    d3 = np.full((n >> 18) + 1, -1, np.int64)
    c1 = np.zeros((n >> 6) + 1, np.int64)
    c2 = np.zeros((n >> 12) + 1, np.int64)
    c3 = np.zeros((n >> 18) + 1, np.int64)
    inserted = 0  # causal: positions < inserted are in d*/c*
    n_heavy = 0
    toks = np.empty(heavy, np.int64)
    # the causal insertion and the small intervals' scan stay in this loop: as inline helpers
    # (numba inline="always") they measured 10-50% slower
    for t in range(T.shape[0]):
        L = np.int64(length[t])
        if L == 0:
            continue
        i = t - L + 1
        a = np.int64(ivl_a[t])
        b = np.int64(ivl_b[t])
        d = doc[i]
        ds = np.int64(starts[d])
        de = np.int64(starts[d + 1])
        if b - a > heavy:
            if mode == CAUSAL:
                while inserted < i:
                    rr = rank[inserted]
                    if rr >= 0:
                        d1[rr >> 6] = inserted
                        d2[rr >> 12] = inserted
                        d3[rr >> 18] = inserted
                        if k > 0:
                            c1[rr >> 6] += 1
                            c2[rr >> 12] += 1
                            c3[rr >> 18] += 1
                    inserted += 1
                best = _ins_max(sa, d1, d2, d3, a, b, i)
                cnt = _ins_count(sa, c1, c2, c3, a, b, i) if k > 0 else -1
            else:
                best, cnt = _heavy_exclude_doc(T, sa, samax, off2, off3, doc_ranks, a, b, d, ds, de, k)
            out_pos[t] = best
            out_cnt[t] = cnt
            if k > 0:
                heavy_t[n_heavy] = t
                heavy_a[n_heavy] = a
                heavy_b[n_heavy] = b
                n_heavy += 1
            continue
        # allowed: starts before i (causal) or outside the own document [ds, de) (exclude-doc)
        lo_ok = i if mode == CAUSAL else ds
        hi_ok = T.shape[0] if mode == CAUSAL else de
        best = np.int64(-1)
        cnt = 0
        for r in range(a, b):
            p = np.int64(sa[r])
            if p < lo_ok or p >= hi_ok:
                if p > best:
                    best = p
                if k > 0:
                    toks[cnt] = _next_tok(T, p + L, sep, eos)
                cnt += 1
        out_pos[t] = best
        out_cnt[t] = cnt
        if k > 0 and cnt > 0:
            srt = np.sort(toks[:cnt])
            j = 0
            while j < cnt:
                e = j
                while e < cnt and srt[e] == srt[j]:
                    e += 1
                _insert_topk(out_ids[t], out_ids_cnt[t], k, srt[j], e - j)
                j = e
    cont_from_pos(T, out_pos, length, sep, eos, out_cont)
    return n_heavy


@nb.njit(**_NB)
def cont_from_pos(T, pos, length, sep, eos, out_cont):
    """cont = the token after the occurrence at pos (-1: none), in its own pass: the loads are
    independent, so the processor overlaps their cache misses."""
    for t in range(pos.shape[0]):
        p = np.int64(pos[t])
        out_cont[t] = _next_tok(T, p + np.int64(length[t]), sep, eos) if p >= 0 else -1


@nb.njit(**_NB)
def doc_sorted_ranks(rank, starts):
    """For each document, the sorted suffix-array ranks of its positions (separators left out),
    concatenated: document d's segment is [starts[d] - d, starts[d+1] - d - 1)."""
    out = np.empty(rank.shape[0] - (starts.shape[0] - 1), np.int64)
    for d in range(starts.shape[0] - 1):
        a = starts[d]
        b = starts[d + 1] - 1
        seg = np.sort(rank[a:b].astype(np.int64))
        out[a - d : b - d] = seg
    return out


@nb.njit(**_NB)
def _group_causal(T, ht, order, g, e, L, pos, nxt, k, counts, top_ids, top_cnt, sep, eos, outs):
    """heavy_groups' causal answers for the queries order[g:e] of one group (occurrences at the
    sorted positions pos, their next tokens nxt): in order of i*, the allowed occurrences (a
    prefix of pos) are counted in as i* passes them. outs: as heavy_groups'."""
    out_cont, out_pos, out_cnt, out_ids, out_ids_cnt = outs
    m = pos.shape[0]
    thr = np.empty(e - g, np.int64)
    for j in range(g, e):
        thr[j - g] = ht[order[j]] - L + 1
    qorder = np.argsort(thr, kind="mergesort")
    ins = 0
    if k > 0:
        top_ids[:] = -1
        top_cnt[:] = 0
    for jj in range(e - g):
        t = ht[order[g + qorder[jj]]]
        i = thr[qorder[jj]]
        while ins < m and pos[ins] < i:
            if k > 0:
                tok = nxt[ins]
                counts[tok] += 1
                c = counts[tok]
                # tok may already be listed: remove it, then re-insert with its new count
                for z in range(k):
                    if top_ids[z] == tok:
                        for y in range(z, k - 1):
                            top_ids[y] = top_ids[y + 1]
                            top_cnt[y] = top_cnt[y + 1]
                        top_ids[k - 1] = -1
                        top_cnt[k - 1] = 0
                        break
                _insert_topk(top_ids, top_cnt, k, tok, c)
            ins += 1
        out_cnt[t] = ins
        if ins > 0:
            out_pos[t] = pos[ins - 1]
            out_cont[t] = _next_tok(T, pos[ins - 1] + L, sep, eos)
        else:
            out_pos[t] = -1
            out_cont[t] = -1
        if k > 0:
            out_ids[t, :] = top_ids
            out_ids_cnt[t, :] = top_cnt
    if k > 0:
        for j in range(ins):
            counts[nxt[j]] = 0


@nb.njit(**_NB)
def _group_exclude_doc(T, doc, starts, ht, order, g, e, L, pos, nxt, k, counts, top_ids, top_cnt, sep, eos, outs):
    """heavy_groups' exclude-doc answers for the queries order[g:e] of one group (occurrences at
    the sorted positions pos, their next tokens nxt): the group's histogram, minus the
    occurrences inside each query's own document (a contiguous range of pos). outs: as
    heavy_groups'."""
    out_cont, out_pos, out_cnt, out_ids, out_ids_cnt = outs
    m = pos.shape[0]
    if k > 0:
        for j in range(m):
            counts[nxt[j]] += 1
        # distinct tokens sorted by (count desc, id asc)
        dist = np.unique(nxt)
        dc = np.empty(dist.shape[0], np.int64)
        for j in range(dist.shape[0]):
            dc[j] = counts[dist[j]]
        dorder = np.argsort(-dc, kind="mergesort")  # count desc; dist is id-ascending
    for jj in range(g, e):
        t = ht[order[jj]]
        d = doc[t]
        lo = np.searchsorted(pos, np.int64(starts[d]))
        hi = np.searchsorted(pos, np.int64(starts[d + 1]))
        out_cnt[t] = m - (hi - lo)
        if hi < m:
            best = m - 1
        elif lo > 0:
            best = lo - 1
        else:
            best = -1
        out_pos[t] = pos[best] if best >= 0 else -1
        out_cont[t] = _next_tok(T, pos[best] + L, sep, eos) if best >= 0 else -1
        if k > 0:
            for j in range(lo, hi):
                counts[nxt[j]] -= 1
            # the top k after subtracting from (hi-lo) tokens lie among the first k+(hi-lo)
            top_ids[:] = -1
            top_cnt[:] = 0
            lim = min(dist.shape[0], k + (hi - lo))
            for z in range(lim):
                tok = dist[dorder[z]]
                if counts[tok] > 0:
                    _insert_topk(top_ids, top_cnt, k, tok, counts[tok])
            out_ids[t, :] = top_ids
            out_ids_cnt[t, :] = top_cnt
            for j in range(lo, hi):
                counts[nxt[j]] += 1
    if k > 0:
        for j in range(m):
            counts[nxt[j]] = 0


@nb.njit(**_NB)
def heavy_groups(T, sa, doc, starts, length, mode, sep, eos, k, vocab1, ht, ha, hb, outs):
    """The grouped pass for heavy positions: queries sorted by (interval, L); each group's
    occurrence positions are sorted once and its queries answered from them.

    causal (_group_causal): the allowed occurrences are a prefix of the sorted positions
    (start < i*); queries are answered in order of i* while a per-token count array and an
    exact top-k list are updated incrementally (counts only grow, so a token outside the list
    can only enter it by overtaking the list's last entry). exclude-doc (_group_exclude_doc):
    the group's full histogram, minus the occurrences inside the query's own document (a
    contiguous range of the sorted positions). outs: own_shard's per-position outputs (cont,
    pos, count, top-k ids, top-k counts), filled in at the queued positions ht.
    """
    nq = ht.shape[0]
    if nq == 0:
        return
    key = ha.astype(np.int64) * 256 + length[ht].astype(np.int64)
    order = np.argsort(key, kind="mergesort")
    counts = np.zeros(vocab1, np.int64)
    top_ids = np.empty(k if k > 0 else 1, np.int64)
    top_cnt = np.empty(k if k > 0 else 1, np.int64)
    g = np.int64(0)  # an int64, not a literal 0: the kernels it is passed to compile once (a literal compiles its own)
    while g < nq:
        e = g
        while e < nq and key[order[e]] == key[order[g]]:
            e += 1
        q0 = order[g]
        L = np.int64(length[ht[q0]])
        pos = np.sort(sa[ha[q0] : hb[q0]].astype(np.int64))
        nxt = np.empty(pos.shape[0] if k > 0 else 0, np.int64)  # next tokens, needed for histograms only
        for j in range(nxt.shape[0]):
            nxt[j] = _next_tok(T, pos[j] + L, sep, eos)
        if mode == CAUSAL:
            _group_causal(T, ht, order, g, e, L, pos, nxt, k, counts, top_ids, top_cnt, sep, eos, outs)
        else:
            _group_exclude_doc(T, doc, starts, ht, order, g, e, L, pos, nxt, k, counts, top_ids, top_cnt, sep, eos, outs)
        g = e


@nb.njit(**_NB)
def restricted_histogram(T, sa, rank, doc, lcp, t, L, mode, sep, eos, out_tok, out_cnt):
    """Full next-token histogram of s = T[t-L+1..t] over its allowed occurrences in this shard
    (used where another shard ties on L and histograms must be merged exactly). Scans the
    interval: O(occurrences). Returns the number of distinct tokens written (ids ascending)."""
    i = t - L + 1
    r0 = rank[i]
    a = r0
    while a > 0 and lcp[a] >= L:
        a -= 1
    b = r0 + 1
    while b < lcp.shape[0] and lcp[b] >= L:
        b += 1
    d = doc[i]
    buf = np.empty(b - a, np.int64)
    n = 0
    for r in range(a, b):
        p = np.int64(sa[r])
        if (mode == CAUSAL and p < i) or (mode == EXCLUDE_DOC and doc[p] != d):
            buf[n] = _next_tok(T, p + L, sep, eos)
            n += 1
    srt = np.sort(buf[:n])
    k = 0
    j = 0
    while j < n:
        e = j
        while e < n and srt[e] == srt[j]:
            e += 1
        out_tok[k] = srt[j]
        out_cnt[k] = e - j
        k += 1
        j = e
    return k


@nb.njit(**_NB)
def causal_unigram(stream, base, zero, k, out_ids, out_cnt):
    """Top-k of the running unigram counts (base + stream[..t]) at each t in `zero` (ascending),
    maintained incrementally and exactly (counts only grow)."""
    counts = base.copy()
    top_ids = np.full(k, -1, np.int64)
    top_cnt = np.zeros(k, np.int64)
    # seed the list with the base counts
    for tok in range(counts.shape[0]):
        if counts[tok] > 0:
            _insert_topk(top_ids, top_cnt, k, tok, counts[tok])
    done = 0
    for z in range(zero.shape[0]):
        t = zero[z]
        while done <= t:
            tok = stream[done]
            counts[tok] += 1
            for y in range(k):
                if top_ids[y] == tok:
                    for x in range(y, k - 1):
                        top_ids[x] = top_ids[x + 1]
                        top_cnt[x] = top_cnt[x + 1]
                    top_ids[k - 1] = -1
                    top_cnt[k - 1] = 0
                    break
            _insert_topk(top_ids, top_cnt, k, tok, counts[tok])
            done += 1
        for y in range(k):
            out_ids[t, y] = top_ids[y]
            out_cnt[t, y] = min(top_cnt[y], 2147483647)


@nb.njit(**_NB)
def runs_by_rank(sa, length, run, runr):
    """The positions t sharing a match start i = t - L + 1 form a run (L growing by one);
    run[i] = (first t of the run) * 256 + (its length), -1 where no run starts, and
    runr[r] = run[sa[r]]: gathered once, so that the rank sweeps read it sequentially."""
    run[:] = -1
    for t in range(length.shape[0]):
        L = np.int64(length[t])
        if L > 0:
            i = t - L + 1
            if run[i] < 0:
                run[i] = t * 256
            run[i] += 1
    for r in range(sa.shape[0]):
        runr[r] = run[sa[r]]


@nb.njit(**_NB)
def interval_bounds(sa, lcp, length, run, runr, out_a, out_b):
    """Suffix-array interval [a, b) of s = T[t-L+1..t] for every position t, in two sweeps over
    the ranks instead of a search per position.

    The positions sharing a match start i form a run of t (L growing by one each), so sweeping
    ranks r in order and keeping, for each lcp value v, the last rank holding v, gives
    a = max over v < L of last[v] for all of i's positions with a running maximum; a reverse
    sweep gives b. lcp values are capped (<= 255), so the tables are tiny. `run` (length n_pos)
    and `runr` (length n) are int64 scratch for runs_by_rank, allocated by the caller so that
    numpy gives them huge pages.
    """
    n = sa.shape[0]
    runs_by_rank(sa, length, run, runr)
    # left sweep: a stack of ranks with strictly increasing lcp; the last rank <= r with
    # lcp < L is the topmost stack entry below L. A run's L values are answered from the top
    # down (largest L first), so each run walks the stack once.
    st_r = np.empty(258, np.int64)
    st_v = np.empty(258, np.int64)
    top = -1
    for r in range(n):
        v = np.int64(lcp[r])
        while top >= 0 and st_v[top] >= v:
            top -= 1
        top += 1
        st_r[top] = r
        st_v[top] = v
        x = runr[r]
        if x < 0:
            continue
        f = x >> 8
        cnt = x & 255
        i = sa[r]
        j = top
        for t in range(f + cnt - 1, f - 1, -1):
            L = t - i + 1
            while st_v[j] >= L:
                j -= 1
            out_a[t] = st_r[j]
    # right sweep, mirrored: the first rank > r with lcp < L (n if none)
    top = -1
    for r in range(n - 1, -1, -1):
        if r + 1 < n:
            v = np.int64(lcp[r + 1])
            while top >= 0 and st_v[top] >= v:
                top -= 1
            top += 1
            st_r[top] = r + 1
            st_v[top] = v
        x = runr[r]
        if x < 0:
            continue
        f = x >> 8
        cnt = x & 255
        i = sa[r]
        j = top
        for t in range(f + cnt - 1, f - 1, -1):
            L = t - i + 1
            while j >= 0 and st_v[j] >= L:
                j -= 1
            out_b[t] = st_r[j] if j >= 0 else n


@nb.njit(inline="always")
def _merge2(m1, d1, m2, n1, e1, n2):
    """Merge two 'largest position (m1, its document d1), largest position of another document
    (m2)' summaries (-1: none) into one."""
    if m1 >= n1:
        o = n1 if e1 != d1 else n2
        return m1, d1, (m2 if m2 > o else o)
    o = m1 if d1 != e1 else m2
    return n1, e1, (n2 if n2 > o else o)


@nb.njit(**_NB)
def exclude_doc_recent(T, sa, lcp, sadoc, length, run, runr, sep, eos, out_pos, out_cont):
    """Exclude-doc length + continuation without intervals or scans: the most recent occurrence
    of s = T[t-L+1..t] in another document for every t (recent_other_doc), then its next token.
    run/runr: scratch for runs_by_rank."""
    runs_by_rank(sa, length, run, runr)
    out_pos[:] = -1
    recent_other_doc(sa, lcp, sadoc, runr, np.empty(0, np.int64), out_pos)
    cont_from_pos(T, out_pos, length, sep, eos, out_cont)


@nb.njit(**_NB)
def recent_other_doc(sa, lcp, sadoc, runr, base, out_pos):
    """The most recent occurrence of s = T[t-L+1..t] in another document, for every run of
    positions t (runr[r]: the run of the match start sa[r], as runs_by_rank packs it), in the
    two rank sweeps of interval_bounds. Each stack entry also summarises the ranks it covers by
    (largest position, its document, largest position of another document); a query for
    document d takes the largest position outside d of each entry its interval spans (the
    first, or the second if the first lies in d). The answer for t goes to out_pos[t], or with
    a non-empty base to out_pos[base[r] + (t - first t of the run)] (runs numbered within a
    part of the ranks); out_pos starts at -1."""
    n = sa.shape[0]
    local = base.shape[0] > 0
    st_r = np.empty(258, np.int64)
    st_v = np.empty(258, np.int64)
    a_m1 = np.empty(258, np.int64)
    a_d1 = np.empty(258, np.int64)
    a_m2 = np.empty(258, np.int64)
    # left sweep: entry j covers ranks [st_r[j], st_r[j+1]) (the top one up to r); popped
    # entries are merged into the entry below them
    top = -1
    for r in range(n):
        v = np.int64(lcp[r])
        m1, d1, m2 = np.int64(-1), np.int64(-1), np.int64(-1)
        while top >= 0 and st_v[top] >= v:
            m1, d1, m2 = _merge2(m1, d1, m2, a_m1[top], a_d1[top], a_m2[top])
            top -= 1
        if top >= 0:
            a_m1[top], a_d1[top], a_m2[top] = _merge2(a_m1[top], a_d1[top], a_m2[top], m1, d1, m2)
        top += 1
        st_r[top] = r
        st_v[top] = v
        a_m1[top] = sa[r]
        a_d1[top] = sadoc[r]
        a_m2[top] = -1
        x = runr[r]
        if x < 0:
            continue
        f = x >> 8
        slot0 = base[r] - f if local else np.int64(0)
        i = np.int64(sa[r])
        d = np.int64(sadoc[r])
        best = np.int64(-1)  # over the entries above j, outside document d
        j = top
        for t in range(f + (x & 255) - 1, f - 1, -1):
            L = t - i + 1
            while st_v[j] >= L:
                best = max(best, a_m1[j] if a_d1[j] != d else a_m2[j])
                j -= 1
            out_pos[slot0 + t] = max(best, a_m1[j] if a_d1[j] != d else a_m2[j])  # ranks [st_r[j], r]
    # right sweep, mirrored: entry j covers [st_r[j], st_r[j-1]) (the bottom one up to n);
    # a pushed entry absorbs the entries it pops
    top = -1
    for r in range(n - 1, -1, -1):
        if r + 1 < n:
            v = np.int64(lcp[r + 1])
            m1, d1, m2 = np.int64(sa[r + 1]), np.int64(sadoc[r + 1]), np.int64(-1)
            while top >= 0 and st_v[top] >= v:
                m1, d1, m2 = _merge2(m1, d1, m2, a_m1[top], a_d1[top], a_m2[top])
                top -= 1
            top += 1
            st_r[top] = r + 1
            st_v[top] = v
            a_m1[top], a_d1[top], a_m2[top] = m1, d1, m2
        x = runr[r]
        if x < 0:
            continue
        f = x >> 8
        slot0 = base[r] - f if local else np.int64(0)
        i = np.int64(sa[r])
        d = np.int64(sadoc[r])
        best = np.int64(-1)
        j = top
        for t in range(f + (x & 255) - 1, f - 1, -1):
            L = t - i + 1
            while j >= 0 and st_v[j] >= L:  # ranks [r+1, st_r[j]) are the entries above j
                best = max(best, a_m1[j] if a_d1[j] != d else a_m2[j])
                j -= 1
            if best > out_pos[slot0 + t]:
                out_pos[slot0 + t] = best
