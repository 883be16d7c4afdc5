"""Perplexity with and without the index, against the peers' methods, raw and decontaminated.

    python benchmarks/perplexity_data.py --out DATA --scale cpu      # corpora from Debian packages
    python benchmarks/perplexity.py --data DATA --scale cpu          # build, train, eval

Corpus: linux-source-6.1 plus the English packages (linux-doc-6.1, dict-gcide, manpages,
manpages-dev, jargon-text, fortunes, bible-kjv-text), split train / held-out by a hash of the
document path; held-out is split again (by hash) into validation (for tuning the peers'
interpolation weights) and test (reported). Index and features come from train only.

Variants, same model shape, training tokens and steps:
  a   no index
  b   TScale: continuation-token embedding, causal lookups (TScale's rule)
  b2  continuation-token embedding, exclude-doc lookups
  c   (a) + infini-gram's ∞-gram interpolation: one λ for sparse, one for non-sparse estimates
  d   (a) + kNN-LM from a dense store of (a)'s hidden states, λ and temperature tuned
  e   teragram: all index inputs + learned mixture;  e+d: with the dense fallback interpolated
Held-out sets: test raw; test decontaminated (documents with >= 80% of their 13-grams in the
index removed, infini-gram's criterion); code and English parts of test.
Stages (--stage): build, train, eval (default all). On a 2-GPU machine the four trainings run
two per GPU at once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCALES = {
    "cpu": dict(
        preset="tiny",
        block_size=128,
        batch_size=16,
        steps=400,
        lr=3e-3,
        min_lr=3e-4,
        warmup=30,
        vocab=8000,
        knn_positions=300_000,
        knn_valid=100_000,
        eval_batch=16,
    ),
    "gpu": dict(
        preset="125m",
        block_size=1024,
        batch_size=32,
        steps=1500,
        lr=6e-4,
        min_lr=6e-5,
        warmup=100,
        vocab=32000,
        knn_positions=2_000_000,
        knn_valid=300_000,
        eval_batch=32,
    ),
}
VARIANTS = {
    "a": ("no index", ["--use_index=false"]),
    "b": ("TScale: continuation embedding, causal", ["--features={w}/feats-causal", "--index_inputs=cont", "--mixture=false"]),
    "b2": ("continuation embedding, exclude-doc", ["--features={w}/feats-exdoc", "--index_inputs=cont", "--mixture=false"]),
    "e": ("teragram: all index inputs + mixture", ["--features={w}/feats-exdoc"]),
}
GPU_OF = {"a": 0, "b": 0, "e": 1, "b2": 1}
# ablations (--stage train-ablation / eval-ablation): one at a time, on all GPUs with DDP
ABLATIONS = {
    "e_drop": ("(e) with index features blinded on half of the training sequences", ["--features={w}/feats-exdoc", "--index_dropout=0.5"]),
}
LAMBDAS = np.array([0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99])


def sh(*cmd, **kw):
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=REPO, check=True, **kw)


def _valid(path: str) -> bool:
    return int.from_bytes(hashlib.blake2b(f"valid:{path}".encode(), digest_size=8).digest(), "big") % 2 == 0


# ---- build -----------------------------------------------------------------------------------


def stage_build(data: Path, w: Path, s: dict, workers: int) -> None:
    import zstandard

    py = sys.executable
    sh(
        py,
        "-m",
        "builder.cli",
        data / "train-code.jsonl.zst",
        data / "train-english.jsonl.zst",
        "--out",
        w / "idx",
        "--vocab-size",
        s["vocab"],
        "--workers",
        workers,
        "--quiet",
    )
    for split in ("valid", "test"):
        (w / "heldout" / split).mkdir(parents=True, exist_ok=True)
    for dom in ("code", "english"):
        outs = {sp: open(w / "heldout" / sp / f"{dom}.jsonl", "w") for sp in ("valid", "test")}
        with zstandard.open(data / f"heldout-{dom}.jsonl.zst", "rt") as f:
            for line in f:
                rec = json.loads(line)
                outs["valid" if _valid(rec["path"]) else "test"].write(line)
        for o in outs.values():
            o.close()
    sh(
        py,
        "-m",
        "serve.cli",
        "features",
        w / "idx",
        "--out",
        w / "feats-exdoc",
        "--mode",
        "exclude-doc",
        "--top-k",
        4,
        "--workers",
        workers,
        "--quiet",
    )
    sh(
        py,
        "-m",
        "serve.cli",
        "features",
        w / "idx",
        "--out",
        w / "feats-causal",
        "--mode",
        "causal",
        "--top-k",
        0,
        "--workers",
        workers,
        "--quiet",
    )
    for split, name in (("valid", "hv"), ("test", "ht")):
        sh(
            py,
            "-m",
            "serve.cli",
            "features",
            w / "idx",
            "--corpus",
            w / "heldout" / split,
            "--out",
            w / name,
            "--top-k",
            4,
            "--workers",
            workers,
            "--quiet",
        )


# ---- train -----------------------------------------------------------------------------------


def train_cmd(v: str, w: Path, s: dict) -> list[str]:
    extra = [x.format(w=w) for x in VARIANTS[v][1]]
    return [
        sys.executable, "-m", "serve.cli", "train", f"--index={w / 'idx'}", f"--out={w / 'runs' / v}", f"--preset={s['preset']}",
        f"--block_size={s['block_size']}", f"--batch_size={s['batch_size']}", f"--max_steps={s['steps']}", f"--lr={s['lr']}",
        f"--min_lr={s['min_lr']}", f"--warmup={s['warmup']}", "--log_every=25", "--progress=false", "--seed=7", *extra,
    ]  # fmt: skip


def stage_train_ablation(w: Path, s: dict, name: str) -> None:
    import torch

    extra = [x.format(w=w) for x in ABLATIONS[name][1]]
    cmd = train_cmd("a", w, s)
    cmd = [c for c in cmd if not c.startswith(("--use_index", "--out="))] + [f"--out={w / 'runs' / name}", *extra]
    n = max(1, torch.cuda.device_count())
    if n > 1:
        # same global batch per step as the single-GPU variants: split it over the GPUs
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", *cmd[1:]]
        cmd = [c if not c.startswith("--batch_size=") else f"--batch_size={s['batch_size'] // n}" for c in cmd]
    sh(*cmd)


def stage_eval_ablation(w: Path, s: dict, name: str) -> dict:
    """The ablation's perplexity on the same test sets (the baseline's numbers come from the
    main run's JSON, whose test split is the same by construction)."""
    import torch

    from builder.tokenizer import load as load_tok
    from index import format as fmt
    from index.engine import Index
    from model.data import EvalData
    from model.evaluate import doc_bytes, summarize, token_eval
    from model.train import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    idx = Index(w / "idx")
    sp = load_tok(w / "idx" / "tokenizer.model")
    ht = w / "ht"
    ev = EvalData(ht, 64, idx.eos_id, idx.sep)
    docs = fmt.read_json(ht / "000000.done")["docs"]
    domain = np.array(["code" if "code" in Path(d["source"]).name else "english" for d in docs])
    nbytes = doc_bytes(ev, sp.decode)
    L = np.asarray(ev.feats.length)
    contam = np.array(
        [
            float((L[int(ev.starts[k]) : int(ev.starts[k + 1]) - 1][12:] >= 13).mean()) if ev.starts[k + 1] - ev.starts[k] > 13 else 0.0
            for k in range(len(docs))
        ]
    )
    sets = {
        "test": np.ones(len(docs), bool),
        "test, decontaminated": contam < 0.8,
        "test code": domain == "code",
        "test English": domain == "english",
    }
    model, _ = load_model(w / "runs" / name, device)
    r = token_eval(model, ht, idx.eos_id, idx.sep, device, batch=s["eval_batch"])
    doc_of = r["doc"].astype(int)
    res = {k: summarize(r["nll"][m[doc_of]], int(nbytes[m].sum())) for k, m in sets.items()}
    return {"variant": ABLATIONS[name][0], "results": res, "removed_docs": int((contam >= 0.8).sum())}


def stage_train(w: Path, s: dict, variants: list[str]) -> None:
    import torch

    n_gpu = torch.cuda.device_count()
    if n_gpu == 0:
        for v in variants:
            sh(*train_cmd(v, w, s))
        return
    procs = []
    for v in variants:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(GPU_OF[v] % n_gpu))
        log = open(w / f"train-{v}.log", "w")
        print("+", " ".join(train_cmd(v, w, s)), flush=True)
        procs.append((v, subprocess.Popen(train_cmd(v, w, s), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)))
    for v, p in procs:
        if p.wait() != 0:
            raise SystemExit(f"training {v} failed: see {w / f'train-{v}.log'}")


# ---- eval ------------------------------------------------------------------------------------


def _infgram_doc(args):
    index_dir, ids = args
    from index.engine import Index

    idx = _infgram_doc.idx = getattr(_infgram_doc, "idx", None) or Index(index_dir)
    r = idx.score(ids, top_k=1, max_len=0, targets=True)  # uncapped: the ∞-gram
    n = len(ids)
    p = np.empty(n + 1)
    sparse = np.zeros(n + 1, bool)
    p[0] = idx.unigram[ids[0]] / idx.n_positions
    p[1:] = r.target_cnt / np.maximum(r.count, 1)
    sparse[1:] = (r.length > 0) & (r.topk_cnt[:, 0] == r.count)
    return p, sparse


def infgram_probs(index_dir: Path, heldout: Path, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """p_inf(target) and sparsity for every target of the held-out features, in token_eval order."""
    from multiprocessing import get_context

    from index import format as fmt

    d = heldout / "000000"
    tok = np.asarray(fmt.open_array(d / "tokens.bin", "tokens")).astype(np.int64)
    st = np.asarray(fmt.open_array(d / "docs.bin", "docs")).astype(np.int64)
    docs = [tok[st[k] : st[k + 1] - 1] for k in range(len(st) - 1)]
    with get_context("spawn").Pool(workers) as pool:
        parts = pool.map(_infgram_doc, [(str(index_dir), x) for x in docs], chunksize=4)
    return np.concatenate([p for p, _ in parts]), np.concatenate([s for _, s in parts])


def tune_interp(nll_lm: np.ndarray, p_other: np.ndarray, groups: np.ndarray | None = None) -> dict:
    """λ per group minimising -log(λ p_other + (1-λ) p_lm) (on validation)."""
    groups = np.zeros(len(nll_lm), int) if groups is None else groups.astype(int)
    p_lm = np.exp(-nll_lm)
    best = {}
    for g in np.unique(groups):
        m = groups == g
        losses = [float(-np.log(lam * p_other[m] + (1 - lam) * p_lm[m] + 1e-300).sum()) for lam in LAMBDAS]
        best[int(g)] = float(LAMBDAS[int(np.argmin(losses))])
    return best


def apply_interp(nll_lm: np.ndarray, p_other: np.ndarray, lams: dict, groups: np.ndarray | None = None) -> np.ndarray:
    groups = np.zeros(len(nll_lm), int) if groups is None else groups.astype(int)
    lam = np.vectorize(lambda g: lams.get(int(g), 0.0))(groups) if len(groups) else np.zeros(0)
    return -np.log(lam * p_other + (1 - lam) * np.exp(-nll_lm) + 1e-300)


def knn_search(keys: np.ndarray, queries: np.ndarray, k: int, device: str, work: Path):
    """(squared distances, key ids) of the k nearest keys: exact torch matmul search on a GPU,
    the FAISS IVF-PQ dense store on CPU."""
    import torch

    if device.startswith("cuda"):
        K = torch.from_numpy(keys).to(device, torch.float16)
        kn = (K.float() ** 2).sum(1)
        ds, ids = [], []
        for a in range(0, len(queries), 1024):
            q = torch.from_numpy(queries[a : a + 1024]).to(device)
            d2 = (q**2).sum(1, keepdim=True) + kn[None] - 2 * (q.half() @ K.T).float()
            v, i = torch.topk(d2, k, dim=1, largest=False)
            ds.append(v.cpu().numpy())
            ids.append(i.cpu().numpy())
        return np.concatenate(ds), np.concatenate(ids)
    from index import dense

    store_dir = work / f"dense-{abs(hash(keys.tobytes()[:4096]))}"
    if not (store_dir / "index.faiss").exists():
        dense.build(store_dir, keys, np.zeros(len(keys), np.uint32))
    store = dense.DenseStore(store_dir)
    d, i = store.index.search(np.ascontiguousarray(queries, np.float32), k)
    return d, i


def knn_variant(model, w: Path, feats: str | None, s: dict, valid: dict, test: dict, device: str, name: str) -> dict:
    """Tune and apply kNN-LM interpolation on top of a model's own token probabilities."""
    from model.dense import collect

    keys, vals = collect(model, w / "idx", feats, s["knn_positions"], device=device)
    out = {}
    nv = min(len(valid["target"]), s["knn_valid"])  # tuning needs only a sample of validation
    valid = {k: v[:nv] for k, v in valid.items()}
    for split, r in (("valid", valid), ("test", test)):
        d, i = knn_search(keys, r["hidden"], 64, device, w)
        out[split] = (d, np.where(i >= 0, vals[np.maximum(i, 0)], -1))
    from index.dense import knn_probs

    scale = float(np.median(out["valid"][0][:, 0])) + 1e-6
    best = None
    for temp in (0.3, 1.0, 3.0, 10.0):
        pk = knn_probs(out["valid"][0], out["valid"][1], valid["target"], temp * scale)
        lam = tune_interp(valid["nll"], pk)
        loss = float(apply_interp(valid["nll"], pk, lam).mean())
        if best is None or loss < best[0]:
            best = (loss, temp, lam)
    _, temp, lam = best
    pk = knn_probs(out["test"][0], out["test"][1], test["target"], temp * scale)
    print(f"{name}: kNN temperature {temp} x median distance, lambda {lam[0]}", flush=True)
    return {"nll": apply_interp(test["nll"], pk, lam), "lambda": lam[0], "temperature": temp * scale, "keys": len(keys)}


def stage_eval(w: Path, s: dict, workers: int, scale: str) -> dict:
    import torch

    from builder.tokenizer import load as load_tok
    from index import format as fmt
    from index.engine import Index
    from model.data import EvalData
    from model.evaluate import doc_bytes, summarize, token_eval
    from model.train import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    idx = Index(w / "idx")
    sp = load_tok(w / "idx" / "tokenizer.model")
    hv, ht = w / "hv", w / "ht"
    # per test document: domain, bytes, contamination (share of 13-grams found in the index)
    ev = EvalData(ht, 64, idx.eos_id, idx.sep)
    docs = fmt.read_json(ht / "000000.done")["docs"]
    domain = np.array(["code" if "code" in Path(d["source"]).name else "english" for d in docs])
    nbytes = doc_bytes(ev, sp.decode)
    L = np.asarray(ev.feats.length)
    contam = []
    for k in range(len(ev.starts) - 1):
        a, b = int(ev.starts[k]), int(ev.starts[k + 1]) - 1
        ll = L[a:b][12:]
        contam.append(float((ll >= 13).mean()) if len(ll) else 0.0)
    contam = np.array(contam)
    clean = contam < 0.8
    sets = {
        "test": np.ones(len(docs), bool),
        "test, decontaminated": clean,
        "test code": domain == "code",
        "test English": domain == "english",
    }
    results: dict[str, dict] = {}
    per_token: dict[str, np.ndarray] = {}
    evals = {}
    for v in VARIANTS:
        model, _ = load_model(w / "runs" / v, device)
        want_hidden = v in ("a", "e")
        evals[v] = (
            token_eval(model, hv, idx.eos_id, idx.sep, device, batch=s["eval_batch"], hidden=want_hidden),
            token_eval(model, ht, idx.eos_id, idx.sep, device, batch=s["eval_batch"], hidden=want_hidden),
        )
        per_token[v] = evals[v][1]["nll"]
        if v in ("a", "e"):
            feats = None if v == "a" else str(w / "feats-exdoc")
            r = knn_variant(model, w, feats, s, evals[v][0], evals[v][1], device, v)
            per_token["d" if v == "a" else "e+d"] = r["nll"]
            results["d" if v == "a" else "e+d"] = {"lambda": r["lambda"], "temperature": r["temperature"], "keys": r["keys"]}
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    t = time.time()
    pv, sv = infgram_probs(w / "idx", hv, workers)
    pt, st = infgram_probs(w / "idx", ht, workers)
    lam = tune_interp(evals["a"][0]["nll"], pv, sv)
    per_token["c"] = apply_interp(evals["a"][1]["nll"], pt, lam, st)
    results["c"] = {"lambda_non_sparse": lam.get(0, 0.0), "lambda_sparse": lam.get(1, 0.0), "infgram_s": time.time() - t}
    doc_of = evals["a"][1]["doc"].astype(int)
    names = {
        "a": "(a) no index",
        "b": "(b) TScale: cont embedding, causal",
        "b2": "(b') cont embedding, exclude-doc",
        "c": "(c) (a) + ∞-gram interpolation",
        "d": "(d) (a) + kNN-LM",
        "e": "(e) teragram",
        "e+d": "(e) + dense fallback",
    }
    rows = []
    for v in ("a", "b", "b2", "c", "d", "e", "e+d"):
        row = {"variant": names[v]}
        results.setdefault(v, {})
        for set_name, m in sets.items():
            tok_mask = m[doc_of]
            r = summarize(per_token[v][tok_mask], int(nbytes[m].sum()))
            results[v][set_name] = r
            row[f"{set_name} ppl"] = r["perplexity"]
            row[f"{set_name} bpb"] = r["bits_per_byte"]
        rows.append(row)
    dec = "test, decontaminated"
    ppl = {v: results[v][dec]["perplexity"] for v in results}
    best_peer = min(ppl[v] for v in ("b", "c", "d"))
    summary = {
        "decontaminated_removed_docs": int((~clean).sum()),
        "test_docs": len(docs),
        "e_vs_best_peer": 1 - ppl["e"] / best_peer,
        "e_vs_a": 1 - ppl["e"] / ppl["a"],
        "best_e": min(ppl["e"], ppl["e+d"]),
        "steps": s["steps"],
        "tokens_per_model": s["steps"] * s["batch_size"] * s["block_size"],
        "index_tokens": idx.n_tokens,
    }
    return {"rows": rows, "results": results, "summary": summary}


SHORT = {"a": "(a)", "b": "(b)", "b2": "(b')", "c": "(c)", "d": "(d)", "e": "(e)", "e+d": "(e)+(d)"}


def plots(w: Path, out: dict, logs: dict[str, Path] | None = None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(13, 4))
    rows = out["rows"]
    sets = ["test", "test, decontaminated", "test code", "test English"]
    x = np.arange(len(rows))
    for j, sname in enumerate(sets):
        ax[0].bar(x + (j - 1.5) * 0.2, [r[f"{sname} ppl"] for r in rows], 0.2, label=sname)
    ax[0].set_xticks(x, list(SHORT.values())[: len(rows)])
    ax[0].set_ylabel("perplexity")
    ax[0].set_yscale("log")
    ax[0].legend(fontsize=8)
    for v in VARIANTS:
        log = (logs or {}).get(v, w / "runs" / v / "log.jsonl")
        rs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        pts = [(r["step"], r["loss"]) for r in rs if r.get("loss")]
        if pts:
            ax[1].plot(*zip(*pts), label=VARIANTS[v][0])
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("training loss (nats/token)")
    ax[1].legend(fontsize=8)
    return fig


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="directory made by perplexity_data.py")
    ap.add_argument("--work", default=None)
    ap.add_argument("--scale", choices=list(SCALES), default="cpu")
    ap.add_argument("--stage", default="build,train,eval")
    ap.add_argument("--steps", type=int, help="override the scale's training steps")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--wait-seconds", type=int, default=420)
    args = ap.parse_args()
    s = dict(SCALES[args.scale])
    if args.steps:
        s["steps"] = args.steps
    w = Path(args.work or f"/tmp/tg-ppl-{args.scale}")
    w.mkdir(parents=True, exist_ok=True)
    stages = args.stage.split(",")
    t0 = time.time()
    timings = {}
    if "build" in stages:
        stage_build(Path(args.data), w, s, args.workers)
        timings["build_s"] = time.time() - t0
    if "train" in stages:
        t = time.time()
        stage_train(w, s, list(VARIANTS))
        timings["train_s"] = time.time() - t
    for st in stages:
        if st.startswith("train-ablation="):
            stage_train_ablation(w, s, st.split("=", 1)[1])
        if st.startswith("eval-ablation="):
            name = st.split("=", 1)[1]
            out = stage_eval_ablation(w, s, name)
            rows = [
                {"variant": out["variant"]}
                | {f"{k} ppl": v["perplexity"] for k, v in out["results"].items()}
                | {f"{k} bpb": v["bits_per_byte"] for k, v in out["results"].items()}
            ]
            cols = ["variant"] + [f"{n} {m}" for n in ("test", "test, decontaminated", "test code", "test English") for m in ("ppl", "bpb")]
            save(f"perplexity_{args.scale}_{name}", out, table(rows, cols))
    if "wait" in stages:  # for a training launched in the background (setsid) by an earlier call
        deadline = time.time() + args.wait_seconds
        while time.time() < deadline:
            done = [
                (w / "runs" / v / "latest.json").exists() and json.loads((w / "runs" / v / "latest.json").read_text())["step"] == s["steps"]
                for v in VARIANTS
            ]
            if all(done):
                break
            time.sleep(5)
        else:
            raise SystemExit("training not finished in --wait-seconds")
    if "eval" in stages:
        t = time.time()
        out = stage_eval(w, s, args.workers, args.scale)
        timings["eval_s"] = time.time() - t
        out["timings"] = timings
        out["scale"] = s
        cols = ["variant"] + [f"{n} {m}" for n in ("test", "test, decontaminated", "test code", "test English") for m in ("ppl", "bpb")]
        md = table(out["rows"], cols)
        sm = out["summary"]
        md += (
            f"\n\n{s['preset']} model, {sm['steps']} steps x {s['batch_size']}x{s['block_size']} tokens ({sm['tokens_per_model'] / 1e6:.1f}M training tokens per variant); "
            f"index of {sm['index_tokens'] / 1e6:.1f}M tokens. Decontamination removed {sm['decontaminated_removed_docs']} of {sm['test_docs']} test documents. "
            f"On the decontaminated test set (e) is {sm['e_vs_best_peer']:.1%} below the best of (b), (c), (d) in perplexity (bar 15%) and {sm['e_vs_a']:.1%} below (a) (bar 20%)."
        )
        save(f"perplexity_{args.scale}", out, md, plots(w, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
