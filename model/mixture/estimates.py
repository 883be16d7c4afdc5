"""Exact-match estimates of the next token, read off the index and off the document's own
earlier text (the document cache), for every position of a document at once.

Components, by name (an n-gram estimate conditions on the last n - 1 tokens):
  index_infgram          the ∞-gram: continuations of the longest suffix of the context that
                         occurs in the index (infini-gram's)
  index_2gram ... index_17gram
                         continuations of the last 1, 2, 4, 8, 16 tokens in the index (fewer when
                         the longest suffix is shorter)
  cache_longest          continuations of the longest suffix (of CACHE_LENGTHS tokens) that
                         occurred earlier in the same document
  cache_2gram ... cache_17gram
                         continuations of the last 1, 2, 4, 8, 16 tokens earlier in the document
Per component NAME, for each target: p_NAME (its probability of the actual next token),
count_NAME (occurrences of its context), share_NAME and top_NAME (its most frequent
continuation's share and id). Also index_length (the ∞-gram's suffix length), cache_length
(cache_longest's) and sparse (a single continuation follows the ∞-gram's suffix).
Held-out text is, by construction, not in the index, but it repeats itself -- identifiers,
boilerplate, whole lines of code -- and a small model's attention copies poorly; both kinds
are exact-match lookups, and neither sees a token before it is predicted.
"""

from __future__ import annotations

from pathlib import Path

import numba as nb
import numpy as np
from teragram.index import format as fmt

ORDERS = (1, 2, 4, 8, 16)  # context lengths of the fixed-order estimates
INDEX = ("index_infgram", *(f"index_{k + 1}gram" for k in ORDERS))
CACHE = ("cache_longest", *(f"cache_{k + 1}gram" for k in ORDERS))
COMPONENTS = INDEX + CACHE
CACHE_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # cache_longest: the longest of these that occurred
# The names gates were saved with before the components were named (model/mixture/gate.py reads them).
LEGACY_NAMES = {"": "index_infgram", "c": "cache_longest"} | {str(k): f"index_{k + 1}gram" for k in ORDERS}
LEGACY_NAMES |= {f"c{k}": f"cache_{k + 1}gram" for k in ORDERS}


def context_length(name: str) -> int:
    """Tokens of context of a fixed-order component (index_5gram: 4); 0 for the longest-match ones."""
    return int(name.rsplit("_", 1)[1].removesuffix("gram")) - 1 if name.endswith("gram") and "infgram" not in name else 0


def index_estimates(idx, ids) -> dict[str, np.ndarray]:
    """The index's estimates for each target of a document read as EOS + ids (ids[0] ..
    ids[-1], then EOS). The first target sees no context: the unigram distribution."""
    return index_estimates_docs(idx, [ids])


def index_estimates_docs(idx, docs: list[np.ndarray], threads: int = 1) -> dict[str, np.ndarray]:
    """index_estimates of each document, concatenated, computed for all of them at once
    (index/bulk.py: each distinct context's continuations once, summed over the shards)."""
    from teragram.index.bulk import continuations

    lens = np.array([len(d) for d in docs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)])
    ids = np.concatenate([np.asarray(d, np.int64) for d in docs]) if len(docs) else np.zeros(0, np.int64)
    caps = {name: context_length(name) for name in INDEX}  # 0: uncapped, the ∞-gram
    cont = continuations(idx, ids, starts, caps.values(), threads=threads)
    first = starts[:-1] + np.arange(len(docs))  # each document's first target: no context
    rest = np.ones(len(ids) + len(docs), bool)
    rest[first] = False
    uni = idx.unigram
    t0 = np.full(len(docs), idx.eos_id)
    t0[lens > 0] = ids[starts[:-1][lens > 0]]

    def col(row0, values: np.ndarray) -> np.ndarray:
        out = np.empty(len(rest), np.result_type(np.asarray(row0), values))
        out[first], out[rest] = row0, values
        return out

    N = idx.n_positions
    out = {"index_length": col(0, cont[0].length.astype(np.int64))}
    for name, cap in caps.items():
        r = cont[cap]
        c = np.maximum(r.count, 1)
        out[f"p_{name}"] = col(uni[t0] / N, r.target_cnt / c)
        out[f"count_{name}"] = col(N, r.count)
        out[f"share_{name}"] = col(uni.max() / N, r.topk_cnt[:, 0] / c)
        out[f"top_{name}"] = col(int(np.argmax(uni)), r.topk_ids[:, 0].astype(np.int64))
    out["sparse"] = out["share_index_infgram"] >= 1.0
    return out


@nb.njit(cache=True, nogil=True)
def _running_counts(key, pair, y, n_keys, n_pairs, o_cnt, o_pair, o_top, o_topc, j0):
    """For each target j in order: how often key[j] occurred before (o_cnt), how often followed
    by y[j] (o_pair), and the most frequent follower so far (o_top; count desc, id asc) with
    its count; then record occurrence j. key -1: no context of this order. Outputs are written
    from target j0 on, at j - j0."""
    ctx = np.zeros(n_keys, np.int64)
    pc = np.zeros(n_pairs, np.int64)
    topc = np.zeros(n_keys, np.int64)
    topt = np.full(n_keys, -1, np.int64)
    for j in range(key.shape[0]):
        kk = key[j]
        if kk < 0:
            continue
        q = pair[j]
        if j >= j0:
            o_cnt[j - j0] = ctx[kk]
            o_pair[j - j0] = pc[q]
            o_top[j - j0] = topt[kk]
            o_topc[j - j0] = topc[kk]
        ctx[kk] += 1
        pc[q] += 1
        if pc[q] > topc[kk] or (pc[q] == topc[kk] and y[j] < topt[kk]):
            topc[kk] = pc[q]
            topt[kk] = y[j]


def _dense(x: np.ndarray) -> np.ndarray:
    """Dense ids of equal values of a 1-D integer array."""
    return np.unique(x, return_inverse=True)[1].ravel().astype(np.int64, copy=False)


def _window_ids(ids: np.ndarray, ks) -> dict[int, np.ndarray]:
    """For each k of ks (<= len(ids)), dense ids of equal windows ids[j : j + k], j = 0 .. n - k.
    A window of a + b tokens is the pair (the id of its first a, the id of its last b), so that
    each length is one sort of integers (a power of two from two halves, any other length from
    the largest power of two below it and the rest), not a sort of k-wide rows. A pair is one
    int64 (id_a * (max id_b + 1) + id_b): documents below 2^31 tokens."""
    have = {1: _dense(ids)}

    def get(k: int) -> np.ndarray:
        if k not in have:
            a = 1 << (k.bit_length() - 1)  # the largest power of two <= k
            a = a // 2 if a == k else a
            A, B = get(a), get(k - a)
            m = len(ids) - k + 1
            have[k] = _dense(A[:m] * (int(B.max()) + 1) + B[a : a + m])
        return have[k]

    return {k: get(k) for k in ks if k <= len(ids)}


def _cache_order(ids: np.ndarray, y: np.ndarray, k: int, kid: np.ndarray | None, start: int = 0) -> tuple[np.ndarray, ...]:
    """Per target j >= start (context ids[:j]): earlier occurrences in the document of its last k
    tokens (ending before j), how many were followed by y[j], and the most frequent follower. kid:
    the ids of the document's windows of k tokens (_window_ids; None: the document is shorter)."""
    n = len(y) - start
    cnt, pair, top, topc = np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, -1, np.int64), np.zeros(n, np.int64)
    if kid is not None:  # context of target j = k, k+1, ...
        pid = _dense(kid * (int(y.max()) + 1) + y[k:])
        key = np.concatenate([np.full(k, -1), kid])
        pr = np.concatenate([np.full(k, -1), pid])
        _running_counts(key, pr, y, kid.max() + 1, pid.max() + 1, cnt, pair, top, topc, start)
    return cnt, pair, top, topc


def _pack(name: str, cnt, pair, top, topc) -> dict[str, np.ndarray]:
    c = np.maximum(cnt, 1)
    return {f"p_{name}": pair / c, f"count_{name}": cnt, f"share_{name}": topc / c, f"top_{name}": top}


def cache_estimates(ids, eos: int, *, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
    """The document cache's estimates, aligned with index_estimates (targets ids[0..], EOS):
    cache_{k+1}gram for k in ORDERS, the continuations of the last k tokens where they occurred
    earlier in the document (all zero, top -1, without one), and cache_longest, the same for the
    longest of CACHE_LENGTHS that occurred earlier (its length: cache_length). Only targets
    start .. stop (default: all) are returned (a piece of a document: stream.Chunk)."""
    ids = np.asarray(ids, np.int64)
    y = np.append(ids, eos)[:stop]
    ids = ids[: len(y) - 1]  # target j reads ids[:j]
    n = len(y) - start
    out = {}
    longest = [np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, -1, np.int64), np.zeros(n, np.int64)]
    clen = np.zeros(n, np.int64)
    lengths = sorted(set(CACHE_LENGTHS) | set(ORDERS))
    windows = _window_ids(ids, lengths) if len(ids) else {}
    for k in lengths:
        st = _cache_order(ids, y, k, windows.get(k), start)
        if k in ORDERS:
            out |= _pack(f"cache_{k + 1}gram", *st)
        if k in CACHE_LENGTHS:
            m = st[0] > 0
            for a, b in zip(longest, st, strict=True):
                a[m] = b[m]
            clen[m] = k
    return out | _pack("cache_longest", *longest) | {"cache_length": clen}


def estimates(idx, ids) -> dict[str, np.ndarray]:
    """index_estimates and cache_estimates of one document."""
    return index_estimates(idx, ids) | cache_estimates(ids, idx.eos_id)


def heldout_docs(heldout) -> list[np.ndarray]:
    """The token ids of each document of a held-out feature directory (index/heldout.py)."""
    d = Path(heldout) / "000000"
    tok = np.asarray(fmt.open_array(d / "tokens.bin", "tokens")).astype(np.int64)
    st = np.asarray(fmt.open_array(d / "docs.bin", "docs")).astype(np.int64)
    return [tok[st[k] : st[k + 1] - 1] for k in range(len(st) - 1)]


def docs_estimates(index, docs: list[np.ndarray], workers: int = 1) -> dict[str, np.ndarray]:
    """estimates (index and document cache) of each document, concatenated in the order of
    model.evaluation.perplexity.forward_docs; the index's on `workers` threads (index: its
    directory, or an opened Index or ClusterIndex, whose holders compute them)."""
    from teragram.index.engine import as_index

    idx = as_index(index)
    est = index_estimates_docs(idx, docs, threads=workers)
    if workers > 1 and len(docs) > 1:  # the cache's kernels and sorts release the GIL
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            parts = list(pool.map(lambda ids: cache_estimates(ids, idx.eos_id), docs))
    else:
        parts = [cache_estimates(ids, idx.eos_id) for ids in docs]
    return est | {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def piece_estimates(index, prefix: np.ndarray, ids: np.ndarray, *, last: bool, context: int, workers: int = 1, cache: bool = True):
    """docs_estimates of a piece of a document (model/evaluation/stream.py's Chunk: the document's
    tokens before it, its own, and whether it is the last): its targets len(prefix) .. (+ EOS when
    last). The index's are computed over the document from token `context` on: the start of the
    ∞-gram's match at the target before the piece (that target's index_length back from it), since
    no later target's match starts earlier; the cache's read the whole prefix. cache=False: the
    ∞-gram's lengths alone (infgram_lengths)."""
    from teragram.index.engine import as_index

    idx = as_index(index)
    s, n = len(prefix), len(prefix) + len(ids)
    full = np.concatenate([np.asarray(prefix, np.int64), np.asarray(ids, np.int64)])
    rows = slice(s - context, s - context + len(ids) + last)
    if not cache:
        return infgram_lengths(idx, [full[context:]], workers)[rows]
    est = {k: v[rows] for k, v in index_estimates_docs(idx, [full[context:]], threads=workers).items()}
    return est | cache_estimates(full, idx.eos_id, start=s, stop=n + last)


def heldout_estimates(index, heldout, workers: int = 1) -> dict[str, np.ndarray]:
    """docs_estimates of every document of a held-out feature directory (or saved outputs),
    made with the index's tokenizer (else TokenizerMismatch: index/tokenizer.py check_same)."""
    from teragram.index.engine import as_index
    from teragram.index.tokenizer import check_same

    idx = as_index(index)
    check_same(heldout, idx.path)
    return docs_estimates(idx, heldout_docs(heldout), workers)


def infgram_lengths(idx, docs: list[np.ndarray], workers: int = 1) -> np.ndarray:
    """The ∞-gram's suffix length of each target row of the documents (index_estimates_docs's
    index_length alone: a document of n tokens has n + 1 rows, the first without context)."""
    from teragram.index.bulk import continuations

    lens = np.array([len(d) for d in docs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)])
    ids = np.concatenate([np.asarray(d, np.int64) for d in docs]) if len(docs) else np.zeros(0, np.int64)
    out = np.zeros(len(ids) + len(docs), np.int64)
    rest = np.ones(len(out), bool)
    rest[starts[:-1] + np.arange(len(docs))] = False
    out[rest] = continuations(idx, ids, starts, [0], threads=workers)[0].length
    return out


def cache_live(q: np.ndarray, V: int, components) -> tuple[dict[str, tuple[np.ndarray, int]], int]:
    """The document cache's distributions (and counts) after context q, as cache_estimates
    defines them, and its longest match: the earlier ends e of the last k tokens are narrowed
    one token at a time."""
    want = {c: context_length(c) for c in components if c in CACHE and c != "cache_longest"}
    kmax = max(set(want.values()) | (set(CACHE_LENGTHS) if "cache_longest" in components else set()), default=0)
    out = {}
    ends = np.arange(1, len(q))  # e: a context ending at q[e-1], followed by q[e]
    hit = {}
    for k in range(1, kmax + 1):
        ends = ends[ends >= k]
        ends = ends[q[ends - k] == q[len(q) - k]] if len(q) >= k else ends[:0]
        hit[k] = ends
    for c, k in want.items():
        out[c] = hit[k]
    clen = 0
    if "cache_longest" in components:
        found = [k for k in CACHE_LENGTHS if len(hit[k])]
        out["cache_longest"] = hit[found[-1]] if found else ends[:0]
        clen = found[-1] if found else 0
    dists = {}
    for c, e in out.items():
        d = np.bincount(q[e], minlength=V)[:V].astype(np.float64)
        dists[c] = (d / max(len(e), 1), len(e))
    return dists, clen
