"""Where the joint model's gain over the post-hoc gate lies, and so where the rest of the way to
issue 15's bar (0.9x post-hoc (t)) would have to come from. Per ∞-gram match-length bucket of the
decontaminated test targets: each bucket's share of them, its mean nll under (a), post-hoc (t),
the joint models' LMs alone and their mixtures, and each bucket's part of the gap between a joint
mixture and (t): share x (nll_joint - nll_t), which sums over the buckets to log(ppl_joint /
ppl_t) (the bar: log 0.9 = -0.105).

    python -m experiments.joint_gap --outputs OUT --joint OUT --index DATA/idx-050m \\
        --variants knnj3r,knnj3s8r,knnj3s9r --posthoc benchmarks/results/joint_posthoc_seeds3.json

OUT holds (a)'s outputs as benchmarks/index_size.py's eval unpacked them (OUT/unpacked) and the
joint runs' per-target nll (benchmarks/joint.py's train stage); (t) is fit again here on each
set's validation half as index_size fits it, and must give the post-hoc results' figure."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import EXPERIMENT_RESULTS, save, table
from benchmarks.index_size import FIT_ROWS, HALVES, LENGTH_BUCKETS, SETS, clean_documents


def _buckets(L: np.ndarray) -> list[tuple[str, np.ndarray]]:
    edges = (*LENGTH_BUCKETS[1:], 1 << 30)
    return [(f"{lo}+" if hi > 1 << 20 else f"{lo}-{hi - 1}", (L >= lo) & (L < hi)) for lo, hi in zip(LENGTH_BUCKETS, edges)]


def posthoc_of(posthoc: Path, index: Path) -> dict:
    """benchmarks.index_size eval's results (`posthoc`) for the index named as `index`."""
    ph = next((r for r in json.loads(posthoc.read_text())["indexes"] if r["index"] == index.name), None)
    if ph is None:
        raise SystemExit(f"{posthoc} has no results for an index named {index.name}")
    return ph


def refit_t(outputs: Path, index: Path, s: str, ph: dict, workers: int):
    """Set s's (a) outputs and estimates per half, post-hoc (t)'s per-target nll per half (its gate
    fit on validation as index_size fits it), and which test targets are decontaminated; (t) must
    give the post-hoc results' (ph) decontaminated figure."""
    from teragram.model.evaluation.outputs import gated_outputs, load_outputs, outputs_estimates
    from teragram.model.mixture.estimates import COMPONENTS

    o = {h: load_outputs(outputs / "unpacked" / f"{s}-{h}") for h in HALVES}
    est = {h: outputs_estimates(o[h], index, workers=workers) for h in HALVES}
    gate, t_valid = gated_outputs(o["valid"], est["valid"], components=COMPONENTS, fit_rows=FIT_ROWS)
    t = {"valid": t_valid, "test": gated_outputs(o["test"], est["test"], gate)[1]}
    clean = clean_documents(o["test"], est["test"])[o["test"].doc.astype(np.int64)]
    want, got = ph["sets"][s]["ppl_decontaminated"]["t"], math.exp(t["test"][clean].mean())
    if abs(got / want - 1) > 1e-6:
        raise SystemExit(f"{s}: (t) refit here gives {got:.6g}, the post-hoc results {want:.6g}: not the same outputs or index")
    return o, est, t, clean


def gap(outputs: Path, joint: Path, index: Path, variants: list[str], posthoc: Path, workers: int) -> dict:
    from benchmarks.joint import load_nll

    ph = posthoc_of(posthoc, index)
    res = {"index": index.name, "variants": variants, "posthoc_results": str(posthoc), "sets": {}}
    for s in SETS:
        o, est, t, clean = refit_t(outputs, index, s, ph, workers)
        nll = {"a": o["test"].nll.astype(np.float64), "t": t["test"]}
        for v in variants:
            z = load_nll({v: joint}, v, s, "test")  # a refit's: with its variant's LM alone and targets
            if not np.array_equal(z["target"], o["test"].target.astype(np.int32)):
                raise SystemExit(f"{v} {s}: the joint run's targets differ from (a)'s outputs'")
            nll[v] = z["nll"].astype(np.float64)
            nll[f"{v} LM alone"] = z["nll_model"].astype(np.float64)
        L = est["test"]["index_length"][clean]
        rows, n = [], clean.sum()
        for name, m in _buckets(L):
            r = {"bucket": name, "share": float(m.mean())}
            for k, x in nll.items():
                x = x[clean][m]
                r[k] = float(x.mean()) if len(x) else float("nan")
            for v in variants:
                r[f"{v} - t"] = float((nll[v][clean][m] - nll["t"][clean][m]).sum() / n)
            rows.append(r)
        res["sets"][s] = {
            "targets": int(n),
            "ppl": {k: float(math.exp(x[clean].mean())) for k, x in nll.items()},
            "buckets": rows,
        }
    return res


def report(res: dict, name: str) -> None:
    vs = res["variants"]
    lines = [
        "Decontaminated test targets by the ∞-gram's match length L (its longest suffix found in the index): share, mean nll "
        "(nats) of each model, and each bucket's part of log(ppl_joint / ppl_t) (share x the mean difference; the parts sum to "
        f"the whole; issue 15's bar is log 0.9 = {math.log(0.9):.3f}). Joint variants: {', '.join(vs)}.",
        "",
    ]
    for s, r in res["sets"].items():
        cols = ["bucket", "share", "a", "t", *[f"{v} LM alone" for v in vs], *vs, *[f"{v} - t" for v in vs]]
        total = {"bucket": "all", "share": 1.0} | {k: math.log(p) for k, p in r["ppl"].items()}
        total |= {f"{v} - t": math.log(r["ppl"][v] / r["ppl"]["t"]) for v in vs}
        lines += [f"**{s}** ({r['targets']:,} targets; perplexity (t) {r['ppl']['t']:.4g})", "", table([*r["buckets"], total], cols), ""]
    save(name, res, "\n".join(lines), _figure(res), results=EXPERIMENT_RESULTS)


def _figure(res: dict):
    """Per set and match-length bucket: each joint variant's part of log(ppl_joint / ppl_t), and
    its LM alone's mean nll against (a)'s (what the mixture leans on where the estimates are weak)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs = res["variants"]
    fig, axes = plt.subplots(2, len(res["sets"]), figsize=(5 * len(res["sets"]), 7), sharey="row")
    for j, (s, r) in enumerate(res["sets"].items()):
        b = [x for x in r["buckets"] if x["share"] > 0]
        x = np.arange(len(b))
        w = 0.8 / len(vs)
        for i, v in enumerate(vs):
            axes[0, j].bar(x + i * w, [row[f"{v} - t"] for row in b], w, label=v)
            axes[1, j].bar(x + i * w, [row[f"{v} LM alone"] - row["a"] for row in b], w, label=v)
        axes[0, j].axhline(0, color="k", lw=0.5)
        axes[0, j].set_title(f"{s}: sum {min(math.log(r['ppl'][v] / r['ppl']['t']) for v in vs):.3f} to "
                             f"{max(math.log(r['ppl'][v] / r['ppl']['t']) for v in vs):.3f} (bar {math.log(0.9):.3f})")  # fmt: skip
        axes[1, j].axhline(0, color="k", lw=0.5)
        for ax in axes[:, j]:
            ax.set_xticks(x + 0.4 - w / 2, [row["bucket"] for row in b])
        axes[1, j].set_xlabel("∞-gram match length (decontaminated test targets)")
    axes[0, 0].set_ylabel("part of log(ppl_joint / ppl_t)")
    axes[1, 0].set_ylabel("LM alone - (a), mean nll (nats)")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def smoke() -> int:
    """The study on benchmarks/joint.py's smoke run (its (a) outputs, refit and own-store joint variants, post-hoc results)."""
    from benchmarks.joint import smoke_study

    with smoke_study() as (tmp, run):
        args = ["--outputs", str(run / "out"), "--joint", str(run / "out"), "--index", str(run / "work" / "idx")]
        return main([*args, "--variants", "knnj3r,knnj3or", "--posthoc", str(run / "posthoc.json"), "--workers", "1"])


def main(argv: list[str] | None = None) -> int:
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):
        return smoke()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", type=Path, required=True, help="(a)'s outputs, unpacked by benchmarks.index_size eval")
    ap.add_argument("--joint", type=Path, required=True, help="the joint run's outputs (V-SET-test.npz)")
    ap.add_argument("--index", type=Path, required=True)
    ap.add_argument("--variants", default="knnj3r,knnj3s8r,knnj3s9r")
    ap.add_argument("--posthoc", type=Path, required=True, help="benchmarks.index_size eval's results for these outputs")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--name", default="joint_gap")
    a = ap.parse_args(argv)
    report(gap(a.outputs, a.joint, a.index, a.variants.split(","), a.posthoc, a.workers), a.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
