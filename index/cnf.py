"""AND/OR queries: the count and the documents of a conjunction of disjunctions of n-grams (CNF),
infini-gram's count_cnf and search_docs_cnf over every shard of an index.

A query is clauses ANDed, each clause terms (n-grams, token ids) ORed:

    idx.count_cnf([[[5, 17], [9]], [[40]]])     # ("5 17" OR "9") AND "40"
    idx.search_docs_cnf(cnf, maxnum=10)

Semantics are infini-gram's (its package is the test oracle), shard by shard, in token positions:
the clause with the fewest occurrences in the shard anchors a range [l, r] at each of its
occurrences (l = r = its start). Each further clause, in order of its count in the shard, widens
every range to its nearest occurrence starting before r and its nearest starting at or after l:
the range keeps both where both are within max_diff_tokens of it, becomes one range per side where
only one side is, and is dropped where neither is. A range that crosses a document boundary is
dropped. The count is the number of ranges left (an anchor can leave two, and two terms of a
clause that start at one position anchor two), summed over the shards; term lengths play no part.

Past max_clause_freq: where a clause occurs more than ceil(max_clause_freq / shards) times in a
shard, each of its terms is read at a block of its suffix-array interval sized in proportion
(ceil(length * limit / count)), at a seeded random offset, and the shard's count is scaled by
count / sampled; the answer says approx. This is infini-gram's scheme, but not its numbers: its
suffix arrays order suffixes by little-endian bytes and teragram's by token id, so the blocks hold
other occurrences; its scale factor is an integer division (a clause sampled at more than half is
scaled by 1 and the count called exact), teragram's the ratio itself, and any sampling is approx.
Under the limit the answer is exact and equal to infini-gram's on the same shards.

search_docs_cnf lists the first maxnum documents (in corpus order) holding a range, as Index.docs
does for an n-gram; infini-gram samples them at random.

The pass over the shards (shards_part) is one function wherever the shards are: count_cnf and
search_docs_cnf check the query and merge (merge) the parts of the index's cnf_parts, one part of
every shard for a local Index (local_parts), one per group of shards for a ClusterIndex, each
computed by a holder beside its shards (index/cluster.py): the same answers either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cancel import check_cancelled
from .errors import QueryError
from .results import CountResult, DocHit, DocsResult

MAX_CLAUSES = 4  # infini-gram's API: disjunctive clauses in a query
MAX_TERMS = 4  # infini-gram's API: terms in a clause
MAX_CLAUSE_FREQ = 50_000  # infini-gram's default: a clause's occurrences read (over all shards) before sampling
MAX_DIFF_TOKENS = 100  # infini-gram's default: how far apart (start to start) the clauses' matches may be
SAMPLE_SEED = 19260817  # infini-gram's seed for the sampled blocks


def is_cnf_text(text: str) -> bool:
    """Whether a query text is an AND/OR query (infini-gram's API: it holds " AND " or " OR ")."""
    return " AND " in text or " OR " in text


def parse_cnf_text(text: str) -> list[list[str]]:
    """The clauses' terms of a query text, infini-gram's syntax: "a b OR c AND d" is ("a b" OR
    "c") AND "d" (OR binds tighter than AND; no parentheses)."""
    return [clause.split(" OR ") for clause in text.split(" AND ")]


def tokenize_cnf(idx, text: str) -> list[list[list[int]]]:
    """The token ids of each term of a query text (each term tokenized alone)."""
    return [[idx.tokenize(term) for term in clause] for clause in parse_cnf_text(text)]


def check_cnf(idx, cnf) -> list[list[np.ndarray]]:
    """The query as int64 arrays, or QueryError naming what is wrong with it."""
    if not isinstance(cnf, list | tuple) or not cnf:
        raise QueryError("an AND/OR query must be a non-empty list of clauses, each a list of terms (lists of token ids)")
    if len(cnf) > MAX_CLAUSES:
        raise QueryError(f"an AND/OR query has at most {MAX_CLAUSES} clauses, not {len(cnf)}")
    out = []
    for c, clause in enumerate(cnf, 1):
        if not isinstance(clause, list | tuple) or not clause:
            raise QueryError(f"clause {c} must be a non-empty list of terms (lists of token ids)")
        if len(clause) > MAX_TERMS:
            raise QueryError(f"clause {c} has {len(clause)} terms; at most {MAX_TERMS}")
        out.append([idx.check_ids(term, allow_empty=False, what=f"clause {c} term {t}") for t, term in enumerate(clause, 1)])
    return out


def _limit(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise QueryError(f"{name} must be a positive integer")
    return int(value)


def shard_limit(max_clause_freq: int, n_shards: int) -> int:
    """A clause's occurrences read in one shard before they are sampled: max_clause_freq spread
    over every shard of the whole index (module doc)."""
    return -(-max_clause_freq // max(n_shards, 1))


@dataclass(frozen=True)
class ShardsPart:
    """One run of shards' part of a query (shards_part), merged with the other runs' by merge.
    Per shard, in the order of the index the part was computed on (idx.shards):"""

    clause_counts: np.ndarray  # (C, S) int64: each clause's occurrences (its terms' summed) in each shard
    ranges_left: list[int]  # the ranges counted in each shard (before scaling)
    factors: list[float]  # each shard's scale factor (1.0: nothing sampled)
    hits: list[DocHit]  # the first maxnum documents of these shards holding a range, in corpus order
    ranges: list[tuple[np.ndarray, np.ndarray]] | None  # each shard's (lo, hi), when asked for (find_cnf)


def shards_part(idx, terms, places, limit: int, diff: int, *, maxnum: int = 0, context: int = 20, keep_ranges: bool = False) -> ShardsPart:
    """The part of a checked query (terms: check_cnf's) that the shards of `idx` answer, computed
    beside them: all the shards of a local Index (local_parts), or a cluster holder's group
    (index/cluster_holder.py). places: each shard's place in the whole index (it seeds the
    sampling); limit: the whole index's per-shard limit (shard_limit); maxnum: documents listed."""
    segs = [[idx.count_intervals(q)[1] for q in clause] for clause in terms]  # segs[c][t][i]: term t's interval in shard i
    n = len(idx.shards)
    clause_counts = np.array([[sum(seg[i][1] - seg[i][0] for seg in clause) for i in range(n)] for clause in segs], np.int64)
    ranges_left, factors, ranges = [], [], []
    for i in range(n):
        check_cancelled()  # a cancelled query stops between shards (index/cancel.py)
        k, factor, lr = _shard_ranges(
            idx.shards[i], places[i], [[seg[i] for seg in clause] for clause in segs], clause_counts[:, i], limit, diff
        )
        ranges_left.append(k)
        factors.append(factor)
        ranges.append(lr)
    hits: list[DocHit] = []
    for i in sorted(range(n), key=lambda i: places[i]):  # corpus order
        if len(hits) < maxnum and ranges_left[i]:
            hits += _shard_hits(idx, idx.shards[i], *ranges[i], maxnum - len(hits), context)
    return ShardsPart(clause_counts.reshape(len(terms), n), ranges_left, factors, hits, ranges if keep_ranges else None)


def merge(parts: list[ShardsPart], maxnum: int = 0) -> tuple[int, bool, list[DocHit]]:
    """(count, approx, the first maxnum documents) of the whole index from its runs' parts: a
    clause that occurs nowhere makes the count 0 and exact; else the shards' scaled counts add."""
    totals = sum(p.clause_counts.sum(axis=1) for p in parts)
    if (totals == 0).any():
        return 0, False, []
    count = sum(int(k * f) for p in parts for k, f in zip(p.ranges_left, p.factors))
    approx = any(f != 1.0 for p in parts for f in p.factors)
    return count, approx, sorted((h for p in parts for h in p.hits), key=lambda h: h.doc_id)[:maxnum]


def local_parts(idx, terms, *, max_clause_freq: int, max_diff_tokens: int, maxnum: int = 0, context: int = 20) -> list[ShardsPart]:
    """Index.cnf_parts: every shard of a local Index as one part (ClusterIndex.cnf_parts asks its holders)."""
    n = len(idx.shards)
    return [shards_part(idx, terms, range(n), shard_limit(max_clause_freq, n), max_diff_tokens, maxnum=maxnum, context=context)]


def _checked(idx, cnf, max_clause_freq, max_diff_tokens) -> tuple[list[list[np.ndarray]], int, int]:
    return check_cnf(idx, cnf), _limit(max_clause_freq, "max_clause_freq"), _limit(max_diff_tokens, "max_diff_tokens")


def find_cnf(idx, cnf, *, max_clause_freq: int = MAX_CLAUSE_FREQ, max_diff_tokens: int = MAX_DIFF_TOKENS):
    """(count, approx, ranges) of a local Index: ranges[s] is (lo, hi), two (k,) int64 arrays of
    token positions in shard s (its place in idx.shards), one entry per range counted (module doc)."""
    terms, limit_all, diff = _checked(idx, cnf, max_clause_freq, max_diff_tokens)
    n = len(idx.shards)
    part = shards_part(idx, terms, range(n), shard_limit(limit_all, n), diff, keep_ranges=True)
    count, approx, _ = merge([part])
    return count, approx, part.ranges


def _shard_ranges(shard, s: int, segs, counts: np.ndarray, limit: int, diff: int):
    """(ranges left, scale factor, (lo, hi)) of one shard, s its place in the whole index;
    segs[c] holds clause c's terms' intervals in it."""
    factor = 1.0
    lo = hi = None
    for c in sorted(range(len(segs)), key=lambda c: counts[c]):  # stable: ties in query order, as infini-gram's sort of <= 16
        check_cancelled()
        blocks, f = _clause_blocks(segs[c], int(counts[c]), limit, s)
        factor *= f
        if lo is None:
            lo = _positions(shard, blocks)
            hi = lo.copy()
            continue
        if not len(lo):  # no range left: the later clauses only scale (their factors), nothing to read
            continue
        pos = _positions(shard, blocks)
        if not len(pos):
            lo, hi = lo[:0], hi[:0]
            continue
        pos = np.sort(pos)
        before = np.searchsorted(pos, hi, side="left") - 1  # the last start < hi
        after = np.searchsorted(pos, lo, side="left")  # the first start >= lo
        has_lo, has_hi = before >= 0, after < len(pos)
        new_lo = np.minimum(lo, pos[np.maximum(before, 0)])
        new_hi = np.maximum(hi, pos[np.minimum(after, len(pos) - 1)])
        ok_lo = has_lo & (lo - new_lo <= diff)
        ok_hi = has_hi & (new_hi - hi <= diff)
        both = ok_lo & ok_hi
        lo_only, hi_only = ok_lo & ~both, ok_hi & ~both
        lo = np.concatenate([new_lo[both], new_lo[lo_only], lo[hi_only]])
        hi = np.concatenate([new_hi[both], hi[lo_only], new_hi[hi_only]])
    starts = np.asarray(shard.starts, np.int64)
    same_doc = np.searchsorted(starts, lo, side="right") == np.searchsorted(starts, hi, side="right")
    return int(same_doc.sum()), factor, (lo[same_doc], hi[same_doc])


def _clause_blocks(segs: list[tuple[int, int]], count: int, limit: int, s: int) -> tuple[list[tuple[int, int]], float]:
    """The suffix-array blocks of a clause's terms read in one shard (a sampled block of each past
    the limit, at offsets seeded by the shard's place s), and the factor that scales a count of
    the sample to the whole."""
    if count <= limit:
        return [(a, b) for a, b in segs if b > a], 1.0
    rng = np.random.default_rng([SAMPLE_SEED, s])
    blocks, sampled = [], 0
    for a, b in segs:
        n = (b - a) * limit // count + ((b - a) * limit % count > 0)  # ceil((b - a) * limit / count)
        lo = a + int(rng.integers(0, b - a - n + 1))
        blocks.append((lo, lo + n))
        sampled += n
    return blocks, count / sampled


def _positions(shard, blocks: list[tuple[int, int]]) -> np.ndarray:
    """The start positions in the suffix-array blocks: (k,) int64."""
    parts = [shard.sa.to_numpy(a, b) for a, b in blocks]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _shard_hits(idx, shard, lo: np.ndarray, hi: np.ndarray, n: int, context: int) -> list[DocHit]:
    """The first n documents of a shard holding one of its ranges, each with the offset of its
    first range and the text around that range."""
    order = np.lexsort((hi, lo))
    lo, hi = lo[order], hi[order]
    docs = np.searchsorted(np.asarray(shard.starts, np.int64), lo, side="right") - 1
    _, first = np.unique(docs, return_index=True)
    hits = []
    for j in np.sort(first)[:n]:
        check_cancelled()
        d, a, b = int(docs[j]), int(lo[j]), int(hi[j])
        ds, de = int(shard.starts[d]), int(shard.starts[d + 1]) - 1
        text = idx.decode(shard.tok[max(ds, a - context) : min(de, b + context)])
        hits.append(DocHit(shard.first_doc + d, shard.id, a - ds, idx.meta.doc(shard.first_doc + d), text))
    return hits


def count_cnf(idx, cnf, *, max_clause_freq: int = MAX_CLAUSE_FREQ, max_diff_tokens: int = MAX_DIFF_TOKENS) -> CountResult:
    """How often the query's clauses co-occur (module doc); approx past max_clause_freq. idx: an
    Index, or a ClusterIndex (its holders compute their shards' parts)."""
    terms, limit_all, diff = _checked(idx, cnf, max_clause_freq, max_diff_tokens)
    count, approx, _ = merge(idx.cnf_parts(terms, max_clause_freq=limit_all, max_diff_tokens=diff))
    return CountResult(count, approx)


def search_docs_cnf(
    idx, cnf, *, maxnum: int = 1, context: int = 20, max_clause_freq: int = MAX_CLAUSE_FREQ, max_diff_tokens: int = MAX_DIFF_TOKENS
) -> DocsResult:
    """The query's count and the first maxnum documents (in corpus order) where its clauses
    co-occur, each with the offset of its first range and the text around that range."""
    maxnum = _limit(maxnum, "maxnum")
    terms, limit_all, diff = _checked(idx, cnf, max_clause_freq, max_diff_tokens)
    parts = idx.cnf_parts(terms, max_clause_freq=limit_all, max_diff_tokens=diff, maxnum=maxnum, context=context)
    count, approx, hits = merge(parts, maxnum)
    return DocsResult(count, hits, approx)


def cnf_json(idx, answer: dict, cnf) -> dict:
    """A CNF query's JSON answer with its terms' ids and their texts beside it, nested as the
    query is (infini-gram's API: `token_ids` and `tokens` of every term of every clause)."""
    ids = [[[int(i) for i in term] for term in clause] for clause in cnf]
    return answer | {"token_ids": ids, "tokens": [[[idx.piece(i) for i in term] for term in clause] for clause in ids]}
