"""Query latency over a multi-shard index: shards one after another or in parallel threads,
with and without the in-memory top levels of each suffix array (index/top_cache.py).

    python -m benchmarks.query_fanout --index IDX [--queries 1000] [--reshard K --out DIR]

With --reshard, first rebuilds IDX's documents (same ids) as a K-shard index in DIR and
measures that. Warm page cache (every query set is run once before it is timed). Median and
p90 latency of count (1-7 tokens sampled from the index), infgram_prob and longest_match
(32-token contexts). Writes benchmarks/results/query_fanout.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
from teragram.index import top_cache
from teragram.index.engine import Index

from benchmarks.common import SMOKE_HELP, save, smoke_context, smoke_index, table


def _docs(idx: Index):
    for s in idx.shards:
        tok, st = np.asarray(s.tok), np.asarray(s.starts).astype(np.int64)
        for k in range(len(st) - 1):
            yield tok[st[k] : st[k + 1] - 1]


def _sample(idx: Index, rng, m: int) -> list[int]:
    while True:
        s = idx.shards[int(rng.integers(len(idx.shards)))]
        p = int(rng.integers(0, len(s.tok) - m))
        q = np.asarray(s.tok[p : p + m])
        if not (q == idx.sep).any():
            return [int(x) for x in q]


def _time(fn, qs) -> np.ndarray:
    for q in qs:  # warm
        fn(q)
    out = np.empty(len(qs))
    for i, q in enumerate(qs):
        t = time.perf_counter()
        fn(q)
        out[i] = time.perf_counter() - t
    return out * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--reshard", type=int, help="rebuild the index's documents in this many shards first")
    ap.add_argument("--out", help="where the resharded index goes")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args(argv)
    if args.smoke:
        with smoke_context(True) as tmp:
            return main(["--index", str(smoke_index(tmp)), "--queries", "20", "--reshard", "2", "--out", str(tmp / "resharded")])
    if not args.index:
        ap.error("--index is required")
    path = Path(args.index)
    if args.reshard:
        from teragram.builder.build import build_from_ids

        src = Index(path, threads=1)
        shard_tokens = -(-src.n_positions // args.reshard) + 1
        build_from_ids(_docs(src), args.out, path / "tokenizer.model", shard_tokens=shard_tokens)
        path = Path(args.out)
    rng = np.random.default_rng(0)
    idx = Index(path, threads=1)
    counts = [_sample(idx, rng, int(rng.integers(1, 8))) for _ in range(args.queries)]
    contexts = [_sample(idx, rng, 33) for _ in range(args.queries)]
    conts = [c[32] for c in contexts]
    contexts = [c[:32] for c in contexts]
    rows = []
    for label, threads, step in [
        ("serial, no top cache", 1, 62),
        ("serial, top cache", 1, top_cache.STEP_LOG2),
        ("parallel, top cache", os.cpu_count() or 1, top_cache.STEP_LOG2),
    ]:
        top_cache.STEP_LOG2 = step
        idx = Index(path, threads=threads)
        row = {"config": label, "threads": idx.threads}
        for name, fn, qs in [
            ("count", idx.count, counts),
            ("infgram_prob", lambda i, idx=idx: idx.infgram_prob(contexts[i], conts[i]), range(len(contexts))),
            ("longest_match", idx.longest_match, contexts),
        ]:
            lat = _time(fn, list(qs))
            row[f"{name}_median_ms"] = float(np.median(lat))
            row[f"{name}_p90_ms"] = float(np.percentile(lat, 90))
        rows.append(row)
        print(row, flush=True)
    idx = Index(path, threads=1)
    md = f"{len(idx.shards)} shard(s), {idx.n_tokens:,} tokens; {args.queries} queries of each kind, warm.\n\n"
    save(
        "query_fanout",
        {"index": str(path), "shards": len(idx.shards), "tokens": idx.n_tokens, "rows": rows},
        md + table(rows, list(rows[0])),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
