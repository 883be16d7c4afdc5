"""Evaluation features of the product against brute force: decontamination (13-gram share in
the index), infini-gram's λ interpolation and kNN-LM, as `teragram eval` computes them, and
infini-gram's interpolation plus the document cache."""

from __future__ import annotations

import numpy as np
import pytest
from teragram.index import format as fmt
from teragram.index.engine import Index
from teragram.index.features import FeatureConfig
from teragram.index.heldout import compute_held_out, contamination
from teragram.model.checkpoint import load_model
from teragram.model.evaluation.perplexity import EvalOptions, heldout_report, token_eval
from teragram.model.mixture import baselines
from teragram.model.training.train import TrainConfig, train

from tests.conftest import real_texts


@pytest.fixture(scope="module")
def setup(real_index, tmp_path_factory):
    """A tiny model of the real index, and held-out text: copies of indexed text (contaminated),
    words the index never saw, a half-and-half mix and a document too short for a 13-gram."""
    d = tmp_path_factory.mktemp("baselines")
    train(TrainConfig(index=str(real_index), out=str(d / "run"), preset="tiny", block_size=32, batch_size=4, max_steps=3, progress=False))
    corpus = d / "corpus"
    corpus.mkdir()
    texts = [t for _, t in real_texts(6, 1200)]
    rng = np.random.default_rng(0)
    noise = lambda n: " ".join("".join(rng.choice(list("qxzjkvw"), 6)) for _ in range(n))  # noqa: E731
    (corpus / "a_copy.txt").write_text(texts[2][:900])
    (corpus / "b_copy.txt").write_text(texts[4][200:1000])
    (corpus / "c_noise.txt").write_text(noise(60))
    (corpus / "d_half.txt").write_text(texts[1][:400] + " " + noise(40))
    (corpus / "e_short.txt").write_text("The kernel")
    compute_held_out(real_index, d / "held", FeatureConfig("held-out", 64, 4), [str(corpus)])
    model, _ = load_model(d / "run")
    return model, d / "held"


def _docs(held):
    h = held / "000000"
    tok = np.asarray(fmt.open_array(h / "tokens.bin", "tokens")).astype(np.int64)
    st = np.asarray(fmt.open_array(h / "docs.bin", "docs")).astype(np.int64)
    return [tok[st[k] : st[k + 1] - 1] for k in range(len(st) - 1)]


def test_contamination_is_the_share_of_13_grams_in_the_index(real_index, setup, tmp_path):
    _, held = setup
    idx = Index(real_index)
    want = []
    for ids in _docs(held):
        grams = [ids[t - 12 : t + 1] for t in range(12, len(ids))]
        want.append(np.mean([idx.count(g).count > 0 for g in grams]) if grams else 0.0)
    got = contamination(held)
    np.testing.assert_allclose(got, want)
    assert got.max() >= 0.8 and got.min() == 0.0 and 0.2 < sorted(got)[2] < 0.8  # copies, noise and the mix
    # features capped below 13 tokens: scored against the index instead
    compute_held_out(real_index, tmp_path / "h8", FeatureConfig("held-out", 8, 0), [str(held.parent / "corpus")])
    np.testing.assert_allclose(contamination(tmp_path / "h8", real_index), want)


def _brute_infgram(idx, ids):
    """Per target of EOS + ids (then EOS): the ∞-gram probability and sparsity, by ntd queries."""
    p, sparse = [], []
    y = list(ids) + [idx.eos_id]
    for j, t in enumerate(y):
        r = idx.infgram_ntd(list(ids[:j]))
        p.append(r.result_by_token_id.get(int(t), (0, 0.0))[1])
        sparse.append(len(r.result_by_token_id) == 1)
    return np.array(p), np.array(sparse)


def test_infinigram_baseline_against_brute_force(real_index, setup):
    model, held = setup
    idx = Index(real_index)
    docs = _docs(held)
    base = token_eval(model, held, idx.eos_id, idx.sep)
    parts = [_brute_infgram(idx, ids) for ids in docs]
    p_inf = np.concatenate([p for p, _ in parts])
    groups = np.concatenate([s for _, s in parts]).astype(int)
    assert len(p_inf) == len(base["nll"]) and groups.any()
    r, lams = heldout_report(model, real_index, held, opts=EvalOptions(baseline="infini-gram"))
    for g in (0, 1):  # each λ is the grid's best on this text
        m = groups == g
        losses = [baselines.mix_nll(base["nll"][m], p_inf[m], lam).sum() for lam in baselines.LAMBDAS]
        assert lams[g] == baselines.LAMBDAS[int(np.argmin(losses))]
    lam = np.where(groups == 1, lams[1], lams[0])
    mixed = -np.log(lam * p_inf + (1 - lam) * np.exp(-base["nll"]))
    assert r["loss"] == pytest.approx(mixed.mean(), rel=1e-9)
    assert r["model"]["loss"] == pytest.approx(base["nll"].mean(), rel=1e-9) and r["loss"] < r["model"]["loss"]
    # loaded parameters give the same figures; decontamination drops the copies from everything
    r2, fitted = heldout_report(model, real_index, held, opts=EvalOptions(baseline="infini-gram", params=lams))
    assert fitted is None and r2["loss"] == r["loss"]
    r3, _ = heldout_report(model, real_index, held, opts=EvalOptions(baseline="infini-gram", params=lams, decontaminate=True))
    keep = contamination(held) < 0.8
    assert r3["decontaminated"] == {"dropped_docs": int((~keep).sum()), "docs": len(docs)} and 1 <= (~keep).sum() < len(docs)
    tok_keep = keep[base["doc"].astype(int)]
    assert r3["tokens"] == sum(len(d) + 1 for d, k in zip(docs, keep) if k)
    assert r3["loss"] == pytest.approx(mixed[tok_keep].mean(), rel=1e-9)


def test_infinigram_cache_interpolation_is_a_distribution_fit_by_likelihood(real_index, setup, tmp_path):
    """fit_cache_weights' weights are each group's best on the fitting text (no point of a fine
    simplex grid does better), the cache weighs nothing where the context did not occur earlier
    in the document, and the interpolation is a distribution over the vocabulary at every
    context: against the ∞-gram from ntd queries and the cache's distribution read off the
    context."""
    from teragram.model.mixture import estimates

    model, held = setup
    idx = Index(real_index)
    docs = _docs(held)
    base = token_eval(model, held, idx.eos_id, idx.sep)
    est = estimates.heldout_estimates(real_index, held)
    p_inf, p_cache, groups = baselines.infgram_cache_inputs(est)
    assert set(np.unique(groups)) == {0, 1, 2, 3}
    w = baselines.fit_cache_weights(base["nll"], p_inf, p_cache, groups)
    grid = np.linspace(0, 1, 51)
    for g, wg in w.items():
        m = groups == g
        assert sum(wg) == pytest.approx(1.0) and min(wg) >= 0 and (wg[2] == 0.0) == (g < 2)
        got = baselines.apply_cache_weights(base["nll"][m], p_inf[m], p_cache[m], w, groups[m]).mean()
        for a in grid:  # a: the ∞-gram's weight, b: the cache's (0 without an earlier occurrence)
            for b in grid[grid <= 1 - a + 1e-12] if g >= 2 else [0.0]:
                other = baselines.apply_cache_weights(
                    base["nll"][m], p_inf[m], p_cache[m], {g: (max(1 - a - b, 0.0), a, b)}, groups[m]
                ).mean()
                assert got <= other + 1e-6, (g, a, b)
    baselines.save_params(tmp_path / "w.json", "infini-gram+cache", w)
    assert baselines.load_params(tmp_path / "w.json", "infini-gram+cache") == w
    # (c+cache) on the text it was fit on is no worse than infini-gram's interpolation
    lams = baselines.fit_lambdas(base["nll"], p_inf, est["sparse"].astype(int))
    mixed = baselines.apply_cache_weights(base["nll"], p_inf, p_cache, w, groups)
    assert mixed.mean() <= baselines.apply_lambdas(base["nll"], p_inf, lams, est["sparse"].astype(int)).mean()
    # every context: the weights mix three distributions over the vocabulary
    rng = np.random.default_rng(3)
    V = idx.vocab_size
    j0 = 0
    for ids in docs:
        y = np.append(ids, idx.eos_id)
        for j in range(len(y)):
            q = ids[:j]
            r = idx.infgram_ntd(list(q))
            d_inf = np.zeros(V)
            for t, (_, prob) in r.result_by_token_id.items():
                d_inf[t] = prob
            d_cache, n_cache = estimates.cache_live(q, V, ["cache_longest"])[0]["cache_longest"]
            g = int(len(r.result_by_token_id) == 1) + 2 * (n_cache > 0)
            k = j0 + j
            assert g == groups[k] and d_inf[y[j]] == pytest.approx(p_inf[k]) and d_cache[y[j]] == pytest.approx(p_cache[k])
            if j % 7 == 0:  # the whole distribution, with a random model distribution
                d_model = rng.dirichlet(np.ones(V))
                p = np.exp(-baselines.apply_cache_weights(-np.log(d_model), d_inf, d_cache, w, np.full(V, g)))
                assert p.sum() == pytest.approx(1.0, abs=1e-9)
        j0 += len(y)
    assert j0 == len(groups)


def test_knn_baseline_mixes_the_dense_stores_neighbours(real_index, setup, tmp_path):
    from teragram.index.dense import DenseStore, knn_probs
    from teragram.model.mixture.dense import build_store

    model, held = setup
    idx = Index(real_index)
    build_store(real_index, held.parent / "run", n_positions=512, out=tmp_path / "dense")
    r, params = heldout_report(model, real_index, held, opts=EvalOptions(baseline="knn", dense=tmp_path / "dense"))
    base = token_eval(model, held, idx.eos_id, idx.sep, hidden=True)
    dist, vals = DenseStore(tmp_path / "dense").search(base["hidden"], 64)
    y = base["target"].astype(np.int64)
    scale = float(np.median(dist[:, 0])) + 1e-6
    best = min(
        (baselines.mix_nll(base["nll"], knn_probs(dist, vals, y, f * scale), lam).mean(), f, lam)
        for f in baselines.KNN_TEMPERATURES
        for lam in baselines.LAMBDAS
    )
    assert (params["temperature_factor"], params["lambda"]) == (best[1], best[2])
    assert r["loss"] == pytest.approx(best[0], rel=1e-6)  # float32 model outputs, summed in another order
