"""Cross-shard matches by merge-join against the per-position search of the other shard."""

import numpy as np
import pytest
from teragram.builder.build import build_from_ids
from teragram.builder.cross_shard import other_shard_matches
from teragram.index import kernels as IK
from teragram.index.engine import Index

from tests.builder.test_sa_parts import _docs_with_duplicates


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
    build_from_ids(_docs_with_duplicates(5), out, tokenizer_model, shard_tokens=1200)
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
