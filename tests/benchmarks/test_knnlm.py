"""The full-datastore kNN-LM peer (benchmarks/knnlm.py) against brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from teragram.model.mixture import cont_cache as cc
from teragram.model.mixture import knn

from benchmarks import knnlm


@pytest.mark.parametrize("n,T", [(2, 4), (5, 4), (6, 4), (7, 4), (20, 4), (21, 4), (22, 4), (1000, 16)])
def test_windows_predict_every_target_once(n, T):
    seen = []
    for a, keep in knn.train_windows(n, T):
        seen += range(a + 1 + keep, min(a + T, n - 1) + 1)
    assert seen == list(range(1, n))


def _brute(keys: np.ndarray, q: np.ndarray, k: int):
    d = ((q[:, None, :].astype(np.float64) - keys[None].astype(np.float64)) ** 2).sum(-1)
    i = np.argsort(d, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(d, i, 1), i


def _brute_chunked(keys: np.ndarray, q: np.ndarray, k: int, chunk: int = 128):
    """_brute for many keys: squared distances in float64 by the expansion, 128 queries at a time."""
    K = keys.astype(np.float64)
    kn = (K * K).sum(1)
    ds, ids = [], []
    for a in range(0, len(q), chunk):
        x = q[a : a + chunk].astype(np.float64)
        d = (x * x).sum(1)[:, None] + kn[None] - 2 * x @ K.T
        i = np.argpartition(d, k, axis=1)[:, :k]
        o = np.argsort(np.take_along_axis(d, i, 1), axis=1, kind="stable")
        ids.append(np.take_along_axis(i, o, 1))
        ds.append(np.take_along_axis(d, ids[-1], 1))
    return np.concatenate(ds), np.concatenate(ids)


def test_search_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(8, 16, generator=g) * 4
    keys = (centres[torch.randint(0, 8, (3000,), generator=g)] + torch.randn(3000, 16, generator=g)).half()
    vals = torch.randint(0, 50, (3000,), generator=g, dtype=torch.int32)
    q = centres[torch.randint(0, 8, (40,), generator=g)] + torch.randn(40, 16, generator=g)
    ds = knn.Datastore(keys, vals, centroids=16, sample=2000, iters=5)
    assert int(ds.off[-1]) == len(keys) and sorted(ds.ids.tolist()) == list(range(len(keys)))
    bd, bi = _brute(keys.float().numpy(), q.numpy(), 64)
    ed, ei = ds.exact(q, 64, chunk=700)
    np.testing.assert_allclose(ed.numpy(), bd, rtol=1e-4, atol=1e-3)
    assert (ei.numpy() == bi).mean() > 0.99  # ties aside, the same keys
    sd, si = ds.search(q, 64, nprobe=16, max_elems=5000)  # every list probed: exact
    np.testing.assert_allclose(sd.numpy(), bd, rtol=1e-4, atol=1e-3)
    ad, ai = ds.search(q, 64, nprobe=2)  # fewer lists: never nearer than exact, and the probed keys' own distances
    assert (ad.numpy() >= bd - 1e-3).all()
    got = ai.numpy()
    ok = got >= 0
    d_true = ((q.numpy()[:, None, :] - keys.float().numpy()[np.maximum(got, 0)]) ** 2).sum(-1)
    np.testing.assert_allclose(ad.numpy()[ok], d_true[ok], rtol=1e-4, atol=1e-3)


def test_target_probs_equal_the_dense_store_formula():
    from teragram.index.dense import knn_probs

    rng = np.random.default_rng(1)
    d = np.sort(rng.random((30, 20)) * 10, axis=1)
    v = rng.integers(0, 5, (30, 20))
    v[3] = -1  # a query without neighbours
    d[3] = np.inf
    t = rng.integers(0, 5, 30)
    got = knnlm.knn_target_probs(torch.from_numpy(d), torch.from_numpy(v), torch.from_numpy(t), [0.5, 3.0]).numpy()
    for j, temp in enumerate([0.5, 3.0]):
        with np.errstate(invalid="ignore"):  # the row without neighbours: nan there, 0 here
            want = knn_probs(d, v, t, temp)
        want[3] = 0.0
        np.testing.assert_allclose(got[:, j], want, rtol=1e-6, atol=1e-12)


def test_continuous_cache_is_brute_force_over_the_documents_earlier_states():
    """cont_cache.target_probs, in query blocks smaller than a document: per row, the softmax over the
    same document's earlier rows, summed where their target is this one's; 0 at a document's
    first row; a document's rows out of one run are refused."""
    rng = np.random.default_rng(3)
    doc = np.repeat([0, 1, 2], [9, 1, 14])
    h = rng.normal(size=(len(doc), 5)).astype(np.float32)
    tgt = rng.integers(0, 3, len(doc))
    temps = [0.5, 4.0]
    got = cc.target_probs(h, tgt, doc, temps, block=4)
    for i in range(len(doc)):
        before = np.flatnonzero((doc == doc[i]) & (np.arange(len(doc)) < i))
        if not len(before):
            assert (got[i] == 0).all()
            continue
        d = ((h[before].astype(np.float64) - h[i]) ** 2).sum(1)
        for c, t in enumerate(temps):
            w = np.exp(-(d - d.min()) / t)
            assert got[i, c] == pytest.approx((w * (tgt[before] == tgt[i])).sum() / w.sum(), rel=1e-5, abs=1e-7)
    assert (got[:, 1] > 0).sum() > 10
    with pytest.raises(ValueError, match="one run"):
        cc.target_probs(h, tgt, np.concatenate([doc[:5], doc[10:], doc[5:10]]), temps)


def test_doc_neighbours_and_cache_columns_are_brute_force_over_the_documents_earlier_states():
    """doc_neighbours, in query blocks smaller than a document: per row, the k nearest of the same
    document's earlier rows (fewer: inf / -1 after them) and their values; cache_columns over chunks
    of whole documents (one longer than a chunk) equals estimate_columns over them at once, and
    at a large k it is cont_cache.target_probs; a document's rows out of one run are refused."""
    rng = np.random.default_rng(4)
    doc = np.repeat([5, 1, 2, 7], [9, 1, 30, 4])
    h = torch.from_numpy(rng.normal(size=(len(doc), 5)).astype(np.float32))
    vals = torch.from_numpy(rng.integers(0, 3, len(doc)))
    k = 6
    d, nb = knn.doc_neighbours(h, doc, vals, k, max_elems=40)  # blocks of one row in the 30-row document
    H = h.double().numpy()
    for i in range(len(doc)):
        before = np.flatnonzero((doc == doc[i]) & (np.arange(len(doc)) < i))
        dd = ((H[before] - H[i]) ** 2).sum(1)
        o = np.argsort(dd, kind="stable")[:k]
        np.testing.assert_allclose(d[i, : len(o)].numpy(), dd[o], rtol=1e-5, atol=1e-6)
        assert (nb[i, : len(o)].numpy() == vals.numpy()[before[o]]).all()
        assert torch.isinf(d[i, len(o) :]).all() and (nb[i, len(o) :] == -1).all()
    cols = knn.cache_columns(h, doc, vals, vals, k, 0.7, 2.0, rows=12)  # the 30-row document alone in its chunk
    want = knn.estimate_columns(d, nb, vals, [0.7], 2.0)
    assert set(cols) == set(want) and all(np.array_equal(cols[f], want[f]) for f in want)
    assert cols["rest"][0, 0] == 1 and cols["q"][0, 0] == 0 and cols["top"][0, 0] == -1 and (cols["rest"][1:9] == 0).all()
    full = knn.cache_columns(h, doc, vals, vals, 64, 0.7, 2.0)
    np.testing.assert_allclose(full["q"][:, 0], cc.target_probs(h.numpy(), vals.numpy(), doc, [0.7])[:, 0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one run"):
        knn.doc_neighbours(h, np.concatenate([doc[:5], doc[10:], doc[5:10]]), vals, k)


def test_datastore_keys_are_the_models_hidden_states(real_index):
    from teragram.index import format as fmt
    from teragram.model.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    m = fmt.read_json(real_index / "manifest.json")
    cfg = GPTConfig.preset("tiny", vocab_size=m["tokenizer"]["vocab_size"], block_size=64, use_index=False, mixture=False)
    model = GPT(cfg).eval()
    keys, vals, mu = knn.build(model, real_index, "cpu", batch=8)
    toks = [fmt.open_array(fmt.shard_dir(real_index, s["shard"], s.get("dir")) / "tokens.bin", "tokens") for s in m["shards"]]
    assert len(keys) == sum(len(t) - 1 for t in toks)
    sep, eos = m["separator"], m["tokenizer"]["eos_id"]
    t0 = np.asarray(toks[0]).astype(np.int64)
    t0[t0 == sep] = eos
    assert (vals[: len(t0) - 1].numpy() == t0[1:]).all()  # the value of each key: the next token
    x = torch.from_numpy(t0[64:128][None])  # the second window of the first shard
    with torch.no_grad():
        h, _ = model.hidden(x)
    np.testing.assert_allclose((keys[64:128].float() + mu).numpy(), h[0].numpy(), rtol=2e-3, atol=2e-3)


def test_fit_picks_the_validation_optimum():
    rng = np.random.default_rng(2)
    nll = rng.random(500) * 5
    p = np.stack([np.zeros(500), np.exp(-nll) * 3], 1).clip(0, 1)  # the second column helps
    j, lam = knnlm.fit(nll, p)
    assert j == 1 and lam > 0


def test_run_scores_every_target_as_brute_force(real_index, tmp_path):
    """run: every target of every half, p_knn per temperature as the softmax over the k nearest of
    all training keys (every list probed: exact), the scale the validation's median nearest."""
    from teragram.builder.features import compute_features
    from teragram.index import format as fmt
    from teragram.index.engine import Index
    from teragram.index.features import FeatureConfig
    from teragram.model.evaluation.perplexity import token_eval
    from teragram.model.gpt import GPT, GPTConfig

    from tests.conftest import real_texts

    torch.manual_seed(0)
    m = fmt.read_json(real_index / "manifest.json")
    model = GPT(GPTConfig.preset("tiny", vocab_size=m["tokenizer"]["vocab_size"], block_size=64, use_index=False, mixture=False)).eval()
    held = {}
    for h, texts in (("valid", real_texts(2, 500)), ("test", real_texts(3, 500)[2:])):
        src = tmp_path / f"text-{h}"
        src.mkdir()
        for j, (_, t) in enumerate(texts):
            (src / f"{j}.txt").write_text(t)
        compute_features(real_index, tmp_path / h, FeatureConfig("held-out", 64, 1), corpus=[str(src)], progress=False)
        held["s", h] = tmp_path / h
    k = 32
    info = knnlm.run(model, real_index, held, tmp_path, "cpu", batch=8, centroids=4, nprobe=4, k=k)
    keys, vals, mu = knn.build(model, real_index, "cpu", batch=8)
    K = keys.float().numpy()
    idx = Index(real_index)
    near = {}
    for h in ("valid", "test"):
        r = token_eval(model, held["s", h], idx.eos_id, idx.sep, "cpu", hidden=True)
        d, i = _brute_chunked(K, r["hidden"] - mu.numpy(), k + 1)
        near[h] = (r, d[:, :k], i[:, :k], d[:, k] - d[:, k - 1] > 1e-3)  # rows whose k nearest are not tied with the next
    nearest = np.sort(near["valid"][1][:, 0])
    scale = float(nearest[(len(nearest) - 1) // 2])  # torch's median: the lower middle value
    assert info["temperature_scale"] == pytest.approx(scale, rel=1e-3)
    for h, (r, d, i, sure) in near.items():
        z = np.load(tmp_path / f"knn-s-{h}.npz")
        assert (z["target"] == r["target"]).all() and len(z["p_knn"]) == len(r["target"])
        np.testing.assert_allclose(z["nll_a"], r["nll"], rtol=1e-5)
        np.testing.assert_allclose(z["nearest"], d[:, 0] / scale, rtol=1e-3, atol=1e-4)  # float32 distances by the expansion
        hit = vals.numpy()[i] == r["target"][:, None]
        for j, f in enumerate(knnlm.FACTORS):
            w = np.exp(-(d - d[:, :1]) / (f * scale))
            want = (w * hit).sum(1) / w.sum(1)
            np.testing.assert_allclose(z["p_knn"][sure, j], want[sure], rtol=1e-3, atol=1e-5)
        assert sure.mean() > 0.5
