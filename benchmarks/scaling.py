"""Scaling study toward a trillion tokens: build, features and queries against index size.

    python -m benchmarks.scaling [--sizes 10,30,100,300] [--shard-tokens 0]

Real text: linux-source-6.1 and this machine's Python sources, tokenized once with one
32000-piece tokenizer; the first N million tokens are indexed at each size (build_from_ids,
so build time is index time), then: bytes per token, build time and peak RSS (a measured
subprocess), feature throughput (exclude-doc, length + continuation), and median query
latency of count, infgram_prob (32-token contexts) and score (per token), for one shard and
for the same tokens in several shards. Fits power laws and extrapolates to 1T tokens; writes
benchmarks/results/scaling.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from benchmarks.common import SMOKE_HELP, default_workdir, linux_corpus, results_dir, run_measured, save, smoke_context, smoke_jsonl, table

REPO = Path(__file__).resolve().parents[1]


def python_sources(out: Path) -> Path:
    """This machine's Python standard library and site-packages sources, as JSON lines."""
    import zstandard

    if out.exists():
        return out
    roots = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]}
    with zstandard.open(out, "wt") as f:
        for r in sorted(roots):
            for p in sorted(Path(r).rglob("*.py")):
                try:
                    f.write(json.dumps({"text": p.read_text(), "path": str(p)}) + "\n")
                except (UnicodeDecodeError, OSError):
                    continue
    return out


def measure_queries(idx, ids: np.ndarray, n: int) -> dict:
    """Median latency of count (1-7 tokens) and infgram_prob (32-token contexts), and score's
    time per token on text beyond every index size."""
    rng = np.random.default_rng(0)
    tok = np.asarray(idx.shards[0].tok)

    def sample(m: int) -> list[int]:
        while True:
            p = int(rng.integers(0, len(tok) - m))
            q = tok[p : p + m]
            if not (q == idx.sep).any():
                return [int(x) for x in q]

    out = {}
    qs = [sample(int(rng.integers(1, 8))) for _ in range(n)]
    ctx = [sample(32) for _ in range(n)]
    for name, fn, batch in (("count", lambda q: idx.count(q), qs), ("infgram_prob", lambda q: idx.infgram_prob(q[:-1], q[-1]), ctx)):
        for q in batch[:20]:
            fn(q)
        t = []
        for q in batch:
            t0 = time.perf_counter()
            fn(q)
            t.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = float(np.median(t) * 1e3)
    doc = np.asarray(ids[len(ids) - 2000 :]).astype(np.int64)  # text beyond every size: held out
    idx.score(doc[:100])
    t0 = time.perf_counter()
    idx.score(doc)
    out["score_us_per_token"] = (time.perf_counter() - t0) / len(doc) * 1e6
    return out


_BUILD = """
import sys, numpy as np, time
ids = np.load({ids!r}, mmap_mode="r"); starts = np.load({starts!r})
n = {n}
k = int(np.searchsorted(starts, n))
docs = [np.asarray(ids[starts[i]:starts[i + 1]]) for i in range(k)]
from teragram.builder.build import build_from_ids
t = time.time()
build_from_ids(docs, {out!r}, {tok!r}, shard_tokens={shard}, workers={workers})
print("INDEX_S", time.time() - t)
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10,30,100,300", help="index sizes in millions of tokens")
    ap.add_argument("--workdir", default=str(default_workdir() / "scaling"))
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--corpus", nargs="+", help="files to tokenize instead of linux-source-6.1 and this machine's Python sources")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    return ap.parse_args(argv)


def tokenize_once(w: Path, corpus: list[str] | None, vocab_size: int) -> tuple[Path, Path]:
    """1. One tokenization of enough text for the largest size (an index of it, WORKDIR/all), its
    documents' ids saved as WORKDIR/ids.npy and their starts as starts.npy (once): their paths."""
    ids_path, starts_path = w / "ids.npy", w / "starts.npy"
    if ids_path.exists():
        return ids_path, starts_path
    corpus = corpus or [linux_corpus(default_workdir(), 1100, "train"), python_sources(w / "python.jsonl.zst")]
    run_measured(
        [
            sys.executable,
            "-m",
            "teragram.builder.cli",
            *map(str, corpus),
            "--out",
            str(w / "all"),
            "--workers",
            "2",
            "--vocab-size",
            str(vocab_size),
            "--quiet",
            "--shard-tokens",
            str(1 << 30),
        ],
        cwd=REPO,
    )
    from teragram.index.engine import Index

    idx = Index(w / "all")
    parts, starts = [], [0]
    for s in idx.shards:
        tok, st = np.asarray(s.tok), np.asarray(s.starts).astype(np.int64)
        for k in range(len(st) - 1):
            parts.append(tok[st[k] : st[k + 1] - 1])
            starts.append(starts[-1] + len(parts[-1]))
    np.save(ids_path, np.concatenate(parts))
    np.save(starts_path, np.asarray(starts))
    return ids_path, starts_path


def measure_point(w: Path, ids: np.ndarray, n: int, shards: int, queries: int) -> tuple[dict, dict]:
    """An index of the first n tokens in `shards` shards, built in a measured subprocess, then its
    bytes per token, query latencies and (one shard, up to 120M tokens) feature throughput:
    (the point's results, its table row)."""
    from teragram.index.engine import Index

    out = w / f"idx-{n // 10**6}m-{shards}"
    run_measured(["rm", "-rf", str(out)])
    shard = (n + 2 * n // 1000) // shards + 1 if shards > 1 else 1 << 31
    code = _BUILD.format(
        repo=str(REPO),
        ids=str(w / "ids.npy"),
        starts=str(w / "starts.npy"),
        n=n,
        out=str(out),
        tok=str(w / "all" / "tokenizer.model"),
        shard=shard,
        workers=1,
    )
    log = w / "build.log"
    m = run_measured([sys.executable, "-c", code], cwd=REPO, stdout=open(log, "w"))
    index_s = float(log.read_text().split("INDEX_S")[1])
    man = json.loads((out / "manifest.json").read_text())
    b = {}
    for s in man["shards"]:
        for f in s["files"]:
            b[Path(f["path"]).name] = b.get(Path(f["path"]).name, 0) + f["size"]
    ntok = man["counts"]["tokens"]
    point = {
        "tokens": ntok,
        "shards": man["counts"]["shards"],
        "index_s": index_s,
        "build_peak_rss_mb": m["peak_rss_mb"],
        "bytes_per_token": (b["tokens.bin"] + b["sa.bin"]) / ntok,
        "bytes_per_token_all": sum(b.values()) / ntok,
    }
    idx = Index(out)
    point |= measure_queries(idx, ids, queries)
    if shards == 1 and n <= 120e6:  # the feature pass holds ~60 bytes per position in RAM
        from teragram.builder.features import shard_features
        from teragram.index.features import FeatureConfig

        t0 = time.perf_counter()
        shard_features(idx, 0, FeatureConfig("exclude-doc", 64, 0))
        point["features_Mtok_s"] = ntok / (time.perf_counter() - t0) / 1e6
    row = {
        "tokens (M)": ntok / 1e6,
        "shards": point["shards"],
        "index s": index_s,
        "peak RSS MiB": m["peak_rss_mb"],
        "B/token": point["bytes_per_token"],
        "count ms": point["count_ms"],
        "infgram_prob ms": point["infgram_prob_ms"],
        "score us/token": point["score_us_per_token"],
        "features M tok/s": point.get("features_Mtok_s", ""),
    }
    return point, row


def power_fits(points: list[dict]) -> dict:
    """Fits on the one-shard points, y = a * N^b: each measure's exponent and its value at 1T tokens."""
    one = [p for p in points if p["shards"] == 1]
    N = np.array([p["tokens"] for p in one], float)
    fits = {}
    for key in ("index_s", "build_peak_rss_mb", "count_ms", "infgram_prob_ms", "score_us_per_token"):
        y = np.array([p[key] for p in one], float)
        b, loga = np.polyfit(np.log(N), np.log(y), 1)
        fits[key] = {"exponent": float(b), "at_1T": float(np.exp(loga) * 1e12**b)}
    return fits


def report(rows: list[dict], data: dict) -> None:
    """The points and fits (RESULTS/scaling_points.json), the table and the plot (scaling_measured.*)."""
    fits = data["fits"]
    results_dir().mkdir(parents=True, exist_ok=True)
    (results_dir() / "scaling_points.json").write_text(json.dumps(data, indent=1))
    md = table(
        rows,
        ["tokens (M)", "shards", "index s", "peak RSS MiB", "B/token", "count ms", "infgram_prob ms", "score us/token", "features M tok/s"],
    )
    md += "\n\nPower-law fits on one-shard points (y = a N^b): " + ", ".join(f"{k} b={v['exponent']:.2f}" for k, v in fits.items())
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    for shards, mk in ((1, "o-"), (4, "s--")):
        pts = [p for p in data["points"] if p["shards"] == shards]
        x = [p["tokens"] for p in pts]
        ax[0].loglog(x, [p["index_s"] for p in pts], mk, label=f"{shards} shard(s)")
        ax[1].loglog(x, [p["bytes_per_token_all"] for p in pts], mk, label=f"{shards} shard(s)")
        ax[2].loglog(x, [p["count_ms"] for p in pts], mk, label=f"count, {shards} shard(s)")
        ax[2].loglog(x, [p["infgram_prob_ms"] for p in pts], mk, label=f"infgram_prob, {shards} shard(s)")
    for a, t in zip(ax, ("index build time (s)", "bytes per token (all files)", "median query latency (ms)")):
        a.set_xlabel("tokens")
        a.set_title(t)
        a.legend(fontsize=7)
    save("scaling_measured", data, md, fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        with smoke_context(True) as tmp:
            c = str(smoke_jsonl(tmp))
            return main(["--sizes", "0.02,0.04", "--workdir", str(tmp / "w"), "--queries", "10", "--corpus", c, "--vocab-size", "512"])
    w = Path(args.workdir)
    w.mkdir(parents=True, exist_ok=True)
    sizes = [int(float(x) * 1e6) for x in args.sizes.split(",")]
    ids_path, _ = tokenize_once(w, args.corpus, args.vocab_size)
    ids = np.load(ids_path, mmap_mode="r")
    rows, data = [], {"points": []}
    for n in [n for n in sizes if n <= len(ids)]:
        for shards in (1, 4):
            point, row = measure_point(w, ids, n, shards, args.queries)
            data["points"].append(point)
            rows.append(row)
            print(rows[-1], flush=True)
    data["fits"] = power_fits(data["points"])
    report(rows, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
