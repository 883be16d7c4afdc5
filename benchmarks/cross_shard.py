"""Cross-shard matches and features: merged suffix arrays, merge-joins per pair, per-position search.

    python -m benchmarks.cross_shard --index IDX [--cap 64] [--live-tokens 2000000]
        [--repeat 3] [--pairwise-shards 0 -1] [--name cross_shard]

1. For shard 0 against shard 1 of IDX: tokens/s of builder/cross_shard.py's merge-join over
   the whole shard, and of searching shard 1 position by position (index.kernels.match_lengths,
   the path it replaces) over the first documents of shard 0 (about --live-tokens of them);
   both checked equal on those documents.
2. Exclude-doc length + continuation of every position of IDX against every other document of
   every shard, end to end: the merged suffix array of all shards (features.
   merged_exclude_doc_features, --repeat runs, median), and shard by shard with a merge-join per
   pair of shards (shard_features(pairwise=True), the path it replaces) on --pairwise-shards;
   both checked equal on those shards.
One process, one thread; times include loading compiled kernels (well under 1 s). The load
average of the machine is recorded before and after. Writes benchmarks/results/NAME.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import numpy as np
from teragram.builder.cross_shard import other_shard_matches
from teragram.builder.features import merged_exclude_doc_features, shard_features
from teragram.index import kernels as IK
from teragram.index.engine import Index
from teragram.index.features import FeatureConfig

from benchmarks.common import save, table


def pair_rows(idx: Index, cap: int, live_tokens: int) -> tuple[list[dict], bool]:
    s, o = idx.shards[0], idx.shards[1]
    t = time.perf_counter()
    L, lo, hi = other_shard_matches(idx, 0, 1, cap)
    merge_s = time.perf_counter() - t
    T = np.asarray(s.tok).astype(np.int64)
    starts = np.asarray(s.starts).astype(np.int64)
    k = int(np.searchsorted(starts, live_tokens))
    k = max(1, min(k, len(starts) - 1))
    n_live = int(starts[k])
    Ll, lol, hil = (np.zeros(n_live, np.int64) for _ in range(3))
    t = time.perf_counter()
    for d in range(k):
        a, b = starts[d], starts[d + 1] - 1
        IK.match_lengths(o.tok, o.sa.words, o.sa.width, o.n, T[a:b], cap, Ll[a:b], lol[a:b], hil[a:b])
    live_s = time.perf_counter() - t
    equal = bool((Ll == L[:n_live]).all() and (lol == lo[:n_live]).all() and (hil == hi[:n_live]).all())
    rows = [
        {"method": "merge-join of shards 0, 1 (cross_shard.py)", "tokens": len(T), "seconds": merge_s, "tokens_per_s": len(T) / merge_s},
        {"method": "per-position search of shard 1", "tokens": n_live, "seconds": live_s, "tokens_per_s": n_live / live_s},
    ]
    return rows, equal


def feature_rows(idx: Index, cap: int, repeat: int, pairwise_shards: list[int]) -> tuple[list[dict], bool, dict]:
    cfg = FeatureConfig(mode="exclude-doc", max_len=cap, top_k=0)
    n = sum(s.tok.shape[0] for s in idx.shards)
    secs = []
    for _ in range(repeat):
        t = time.perf_counter()
        merged = merged_exclude_doc_features(idx, cfg)
        secs.append(time.perf_counter() - t)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    med = statistics.median(secs)
    rows = [
        {
            "method": f"merged suffix array, all {len(idx.shards)} shards",
            "positions": n,
            "seconds": med,
            "tokens_per_s_per_core": n / med,
            "runs (s)": " ".join(f"{x:.1f}" for x in secs),
        }
    ]
    equal = True
    for sh in pairwise_shards:
        t = time.perf_counter()
        f, _ = shard_features(idx, sh, cfg, pairwise=True)
        sec = time.perf_counter() - t
        equal &= bool(np.array_equal(f.length, merged[sh].length) and np.array_equal(f.cont, merged[sh].cont))
        m = len(f.length)
        rows.append(
            {
                "method": f"merge-join per pair, shard {sh} vs the other {len(idx.shards) - 1}",
                "positions": m,
                "seconds": sec,
                "tokens_per_s_per_core": m / sec,
            }
        )
    return rows, equal, {"merged_runs_s": secs, "peak_rss_mb_after_merged": peak_mb}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", required=True)
    ap.add_argument("--cap", type=int, default=64)
    ap.add_argument("--live-tokens", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pairwise-shards", type=int, nargs="*", default=[0, -1])
    ap.add_argument("--name", default="cross_shard")
    args = ap.parse_args()
    idx = Index(args.index, threads=1)
    load = {"before": os.getloadavg()}
    shards = [s % len(idx.shards) for s in args.pairwise_shards]
    frows, fequal, fdata = feature_rows(idx, args.cap, args.repeat, shards)
    prows, pequal = pair_rows(idx, args.cap, args.live_tokens)
    load["after"] = os.getloadavg()
    s, o = idx.shards[0], idx.shards[1]
    n = sum(x.tok.shape[0] for x in idx.shards)
    md = (
        f"Index: {len(idx.shards)} shards, {n:,} positions; cap {args.cap}; load average "
        f"{load['before'][0]:.2f} before, {load['after'][0]:.2f} after (of {os.cpu_count()} cores).\n\n"
        f"Exclude-doc length + continuation of every position (peak RSS {fdata['peak_rss_mb_after_merged']:,.0f} MB after "
        f"the merged runs); answers equal on the pairwise shards: {fequal}.\n\n"
        + table(frows, list(frows[0]))
        + f"\n\nShard 0 ({s.tok.shape[0]:,} positions) against shard 1 ({o.n:,} suffixes); answers equal on the common documents: {pequal}.\n\n"
        + table(prows, list(prows[0]))
    )
    data = {"features": frows, "features_equal": fequal, "pair": prows, "pair_equal": pequal, "cap": args.cap, "load": load} | fdata
    save(args.name, data, md)
    return 0 if fequal and pequal else 1


if __name__ == "__main__":
    sys.exit(main())
