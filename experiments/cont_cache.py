"""Would a continuous cache (Grave et al., 2017) add to the joint model? Issue 15's diagnostic, and
the post-hoc control of the joint component made of it since (dense_cache, model/mixture/knn.doc_neighbours:
variant knnj3c of benchmarks/joint.py): how much of that variant's gain the same cache gives post-hoc
(t) by interpolation.

The document cache (the cache_* components) counts the document's own earlier n-grams. The
continuous cache instead looks the current state up among the document's earlier states, with
the kNN-LM's distance, and weights the tokens that followed them: p(y) is the softmax over the
earlier positions j of -||h_i - h_j||^2 / T, summed where target_j = y
(model/mixture/knn.cache_target_probs). benchmarks/knnlm.py writes its p(target) for every held-out
target over (a)'s key states (OUT/contcache-SET-HALF.npz, in the dense components' held-out
pass; temperatures: knnlm.CACHE_FACTORS x the store's scale).

Here every model is interpolated with it in the same way, p = (1 - λ) p_model + λ p_cache. The
temperature and λ are fit on each set's validation half (knnlm.fit), and the decontaminated test
half is reported. The models are (a), post-hoc (t) (refit here as experiments/joint_gap.py refits
it, checked against the post-hoc results) and the joint variants given. The cache is added to (t)
too, so the joint-over-(t) ratio with the cache is a fair one. A post-hoc mix on top of a joint
model is not the joint model: a gain here says the cache is worth making a joint component, and
no more.

    python -m experiments.cont_cache --outputs OUT --joint OUT --index DATA/idx-050m \\
        --variants knnj3r --posthoc benchmarks/results/joint_posthoc_NAME.json --name cont_cache
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import EXPERIMENT_RESULTS, save, table
from benchmarks.index_size import HALVES, SETS
from benchmarks.knnlm import CACHE_FACTORS


def measure(outputs: Path, joint: Path, index: Path, variants: list[str], posthoc: Path, workers: int) -> dict:
    from teragram.model.mixture.baselines import mix_nll

    from benchmarks.joint import load_nll
    from benchmarks.knnlm import fit
    from experiments.joint_gap import posthoc_of, refit_t

    ph = posthoc_of(posthoc, index)
    res = {"index": index.name, "variants": variants, "posthoc_results": str(posthoc), "sets": {}}
    for s in SETS:
        o, est, t, clean = refit_t(outputs, index, s, ph, workers)
        nll = {"a": {h: o[h].nll.astype(np.float64) for h in HALVES}, "t": t}
        q, factors = {}, None
        for h in HALVES:
            z = np.load(joint / f"contcache-{s}-{h}.npz")
            if not np.array_equal(z["target"], o[h].target.astype(np.int32)):
                raise SystemExit(f"contcache {s}-{h}: its targets differ from (a)'s outputs'")
            q[h], factors = z["q"].astype(np.float64), [float(f) for f in z["factors"]]
        for v in variants:
            nll[v] = {}
            for h in HALVES:
                z = load_nll({v: joint}, v, s, h)
                if not np.array_equal(z["target"], o[h].target.astype(np.int32)):
                    raise SystemExit(f"{v} {s}-{h}: the joint run's targets differ from (a)'s outputs'")
                nll[v][h] = z["nll"].astype(np.float64)
        row = {}
        for m, x in nll.items():
            j, lam = fit(x["valid"], q["valid"])
            mixed = mix_nll(x["test"], q["test"][:, j], lam)
            row[m] = {
                "test_decontaminated": math.exp(x["test"][clean].mean()),
                "with_cache": math.exp(mixed[clean].mean()),
                "factor": factors[j],
                "lambda": lam,
            }
        g = _gate_with_cache(o, est, q)
        res["sets"][s] = {
            "targets": int(clean.sum()),
            "share_with_history": float((q["test"][clean, -1] > 0).mean()),
            "models": row,
            "t_gate_cc": {"valid": math.exp(g["valid"].mean()), "test_decontaminated": math.exp(g["test"][clean].mean())},
        }
    return res


def _gate_with_cache(o: dict, est: dict, q: dict) -> dict:
    """(t+cc): the post-hoc gate over (t)'s estimates and the continuous cache at each of its
    temperatures as more estimates (its inputs (t)'s, fit on validation as experiments/gate_headroom.py
    fits its (t+knn3)); the cache defers to the model at a document's first target, where it has
    no history. Per-target nll per half."""
    from teragram.model.mixture.estimates import COMPONENTS
    from teragram.model.mixture.gate import component_logp, gate_inputs

    from experiments.gate_headroom import linear_gate_nll

    X, lp = {}, {}
    for h in HALVES:
        nll = o[h].nll.astype(np.float64)
        doc = o[h].doc.astype(np.int64)
        first = np.concatenate([[True], doc[1:] != doc[:-1]])
        X[h] = gate_inputs(est[h], o[h].maxp.astype(np.float64), o[h].top.astype(np.int64), COMPONENTS)
        cc = np.where(first[:, None], -nll[:, None], np.log(q[h] + 1e-300))
        lp[h] = np.maximum(np.concatenate([component_logp(est[h], nll, COMPONENTS), cc], 1), -700.0)
    return linear_gate_nll(X, lp)


def report(res: dict, name: str) -> None:
    lines = [
        "Decontaminated test perplexity of each model alone and interpolated with the continuous cache over (a)'s states "
        "(temperature x the store's scale and λ fit on the set's validation half), and against post-hoc (t) with the same "
        "cache. Issue 15's bar: joint <= 0.9x (t).",
        "",
    ]
    for s, r in res["sets"].items():
        t = r["models"]["t"]
        rows = [
            {
                "model": m,
                "alone": x["test_decontaminated"],
                "with the cache": x["with_cache"],
                "gain": 1 - x["with_cache"] / x["test_decontaminated"],
                "vs (t) alone": x["test_decontaminated"] / t["test_decontaminated"],
                "vs (t), both with the cache": x["with_cache"] / t["with_cache"],
                "temperature factor": x["factor"],
                "λ": x["lambda"],
            }
            for m, x in r["models"].items()
        ]
        cols = list(rows[0])
        head = f"**{s}** ({r['targets']:,} targets; {100 * r['share_with_history']:.0f}% with a cache hit of any weight)"
        lines += [head, "", table(rows, cols), ""]
        if "t_gate_cc" in r:
            g = r["t_gate_cc"]["test_decontaminated"]
            vs = ", ".join(f"{m} {x['test_decontaminated'] / g:.3f}x" for m, x in r["models"].items() if m not in ("a", "t"))
            lines += [
                f"- (t+cc), the post-hoc gate over (t)'s estimates and the cache at its {len(CACHE_FACTORS)} temperatures as more "
                f"estimates (fit on validation): {g:.4g} ({g / t['test_decontaminated']:.3f}x (t) alone). Against it, alone: {vs}.",
                "",
            ]
    save(name, res, "\n".join(lines), _figure(res), results=EXPERIMENT_RESULTS)


def _figure(res: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(res["sets"]), figsize=(5 * len(res["sets"]), 3.5), sharey=True)
    for ax, (s, r) in zip(np.atleast_1d(axes), res["sets"].items()):
        ms = list(r["models"])
        x = np.arange(len(ms))
        ax.bar(x - 0.2, [r["models"][m]["test_decontaminated"] for m in ms], 0.4, label="alone")
        ax.bar(x + 0.2, [r["models"][m]["with_cache"] for m in ms], 0.4, label="with the continuous cache")
        ax.set_xticks(x, ms, rotation=20)
        ax.set_yscale("log")
        ax.set_title(s)
    np.atleast_1d(axes)[0].set_ylabel("decontaminated test perplexity")
    np.atleast_1d(axes)[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def smoke() -> int:
    """The study on benchmarks/joint.py's smoke run (its (a) outputs, continuous-cache estimates, refit joint variant, post-hoc results)."""
    from benchmarks.joint import smoke_study

    with smoke_study() as (tmp, run):
        args = ["--outputs", str(run / "out"), "--joint", str(run / "out"), "--index", str(run / "work" / "idx")]
        return main([*args, "--variants", "knnj3r", "--posthoc", str(run / "posthoc.json"), "--workers", "1"])


def main(argv: list[str] | None = None) -> int:
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):
        return smoke()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", type=Path, required=True, help="(a)'s outputs, unpacked by benchmarks.index_size eval")
    ap.add_argument("--joint", type=Path, required=True, help="the joint run's outputs (V-SET-HALF.npz, contcache-SET-HALF.npz)")
    ap.add_argument("--index", type=Path, required=True)
    ap.add_argument("--variants", default="knnj3r")
    ap.add_argument("--posthoc", type=Path, required=True, help="benchmarks.index_size eval's results for these outputs")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--name", default="cont_cache")
    a = ap.parse_args(argv)
    report(measure(a.outputs, a.joint, a.index, [v for v in a.variants.split(",") if v], a.posthoc, a.workers), a.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
