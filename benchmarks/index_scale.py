"""The index at billions of tokens: size on disk, query latency warm and cold, and bulk
held-out estimates, for nested indexes from tens of millions to billions of tokens; at one
size, infini-gram's engine on the very same token ids.

    python -m benchmarks.index_scale --index DATA/idx-050m DATA/idx-200m DATA/idx-1b DATA/idx-2b \\
        --heldout DATA/outputs-125m/unpacked/timeshift-test [--infinigram IG_DIR --infinigram-of DATA/idx-1b]

Queries are drawn from held-out text (newer kernel files), so they behave like an application's:
`count` of 1-10-token n-grams, `infgram_prob` and `longest_match` of 32-token contexts. Warm: every
query run once before timing. Cold: before each timed query the pages of every index file are
dropped from the page cache (posix_fadvise DONTNEED, no root needed); the process's own memory
(each shard's top-level cache, index/top_cache.py) stays, as it does in a server. Bulk estimates:
index_estimates_docs (index/bulk.py) over held-out documents on one thread.

`--infinigram DIR` (an infini-gram index of the same ids; `--build-infinigram` makes it with
infini-gram's indexer, timed) adds its engine's latencies on the same queries.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import SMOKE_HELP, run_measured, save, sh, smoke_context, smoke_corpus, smoke_index, table

OPS = ("count", "infgram_prob", "longest_match")


def evict(paths: list[Path], maps=()) -> None:
    """Drop the files' pages from the page cache. A page mapped by a process stays cached, so
    this process's own mappings (maps: numpy memmaps) first let go of theirs (madvise); the
    files must not be mapped by another process meanwhile."""
    for m in maps:
        m._mmap.madvise(mmap.MADV_DONTNEED)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def index_maps(idx) -> list:
    out = []
    for s in idx.shards:
        out += [a for a in (s.tok, s.starts, s.sa.words, s.samax, s.unigram) if getattr(a, "_mmap", None) is not None]
    return out


def queries(heldout: Path, n: int, seed: int = 0) -> dict[str, list[tuple]]:
    from teragram.index import format as fmt

    d = heldout / "000000"
    tok = np.asarray(fmt.open_array(d / "tokens.bin", "tokens")).astype(np.int64)
    sep = int(np.iinfo(fmt.open_array(d / "tokens.bin", "tokens").dtype).max)
    rng = np.random.default_rng(seed)

    def sample(m: int) -> list[int]:
        while True:
            p = int(rng.integers(0, len(tok) - m))
            q = tok[p : p + m]
            if not (q == sep).any():
                return [int(x) for x in q]

    short = [sample(int(rng.integers(1, 11))) for _ in range(n)]
    long33 = [sample(33) for _ in range(n)]
    return {
        "count": [(q,) for q in short],
        "infgram_prob": [(q[:32], q[32]) for q in long33],
        "longest_match": [(q[:32],) for q in long33],
    }


def timed(fn, qs: list[tuple], cold=None) -> np.ndarray:
    """Milliseconds per query; cold(): called before each (untimed) to make it a cold query."""
    out = []
    for q in qs:
        if cold is not None:
            fn = cold() or fn
        t = time.perf_counter()
        fn(*q)
        out.append(time.perf_counter() - t)
    return np.array(out) * 1e3


def latencies(fns: dict, qs: dict, cold, n_cold: int) -> dict:
    """cold(op) -> None, or a fresh callable for op (an engine reopened over evicted files)."""
    res = {}
    for op, fn in fns.items():
        timed(fn, qs[op])  # warm-up: numba, page cache, top-level caches
        warm = timed(fn, qs[op])
        c = timed(fn, qs[op][:n_cold], lambda op=op: cold(op))
        res[op] = {"warm_median_ms": float(np.median(warm)), "warm_p90_ms": float(np.percentile(warm, 90))}
        res[op] |= {"cold_median_ms": float(np.median(c)), "cold_p90_ms": float(np.percentile(c, 90))}
    return res


def open_cold(root: Path, q: tuple, stored: bool, repeats: int = 3) -> float:
    """Median ms to open the index and answer its first count with every index file evicted
    from the page cache: with the builder's stored suffix-array samples (stored, when the index
    has them: index/top_cache.py) or with them built in memory on first use."""
    from teragram.index import format as fmt
    from teragram.index import top_cache
    from teragram.index.engine import Index

    man = fmt.read_json(root / "manifest.json")
    files = [p for s in man["shards"] for p in fmt.shard_dir(root, s["shard"], s.get("dir")).glob("*.bin")]
    load = top_cache.load
    out = []
    try:
        if not stored:
            top_cache.load = lambda *a: None
        for _ in range(repeats):
            evict(files)
            t = time.perf_counter()
            Index(root).count(*q)
            out.append(time.perf_counter() - t)
    finally:
        top_cache.load = load
    return float(np.median(out)) * 1e3


def bulk_rate(idx, heldout: Path, max_tokens: int) -> dict:
    from teragram.model.mixture.estimates import heldout_docs, index_estimates_docs

    docs, n = [], 0
    for d in heldout_docs(heldout):
        if n >= max_tokens:
            break
        docs.append(d)
        n += len(d)
    index_estimates_docs(idx, docs[:2])  # numba
    t = time.perf_counter()
    index_estimates_docs(idx, docs, threads=1)
    dt = time.perf_counter() - t
    return {"tokens": n, "s": dt, "tokens_per_s_core": n / dt}


def measure_index(root: Path, qs: dict, heldout: Path, n_cold: int, bulk_tokens: int, threads: int = 1) -> dict:
    from teragram.index import format as fmt
    from teragram.index import top_cache
    from teragram.index.engine import Index

    opened = {"stored": open_cold(root, qs["count"][0], True), "built": open_cold(root, qs["count"][0], False)}
    idx = Index(root, threads=threads)
    man = idx.manifest
    sizes: dict[str, int] = {}
    for s in man["shards"]:
        for f in s["files"]:
            name = Path(f["path"]).name
            sizes[name] = sizes.get(name, 0) + f["size"]
    n = man["counts"]["tokens"]
    maps = index_maps(idx)
    files = [Path(m.filename) for m in maps]  # the files the queries read (shards may be symlinks elsewhere)
    fns = {
        "count": idx.count,
        "infgram_prob": idx.infgram_prob,
        "longest_match": idx.longest_match,
    }
    row = {
        "index": root.name,
        "tokens": n,
        "shards": len(idx.shards),
        "bytes_per_token_tokens_sa": (sizes["tokens.bin"] + sizes["sa.bin"]) / n,
        "bytes_per_token_all": sum(sizes.values()) / n,
        "latency": latencies(fns, qs, lambda op: evict(files, maps), n_cold),
        "bulk_estimates": bulk_rate(idx, heldout, bulk_tokens),
        "open_cold_ms": opened,
        "stored_samples": all((fmt.shard_dir(root, s["shard"], s.get("dir")) / top_cache.POS_FILE).exists() for s in man["shards"]),
    }
    print(json.dumps(row), flush=True)
    return row


_RESHARD = """
import sys, time
from benchmarks.build import doc_ids
from teragram.builder.build import build_from_ids
docs = doc_ids({of!r})
t = time.time()
build_from_ids(docs, {out!r}, {of!r} + "/tokenizer.model", shard_tokens={shard}, workers=2, memory_gb=8)
print("INDEX_S", time.time() - t)
import resource
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM"))
print("RSS_KB", hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def reshard(of: Path, out: Path, shards: int) -> dict:
    """The ids of index `of` rebuilt as `shards` shards with --memory 8, timed (the ids are read
    first, outside the timed part; peak RSS is the whole process's)."""
    from teragram.index.engine import Index

    if (out / "reshard.json").exists():
        return json.loads((out / "reshard.json").read_text())
    n = Index(of).n_positions
    code = _RESHARD.format(of=str(of), out=str(out), shard=-(-n // shards) + 1)
    log = out.parent / f"{out.name}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    m = run_measured([sys.executable, "-c", code], stdout=open(log, "w"))
    text = log.read_text()
    own, kids = (int(x) / 1024 for x in text.split("RSS_KB")[1].split()[:2])
    # wait4's peak RSS counts the parent's pages mapped when the child was forked: read the
    # builder's own high-water mark and its workers' instead (their sum bounds the tree's peak)
    m.pop("peak_rss_mb")
    m |= {"of": of.name, "shards": len(Index(out).shards), "index_s": float(text.split("INDEX_S")[1].split()[0])}
    m |= {"rss_own_mb": own, "rss_workers_mb": kids}
    (out / "reshard.json").write_text(json.dumps(m))
    return m


def build_infinigram(of: Path, out: Path, mem_gb: int, cpus: int) -> dict:
    from benchmarks.build import doc_ids, write_infinigram

    write_infinigram(doc_ids(of), out)
    (out.parent / "ig_data_empty").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "infini_gram.indexing", "--data_dir", str(out.parent / "ig_data_empty"), "--save_dir", str(out)]
    cmd += ["--token_dtype", "u16", "--cpus", str(cpus), "--mem", str(mem_gb), "--ulimit", "20000"]
    m = run_measured(cmd, stdout=open(out / "indexing.log", "w"), stderr=open(out / "indexing.err", "w"))
    m["bytes"] = {p.name: p.stat().st_size for p in out.iterdir() if p.name.split(".")[0] in ("tokenized", "table", "offset")}
    (out / "build.json").write_text(json.dumps(m))
    return m


def measure_infinigram(ig_dir: Path, of: Path, qs: dict, n_cold: int) -> dict:
    from infini_gram.engine import InfiniGramEngine
    from teragram.index.engine import Index

    idx = Index(of)
    files = [p for p in ig_dir.iterdir() if p.name.split(".")[0] in ("tokenized", "table", "offset")]
    engine = {}

    def open_engine():
        engine.clear()  # its mappings go with it
        gc.collect()
        evict(files)
        engine["e"] = InfiniGramEngine(index_dir=str(ig_dir), eos_token_id=idx.eos_id, vocab_size=65535, version=4, token_dtype="u16")

    open_engine()
    calls = {  # infini-gram has no longest-match query of its own (its infgram_prob makes the same search)
        "count": lambda q: engine["e"].count(input_ids=q),
        "infgram_prob": lambda q, c: engine["e"].infgram_prob(prompt_ids=q, cont_id=c),
    }
    # cold: the engine is reopened over evicted files (it keeps no cache of its own)
    lat = latencies(calls, qs, lambda op: open_engine(), n_cold)
    built = json.loads((ig_dir / "build.json").read_text()) if (ig_dir / "build.json").exists() else None
    return {"of": of.name, "latency": lat, "build": built}


def _opened(r: dict) -> str:
    o = r.get("open_cold_ms")
    if o is None:
        return ""
    return f"{o['stored']:.3g} / {o['built']:.3g}" if r.get("stored_samples") else f"(none stored) / {o['built']:.3g}"


def report(res: dict, name: str = "index_scale") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for r in res["indexes"]:
        tr = {"index": r["index"], "tokens": f"{r['tokens'] / 1e6:,.0f}M", "shards": r["shards"]}
        tr["B/token (tokens+SA / all)"] = f"{r['bytes_per_token_tokens_sa']:.2f} / {r['bytes_per_token_all']:.2f}"
        for op in OPS:
            lat = r["latency"][op]
            tr[f"{op} warm / cold ms"] = f"{lat['warm_median_ms']:.3g} / {lat['cold_median_ms']:.3g}"
        tr["bulk estimates tok/s/core"] = f"{r['bulk_estimates']['tokens_per_s_core']:,.0f}"
        tr["open + first count, cold ms (stored samples / built)"] = _opened(r)
        rows.append(tr)
    res["reshard_warm_ratio"] = {}
    for r in res.get("reshard", []):
        one = next(x for x in res["indexes"] if x["index"] == r["of"])
        res["reshard_warm_ratio"][f"{r['of']}:{r['shards']}"] = {
            op: r["latency"][op]["warm_median_ms"] / one["latency"][op]["warm_median_ms"] for op in OPS
        }
        tr = {"index": f"{r['of']} rebuilt as {r['shards']} shards", "tokens": f"{r['tokens'] / 1e6:,.0f}M", "shards": r["shards"]}
        tr |= {f"{op} warm / cold ms": f"{r['latency'][op]['warm_median_ms']:.3g} / {r['latency'][op]['cold_median_ms']:.3g}" for op in OPS}
        tr["B/token (tokens+SA / all)"] = f"{r['bytes_per_token_tokens_sa']:.2f} / {r['bytes_per_token_all']:.2f}"
        tr["bulk estimates tok/s/core"] = f"{r['bulk_estimates']['tokens_per_s_core']:,.0f}"
        rss = f", {(r['rss_own_mb'] + r['rss_workers_mb']) / 1024:.1f} GiB" if "rss_own_mb" in r else " (RSS not measured)"
        tr["build from ids"] = f"{r['index_s']:.0f} s{rss}"
        tr["open + first count, cold ms (stored samples / built)"] = _opened(r)
        rows.append(tr)
    ig = res.get("infinigram")
    if ig:
        tr = {"index": f"infini-gram, ids of {ig['of']}", "tokens": "", "shards": 1}
        for op in ig["latency"]:
            lat = ig["latency"][op]
            tr[f"{op} warm / cold ms"] = f"{lat['warm_median_ms']:.3g} / {lat['cold_median_ms']:.3g}"
        rows.append(tr)
    cols = list(dict.fromkeys(c for r in rows for c in r))
    md = "Median latency per query, warm and cold (index pages evicted before each cold query):\n\n" + table(rows, cols)
    if ig and ig.get("build"):
        b = ig["build"]
        md += f"\n\ninfini-gram's indexer on the ids of {ig['of']} (--cpus 2 --mem 8): {b['wall_s']:.0f} s, peak RSS {b['peak_rss_mb'] / 1024:.1f} GiB."
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = [r["tokens"] for r in res["indexes"]]
    for op in OPS:
        for ax, kind in zip(axes, ("warm", "cold")):
            ax.plot(x, [r["latency"][op][f"{kind}_median_ms"] for r in res["indexes"]], marker="o", label=op)
            ax.set_title(f"{kind} median latency")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("index tokens")
        ax.set_ylabel("ms")
        ax.legend()
    save(name, res, md, fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", type=Path, nargs="+")
    ap.add_argument("--heldout", type=Path, help="a held-out features or outputs directory: the queries' text")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--cold", type=int, default=200, help="queries timed cold per operation")
    ap.add_argument("--bulk-tokens", type=int, default=100_000)
    ap.add_argument("--reshard", nargs="+", default=[], help="IDX:N: also measure the ids of index IDX rebuilt as N shards")
    ap.add_argument("--work", type=Path, default=Path("/tmp/index-scale"), help="where --reshard's index goes")
    ap.add_argument("--infinigram", type=Path, help="an infini-gram index of the ids of --infinigram-of")
    ap.add_argument("--infinigram-of", type=Path)
    ap.add_argument("--build-infinigram", action="store_true", help="build --infinigram first with infini-gram's indexer")
    ap.add_argument("--infinigram-mem", type=int, default=8)
    ap.add_argument("--name", default="index_scale", help="results file name")
    ap.add_argument("--threads", type=int, default=1, help="shards searched at once (Index(threads=...))")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    a = ap.parse_args(argv)
    if a.smoke:
        with smoke_context(True) as tmp:
            idx, held = smoke_index(tmp), tmp / "heldout"
            sh(
                sys.executable,
                "-m",
                "teragram.serve.main",
                "features",
                idx,
                "--out",
                held,
                "--corpus",
                smoke_corpus(tmp, heldout=True) / "valid",
                "--quiet",
            )
            return main(
                [
                    "--index",
                    str(idx),
                    "--heldout",
                    str(held),
                    "--queries",
                    "20",
                    "--cold",
                    "5",
                    "--bulk-tokens",
                    "2000",
                    "--reshard",
                    f"{idx}:2",
                ]
                + [
                    "--work",
                    str(tmp / "work"),
                    "--infinigram",
                    str(tmp / "ig"),
                    "--infinigram-of",
                    str(idx),
                    "--build-infinigram",
                    "--infinigram-mem",
                    "1",
                ]
            )
    if not (a.index and a.heldout):
        ap.error("--index and --heldout are required")
    qs = queries(a.heldout, a.queries)
    res = {"queries": a.queries, "cold_queries": a.cold, "heldout": str(a.heldout)}
    if a.infinigram and a.build_infinigram:
        build_infinigram(a.infinigram_of, a.infinigram, a.infinigram_mem, 2)
    res["indexes"] = [measure_index(r, qs, a.heldout, a.cold, a.bulk_tokens, a.threads) for r in a.index]
    res["reshard"] = []
    for spec in a.reshard:
        of, n = Path(spec.rsplit(":", 1)[0]), int(spec.rsplit(":", 1)[1])
        out = a.work / f"{of.name}-{n}shards"
        res["reshard"].append(reshard(of, out, n) | measure_index(out, qs, a.heldout, a.cold, a.bulk_tokens))
    if a.infinigram:
        res["infinigram"] = measure_infinigram(a.infinigram, a.infinigram_of, qs, a.cold)
    report(res, a.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
