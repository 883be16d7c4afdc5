"""Query benchmark: teragram's engine against infini-gram's on the same ~50M-token index.

    python -m benchmarks.query [--workdir W] [--queries 2000]

Uses WORKDIR/tg (teragram) and WORKDIR/ig (infini-gram's index of the very same token ids),
both made by benchmarks/build.py. One run, same queries for both engines, after warm-up:
  * median and p90 latency of count, prob, ntd (n-grams of 1-10 tokens sampled from the
    corpus), infgram_prob and infgram_ntd (32-token contexts);
  * throughput of scoring every position of 200 held-out 1,000-token documents: teragram's
    `score` (one pass per document) against infini-gram's infgram_prob called per position
    with the whole prefix as prompt (timed on a subset of the documents);
  * RSS of a process that opens the index (everything memory-mapped).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import SMOKE_HELP, default_workdir, linux_corpus, save, smoke_context, smoke_jsonl, table


def _lat(fn, queries) -> np.ndarray:
    out = np.empty(len(queries))
    for i, q in enumerate(queries):
        t = time.perf_counter()
        fn(*q)
        out[i] = time.perf_counter() - t
    return out * 1e3  # ms


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=str(default_workdir()))
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--ig-docs", type=int, default=10, help="documents scored by infini-gram (per-position calls are slow)")
    ap.add_argument("--heldout", type=Path, help="held-out corpus file (default: 4 MB of linux-source's held-out split)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    return ap.parse_args(argv)


def smoke() -> int:
    """Both indexes made by benchmarks/build.py's smoke arguments; 20 queries, 2 documents."""
    from benchmarks import build

    with smoke_context(True) as tmp:
        w, held = str(tmp / "w"), str(smoke_jsonl(tmp, heldout=True))
        build.main(["--corpus", str(smoke_jsonl(tmp)), "--workdir", w, "--workers", "1", "--vocab-size", "512"])
        return main(["--workdir", w, "--queries", "20", "--docs", "2", "--ig-docs", "1", "--heldout", held])


def open_rss(index: Path) -> tuple[float, float, float]:
    """MiB after opening the index and one query, in a process of its own: peak RSS, and now its
    anonymous part (the process's own memory) and file-backed part (mapped index pages, the page
    cache's, shared and reclaimable)."""
    probe = (
        f"import resource; from teragram.index.engine import Index; i=Index({str(index)!r}); i.count([5]); "
        "st=dict(l.split(':') for l in open('/proc/self/status') if l.startswith('Rss')); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, st['RssAnon'].split()[0], st['RssFile'].split()[0])"
    )
    rss = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    open_rss_mb, open_anon_mb, open_file_mb = (int(x) / 1024 for x in rss.stdout.split()[-3:])
    return open_rss_mb, open_anon_mb, open_file_mb


def query_ops(idx, ig, n_queries: int) -> dict:
    """Each operation's queries (n-grams of 1-10 tokens sampled from the first shard, 32-token
    contexts for the ∞-gram ones; seed 0) and the two engines' methods: {op: (queries, ours, theirs)}."""
    rng = np.random.default_rng(0)
    tok = np.asarray(idx.shards[0].tok)
    n = len(tok)

    def sample(m: int) -> list[int]:
        while True:
            p = int(rng.integers(0, n - m))
            q = tok[p : p + m]
            if not (q == idx.sep).any():
                return [int(x) for x in q]

    short = [sample(int(rng.integers(1, 11))) for _ in range(n_queries)]
    long32 = [sample(32) for _ in range(n_queries)]
    conts = [int(tok[int(rng.integers(0, n))]) % idx.vocab_size for _ in range(n_queries)]
    return {
        "count": ([(q,) for q in short], idx.count, ig.count),
        "prob": ([(q, c) for q, c in zip(short, conts)], idx.prob, ig.prob),
        "ntd": ([(q,) for q in short], idx.ntd, ig.ntd),
        "infgram_prob": ([(q, c) for q, c in zip(long32, conts)], idx.infgram_prob, ig.infgram_prob),
        "infgram_ntd": ([(q,) for q in long32], idx.infgram_ntd, ig.infgram_ntd),
    }


def latencies(ops: dict) -> tuple[list[dict], dict]:
    """Median and p90 latency of each operation on both engines, after a warm-up: (table rows, results)."""
    rows, out = [], {}
    for name, (qs, ours, theirs) in ops.items():
        _lat(ours, qs[:50])
        _lat(theirs, qs[:50])  # warm-up: JIT, page cache
        a, b = _lat(ours, qs), _lat(theirs, qs)
        out[name] = {
            "teragram": {"median": float(np.median(a)), "p90": float(np.percentile(a, 90))},
            "infini-gram": {"median": float(np.median(b)), "p90": float(np.percentile(b, 90))},
        }
        rows.append(
            {
                "query": name,
                "teragram median ms": float(np.median(a)),
                "teragram p90 ms": float(np.percentile(a, 90)),
                "infini-gram median ms": float(np.median(b)),
                "infini-gram p90 ms": float(np.percentile(b, 90)),
                "speed-up (median)": float(np.median(b) / np.median(a)),
            }
        )
    return rows, out


def scoring(idx, ig, held: Path, n_docs: int, ig_docs: int) -> dict:
    """Tokens per second scoring every position of n_docs held-out 1,000-token documents:
    teragram's `score` (capped and uncapped) and infini-gram's infgram_prob per position (ig_docs of them)."""
    from teragram.index import readers

    docs = []
    for item in readers.read_file(held):
        if isinstance(item, readers.Doc):
            ids = idx.tokenize(item.text)
            if len(ids) >= 1000:
                docs.append(np.asarray(ids[:1000], dtype=np.int64))
            if len(docs) == n_docs:
                break
    idx.score(docs[0][:50])
    t = time.perf_counter()
    for d in docs:
        idx.score(d, top_k=4, max_len=64)
    ours_tps = len(docs) * 1000 / (time.perf_counter() - t)
    t = time.perf_counter()
    for d in docs:
        idx.score(d, top_k=4, max_len=0)
    ours_uncapped_tps = len(docs) * 1000 / (time.perf_counter() - t)
    t = time.perf_counter()
    for d in docs[:ig_docs]:
        ids = d.tolist()
        for p in range(len(ids) - 1):
            ig.infgram_prob(ids[: p + 1], ids[p + 1])
    ig_tps = ig_docs * 999 / (time.perf_counter() - t)
    return {
        "teragram_score_max_len_64": ours_tps,
        "teragram_score_uncapped": ours_uncapped_tps,
        "infini-gram_infgram_prob_per_position": ig_tps,
        "docs": len(docs),
    }


def report(rows: list[dict], data: dict, ig_docs: int, n_tokens: int) -> None:
    """The table and the plot: benchmarks/results/query.*"""
    sc = data["scoring_tokens_per_s"]
    ours_tps, ours_uncapped_tps, ig_tps = (
        sc["teragram_score_max_len_64"],
        sc["teragram_score_uncapped"],
        sc["infini-gram_infgram_prob_per_position"],
    )
    open_rss_mb, open_anon_mb, open_file_mb = data["open_rss_mb"], data["open_anon_mb"], data["open_file_mb"]
    md = table(rows, ["query", "teragram median ms", "teragram p90 ms", "infini-gram median ms", "infini-gram p90 ms", "speed-up (median)"])
    md += (
        f"\n\nScoring every position of {sc['docs']} held-out 1,000-token documents: teragram `score` {ours_tps:,.0f} tokens/s "
        f"(uncapped match length: {ours_uncapped_tps:,.0f}); infini-gram `infgram_prob` per position {ig_tps:,.0f} tokens/s "
        f"({ig_docs} documents) -> {ours_tps / ig_tps:.1f}x. Opening the index and one count: {open_rss_mb:.0f} MiB peak RSS, of which {open_anon_mb:.0f} MiB the process's own and {open_file_mb:.0f} MiB mapped index pages (the top-level cache reads a sample of the suffix array on first use)."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["teragram median ms"] for r in rows], 0.4, label="teragram")
    ax.bar(x + 0.2, [r["infini-gram median ms"] for r in rows], 0.4, label="infini-gram")
    ax.set_xticks(x, [r["query"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("median latency (ms)")
    ax.legend()
    ax.set_title(f"{n_tokens / 1e6:.0f}M-token linux-source index")
    save("query", data, md, fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        return smoke()
    w = Path(args.workdir)
    from infini_gram.engine import InfiniGramEngine
    from teragram.index.engine import Index

    open_rss_mb, open_anon_mb, open_file_mb = open_rss(w / "tg")
    idx = Index(w / "tg")
    ig = InfiniGramEngine(index_dir=str(w / "ig"), eos_token_id=idx.eos_id, vocab_size=65535, version=4, token_dtype="u16")
    rows, latency = latencies(query_ops(idx, ig, args.queries))
    data = {"open_rss_mb": open_rss_mb, "open_anon_mb": open_anon_mb, "open_file_mb": open_file_mb, "latency_ms": latency}
    data["scoring_tokens_per_s"] = scoring(idx, ig, args.heldout or linux_corpus(w, 4, "heldout"), args.docs, args.ig_docs)
    report(rows, data, args.ig_docs, idx.n_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
