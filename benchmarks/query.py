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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=str(default_workdir()))
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--ig-docs", type=int, default=10, help="documents scored by infini-gram (per-position calls are slow)")
    ap.add_argument("--heldout", type=Path, help="held-out corpus file (default: 4 MB of linux-source's held-out split)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args(argv)
    if args.smoke:  # both indexes made by benchmarks/build.py's smoke arguments
        from benchmarks import build

        with smoke_context(True) as tmp:
            w, held = str(tmp / "w"), str(smoke_jsonl(tmp, heldout=True))
            build.main(["--corpus", str(smoke_jsonl(tmp)), "--workdir", w, "--workers", "1", "--vocab-size", "512"])
            return main(["--workdir", w, "--queries", "20", "--docs", "2", "--ig-docs", "1", "--heldout", held])
    w = Path(args.workdir)
    from infini_gram.engine import InfiniGramEngine
    from teragram.index.engine import Index

    # after opening and one query: peak RSS, and now its anonymous part (the process's own
    # memory) and file-backed part (mapped index pages, the page cache's, shared and reclaimable)
    probe = (
        f"import resource; from teragram.index.engine import Index; i=Index({str(w / 'tg')!r}); i.count([5]); "
        "st=dict(l.split(':') for l in open('/proc/self/status') if l.startswith('Rss')); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, st['RssAnon'].split()[0], st['RssFile'].split()[0])"
    )
    rss = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    open_rss_mb, open_anon_mb, open_file_mb = (int(x) / 1024 for x in rss.stdout.split()[-3:])
    idx = Index(w / "tg")
    ig = InfiniGramEngine(index_dir=str(w / "ig"), eos_token_id=idx.eos_id, vocab_size=65535, version=4, token_dtype="u16")
    rng = np.random.default_rng(0)
    s = idx.shards[0]
    tok = np.asarray(s.tok)
    n = len(tok)

    def sample(m: int) -> list[int]:
        while True:
            p = int(rng.integers(0, n - m))
            q = tok[p : p + m]
            if not (q == idx.sep).any():
                return [int(x) for x in q]

    short = [sample(int(rng.integers(1, 11))) for _ in range(args.queries)]
    long32 = [sample(32) for _ in range(args.queries)]
    conts = [int(tok[int(rng.integers(0, n))]) % idx.vocab_size for _ in range(args.queries)]
    ops = {
        "count": ([(q,) for q in short], idx.count, ig.count),
        "prob": ([(q, c) for q, c in zip(short, conts)], idx.prob, ig.prob),
        "ntd": ([(q,) for q in short], idx.ntd, ig.ntd),
        "infgram_prob": ([(q, c) for q, c in zip(long32, conts)], idx.infgram_prob, ig.infgram_prob),
        "infgram_ntd": ([(q,) for q in long32], idx.infgram_ntd, ig.infgram_ntd),
    }
    rows, data = [], {"open_rss_mb": open_rss_mb, "open_anon_mb": open_anon_mb, "open_file_mb": open_file_mb, "latency_ms": {}}
    for name, (qs, ours, theirs) in ops.items():
        _lat(ours, qs[:50])
        _lat(theirs, qs[:50])  # warm-up: JIT, page cache
        a, b = _lat(ours, qs), _lat(theirs, qs)
        data["latency_ms"][name] = {
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
    # sequence scoring on held-out documents
    from teragram.index import readers

    held = args.heldout or linux_corpus(w, 4, "heldout")
    docs = []
    for item in readers.read_file(held):
        if isinstance(item, readers.Doc):
            ids = idx.tokenize(item.text)
            if len(ids) >= 1000:
                docs.append(np.asarray(ids[:1000], dtype=np.int64))
            if len(docs) == args.docs:
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
    for d in docs[: args.ig_docs]:
        ids = d.tolist()
        for p in range(len(ids) - 1):
            ig.infgram_prob(ids[: p + 1], ids[p + 1])
    ig_tps = args.ig_docs * 999 / (time.perf_counter() - t)
    data["scoring_tokens_per_s"] = {
        "teragram_score_max_len_64": ours_tps,
        "teragram_score_uncapped": ours_uncapped_tps,
        "infini-gram_infgram_prob_per_position": ig_tps,
        "docs": len(docs),
    }
    md = table(rows, ["query", "teragram median ms", "teragram p90 ms", "infini-gram median ms", "infini-gram p90 ms", "speed-up (median)"])
    md += (
        f"\n\nScoring every position of {len(docs)} held-out 1,000-token documents: teragram `score` {ours_tps:,.0f} tokens/s "
        f"(uncapped match length: {ours_uncapped_tps:,.0f}); infini-gram `infgram_prob` per position {ig_tps:,.0f} tokens/s "
        f"({args.ig_docs} documents) -> {ours_tps / ig_tps:.1f}x. Opening the index and one count: {open_rss_mb:.0f} MiB peak RSS, of which {open_anon_mb:.0f} MiB the process's own and {open_file_mb:.0f} MiB mapped index pages (the top-level cache reads a sample of the suffix array on first use)."
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
    ax.set_title(f"{idx.n_tokens / 1e6:.0f}M-token linux-source index")
    save("query", data, md, fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
