"""kNN-LM with every training position in the datastore: the fair dense peer of issue #15.

Khandelwal et al. (2020) store a key (the model's final hidden state) and a value (the next
token) for every training token, look the current hidden state up among them, and mix the
neighbours' distribution, softmax(-squared distance / temperature), with the model's:

    p(y) = (1 - λ) p_model(y) + λ p_knn(y).

Here the model is the joint benchmark's plain 125M (a) and the datastore holds all ~47M
training positions (non-overlapping windows of the block size, the way held-out text is read,
so every target appears once). The keys, fp16, live in GPU memory (~72 GB on the H200). The
search is the paper's: an inverted file (k-means centroids, each query probing the nearest
few lists, as FAISS's IVF), with exact float32 distances to the probed keys (the paper recomputed
full-precision distances; no product quantisation here), k = 1024 neighbours. Its recall against
exact brute-force search is measured on a sample of queries and reported.

On the GPU, `run` writes, per held-out half, p_knn(target) of every target for a grid of
temperatures (multiples of the median nearest distance of a sample of validation queries), the
nearest distance (in that scale) and (a)'s nll; `fit` picks the temperature and λ on validation,
here, and the test halves are only reported (benchmarks/joint.py). benchmarks/gate_headroom.py
also gives the post-hoc gate p_knn as one more estimate.

`joint_estimates` makes the same kNN estimate a component of the joint gate (model/joint.py's
dense_knn): for held-out text as above, and for every training position in exclude-doc mode
(the keys of the position's own document, its own key among them, masked inside the search), so
that a model trained with it sees what held-out text sees.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

K_NEIGHBOURS = 1024  # the paper's k
CENTROIDS = 4096  # the paper's inverted lists
NPROBE = 32  # lists probed per query (the paper's 32)
KMEANS_SAMPLE = 1_000_000  # keys the centroids are fit on
KMEANS_ITERS = 20
VALID_ROWS = 20_000  # validation queries per set that set the temperature scale (a fixed random sample)
QUERY_CHUNK = 131_072  # queries searched at once (their 1024 neighbours each stay in GPU memory)
RECALL_ROWS = 1_000  # queries whose IVF neighbours are checked against exact search
FACTORS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)  # temperatures, x the median nearest distance
SEED = 20261201
K_JOINT = 64  # neighbours of the joint gate's kNN estimate (its p(target) against k = 1024's is measured: knn_est.json)
TRAIN_CHUNK = 1 << 21  # training positions searched at once
DIST_EDGES = np.geomspace(0.02, 20.0, 19)  # the nearest distance / scale: the estimate's buckets 1..20 (0: no neighbour)


def train_windows(n: int, T: int) -> list[tuple[int, int]]:
    """(start, first kept target) of windows of T + 1 tokens over a stream of n tokens, so that
    every target position 1..n-1 is predicted exactly once: consecutive windows, the last one
    moved back to end at the stream's end and keeping only targets not seen before."""
    if n < 2:
        return []
    if n <= T + 1:
        return [(0, 0)]
    out = [(a, 0) for a in range(0, n - T - 1, T)]
    last = n - T - 1
    done = out[-1][0] + T  # targets 1..done are covered
    if done < n - 1:
        out.append((last, done - last))  # window row j predicts position last + 1 + j
    return out


def _windows_of(tokens: np.ndarray, T: int, sep: int, eos: int):
    for a, keep in train_windows(len(tokens), T):
        w = np.asarray(tokens[a : a + T + 1]).astype(np.int64)
        w[w == sep] = eos
        yield w[:-1], w[1:], keep


def kmeans(x, k: int, iters: int, seed: int):
    """Lloyd's k-means (float32) from k distinct random points; an empty cluster keeps its centroid."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    c = x[torch.randperm(len(x), generator=g)[:k].to(x.device)].clone()
    for _ in range(iters):
        a = assign(x, c)
        s = torch.zeros_like(c).index_add_(0, a, x)
        n = torch.bincount(a, minlength=len(c)).to(x.dtype)
        c = torch.where(n[:, None] > 0, s / n.clamp_min(1)[:, None], c)
    return c


def assign(x, c, chunk: int = 65536):
    """The nearest centroid of each row of x."""
    import torch

    cn = (c * c).sum(1)
    return torch.cat([(cn[None] - 2 * x[a : a + chunk] @ c.T).argmin(1) for a in range(0, len(x), chunk)])


class Datastore:
    """Keys (N, C) float16, centred on mu, their values (N,) int32, and an inverted file: the
    keys' ids grouped by nearest centroid (ids[off[c]:off[c+1]] are list c)."""

    def __init__(self, keys, vals, *, centroids: int = CENTROIDS, sample: int = KMEANS_SAMPLE, iters: int = KMEANS_ITERS, seed: int = SEED):
        import torch

        self.keys, self.vals = keys, vals
        g = torch.Generator(device="cpu").manual_seed(seed)
        rows = torch.randperm(len(keys), generator=g)[: min(sample, len(keys))].to(keys.device)
        self.cent = kmeans(keys[rows].float(), min(centroids, len(rows)), iters, seed)
        a = torch.cat([assign(keys[s : s + (1 << 20)].float(), self.cent) for s in range(0, len(keys), 1 << 20)])
        self.ids = torch.argsort(a, stable=True)
        self.off = torch.cat([torch.zeros(1, dtype=torch.long, device=a.device), torch.bincount(a, minlength=len(self.cent)).cumsum(0)])
        self.kn = torch.cat([(keys[s : s + (1 << 22)].float() ** 2).sum(1) for s in range(0, len(keys), 1 << 22)])

    def exact(self, q, k: int, chunk: int = 1 << 20):
        """(squared distances, ids) of the k nearest keys by brute force (float32)."""
        import torch

        qn = (q * q).sum(1, keepdim=True)
        best_d = torch.full((len(q), 0), float("inf"), device=q.device)
        best_i = torch.zeros((len(q), 0), dtype=torch.long, device=q.device)
        for s in range(0, len(self.keys), chunk):
            d = qn + self.kn[s : s + chunk][None] - 2 * q @ self.keys[s : s + chunk].float().T
            dv, dj = torch.topk(d, min(k, d.shape[1]), dim=1, largest=False)
            best_d, j = torch.topk(torch.cat([best_d, dv], 1), min(k, best_d.shape[1] + dv.shape[1]), dim=1, largest=False)
            best_i = torch.gather(torch.cat([best_i, dj + s], 1), 1, j)
        return best_d, best_i

    def search(self, q, k: int, nprobe: int = NPROBE, max_elems: int = 1 << 29, qdoc=None, kdoc=None):
        """(squared distances, ids) of the k nearest keys among the nprobe nearest lists of each
        query (ids -1 and distance inf where fewer than k keys were probed). All queries go at
        once: one pass over the lists, each scored against the queries probing it. With qdoc
        (nq,) and kdoc (N,), document numbers, a query's own document's keys are left out."""
        import torch

        nq = len(q)
        npr = min(nprobe, len(self.cent))
        probe = torch.cat(  # (nq, nprobe), 2^17 queries' centroid scores at a time
            [torch.topk(assign_scores(q[a : a + (1 << 17)], self.cent), npr, dim=1, largest=False).indices for a in range(0, nq, 1 << 17)]
        )
        lists = probe.reshape(-1)
        order = torch.argsort(lists, stable=True)
        qof = (order // probe.shape[1]).contiguous()  # query of each (list, query) pair, grouped by list
        bounds = torch.cat(
            [torch.zeros(1, dtype=torch.long, device=q.device), torch.bincount(lists, minlength=len(self.cent)).cumsum(0)]
        ).tolist()
        off = self.off.tolist()
        qn = (q * q).sum(1)
        best_d = torch.full((nq, k), float("inf"), device=q.device)
        best_i = torch.full((nq, k), -1, dtype=torch.long, device=q.device)
        for c in range(len(self.cent)):
            if bounds[c] == bounds[c + 1] or off[c] == off[c + 1]:
                continue
            ids = self.ids[off[c] : off[c + 1]]
            kc = self.keys[ids].float()
            knc = self.kn[ids][None]
            kdc = kdoc[ids][None] if qdoc is not None else None
            qs_all = qof[bounds[c] : bounds[c + 1]]
            step = max(1, max_elems // len(ids))
            for a in range(0, len(qs_all), step):
                qs = qs_all[a : a + step]
                d = torch.addmm(knc, q[qs], kc.T, alpha=-2)  # |k|^2 - 2 q.k: the ranking; |q|^2 added to the k kept
                if kdc is not None:
                    d.masked_fill_(qdoc[qs][:, None] == kdc, float("inf"))
                kk = min(k, d.shape[1])
                dv, dj = torch.topk(d, kk, dim=1, largest=False)
                dv = dv + qn[qs][:, None]
                md, mj = torch.topk(torch.cat([best_d[qs], dv], 1), k, dim=1, largest=False)
                best_i[qs] = torch.gather(torch.cat([best_i[qs], torch.where(torch.isfinite(dv), ids[dj], -1)], 1), 1, mj)
                best_d[qs] = md
        return best_d, best_i

    def neighbours(self, q, k: int, nprobe: int = NPROBE, **kw):
        """search's squared distances and the neighbours' values (-1 where there is none)."""
        import torch

        d, i = self.search(q, k, nprobe, **kw)
        return d, torch.where(i >= 0, self.vals[i.clamp_min(0)].long(), -1)


def _queries(hidden: np.ndarray, rows, mu, device: str):
    """Held-out hidden states (rows of them) as queries: float32 on device, centred as the keys are."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(hidden[rows], np.float32)).to(device) - mu


def assign_scores(q, c):
    """Squared distances (up to a per-query constant) of queries to centroids."""
    return (c * c).sum(1)[None] - 2 * q @ c.T


def knn_target_probs(d, nb_vals, target, temps):
    """p_knn(target) (n, len(temps)): softmax(-d / T) over the neighbours, summed where the
    neighbour's value is the target (missing neighbours: d = inf, weight 0)."""
    import torch

    hit = (nb_vals == target[:, None]).float()
    out = []
    for t in temps:
        w = torch.softmax(-d / t, dim=1)
        out.append((w * hit).sum(1))
    return torch.nan_to_num(torch.stack(out, 1))  # no neighbour at all: 0


def build(model, index_dir: Path, device: str, batch: int = 64):
    """The datastore of every training position of the index's shards under `model`: keys are
    its final hidden states (float16, centred), values the next tokens."""
    import torch
    from teragram.index import format as fmt

    m = fmt.read_json(Path(index_dir) / "manifest.json")
    sep, eos = m["separator"], m["tokenizer"]["eos_id"]
    T = model.cfg.block_size
    toks = [fmt.open_array(fmt.shard_dir(Path(index_dir), s["shard"], s.get("dir")) / "tokens.bin", "tokens") for s in m["shards"]]
    N = sum(max(len(t) - 1, 0) for t in toks)
    C = model.cfg.n_embd
    keys = torch.empty((N, C), dtype=torch.float16, device=device)
    vals = torch.empty(N, dtype=torch.int32, device=device)
    model.eval()
    cuda = str(device).startswith("cuda")
    mu = None
    n = 0
    buf: list = []

    def flush():
        nonlocal n, mu
        x = torch.from_numpy(np.stack([b[0] for b in buf])).to(device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            h, _ = model.hidden(x)
        h = h.float()
        if mu is None:
            mu = h.reshape(-1, C).mean(0)  # any vector gives the same distances; centring keeps fp16 precise
        for j, (_, y, keep) in enumerate(buf):
            r = len(y) - keep
            keys[n : n + r] = (h[j, keep:] - mu).half()
            vals[n : n + r] = torch.from_numpy(y[keep:]).to(device, torch.int32)
            n += r
        buf.clear()

    for t in toks:
        for x, y, keep in _windows_of(t, T, sep, eos):
            if len(x) < T:  # a stream shorter than a window
                continue
            buf.append((x, y, keep))
            if len(buf) == batch:
                flush()
    if buf:
        flush()
    return keys[:n], vals[:n], mu


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
    from teragram.model.evaluate import token_eval

    info: dict = {}
    t = time.time()
    keys, vals, mu = build(model, index_dir, device, batch)
    info |= {"keys": len(keys), "keys_s": time.time() - t}
    t = time.time()
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # keys are fp16: TF32's 10-bit inputs lose nothing more; sums stay float32
    try:
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
            q = _queries(r["hidden"], rows, mu, device)
            d, i = ds.search(q, k, nprobe)
            nearest.append(d[:, 0])
            info[f"scale_search_{name}_s"] = time.time() - t
            if name == "indist":  # recall against exact search, on a sample
                s = slice(0, min(RECALL_ROWS, len(q)))
                ed, ei = ds.exact(q[s], k)
                inter = [len(np.intersect1d(a, b)) for a, b in zip(i[s].cpu().numpy(), ei.cpu().numpy())]
                info["recall_at_k"] = float(np.mean(inter)) / k
                info["nearest_exact_share"] = float((i[s, 0] == ei[:, 0]).float().mean())
        scale = float(torch.cat(nearest).median())
        info |= {"temperature_scale": scale, "factors": list(FACTORS)}
        for (name, h), r in evals.items():  # every target of every half, in chunks (the neighbours of all would not fit)
            t = time.time()
            ps, near = [], []
            for a in range(0, len(r["target"]), QUERY_CHUNK):
                d, nb = ds.neighbours(_queries(r["hidden"], slice(a, a + QUERY_CHUNK), mu, device), k, nprobe)
                tgt = torch.from_numpy(r["target"][a : a + QUERY_CHUNK].astype(np.int64)).to(device)
                ps.append(knn_target_probs(d, nb, tgt, [f * scale for f in FACTORS]).cpu().numpy())
                near.append((d[:, 0] / scale).cpu().numpy())
            info[f"search_{name}_{h}_s"] = time.time() - t
            np.savez_compressed(
                out / f"knn-{name}-{h}.npz",
                p_knn=np.concatenate(ps).astype(np.float32),
                nearest=np.concatenate(near).astype(np.float32),
                nll_a=r["nll"].astype(np.float32),
                target=r["target"].astype(np.int32),
            )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    (out / "knn_gpu.json").write_text(json.dumps(info, indent=1))
    return info


# ---- the kNN estimate as a component of the joint gate (model/joint.py's dense_knn) ----------


def estimate_columns(d, nb, target, temp: float, scale: float) -> dict:
    """The kNN estimate as one joint component, numpy columns of model/joint.Est: q = p_knn(target)
    (softmax(-d / temp) over the neighbours), rest 0 (1 without any neighbour: it defers to the
    model), in the count's place the nearest distance's bucket (in units of `scale`; 0: none), the
    share of the nearest neighbour's token and that token as top (-1: none)."""
    import torch
    from teragram.model.gate import SHARE_EDGES

    has = torch.isfinite(d[:, 0])
    w = torch.nan_to_num(torch.softmax(-d / temp, dim=1))  # no neighbour at all: 0
    q = (w * (nb == target[:, None])).sum(1)
    share = (w * (nb == nb[:, :1])).sum(1)
    edges = torch.as_tensor(DIST_EDGES, dtype=d.dtype, device=d.device)
    near = torch.where(has, torch.bucketize(torch.where(has, d[:, 0], 0) / scale, edges, right=True) + 1, 0)
    share_b = torch.bucketize(share, torch.as_tensor(SHARE_EDGES, dtype=share.dtype, device=d.device), right=True)
    return {
        "q": q.cpu().numpy().astype(np.float32),
        "rest": (~has).float().cpu().numpy(),
        "count": near.cpu().numpy().astype(np.uint8),
        "share": torch.where(has, share_b, 0).cpu().numpy().astype(np.uint8),
        "top": torch.where(has, nb[:, 0], -1).cpu().numpy().astype(np.int32),
    }


def as_est(cols: dict):
    """estimate_columns' arrays as a one-column model/joint.Est (the per-position fields zero:
    with_columns keeps the index's)."""
    from teragram.model.joint import Est

    n = len(cols["q"])
    z = np.zeros(n, np.uint8)
    return Est(*(cols[f][:, None] for f in ("q", "rest", "count", "share", "top")), z, z, z)


def load_est(out: Path, name: str, half: str):
    """A held-out half's kNN estimate saved by joint_estimates, as a one-column Est."""
    z = np.load(Path(out) / f"knnest-{name}-{half}.npz")
    return as_est({f: z[f] for f in ("q", "rest", "count", "share", "top")})


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


def _heldout(model, ds, mu, held: dict, idx, out: Path, device: str, eval_batch: int, k: int, nprobe: int, info: dict):
    """joint_estimates' held-out part: every held-out target's kNN estimate (OUT/knnest-SET-HALF.npz),
    the temperature fit on the in-distribution validation half first. Returns (temperature, scale)."""
    import torch
    from teragram.model.evaluate import token_eval

    found = {}
    for (name, h), feats in sorted(held.items(), key=lambda kv: kv[0] != ("indist", "valid")):  # it sets the temperature
        t = time.time()
        r = token_eval(model, feats, idx.eos_id, idx.sep, device, batch=eval_batch, hidden=True)
        parts = []
        for a in range(0, len(r["target"]), QUERY_CHUNK):
            parts.append(ds.neighbours(_queries(r["hidden"], slice(a, a + QUERY_CHUNK), mu, device), k, nprobe))
        d, nb = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        tgt = torch.from_numpy(r["target"].astype(np.int64)).to(device)
        found[name, h] = (d, nb, tgt, r["target"].astype(np.int32))
        info[f"heldout_{name}_{h}_s"] = time.time() - t
        if (name, h) == ("indist", "valid"):  # the scale and temperature, here only
            scale = float(d[:, 0].median())
            p = knn_target_probs(d, nb, tgt, [f * scale for f in FACTORS]).cpu().numpy()
            j, lam = fit(r["nll"].astype(np.float64), p)
            temp = FACTORS[j] * scale
            info |= {"temperature_scale": scale, "temperature_factor": FACTORS[j], "lambda_at_fit": lam}
            s = slice(0, min(VALID_ROWS, len(r["target"])))  # k against the peer's 1024, on the first targets
            d2, nb2 = ds.neighbours(_queries(r["hidden"], s, mu, device), K_NEIGHBOURS, nprobe)
            big = knn_target_probs(d2, nb2, tgt[s], [temp])[:, 0]
            small = knn_target_probs(d2[:, :k], nb2[:, :k], tgt[s], [temp])[:, 0]
            diff = (big - small).abs()
            info |= {"k_vs_1024_max_abs": float(diff.max()), "k_vs_1024_mean_abs": float(diff.mean())}
    for (name, h), (d, nb, tgt, target) in found.items():
        c = estimate_columns(d, nb, tgt, temp, scale)
        info[f"heldout_{name}_{h}_mean_q"] = float(c["q"].mean())
        np.savez_compressed(out / f"knnest-{name}-{h}.npz", target=target, **c)
    del found
    return temp, scale


def joint_estimates(
    model, index_dir: Path, held: dict, est_dir: Path, out_dir: Path, out: Path, device: str,
    *, batch: int = 64, eval_batch: int = 16, k: int = K_JOINT, centroids: int = CENTROIDS, nprobe: int = NPROBE,
    chunk: int = TRAIN_CHUNK,
) -> dict:  # fmt: skip
    """On the GPU: the kNN estimate of every held-out target (OUT/knnest-SET-HALF.npz) and of every
    training position in exclude-doc mode, appended to the joint estimates in est_dir as the
    component dense_knn (written to out_dir). The datastore is build's (every training position
    under `model`); the temperature, one for all text as training needs, is fit on the
    in-distribution validation half (fit's λ-interpolation loss, as the peer), in units of the
    median nearest distance there. A call cut short resumes: its chunks are kept in out_dir/searched
    and the held-out part in OUT (knnest-heldout.json). With TERAGRAM_KNN_SEARCH_ONLY set it returns
    once the training positions are searched, writing nothing to out_dir but those chunks; with
    TERAGRAM_KNN_PARTIAL it searches nothing more and merges what is searched."""
    import torch
    from teragram.index import format as fmt
    from teragram.index.engine import Index
    from teragram.model import joint

    if ("indist", "valid") not in held:
        raise SystemExit("joint_estimates fits the temperature on the in-distribution validation half: give it (held['indist', 'valid'])")
    info: dict = {"k": k, "nprobe": nprobe}
    t = time.time()
    keys, vals, mu = build(model, index_dir, device, batch)
    docs = key_documents(index_dir, model.cfg.block_size)
    kdoc = torch.from_numpy(np.concatenate([d for *_, d in docs])).to(device)
    if len(kdoc) != len(keys):
        raise SystemExit(f"{len(keys):,} keys, {len(kdoc):,} training positions: the datastore and the stream disagree")
    info |= {"keys": len(keys), "keys_s": time.time() - t}
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        t = time.time()
        ds = Datastore(keys, vals, centroids=centroids)
        info |= {"ivf_s": time.time() - t, "centroids": len(ds.cent)}
        cache = out / "knnest-heldout.json"  # a later call (the search resumed) reuses the held-out part
        sig = {"k": k, "nprobe": nprobe, "centroids": len(ds.cent), "keys": len(keys), "mu_abs_sum": float(mu.double().abs().sum())}
        prior = json.loads(cache.read_text()) if cache.exists() else None
        if prior and all((out / f"knnest-{n}-{h}.npz").exists() for n, h in held):
            same = all(prior["sig"][f] == v for f, v in sig.items() if f != "mu_abs_sum")
            if not same or abs(prior["sig"]["mu_abs_sum"] - sig["mu_abs_sum"]) > 1e-4 * sig["mu_abs_sum"]:
                raise SystemExit(
                    f"{cache}: the held-out kNN estimates there are another datastore's ({prior['sig']} vs {sig}): remove them"
                )
            temp, scale = prior["temperature"], prior["info"]["temperature_scale"]
            info |= prior["info"] | {"heldout_cached": True}
        else:
            temp, scale = _heldout(model, ds, mu, held, Index(index_dir), out, device, eval_batch, k, nprobe, info)
            cache.write_text(
                json.dumps({"sig": sig, "temperature": temp, "info": {f: v for f, v in info.items() if f not in ("keys_s", "ivf_s")}})
            )
        t = time.time()
        cols = {f: [] for f in ("q", "rest", "count", "share", "top")}
        done = Path(out_dir) / "searched"  # each chunk's columns once searched: a call cut short resumes here
        done.mkdir(parents=True, exist_ok=True)
        spans = [(a, min(a + chunk, len(keys))) for a in range(0, len(keys), chunk)]
        file = {(a, b): done / f"{a:012d}-{b:012d}-{temp:.6g}.npz" for a, b in spans}
        partial = bool(os.environ.get("TERAGRAM_KNN_PARTIAL"))  # merge what is searched; the rest defer to the model
        for j in [] if partial else np.random.default_rng(SEED).permutation(len(spans)):  # random order: a cut is a sample
            a, b = spans[j]
            if not file[a, b].exists():
                d, nb = ds.neighbours(keys[a:b].float(), k, nprobe, qdoc=kdoc[a:b], kdoc=kdoc)
                np.savez(done / "part.npz", **estimate_columns(d, nb, vals[a:b].long(), temp, scale))
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
                e0 = joint.empty(b - a, 1)
                z = {f: getattr(e0, f)[:, 0] for f in cols}
                info["unsearched"] = info.get("unsearched", 0) + b - a
            for f in cols:
                cols[f].append(z[f])
        cols = {f: np.concatenate(v) for f, v in cols.items()}
        info["train_search_s"] = time.time() - t
        info["train_mean_q"] = float(cols["q"].mean())  # beside the held-out's (unsearched positions count 0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
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
        rows = joint.empty(n, 1)  # the last position (and a shard without keys) defers to the model
        if len(doc):
            rows = joint.Est.combine([as_est({f: v[first : first + n - 1] for f, v in cols.items()}), joint.empty(1, 1)])
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
    from teragram.model.baselines import LAMBDAS, mix_nll

    best = None
    for j in range(p_knn.shape[1]):
        for lam in LAMBDAS:
            loss = float(mix_nll(nll_a, p_knn[:, j], lam).mean())
            if best is None or loss < best[0]:
                best = (loss, j, float(lam))
    return best[1], best[2]
