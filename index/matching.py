"""Longest matches of whole documents against every shard at once: the first step of bulk
scoring (index/bulk.py).

For each position t of a document: L(t), the length of the longest suffix of the document up
to t that occurs in the index, and each shard's suffix-array interval of that suffix (empty in
a shard that lacks it). One pass with two pointers, as for one shard (kernels.match_step), but
over all the shards together: extending the match by a token narrows the intervals of the
shards that hold it; when none does, the match start moves right until some shard holds the
shorter match with the new token, each try a search of every shard from scratch that looks
for the lower bounds alone (an upper bound only where a lower one is an occurrence). These
probes cost most of the pass and grow with the shards, so fewer are made: the index's summed
histograms (index/merged.py) prove, where the tokens before t are a frequent context whose
next tokens over the whole index lack ids[t], that no longer match ends at t
(merged.longest_bound), and a string probed before is answered from a memo (_probe). At 2.43B
tokens in 12 shards, per 63k tokens of time-shifted code: 0.67 s of longest matches, 0.52 s
with the memo, 0.45 s with the bound too. Every step searches the shards in lockstep
(fanout.search_bounds: their cache misses overlap, and the in-memory samples and first-token
blocks start each search).
A shard takes the pattern's first token's block from its unigram counts. In an index of one
shard a search first walks down the shard's stored frequent contexts (index/contexts.py) as far
as they hold the pattern, one token per step and no search (47M tokens: longest matches of 63k
tokens 0.064 s with the walk, 0.084 s without). Over many shards a walk's node lookups, not in
lockstep, cost more than the searches they save, except from one known token, where the first
token's block is large and its search the longest: there a 2-token cap (narrowed from its
first token's block) walks (held-out code at 2.43B tokens in 12 shards, per 63k tokens: longest
matches 0.80 s with the walk from scratch, 0.52 s without; 0.44 s with it for extensions, 0.39
s without; 2-token caps 0.04 s with it, 0.08 s without).

A shard whose 3-token filter (index/trigrams.py) lacks a pattern's last 3 tokens is not
searched: over many shards most searches are made in shards that lack the string, and cost as
much as those that find it.

A string of 2-4 tokens frequent in the whole index (a summed context: index/merged.py) has its
interval in every shard stored with its summed histogram, and is read there instead of searched
in each shard (a third of the capped suffixes of 2 tokens below and a sixth of those of 4, whose
searches cost the most: many shards hold them).

The longest suffix of at most c tokens is the last min(L(t), c) tokens, since every suffix of
a match occurs too. Where L(t) <= c it is the match itself; elsewhere it is the c tokens from
t - c + 1, and the suffixes that start at one position nest: the intervals of ids[j : j + c]
for the caps c in increasing order are found by narrowing each from the last one
(narrow_starts), never from the whole suffix array. Held-out text repeats itself, so each
distinct string is searched once (distinct_starts: 152k capped suffixes of 63k tokens of newer
kernel code are 54k strings), in their sorted order, so that neighbouring searches read
neighbouring ranks.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from .contexts import child
from .fanout import HI, N_STATE, RLCP, SHARD, L, N, search_bounds, set_search
from .merged import longest_bound, summed_row
from .trigrams import word_of

_NB = dict(cache=True, nogil=True)
MEMO = 1 << 16  # probes remembered per pass at most (each S intervals)


@nb.njit(**_NB)
def _search(table, first_rank, pos, prefix, step_log2, ctx, known, ids, st, lo, hi, start, end, d, every, probe=False):
    """Each shard's interval of ids[start:end] into lo, hi, searched inside [lo[s], hi[s])
    (whose suffixes share its first d tokens) in the shards where that is not empty, or from
    the whole shard in all of them (every). True if any shard holds it. A summed context of the
    index (known: merged.tables) has its intervals read, not searched, and a shard whose
    3-token filter (known[5]) lacks the string's last 3 tokens is not searched. Else a shard
    first walks down its stored frequent contexts (ctx: ShardSet.contexts), one token per step
    and no search, as far as they go (in a set of several shards only from one known token,
    d = 1: module doc); the suffix array is searched only for the rest. A probe searches the
    lower bounds first, and the upper ones where a lower bound is an occurrence."""
    S = table.shape[0]
    if end - start >= 2:
        r = summed_row(known, ids, start, end)
        if r >= 0:  # a summed context: its intervals were stored with its histogram
            spans = known[4]
            for s in range(S):
                lo[s] = spans[r, s, 0]
                hi[s] = spans[r, s, 1]
            return True
    nodes, hists, mins = ctx
    walk = d == 1 or S == 1
    grams = known[5]
    w, bits = np.int64(-1), np.uint64(0)
    if grams.shape[1] > 0 and end - start >= 3:
        w, bits = word_of(grams, ids, end)
    J = np.int64(0)  # an int64, not a literal 0: the kernels it is passed to compile once (a literal compiles its own)
    found = False
    for s in range(S):
        a, b, k = lo[s], hi[s], d
        if every:
            a, b, k = 0, table[s, N], 0
        lo[s] = 0
        hi[s] = 0
        if a >= b or (w >= 0 and (grams[s, w] & bits) != bits):  # empty, or the shard lacks the last 3 tokens
            continue
        if k == 0 and end > start:  # the first token's block
            t0 = ids[start]
            a, b, k = max(first_rank[s, t0], a), min(first_rank[s, t0 + 1], b), 1
        while walk and k < end - start and b - a >= mins[s]:
            x, y = child(nodes[s], hists[s], a, b, k, ids[start + k])
            if x < 0:  # not stored at this depth: search from here
                break
            a, b, k = x, y, k + 1
        if a >= b:
            continue
        if k == end - start:
            lo[s], hi[s] = a, b
            found = True
            continue
        set_search(st, J, s, start, end, a, b, k, 0)
        J += 1
        if not probe:
            set_search(st, J, s, start, end, a, b, k, 1)
            J += 1
    search_bounds(table, first_rank, pos, prefix, step_log2, ids, st, J)
    if probe:
        m = end - start
        K = np.int64(0)
        for j in range(J):
            if st[j, L] < st[j, HI] and st[j, RLCP] == m:  # an occurrence: the upper bound is past it
                s = st[j, SHARD]
                lo[s] = st[j, L]
                set_search(st, K, s, start, end, st[j, L], st[j, HI], 0, 1)
                K += 1
        search_bounds(table, first_rank, pos, prefix, step_log2, ids, st, K)
        for j in range(K):
            hi[st[j, SHARD]] = st[j, L]
        return K > 0 or found
    for j in range(0, J, 2):
        s = st[j, SHARD]
        lo[s] = st[j, L]
        hi[s] = st[j + 1, L]
        if hi[s] > lo[s]:
            found = True
    return found


@nb.njit(**_NB)
def new_memo(S, size):
    """Room for the answers of `size` probes over S shards (_probe): (buckets, rows). buckets,
    2^k >= 2 * size of them, hold a row's number or -1; row r + 1 holds the r-th string's hash,
    its start in ids and length, whether some shard holds it, then its S lower and S upper
    bounds; row 0 counts the rows taken. Plain arrays: a numba call from Python takes them at
    no cost (a typed dict in a tuple cost ~60 us a call)."""
    n = 1
    while n < 2 * size:
        n *= 2
    rows = np.zeros((size + 1, 4 + 2 * S), np.int64)
    return np.full(n, -1, np.int64), rows


@nb.njit(**_NB)
def _probe(table, first_rank, pos, prefix, step_log2, ctx, known, ids, st, lo, hi, start, end, memo):
    """_search's probe of ids[start:end] from scratch, its answer remembered in memo (new_memo)
    and read back when the same string is probed again: text repeats itself, and so do the
    probes after failed extensions (63k tokens of time-shifted code: 23.6k failing probes are
    17.1k strings, 16.6k successful ones 10.0k). Keyed by a hash of the tokens (open
    addressing), the string compared with the one remembered (a position of ids); a memo that is
    full takes no more."""
    buckets, rows = memo
    S = lo.shape[0]
    m = end - start
    h = np.uint64(14695981039346656037)  # FNV-1a over the tokens
    for k in range(start, end):
        h = (h ^ np.uint64(ids[k])) * np.uint64(1099511628211)
    key = np.int64(h)
    mask = buckets.shape[0] - 1
    b = np.int64(h & np.uint64(mask))
    while buckets[b] >= 0:
        r = buckets[b]
        if rows[r, 0] == key and rows[r, 2] == m:
            p = rows[r, 1]
            same = True
            for k in range(m):
                if ids[p + k] != ids[start + k]:
                    same = False
                    break
            if same:
                lo[:] = rows[r, 4 : 4 + S]
                hi[:] = rows[r, 4 + S : 4 + 2 * S]
                return rows[r, 3] != 0
        b = (b + 1) & mask
    ok = _search(
        table, first_rank, pos, prefix, step_log2, ctx, known, ids, st, lo, hi, start, end, np.int64(0), np.bool_(True), np.bool_(True)
    )
    if rows[0, 0] < rows.shape[0] - 1:  # the empty bucket the search ended at takes it
        r = rows[0, 0] + 1
        rows[0, 0] = r
        buckets[b] = r
        rows[r, 0], rows[r, 1], rows[r, 2], rows[r, 3] = key, start, m, ok
        rows[r, 4 : 4 + S] = lo
        rows[r, 4 + S : 4 + 2 * S] = hi
    return ok


@nb.njit(**_NB)
def extend(table, first_rank, pos, prefix, step_log2, ctx, known, ids, i, t, st, lo, hi, memo):
    """One step of the two-pointer pass: given the longest match ids[i:t] before position t and
    its intervals lo, hi, the longest match ending at t: returns its start (t + 1 when not even
    ids[t] occurs; lo, hi then every rank) with its intervals in lo, hi. After a failed
    extension, the index's summed histograms (known: merged.tables) bound the new match's length
    and the longer probes are not made; memo (new_memo) keeps the answers of the probes, for the
    same string probed again."""
    S = table.shape[0]
    if 0 <= ids[t] < first_rank.shape[1] - 1:
        if _search(
            table, first_rank, pos, prefix, step_log2, ctx, known, ids, st, lo, hi, i, t + 1, t - i, np.bool_(False), np.bool_(False)
        ):
            return i
        most = longest_bound(known, ids, i, t)
        for j in range(max(i + 1, t + 1 - most), t + 1):  # no shard holds ids[i:t+1]: the longest shorter one, from scratch
            if _probe(table, first_rank, pos, prefix, step_log2, ctx, known, ids, st, lo, hi, j, t + 1, memo):
                return j
    for s in range(S):  # not even ids[t] occurs (or the index cannot hold it): start again after it
        lo[s] = 0
        hi[s] = table[s, N]
    return t + 1


@nb.njit(**_NB)
def longest_matches(table, first_rank, pos, prefix, step_log2, ctx, known, ids, starts, out_len, out_lo, out_hi):
    """For every position t of the documents ids[starts[k]:starts[k+1]]: out_len[t] = L(t) and
    out_lo[t, s], out_hi[t, s] each shard's interval of ids[t-L+1 : t+1] (every rank when L is
    0). A token outside the vocabulary matches nothing."""
    S = table.shape[0]
    st = np.empty((2 * S, N_STATE), np.int64)
    lo = np.empty(S, np.int64)
    hi = np.empty(S, np.int64)
    memo = new_memo(S, min(MEMO, starts[-1] - starts[0]))
    for k in range(starts.shape[0] - 1):
        i = starts[k]  # the match is ids[i:t]; lo, hi its intervals
        for s in range(S):
            lo[s] = 0
            hi[s] = table[s, N]
        for t in range(starts[k], starts[k + 1]):
            i = extend(table, first_rank, pos, prefix, step_log2, ctx, known, ids, i, t, st, lo, hi, memo)
            out_len[t] = t - i + 1
            for s in range(S):
                out_lo[t, s] = lo[s]
                out_hi[t, s] = hi[s]


@nb.njit(**_NB)
def narrow_starts(table, first_rank, pos, prefix, step_log2, ctx, known, ids, js, c, in_lo, in_hi, cp, out_lo, out_hi):
    """For each start j of js, each shard's interval of ids[j : j + c] into row j + c - 1 of
    out_lo, out_hi (P, S): searched inside the intervals of ids[j : j + cp] (cp < c), row
    j + cp - 1 of in_lo, in_hi, or in the whole shard when cp is 0."""
    S = table.shape[0]
    st = np.empty((2 * S, N_STATE), np.int64)
    lo = np.empty(S, np.int64)
    hi = np.empty(S, np.int64)
    for j in js:
        for s in range(S):
            lo[s] = in_lo[j + cp - 1, s] if cp > 0 else 0
            hi[s] = in_hi[j + cp - 1, s] if cp > 0 else table[s, N]
        _search(table, first_rank, pos, prefix, step_log2, ctx, known, ids, st, lo, hi, j, j + c, cp, np.bool_(False), np.bool_(False))
        for s in range(S):
            out_lo[j + c - 1, s] = lo[s]
            out_hi[j + c - 1, s] = hi[s]


def distinct_starts(ids: np.ndarray, js: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray]:
    """The starts j of js whose strings ids[j : j + c] are distinct, in the strings' order,
    and for each start of js the index of its string among them. The tokens (>= 0) are packed
    as many to a 64-bit key as fit, and the keys sorted (np.unique over rows is 3-8x slower)."""
    if len(js) == 0:
        return js, js
    bits = max(1, int(ids.max()).bit_length())
    per = 64 // bits
    keys = []
    for a in range(0, c, per):
        k = np.zeros(len(js), np.uint64)
        for i in range(a, min(a + per, c)):
            k = (k << np.uint64(bits)) | ids[js + i].astype(np.uint64)
        keys.append(k)
    order = np.lexsort(keys[::-1])
    new = np.zeros(len(js), bool)
    new[0] = True
    for k in keys:
        k = k[order]
        new[1:] |= k[1:] != k[:-1]
    which = np.empty(len(js), np.int64)
    which[order] = np.cumsum(new) - 1
    return js[order[new]], which
