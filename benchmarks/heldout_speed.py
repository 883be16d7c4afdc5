"""Bulk held-out scoring against indexes of growing size and shard count (issue 48): tokens per
second per core of the gates' index estimates (the ∞-gram and the fixed orders 2-17, with
counts: model.mixture.estimates.index_estimates_docs) and of held-out features (top-4, matches
capped at 64 tokens: index.heldout.held_out_features).

    python -m benchmarks.heldout_speed --index DATA/idx-050m DATA/idx-2b DATA/idx-2b-3sh \\
        --heldout DATA/heldout/timeshift/test.jsonl.zst [--tokens 300000] [--threads 1 2] \\
        [--baseline COMMIT] [--small-pages] [--index-side DATA/heldout]

Each index is measured in a fresh process, its files read into the page cache just before, in
2 MiB pages where the kernel can (`teragram warm`, index/pagecache.py: warm, as on a machine whose
memory holds the index, and the same whatever ran before), the documents are read and tokenized,
a pass over other documents compiles the kernels, then the index is opened afresh and two passes
over the documents are timed. The first pass pays for mapping every page it touches into the
process (minor page faults, about a quarter of the time at 2.43B in 12 shards); the second,
through the same opened index, is the rate a long run sustains (the index keeps no results
between passes; both give the same digest), and the one reported as tokens/s/core. An output
digest per index and operation shows that indexes of the same tokens in other shardings, and the
code of --baseline (a commit, run from a `git archive` of its library), give the same answers on
every position; each row also gives the measuring process's resident memory and the part of it
mapped 2 MiB at a time (/proc/self/smaps_rollup). --small-pages: each index also mapped 4 kB at
a time (MADV_NOHUGEPAGE). --index-side: the index side of an index-size evaluation, estimates of
every held-out file under that folder (both halves of each set) on 2 threads, timed on the
largest index. Writes benchmarks/results/heldout_speed.{json,md,png}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, SMOKE_HELP, library_at, library_env, save, smoke_context, smoke_index, smoke_jsonl, table

OPS = ("estimates", "features")
WARM_TOKENS = 20_000  # of other documents, scored before each measured pass


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def _run_op(idx, docs: list[np.ndarray], op: str, threads: int) -> str:
    """One bulk pass of op over the documents; the digest of its outputs."""
    if op == "estimates":
        from teragram.model.mixture.estimates import index_estimates_docs

        e = index_estimates_docs(idx, docs, threads=threads)
        return _digest(e[k] for k in sorted(e))
    from teragram.index.features import FIELDS, FeatureConfig
    from teragram.index.heldout import held_out_features

    f = held_out_features(idx, docs, FeatureConfig("held-out", 64, 4), threads=threads)
    return _digest(getattr(f, n) for n in FIELDS)


def _opened(spec: dict):
    """The index opened afresh; with spec["small_pages"], every array it maps advised
    MADV_NOHUGEPAGE before a search touches it: the same cached pages mapped 4 kB at a time."""
    import mmap

    from teragram.index.engine import Index
    from teragram.index.shard import advise

    idx = Index(spec["index"])
    if spec.get("small_pages"):
        arrays = [a for s in idx.shards for a in s.searched]
        arrays += [a for s in idx.shards if s.contexts is not None for a in (s.contexts.nodes, s.contexts.hist)]
        if idx.merged is not None:
            arrays += [getattr(idx.merged, n) for n in ("keys", "ends", "hist", "spans")]
        if idx.trigrams is not None:
            arrays.append(idx.trigrams)
        advise(arrays, mmap.MADV_NOHUGEPAGE)
    return idx


def worker(spec: dict) -> dict:
    """Measure one index (run in a process of its own): {op: {threads: {warm_s, first_s, s,
    digest}}}. A pass over other documents compiles
    the kernels; each op opens the index afresh and is timed twice over the documents (first_s,
    then s, the same opened index)."""
    from teragram.index.engine import Index
    from teragram.index.heldout import read_corpus

    idx = Index(spec["index"])
    docs, out = [], {}
    for path in spec["heldout"]:
        docs += read_corpus(idx, [path])[0]
    rest = []
    if spec.get("tokens"):
        cut = int(np.searchsorted(np.cumsum([len(d) for d in docs]), spec["tokens"])) + 1
        docs, rest = docs[:cut], docs[cut:]
    warm = int(np.searchsorted(np.cumsum([len(d) for d in rest]), WARM_TOKENS)) + 1
    rest = rest[:warm] if rest else docs[:1]
    tokens = int(sum(len(d) for d in docs))
    for op in spec["ops"]:
        out[op] = {}
        for th in spec["threads"]:
            t = time.perf_counter()
            _run_op(_opened(spec), rest, op, th)
            warm = time.perf_counter() - t
            fresh = _opened(spec)
            t = time.perf_counter()
            digest = _run_op(fresh, docs, op, th)
            first = time.perf_counter() - t
            s = first
            if spec.get("passes", 2) == 2:
                t = time.perf_counter()
                if _run_op(fresh, docs, op, th) != digest:
                    raise SystemExit(f"{spec['index']} {op}: two passes over the same documents disagree")
                s = time.perf_counter() - t
            r = {"warm_s": warm, "first_s": first, "s": s, "digest": digest, "tokens_per_s_core": tokens / s / th}
            out[op][str(th)] = r | {"first_tokens_per_s_core": tokens / first / th}
            print(
                f"  {Path(spec['index']).name} {op} threads {th}: {tokens / first / th:,.0f} then {tokens / s / th:,.0f} tokens/s/core",
                flush=True,
            )
    m = idx.manifest["counts"]
    return {"index": Path(spec["index"]).name, "index_tokens": m["tokens"], "shards": len(idx.shards), "tokens": tokens, "ops": out} | {
        "mapped": _mapped()
    }


def _mapped() -> dict:
    """This process's resident memory and the part of it mapped 2 MiB at a time (GiB; Linux)."""
    try:
        rows = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines() if ":" in line)
    except OSError:
        return {}
    gib = lambda k: round(int(rows[k].split()[0]) / 2**20, 2) if k in rows else None  # noqa: E731
    return {"rss_gib": gib("Rss"), "pmd_mapped_gib": gib("FilePmdMapped")}


def measure(spec: dict, library: Path | None = None) -> dict:
    """worker(spec) in a fresh process (with the library at `library` when given), the index
    warmed just before (the same way for every library)."""
    from teragram.index.pagecache import warm

    warmed = warm(spec["index"])
    cmd = [sys.executable, "-m", "benchmarks.heldout_speed", "--worker", json.dumps(spec)]
    r = subprocess.run(cmd, cwd=REPO, env=library_env(library), capture_output=True, text=True)
    sys.stdout.write(r.stdout.split("RESULT ")[0])
    if r.returncode:
        raise SystemExit(f"{cmd[:4]} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.split("RESULT ", 1)[1]) | {"warmed": warmed}


def _plot(rows: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for code in sorted({r["code"] for r in rows}):
        for op in OPS:
            pts = sorted(
                (r["shards"], r["ops"][op][str(max(map(int, r["ops"][op])))]["tokens_per_s_core"])
                for r in rows
                if r["code"] == code and op in r["ops"]
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{op} ({code})")
    ax.set_xlabel("shards")
    ax.set_ylabel("tokens/s/core")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("bulk held-out scoring")
    return fig


def _report(rows: list[dict], side: dict | None) -> str:
    out = []
    for r in rows:
        for op, per in r["ops"].items():
            for th, m in per.items():
                out.append(
                    {
                        "code": r["code"],
                        "index": r["index"],
                        "index tokens": f"{r['index_tokens'] / 1e6:,.0f}M",
                        "shards": r["shards"],
                        "op": op,
                        "threads": th,
                        "tokens": f"{r['tokens']:,}",
                        "first pass, tokens/s/core": f"{m['first_tokens_per_s_core']:,.0f}" if "first_s" in m else "",
                        "tokens/s/core": f"{m['tokens_per_s_core']:,.0f}",
                        "digest": m["digest"],
                        "resident GiB (2 MiB-mapped)": f"{r['mapped']['rss_gib']} ({r['mapped']['pmd_mapped_gib']})"
                        if r.get("mapped")
                        else "",
                    }
                )
    md = table(out, list(out[0]))
    if side:
        md += (
            f"\n\nIndex side of an index-size evaluation on {side['index']} ({side['shards']} shards): the gates' estimates of "
            f"{side['tokens']:,} tokens (every held-out file, both halves) on {side['threads']} threads in {side['s'] / 60:.1f} minutes, "
            f"one pass from the index just opened: {side['tokens'] / side['s'] / side['threads']:,.0f} tokens/s/core."
        )
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", nargs="+", type=Path)
    ap.add_argument("--heldout", nargs="+", type=Path, help="held-out text (JSON lines, files or folders)")
    ap.add_argument("--tokens", type=int, default=300_000, help="first documents of --heldout up to this many tokens")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--baseline", help="also measure the library at this commit (e.g. the one before the change)")
    ap.add_argument("--baseline-index", nargs="*", type=Path, help="indexes to measure with --baseline (default: all)")
    ap.add_argument("--index-side", type=Path, help="folder of held-out sets: time the gates' estimates of all of it")
    ap.add_argument("--small-pages", action="store_true", help="also each index mapped 4 kB at a time (MADV_NOHUGEPAGE)")
    ap.add_argument("--name", default="heldout_speed")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    a = ap.parse_args(argv)
    if a.worker:
        print("RESULT " + json.dumps(worker(json.loads(a.worker))))
        return 0
    with smoke_context(a.smoke) as tmp:
        if a.smoke:
            a.index, a.heldout, a.tokens, a.threads = [smoke_index(tmp)], [smoke_jsonl(tmp, heldout=True)], 5000, [1]
            a.baseline, a.index_side, a.small_pages = "HEAD" if (REPO / ".git").exists() else None, None, True
        if not a.index or not a.heldout:
            ap.error("--index and --heldout are required")
        rows = []
        base = {"heldout": [str(p) for p in a.heldout], "tokens": a.tokens, "threads": a.threads, "ops": list(OPS)}
        with tempfile.TemporaryDirectory(prefix="heldout-speed-") as t:
            lib = library_at(a.baseline, Path(t)) if a.baseline else None
            for ix in a.index:
                rows.append(measure(base | {"index": str(ix)}) | {"code": "this commit"})
                if a.small_pages:
                    rows.append(measure(base | {"index": str(ix), "small_pages": True}) | {"code": "this commit, 4 kB pages"})
                if lib is not None and (a.baseline_index is None or ix in a.baseline_index):
                    rows.append(measure(base | {"index": str(ix)}, lib) | {"code": f"baseline {a.baseline}"})
        side = None
        if a.index_side:
            big = max(a.index, key=lambda p: json.loads((p / "manifest.json").read_text())["counts"]["tokens"])
            files = sorted(str(p) for p in a.index_side.rglob("*.jsonl.zst"))
            r = measure({"heldout": files, "tokens": 0, "threads": [2], "ops": ["estimates"], "index": str(big), "passes": 1})
            side = {"index": r["index"], "shards": r["shards"], "tokens": r["tokens"], "threads": 2} | {
                k: r["ops"]["estimates"]["2"][k] for k in ("s", "warm_s")
            }
        save(a.name, {"rows": rows, "index_side": side}, _report(rows, side), _plot(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
