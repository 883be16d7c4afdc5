"""Cross-shard matches: merge-join of two suffix arrays against the per-position search.

    python -m benchmarks.cross_shard --index IDX [--cap 64] [--live-tokens 2000000]

For shard 0 against shard 1 of IDX: tokens/s of builder/cross_shard.py over the whole shard,
and of searching shard 1 position by position (index.kernels.match_lengths, the path it
replaces) over the first documents of shard 0 (about --live-tokens of them); both checked
equal on those documents. One thread each; the merge-join time includes loading its compiled kernels (well under 1 s). Writes benchmarks/results/cross_shard.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from teragram.builder.cross_shard import other_shard_matches
from teragram.index import kernels as IK
from teragram.index.engine import Index

from benchmarks.common import save, table


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", required=True)
    ap.add_argument("--cap", type=int, default=64)
    ap.add_argument("--live-tokens", type=int, default=2_000_000)
    args = ap.parse_args()
    idx = Index(args.index, threads=1)
    s, o = idx.shards[0], idx.shards[1]
    t = time.perf_counter()
    L, lo, hi = other_shard_matches(idx, 0, 1, args.cap)
    merge_s = time.perf_counter() - t
    T = np.asarray(s.tok).astype(np.int64)
    starts = np.asarray(s.starts).astype(np.int64)
    k = int(np.searchsorted(starts, args.live_tokens))
    k = max(1, min(k, len(starts) - 1))
    n_live = int(starts[k])
    Ll, lol, hil = (np.zeros(n_live, np.int64) for _ in range(3))
    t = time.perf_counter()
    for d in range(k):
        a, b = starts[d], starts[d + 1] - 1
        IK.match_lengths(o.tok, o.sa.words, o.sa.width, o.n, T[a:b], args.cap, Ll[a:b], lol[a:b], hil[a:b])
    live_s = time.perf_counter() - t
    equal = bool((Ll == L[:n_live]).all() and (lol == lo[:n_live]).all() and (hil == hi[:n_live]).all())
    rows = [
        {"method": "merge-join (cross_shard.py)", "tokens": len(T), "seconds": merge_s, "tokens_per_s": len(T) / merge_s},
        {"method": "per-position search", "tokens": n_live, "seconds": live_s, "tokens_per_s": n_live / live_s},
    ]
    md = f"Shard 0 ({len(T):,} positions) against shard 1 ({o.n:,} suffixes), cap {args.cap}; answers equal on the common documents: {equal}.\n\n"
    save("cross_shard", {"rows": rows, "equal": equal, "cap": args.cap}, md + table(rows, list(rows[0])))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
