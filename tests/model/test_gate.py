"""The ∞-gram interpolation: infini-gram's two λ and the learned gate, on synthetic positions
whose best mixing weight is known; the document cache's estimates against brute force."""

import json

import numpy as np
import pytest
from teragram.model.mixture import baselines, estimates
from teragram.model.mixture import gate as gate_mod
from teragram.model.mixture.gate import Gate


def _positions(n: int, seed: int):
    """Long sparse matches whose continuation is right 95% of the time; short dense matches
    whose ∞-gram estimate is noise; a model that is mediocre everywhere."""
    rng = np.random.default_rng(seed)
    sparse = rng.random(n) < 0.4
    length = np.where(sparse, rng.integers(20, 60, n), rng.integers(1, 4, n))
    count = np.where(sparse, rng.integers(1, 3, n), rng.integers(1000, 100000, n))
    right = rng.random(n) < 0.95
    p_inf = np.where(sparse, np.where(right, 1.0, 0.0), rng.uniform(0.0, 0.02, n))
    nll_model = -np.log(rng.uniform(0.05, 0.3, n))
    maxp = rng.uniform(0.2, 0.6, n)
    agree = (rng.random(n) < 0.5) & sparse
    share = np.where(sparse, 1.0, rng.uniform(0.01, 0.5, n))
    return length, count, share, maxp, agree, nll_model, p_inf


def _logp(nll_model, *ps):
    return np.stack([-nll_model, *(np.log(p + 1e-300) for p in ps)], 1)


def test_lambdas_pick_the_grid_optimum():
    *_, share, _, _, nll_model, p_inf = _positions(20000, 0)
    sparse = share >= 1
    lams = baselines.fit_lambdas(nll_model, p_inf, sparse.astype(int))
    for grp in (0, 1):
        m = sparse.astype(int) == grp
        losses = [baselines.mix_nll(nll_model[m], p_inf[m], lam).mean() for lam in baselines.LAMBDAS]
        assert lams[grp] == baselines.LAMBDAS[int(np.argmin(losses))]
    assert lams[1] > 0.7 > 0.1 > lams[0]


def test_gate_learns_where_the_index_is_reliable_and_generalises():
    length, count, share, maxp, agree, nll_model, p_inf = _positions(20000, 1)
    sparse = share >= 1
    X = gate_mod.gate_features(length, maxp, [count], [share], [agree])
    gate = Gate.fit(X, _logp(nll_model, p_inf), components=("index_infgram",))
    g = gate(X)[:, 1]
    assert g[sparse].mean() > 0.8 and g[~sparse].mean() < 0.2
    # on fresh positions the gate is at least as good as infini-gram's tuned constants
    length2, count2, share2, maxp2, agree2, nll2, p2 = _positions(20000, 2)
    sparse2 = share2 >= 1
    lams = baselines.fit_lambdas(nll_model, p_inf, sparse.astype(int))
    fixed = baselines.apply_lambdas(nll2, p2, lams, sparse2.astype(int)).mean()
    learned = gate_mod.mix_nll_multi(_logp(nll2, p2), gate(gate_mod.gate_features(length2, maxp2, [count2], [share2], [agree2]))).mean()
    assert learned <= fixed + 1e-3
    assert learned < nll2.mean()


def test_gate_round_trips(tmp_path):
    length, count, share, maxp, agree, nll_model, p_inf = _positions(2000, 3)
    X = gate_mod.gate_features(length, maxp, [count], [share], [agree])
    gate = Gate.fit(X, _logp(nll_model, *[p_inf] * len(estimates.INDEX)), components=estimates.INDEX, steps=50)
    gate.save(tmp_path / "gate.json")
    np.testing.assert_allclose(Gate.load(tmp_path / "gate.json")(X), gate(X))


def test_gate_load_refuses_other_files(tmp_path):
    from teragram.index.errors import TeragramError

    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(TeragramError, match="not a teragram index gate"):
        Gate.load(tmp_path / "x.json")
    Gate(np.zeros((5, 2)), ("index_infgram", "index_2gram")).save(tmp_path / "two.json")
    d = json.loads((tmp_path / "two.json").read_text())
    d["W"] = np.zeros((5, 3)).tolist()  # weights for three estimates, two named
    (tmp_path / "two.json").write_text(json.dumps(d))
    with pytest.raises(TeragramError, match="other features"):
        Gate.load(tmp_path / "two.json")
    with pytest.raises(TeragramError, match="unknown or misordered"):
        Gate(np.zeros((5, 2)), ("index_2gram", "index_infgram"))


def test_gate_uses_a_third_component_where_it_helps():
    """A short-order estimate that is right on dense positions gets the weight there."""
    length, count, share, maxp, agree, nll_model, p_inf = _positions(20000, 4)
    sparse = share >= 1
    rng = np.random.default_rng(5)
    short_cnt = rng.integers(1, 1000, len(length))
    good = short_cnt > 500  # reliable only when its own suffix is frequent
    p_short = np.where(good, 0.6, rng.uniform(0, 0.01, len(length)))
    X = gate_mod.gate_features(length, maxp, [count, short_cnt], [share, np.full(len(length), 0.3)], [agree, np.zeros(len(length))])
    w = Gate.fit(X, _logp(nll_model, p_inf, p_short), components=("index_infgram", "index_2gram"))(X)
    dense = ~sparse
    assert w[dense & good, 2].mean() > 0.5 > 0.1 > w[dense & ~good, 2].mean()
    two = Gate.fit(X, _logp(nll_model, p_inf), components=("index_infgram",))(X)
    assert (
        gate_mod.mix_nll_multi(_logp(nll_model, p_inf, p_short), w).mean()
        < gate_mod.mix_nll_multi(_logp(nll_model, p_inf), two).mean() - 0.05
    )


def _brute_cache(ids, eos, j, k):
    """Earlier occurrences in ids[:j] of its last k tokens: (count, followers' histogram)."""
    ctx = ids[:j]
    if j < k:
        return 0, {}
    nxt = [int(ctx[e]) for e in range(k, j) if np.array_equal(ctx[e - k : e], ctx[j - k :])]
    return len(nxt), {t: nxt.count(t) for t in set(nxt)}


def test_window_ids_group_equal_windows():
    # the cache's context ids, composed from shorter windows' ids, against comparing the windows themselves
    rng = np.random.default_rng(1)
    for trial in range(30):
        ids = rng.integers(0, 2 + trial % 4, size=int(rng.integers(1, 300)))
        ks = (1, 2, 3, 5, 6, 7, 12, 13, 31, 64, 100, 299)
        got = estimates._window_ids(ids, ks)
        assert sorted(got) == [k for k in ks if k <= len(ids)]
        for k, kid in got.items():
            rows = np.lib.stride_tricks.sliding_window_view(ids, k)
            want = np.unique(rows, axis=0, return_inverse=True)[1].ravel()
            assert np.array_equal(kid, want), (trial, k)  # ranks of the windows in lexicographic order, both


def test_cache_estimates_against_brute_force_and_live():
    rng = np.random.default_rng(0)
    eos = 9
    for trial in range(40):
        ids = rng.integers(0, 3 if trial % 2 else 6, size=int(rng.integers(0, 90)))
        est = estimates.cache_estimates(ids, eos)
        y = np.append(ids, eos)
        assert all(len(v) == len(y) for v in est.values())
        for j in range(len(y)):
            longest = max((k for k in estimates.CACHE_LENGTHS if _brute_cache(ids, eos, j, k)[0]), default=0)
            assert est["cache_length"][j] == longest, (trial, j)
            for name, k in [(f"cache_{k + 1}gram", k) for k in estimates.ORDERS] + [("cache_longest", longest)]:
                cnt, hist = _brute_cache(ids, eos, j, k) if k else (0, {})
                top = min(hist, key=lambda t: (-hist[t], t)) if hist else -1
                got = (est[f"count_{name}"][j], est[f"p_{name}"][j], est[f"top_{name}"][j], est[f"share_{name}"][j])
                want = (cnt, hist.get(int(y[j]), 0) / max(cnt, 1), top, (hist[top] if hist else 0) / max(cnt, 1))
                assert got == pytest.approx(want), (trial, j, name)
            # the live path (generation) reads the same distributions off the context
            dists, clen = estimates.cache_live(ids[:j], 10, estimates.CACHE)
            assert clen == longest
            for name in estimates.CACHE:
                d, n = dists[name]
                assert n == est[f"count_{name}"][j] and d[y[j]] == pytest.approx(est[f"p_{name}"][j]), (trial, j, name)


def test_gates_saved_with_the_old_component_names_load_under_the_new(tmp_path):
    rng = np.random.default_rng(6)
    W = rng.normal(size=(5, len(estimates.COMPONENTS)))
    Gate(W).save(tmp_path / "new.json")
    d = json.loads((tmp_path / "new.json").read_text())
    old = ["", "1", "2", "4", "8", "16", "c", "c1", "c2", "c4", "c8", "c16"]  # the names before they said what they are
    d["components"] = old
    (tmp_path / "old.json").write_text(json.dumps(d))
    g = Gate.load(tmp_path / "old.json")
    assert g.components == estimates.COMPONENTS
    assert g.components[:3] == ("index_infgram", "index_2gram", "index_3gram") and g.components[6:8] == ("cache_longest", "cache_2gram")
    np.testing.assert_array_equal(g.W, W)
    d["components"] = ["", "c4"]
    d["W"] = W[:, :2].tolist()
    (tmp_path / "two.json").write_text(json.dumps(d))
    assert Gate.load(tmp_path / "two.json").components == ("index_infgram", "cache_5gram")


def test_component_names_say_their_context():
    assert [estimates.context_length(c) for c in estimates.INDEX] == [0, *estimates.ORDERS]
    assert [estimates.context_length(c) for c in estimates.CACHE] == [0, *estimates.ORDERS]


def test_gate_columns_are_the_dense_design_matrix():
    """GateX (the columns set in each row) gives the dense matrix's product exactly, and each
    row of the dense matrix has one 1 per one-hot block plus its set binary columns."""
    rng = np.random.default_rng(3)
    n, comps = 500, estimates.COMPONENTS
    X = gate_mod.gate_features(
        rng.integers(0, 200, n),
        rng.random(n),
        [rng.integers(0, 10**6, n) for _ in comps],
        [rng.random(n) for _ in comps],
        [rng.random(n) < 0.5 for _ in comps],
        rng.integers(0, 70, n),
    )
    D = X.dense()
    W = rng.standard_normal((X.width, 4))
    np.testing.assert_allclose(X.matmul(W), D.astype(np.float64) @ W, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(D.sum(1), (X.cols < X.width).sum(1))
    np.testing.assert_array_equal(X[10:20].dense(), D[10:20])
