"""What a bigger index buys: perplexity on new text as the index grows, one model throughout; with
the continuous cache saved, the best system (issue 46): (t+cc) and the product's choice.

    python -m benchmarks.index_size prepare --data DATA --carry .carry14          # here
    python -m benchmarks.index_size gpu --carry .carry14 --work W --out OUT       # on a GPU
    python -m benchmarks.index_size eval --outputs OUT --index IDX... [--workers 2]  # here

The model is the perplexity benchmark's (a): a 125M GPT with no index inputs, trained on the
~47M tokens of DATA/ppl/train-* (linux-source-6.1 C and English Debian text; same settings as
`benchmarks/perplexity.py --scale gpu`). `gpu` trains it once and saves its per-token outputs
(`model/evaluation/outputs.py`) on every held-out set; `eval` mixes those outputs with each index given,
here, where the indexes live. Every index must contain the model's training text and share
its tokenizer (DATA/idx-050m/tokenizer.model); the larger ones add documents of other Debian
code and text packages, nested (tools/corpora.py).

Held-out sets, each split into validation (every λ and gate is fit there) and test (reported):
  indist     the perplexity benchmark's held-out documents (split from training by path hash)
  timeshift  files new in linux-source-6.12 (absent from 6.1): text written after the index
  prose      English prose from a source no index holds
  packages   (when DATA/heldout/packages exists) code of whole packages held out of every index
             by a hash of the package name: projects no index holds
Variants per index and set: (a) the model alone; (c) infini-gram's interpolation (two λ);
(c+cache) infini-gram's interpolation plus the same document cache the gates read (fixed
weights per group, by EM: model/mixture/baselines.py); (t-c) the gate over the index's estimates only;
(a+c) the gate over the document cache's estimates only (no index: constant across sizes); (t)
the gate over both. With outputs saved with the continuous cache (the document's own earlier
states, as `teragram eval --save-outputs` keeps them): (t+cc) the gate over both and the
continuous cache, and the product's choice (what `eval --fit-gate` keeps: (t) or (t+cc), chosen
on half the validation documents, fit on all; `gpu --product` also runs those commands alone
from the checkpoint, and `eval` compares their figures with (t+cc)). Also reported: the share of targets whose context has a match of >= 8 /
16 / 32 tokens, the ∞-gram's argmax accuracy by match length, and decontaminated test
perplexity (documents with >= 80% of their 13-grams in that index removed). The variants are
fit in benchmarks/lib/index_size_variants.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import save, sh, smoke_context, smoke_data, smoke_index, smoke_model, smoke_short_fits, table
from benchmarks.lib.index_size_variants import CC_NAMES, HALVES, NAMES, clean_documents, variants

SETS = ("indist", "timeshift", "prose")
PACKAGES = "packages"  # the fourth set, when DATA/heldout/packages exists: code of whole packages no index holds
LENGTH_BUCKETS = (0, 1, 4, 8, 16, 32)  # ∞-gram accuracy by match length: [0], [1, 4), ...


# ---- prepare (here) and gpu (on the GPU machine) -----------------------------------------------


def _sample(src: Path, dst: Path, max_bytes: int) -> dict:
    """Documents of a held-out file in the order of a hash of their path, up to max_bytes of text
    (a random sample, not a prefix of a sorted list)."""
    import hashlib

    import zstandard

    with zstandard.open(src, "rt") as f:
        recs = [json.loads(line) for line in f]
    recs.sort(key=lambda r: hashlib.blake2b(r["path"].encode(), digest_size=8).digest())
    n = docs = 0
    with zstandard.open(dst, "wt") as f:
        for r in recs:
            if n >= max_bytes:
                break
            f.write(json.dumps(r) + "\n")
            n, docs = n + len(r["text"].encode()), docs + 1
    return {"docs": docs, "of": len(recs), "bytes": n}


def stage_prepare(data: Path, carry: Path, max_mb: float) -> None:
    """What the GPU machine needs, < 64 MB: the training text, the tokenizer, the held-out sets
    (each half sampled down to max_mb of text, so that the outputs come back and the index side
    stays minutes per index)."""
    carry.mkdir(parents=True, exist_ok=True)
    for name in ("train-code.jsonl.zst", "train-english.jsonl.zst"):
        shutil.copyfile(data / "ppl" / name, carry / name)
    shutil.copyfile(data / "idx-050m" / "tokenizer.model", carry / "tokenizer.model")
    info = {}
    for s in (*SETS, PACKAGES) if (data / "heldout" / PACKAGES).is_dir() else SETS:
        (carry / s).mkdir(exist_ok=True)
        for h in HALVES:
            info[f"{s}/{h}"] = _sample(data / "heldout" / s / f"{h}.jsonl.zst", carry / s / f"{h}.jsonl.zst", int(max_mb * 1e6))
    (carry / "prepare.json").write_text(json.dumps(info, indent=1))
    size = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    print(json.dumps(info, indent=1))
    print(f"{carry}: {size / 1e6:.1f} MB")


def index_train_text(carry: Path, work: Path) -> None:
    """WORK/idx: the carried training text indexed with the carried tokenizer, on every core."""
    import os

    text = [carry / "train-code.jsonl.zst", carry / "train-english.jsonl.zst"]
    opts = ["--out", work / "idx", "--tokenizer", carry / "tokenizer.model", "--workers", os.cpu_count(), "--quiet"]
    sh(sys.executable, "-m", "teragram.builder.cli", *text, *opts)


def stage_gpu(carry: Path, work: Path, out: Path, scale: str, product: bool = False) -> None:
    """Index the training text with the carried tokenizer, train (a), save its outputs, and with
    product, run the product commands from its checkpoint (product_from_checkpoint) (scale "cpu":
    the perplexity benchmark's tiny model, to try the pipeline without a GPU)."""
    import os

    import torch
    from teragram.index.engine import Index

    from benchmarks.perplexity import SCALES, train_cmd

    s = SCALES[scale]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = time.time()
    index_train_text(carry, work)
    phases = {"index_s": time.time() - t}
    t = time.time()
    sh(*train_cmd("a", work, s))
    phases["train_s"] = time.time() - t
    t = time.time()
    held = heldout_features(work / "idx", work / "heldout", carry, os.cpu_count() or 1)
    save_outputs_a(work, out, held, s["eval_batch"], device)
    phases["outputs_s"] = time.time() - t
    if product:
        t = time.time()
        product_from_checkpoint(work / "runs" / "a", work / "idx", carry, out, device, os.cpu_count() or 1)
        phases["product_s"] = time.time() - t
    log = [json.loads(line) for line in open(work / "runs" / "a" / "log.jsonl")]
    info = {
        "train_log": log,
        "phases": phases,
        "index_tokens": Index(work / "idx").n_positions,
        "scale": scale,
        "torch": torch.__version__,
        "device": device,
    }
    (out / "gpu.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


def carried_sets(carry: Path) -> tuple[str, ...]:
    """The held-out sets prepare carried (the fourth, packages, where DATA had it)."""
    return tuple(s for s in (*SETS, PACKAGES) if (carry / s).is_dir())


def heldout_features(index: Path, root: Path, carry: Path, workers: int) -> dict:
    """Held-out features of every carried half against the index, ROOT/SET-HALF (test halves
    first: the figures reported); a half already written against this index is kept (one of
    another index or text is refused by compute_features). Returns {(set, half): dir}."""
    from teragram.builder.features import FeatureConfig, compute_features
    from teragram.index import format as fmt

    digest = fmt.file_digest(index / "manifest.json")
    held = {}
    for h in ("test", "valid"):
        for name in carried_sets(carry):
            d, corpus = root / f"{name}-{h}", [str(carry / name / f"{h}.jsonl.zst")]
            held[name, h] = d
            m = fmt.read_json(d / "manifest.json") if (d / "manifest.json").exists() else {}
            if (m.get("index_manifest"), m.get("corpus")) != (digest, corpus):
                compute_features(index, d, FeatureConfig("held-out", 64, 1), corpus=corpus, workers=workers)
    return held


def save_outputs_a(work: Path, out: Path, held: dict, batch: int, device: str, run: Path | None = None) -> None:
    """(a)'s (RUN, default WORK/runs/a) per-token outputs on each held-out half (held[set, half]: its features
    directory), as `teragram eval --save-outputs` saves them: with the continuous cache's p(target),
    its scale fit on the validation half and the test half saved at that scale (--cont-cache-from).
    One .tgz each in OUT: one file each, so that < 16 MB comes back."""
    from teragram.index.engine import Index
    from teragram.model.checkpoint import load_model
    from teragram.model.evaluation.outputs import save_model_outputs

    model, meta = load_model(run or work / "runs" / "a", device)
    idx = Index(work / "idx")
    spec = {}
    for (name, h), feats in sorted(held.items(), key=lambda kv: kv[0][1] != "valid"):  # valid halves first
        dst = work / "outputs" / f"{name}-{h}"
        spec[name] = save_model_outputs(dst, model, feats, idx, device, meta=meta, source="a", cont_cache=spec.get(name), batch=batch)
        with tarfile.open(out / f"outputs-{name}-{h}.tgz", "w:gz") as tar:
            tar.add(dst, arcname=f"{name}-{h}")


# ---- eval (here, where the indexes live) ------------------------------------------------------


def _ppl(nll: np.ndarray) -> float:
    return float(np.exp(nll.mean())) if len(nll) else float("nan")


def stage_eval(outputs: Path, indexes: list[Path], workers: int, max_targets: int | None = None) -> dict:
    """Each index's figures, kept in OUTPUTS/eval/INDEX.json (keyed by the index's manifest) so
    that adding a larger index later evaluates only that one."""
    import hashlib

    from teragram.model.evaluation.outputs import load_outputs, outputs_estimates, truncate_outputs

    unpacked = outputs / "unpacked"
    sets = tuple(s for s in (*SETS, PACKAGES) if (outputs / f"outputs-{s}-test.tgz").exists())
    for name in sets:
        for h in HALVES:
            if not (unpacked / f"{name}-{h}").exists():
                with tarfile.open(outputs / f"outputs-{name}-{h}.tgz") as tar:
                    tar.extractall(unpacked, filter="data")
    outs = {name: {h: load_outputs(unpacked / f"{name}-{h}") for h in HALVES} for name in sets}
    names = set(NAMES) | (set(CC_NAMES) if all(o.cont_cache is not None for oh in outs.values() for o in oh.values()) else set())
    if max_targets:  # the first documents of each half (they were saved in hash order: a random sample)
        outs = {
            n: {h: truncate_outputs(o, unpacked / f"first{max_targets}" / f"{n}-{h}", max_targets) for h, o in oh.items()}
            for n, oh in outs.items()
        }
    results = []
    cache_only: dict[str, dict] = {}
    for root in indexes:
        manifest = (root / "manifest.json").read_bytes()
        key = hashlib.sha256(manifest).hexdigest()[:16]
        tag = f"-first{max_targets}" if max_targets else ""
        saved = outputs / "eval" / f"{root.name}{tag}.json"
        old = json.loads(saved.read_text()) if saved.exists() else {}
        if (
            old.get("manifest_sha256") == key
            and set(old["sets"]) == set(sets)
            and all(names <= set(s["ppl"]) and "test_doc_nll" in s for s in old["sets"].values())
        ):
            results.append(old)
            print(f"{root.name}: evaluated before ({saved})", flush=True)
            continue
        tokens = json.loads(manifest)["counts"]["tokens"]
        row = {"index": root.name, "index_tokens": tokens, "manifest_sha256": key, "sets": {}}
        for name in sets:
            t = time.time()
            o = outs[name]
            est = {h: outputs_estimates(o[h], root, workers=workers) for h in HALVES}
            est_s = time.time() - t
            nll, weights = variants(o, est, cache_only.get(name))
            cache_only[name] = {v: nll[v] for v in ("a+c", "a+cc") if v in nll}
            test = o["test"]
            clean_docs = clean_documents(test, est["test"])
            clean = clean_docs[test.doc.astype(np.int64)]
            L, y = est["test"]["index_length"], test.target.astype(np.int64)
            hit = est["test"]["top_index_infgram"] == y
            acc = {}
            for lo, hi in zip(LENGTH_BUCKETS, (*LENGTH_BUCKETS[1:], 1 << 30)):
                m = (L >= lo) & (L < hi)
                acc[f"{lo}+" if hi > 1 << 20 else f"{lo}-{hi - 1}"] = {
                    "share": float(m.mean()),
                    "accuracy": float(hit[m].mean()) if m.any() else None,
                }
            row["sets"][name] = {
                "test_tokens": int(len(y)),
                "test_docs": len(clean_docs),
                "decontaminated_docs": int(clean_docs.sum()),
                "ppl": {v: _ppl(n["test"]) for v, n in nll.items()},
                "ppl_valid": {v: _ppl(n["valid"]) for v, n in nll.items()},
                "ppl_decontaminated": {v: _ppl(n["test"][clean]) for v, n in nll.items()},
                "weights": weights,
                "test_doc_tokens": np.bincount(test.doc.astype(np.int64), minlength=len(clean_docs)).tolist(),
                "test_doc_nll": {
                    v: np.bincount(test.doc.astype(np.int64), weights=n["test"], minlength=len(clean_docs)).tolist() for v, n in nll.items()
                },
                "test_clean_docs": clean_docs.astype(int).tolist(),
                "match_share": {str(k): float((L >= k).mean()) for k in (8, 16, 32)},
                "infgram_accuracy_by_length": acc,
                "estimates_s": est_s,
                "total_s": time.time() - t,
            }
            print(f"{root.name} {name}: " + ", ".join(f"{v} {p:.3g}" for v, p in row["sets"][name]["ppl"].items()), flush=True)
        saved.parent.mkdir(exist_ok=True)
        saved.write_text(json.dumps(row, indent=1))
        results.append(row)
    return {"indexes": results, "workers": workers}


def report(res: dict, results_name: str = "index_size") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(res["indexes"], key=lambda r: r["index_tokens"])
    sets = [s for s in (*SETS, PACKAGES) if s in rows[0]["sets"]]
    names = {v: n for v, n in (NAMES | CC_NAMES).items() if all(v in r["sets"][s]["ppl"] for r in rows for s in sets)}
    md = []
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4))
    for ax, name in zip(axes, sets):
        trs = []
        for r in rows:
            s = r["sets"][name]
            tr = {"index tokens": f"{r['index_tokens'] / 1e6:,.0f}M"}
            tr |= {names[v]: f"{s['ppl'][v]:.3g} / {s['ppl_decontaminated'][v]:.3g}" for v in names}
            if "choice" in names:
                tr["chosen"] = "(t+cc)" if s["weights"]["choice"]["chosen"] == "gate+cont_cache" else "(t)"
            tr |= {f"match >= {k}": f"{100 * s['match_share'][str(k)]:.0f}%" for k in (8, 16, 32)}
            trs.append(tr)
        first = rows[0]["sets"][name]
        md.append(
            f"**{name}** test set ({first['test_docs']} documents, {first['test_tokens']:,} tokens), perplexity all / decontaminated:\n\n"
            + table(trs, list(trs[0]))
        )
        x = [r["index_tokens"] for r in rows]
        for v in names:
            ax.plot(x, [r["sets"][name]["ppl"][v] for r in rows], marker="o", label=names[v])
        ax.set_xscale("log")
        ax.set_xlabel("index tokens")
        ax.set_ylabel("test perplexity")
        ax.set_title(name)
    axes[0].legend(fontsize=7)
    big = rows[-1]
    lines = []
    for name in sets:
        p = big["sets"][name]["ppl"]
        lines.append(
            f"- {name}, largest index ({big['index_tokens'] / 1e6:,.0f}M tokens): (t-c) is {100 * (1 - p['t-c'] / p['a']):.1f}% below (a); "
            f"(t) is {100 * (1 - p['t'] / p['a+c']):.1f}% below the cache-only gate (a+c) "
            f"and {100 * (1 - p['t'] / p['c+c']):.1f}% below the peers' interpolation with the same cache (c+cache)."
        )
    if "choice" in names:
        lines += best_system_bars(rows, sets)
    if "product_check" in res:
        pc = res["product_check"]
        lines.append(
            f"- The product commands alone, from the checkpoint on {pc['device']} (`teragram eval --checkpoint RUN --corpus VALID "
            f"--index {pc['index']} --fit-gate G`, then `--corpus TEST --gate G --decontaminate`), test perplexity all / decontaminated "
            "against this table's (t+cc): "
            + "; ".join(
                f"{n} {c['product']['all']:.4g} / {c['product']['decontaminated']:.4g} vs {c['t+cc']['all']:.4g} / "
                f"{c['t+cc']['decontaminated']:.4g} ({c['ratio']['all']:.4f}x / {c['ratio']['decontaminated']:.4f}x, chose {c['chosen']})"
                for n, c in pc["sets"].items()
            )
            + f" (bar: within 0.5%: {'met' if pc['within_bar'] else 'missed'})."
        )
        lines.append(
            "- Their end-to-end speed (process start to report, features, model, continuous cache, estimates, gate): "
            + "; ".join(
                f"{n} {h} {c['tokens'][h] / c['wall_s'][h]:,.0f} tokens/s ({', '.join(f'{k} {v:.1f} s' for k, v in c['stages_s'][h].items())})"
                for n, c in pc["sets"].items()
                for h in c["tokens"]
            )
            + "."
        )
    acc = []
    for name in sets:
        by = big["sets"][name]["infgram_accuracy_by_length"]
        acc.append(
            {"set": name}
            | {
                f"L {k}": f"{100 * v['share']:.0f}% / {100 * v['accuracy']:.0f}%" if v["accuracy"] is not None else "0%"
                for k, v in by.items()
            }
        )
    md.append(
        "∞-gram argmax accuracy by match length at the largest index (share of test targets / accuracy):\n\n" + table(acc, list(acc[0]))
    )
    lines.append(
        "- Index side of the evaluation (bulk estimates of both halves of a set, index/bulk.py, "
        f"{res['workers']} threads): "
        + "; ".join(f"{r['index']} {sum(s['estimates_s'] for s in r['sets'].values()):.0f} s" for r in rows)
        + f" for all {sum(r['sets'][n]['test_tokens'] for n in sets for r in rows[:1]):,} test tokens and their validation halves."
    )
    save(results_name, res, "\n\n".join(md) + "\n\n" + "\n".join(lines), fig)


def product_from_checkpoint(run: Path, index: Path, carry: Path, out: Path, device: str, workers: int, sets=None) -> dict:
    """The product commands alone, from the checkpoint RUN and the carried text, with no saved
    outputs and no benchmark code: on each set `teragram eval --checkpoint RUN --index INDEX
    --corpus VALID --fit-gate G`, then `--corpus TEST --gate G --decontaminate` (which also
    reports every document). Their reports (each stage's seconds included) and wall times, in
    OUT/product.json, for `eval --product` to compare with this benchmark's figures."""
    import subprocess

    from teragram.index.engine import Index

    res = {"index_tokens": Index(index).manifest["counts"]["tokens"], "device": device, "workers": workers, "sets": {}}
    base = [sys.executable, "-m", "teragram.serve.main", "eval", "--checkpoint", str(run), "--index", str(index)]
    base += ["--device", device, "--workers", str(workers), "--json"]
    for name in sets or carried_sets(carry):
        gate, runs = out / f"gate-{name}.json", {}
        for half, extra in (("valid", ["--fit-gate", str(gate)]), ("test", ["--gate", str(gate), "--decontaminate"])):
            cmd = [*base, "--corpus", str(carry / name / f"{half}.jsonl.zst"), *extra]
            print("+", " ".join(cmd), flush=True)
            t = time.time()
            p = subprocess.run(cmd, check=True, capture_output=True, text=True)
            runs[half] = json.loads(p.stdout) | {"wall_s": time.time() - t, "command": " ".join(cmd[2:])}
            print(f"  {name} {half}: {runs[half]['tokens']:,} tokens in {runs[half]['wall_s']:.1f} s", flush=True)
        res["sets"][name] = runs
    (out / "product.json").write_text(json.dumps(res, indent=1))
    return res


def product_check(product: dict, res: dict) -> dict:
    """The product commands' test perplexity (product_from_checkpoint: from the checkpoint,
    another path than this benchmark's saved outputs) against this benchmark's (t+cc) and choice
    on the same documents, all and decontaminated, at the index of the same size: the bar is
    agreement with (t+cc) within 0.5%. Exits without a report if a set is missing."""
    row = next((r for r in res["indexes"] if r["index_tokens"] == product["index_tokens"]), None)
    if row is None:
        raise SystemExit(f"no index of {product['index_tokens']:,} tokens among --index: the product check needs the one it ran with")
    check = {"index": row["index"], "device": product["device"], "sets": {}}
    for name, runs in product["sets"].items():
        s, test = row["sets"][name], runs["test"]
        got = {"all": test["all_documents"]["perplexity"], "decontaminated": test["perplexity"]}
        tcc = {"all": s["ppl"]["t+cc"], "decontaminated": s["ppl_decontaminated"]["t+cc"]}
        check["sets"][name] = {
            "product": got,
            "t+cc": tcc,
            "choice": {"all": s["ppl"]["choice"], "decontaminated": s["ppl_decontaminated"]["choice"]},
            "ratio": {k: got[k] / tcc[k] for k in got},
            "chosen": runs["valid"].get("gate_choice", {}).get("chosen"),
            "tokens": {h: r["tokens"] for h, r in runs.items()},
            "wall_s": {h: r["wall_s"] for h, r in runs.items()},
            "stages_s": {h: r.get("stages_s", {}) for h, r in runs.items()},
        }
    check["within_bar"] = all(abs(r - 1) <= 0.005 for c in check["sets"].values() for r in c["ratio"].values())
    return check


def best_system_bars(rows: list[dict], sets: list[str]) -> list[str]:
    """Issue 46's bars, on decontaminated test perplexity: at the largest index the product's
    choice >= 25% below (t) at the smallest on the time-shifted and prose sets and never worse
    than (t+cc) at the largest; moonshot: >= 35% below (c+cache) at the largest on every set."""
    small, big = rows[0], rows[-1]
    tag = f"{big['index_tokens'] / 1e6:,.0f}M"
    out = []
    for name in sets:
        d, d0 = big["sets"][name]["ppl_decontaminated"], small["sets"][name]["ppl_decontaminated"]
        a = big["sets"][name]["ppl"]
        out.append(
            f"- {name}, decontaminated, the product's choice at {tag}: {d['choice']:.4g}, "
            f"{100 * (1 - d['choice'] / d0['t']):.1f}% below (t) at {small['index_tokens'] / 1e6:,.0f}M"
            f"{' (bar >= 25%)' if name in ('timeshift', 'prose') else ''}, "
            f"{d['choice'] / d['t+cc']:.4f}x (t+cc) at {tag} (all: {a['choice'] / a['t+cc']:.4f}x; bar <= 1), "
            f"{100 * (1 - d['choice'] / d['c+c']):.1f}% below (c+cache) at {tag} (moonshot >= 35%)."
        )
    return out


def smoke() -> int:
    """prepare on a tiny DATA; the gpu stage's held-out features and saved outputs of the tiny
    (a) (trained once for every smoke run: the stage's own training is left out); eval on them."""
    smoke_short_fits()
    with smoke_context(True) as tmp:
        carry, work, out = tmp / "carry", tmp / "work", tmp / "out"
        main(["prepare", "--data", str(smoke_data(tmp)), "--carry", str(carry), "--max-mb", "0.02"])
        work.mkdir()
        out.mkdir()
        (work / "idx").symlink_to(smoke_index(tmp).resolve())
        held = heldout_features(work / "idx", work / "heldout", carry, 1)
        save_outputs_a(work, out, held, 4, "cpu", run=smoke_model(tmp))
        product_from_checkpoint(
            smoke_model(tmp), work / "idx", carry, out, "cpu", 1, sets=["timeshift"]
        )  # one set: the same commands for each
        return main(["eval", "--outputs", str(out), "--index", str(work / "idx"), "--workers", "1"])


def main(argv: list[str] | None = None) -> int:
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):
        return smoke()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["prepare", "gpu", "eval"])
    ap.add_argument("--data", type=Path, help="prepare: the corpora directory (ppl/, idx-050m/, heldout/)")
    ap.add_argument("--carry", type=Path, default=Path(".carry14"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/index-size"))
    ap.add_argument("--out", type=Path, help="gpu: where the outputs go; eval: where they are")
    ap.add_argument("--outputs", type=Path)
    ap.add_argument("--index", type=Path, nargs="+")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-targets", type=int, help="eval: only the first documents of each half, up to this many targets")
    ap.add_argument("--max-mb", type=float, default=1.2, help="prepare: text per held-out half")
    ap.add_argument("--scale", choices=["gpu", "cpu"], default="gpu", help="gpu: the 125M model; cpu: the tiny one")
    ap.add_argument("--name", default="index_size", help="eval: the results' name (benchmarks/results/NAME.md)")
    ap.add_argument("--product", action="store_true", help="gpu: also run the product commands from the checkpoint (product.json)")
    a = ap.parse_args(argv)
    if a.stage == "prepare":
        stage_prepare(a.data, a.carry, a.max_mb)
    elif a.stage == "gpu":
        a.out.mkdir(parents=True, exist_ok=True)
        stage_gpu(a.carry, a.work, a.out, a.scale, a.product)
    else:
        res = stage_eval(a.outputs, a.index, a.workers, a.max_targets)
        if (a.outputs / "product.json").exists():  # the gpu stage's --product: compared before anything is saved
            res["product_check"] = product_check(json.loads((a.outputs / "product.json").read_text()), res)
        report(res, a.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
