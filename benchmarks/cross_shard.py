"""Cross-shard matches and features: merged suffix arrays, merge-joins per pair, per-position search.

    python -m benchmarks.cross_shard --index IDX [--cap 64] [--live-tokens 2000000]
        [--repeat 3] [--pairwise-shards 0 -1] [--check 2000] [--scratch DIR] [--name cross_shard]

1. For shard 0 against shard 1 of IDX: tokens/s of builder/cross_shard.py's merge-join over
   the whole shard, and of searching shard 1 position by position (index.kernels.match_lengths,
   the path it replaces) over the first documents of shard 0 (about --live-tokens of them);
   both checked equal on those documents.
2. Exclude-doc length + continuation of every position of IDX against every other document of
   every shard, end to end: the merged suffix array of all shards chunk by chunk
   (builder/merged_features.py through features.merged_exclude_doc_lengths, with the memory
   budget compute_features gives it, chunks kept on --scratch between its passes; --repeat
   runs, median), and shard by shard with a merge-join per pair of shards
   (shard_features(pairwise=True), the path it replaces) on --pairwise-shards (none: skipped);
   both checked equal on those shards, and --check positions drawn at random checked against
   brute force over the index (every occurrence of the position's suffix, found by search,
   read one by one where there are at most 1M of them, else through the block maxima).
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
from pathlib import Path

import numpy as np
from teragram.builder.cross_shard import other_shard_matches
from teragram.builder.features import merged_exclude_doc_lengths, shard_features
from teragram.index import kernels as IK
from teragram.index.engine import Index
from teragram.index.features import FeatureConfig

from benchmarks.common import SMOKE_HELP, save, sh, smoke_context, smoke_corpus, table


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


def feature_rows(idx: Index, cap: int, repeat: int, pairwise_shards: list[int], scratch: Path | None) -> tuple[list[dict], bool, dict]:
    cfg = FeatureConfig(mode="exclude-doc", max_len=cap, top_k=0)
    n = sum(s.tok.shape[0] for s in idx.shards)
    secs, stats = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        merged, st = merged_exclude_doc_lengths(idx, cfg, scratch=scratch, progress=True)
        secs.append(time.perf_counter() - t)
        stats.append(st)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    med = statistics.median(secs)
    rows = [
        {
            "method": f"merged suffix array, all {len(idx.shards)} shards, {stats[-1]['chunks']} chunks",
            "positions": n,
            "seconds": med,
            "tokens_per_s_per_core": n / med,
            "runs (s)": " ".join(f"{x:.1f}" for x in secs),
        }
    ]
    equal = True
    for k in pairwise_shards:
        t = time.perf_counter()
        f, _ = shard_features(idx, k, cfg, pairwise=True)
        sec = time.perf_counter() - t
        length, cont = merged[k]
        equal &= bool(np.array_equal(f.length, length) and np.array_equal(np.where(f.cont < 0, idx.sep, f.cont), cont))
        m = len(f.length)
        rows.append(
            {
                "method": f"merge-join per pair, shard {k} vs the other {len(idx.shards) - 1}",
                "positions": m,
                "seconds": sec,
                "tokens_per_s_per_core": m / sec,
            }
        )
    return rows, equal, {"merged_runs_s": secs, "merged_stats": stats, "peak_rss_mb_after_merged": peak_mb, "merged": merged}


def _other_doc_recent(idx: Index, q: np.ndarray, doc_lo: int, doc_hi: int, brute_max: int) -> tuple[int, bool]:
    """(largest global position of an occurrence of q outside [doc_lo, doc_hi), -1 if none;
    whether the occurrences were read one by one)."""
    from teragram.builder.merged_features import max_below
    from teragram.index import packed

    _, segs = idx.count_intervals(q)
    offs = np.cumsum([0] + [s.tok.shape[0] for s in idx.shards])
    best, brute = -1, sum(hi - lo for lo, hi in segs) <= brute_max
    for s, (lo, hi), off in zip(idx.shards, segs, offs):
        if hi <= lo:
            continue
        if brute:
            pos = packed.unpack(s.sa.words, s.sa.width, s.n, lo, hi) + off
            pos = pos[(pos < doc_lo) | (pos >= doc_hi)]
            best = max(best, int(pos.max()) if len(pos) else -1)
            continue
        top = s.most_recent(lo, hi) + off
        if top >= doc_hi:
            best = max(best, int(top))
        elif doc_lo > off:
            v = max_below(s.sa.words, s.sa.width, s.samax, s.off2, s.off3, lo, hi, doc_lo - off)
            best = max(best, int(v + off) if v >= 0 else -1)
    return best, brute


def spot_check(idx: Index, merged: list, cap: int, n: int, seed: int = 0, brute_max: int = 1_000_000) -> dict:
    """n positions drawn at random: their length L is the longest suffix (<= cap, inside the
    document) with an occurrence outside the document and cont the token after the largest such
    occurrence, by search over the whole index."""
    rng = np.random.default_rng(seed)
    sizes = np.array([s.tok.shape[0] for s in idx.shards])
    offs = np.concatenate([[0], np.cumsum(sizes)])
    ok = brute = 0
    bad = []
    for _ in range(n):
        sh = int(rng.choice(len(sizes), p=sizes / sizes.sum()))
        s = idx.shards[sh]
        T = s.tok
        t = int(rng.integers(0, sizes[sh]))
        length, cont = merged[sh]
        if T[t] == idx.sep:
            good = length[t] == 0 and cont[t] == idx.sep
        else:
            d = s.doc_of(t)
            ds, de = int(s.starts[d]), int(s.starts[d + 1])
            L = int(length[t])
            q = np.asarray(T[t - L + 1 : t + 1]).astype(np.int64)
            recent, b = _other_doc_recent(idx, q, ds + offs[sh], de + offs[sh], brute_max) if L else (-1, True)
            brute += b
            longer = L < cap and t - L >= ds
            beyond = (
                _other_doc_recent(idx, np.asarray(T[t - L : t + 1]).astype(np.int64), ds + offs[sh], de + offs[sh], brute_max)[0]
                if longer
                else -1
            )
            if L == 0:
                good = cont[t] == idx.sep
            else:
                g = int(np.searchsorted(offs, recent, side="right")) - 1
                nxt = int(idx.shards[g].tok[recent - offs[g] + L]) if recent >= 0 else -1
                good = recent >= 0 and int(cont[t]) == (idx.eos_id if nxt == idx.sep else nxt)
            good = good and beyond < 0
        ok += bool(good)
        if not good and len(bad) < 10:
            bad.append({"shard": sh, "t": t, "length": int(length[t]), "cont": int(cont[t])})
    return {"checked": n, "equal": ok, "read_one_by_one": brute, "mismatches": bad}


def _stats_line(st: dict) -> str:
    return (
        f"{st['chunks']} chunks (largest {st['largest_chunk']:,} positions, {st['split_blocks']} split blocks), "
        f"memory budget {st['memory_bytes'] / 2**30:.1f} GiB, tokens {'mapped from scratch' if st['tokens_in_file'] else 'in memory'}; "
        f"prepare {st['prepare_s']:.0f} s, lengths {st['lengths_s']:.0f} s, continuations {st['continuations_s']:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index")
    ap.add_argument("--cap", type=int, default=64)
    ap.add_argument("--live-tokens", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pairwise-shards", type=int, nargs="*", default=[0, -1])
    ap.add_argument("--check", type=int, default=2000, help="positions checked against brute force")
    ap.add_argument("--scratch", type=Path, help="where the chunks wait between the passes (else merged twice)")
    ap.add_argument("--no-pair", action="store_true", help="skip part 1")
    ap.add_argument("--name", default="cross_shard")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args(argv)
    if args.smoke:  # a tiny index of three shards
        with smoke_context(True) as tmp:
            idx = tmp / "idx"
            sh(
                sys.executable,
                "-m",
                "teragram.builder.cli",
                smoke_corpus(tmp),
                "--out",
                idx,
                "--vocab-size",
                512,
                "--shard-tokens",
                40000,
                "--quiet",
            )
            return main(["--index", str(idx), "--live-tokens", "5000", "--repeat", "1", "--check", "50", "--scratch", str(tmp / "scratch")])
    if not args.index:
        ap.error("--index is required")
    idx = Index(args.index, threads=1, access="normal")
    load = {"before": os.getloadavg()}
    shards = [s % len(idx.shards) for s in args.pairwise_shards]
    frows, fequal, fdata = feature_rows(idx, args.cap, args.repeat, shards, args.scratch)
    load["after"] = os.getloadavg()
    t = time.perf_counter()
    check = spot_check(idx, fdata.pop("merged"), args.cap, args.check)
    check["seconds"] = time.perf_counter() - t
    fequal &= check["equal"] == check["checked"]
    prows, pequal = pair_rows(idx, args.cap, args.live_tokens) if not args.no_pair else ([], True)
    s, o = idx.shards[0], idx.shards[1]
    n = sum(x.tok.shape[0] for x in idx.shards)
    md = (
        f"Index: {len(idx.shards)} shards, {n:,} positions; cap {args.cap}; load average "
        f"{load['before'][0]:.2f} before, {load['after'][0]:.2f} after (of {os.cpu_count()} cores).\n\n"
        f"Exclude-doc length + continuation of every position (peak RSS {fdata['peak_rss_mb_after_merged']:,.0f} MiB after "
        f"the merged runs; last run: {_stats_line(fdata['merged_stats'][-1])}); answers equal on the pairwise shards and on "
        f"{check['equal']:,} of {check['checked']:,} positions checked by search ({check['read_one_by_one']:,} with every "
        f"occurrence read): {fequal}.\n\n" + table(frows, list(frows[0]))
    )
    if prows:
        md += (
            f"\n\nShard 0 ({s.tok.shape[0]:,} positions) against shard 1 ({o.n:,} suffixes); answers equal on the common documents: {pequal}.\n\n"
            + table(prows, list(prows[0]))
        )
    data = {"features": frows, "features_equal": fequal, "check": check, "pair": prows, "pair_equal": pequal, "cap": args.cap, "load": load}
    data |= fdata
    save(args.name, data, md, checks={"features == search's": bool(fequal), "pairwise answers == search's": bool(pequal)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
