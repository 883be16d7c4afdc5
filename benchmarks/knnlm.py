"""kNN-LM with every training position in the datastore: the fair dense peer of issue #15.

Khandelwal et al. (2020) store a key (a hidden state of the model: theirs, the last block's
feed-forward input after its layer norm) and a value (the next token) for every training token,
look the current context's key up among them, and mix the neighbours' distribution,
softmax(-squared distance / temperature), with the model's:

    p(y) = (1 - λ) p_model(y) + λ p_knn(y).

Here the model is the joint benchmark's plain 125M (a) and the datastore holds all ~47M
training positions (non-overlapping windows of the block size, the way held-out text is read,
so every target appears once). `run` keys it by the final hidden states; `joint_estimates`
by the states choose_key finds best on validation (model/mixture/knn.KEY_STATES). The keys, fp16, live in GPU memory (~72 GB on the H200); the
store and its search are model/mixture/knn.py's (the library's: a joint model that reads the estimate is
served with it). The search is the paper's: an inverted file (k-means centroids, each query probing the nearest
few lists, as FAISS's IVF), with exact float32 distances to the probed keys (the paper recomputed
full-precision distances; no product quantisation here), k = 1024 neighbours. Its recall against
exact brute-force search is measured on a sample of queries and reported.

On the GPU, `run` writes, per held-out half, p_knn(target) of every target for a grid of
temperatures (multiples of the median nearest distance of a sample of validation queries), the
nearest distance (in that scale) and (a)'s nll; `fit` picks the temperature and λ on validation,
here, and the test halves are only reported (benchmarks/joint.py). experiments/gate_headroom.py
also gives the post-hoc gate p_knn as one more estimate.

`joint_estimates` makes the same kNN estimate components of the joint gate (model/mixture/joint.py's
DENSE: dense_knn at the temperature fit on validation, dense_knn_sharp and dense_knn_broad at
multiples of it): for held-out text as above, and for every training position in exclude-doc mode
(the keys of the position's own document, its own key among them, masked inside the search), so
that a model trained with it sees what held-out text sees; and dense_cache, the continuous cache:
the same estimate over the keys of the position's own document before it (model/mixture/knn.doc_neighbours;
its temperature fit on the same validation half, in the same units), for training positions and
held-out text alike (a document's earlier text is what both read). Its held-out pass also writes the
continuous cache over the same states (OUT/contcache-SET-HALF.npz, model/mixture/cont_cache.target_probs)
for experiments/cont_cache.py.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from teragram.model.mixture.cont_cache import target_probs
from teragram.model.mixture.knn import (
    CENTROIDS,
    K_JOINT,
    KEY_STATES,
    MULTIPLES,
    NPROBE,
    QUERY_CHUNK,
    SEED,
    Datastore,
    as_est,
    build,
    cache_columns,
    doc_neighbours,
    estimate_columns,
    knn_target_probs,
    queries,
)

K_NEIGHBOURS = 1024  # the paper's k
VALID_ROWS = 20_000  # validation queries per set that set the temperature scale (a fixed random sample)
RECALL_ROWS = 1_000  # queries whose IVF neighbours are checked against exact search
FACTORS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)  # temperatures, x the median nearest distance
TRAIN_CHUNK = 1 << 21  # training positions searched at once
SELECT_EVERY = 3  # the key choice's stores hold the positions of every 3rd training window
CACHE_FACTORS = (0.05, 0.1, 0.2, 0.5, 1.0)  # the continuous cache's temperatures, x the same scale
CACHE_FIT = (*FACTORS, 50.0, 100.0)  # dense_cache's temperature grid, x the same scale (a document's neighbours share more)


def run(
    model,
    index_dir: Path,
    held: dict,
    out: Path,
    device: str,
    *,
    batch: int = 64,
    eval_batch: int = 16,
    centroids: int = CENTROIDS,
    nprobe: int = NPROBE,
    k: int = K_NEIGHBOURS,
) -> dict:
    """On the GPU: the datastore, then every held-out half's p_knn(target) per temperature with
    the nearest distance and (a)'s nll, saved as OUT/knn-SET-HALF.npz."""
    import torch
    from teragram.index.engine import Index
    from teragram.model.evaluation.perplexity import token_eval

    info: dict = {}
    t = time.time()
    keys, vals, mu = build(model, index_dir, device, batch)
    info |= {"keys": len(keys), "keys_s": time.time() - t}
    t = time.time()
    ds = Datastore(keys, vals, centroids=centroids)
    info |= {"ivf_s": time.time() - t, "centroids": len(ds.cent), "nprobe": nprobe, "k": k}
    idx = Index(index_dir)
    rng = np.random.default_rng(SEED)
    evals, nearest = {}, []
    for (name, h), feats in sorted(held.items(), key=lambda kv: kv[0][1] != "valid"):  # validation first: it sets the scale
        t = time.time()
        r = evals[name, h] = token_eval(model, feats, idx.eos_id, idx.sep, device, batch=eval_batch, hidden=True)
        info[f"eval_{name}_{h}_s"] = time.time() - t
        if h != "valid":
            continue
        t = time.time()
        rows = np.sort(rng.choice(len(r["target"]), min(VALID_ROWS, len(r["target"])), replace=False))
        q = queries(r["hidden"], rows, mu, device)
        d, i = ds.search(q, k, nprobe)
        nearest.append(d[:, 0])
        info[f"scale_search_{name}_s"] = time.time() - t
        if name == "indist":  # recall against exact search, on a sample
            info |= _recall(ds, q[:RECALL_ROWS], k, nprobe)
    scale = float(torch.cat(nearest).median())
    info |= {"temperature_scale": scale, "factors": list(FACTORS)}
    for (name, h), r in evals.items():
        t = time.time()
        _peer_half(ds, r, mu, scale, out / f"knn-{name}-{h}.npz", device, k, nprobe)
        info[f"search_{name}_{h}_s"] = time.time() - t
    (out / "knn_gpu.json").write_text(json.dumps(info, indent=1))
    return info


def _peer_half(ds, r: dict, mu, scale: float, path: Path, device: str, k: int, nprobe: int) -> None:
    """The peer's file of one held-out half (token_eval's `r` with the keys' states): p_knn(target)
    per temperature (FACTORS x scale), the nearest distance (in scale) and the model's nll. Every
    target, in chunks (the neighbours of all would not fit)."""
    import torch

    ps, near = [], []
    for a in range(0, len(r["target"]), QUERY_CHUNK):
        d, nb = ds.neighbours(queries(r["hidden"], slice(a, a + QUERY_CHUNK), mu, device), k, nprobe)
        tgt = torch.from_numpy(r["target"][a : a + QUERY_CHUNK].astype(np.int64)).to(device)
        ps.append(knn_target_probs(d, nb, tgt, [f * scale for f in FACTORS]).cpu().numpy())
        near.append((d[:, 0] / scale).cpu().numpy())
    np.savez_compressed(
        path,
        p_knn=np.concatenate(ps).astype(np.float32),
        nearest=np.concatenate(near).astype(np.float32),
        nll_a=r["nll"].astype(np.float32),
        target=r["target"].astype(np.int32),
    )


def _recall(ds, q, k: int, nprobe: int) -> dict:
    """The inverted file's neighbours of queries q against exact search's."""
    import torch

    d, i = ds.search(q, k, nprobe)
    ed, ei = ds.exact(q, k)
    inter = [len(np.intersect1d(a, b)) for a, b in zip(i.cpu().numpy(), ei.cpu().numpy())]
    return {"recall_at_k": float(np.mean(inter)) / k, "nearest_exact_share": float(torch.eq(i[:, 0], ei[:, 0]).float().mean())}


# ---- the kNN estimate as a component of the joint gate (model/mixture/joint.py's dense_knn) ----------


def load_est(out: Path, name: str, half: str, components):
    """A held-out half's kNN estimates saved by joint_estimates, as an Est of the dense
    components among `components` (a model's, in its order)."""
    from teragram.model.mixture.joint import DENSE

    z = np.load(Path(out) / f"knnest-{name}-{half}.npz")
    e = as_est({f: z[f] for f in ("q", "rest", "count", "share", "top")})
    want = [DENSE.index(c) for c in components if c in DENSE]
    if max(want, default=-1) >= e.q.shape[1]:
        raise SystemExit(f"{out}: its kNN estimates hold {', '.join(DENSE[: e.q.shape[1]])}; the model reads {', '.join(components)}")
    return e.rows(0, len(e), want)


def key_documents(index_dir: Path, T: int) -> list[tuple[int, int, np.ndarray]]:
    """Per shard, in build's order: (shard, first key, document number of each key). A key is a
    position t of the stream predicting t + 1 (every t < n - 1 of a shard that holds a window);
    its document is the target's: a separator starts the next one."""
    from teragram.index import format as fmt

    m = fmt.read_json(Path(index_dir) / "manifest.json")
    out, n_keys, n_docs = [], 0, 0
    for s in m["shards"]:
        tok = np.asarray(fmt.open_array(fmt.shard_dir(Path(index_dir), s["shard"], s.get("dir")) / "tokens.bin", "tokens"))
        doc = np.zeros(0, np.int64)
        if len(tok) >= T + 1:  # build skips a stream shorter than one window
            doc = n_docs + np.cumsum(tok[:-1] == m["separator"])
            n_docs = int(doc[-1]) + 1
        out.append((s["shard"], n_keys, doc))
        n_keys += len(doc)
    return out


def _heldout(
    model, ds, mu, held: dict, idx, out: Path, device: str, eval_batch: int, k: int, nprobe: int, info: dict, key: str, peer: bool,
    evaluate=None,
):  # fmt: skip
    """joint_estimates' held-out part: every held-out target's kNN estimate (OUT/knnest-SET-HALF.npz),
    the temperature fit on the in-distribution validation half first; with `peer`, the same store's
    kNN-LM peer (d) too, k = 1024 (OUT/knn-SET-HALF.npz and knn_gpu.json, as `run` writes them).
    evaluate(set, half, feats): the model's token_eval there (its nll, the one the temperature is
    fit against, and its key states); default: the plain model's. Returns (temperature, scale)."""
    import torch
    from teragram.model.evaluation.perplexity import token_eval

    if evaluate is None:

        def evaluate(name, h, feats):
            return token_eval(model, feats, idx.eos_id, idx.sep, device, batch=eval_batch, hidden=key)

    found, gpu = {}, {f: info[f] for f in ("keys", "keys_s", "centroids", "nprobe")} | {"k": K_NEIGHBOURS, "key": key}
    for (name, h), feats in sorted(held.items(), key=lambda kv: kv[0] != ("indist", "valid")):  # it sets the temperature
        t = time.time()
        r = evaluate(name, h, feats)
        d, nb = _search_all(ds, r["hidden"], mu, device, k, nprobe)
        tgt = torch.from_numpy(r["target"].astype(np.int64)).to(device)
        tc = time.time()  # dense_cache: the k nearest of the document's own earlier states
        dc, nbc = doc_neighbours(torch.from_numpy(np.asarray(r["hidden"], np.float32)).to(device), r["doc"], tgt, k)
        info[f"heldout_{name}_{h}_doc_neighbours_s"] = time.time() - tc
        found[name, h] = (d, nb, dc, nbc, tgt, r["target"].astype(np.int32))
        info[f"heldout_{name}_{h}_s"] = time.time() - t
        if (name, h) == ("indist", "valid"):  # the scale and temperatures, here only
            scale, j, lam, _ = _fit_temperature(d, nb, tgt, r["nll"].astype(np.float64))
            temp = FACTORS[j] * scale
            info |= {"temperature_scale": scale, "temperature_factor": FACTORS[j], "lambda_at_fit": lam}
            jc, lam_c = fit(r["nll"].astype(np.float64), knn_target_probs(dc, nbc, tgt, [f * scale for f in CACHE_FIT]).cpu().numpy())
            info |= {"cache_factor": CACHE_FIT[jc], "cache_temperature": CACHE_FIT[jc] * scale, "cache_lambda_at_fit": lam_c}
            s = slice(0, min(VALID_ROWS, len(r["target"])))  # k against the peer's 1024, on the first targets
            d2, nb2 = ds.neighbours(queries(r["hidden"], s, mu, device), K_NEIGHBOURS, nprobe)
            big = knn_target_probs(d2, nb2, tgt[s], [temp])[:, 0]
            small = knn_target_probs(d2[:, :k], nb2[:, :k], tgt[s], [temp])[:, 0]
            diff = (big - small).abs()
            info |= {"k_vs_1024_max_abs": float(diff.max()), "k_vs_1024_mean_abs": float(diff.mean())}
            if peer:
                gpu |= {"temperature_scale": scale, "factors": list(FACTORS)}
                gpu |= _recall(ds, queries(r["hidden"], slice(0, RECALL_ROWS), mu, device), K_NEIGHBOURS, nprobe)
        t = time.time()  # the continuous cache over the same states, beside them (experiments/cont_cache.py reads it)
        q = target_probs(r["hidden"], r["target"], r["doc"], [f * scale for f in CACHE_FACTORS], device, window=len(r["target"])).astype(
            np.float32
        )  # every earlier state, as measured
        q = q.astype(np.float16)  # half the bytes to bring back; a mixture's nll moves by < 1e-3
        np.savez_compressed(out / f"contcache-{name}-{h}.npz", target=r["target"].astype(np.int32), q=q, factors=CACHE_FACTORS)
        info[f"heldout_{name}_{h}_cache_s"] = time.time() - t
        if peer:  # the scale is the in-distribution validation's (the grid; each set fits its own on validation)
            t = time.time()
            _peer_half(ds, r, mu, scale, out / f"knn-{name}-{h}.npz", device, K_NEIGHBOURS, nprobe)
            gpu[f"search_{name}_{h}_s"] = time.time() - t
        del r
    if peer:
        (out / "knn_gpu.json").write_text(json.dumps(gpu, indent=1))
    for (name, h), (d, nb, dc, nbc, tgt, target) in found.items():
        c = estimate_columns(d, nb, tgt, [temp * m for m in MULTIPLES], scale)
        cc = estimate_columns(dc, nbc, tgt, [info["cache_temperature"]], scale)
        info[f"heldout_{name}_{h}_mean_q"] = float(c["q"][:, 0].mean())
        info[f"heldout_{name}_{h}_cache_mean_q"] = float(cc["q"][:, 0].mean())
        np.savez_compressed(out / f"knnest-{name}-{h}.npz", target=target, **{f: np.concatenate([c[f], cc[f]], 1) for f in c})
    del found
    return temp, scale


def own_store(model, index_dir: Path, held: dict, out: Path, device: str, estimates, *, eval_batch: int = 16) -> dict:
    """On the GPU: a jointly trained model's dense components over a store keyed by its own states
    instead of those of the keys model it was trained with (one model at inference; the store
    follows the LM it serves). Every held-out target's kNN estimate (OUT/knnest-SET-HALF.npz, as
    joint_estimates writes them), with the store settings the model keeps (model/mixture/knn.SETTINGS:
    key, k, lists, lists probed), the scale and temperature fit again on the in-distribution
    validation half, against its LM alone as the keys model's were against that model.
    estimates(set, half): the joint estimates to evaluate it with there (only its LM's nll and
    key states are read). Returns the store's info, as joint_estimates'."""
    from teragram.index.engine import Index
    from teragram.model.evaluation.perplexity import token_eval
    from teragram.model.mixture.knn import OPTIONAL

    if ("indist", "valid") not in held:
        raise SystemExit("own_store fits the temperature on the in-distribution validation half: give it (held['indist', 'valid'])")
    st = OPTIONAL | dict(model.cfg.joint_knn)
    if tuple(st["temperature_multiples"]) != tuple(MULTIPLES):
        raise SystemExit(f"the model's dense components are at {st['temperature_multiples']} x the temperature; this store's {MULTIPLES}")
    idx, key, k, nprobe = Index(index_dir), st["key"], st["k"], st["nprobe"]
    info: dict = {"k": k, "nprobe": nprobe, "build_batch": st["build_batch"], "key": key, "temperature_multiples": list(MULTIPLES)}
    t = time.time()
    keys, vals, mu = build(model, index_dir, device, st["build_batch"], key)
    info |= {"keys": len(keys), "keys_s": time.time() - t, "mu_abs_sum": float(mu.double().abs().sum())}
    t = time.time()
    ds = Datastore(keys, vals, centroids=st["centroids"])
    info |= {"ivf_s": time.time() - t, "centroids": len(ds.cent)}

    def evaluate(name, h, feats):  # the joint model needs its estimates to run; its LM alone sets the temperature
        r = token_eval(model, feats, idx.eos_id, idx.sep, device, batch=eval_batch, hidden=key, index=idx, estimates=estimates(name, h))
        return r | {"nll": r["nll_model"]}

    out.mkdir(parents=True, exist_ok=True)
    _heldout(model, ds, mu, held, idx, out, device, eval_batch, k, nprobe, info, key, False, evaluate=evaluate)
    (out / "knn_est.json").write_text(json.dumps(info, indent=1))
    return info


def _search_all(ds, hidden: np.ndarray, mu, device: str, k: int, nprobe: int):
    """The neighbours (squared distances, values) of every held-out state (token_eval's hidden), in
    chunks of queries."""
    import torch

    parts = [ds.neighbours(queries(hidden, slice(a, a + QUERY_CHUNK), mu, device), k, nprobe) for a in range(0, len(hidden), QUERY_CHUNK)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _fit_temperature(d, nb, tgt, nll: np.ndarray) -> tuple[float, int, float, float]:
    """The scale (the median nearest distance), and fit's temperature column (FACTORS x the scale)
    and λ for the model's nll, with that fit's validation loss."""
    from teragram.model.mixture.baselines import mix_nll

    scale = float(d[:, 0].median())
    p = knn_target_probs(d, nb, tgt, [f * scale for f in FACTORS]).cpu().numpy()
    j, lam = fit(nll, p)
    return scale, j, lam, float(mix_nll(nll, p[:, j], lam).mean())


def choose_key(model, index_dir: Path, feats, idx, device: str, *, batch: int, eval_batch: int, k: int, centroids: int, nprobe: int,
               every: int = SELECT_EVERY) -> tuple[str, dict]:  # fmt: skip
    """The keys (model/mixture/knn.KEY_STATES) whose kNN-LM does best on the in-distribution validation
    half `feats`: per kind, a store of the positions of every every-th training window, its
    temperature (FACTORS x the median nearest distance) and λ fit there (fit), and that fit's
    loss; the lowest wins. Returns it with each kind's figures."""
    import torch
    from teragram.model.evaluation.perplexity import token_eval

    res = {}
    for key in KEY_STATES:
        t = time.time()
        keys, vals, mu = build(model, index_dir, device, batch, key, every)
        ds = Datastore(keys, vals, centroids=centroids)
        r = token_eval(model, feats, idx.eos_id, idx.sep, device, batch=eval_batch, hidden=key)
        tgt = torch.from_numpy(r["target"].astype(np.int64)).to(device)
        d, nb = _search_all(ds, r["hidden"], mu, device, k, nprobe)
        nll = r["nll"].astype(np.float64)
        _, j, lam, loss = _fit_temperature(d, nb, tgt, nll)
        res[key] = {
            "valid_nll": loss,
            "model_nll": float(nll.mean()),
            "temperature_factor": FACTORS[j],
            "lambda": lam,
            "keys": len(keys),
            "targets": len(tgt),
            "s": time.time() - t,
        }
        del keys, vals, ds, d, nb, r
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return min(res, key=lambda x: res[x]["valid_nll"]), res


@contextmanager
def _profiled(path: Path, first: bool):
    """With TERAGRAM_KNN_PROFILE set, the first search of a call under torch.profiler: its operators'
    GPU and CPU times, written to `path` (where a faster search should start). The profiler slows
    that chunk about 5x (141 s against 27 s on the H200: experiments/results/knn_search_profile.txt)."""
    if not (first and os.environ.get("TERAGRAM_KNN_PROFILE")):
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    t = time.time()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=30)
    path.write_text(f"one chunk's search under the profiler: {time.time() - t:.1f} s\n{table}\n")


def joint_estimates(
    model, index_dir: Path, held: dict, est_dir: Path, out_dir: Path, out: Path, device: str,
    *, batch: int = 64, eval_batch: int = 16, k: int = K_JOINT, centroids: int = CENTROIDS, nprobe: int = NPROBE,
    chunk: int = TRAIN_CHUNK, key: str = "auto", peer: bool = False,
) -> dict:  # fmt: skip
    """On the GPU: the kNN estimate of every held-out target (OUT/knnest-SET-HALF.npz) and of every
    training position in exclude-doc mode, appended to the joint estimates in est_dir as the
    components joint.DENSE (written to out_dir). The datastore is build's (every training position
    under `model`); the temperature, one for all text as training needs, is fit on the
    in-distribution validation half (fit's λ-interpolation loss, as the peer), in units of the
    median nearest distance there: dense_knn's, the other components' its MULTIPLES. The keys are
    `key`'s states (model/mixture/knn.KEY_STATES; "auto": the one choose_key finds best on that half).
    With `peer`, the held-out part also writes the peer (d) over the same store (`_heldout`). A call cut short resumes: its chunks are kept in
    out_dir/searched and the held-out part, with the key chosen, in OUT (knnest-heldout.json). With TERAGRAM_KNN_SEARCH_ONLY set it returns
    once the training positions are searched, writing nothing to out_dir but those chunks; with
    TERAGRAM_KNN_PARTIAL it searches nothing more and merges what is searched."""
    import torch
    from teragram.index import format as fmt
    from teragram.index.engine import Index
    from teragram.model.mixture import joint

    if ("indist", "valid") not in held:
        raise SystemExit("joint_estimates fits the temperature on the in-distribution validation half: give it (held['indist', 'valid'])")
    info: dict = {"k": k, "nprobe": nprobe, "build_batch": batch}
    cache = out / "knnest-heldout.json"  # a later call (the search resumed) reuses the held-out part
    prior = json.loads(cache.read_text()) if cache.exists() else None
    if not (prior and all((out / f"knnest-{n}-{h}.npz").exists() for n, h in held)):
        prior = None
    if key == "auto" and prior:
        key = prior["sig"].get("key", "final")
    elif key == "auto":
        t = time.time()
        key, choice = choose_key(
            model, index_dir, held["indist", "valid"], Index(index_dir), device,
            batch=batch, eval_batch=eval_batch, k=k, centroids=centroids, nprobe=nprobe,
        )  # fmt: skip
        info |= {"key_choice": choice, "key_choice_s": time.time() - t}
    info |= {"key": key, "temperature_multiples": list(MULTIPLES)}
    t = time.time()
    keys, vals, mu = build(model, index_dir, device, batch, key)
    docs = key_documents(index_dir, model.cfg.block_size)
    kdoc_np = np.concatenate([d for *_, d in docs])  # each key's document (dense_cache reads it too)
    kdoc = torch.from_numpy(kdoc_np).to(device)
    if len(kdoc) != len(keys):
        raise SystemExit(f"{len(keys):,} keys, {len(kdoc):,} training positions: the datastore and the stream disagree")
    info |= {"keys": len(keys), "keys_s": time.time() - t}
    t = time.time()
    ds = Datastore(keys, vals, centroids=centroids)
    info |= {"ivf_s": time.time() - t, "centroids": len(ds.cent)}
    sig = {"k": k, "nprobe": nprobe, "centroids": len(ds.cent), "keys": len(keys), "key": key, "multiples": list(MULTIPLES)}
    sig["dense_cache"] = True  # held-out estimates of before it hold no dense_cache column
    sig["mu_abs_sum"] = info["mu_abs_sum"] = float(mu.double().abs().sum())  # the keys' fingerprint: KnnSource checks by it
    if prior:
        same = all(prior["sig"].get(f, {"key": "final", "multiples": [1.0]}.get(f)) == v for f, v in sig.items() if f != "mu_abs_sum")
        if not same or abs(prior["sig"]["mu_abs_sum"] - sig["mu_abs_sum"]) > 1e-4 * sig["mu_abs_sum"]:
            raise SystemExit(f"{cache}: the held-out kNN estimates there are another datastore's ({prior['sig']} vs {sig}): remove them")
        temp, scale = prior["temperature"], prior["info"]["temperature_scale"]
        info |= prior["info"] | {"heldout_cached": True}
    else:
        temp, scale = _heldout(model, ds, mu, held, Index(index_dir), out, device, eval_batch, k, nprobe, info, key, peer)
        cache.write_text(
            json.dumps({"sig": sig, "temperature": temp, "info": {f: v for f, v in info.items() if f not in ("keys_s", "ivf_s")}})
        )
    t = time.time()
    cols = {f: [] for f in ("q", "rest", "count", "share", "top")}
    done = Path(out_dir) / "searched"  # each chunk's columns once searched: a call cut short resumes here
    done.mkdir(parents=True, exist_ok=True)
    spans = [(a, min(a + chunk, len(keys))) for a in range(0, len(keys), chunk)]
    temps, M = [temp * m for m in MULTIPLES], len(MULTIPLES)
    file = {(a, b): done / f"{a:012d}-{b:012d}-{key}-{'-'.join(f'{t:.6g}' for t in temps)}.npz" for a, b in spans}
    partial = bool(os.environ.get("TERAGRAM_KNN_PARTIAL"))  # merge what is searched; the rest defer to the model
    for j in [] if partial else np.random.default_rng(SEED).permutation(len(spans)):  # random order: a cut is a sample
        a, b = spans[j]
        if not file[a, b].exists():
            with _profiled(out / "knn_search_profile.txt", "chunks_searched_now" not in info):
                d, nb = ds.neighbours(keys[a:b].float(), k, nprobe, qdoc=kdoc[a:b], kdoc=kdoc)
            np.savez(done / "part.npz", **estimate_columns(d, nb, vals[a:b].long(), temps, scale))
            (done / "part.npz").rename(file[a, b])
            del d, nb
            info["chunks_searched_now"] = info.get("chunks_searched_now", 0) + 1
    if os.environ.get("TERAGRAM_KNN_SEARCH_ONLY"):  # e.g. beside benchmarks/joint.py's prep, before est_dir is written
        return info | {"search_only": True, "search_s": time.time() - t}
    for a, b in spans:
        if file[a, b].exists():
            z = np.load(file[a, b])
            z = {f: z[f] for f in cols}
        else:
            e0 = joint.empty(b - a, M)
            z = {f: getattr(e0, f) for f in cols}
            info["unsearched"] = info.get("unsearched", 0) + b - a
        for f in cols:
            cols[f].append(z[f])
    cols = {f: np.concatenate(v) for f, v in cols.items()}
    info["train_search_s"] = time.time() - t
    info["train_mean_q"] = float(cols["q"][:, 0].mean())  # beside the held-out's (unsearched positions count 0)
    t = time.time()  # dense_cache: every training position's own document's earlier keys (the held-out's, as the model reads them)
    cc = cache_columns(keys, kdoc_np, vals.long(), vals.long(), k, info["cache_temperature"], info["temperature_scale"])
    cols = {f: np.concatenate([cols[f], cc[f]], 1) for f in cols}
    M += 1
    info["train_cache_s"], info["train_cache_mean_q"] = time.time() - t, float(cc["q"][:, 0].mean())
    t = time.time()
    est_dir, out_dir = Path(est_dir), Path(out_dir)
    m = fmt.read_json(est_dir / "manifest.json")
    if any(c in joint.DENSE for c in m["components"]):
        raise SystemExit(f"{est_dir}: these estimates already hold {', '.join(joint.DENSE)}")
    for shard, first, doc in docs:
        e = joint.Est(*(np.load(est_dir / f"{shard:06d}" / f"{f}.npy") for f in joint.Est.__dataclass_fields__))
        n = len(e)
        if len(doc) not in (0, n - 1):
            raise SystemExit(f"shard {shard}: {len(doc):,} keys for {n:,} positions")
        rows = joint.empty(n, M)  # the last position (and a shard without keys) defers to the model
        if len(doc):
            rows = joint.Est.combine([as_est({f: v[first : first + n - 1] for f, v in cols.items()}), joint.empty(1, M)])
        merged = joint.with_columns(e, rows)
        d = out_dir / f"{shard:06d}"
        d.mkdir(parents=True, exist_ok=True)
        for f in joint.Est.__dataclass_fields__:
            np.save(d / f"{f}.npy", getattr(merged, f))
        fmt.write_json(out_dir / f"{shard:06d}.done", {"shard": shard, "positions": n})
    info["write_s"] = time.time() - t
    fmt.write_json(out_dir / "manifest.json", m | {"components": [*m["components"], *joint.DENSE], "dense_knn": info})
    (out / "knn_est.json").write_text(json.dumps(info, indent=1))
    return info


def fit(nll_a: np.ndarray, p_knn: np.ndarray) -> tuple[int, float]:
    """(temperature column, λ) with the lowest validation loss (λ from baselines.LAMBDAS)."""
    from teragram.model.mixture.baselines import LAMBDAS, mix_nll

    best = None
    for j in range(p_knn.shape[1]):
        for lam in LAMBDAS:
            loss = float(mix_nll(nll_a, p_knn[:, j], lam).mean())
            if best is None or loss < best[0]:
                best = (loss, j, float(lam))
    return best[1], best[2]
