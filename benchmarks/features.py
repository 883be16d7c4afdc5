"""Feature benchmark: bulk per-token features on the ~50M-token linux-source index.

    python -m benchmarks.features [--workdir W] [--heldout-mb 4]

Needs the index of benchmarks/build.py (WORKDIR/tg; built here if missing). Measures, in a
fresh single-process run per configuration, tokens/s per core and peak RSS for
  * length + continuation only (--top-k 0), causal and exclude-doc;
  * the full features with the top-4 distribution;
  * held-out text (the held-out split of linux-source-6.1) against the whole index;
then, on held-out text, the fraction of positions with L >= 1, 4, 16, 32 and how often the
continuation token is the actual next token, by L bucket.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import SMOKE_HELP, default_workdir, linux_corpus, run_measured, save, smoke_context, smoke_index, smoke_jsonl, table

BUCKETS = [(0, 0), (1, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 64)]


def l_stats(tokens: np.ndarray, starts: np.ndarray, length: np.ndarray, cont: np.ndarray, sep: int) -> dict:
    """Match-length fractions and continuation accuracy (cont == next token) by L bucket."""
    nxt = np.append(tokens[1:], sep)
    real = (tokens != sep) & (nxt != sep)  # positions whose next token is in the same document
    L, c, y = length[real].astype(int), cont[real].astype(int), nxt[real].astype(int)
    out = {"positions": int(real.sum()), "frac_L_ge": {str(k): float((L >= k).mean()) for k in (1, 4, 16, 32)}}
    out["cont_accuracy_overall"] = float((c[L > 0] == y[L > 0]).mean()) if (L > 0).any() else 0.0
    out["by_bucket"] = []
    for lo, hi in BUCKETS:
        m = (L >= lo) & (L <= hi)
        out["by_bucket"].append(
            {
                "L": f"{lo}-{hi}" if lo != hi else str(lo),
                "share": float(m.mean()),
                "cont_accuracy": float((c[m] == y[m]).mean()) if m.any() and lo > 0 else None,
            }
        )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=str(default_workdir()))
    ap.add_argument("--heldout-mb", type=float, default=4)
    ap.add_argument("--heldout", type=Path, help="held-out corpus file (default: the first --heldout-mb of linux-source's held-out split)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    return ap.parse_args(argv)


def _features(repo: str, idx_dir: Path, out: Path, *opts: str) -> dict:
    """`teragram features IDX --out OUT OPTS --workers 1 --quiet`, measured, into a fresh OUT."""
    run_measured(["rm", "-rf", str(out)])
    cmd = [sys.executable, "-m", "teragram.serve.main", "features", str(idx_dir), "--out", str(out), *opts, "--workers", "1", "--quiet"]
    return run_measured(cmd, cwd=repo)


def index_features(repo: str, w: Path, n_pos: int) -> tuple[list[dict], dict]:
    """The index's own features, causal and exclude-doc, with and without the top-4 distribution:
    (table rows, results)."""
    rows, data = [], {}
    for mode in ("causal", "exclude-doc"):
        for k in (0, 4):
            out = w / f"feat-{mode}-k{k}"
            m = _features(repo, w / "tg", out, "--mode", mode, "--top-k", str(k))
            rep = json.loads((out / "features-report.json").read_text())
            secs = sum(s["total_s"] for s in rep["shards"])
            what = "length + continuation" if k == 0 else "all, top-4"
            data[f"{mode}_k{k}"] = m | {"compute_s": secs, "tokens_per_s_per_core": n_pos / secs}
            rows.append(
                {"features": what, "mode": mode, "compute s": secs, "M tokens/s/core": n_pos / secs / 1e6, "peak RSS MiB": m["peak_rss_mb"]}
            )
    return rows, data


def heldout_features(repo: str, w: Path, held: Path) -> tuple[dict, dict]:
    """Held-out text's features against the whole index, into WORKDIR/feat-heldout: (table row, results)."""
    out = w / "feat-heldout"
    m = _features(repo, w / "tg", out, "--corpus", str(held))
    rep = json.loads((out / "features-report.json").read_text())
    row = {
        "features": "all, top-4",
        "mode": "held-out (bulk, one thread)",
        "compute s": rep["features_s"],
        "M tokens/s/core": rep["positions"] / rep["features_s"] / 1e6,
        "peak RSS MiB": m["peak_rss_mb"],
    }
    return row, m | rep


def match_stats(w: Path, sep: int) -> dict:
    """l_stats of the held-out features and of the index's own (causal, exclude-doc; length + continuation)."""
    from teragram.index import format as fmt

    idx_dir, d = w / "tg", w / "feat-heldout" / "000000"
    tok = np.asarray(fmt.open_array(d / "tokens.bin", "tokens"))
    st = np.asarray(fmt.open_array(d / "docs.bin", "docs"))
    stats = {
        "heldout": l_stats(
            tok,
            st,
            np.asarray(fmt.open_array(d / "length.bin", "feat.length")),
            np.asarray(fmt.open_array(d / "cont.bin", "feat.cont")),
            sep,
        )
    }
    for mode in ("causal", "exclude-doc"):
        fd = w / f"feat-{mode}-k0" / "000000"
        itok = np.asarray(fmt.open_array(idx_dir / "shards/000000/tokens.bin", "tokens"))
        ist = np.asarray(fmt.open_array(idx_dir / "shards/000000/docs.bin", "docs"))
        stats[f"train_{mode}"] = l_stats(
            itok,
            ist,
            np.asarray(fmt.open_array(fd / "length.bin", "feat.length")),
            np.asarray(fmt.open_array(fd / "cont.bin", "feat.cont")),
            sep,
        )
    return stats


def report(rows: list[dict], data: dict, stats: dict) -> None:
    """The tables and the plot: benchmarks/results/features.*"""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    labels = [b["L"] for b in stats["heldout"]["by_bucket"]]
    x = np.arange(len(labels))
    for j, (name, st_) in enumerate(stats.items()):
        ax[0].bar(x + (j - 1) * 0.27, [b["share"] for b in st_["by_bucket"]], 0.27, label=name)
        ax[1].bar(x + (j - 1) * 0.27, [b["cont_accuracy"] or 0 for b in st_["by_bucket"]], 0.27, label=name)
    for a, t in zip(ax, ("share of positions", "continuation = next token")):
        a.set_xticks(x, labels)
        a.set_xlabel("match length L")
        a.set_title(t)
    ax[0].legend(fontsize=8)
    md = table(rows, ["features", "mode", "compute s", "M tokens/s/core", "peak RSS MiB"])
    h = stats["heldout"]
    md += (
        "\n\nHeld-out linux-source ("
        + f"{h['positions']:,} positions): "
        + ", ".join(f"L>={k}: {v:.1%}" for k, v in h["frac_L_ge"].items())
    )
    md += f"; continuation accuracy {h['cont_accuracy_overall']:.1%} where L>0.\n\n"
    md += table(
        [
            {
                "L": b["L"],
                **{f"{n} share": s["by_bucket"][i]["share"] for n, s in stats.items()},
                **{f"{n} cont acc": s["by_bucket"][i]["cont_accuracy"] for n, s in stats.items()},
            }
            for i, b in enumerate(h["by_bucket"])
        ],
        ["L"] + [f"{n} share" for n in stats] + [f"{n} cont acc" for n in stats],
    )
    save("features", data, md, fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:  # WORKDIR/tg: a tiny index
        with smoke_context(True) as tmp:
            shutil.copytree(smoke_index(tmp), tmp / "w" / "tg")
            return main(["--workdir", str(tmp / "w"), "--heldout", str(smoke_jsonl(tmp, heldout=True))])
    repo = str(Path(__file__).resolve().parents[1])
    w = Path(args.workdir)
    idx_dir = w / "tg"
    if not (idx_dir / "manifest.json").exists():
        run_measured([sys.executable, "-m", "benchmarks.build", "--workdir", str(w)], cwd=repo)
    man = json.loads((idx_dir / "manifest.json").read_text())
    rows, own = index_features(repo, w, man["counts"]["positions"])
    held_row, held = heldout_features(repo, w, args.heldout or linux_corpus(w, args.heldout_mb, "heldout"))
    stats = match_stats(w, man["separator"])
    data = {"index": {"dir": str(idx_dir), "tokens": man["counts"]["tokens"], "shards": man["counts"]["shards"]}}
    report([*rows, held_row], data | own | {"heldout": held, "match_stats": stats}, stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
