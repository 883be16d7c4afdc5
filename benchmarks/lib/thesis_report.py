"""The thesis benchmark's table (benchmarks/thesis.py): per held-out set, each model alone, with
the cache-only gate and with the product's gate at each index, on one document set; the issue's
bars; the plot of perplexity against index tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VARIANTS = {
    "a": "alone",
    "a+cc": "cache-only gate (document + continuous cache, no index)",
    "choice": "product (eval --fit-gate's choice)",
    "c+c": "infini-gram interpolation + document cache",
}


def trained_tokens(out: Path) -> int:
    """The tokens a model's run trained on (its gpu.json; index_size gpu's: an epoch of its index's)."""
    g = json.loads((out / "gpu.json").read_text())
    return g["schedule"]["trained_tokens"] if "schedule" in g else g["index_tokens"]


def model_label(out: Path) -> str:
    """aN: the model trained on N million tokens (N thousand, written Nk, below a million); aNxP:
    P passes over N million distinct tokens (benchmarks/epochs.py's runs of more than one pass)."""
    sched = json.loads((out / "gpu.json").read_text()).get("schedule", {})
    t, passes = sched.get("distinct_tokens") or trained_tokens(out), sched.get("passes", 1)
    n = f"{t / 1e6:.0f}" if t >= 1e6 else f"{t / 1e3:.0f}k"
    return f"a{n}x{passes:.0f}" if passes >= 1.5 else f"a{n}"


def _ppl(s: dict, v: str, docs: np.ndarray) -> float:
    """Perplexity of variant v over the test documents `docs` (a mask) of one set's figures."""
    tok = np.asarray(s["test_doc_tokens"], dtype=np.float64)[docs]
    return float(np.exp(np.asarray(s["test_doc_nll"][v])[docs].sum() / tok.sum()))


def figures(res: dict) -> tuple[list[str], list[str], dict]:
    """(sets, indexes, {(set, model, variant, index): {"all", "clean", "index_tokens"}}): test
    perplexity over all documents and over those decontaminated against the largest index (fewer
    than 80% of their 13-grams in it; the indexes nest, so these are clean of every smaller one):
    one document set for every row of a set."""
    by = {m: {r["index"]: r for r in res[m]["indexes"]} for m in res}
    first = next(iter(by.values()))
    indexes = sorted(first, key=lambda i: first[i]["index_tokens"])
    big = first[indexes[-1]]["sets"]
    out: dict = {}
    for name in big:
        clean = np.asarray(big[name]["test_clean_docs"], bool)
        every = np.ones_like(clean)
        for m in res:
            for idx, r in by[m].items():
                s = r["sets"][name]
                for v in VARIANTS:
                    out[name, m, v, idx] = {"all": _ppl(s, v, every), "clean": _ppl(s, v, clean), "index_tokens": r["index_tokens"]}
        out[name, "docs"] = {"all": int(every.sum()), "clean": int(clean.sum()), "tokens": big[name]["test_tokens"]}
    return list(big), indexes, out


def bars(sets: list[str], indexes: list[str], f: dict, small: str, large: str) -> tuple[list[str], dict]:
    """The issue's bars, on decontaminated test perplexity (lines, and each bar's verdict)."""
    top = indexes[-1]
    alone = {s: f[s, large, "a", top]["clean"] < f[s, small, "a", top]["clean"] for s in sets}
    cut = {s: 1 - f[s, large, "choice", top]["clean"] / f[s, large, "a+cc", top]["clean"] for s in sets}
    moon = {s: f[s, small, "choice", top]["clean"] / f[s, large, "a+cc", top]["clean"] for s in sets}
    shifted = [s for s in ("timeshift", "prose", "packages") if s in sets]
    verdict = {
        "alone": all(alone.values()),
        "cut_20pct": all(cut[s] >= 0.2 for s in shifted),
        "moonshot": all(m < 1 for m in moon.values()),
    }
    lines = [
        f"- ({large}) alone below ({small}) alone on every set: {'met' if verdict['alone'] else 'missed'} ("
        + ", ".join(f"{s} {f[s, large, 'a', top]['clean']:.4g} vs {f[s, small, 'a', top]['clean']:.4g}" for s in sets)
        + ")",
        f"- At {top} the product cuts ({large})'s perplexity against its cache-only gate by "
        + ", ".join(f"{s} {100 * cut[s]:.1f}%" for s in sets)
        + f" (bar: >= 20% on {', '.join(shifted)}: {'met' if verdict['cut_20pct'] else 'missed'})",
        f"- Moonshot, ({small}) + {top} (product) against ({large}) with the cache-only gate: "
        + ", ".join(f"{s} {f[s, small, 'choice', top]['clean']:.4g} vs {f[s, large, 'a+cc', top]['clean']:.4g}" for s in sets)
        + f" (bar: below on every set: {'met' if verdict['moonshot'] else 'missed'})",
    ]
    return lines, verdict


def report(outs: list[Path], mixed, name: str = "thesis") -> dict:
    """The table (one per held-out set), the bars and the plot: benchmarks/results/NAME.*
    (mixed(outs): each model's figures by label, as thesis.stage_eval gives them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common import save, table

    outs = sorted(outs, key=trained_tokens)
    res = mixed(outs)
    labels = [model_label(o) for o in outs]
    small, large, mids = labels[0], labels[-1], labels[1:-1]
    sets, indexes, f = figures(res)
    md = []
    for s in sets:
        trs = []
        for m in labels:
            for v, what in VARIANTS.items():
                for idx in [
                    i for i in (indexes if v == "choice" else indexes[-1:]) if (s, m, v, i) in f
                ]:  # a model mixed with fewer indexes
                    index = "-" if v in ("a", "a+cc") else f"{idx} ({f[s, m, v, idx]['index_tokens'] / 1e6:,.0f}M)"
                    c = f[s, m, v, idx]
                    trs.append({"model": f"({m})", "mixture": what, "index": index, "all": c["all"], "decontaminated": c["clean"]})
        d = f[s, "docs"]
        md.append(
            f"**{s}** ({d['all']} test documents, {d['tokens']:,} tokens; {d['clean']} decontaminated against {indexes[-1]}): "
            "test perplexity\n\n" + table(trs, list(trs[0]))
        )
    lines, verdict = bars(sets, indexes, f, small, large)
    top = indexes[-1]
    for m in mids:  # kNN-LM's terms: a small model trained longer on its own text, with the big index
        lines.append(
            f"- ({m}) + {top} (product) against ({large}) with the cache-only gate: "
            + ", ".join(f"{s} {f[s, m, 'choice', top]['clean']:.4g} vs {f[s, large, 'a+cc', top]['clean']:.4g}" for s in sets)
        )
    fig, axes = plt.subplots(1, len(sets), figsize=(4.5 * len(sets), 4), squeeze=False)
    for ax, s in zip(axes[0], sets, strict=True):
        for m, col in zip(labels, ("C0", *("C2", "C3")[: len(mids)], "C1")):
            mine = [i for i in indexes if (s, m, "choice", i) in f]
            xs = [f[s, m, "choice", i]["index_tokens"] for i in mine]
            ax.plot(xs, [f[s, m, "choice", i]["clean"] for i in mine], marker="o", color=col, label=f"({m}) + index (product)")
            ax.axhline(f[s, m, "a+cc", indexes[-1]]["clean"], color=col, ls="--", label=f"({m}) cache-only gate")
            ax.axhline(f[s, m, "a", indexes[-1]]["clean"], color=col, ls=":", label=f"({m}) alone")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("index tokens")
        ax.set_ylabel("test perplexity (decontaminated)")
        ax.set_title(s)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    gpu = {m: json.loads((o / "gpu.json").read_text()) for m, o in zip(labels, outs, strict=True)}
    rows = {"|".join(k): v for k, v in f.items()}
    save(name, {"figures": rows, "bars": verdict, "sets": sets, "indexes": indexes, "gpu": gpu}, "\n\n".join([*md, "\n".join(lines)]), fig)
    return verdict
