"""Cross-shard matches by merge-join against the per-position search of the other shard."""

import numpy as np
import pytest
from teragram.builder.build import build_from_ids
from teragram.builder.cross_shard import key_lcp, key_lengths, lcp_from_key_lcp, merged_suffix_array, other_shard_matches
from teragram.builder.features import merged_exclude_doc_features, shard_features
from teragram.builder.merged_features import plan_chunks
from teragram.index import kernels as IK
from teragram.index.engine import Index
from teragram.index.features import FeatureConfig

from tests.builder.helpers import docs_with_duplicates


def _live(idx: Index, shard: int, other: int, cap: int):
    """The oracle: every document of `shard` searched in `other` position by position."""
    s, o = idx.shards[shard], idx.shards[other]
    T = np.asarray(s.tok).astype(np.int64)
    L, lo, hi = (np.zeros(len(T), np.int64) for _ in range(3))
    starts = np.asarray(s.starts).astype(np.int64)
    for d in range(len(starts) - 1):
        a, b = starts[d], starts[d + 1] - 1
        IK.match_lengths(o.tok, o.sa.words, o.sa.width, o.n, T[a:b], cap, L[a:b], lo[a:b], hi[a:b])
    return L, lo, hi


@pytest.fixture(scope="module")
def dup_index(tmp_path_factory, tokenizer_model):
    out = tmp_path_factory.mktemp("xs") / "idx"
    build_from_ids(docs_with_duplicates(5), out, tokenizer_model, shard_tokens=1200)
    return Index(out, threads=1)


@pytest.mark.parametrize("cap", [1, 3, 8, 64, 255])
def test_merge_join_equals_live_search(dup_index, cap):
    idx = dup_index
    assert len(idx.shards) >= 3
    for shard, other in [(0, 1), (1, 0), (2, 0), (0, len(idx.shards) - 1)]:
        got = other_shard_matches(idx, shard, other, cap)
        want = _live(idx, shard, other, cap)
        for g, w, name in zip(got, want, ("length", "lo", "hi")):
            assert g.tolist() == w.tolist(), (shard, other, name)
        assert got[0].max() == min(cap, got[0].max()) and (cap == 1 or got[0].max() > 1)


def test_merge_join_on_real_text(real_index):
    idx = Index(real_index, threads=1)
    for cap in (4, 64):
        got = other_shard_matches(idx, 1, 0, cap)
        want = _live(idx, 1, 0, cap)
        assert all(g.tolist() == w.tolist() for g, w in zip(got, want))


def _keys(T: np.ndarray, p: int, cap: int, sep: int) -> tuple:
    """The key merged_suffix_array sorts by: tokens up to cap, through the first SEP."""
    k = []
    for x in T[p : p + cap]:
        k.append(int(x))
        if x == sep:
            break
    return tuple(k)


@pytest.mark.parametrize("cap", [1, 3, 8, 64, 255])
def test_merged_suffix_array_is_sorted_with_its_lcps(dup_index, cap):
    """The shards' suffix arrays merged: every position once, keys sorted, and the lcp array
    that of the capped, SEP-stopped common prefix of neighbours (brute force)."""
    idx = dup_index
    T = np.concatenate([np.asarray(s.tok) for s in idx.shards])
    offs = np.cumsum([0] + [s.tok.shape[0] for s in idx.shards])
    klen = np.empty(len(T), np.uint8)
    key_lengths(T, idx.sep, cap, klen)
    parts = []
    for s, a in zip(idx.shards, offs[:-1]):
        sa = s.sa.to_numpy().astype(np.int64)
        lcp = np.zeros(len(sa), np.uint8)
        for r in range(1, len(sa)):
            lcp[r] = _common(T, sa[r - 1] + a, sa[r] + a, cap, idx.sep)
        key_lcp(sa, lcp, klen[a:], lcp)
        parts.append((sa + a, lcp))
    sa, h = merged_suffix_array(T, parts, cap, idx.sep)
    lcp_from_key_lcp(sa, h, klen, h)
    assert sorted(sa.tolist()) == np.nonzero(T != idx.sep)[0].tolist()
    keys = [_keys(T, p, cap, idx.sep) for p in sa.tolist()]
    assert keys == sorted(keys)
    assert h[0] == 0 and all(h[r] == _common(T, sa[r - 1], sa[r], cap, idx.sep) for r in range(1, len(sa)))


def _common(T, a, b, cap, sep) -> int:
    k = 0
    while k < cap and a + k < len(T) and b + k < len(T) and T[a + k] == T[b + k] and T[a + k] != sep:
        k += 1
    return k


@pytest.mark.parametrize("cap", [1, 2, 5, 64, 255])
@pytest.mark.parametrize("chunk", [None, 300, 40, 3])
def test_merged_exclude_doc_features_equal_pairwise(dup_index, cap, chunk):
    """Length + continuation from the merged suffix array, whole or in chunks small enough to
    split blocks several tokens deep, equal the merge-join per pair of shards (itself checked
    against the live search above), on every position of every shard."""
    idx = dup_index
    cfg = FeatureConfig(mode="exclude-doc", max_len=cap, top_k=0)
    merged = merged_exclude_doc_features(idx, cfg, max_chunk_positions=chunk)
    if chunk == 3 and cap >= 5:
        assert max(c.depth for c in plan_chunks(idx, chunk, cap)[0]) >= 4
    for sh in range(len(idx.shards)):
        want = shard_features(idx, sh, cfg, pairwise=True)[0]
        assert merged[sh].length.tolist() == want.length.tolist(), sh
        assert merged[sh].cont.tolist() == want.cont.tolist(), sh
        if chunk is None:
            assert shard_features(idx, sh, cfg)[0].cont.tolist() == want.cont.tolist()


def test_chunks_kept_on_scratch_give_the_same_features(dup_index, tmp_path, monkeypatch):
    """With a scratch directory each chunk's merge is written by the first pass and read back by
    the second (tokens mapped from a file there too): the same features, nothing left behind."""
    from teragram.builder import features, merged_features

    cfg = FeatureConfig(mode="exclude-doc", max_len=64, top_k=0)
    want = merged_exclude_doc_features(dup_index, cfg, max_chunk_positions=40)
    monkeypatch.setattr(features, "_merged_memory", lambda idx: 1000)  # too little to hold the tokens
    assert merged_features.layout(dup_index, 1000, scratch=True)[0]
    got = merged_exclude_doc_features(dup_index, cfg, max_chunk_positions=40, scratch=tmp_path / "s")
    assert all(np.array_equal(g.length, w.length) and np.array_equal(g.cont, w.cont) for g, w in zip(got, want))
    assert list((tmp_path / "s").iterdir()) == []


@pytest.mark.parametrize("cap,chunk", [(64, 40), (3, 7), (255, 1)])
def test_chunks_cover_the_merged_order(dup_index, cap, chunk):
    """The chunks hold every suffix once, in key order (each shard's ranks consecutively from 0
    to n), each within the budget unless its suffixes' keys are all equal (nothing to split
    them by); every chunk of depth j lies in its ancestors, whose depths are 1..j."""
    idx = dup_index
    chunks, blocks = plan_chunks(idx, chunk, cap)
    oversize = 0
    for s in range(len(idx.shards)):
        ranges = [c.ranges[s] for c in chunks]
        assert ranges[0][0] == 0 and ranges[-1][1] == idx.shards[s].n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for c in chunks:
        if c.positions > chunk:
            oversize += 1
            T = [np.asarray(s.tok) for s in idx.shards]
            keys = {_keys(T[s], int(p), cap, idx.sep) for s, (lo, hi) in enumerate(c.ranges) for p in idx.shards[s].sa.to_numpy()[lo:hi]}
            assert len(keys) == 1, c
        assert [blocks[a].depth for a in c.ancestors] == list(range(1, c.depth + 1))
        for a in c.ancestors:
            assert all(blo <= lo and hi <= bhi for (lo, hi), (blo, bhi) in zip(c.ranges, blocks[a].ranges) if hi > lo)
    assert len(chunks) > 10 and (oversize < len(chunks) or cap <= 3)


@pytest.mark.parametrize("chunk", [None, 5000])
def test_merged_exclude_doc_features_on_real_text(real_index, chunk):
    idx = Index(real_index, threads=1)
    cfg = FeatureConfig(mode="exclude-doc", max_len=64, top_k=0)
    merged = merged_exclude_doc_features(idx, cfg, max_chunk_positions=chunk)
    for sh in range(len(idx.shards)):
        want = shard_features(idx, sh, cfg, pairwise=True)[0]
        assert np.array_equal(merged[sh].length, want.length) and np.array_equal(merged[sh].cont, want.cont)
