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
"""

from __future__ import annotations

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


def find_cnf(idx, cnf, *, max_clause_freq: int = MAX_CLAUSE_FREQ, max_diff_tokens: int = MAX_DIFF_TOKENS):
    """(count, approx, ranges): ranges[s] is (lo, hi), two (k,) int64 arrays of token positions in
    shard s (its place in idx.shards), one entry per range counted (module doc)."""
    terms = check_cnf(idx, cnf)
    limit_all = _limit(max_clause_freq, "max_clause_freq")
    diff = _limit(max_diff_tokens, "max_diff_tokens")
    n_shards = len(idx.shards)
    none = [(np.zeros(0, np.int64), np.zeros(0, np.int64)) for _ in range(n_shards)]
    # every term's interval in every shard: segs[c][t][s] = (lo, hi)
    segs = [[idx.count_intervals(q)[1] for q in clause] for clause in terms]
    per_shard = np.array([[sum(seg[s][1] - seg[s][0] for seg in clause) for s in range(n_shards)] for clause in segs], np.int64)
    if (per_shard.sum(axis=1) == 0).any():
        return 0, False, none
    limit = -(-limit_all // n_shards)
    count, approx, ranges = 0, False, []
    for s in range(n_shards):
        check_cancelled()  # a cancelled query stops between shards (index/cancel.py)
        n, factor, lr = _shard_ranges(idx, s, segs, per_shard[:, s], limit, diff)
        count += int(n * factor)
        approx |= factor != 1.0
        ranges.append(lr)
    return count, approx, ranges


def _shard_ranges(idx, s: int, segs, counts: np.ndarray, limit: int, diff: int):
    """(ranges left, scale factor, (lo, hi)) of one shard."""
    shard = idx.shards[s]
    factor = 1.0
    lo = hi = None
    for c in sorted(range(len(segs)), key=lambda c: counts[c]):  # stable: ties in query order, as infini-gram's sort of <= 16
        check_cancelled()
        pos, f = _clause_positions(shard, [seg[s] for seg in segs[c]], int(counts[c]), limit, s)
        factor *= f
        if lo is None:
            lo, hi = pos, pos.copy()
            continue
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


def _clause_positions(shard, segs: list[tuple[int, int]], count: int, limit: int, s: int) -> tuple[np.ndarray, float]:
    """Start positions of a clause's terms in one shard (a sampled block of each past the limit),
    and the factor that scales a count of the sample to the whole."""
    if count <= limit:
        parts = [shard.sa.to_numpy(a, b) for a, b in segs if b > a]
        return (np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)), 1.0
    rng = np.random.default_rng([SAMPLE_SEED, s])
    parts, sampled = [], 0
    for a, b in segs:
        n = (b - a) * limit // count + ((b - a) * limit % count > 0)  # ceil((b - a) * limit / count)
        lo = a + int(rng.integers(0, b - a - n + 1))
        parts.append(shard.sa.to_numpy(lo, lo + n))
        sampled += n
    return np.concatenate(parts).astype(np.int64), count / sampled


def count_cnf(idx, cnf, *, max_clause_freq: int = MAX_CLAUSE_FREQ, max_diff_tokens: int = MAX_DIFF_TOKENS) -> CountResult:
    """How often the query's clauses co-occur (module doc); approx past max_clause_freq."""
    count, approx, _ = find_cnf(idx, cnf, max_clause_freq=max_clause_freq, max_diff_tokens=max_diff_tokens)
    return CountResult(count, approx)


def search_docs_cnf(
    idx, cnf, *, maxnum: int = 1, context: int = 20, max_clause_freq: int = MAX_CLAUSE_FREQ, max_diff_tokens: int = MAX_DIFF_TOKENS
) -> DocsResult:
    """The query's count and the first maxnum documents (in corpus order) where its clauses
    co-occur, each with the offset of its first range and the text around that range."""
    maxnum = _limit(maxnum, "maxnum")
    count, approx, ranges = find_cnf(idx, cnf, max_clause_freq=max_clause_freq, max_diff_tokens=max_diff_tokens)
    hits: list[DocHit] = []
    for shard, (lo, hi) in zip(idx.shards, ranges):
        if len(hits) >= maxnum or not len(lo):
            continue
        order = np.lexsort((hi, lo))
        lo, hi = lo[order], hi[order]
        docs = np.searchsorted(np.asarray(shard.starts, np.int64), lo, side="right") - 1
        _, first = np.unique(docs, return_index=True)
        for j in np.sort(first)[: maxnum - len(hits)]:
            check_cancelled()
            d, a, b = int(docs[j]), int(lo[j]), int(hi[j])
            ds, de = int(shard.starts[d]), int(shard.starts[d + 1]) - 1
            text = idx.decode(shard.tok[max(ds, a - context) : min(de, b + context)])
            hits.append(DocHit(shard.first_doc + d, shard.id, a - ds, idx.meta.doc(shard.first_doc + d), text))
    return DocsResult(count, hits, approx)


def cnf_json(idx, answer: dict, cnf) -> dict:
    """A CNF query's JSON answer with its terms' ids and their texts beside it, nested as the
    query is (infini-gram's API: `token_ids` and `tokens` of every term of every clause)."""
    ids = [[[int(i) for i in term] for term in clause] for clause in cnf]
    return answer | {"token_ids": ids, "tokens": [[[idx.piece(i) for i in term] for term in clause] for clause in ids]}
