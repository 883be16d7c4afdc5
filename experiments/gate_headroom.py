"""What the post-hoc gate (t) leaves on the table, and three levers tried beyond it (issue 15).

From (a)'s saved outputs (benchmarks/joint.py gpu) mixed with the index here, per held-out set:

1. Where (t)'s loss is, on decontaminated test text: targets that some estimate (index or
   cache) gives mass against those none does, by the ∞-gram's match length; and the bound of
   a per-target oracle that always picks the best of the model and the estimates.
2. A richer gate over the same inputs: a two-layer MLP (256 wide) instead of the linear
   softmax gate, fit on 78% of the validation documents and stopped early on the rest.
3. New estimates for the same gate:
   - a neighbour cache: the document cache's estimates over the training documents nearest
     the document by path (its directory, then its parents; versions in the top directory
     dropped, so linux-source-6.12/drivers/x/ reads linux-source-6.1/drivers/x/), up to
     NEIGHBOUR_TOKENS, followed by the document's own earlier text;
   - kNN-LM's p_knn(target) over every training position (benchmarks/knnlm.py, with --knn:
     a run of the same (a)), its temperature fit on validation, the gate reading the nearest
     distance's bucket; and the same at three temperatures (KNN3: the joint gate's), three
     estimates the gate weighs per token, and at five (KNN5).

    python -m experiments.gate_headroom --outputs OUT --index DATA/idx-050m [--knn OUT] [--name gate_headroom]

Every gate and temperature is fit on validation; test is only reported. Decontaminated:
documents with < 80% of their 13-grams in the index, as everywhere here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import EXPERIMENT_RESULTS, read_jsonl, save, table
from benchmarks.index_size import FIT_ROWS, HALVES, SETS, clean_documents

NEIGHBOUR_TOKENS = 65536  # the neighbour cache's training text per document (one setting, not tuned)
MLP_WIDTH, MLP_EPOCHS, MLP_BATCH = 256, 30, 4096
DIST_EDGES = (0.1, 0.25, 0.5, 0.75, 0.9)  # quantiles (on validation) of kNN's nearest distance: the gate's buckets
KNN3 = (
    0.1,
    0.2,
    0.5,
)  # (t+knn3)'s temperatures (x the median nearest distance): the joint gate's three (model/mixture/knn.MULTIPLES x 0.2)
KNN5 = (0.05, 0.1, 0.2, 0.5, 1.0)  # (t+knn5): two more, sharper and broader still (would more temperatures help the joint gate?)


def _paths(source: Path) -> list[str]:
    return [r["path"] for r in read_jsonl(source)]


def _dir_parts(path: str) -> list[str]:
    parts = path.split("/")
    parts[0] = re.sub(r"[-_.]?\d+(\.\d+)*", "", parts[0])  # linux-source-6.12 -> linux-source
    return parts


class Neighbours:
    """The index's documents by directory, for the neighbour cache."""

    def __init__(self, idx):
        self.idx, sh = idx, idx.shards
        if len(sh) != 1:
            raise SystemExit("the neighbour cache reads a one-shard index")
        self.tok, self.starts = sh[0].tok, sh[0].starts.astype(np.int64)
        sources: dict[str, list[str]] = {}
        self.parts = []
        for d in range(idx.n_docs):
            m = idx.meta.doc(d)
            if m["source"] not in sources:
                sources[m["source"]] = _paths(Path(m["source"]))
            self.parts.append(_dir_parts(sources[m["source"]][m["record"]]))
        self.by_dir: dict[str, list[int]] = {}
        for d, p in enumerate(self.parts):
            for k in range(1, len(p)):
                self.by_dir.setdefault("/".join(p[:k]), []).append(d)

    def of(self, path: str, budget: int) -> np.ndarray:
        """The ids of the training documents nearest `path`: its directory's first (the longest
        common file-name prefix first, then the shorter), then its parents', up to budget tokens."""
        parts, seen, out, n = _dir_parts(path), set(), [], 0
        name = parts[-1]
        for k in range(len(parts) - 1, 0, -1):
            cand = [d for d in self.by_dir.get("/".join(parts[:k]), []) if d not in seen]
            cand.sort(key=lambda d: (-len(os.path.commonprefix([self.parts[d][-1], name])), self.starts[d + 1] - self.starts[d]))
            for d in cand:
                seen.add(d)
                size = int(self.starts[d + 1] - self.starts[d])  # the document and its separator
                if n + size <= budget:
                    out.append(d)
                    n += size
            if n >= 0.9 * budget:
                break
        ids = [np.asarray(self.tok[self.starts[d] : self.starts[d + 1]]).astype(np.int64) for d in out]
        return np.concatenate(ids) if ids else np.zeros(0, np.int64)


def neighbour_estimates(o, nb: Neighbours, carry_root: Path) -> dict[str, np.ndarray]:
    """The cache's estimates (model/mixture/estimates.py) over [the neighbours; the document], at the
    document's targets, named near_* for cache_*."""
    from teragram.model.mixture.estimates import cache_estimates, heldout_docs

    paths: dict[str, list[str]] = {}
    parts = []
    for k, ids in enumerate(heldout_docs(o.path)):
        d = o.manifest["docs"][k]
        src = Path(d["source"]) if Path(d["source"]).exists() else carry_root / d["source"]
        if d["source"] not in paths:
            paths[d["source"]] = _paths(src)
        pre = nb.of(paths[d["source"]][d["record"]], NEIGHBOUR_TOKENS)
        c = cache_estimates(np.concatenate([pre, ids]), nb.idx.eos_id)
        parts.append({key.replace("cache", "near"): v[len(pre) :] for key, v in c.items()})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _mlp_gate(X: dict, lp: dict, docs_valid: np.ndarray, seed: int = 0) -> np.ndarray:
    """Test nll of an MLP gate fit on 78% of the validation documents, stopped early on the rest."""
    import torch

    torch.manual_seed(seed)
    Xv, Lv = torch.from_numpy(np.ascontiguousarray(X["valid"], np.float64)), torch.from_numpy(lp["valid"])
    fit = (docs_valid.astype(np.int64) * 2654435761 % 97) < 76
    fi, hi = torch.from_numpy(np.nonzero(fit)[0]), torch.from_numpy(np.nonzero(~fit)[0])
    net = torch.nn.Sequential(
        torch.nn.Linear(Xv.shape[1], MLP_WIDTH),
        torch.nn.GELU(),
        torch.nn.Linear(MLP_WIDTH, MLP_WIDTH),
        torch.nn.GELU(),
        torch.nn.Linear(MLP_WIDTH, Lv.shape[1]),
    ).double()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-4)

    def nll(X_, L_):
        return -torch.logsumexp(torch.log_softmax(net(X_), 1) + L_, 1)

    best, state = float("inf"), None
    for _ in range(MLP_EPOCHS):
        perm = fi[torch.randperm(len(fi))]
        for b in range(0, len(perm), MLP_BATCH):
            r = perm[b : b + MLP_BATCH]
            opt.zero_grad()
            nll(Xv[r], Lv[r]).mean().backward()
            opt.step()
        with torch.no_grad():
            h = float(nll(Xv[hi], Lv[hi]).mean())
        if h < best:
            best, state = h, {k: v.clone() for k, v in net.state_dict().items()}
    net.load_state_dict(state)
    with torch.no_grad():
        return nll(torch.from_numpy(np.ascontiguousarray(X["test"], np.float64)), torch.from_numpy(lp["test"])).numpy()


def linear_gate_nll(X: dict, lp: dict) -> dict[str, np.ndarray]:
    """Per half, the nll of the post-hoc softmax gate over the inputs X and the components' log
    probabilities lp, its weights fit on (at most FIT_ROWS of) validation."""
    from teragram.model.mixture.gate import fit_weights, mix_nll_multi, mixture_weights

    fit = np.arange(len(X["valid"]))
    if len(fit) > FIT_ROWS:
        fit = np.sort(np.random.default_rng(0).choice(fit, FIT_ROWS, replace=False))
    W = fit_weights(X["valid"][fit], lp["valid"][fit])
    return {h: mix_nll_multi(lp[h], mixture_weights(X[h], W)) for h in HALVES}


def _knn(path: Path, o) -> tuple[np.ndarray, np.ndarray]:
    z = np.load(path)
    if "rows" in z or not np.array_equal(z["target"], o.target.astype(np.int32)):
        raise SystemExit(f"{path}: not every target of {o.path} (a kNN run of another (a) or an older one)")
    return z["p_knn"].astype(np.float64), z["nearest"].astype(np.float64)


def evaluate_set(name: str, a, nb: Neighbours | None) -> dict:
    from teragram.model.evaluation.outputs import load_outputs, outputs_estimates
    from teragram.model.mixture import estimates as E
    from teragram.model.mixture.gate import component_logp, gate_inputs

    from benchmarks import knnlm

    t0 = time.time()
    o, est = {}, {}
    for h in HALVES:
        if not (Path(a.outputs) / "unpacked" / f"{name}-{h}").exists():
            with tarfile.open(Path(a.outputs) / f"outputs-{name}-{h}.tgz") as tar:
                tar.extractall(Path(a.outputs) / "unpacked", filter="data")
        o[h] = load_outputs(Path(a.outputs) / "unpacked" / f"{name}-{h}")
        cached = Path(a.outputs) / "eval" / f"headroom-{name}-{h}.npz"
        if cached.exists():
            est[h] = dict(np.load(cached))
        else:
            est[h] = outputs_estimates(o[h], Path(a.index), workers=a.workers) | neighbour_estimates(o[h], nb, Path(a.carry_root))
            cached.parent.mkdir(exist_ok=True)
            np.savez(cached, **est[h])
    clean = clean_documents(o["test"], est["test"])[o["test"].doc.astype(np.int64)]
    near = tuple(c.replace("cache", "near") for c in E.CACHE)

    def inputs(comps):
        X = {h: gate_inputs(est[h], o[h].maxp.astype(np.float64), o[h].top.astype(np.int64), comps) for h in HALVES}
        lp = {h: np.maximum(component_logp(est[h], o[h].nll.astype(np.float64), comps), -700.0) for h in HALVES}
        return X, lp

    nll = {"(a) no index": {h: o[h].nll.astype(np.float64) for h in HALVES}}
    X, lp = inputs(E.COMPONENTS)
    nll["(t) post-hoc gate"] = linear_gate_nll(X, lp)
    t = time.time()
    nll["(t/mlp) the same inputs, an MLP gate"] = {"test": _mlp_gate(X, lp, o["valid"].doc)}
    mlp_s = time.time() - t
    Xn, lpn = inputs(E.COMPONENTS + near)
    nll["(t+near) plus the neighbour cache"] = linear_gate_nll(Xn, lpn)
    knn = {}
    if a.knn:
        p, dist = zip(*(_knn(Path(a.knn) / f"knn-{name}-{h}.npz", o[h]) for h in HALVES), strict=True)
        p, dist = dict(zip(HALVES, p, strict=True)), dict(zip(HALVES, dist, strict=True))
        j, lam = knnlm.fit(o["valid"].nll.astype(np.float64), p["valid"])
        from teragram.model.mixture.baselines import mix_nll

        nll["(d) kNN-LM over (a)"] = {h: mix_nll(o[h].nll.astype(np.float64), p[h][:, j], lam) for h in HALVES}
        edges = np.quantile(dist["valid"], DIST_EDGES)
        three, five = ([knnlm.FACTORS.index(f) for f in temps] for temps in (KNN3, KNN5))
        for tag, (Xb, lpb), cols in (
            ("(t+knn) plus kNN-LM's estimate", (X, lp), [j]),
            ("(t+near+knn) plus both", (Xn, lpn), [j]),
            (f"(t+knn3) plus kNN-LM's estimate at {', '.join(map(str, KNN3))} x the median nearest distance: three", (X, lp), three),
            (f"(t+knn5) the same at {', '.join(map(str, KNN5))} x: five", (X, lp), five),
        ):
            Xk, lpk = {}, {}
            for h in HALVES:
                B = np.zeros((len(dist[h]), len(edges) + 1), np.float32)
                B[np.arange(len(B)), np.searchsorted(edges, dist[h])] = 1
                Xk[h] = np.concatenate([B, Xb[h]], 1)
                lpk[h] = np.concatenate([lpb[h], np.maximum(np.log(p[h][:, cols] + 1e-300), -700.0)], 1)
            nll[tag] = linear_gate_nll(Xk, lpk)
        knn = {"temperature_factor": knnlm.FACTORS[j], "lambda": lam}
    row = {"set": name, "test targets": len(clean), "decontaminated targets": int(clean.sum())}
    for v, n in nll.items():
        row[v] = {
            "valid": float(np.exp(n["valid"].mean())) if "valid" in n else None,
            "test": float(np.exp(n["test"].mean())),
            "test_decontaminated": float(np.exp(n["test"][clean].mean())),
        }
    row |= {"knn": knn, "mlp_s": mlp_s, "seconds": time.time() - t0}
    row["decomposition"] = _decomposition(
        est["test"], nll["(t) post-hoc gate"]["test"], nll["(a) no index"]["test"], lp["test"], clean, E.COMPONENTS
    )
    return row


def _decomposition(est: dict, t: np.ndarray, a: np.ndarray, lp: np.ndarray, clean: np.ndarray, comps) -> list[dict]:
    """(t)'s decontaminated test loss by region, with (a)'s and the oracle's (the best of the
    model and the estimates at each target) perplexity there."""
    has = np.zeros(len(t), bool)
    for s in comps:
        has |= (est[f"count_{s}"] > 0) & (est[f"p_{s}"] > 0)
    oracle = -lp.max(1)
    L = est["index_length"]
    regions = [("all", np.ones(len(t), bool)), ("some estimate gives the target mass", has), ("none does", ~has)]
    regions += [
        (f"∞-gram match {lo}-{hi - 1}" if hi < 1 << 20 else f"∞-gram match {lo}+", (L >= lo) & (L < hi))
        for lo, hi in ((0, 4), (4, 16), (16, 1 << 30))
    ]
    total = t[clean].sum()
    out = []
    for what, m in regions:
        m = m & clean
        out.append(
            {
                "targets": what,
                "share": float(m.sum() / clean.sum()),
                "share of (t)'s loss": float(t[m].sum() / total),
                "(a)": float(np.exp(a[m].mean())),
                "(t)": float(np.exp(t[m].mean())),
                "oracle": float(np.exp(oracle[m].mean())),
            }
        )
    return out


def smoke() -> int:
    """The study on benchmarks/joint.py's smoke run: its (a) outputs, index (one shard, its sources
    the run's carried files) and kNN-LM peer (every target)."""
    from benchmarks.joint import smoke_study

    with smoke_study() as (tmp, run):
        out = tmp / "outputs"  # the estimates' cache (OUTPUTS/eval) goes here, not into the shared run
        out.mkdir()
        (out / "unpacked").symlink_to(run / "out" / "unpacked")
        args = ["--outputs", str(out), "--index", str(run / "work" / "idx"), "--knn", str(run / "out"), "--workers", "1"]
        return main(args)


def main(argv: list[str] | None = None) -> int:
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):
        return smoke()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", required=True, help="a directory with unpacked/SET-HALF outputs of (a)")
    ap.add_argument("--index", required=True)
    ap.add_argument("--knn", help="a kNN run of the same (a) (benchmarks/joint.py gpu --variants a,knn): OUT/knn-SET-HALF.npz")
    ap.add_argument("--carry-root", default=".", help="where the outputs' held-out sources (.carry15/...) are")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--name", default="gate_headroom")
    a = ap.parse_args(argv)
    from teragram.index.engine import Index

    nb = Neighbours(Index(a.index))
    rows = []
    for name in SETS:
        rows.append(evaluate_set(name, a, nb))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "decomposition"}), flush=True)
    report(rows, a)
    return 0


def report(rows: list[dict], a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [k for k in rows[0] if k.startswith("(")]
    lines = [
        f"(a)'s outputs in `{a.outputs}`, the index `{a.index}`"
        + (f", kNN-LM from `{a.knn}`" if a.knn else "")
        + ". Test perplexity, all and decontaminated; every gate and temperature fit on validation.",
        "",
    ]
    tab = []
    for v in variants:
        r = {"variant": v}
        for row in rows:
            r[f"{row['set']} test"] = row[v]["test"]
            r[f"{row['set']} decontaminated"] = row[v]["test_decontaminated"]
            base = row["(t) post-hoc gate"]["test_decontaminated"]
            r[f"{row['set']} vs (t)"] = row[v]["test_decontaminated"] / base
        tab.append(r)
    lines += [table(tab, list(tab[0])), ""]
    for row in rows:
        lines += [f"**{row['set']}**: (t)'s decontaminated test loss by target ({row['decontaminated targets']:,} targets; perplexity)", ""]
        lines += [table(row["decomposition"], list(row["decomposition"][0])), ""]
        if row["knn"]:
            lines.append(
                f"- kNN-LM: temperature {row['knn']['temperature_factor']} x the median nearest distance, λ {row['knn']['lambda']}"
            )
        lines.append(f"- {row['seconds']:.0f} s (the MLP gate {row['mlp_s']:.0f} s)")
        lines.append("")
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / len(variants)
    for i, v in enumerate(variants[1:]):
        ax.bar(
            np.arange(len(rows)) + i * w,
            [row[v]["test_decontaminated"] / row["(t) post-hoc gate"]["test_decontaminated"] for row in rows],
            w,
            label=v,
        )
    ax.axhline(0.9, color="k", ls="--", lw=1, label="issue 15's bar: 0.9x (t)")
    ax.set_xticks(np.arange(len(rows)) + 0.4 - w / 2, [row["set"] for row in rows])
    ax.set_ylim(0.8, 1.1)
    ax.set_ylabel("decontaminated test perplexity / (t)'s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(
        a.name,
        {"rows": rows, "outputs": a.outputs, "index": a.index, "knn": a.knn, "neighbour_tokens": NEIGHBOUR_TOKENS},
        "\n".join(lines),
        fig,
        results=EXPERIMENT_RESULTS,
    )


if __name__ == "__main__":
    sys.exit(main())
