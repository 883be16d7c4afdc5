import numpy as np
from teragram.index import dense


def test_ivfpq_recall_at_8_against_exact_search(tmp_path):
    """Clustered keys like hidden states: IVF-PQ finds >= 90% of the exact 8 nearest."""
    rng = np.random.default_rng(0)
    d, n = 32, 12000
    centers = rng.normal(size=(200, d)).astype(np.float32) * 3
    keys = (centers[rng.integers(0, 200, n)] + rng.normal(size=(n, d))).astype(np.float32)
    vals = rng.integers(0, 1000, n)
    dense.build(tmp_path / "d", keys, vals, dense.DenseConfig(nlist=128, nprobe=16))
    store = dense.DenseStore(tmp_path / "d")
    q = (centers[rng.integers(0, 200, 300)] + rng.normal(size=(300, d))).astype(np.float32)
    _, got = store.search(q, 8)
    d2 = (q**2).sum(1)[:, None] + (keys**2).sum(1)[None, :] - 2 * q @ keys.T
    exact = np.argsort(d2, axis=1)[:, :8]
    # compare by key identity: map the returned values back through positions is ambiguous, so
    # search the raw index for ids
    _, ids = store.index.search(q, 8)
    recall = np.mean([len(set(ids[i]) & set(exact[i])) / 8 for i in range(len(q))])
    assert recall >= 0.9, recall
    assert (got == vals[ids]).all()


def test_knn_probs():
    dist = np.array([[0.0, 1.0, 2.0], [0.0, 0.0, 5.0]])
    vals = np.array([[7, 8, 7], [1, -1, 2]])
    p = dense.knn_probs(dist, vals, np.array([7, 2]), temperature=1.0)
    w = np.exp([0.0, -1.0, -2.0])
    assert np.isclose(p[0], (w[0] + w[2]) / w.sum())
    assert np.isclose(p[1], np.exp(-5) / (1 + np.exp(-5)))
