"""Perplexity with and without the index, against the peers' methods, raw and decontaminated.

    python -m benchmarks.perplexity_data --out DATA --scale cpu      # corpora from Debian packages
    python -m benchmarks.perplexity --data DATA --scale cpu          # build, train, eval

Corpus: linux-source-6.1 plus the English packages (linux-doc-6.1, dict-gcide, manpages,
manpages-dev, jargon-text, fortunes, bible-kjv-text), split train / held-out by a hash of the
document path; held-out is split again (by hash) into validation (for tuning the peers'
interpolation weights) and test (reported). Index and features come from train only.

Trained variants, same model shape, training tokens and steps:
  a   no index
  b   TScale: continuation-token embedding, causal lookups (TScale's rule)
  e   all index inputs (exclude-doc lookups, blinded on half of the sequences) + learned mixture
  eo  the learned mixture only: the model reads no index inputs, its gate sees the match
Evaluated on top of them (everything tuned or fit on validation only):
  c   (a) + infini-gram's ∞-gram interpolation: one λ for sparse, one for non-sparse estimates
  c+c (c) plus the document cache's longest-match estimate (the one the gates read): fixed
      weights of model, ∞-gram and cache per group (sparse or not, crossed with whether the
      context occurred earlier in the document), by EM (model/mixture/baselines.py)
  d   (a) + kNN-LM from a dense store of (a)'s hidden states, λ and temperature tuned
  X+g a model's distribution mixed with the index's ∞-gram and fixed-order (2..17-gram)
      estimates and the document cache's (the same estimates from the document's own earlier
      text) by a learned softmax gate (model/mixture/gate.py; inputs: suffix lengths and
      counts, sparsity, model confidence, agreement), fit on validation
  a+gi, a+gc  ablations of a+g: the gate over the index's estimates only, the cache's only
  e+d (e) with the dense fallback interpolated
teragram's headline is the best of a+g, a+gi, e, e+d, e+g, eo, eo+g on the decontaminated
validation set (a+gc reads no index: it is not a candidate).
Held-out sets: test raw; test decontaminated (documents with >= 80% of their 13-grams in the
index removed, infini-gram's criterion); code and English parts of test. The same for
validation, where choices are made.
At --scale cpu the default variants are a, b, e (e' is left out to keep the CPU run short);
--variants picks others. Stages (--stage): build, train, eval (default all). On a 2-GPU machine the four trainings run
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
from teragram.model.mixture import baselines, estimates
from teragram.model.mixture import gate as gate_mod

from benchmarks.common import save, smoke_context, smoke_data, smoke_imports, table

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
        variants="a,b,e",  # (e') is left out to keep the CPU run short
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
        variants="a,b,e,eo",
    ),
}
VARIANTS = {
    "a": ("no index", ["--use_index=false"]),
    "b": ("TScale: continuation embedding, causal", ["--features={w}/feats-causal", "--index_inputs=cont", "--mixture=false"]),
    "e": ("index inputs + learned mixture", ["--features={w}/feats-exdoc", "--index_dropout=0.5"]),
    "eo": ("learned mixture, no index inputs", ["--features={w}/feats-exdoc", "--index_inputs="]),
}
GPU_OF = {"a": 0, "b": 0, "e": 1, "eo": 1}


def sh(*cmd, **kw):
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=REPO, check=True, **kw)


def in_valid_half(path: str) -> bool:
    """Whether a held-out document goes to validation (else test): a second hash of its path."""
    return int.from_bytes(hashlib.blake2b(f"valid:{path}".encode(), digest_size=8).digest(), "big") % 2 == 0


# ---- build -----------------------------------------------------------------------------------


def stage_build(data: Path, w: Path, s: dict, workers: int, variants: list[str]) -> None:
    import zstandard

    py = sys.executable
    train = [data / "train-code.jsonl.zst", data / "train-english.jsonl.zst"]
    sh(py, "-m", "teragram.builder.cli", *train, "--out", w / "idx", "--vocab-size", s["vocab"], "--workers", workers, "--quiet")
    for split in ("valid", "test"):
        (w / "heldout" / split).mkdir(parents=True, exist_ok=True)
    for dom in ("code", "english"):
        outs = {sp: open(w / "heldout" / sp / f"{dom}.jsonl", "w") for sp in ("valid", "test")}
        with zstandard.open(data / f"heldout-{dom}.jsonl.zst", "rt") as f:
            for line in f:
                rec = json.loads(line)
                outs["valid" if in_valid_half(rec["path"]) else "test"].write(line)
        for o in outs.values():
            o.close()

    def features(out: str, *opts) -> None:
        sh(py, "-m", "teragram.serve.main", "features", w / "idx", "--out", w / out, *opts, "--workers", workers, "--quiet")

    if {"e", "eo"} & set(variants):
        features("feats-exdoc", "--mode", "exclude-doc", "--top-k", 4)
    if "b" in variants:
        features("feats-causal", "--mode", "causal", "--top-k", 0)
    for split, name in (("valid", "hv"), ("test", "ht")):
        features(name, "--corpus", w / "heldout" / split, "--top-k", 4)


# ---- train -----------------------------------------------------------------------------------


def train_cmd(v: str, w: Path, s: dict, out: Path | None = None) -> list[str]:
    """The training command of variant v with scale s's settings, into out (default W/runs/V)."""
    extra = [x.format(w=w) for x in VARIANTS[v][1]]
    return [
        sys.executable, "-m", "teragram.serve.main", "train", f"--index={w / 'idx'}", f"--out={out or w / 'runs' / v}", f"--preset={s['preset']}",
        f"--block_size={s['block_size']}", f"--batch_size={s['batch_size']}", f"--max_steps={s['steps']}", f"--lr={s['lr']}",
        f"--min_lr={s['min_lr']}", f"--warmup={s['warmup']}", "--log_every=25", "--progress=false", f"--seed={s.get('seed', 7)}", *extra,
    ]  # fmt: skip


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
    from teragram.index import dense

    store_dir = work / f"dense-{abs(hash(keys.tobytes()[:4096]))}"
    if not (store_dir / "index.faiss").exists():
        dense.build(store_dir, keys, np.zeros(len(keys), np.uint32))
    store = dense.DenseStore(store_dir)
    d, i = store.index.search(np.ascontiguousarray(queries, np.float32), k)
    return d, i


def knn_variant(model, w: Path, feats: str | None, s: dict, ev: dict, device: str, name: str) -> dict:
    """kNN-LM on top of a model's final distribution: temperature and λ tuned on (a sample of)
    validation, applied to validation and test."""
    from teragram.model.mixture.dense import collect

    keys, vals = collect(model, w / "idx", feats, s["knn_positions"], device=device)
    nv = min(len(ev["valid"]["target"]), s["knn_valid"])  # tuning needs only a sample of validation
    pk = {}
    for split, r in ev.items():
        d, i = knn_search(keys, r["hidden"], 64, device, w)
        pk[split] = (d, np.where(i >= 0, vals[np.maximum(i, 0)], -1))
    fit = baselines.fit_knn(ev["valid"]["nll"][:nv], pk["valid"][0][:nv], pk["valid"][1][:nv], ev["valid"]["target"][:nv])
    print(f"{name}: kNN temperature {fit['temperature_factor']} x median distance, lambda {fit['lambda']}", flush=True)
    nll = {sp: baselines.knn_nll(r["nll"], *pk[sp], r["target"], fit) for sp, r in ev.items()}
    return {"nll": nll, "lambda": fit["lambda"], "temperature": fit["temperature"], "keys": len(keys)}


def doc_sets(heldout: Path, idx, sp, split: str) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Document masks of a held-out split (all, decontaminated, code, English), bytes per
    document, and each document's contamination: the share of its 13-grams found in the index
    (infini-gram's criterion; >= 0.8 is removed)."""
    from teragram.index import format as fmt
    from teragram.index.heldout import contamination
    from teragram.model.evaluation.perplexity import doc_bytes
    from teragram.model.training.data import EvalData

    ev = EvalData(heldout, 64, idx.eos_id, idx.sep)
    docs = fmt.read_json(heldout / "000000.done")["docs"]
    domain = np.array(["code" if "code" in Path(d["source"]).name else "english" for d in docs])
    contam = contamination(heldout)
    sets = {
        split: np.ones(len(docs), bool),
        f"{split}, decontaminated": contam < 0.8,
        f"{split} code": domain == "code",
        f"{split} English": domain == "english",
    }
    return sets, doc_bytes(ev, sp.decode), contam


NAMES = {
    "a": "(a) no index",
    "b": "(b) TScale: cont embedding, causal",
    "c": "(c) (a) + ∞-gram interpolation (infini-gram: 2 λ)",
    "c+c": "(c+cache) (c) + the document cache, interpolated (weights per group)",
    "d": "(d) (a) + kNN-LM",
    "a+g": "(t) (a) + learned gate over the index's and the document cache's estimates",
    "a+gi": "(t-c) (t) without the document cache: the index's estimates only",
    "a+gc": "(a+c) (a) + the document cache's estimates only (no index)",
    "e": "(e) index inputs + learned mixture",
    "e+d": "(e) + dense fallback",
    "e+g": "(e) + learned index gate",
    "eo": "(e') learned mixture, no index inputs",
    "eo+g": "(e') + learned index gate",
}
TERAGRAM = ("a+g", "a+gi", "e", "e+d", "e+g", "eo", "eo+g")  # the headline is the best of these on validation


def stage_eval(w: Path, s: dict, workers: int, variants: list[str]) -> dict:
    import torch
    from teragram.index.engine import Index
    from teragram.index.tokenizer import load as load_tok
    from teragram.model.checkpoint import load_model
    from teragram.model.evaluation.perplexity import summarize, token_eval

    device = "cuda" if torch.cuda.is_available() else "cpu"
    idx = Index(w / "idx")
    sp = load_tok(w / "idx" / "tokenizer.model")
    held = {"valid": w / "hv", "test": w / "ht"}
    t = time.time()
    inf = {split: estimates.heldout_estimates(w / "idx", path, workers) for split, path in held.items()}
    infgram_s = time.time() - t
    sets, nbytes, contam = {}, {}, {}
    for split, path in held.items():
        sets[split], nbytes[split], contam[split] = doc_sets(path, idx, sp, split)
    results: dict[str, dict] = {v: {} for v in NAMES}
    nll: dict[str, dict[str, np.ndarray]] = {}  # variant -> split -> per-token nll
    docs: dict[str, np.ndarray] = {}

    def gated(v: str, ev: dict, key: str, comps: tuple[str, ...]) -> None:
        """The model's distribution and the estimates `comps` (index, document cache), mixed by
        a gate fit on validation."""
        X = {sp_: gate_mod.gate_inputs(inf[sp_], ev[sp_]["maxp"], ev[sp_]["top"], comps) for sp_ in held}
        logp = {sp_: gate_mod.component_logp(inf[sp_], ev[sp_]["nll"], comps) for sp_ in held}
        gate = gate_mod.Gate.fit(X["valid"], logp["valid"], components=comps)
        gate.save(w / f"gate-{key}.json")
        nll[key] = {sp_: gate_mod.mix_nll_multi(logp[sp_], gate(X[sp_])) for sp_ in held}
        results[key]["mean_weights_test"] = dict(zip(("model", *comps), gate(X["test"]).mean(0).tolist(), strict=True))

    phases = {"estimates_s": infgram_s}  # where the evaluation's time goes
    for v in variants:
        t = time.time()
        model, _ = load_model(w / "runs" / v, device)
        hid = v in ("a", "e")
        ev = {sp_: token_eval(model, path, idx.eos_id, idx.sep, device, batch=s["eval_batch"], hidden=hid) for sp_, path in held.items()}
        docs = {sp_: r["doc"].astype(int) for sp_, r in ev.items()}
        nll[v] = {sp_: r["nll"] for sp_, r in ev.items()}
        phases[f"model_{v}_s"] = time.time() - t
        if hid:
            t = time.time()
            r = knn_variant(model, w, None if v == "a" else str(w / "feats-exdoc"), s, ev, device, v)
            k = "d" if v == "a" else "e+d"
            nll[k] = r.pop("nll")
            results[k].update(r)
            phases[f"knn_{v}_s"] = time.time() - t
        t = time.time()
        if v == "a":
            groups = {sp_: inf[sp_]["sparse"].astype(int) for sp_ in held}
            lam = baselines.fit_lambdas(ev["valid"]["nll"], inf["valid"]["p_index_infgram"], groups["valid"])
            nll["c"] = {sp_: baselines.apply_lambdas(ev[sp_]["nll"], inf[sp_]["p_index_infgram"], lam, groups[sp_]) for sp_ in held}
            results["c"].update(lambda_non_sparse=lam.get(0, 0.0), lambda_sparse=lam.get(1, 0.0), infgram_s=infgram_s)
            mix = {sp_: baselines.infgram_cache_inputs(inf[sp_]) for sp_ in held}  # (p_inf, p_cache, groups)
            cw = baselines.fit_cache_weights(ev["valid"]["nll"], *mix["valid"])
            nll["c+c"] = {sp_: baselines.apply_cache_weights(ev[sp_]["nll"], *mix[sp_][:2], cw, mix[sp_][2]) for sp_ in held}
            results["c+c"]["weights"] = {
                baselines.CACHE_GROUPS[g]: dict(zip(baselines.CACHE_WEIGHTS, wg, strict=True)) for g, wg in cw.items()
            }
        if v in ("a", "e", "eo"):
            gated(v, ev, v + "+g", estimates.COMPONENTS)
        if v == "a":
            gated(v, ev, "a+gi", estimates.INDEX)
            gated(v, ev, "a+gc", estimates.CACHE)
        phases[f"mixtures_{v}_s"] = time.time() - t
        del model, ev
        if device == "cuda":
            torch.cuda.empty_cache()
    rows, vrows = [], []
    for v in [v for v in NAMES if v in nll]:
        for split, out in (("test", rows), ("valid", vrows)):
            row = {"variant": NAMES[v]}
            for set_name, m in sets[split].items():
                r = summarize(nll[v][split][m[docs[split]]], int(nbytes[split][m].sum()))
                results[v][set_name] = r
                col = set_name.replace(split, "", 1).strip(" ,") or "all"
                row[f"{col} ppl"] = r["perplexity"]
                row[f"{col} bpb"] = r["bits_per_byte"]
            out.append(row)
    results = {v: r for v, r in results.items() if v in nll}
    ppl = {v: results[v]["test, decontaminated"]["perplexity"] for v in results}
    best = min(
        (v for v in TERAGRAM if v in results), key=lambda v: results[v]["valid, decontaminated"]["perplexity"]
    )  # chosen on validation
    peers = [v for v in ("b", "c", "c+c", "d") if v in ppl]
    best_peer = min(ppl[v] for v in peers)
    summary = {
        "decontaminated_removed_docs": int((contam["test"] >= 0.8).sum()),
        "test_docs": len(contam["test"]),
        "valid_removed_docs": int((contam["valid"] >= 0.8).sum()),
        "valid_docs": len(contam["valid"]),
        "teragram": best,
        "peers": peers,
        "teragram_vs_best_peer": 1 - ppl[best] / best_peer,
        "teragram_vs_a": 1 - ppl[best] / ppl["a"],
        "steps": s["steps"],
        "tokens_per_model": s["steps"] * s["batch_size"] * s["block_size"],
        "index_tokens": idx.n_tokens,
    }
    return {"rows": rows, "valid_rows": vrows, "results": results, "summary": summary, "eval_phases": phases}


SETS = ("all", "decontaminated", "code", "English")


def plots(w: Path, out: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(14, 4.5))
    rows = out["rows"]
    x = np.arange(len(rows))
    for j, sname in enumerate(SETS):
        ax[0].bar(x + (j - 1.5) * 0.2, [r[f"{sname} ppl"] for r in rows], 0.2, label=f"test, {sname}")
    ax[0].set_xticks(
        x,
        [r["variant"].split(")")[0] + ")" + ("+" + r["variant"].split("+ ")[-1][:6] if "+ " in r["variant"] else "") for r in rows],
        rotation=60,
        fontsize=7,
    )
    ax[0].set_ylabel("perplexity")
    ax[0].set_yscale("log")
    ax[0].legend(fontsize=8)
    for v in out["variants"]:
        log = w / "runs" / v / "log.jsonl"
        rs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        pts = [(r["step"], r["loss"]) for r in rs if r.get("loss")]
        if pts:
            ax[1].plot(*zip(*pts), label=VARIANTS[v][0])
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("training loss (nats/token)")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def main() -> int:
    if "--smoke" in sys.argv[1:]:  # the build stage on a tiny DATA (train and eval: three trainings, too slow for a smoke run)
        with smoke_context(True) as tmp:
            sys.argv = [sys.argv[0], "--data", str(smoke_data(tmp) / "ppl"), "--work", str(tmp / "w"), "--scale", "cpu", "--stage", "build"]
            sys.argv += ["--variants", "a", "--workers", "1"]
            main()
        return smoke_imports(
            "benchmarks.common",
            "teragram.index",
            "teragram.index.engine",
            "teragram.index.heldout",
            "teragram.index.tokenizer",
            "teragram.model.checkpoint",
            "teragram.model.evaluation.perplexity",
            "teragram.model.mixture.dense",
            "teragram.model.training.data",
        )
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="directory made by perplexity_data.py")
    ap.add_argument("--work", default=None)
    ap.add_argument("--scale", choices=list(SCALES), default="cpu")
    ap.add_argument("--stage", default="build,train,eval")
    ap.add_argument("--steps", type=int, help="override the scale's training steps")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--wait-seconds", type=int, default=420)
    ap.add_argument("--variants", help="the models to train and evaluate (default: the scale's; known: " + ",".join(VARIANTS) + ")")
    ap.add_argument("--tag", default="", help="suffix of the results' name")
    args = ap.parse_args()
    s = dict(SCALES[args.scale])
    if args.steps:
        s["steps"] = args.steps
    w = Path(args.work or f"/tmp/tg-ppl-{args.scale}")
    w.mkdir(parents=True, exist_ok=True)
    stages = args.stage.split(",")
    variants = (args.variants or s["variants"]).split(",")
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    t0 = time.time()
    timings = {}
    if "build" in stages:
        stage_build(Path(args.data), w, s, args.workers, variants)
        timings["build_s"] = time.time() - t0
    if "train" in stages:
        t = time.time()
        stage_train(w, s, variants)
        timings["train_s"] = time.time() - t
    if "wait" in stages:  # for a training launched in the background (setsid) by an earlier call
        deadline = time.time() + args.wait_seconds
        while time.time() < deadline:
            done = [
                (w / "runs" / v / "latest.json").exists() and json.loads((w / "runs" / v / "latest.json").read_text())["step"] == s["steps"]
                for v in variants
            ]
            if all(done):
                break
            time.sleep(5)
        else:
            raise SystemExit("training not finished in --wait-seconds")
    if "eval" in stages:
        t = time.time()
        out = stage_eval(w, s, args.workers, variants)
        out["variants"] = variants
        timings["eval_s"] = time.time() - t
        out["timings"] = timings
        out["scale"] = s
        cols = ["variant"] + [f"{n} {m}" for n in SETS for m in ("ppl", "bpb")]
        sm = out["summary"]
        md = "Test set (reported):\n\n" + table(out["rows"], cols)
        md += (
            f"\n\n{s['preset']} model, {sm['steps']} steps x {s['batch_size']}x{s['block_size']} tokens ({sm['tokens_per_model'] / 1e6:.1f}M training tokens per variant); "
            f"index of {sm['index_tokens'] / 1e6:.1f}M tokens. Decontamination removed {sm['decontaminated_removed_docs']} of {sm['test_docs']} test documents "
            f"({sm['valid_removed_docs']} of {sm['valid_docs']} validation documents). teragram's headline variant, chosen on decontaminated validation perplexity, "
            f"is {NAMES[sm['teragram']]}: on the decontaminated test set it is {sm['teragram_vs_best_peer']:.1%} below the best of {', '.join(NAMES[v].split(' ')[0] for v in sm['peers'])} in perplexity "
            f"and {sm['teragram_vs_a']:.1%} below (a).\n\nValidation set (λ, gates and the headline variant are chosen here):\n\n"
        )
        md += table(out["valid_rows"], cols)
        md += "\n\nTime (s): " + ", ".join(f"{k[:-2]} {v:.0f}" for k, v in (timings | out["eval_phases"]).items()) + ".\n"
        save(f"perplexity_{args.scale}{args.tag}", out, md, plots(w, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
