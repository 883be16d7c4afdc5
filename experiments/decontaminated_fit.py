"""Two checks of how near-duplicates in the training corpus bear on the joint gate (issue 15),
from a joint run's saved outputs (benchmarks/joint.py gpu: (a)'s outputs, each variant's nll)
mixed with the index here:

1. Does the post-hoc gate (t) do better on decontaminated test text when it is fit on the
   decontaminated part of validation only (near-duplicates making the index look better in
   fitting than on clean text)?
2. Where is a jointly trained model's LM alone worse than (a): on the contaminated documents and
   the long matches (the LM leaving near-duplicated text to the index), or everywhere?

    python -m experiments.decontaminated_fit --outputs OUT --index DATA/idx-050m [--joint lm1] [--name decontaminated_fit]

Decontaminated: documents with < 80% of their 13-grams in the index (infini-gram's criterion,
as everywhere here). Both gates are fit on the same number of validation targets at most
(index_size.FIT_ROWS, a fixed random sample).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import EXPERIMENT_RESULTS, save, table
from benchmarks.index_size import FIT_ROWS, HALVES, SETS, clean_documents


def smoke() -> int:
    """The study on benchmarks/joint.py's smoke run: its (a) outputs, index and joint variant."""
    from benchmarks.joint import smoke_study

    with smoke_study() as (tmp, run):
        return main(["--outputs", str(run / "out"), "--index", str(run / "work" / "idx"), "--joint", "knnj3", "--workers", "1"])


def main(argv: list[str] | None = None) -> int:
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):
        return smoke()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", required=True, help="a directory with unpacked/SET-HALF outputs of (a)")
    ap.add_argument("--index", required=True)
    ap.add_argument("--joint", default="lm1", help="the joint variant whose LM alone is compared with (a) (OUT/V-SET-test.npz)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--name", default="decontaminated_fit")
    a = ap.parse_args(argv)
    from teragram.model.evaluation.outputs import load_outputs, outputs_estimates
    from teragram.model.mixture.estimates import COMPONENTS
    from teragram.model.mixture.gate import Gate, component_logp, gate_inputs, mix_nll_multi

    rows, lm_rows = [], []
    for name in SETS:
        t = time.time()
        X, lp, clean = {}, {}, {}
        for h in HALVES:
            o = load_outputs(Path(a.outputs) / "unpacked" / f"{name}-{h}")
            est = outputs_estimates(o, Path(a.index), workers=a.workers)
            clean[h] = clean_documents(o, est)[o.doc.astype(np.int64)]
            X[h] = gate_inputs(est, o.maxp.astype(np.float64), o.top.astype(np.int64), COMPONENTS)
            lp[h] = component_logp(est, o.nll.astype(np.float64), COMPONENTS)
        lm_rows += _lm_alone(Path(a.outputs) / f"{a.joint}-{name}-test.npz", name, o, est, clean["test"])
        row = {"set": name, "valid clean share": float(clean["valid"].mean()), "test clean share": float(clean["test"].mean())}
        for tag, keep in (("fit on all valid", np.ones(len(X["valid"]), bool)), ("fit on clean valid", clean["valid"])):
            fit = np.nonzero(keep)[0]
            if len(fit) > FIT_ROWS:
                fit = np.sort(np.random.default_rng(0).choice(fit, FIT_ROWS, replace=False))
            nll = mix_nll_multi(lp["test"], Gate.fit(X["valid"][fit], lp["valid"][fit], components=COMPONENTS)(X["test"]))
            row[f"(t) {tag}: test"] = float(np.exp(nll.mean()))
            row[f"(t) {tag}: test decontaminated"] = float(np.exp(nll[clean["test"]].mean()))
        row["seconds"] = time.time() - t
        rows.append(row)
        print(row, flush=True)
    md = (
        f"The post-hoc gate (t) over (a)'s outputs in `{a.outputs}` and the index `{a.index}`, fit on each set's whole "
        "validation half or on its decontaminated documents only (< 80% of their 13-grams in the index), evaluated on "
        "the test half, all and decontaminated (perplexity).\n\n"
    )
    lines = [
        f"- {r['set']}: decontaminated test {r['(t) fit on all valid: test decontaminated']:.3f} with the gate fit on all "
        f"validation text, {r['(t) fit on clean valid: test decontaminated']:.3f} fit on its clean part "
        f"({r['(t) fit on clean valid: test decontaminated'] / r['(t) fit on all valid: test decontaminated'] - 1:+.2%})"
        for r in rows
    ]
    md += table(rows, list(rows[0])) + "\n\n" + "\n".join(lines)
    if lm_rows:
        md += (
            f"\n\nThe LM alone of the joint variant {a.joint} against (a) on the same test targets, by document "
            "(clean: decontamination keeps it) and by the ∞-gram's match length L at the target (perplexity):\n\n"
            + table(lm_rows, list(lm_rows[0]))
        )
    save(
        a.name,
        {"rows": rows, "lm_alone": lm_rows, "outputs": a.outputs, "index": a.index, "joint": a.joint},
        md,
        results=EXPERIMENT_RESULTS,
    )
    return 0


def _lm_alone(path: Path, name: str, o, est: dict, clean: np.ndarray) -> list[dict]:
    if not path.exists():
        return []
    z = np.load(path)
    if not np.array_equal(z["target"], o.target.astype(z["target"].dtype)):
        raise SystemExit(f"{path}: other targets than (a)'s outputs of {name}")
    a, j, L = o.nll.astype(np.float64), z["nll_model"].astype(np.float64), est["index_length"]
    out = []
    for docs, dm in (("clean", clean), ("contaminated", ~clean)):
        for lo, hi in ((0, 1 << 30), (0, 4), (4, 16), (16, 1 << 30)):
            m = dm & (L >= lo) & (L < hi)
            if m.any():
                pa, pj = float(np.exp(a[m].mean())), float(np.exp(j[m].mean()))
                span = "all" if (lo, hi) == (0, 1 << 30) else (f"{lo}+" if hi == 1 << 30 else f"{lo}-{hi - 1}")
                out.append(
                    {"set": name, "documents": docs, "L": span, "targets": int(m.sum()), "(a)": pa, "joint LM alone": pj, "ratio": pj / pa}
                )
    return out


if __name__ == "__main__":
    sys.exit(main())
