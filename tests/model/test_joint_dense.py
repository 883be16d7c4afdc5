"""The kNN-LM's dense estimates as joint components (benchmarks/knnlm.joint_estimates, the
store rebuilt by model/mixture/knn.KnnSource): brute force's over every key but the own
document's for training positions, over every key for held-out text; a model trained with
them, scored with them given, through the CLI, evals and serve."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from teragram.index.engine import Index
from teragram.index.errors import TeragramError
from teragram.model.checkpoint import load_model
from teragram.model.config import ConfigError
from teragram.model.evaluation.perplexity import token_eval
from teragram.model.generation.sample import generate
from teragram.model.mixture import joint, knn
from teragram.model.mixture.estimates import heldout_docs

from tests.model.conftest import joint_kw, make_joint_root, train_tiny
from tests.model.helpers import assert_live_is_bulk


@pytest.fixture(scope="module")
def dense_run(tokenizer_model, tmp_path_factory):
    """benchmarks/knnlm.joint_estimates (every list probed: exact) over a small index (every pair
    of shards searched) with a keys model's ffn_in states: the training positions' dense
    estimates (est_knn) and the held-out text's, the peer's and the continuous cache's (.npz in
    tmp); with the store's keys (K, centred on mu), values (V) and each key's document (doc) and
    (shard, row) (where) for the brute-force oracles."""
    from benchmarks import knnlm

    tmp = tmp_path_factory.mktemp("dense")
    root = make_joint_root(tmp / "small", tokenizer_model, 12, 2500, 3, shard_tokens=6000)  # a smaller one: every pair is searched
    idx = Index(root / "idx")
    assert len(idx.shards) > 1
    train_tiny(root, "keys", max_steps=2, use_index=False, heldout=None)  # the keys model, a checkpoint (--knn-keys)
    model, _ = load_model(root / "keys")
    model.eval()
    held = {("indist", h): root / "held" for h in ("valid", "test")}
    k = 8
    est_knn = tmp / "est-knn"
    args = (model, root / "idx", held, root / "est", est_knn, tmp, "cpu")
    info = knnlm.joint_estimates(*args, batch=8, eval_batch=8, k=k, centroids=4, nprobe=4, chunk=5000, key="ffn_in", peer=True)
    keys, vals, mu = knn.build(model, root / "idx", "cpu", batch=8, key="ffn_in")  # centred on mu: held-out queries too
    doc, where, off = [], [], 0  # per key: its target's document (the one whose span holds it), its shard and row
    for s in idx.shards:
        tok = np.asarray(s.tok)
        ends = np.nonzero(tok == idx.sep)[0]
        doc.append(off + np.searchsorted(ends, np.arange(1, len(tok)), side="left"))
        where += [(s.id, r) for r in range(len(tok) - 1)]
        off += len(ends) + 1
    scale = info["temperature_scale"]
    temp = info["temperature_factor"] * scale
    return SimpleNamespace(
        tmp=tmp, root=root, idx=idx, model=model, held=held, k=k, est_knn=est_knn, args=args, info=info,
        K=keys.float().numpy().astype(np.float64), V=vals.numpy(), mu=mu, doc=np.concatenate(doc), where=where,
        comps=(*joint.COMPONENTS, *joint.DENSE), scale=scale, temp=temp, temps=np.array([temp * m for m in knn.MULTIPLES]),
        nd=len(knn.MULTIPLES),  # the nd columns before the last: the kNN estimate at each of its temperatures; the last dense_cache
    )  # fmt: skip


def _dense_oracle(run, q, mask=None):
    """Brute force's k nearest keys to q (squared distances of the k + 1 nearest, their ids) and
    the kNN estimate's weights over the k at each of run.temps (mask: keys left out)."""
    d = ((run.K - q) ** 2).sum(1)
    if mask is not None:
        d[mask] = np.inf
    o = np.argsort(d, kind="stable")[: run.k + 1]
    w = np.exp(-(d[o[: run.k]] - d[o[0]])[None] / run.temps[:, None])  # (nd, k)
    return d[o], o, w / w.sum(1, keepdims=True)


def test_dense_knn_estimates_exclude_the_own_document(dense_run):
    """Each training position's kNN estimate is brute force's over every key but its own
    document's (its copies elsewhere are found); dense_cache's over its own document's earlier
    keys; the index's and cache's columns are kept."""
    from benchmarks import knnlm

    run, k, nd, K, V, doc = dense_run, dense_run.k, dense_run.nd, dense_run.K, dense_run.V, dense_run.doc
    info, idx, scale = run.info, run.idx, run.scale
    assert info["key"] == "ffn_in" and "key_choice" not in info
    kn = slice(-nd - 1, -1)
    assert joint.DENSE[-1] == "dense_cache" and len(joint.DENSE) == nd + 1 and info["temperature_multiples"] == list(knn.MULTIPLES)
    temp_c = info["cache_temperature"]
    assert (
        info["cache_factor"] in knnlm.CACHE_FIT and temp_c == pytest.approx(info["cache_factor"] * scale) and info["train_cache_mean_q"] > 0
    )
    shards, cols = joint.open_train_estimates(run.est_knn, run.root / "idx", run.comps, 4)
    ids = [s.id for s in idx.shards]
    base, _ = joint.open_train_estimates(run.root / "est", run.root / "idx", joint.COMPONENTS, 4)
    rng = np.random.default_rng(0)
    checked = copies = cached = 0
    for p in rng.choice(len(K), 300, replace=False):
        d, o, w = _dense_oracle(run, K[p], doc == doc[p])
        if d[k] - d[k - 1] < 1e-3:
            continue  # the k-th nearest tied with the next
        sid, r = run.where[p]
        row = shards[ids.index(sid)].rows(r, r + 1, cols)
        np.testing.assert_allclose(row.q[0, kn], (w * (V[o[:k]] == V[p])).sum(1), rtol=2e-3, atol=1e-5)
        assert all(row.top[0, kn] == row.top[0, -2]) and (row.rest[0, kn] == 0).all()
        assert row.top[0, -2] in V[o[d[: k + 1] - d[0] < 1e-3]]  # the nearest (or one tied with it)
        assert (row.count[0, kn] == 1 + np.searchsorted(knn.DIST_EDGES, d[0] / scale, side="right")).all()
        np.testing.assert_array_equal(row.q[0, : -nd - 1], base[ids.index(sid)].q[r])  # the index's and cache's columns kept
        checked += 1
        copies += d[0] < 1e-2  # the same context in a copy of the document
        before = np.flatnonzero((doc == doc[p]) & (np.arange(len(K)) < p))  # dense_cache: its own document's earlier keys
        if not len(before):
            assert row.rest[0, -1] == 1 and row.q[0, -1] == 0 and row.top[0, -1] == -1
            continue
        dc = ((K[before] - K[p]) ** 2).sum(1)
        oc = np.argsort(dc, kind="stable")[: k + 1]
        if len(oc) > k and dc[oc[k]] - dc[oc[k - 1]] < 1e-3:
            continue
        wc = np.exp(-(dc[oc[:k]] - dc[oc[0]]) / temp_c)
        assert row.q[0, -1] == pytest.approx((wc * (V[before[oc[:k]]] == V[p])).sum() / wc.sum(), rel=2e-3, abs=1e-5)
        assert row.rest[0, -1] == 0 and row.count[0, -1] == 1 + np.searchsorted(knn.DIST_EDGES, dc[oc[0]] / scale, side="right")
        cached += 1
    assert checked > 200 and copies > 20 and cached > 150, (checked, copies, cached)
    for e in shards:  # the last position of a shard predicts nothing indexed: it defers to the model
        assert (e.rest[-1, -nd - 1 :] == 1).all() and (e.q[-1, -nd - 1 :] == 0).all()


def test_dense_knn_heldout_estimates_and_the_peer_are_brute_force(dense_run):
    """A held-out target's kNN estimate is brute force's over every key, dense_cache's over its
    document's earlier states; the peer (k = 1024) and the continuous cache over the same states
    are brute force's too."""
    from benchmarks import knnlm

    run, k, K, V, idx, mu = dense_run, dense_run.k, dense_run.K, dense_run.V, dense_run.idx, dense_run.mu
    temp_c = run.info["cache_temperature"]
    r = token_eval(run.model, run.held["indist", "test"], idx.eos_id, idx.sep, "cpu", hidden="ffn_in")
    z = np.load(run.tmp / "knnest-indist-test.npz")
    zp = np.load(run.tmp / "knn-indist-test.npz")  # the peer (d) over the same store, k = 1024: every key here
    assert (zp["target"] == r["target"]).all() and np.allclose(zp["nll_a"], r["nll"], atol=1e-5)
    assert (z["target"] == r["target"]).all()
    Hr = r["hidden"].astype(np.float64)
    rng = np.random.default_rng(0)
    for j in rng.choice(len(r["target"]), 100, replace=False):
        d, o, w = _dense_oracle(run, Hr[j] - mu.numpy())
        if d[k] - d[k - 1] >= 1e-3:
            np.testing.assert_allclose(z["q"][j, :-1], (w * (V[o[:k]] == r["target"][j])).sum(1), rtol=2e-3, atol=1e-5)
        before = np.flatnonzero((r["doc"] == r["doc"][j]) & (np.arange(len(Hr)) < j))  # dense_cache: the document's earlier states
        dc = ((Hr[before] - Hr[j]) ** 2).sum(1)
        oc = np.argsort(dc, kind="stable")[: k + 1]
        if not len(before):
            assert z["q"][j, -1] == 0 and z["rest"][j, -1] == 1
        elif len(oc) <= k or dc[oc[k]] - dc[oc[k - 1]] >= 1e-3:
            wc = np.exp(-(dc[oc[:k]] - dc[oc[0]]) / temp_c)
            assert z["q"][j, -1] == pytest.approx(
                (wc * (r["target"][before[oc[:k]]] == r["target"][j])).sum() / wc.sum(), rel=2e-3, abs=1e-5
            )
        dp = ((K - (r["hidden"][j].astype(np.float64) - mu.numpy())) ** 2).sum(1)  # the peer's 1024 at the same temperature
        o2 = np.argsort(dp, kind="stable")[: knnlm.K_NEIGHBOURS + 1]
        if dp[o2[-1]] - dp[o2[-2]] >= 1e-3:
            wp = np.exp(-(dp[o2[:-1]] - dp[o2[0]]) / run.temp)
            c = knnlm.FACTORS.index(run.info["temperature_factor"])
            assert zp["p_knn"][j, c] == pytest.approx((wp * (V[o2[:-1]] == r["target"][j])).sum() / wp.sum(), rel=2e-3, abs=1e-5)
    zc = np.load(run.tmp / "contcache-indist-test.npz")  # the continuous cache over the same states: brute force's
    assert (zc["target"] == r["target"]).all() and list(zc["factors"]) == list(knnlm.CACHE_FACTORS)
    same = np.diff(r["doc"]) == 0
    assert (np.diff(r["doc"]) >= 0).all() and (np.diff(r["pos"])[same] > 0).all()  # a document's rows in one run, in order
    H, temps_c, seen = r["hidden"].astype(np.float64), np.array(knnlm.CACHE_FACTORS) * run.scale, 0
    for j in np.random.default_rng(1).choice(len(H), 100, replace=False):
        before = np.flatnonzero((r["doc"] == r["doc"][j]) & (np.arange(len(H)) < j))
        if not len(before):
            assert (zc["q"][j] == 0).all()
            continue
        d = ((H[before] - H[j]) ** 2).sum(1)
        w = np.exp(-(d - d.min())[None] / temps_c[:, None])
        np.testing.assert_allclose(
            zc["q"][j], (w * (r["target"][before] == r["target"][j])).sum(1) / w.sum(1), rtol=1e-3, atol=1e-4
        )  # float16
        seen += zc["q"][j, -1] > 0
    assert seen > 20, seen


def test_dense_knn_cut_short_and_search_only_runs(dense_run, tmp_path):
    """A run cut short (TERAGRAM_KNN_PARTIAL) merges the chunks searched and the rest defer to
    the model; a search-only run (benchmarks/joint.py's prep) searches the missing chunk again,
    as it was, and writes nothing else. (On a copy of the estimates: the other tests read them whole.)"""
    from benchmarks import knnlm

    run, k = dense_run, dense_run.k
    est_knn = tmp_path / "est-knn"
    shutil.copytree(run.est_knn, est_knn)
    shards, _ = joint.open_train_estimates(est_knn, run.root / "idx", run.comps, 4)
    # dense_knn_broad, in memory (the files are rewritten); keys: every position but a shard's last
    q_all = np.concatenate([e.q[:-1, -2] for e in shards])
    top_all = np.concatenate([e.top[:-1, -2] for e in shards])
    cache_all = np.concatenate([e.q[:, -1] for e in shards])
    gone = sorted((est_knn / "searched").glob("*.npz"))[0]
    a, b = (int(x) for x in gone.name.split("-")[:2])
    gone.unlink()
    mp = pytest.MonkeyPatch()
    mp.setenv("TERAGRAM_KNN_PARTIAL", "1")
    held_z = {f: np.load(f) for f in sorted(run.tmp.glob("knnest-*.npz"))}
    args = (*run.args[:4], est_knn, *run.args[5:])
    part = knnlm.joint_estimates(*args, batch=8, eval_batch=8, k=k, centroids=4, nprobe=4, chunk=5000)
    mp.undo()
    assert part["unsearched"] == b - a and part["heldout_cached"] and "heldout_cached" not in run.info
    assert part["temperature_scale"] == run.scale and len(held_z) == 2
    for f, z0 in held_z.items():  # the held-out part reused, untouched
        assert all((np.load(f)[c] == z0[c]).all() for c in z0.files)
    cut, _ = joint.open_train_estimates(est_knn, run.root / "idx", run.comps, 4)
    q_cut = np.concatenate([e.q[:-1, -2] for e in cut])
    rest_cut = np.concatenate([e.rest[:-1, -2] for e in cut])
    np.testing.assert_array_equal(np.concatenate([e.q[:, -1] for e in cut]), cache_all)  # the cache: all
    assert q_all[a:b].max() > 0 and (q_cut[a:b] == 0).all() and (rest_cut[a:b] == 1).all()
    keep = np.ones(len(q_all), bool)
    keep[a:b] = False
    np.testing.assert_array_equal(q_cut[keep], q_all[keep])
    # search only (benchmarks/joint.py's prep, before the estimates exist): the missing chunk searched
    # again, as it was, and nothing written but it
    mp.setenv("TERAGRAM_KNN_SEARCH_ONLY", "1")
    only = knnlm.joint_estimates(
        run.model, run.root / "idx", run.held, tmp_path / "none", tmp_path / "only", run.tmp, "cpu",
        batch=8, eval_batch=8, k=k, centroids=4, nprobe=4, chunk=5000,
    )  # fmt: skip
    mp.undo()
    assert only["search_only"] and only["chunks_searched_now"] == len(list((est_knn / "searched").glob("*.npz"))) + 1
    assert [x.name for x in (tmp_path / "only").iterdir()] == ["searched"] and not (tmp_path / "none").exists()
    again = np.load(tmp_path / "only" / "searched" / gone.name)
    assert np.abs(again["q"][:, -1] - q_all[a:b]).max() < 1e-5 and (again["top"][:, -1] == top_all[a:b]).all()


@pytest.fixture(scope="module")
def dense_model(dense_run):
    """A joint model trained with the dense estimates as more components (m2), the held-out
    documents, their estimates given (e) and its token_eval with them (got); the store rebuilt
    from the keys model with the settings m2 keeps (src) and token_eval through it (via)."""
    from benchmarks import knnlm

    run, idx = dense_run, dense_run.idx
    train_tiny(run.root, "dense", max_steps=6, heldout=None, **joint_kw(run.root, joint_estimates=str(run.est_knn)))
    m2, _ = load_model(run.root / "dense")
    docs = heldout_docs(run.root / "held")
    e = joint.heldout_est(idx, docs, m2.cfg.joint, 4, dense=knnlm.load_est(run.tmp, "indist", "test", m2.cfg.joint))
    got = token_eval(m2, run.root / "held", idx.eos_id, idx.sep, "cpu", index=idx, estimates=e)
    src = knn.KnnSource(run.model, run.root / "idx", m2.cfg.joint_knn, m2.cfg.joint)
    via = token_eval(m2, run.root / "held", idx.eos_id, idx.sep, "cpu", index=idx, knn=src)
    return SimpleNamespace(m2=m2, docs=docs, e=e, got=got, src=src, via=via)


def test_a_model_trained_with_dense_knn_is_scored_with_the_estimates_given(dense_run, dense_model):
    """It is scored with the held-out estimates given, nothing else can supply them; over a
    store keyed by its own states (benchmarks/joint.py --own-store) its estimate is brute
    force's over every training position under it, at a temperature fit again against its LM."""
    from benchmarks import knnlm

    run, idx, k, V = dense_run, dense_run.idx, dense_run.k, dense_run.V
    m2, docs, e, got = dense_model.m2, dense_model.docs, dense_model.e, dense_model.got
    assert m2.cfg.joint == run.comps
    with pytest.raises(TeragramError, match="kNN datastore"):
        token_eval(m2, run.root / "held", idx.eos_id, idx.sep, "cpu", index=idx)
    z = np.load(run.tmp / "knnest-indist-test.npz")
    assert np.isfinite(got["nll"]).all() and len(got["nll"]) == len(z["q"])
    own = knnlm.own_store(
        m2, run.root / "idx", run.held, run.tmp / "own", "cpu",
        lambda name, h: joint.heldout_est(idx, docs, m2.cfg.joint, 4, dense=knnlm.load_est(run.tmp, name, h, m2.cfg.joint)),
        eval_batch=8,
    )  # fmt: skip
    k2, _, mu2 = knn.build(m2, run.root / "idx", "cpu", batch=8, key="ffn_in")
    K2 = k2.float().numpy().astype(np.float64)
    assert own["keys"] == len(run.K) and own["key"] == "ffn_in" and own["mu_abs_sum"] != pytest.approx(run.info["mu_abs_sum"], rel=1e-3)
    r2 = token_eval(m2, run.held["indist", "test"], idx.eos_id, idx.sep, "cpu", hidden="ffn_in", index=idx, estimates=e)
    Q = r2["hidden"].astype(np.float64) - mu2.numpy()
    D = (Q**2).sum(1)[:, None] + (K2**2).sum(1)[None] - 2 * Q @ K2.T  # every query's squared distance to every key
    lower_median = float(np.sort(D.min(1))[(len(D) - 1) // 2])  # torch.median's; valid and test: the same text here
    assert own["temperature_scale"] == pytest.approx(lower_median, rel=1e-3)
    z2 = np.load(run.tmp / "own" / "knnest-indist-test.npz")
    temps2 = own["temperature_factor"] * own["temperature_scale"] * np.array(knn.MULTIPLES)
    assert (z2["target"] == r2["target"]).all() and not np.allclose(z2["q"], z["q"], atol=1e-3)
    checked = 0
    for j in np.random.default_rng(2).choice(len(r2["target"]), 300, replace=False):  # many tie at the k-th distance (copies of a document)
        o = np.argsort(D[j], kind="stable")[: k + 1]
        d = D[j, o]
        if d[k] - d[k - 1] >= 1e-3:
            w = np.exp(-(d[:k] - d[0])[None] / temps2[:, None])
            want = (w * (V[o[:k]] == r2["target"][j])).sum(1) / w.sum(1)
            np.testing.assert_allclose(z2["q"][j, :-1], want, rtol=2e-3, atol=1e-5)
            checked += 1
    assert checked > 60, checked
    with pytest.raises(TeragramError, match="no live source"):
        joint.live(idx, docs[0][:5], idx.vocab_size, m2.cfg.joint, 4)
    with pytest.raises(TeragramError, match="go last"):
        joint.check_components(("dense_knn", "index_infgram"))
    with pytest.raises(ConfigError, match="no kNN store"):
        train_tiny(
            run.root,
            "dense-evals",
            max_steps=1,
            evals=("openbookqa",),
            **joint_kw(run.root, joint_estimates=str(run.est_knn), joint_components=run.comps),
        )
    with pytest.raises(ConfigError, match="no source"):
        train_tiny(run.root, "dense-bad", max_steps=1, **joint_kw(run.root, joint_estimates=str(run.est_knn)))


def test_the_dense_store_rebuilt_from_the_keys_model_gives_the_estimates(dense_run, dense_model):
    """Outside training (teragram eval/sample/serve --knn-keys): the store rebuilt from the keys
    model with the settings the checkpoint keeps gives the held-out estimates joint_estimates
    wrote, in bulk and live, and the live mixture equals the bulk one; settings of older
    estimates and another keys model are refused."""
    from teragram.model.gpt import GPT, GPTConfig

    from benchmarks import knnlm

    run, idx, model = dense_run, dense_run.idx, dense_run.model
    m2, docs, src, via = dense_model.m2, dense_model.docs, dense_model.src, dense_model.via
    z = np.load(run.tmp / "knnest-indist-test.npz")
    kept = dict(m2.cfg.joint_knn)
    assert kept["temperature_factor"] == run.info["temperature_factor"] and kept["key"] == "ffn_in"
    with pytest.raises(TeragramError, match="another keys model"):  # settings written before "key": final states, not these
        knn.KnnSource(model, run.root / "idx", [(f, v) for f, v in kept.items() if f != "key"], m2.cfg.joint)
    with pytest.raises(TeragramError, match="had dense_knn, dense_cache$"):  # settings written before the multiples: dense_knn only
        knn.KnnSource(model, run.root / "idx", [(f, v) for f, v in kept.items() if f != "temperature_multiples"], m2.cfg.joint)
    with pytest.raises(TeragramError, match="dense_cache; its kNN estimates had dense_knn, dense_knn_sharp, dense_knn_broad$"):
        knn.KnnSource(model, run.root / "idx", [(f, v) for f, v in kept.items() if f != "cache_temperature"], m2.cfg.joint)
    assert kept["cache_temperature"] == run.info["cache_temperature"]  # settings written before dense_cache: a gate reading it refused
    bulk = src.documents(docs, idx.eos_id)
    assert len(bulk) == len(z["q"]) and bulk.q.shape[1] == run.nd + 1 and np.abs(bulk.q - z["q"]).max() < 1e-4
    assert (bulk.top == z["top"]).mean() > 0.99 and (bulk.count == z["count"]).mean() > 0.99
    one = ("index_infgram", "dense_knn_broad")  # a gate reading one of them: its column, in bulk and from the saved files
    np.testing.assert_array_equal(knnlm.load_est(run.tmp, "indist", "test", one).q[:, 0], z["q"][:, 2])
    sharp = knn.KnnSource(model, run.root / "idx", m2.cfg.joint_knn, ("index_infgram", "dense_knn_sharp"))
    assert np.abs(sharp.documents(docs[:2], idx.eos_id).q[:, 0] - z["q"][: sum(len(x) + 1 for x in docs[:2]), 1]).max() < 1e-4
    np.testing.assert_allclose(via["nll"], dense_model.got["nll"], atol=1e-3)
    assert_live_is_bulk(m2, idx, docs, via, (0, 2), 30, knn=src)
    w = np.concatenate([[idx.eos_id], docs[1][:40]]).astype(np.int64)  # live's cached window state is the window's own,
    for n in (5, 6, 9, 9, 7, 12, 3):  # growing by one and by several, asked again, cut back (a rejected draft)
        torch.testing.assert_close(src._last_state(w[:n]), src._hidden([w[:n]], 1)[-1:], atol=1e-5, rtol=1e-5)
    g = generate(m2, idx, [int(i) for i in docs[0][:5]], max_new_tokens=4, knn=src)
    assert len(g.new_ids) == 4
    torch.manual_seed(1)
    other = GPT(GPTConfig.preset("tiny", vocab_size=idx.vocab_size, block_size=64, use_index=False, mixture=False)).eval()
    with pytest.raises(TeragramError, match="another keys model"):
        knn.KnnSource(other, run.root / "idx", m2.cfg.joint_knn, m2.cfg.joint)
    with pytest.raises(TeragramError, match="reads no kNN estimate"):
        knn.source_for(other, "x", run.root / "idx")  # a model that reads none


def test_eval_evals_sample_and_serve_with_the_dense_store(dense_run, dense_model, tmp_path, capsys):
    """The CLI: eval with the store gives token_eval's mixture, without it a one-line refusal;
    sample runs; evals: each candidate's mixture is token_eval's with the store, without it one
    line before any work; serve: refused at start without the store, with it /v1/score's gated
    logprobs are token_eval's."""
    from fastapi.testclient import TestClient
    from teragram.model.evaluation.tasks import candidates, joint_estimates, load_task, model_outputs, run_task
    from teragram.serve.app import ServeConfig, create_app
    from teragram.serve.main import main

    from tests.model.helpers import accuracy_by_hand, completion_rows, token_eval_of

    joint_root, idx = dense_run.root, dense_run.idx
    m2, docs, src, via = dense_model.m2, dense_model.docs, dense_model.src, dense_model.via
    ev = ["eval", "--checkpoint", str(joint_root / "dense"), "--index", str(joint_root / "idx"), "--corpus", str(joint_root / "held-text")]
    assert main([*ev, "--knn-keys", str(joint_root / "keys"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["perplexity"] == pytest.approx(float(np.exp(via["nll"].mean())), rel=1e-3)
    assert main(ev) == 2 and "--knn-keys" in capsys.readouterr().err
    sa = ["sample", "--checkpoint", str(joint_root / "dense"), "--index", str(joint_root / "idx"), "The", "--max-tokens", "3"]
    assert main([*sa, "--knn-keys", str(joint_root / "keys")]) == 0 and capsys.readouterr().out.startswith("The")
    assert main(sa) == 2 and "no live source" in capsys.readouterr().err
    es = ["evals", "--checkpoint", str(joint_root / "dense"), "--index", str(joint_root / "idx"), "--tasks", "openbookqa"]
    es += ["--limit", "3", "--quiet"]
    assert main([*es, "--knn-keys", str(joint_root / "keys"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == [run_task(m2, idx, "openbookqa", limit=3, knn=src)]
    examples = load_task("openbookqa", 3)
    want = [
        completion_rows(token_eval_of(m2, idx, d, tmp_path / f"cand{j}", knn=src), n, len(d))
        for j, (d, n) in enumerate(candidates(examples, idx.tokenize))
    ]  # fmt: skip
    cands = candidates(examples, idx.tokenize)
    outs = model_outputs(m2, cands, idx.eos_id, est=joint_estimates(m2, idx, cands, knn=src))
    assert all(len(d) <= m2.cfg.block_size for d, _ in cands)  # one window: the scorer's is token_eval's
    for o, w in zip(outs, want, strict=True):
        np.testing.assert_allclose(o["nll_joint"], w["nll"], atol=1e-4)
    acc, acc_norm = accuracy_by_hand(examples, [w["nll"] for w in want])
    assert (rows[0]["joint"]["acc"], rows[0]["joint"]["acc_norm"]) == (acc, acc_norm)
    assert main(es) == 2 and "give --knn-keys" in capsys.readouterr().err
    assert main([*es, "--model-only"]) == 0  # the model alone needs no store
    with pytest.raises(TeragramError, match="give --knn-keys"):
        create_app(ServeConfig(index=str(joint_root / "idx"), checkpoint=str(joint_root / "dense")))
    app = create_app(ServeConfig(index=str(joint_root / "idx"), checkpoint=str(joint_root / "dense"), knn_keys=str(joint_root / "keys")))
    n = 40
    out = TestClient(app).post("/v1/score", json={"ids": [int(i) for i in docs[0][:n]]}).json()
    np.testing.assert_allclose(-np.array(out["logprobs_with_gate"]), via["nll"][np.nonzero(via["doc"] == 0)[0][:n]], atol=1e-3)
