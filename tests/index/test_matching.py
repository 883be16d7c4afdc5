"""index/matching.py: the grouping of the capped suffixes (each distinct string once, in order)
and the longest matches with the probes after failed extensions remembered."""

import numpy as np
import pytest
from teragram.index import contexts, merged
from teragram.index.engine import Index
from teragram.index.fanout import N_STATE, N
from teragram.index.matching import _probe, distinct_starts, extend, longest_matches, new_memo


@pytest.mark.parametrize("vocab", [3, 300, 70_000, 2**40])
def test_distinct_starts_are_the_distinct_strings_in_order(vocab):
    """Against np.unique over the rows of tokens: the same strings, sorted, and each start mapped
    to its string; for tokens packed 1 to 32 to a key and strings spanning several keys."""
    rng = np.random.default_rng(vocab % 1000)
    ids = rng.integers(0, vocab, 4000).astype(np.int64)
    ids[2000:2600] = ids[:600]  # repeated text
    for c in (1, 2, 5, 16, 33):
        js = np.sort(rng.choice(len(ids) - c, 1500, replace=False)).astype(np.int64)
        reps, which = distinct_starts(ids, js, c)
        grams = ids[js[:, None] + np.arange(c)]
        want, inverse = np.unique(grams, axis=0, return_inverse=True)
        assert np.array_equal(ids[reps[:, None] + np.arange(c)], want)
        assert np.array_equal(which, inverse.reshape(-1))
    assert [len(x) for x in distinct_starts(ids, np.zeros(0, np.int64), 4)] == [0, 0]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tokenizer_model):
    """Documents over a small alphabet in several shards, and held-out text that repeats itself."""
    from teragram.builder.build import build_from_ids

    from tests.conftest import random_docs

    rng = np.random.default_rng(5)
    docs = random_docs(rng, 120, 12, 60, 1000)
    out = tmp_path_factory.mktemp("matching") / "idx"
    with pytest.MonkeyPatch.context() as mp:  # many short contexts summed over the shards (index/merged.py)
        mp.setattr(contexts, "MIN_COUNT", 5)
        build_from_ids(docs, out, tokenizer_model, shard_tokens=1200)
    alphabet = np.unique(np.concatenate(docs))
    text = [np.concatenate([alphabet[rng.integers(0, len(alphabet), 40)], docs[k][:20]]) for k in range(6)]
    text += text[:3]  # the same probes again
    return Index(out), docs, text


def _longest(docs, q):
    """Brute force: the length of the longest suffix of q in any document."""
    for L in range(len(q), 0, -1):
        s = q[len(q) - L :].tolist()
        if any(s == d[i : i + L].tolist() for d in docs for i in range(len(d) - L + 1)):
            return L
    return 0


def test_remembered_probes_answer_as_searched(sharded):
    """longest_matches (the probes after failed extensions bounded by the summed histograms and
    remembered) against brute force for the lengths and, for the intervals, against the same pass
    without the bound and with a memo that keeps nothing; the bound is never below the match."""
    idx, docs, text = sharded
    ss = idx.shard_set
    S = len(idx.shards)
    assert S >= 3
    ids = np.concatenate(text).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum([len(d) for d in text])]).astype(np.int64)
    known = merged.tables(idx.merged, idx.trigrams)
    shards = (ss.table, ss.first_rank, ss.pos, ss.prefix, ss.step_log2, ss.contexts)
    got_len, got_lo, got_hi = np.zeros(len(ids), np.int64), np.zeros((len(ids), S), np.int64), np.zeros((len(ids), S), np.int64)
    longest_matches(*shards, known, ids, starts, got_len, got_lo, got_hi)
    none = merged.tables(None)  # the reference pass: no bound, no stored intervals, a memo that keeps nothing
    st, lo, hi, memo = np.empty((2 * S, N_STATE), np.int64), np.zeros(S, np.int64), np.zeros(S, np.int64), new_memo(S, 0)
    bounded = 0
    for a, b in zip(starts[:-1], starts[1:]):
        i, lo[:], hi[:] = a, 0, ss.table[:, N]
        for t in range(a, b):
            most = merged.longest_bound(known, ids, i, t)
            bounded += most < t - i + 1
            i = extend(*shards, none, ids, i, t, st, lo, hi, memo)
            for x, y in ((lo, hi), (got_lo[t], got_hi[t])):  # an empty interval, wherever the search left it
                e = y <= x
                x[e], y[e] = 0, 0
            assert got_len[t] == t - i + 1 == _longest(docs, ids[a : t + 1]) <= most
            assert np.array_equal(got_lo[t], lo) and np.array_equal(got_hi[t], hi)
    assert bounded > 20  # the summed histograms ruled out longer matches (exactly: <= most above)


def test_a_probe_whose_hash_is_taken_is_searched(sharded):
    """A remembered string of the same length and hash slot is not taken for another one."""
    idx, docs, _ = sharded
    ss = idx.shard_set
    S = len(idx.shards)
    a, b = docs[0][:3].astype(np.int64), docs[1][:3].astype(np.int64)
    assert not np.array_equal(a, b)
    ids = np.concatenate([b, a])
    h = 14695981039346656037  # the FNV-1a hash _probe keys by, of a
    for x in a.tolist():
        h = ((h ^ x) * 1099511628211) % 2**64
    buckets, rows = memo = new_memo(S, 4)
    first = h % len(buckets)
    buckets[first] = 1  # a's bucket holds b under a's hash, with made-up intervals
    rows[0, 0], rows[1, :4], rows[1, 4:] = 1, [h - 2**64 if h >= 2**63 else h, 0, 3, 1], 7
    st, lo, hi = np.empty((2 * S, N_STATE), np.int64), np.zeros(S, np.int64), np.zeros(S, np.int64)
    args = (ss.table, ss.first_rank, ss.pos, ss.prefix, ss.step_log2, ss.contexts, merged.tables(None), ids, st, lo, hi)
    assert _probe(*args, 3, 6, memo)
    total, intervals = idx.count_intervals(a)
    assert (hi - lo).tolist() == [y - x for x, y in intervals] and total > 0
    assert rows[0, 0] == 2 and buckets[(first + 1) % len(buckets)] == 2  # a remembered beside it
    rows[2, 4:] = 5  # read back, not searched again
    assert _probe(*args, 3, 6, memo) and (lo == 5).all() and (hi == 5).all()
