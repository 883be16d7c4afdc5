"""index/cluster_bulk's holder side without Ray: a holder is any object with idx, places and kept."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from teragram.index.cluster_bulk import holder_histograms, holder_lengths
from teragram.index.engine import Index


def test_round_two_on_a_replica_that_missed_round_one(real_index):
    """A replica that ran a pass's round 2 (its kept intervals dropped) and then gets another
    pass's round 2 without its round 1 (the round-1 call went to another replica) computes the
    intervals itself: the same answer as a holder that ran both rounds."""
    idx = Index(real_index)
    tok = np.asarray(idx.shards[0].tok[:400]).astype(np.int64)
    ids, starts, caps = np.concatenate([tok[:150], tok[200:400]]), np.array([0, 150, 350]), [4, 16]

    def holder():
        return SimpleNamespace(idx=idx, places=list(range(len(idx.shards))))

    def both_rounds(h, key):
        lengths, _ = holder_lengths(h, key, ids, starts, caps)
        return holder_histograms(h, key, ids, starts, caps, lengths, np.zeros(lengths.size, bool), 64)

    want = both_rounds(holder(), "b")
    replica = holder()
    both_rounds(replica, "a")  # its kept intervals are dropped after round 2
    lengths, _ = holder_lengths(holder(), "b", ids, starts, caps)
    got = holder_histograms(replica, "b", ids, starts, caps, lengths, np.zeros(lengths.size, bool), 64)
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))
    assert len(want[0]) > 0  # rows whose longest match this holder holds
