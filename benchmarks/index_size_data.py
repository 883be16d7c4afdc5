"""Data of the index-size benchmark (issue 14) and the scale benchmark (issue 13): a corpus of
> 2B tokens from Debian packages, held-out sets kept out of every index, and nested indexes.

Everything goes under DATA (large; outside the repository). One command per step, in order:

    python -m benchmarks.perplexity_data --out DATA/ppl --scale gpu      # the 125M model's text
    build-index DATA/ppl/train-code.jsonl.zst DATA/ppl/train-english.jsonl.zst \\
        --out DATA/idx-050m --vocab-size 32000 --workers 2 --shard-tokens 134217728
    python -m benchmarks.index_size_data export  --data DATA           # DATA/extra/CORPUS/bNN.jsonl.zst
    python -m benchmarks.index_size_data heldout --data DATA           # DATA/heldout/{indist,timeshift,prose,packages}
    python -m benchmarks.index_size_data index   --data DATA --name idx-200m --tokens 200e6
    python -m benchmarks.index_size_data index   --data DATA --name idx-1b --tokens 1e9
    python -m benchmarks.index_size_data index   --data DATA --name idx-2b --all
    python -m benchmarks.index_size_data export  --data DATA --pool    # DATA/extra2/GROUP/bNN.jsonl.zst
    python -m benchmarks.index_size_data index   --data DATA --name idx-5b --tokens 5e9 --pool --part-buckets 32

The extra corpus is every train-split document (corpora.split_of) of linux-source-6.1 and the
English packages that the 125M model's training text does not already hold, plus the
corpora.EXTRA_CODE and EXTRA_ENGLISH packages, one document per source file, exported once into
100 buckets by a hash of the path (corpora.sample_bucket). An index of the extra corpus's buckets
< k plus the model's training text holds every document of each smaller k: the indexes nest, and
each is a uniform sample of documents of the next, never a prefix of a sorted list. All of them
use idx-050m's tokenizer. Held-out documents never enter an index: the indist set is the
perplexity benchmark's held-out documents (split_of == heldout, which the exports skip), the
time-shifted and prose sets come from evaluation-only corpora (corpora.EVAL_ONLY) that no export
accepts, and the packages set is code of whole packages held out of every index (the package pool
of tools/package_pool.py, split by a hash of the package name before any export; `heldout --sets
packages` makes it alone, selecting the pool and downloading its held-out packages if needed). The
held-out sets are made by benchmarks/lib/heldout_sets.py.
The next doubling nests on the whole extra corpus the same way: the indexable packages of the
pool, exported into 100 buckets by path hash (DATA/extra2/), are a second stage (STAGES) whose
buckets < k are indexed in parts under DATA/parts2/ and composed with idx-050m and every part of
the extra corpus. Each step appends what it made to DATA/READY.md; an index step that stops
resumes when run again (build-index resumes a part after its last completed shard).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import SMOKE_HELP, note_ready, read_jsonl, smoke_context, smoke_data, write_jsonl
from benchmarks.lib.heldout_sets import HELDOUT_SETS, heldout
from tools import corpora, package_pool

EXTRA = (*corpora.CODE, *corpora.ENGLISH, *corpora.EXTRA_CODE, *corpora.EXTRA_ENGLISH)
TRAIN = ("train-code.jsonl.zst", "train-english.jsonl.zst")
POOL_DIR = "extra2"  # the package pool (tools.package_pool) and its export: DATA/extra2/


@dataclass(frozen=True)
class Stage:
    """An exported corpus that nested indexes take bucket by bucket: its corpora's exports under
    DATA/exports/NAME/bNN.jsonl.zst, the indexes of its buckets under DATA/parts/bLO-bHI."""

    exports: str
    names: tuple[str, ...]
    parts: str


STAGES = (Stage("extra", EXTRA, "parts"), Stage(POOL_DIR, tuple(package_pool.GROUPS), "parts2"))


# ---- export ----------------------------------------------------------------------------------


def export_all(data: Path) -> dict:
    """Every extra corpus into DATA/extra/NAME/bNN.jsonl.zst, less the model's training text."""
    have = {rec["path"] for name in TRAIN for rec in read_jsonl(data / "ppl" / name)}
    out = {}
    for name in EXTRA:
        t0 = time.time()
        m = corpora.export_buckets(name, data / "extra", exclude=frozenset(have))
        note_ready(
            data,
            f"extra/{name}: {sum(m['docs']):,} docs, {sum(m['bytes']) / 1e6:,.1f} MB of text, skipped {m['skipped']} ({time.time() - t0:.0f} s)",
        )
        out[name] = m
    return out


def export_pool(data: Path) -> dict:
    """The package pool (selected and recorded in DATA/extra2/pool.json once) downloaded, and its
    indexable packages exported into DATA/extra2/GROUP/bNN.jsonl.zst."""
    pool = package_pool.ensure_pool(data / POOL_DIR / "pool.json")
    if failed := package_pool.download([p for p in pool if p["split"] == "indexable"]):
        raise SystemExit(f"{len(failed)} pool packages not downloaded: {', '.join(failed[:10])}")
    out = {}
    for group in package_pool.GROUPS:
        t0 = time.time()
        m = package_pool.export_group(pool, group, data / POOL_DIR)
        note_ready(
            data,
            f"{POOL_DIR}/{group}: {len(m['packages']):,} packages, {sum(m['docs']):,} docs, "
            f"{sum(m['bytes']) / 1e6:,.1f} MB of text, skipped {m['skipped']} ({time.time() - t0:.0f} s)",
        )
        out[group] = m
    return out


# ---- nested indexes --------------------------------------------------------------------------


def tokens_per_byte(data: Path, tokenizer: Path, sample_bytes: int = 2_000_000, stage: Stage = STAGES[0]) -> dict[str, float]:
    """Tokens per byte of text of each corpus of a stage, measured on the first documents of bucket 0."""
    from teragram.index import tokenizer as tok

    cached = data / stage.exports / "tokens_per_byte.json"
    if cached.exists():
        return json.loads(cached.read_text())
    sp = tok.load(tokenizer)
    out = {}
    for name in stage.names:
        n_tok = n_bytes = 0
        for r in read_jsonl(data / stage.exports / name / "b00.jsonl.zst"):
            n_tok += len(sp.encode(r["text"]))
            n_bytes += len(r["text"].encode())
            if n_bytes >= sample_bytes:
                break
        out[name] = n_tok / max(n_bytes, 1)
    cached.write_text(json.dumps(out, indent=1))
    return out


def plan(data: Path, base_tokens: int, tpb: dict[str, float], target: float | None, stage: Stage = STAGES[0]) -> tuple[int, float]:
    """The fewest buckets of a stage whose estimated tokens, with the base, reach target (all 100 if None)."""
    manifests = {n: json.loads((data / stage.exports / n / "manifest.json").read_text()) for n in stage.names}
    nb = manifests[stage.names[0]]["buckets"]
    est = base_tokens
    for k in range(nb):
        est += sum(tpb[n] * m["bytes"][k] for n, m in manifests.items())
        if target is not None and est >= target:
            return k + 1, est
    return nb, est


class _PeakRss:
    """Peak of the summed RSS of a process and all its descendants, sampled every second."""

    def __init__(self, pid: int):
        import psutil

        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(1.0):
            try:
                procs = [self.proc, *self.proc.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self.thread.join()
        return self.peak


def _run_build(data: Path, files: list[Path], out: Path, shard_tokens: int, workers: int) -> dict:
    """build-index over files into out, with the peak RSS of its whole process tree."""
    tokenizer = data / "idx-050m" / "tokenizer.model"
    cmd = [str(Path(sys.executable).with_name("build-index")), *map(str, files), "--out", str(out), "--tokenizer", str(tokenizer)]
    cmd += ["--workers", str(workers), "--shard-tokens", str(shard_tokens), "--quiet"]
    t0 = time.time()
    log_name = f"{out.name}.log" if out.parent.name == STAGES[0].parts else f"{out.parent.name}-{out.name}.log"
    with open(data / "logs" / log_name, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        rss = _PeakRss(proc.pid)
        rc = proc.wait()
        peak = rss.stop()
    if rc != 0:
        raise SystemExit(f"build-index failed ({rc}): see {data / 'logs' / log_name}")
    report = json.loads((out / "build-report.json").read_text())
    return {"command": cmd, "wall_s": time.time() - t0, "peak_rss_tree_mb": peak / 2**20, "build_report": report}


def _parts(data: Path, stage: Stage = STAGES[0]) -> list[tuple[int, int, Path]]:
    """Finished parts (lo, hi, dir): indexes of a stage's buckets lo..hi-1, by lo."""
    out = []
    for d in sorted((data / stage.parts).glob("b*-b*")):
        if (d / "part.json").exists():
            lo, hi = (int(x[1:]) for x in d.name.split("-"))
            out.append((lo, hi, d))
    return sorted(out)


def build_part(data: Path, lo: int, hi: int, shard_tokens: int, workers: int, stage: Stage = STAGES[0]) -> Path:
    """An index of a stage's buckets lo..hi-1 (build-index resumes a part left unfinished)."""
    out = data / stage.parts / f"b{lo:02d}-b{hi:02d}"
    files = [data / stage.exports / n / f"b{b:02d}.jsonl.zst" for n in stage.names for b in range(lo, hi)]
    run = _run_build(data, files, out, shard_tokens, workers)
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    (out / "part.json").write_text(json.dumps({"buckets": [lo, hi], "corpora": list(stage.names), "counts": counts} | run, indent=1))
    note_ready(
        data,
        f"{stage.parts}/{out.name} ({stage.exports} buckets {lo}..{hi - 1}): {counts['tokens']:,} tokens, {counts['docs']:,} docs, "
        f"{counts['shards']} shards; build {run['wall_s'] / 60:.1f} min, peak RSS {run['peak_rss_tree_mb'] / 1024:.1f} GiB (process tree)",
    )
    return out


def compose(out: Path, parts: list[Path]) -> dict:
    """An index whose shards are the shards of `parts` (same tokenizer), linked, not copied: the
    exact answers of one index over all their documents, as a multi-shard build gives."""
    from teragram.index import format as fmt
    from teragram.index import merged, trigrams
    from teragram.index import meta as meta_store
    from teragram.index.engine import Index

    manifests = [json.loads((p / "manifest.json").read_text()) for p in parts]
    digests = {hashlib.blake2b((p / "tokenizer.model").read_bytes()).hexdigest() for p in parts}
    if len(digests) != 1 or len({m["token_dtype"] for m in manifests}) != 1:
        raise SystemExit(f"cannot compose {out.name}: its parts have different tokenizers or token types")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    (out / "shards").mkdir(parents=True)
    (out / "tokenizer.model").write_bytes((parts[0] / "tokenizer.model").read_bytes())
    shards, markers, first_doc = [], [], 0
    skipped: dict[str, int] = {}
    for p, m in zip(parts, manifests, strict=True):
        for s in m["shards"]:
            k = len(shards)
            (out / "shards" / f"{k:06d}").symlink_to(fmt.shard_dir(p.resolve(), s["shard"], s.get("dir")))
            files = [f | {"path": f"shards/{k:06d}/{Path(f['path']).name}"} for f in s["files"]]
            shards.append(s | {"shard": k, "dir": None, "files": files, "first_doc": first_doc})
            markers.append({"shard": k, "dir": None})
            first_doc += s["n_docs"]
        for reason, n in m["skipped"]["counts"].items():
            skipped[reason] = skipped.get(reason, 0) + n
    manifest = {k: v for k, v in manifests[0].items() if k != "contexts"} | {
        "counts": fmt.manifest_counts(shards, first_doc),
        "shards": shards,
        "build": {"composed_of": [str(p.resolve()) for p in parts], "parts": [m["build"] for m in manifests]},
        "skipped": {"counts": skipped, "examples": {}},
    }
    if len(shards) > 1:  # the shards' summed histograms and filters, as build-index gives an index of several
        idx = Index(out, access="normal", manifest=manifest)
        manifest["contexts"] = merged.write(out, idx)
        manifest["trigrams"] = trigrams.write(out, idx)
    meta_store.write(out, markers, manifest)
    fmt.write_json(out / "manifest.json", manifest)
    return manifest


def _contiguous_parts(data: Path, stage: Stage) -> list[tuple[int, int, Path]]:
    parts = _parts(data, stage)
    if any(a != b for (_, a, _), (b, _, _) in zip(parts, parts[1:], strict=False)) or (parts and parts[0][0] != 0):
        raise SystemExit(f"{data / stage.parts}: the parts do not cover buckets 0.. without gaps")
    return parts


def _tokens(index: Path) -> int:
    return json.loads((index / "manifest.json").read_text())["counts"]["tokens"]


def _part_run(index: Path) -> dict:
    """wall_s and peak_rss_tree_mb of the build of a part (part.json) or of an index built alone."""
    if (index / "part.json").exists():
        return json.loads((index / "part.json").read_text())
    report = json.loads((index / "build-report.json").read_text())
    return {"wall_s": report["timings"]["total_s"], "peak_rss_tree_mb": report["peak_rss_mb"]}


def _inputs(index: Path) -> list[str]:
    """The input files build-index made the index from (resolved), none if it was composed."""
    state = index / "build-state.json"
    return [str(Path(f).resolve()) for f in json.loads(state.read_text())["inputs"]] if state.exists() else []


def _whole_extra(data: Path, on: Path, nb: int) -> Path:
    """on, if build-index made it from exactly idx-050m's text and every bucket of the extra corpus."""
    want = set(_inputs(data / "idx-050m"))
    want |= {str((data / "extra" / n / f"b{b:02d}.jsonl.zst").resolve()) for n in EXTRA for b in range(nb)}
    if (got := set(_inputs(on))) != want:
        raise SystemExit(f"{on}: not built from exactly idx-050m's text and the whole extra corpus ({len(got)} inputs, {len(want)} wanted)")
    return on


def build(
    data: Path,
    name: str,
    target: float | None,
    shard_tokens: int,
    workers: int,
    *,
    pool: bool = False,
    part_buckets: int = 0,
    on: Path | None = None,
) -> dict:
    """idx-050m plus the extra corpus's buckets < k (k from the token target) or, with pool, plus
    all of the extra corpus's parts (or the index `on`, built in one piece from idx-050m's text and
    the whole extra corpus) and the package pool's buckets < k: the buckets not yet indexed are
    built as parts of part_buckets buckets each (all in one if 0; a part left unfinished resumes),
    then the index is composed of idx-050m and the parts, so that it nests on every smaller one."""
    tokenizer = data / "idx-050m" / "tokenizer.model"
    base = json.loads((data / "idx-050m" / "manifest.json").read_text())["counts"]["tokens"]
    stage, below, nb = STAGES[1 if pool else 0], [], 0
    if pool:
        nb = json.loads((data / "extra" / EXTRA[0] / "manifest.json").read_text())["buckets"]
        if on is not None:  # the whole extra corpus indexed in one piece (build-index over all its files)
            below, base = [_whole_extra(data, on, nb)], 0
        else:
            first = _contiguous_parts(data, STAGES[0])
            if not first or first[-1][1] != nb:
                raise SystemExit("index the whole extra corpus first (index --all, or give --on): the package pool nests on it")
            below = [d for _, _, d in first]
        base += sum(_tokens(d) for d in below)
    tpb = tokens_per_byte(data, tokenizer, stage=stage)
    k, est = plan(data, base, tpb, target, stage)
    parts = _contiguous_parts(data, stage)
    have = parts[-1][1] if parts else 0
    bounds = {0} | {hi for _, hi, _ in parts}
    if k < have and k not in bounds:
        k = min(b for b in bounds if b >= k)  # nest on the parts already built
    print(f"{name}: buckets < {k} of each {stage.exports} corpus, ~{est / 1e6:,.0f}M tokens estimated", flush=True)
    step = part_buckets or max(k - have, 1)
    for lo in range(have, k, step):
        build_part(data, lo, min(lo + step, k), shard_tokens, workers, stage)
    parts = _parts(data, stage)
    use = below + [d for _, hi, d in parts if hi <= k]
    first = [] if on is not None else [data / "idx-050m"]  # a one-piece base holds idx-050m's text
    manifest = compose(data / name, [*first, *use])
    runs = [_part_run(d) for d in [*first, *use]]
    wall = sum(r["wall_s"] for r in runs)
    peak = max(r["peak_rss_tree_mb"] for r in runs)
    counts = manifest["counts"]
    disk = sum(f["size"] for s in manifest["shards"] for f in s["files"])
    names = [d.name if d.parent.name in (STAGES[0].parts, data.name) else f"{d.parent.name}/{d.name}" for d in use]
    sel = {"buckets": k, "of_buckets": 100, "corpora": list(stage.names), "estimated_tokens": est, "counts": counts}
    sel |= {"parts": [*(d.name for d in first), *names], "build_wall_s_sum_of_parts": wall, "peak_rss_mb_max_of_parts": peak}
    sel |= {"shard_bytes": disk} | ({"on": "all of the extra corpus (idx-2b's parts)", "stage": stage.exports} if pool else {})
    (data / name / "selection.json").write_text(json.dumps(sel, indent=1))
    what = f"extra-corpus buckets < {nb}/{nb} + {stage.exports} buckets < {k}/100" if pool else f"extra-corpus buckets < {k}/100"
    note_ready(
        data,
        f"{name}: {counts['tokens']:,} tokens, {counts['docs']:,} docs, {counts['shards']} shards, {disk / 1e9:.2f} GB; "
        f"idx-050m + {what} (parts {', '.join(sel['parts'])}); "
        f"build {wall / 60:.1f} min in all, peak RSS {peak / 1024:.1f} GiB",
    )
    return sel


def overlap(index: Path, data: Path, n: int = 13, stride: int = 4) -> dict:
    """Per held-out set and half: the share of each document's n-grams (every stride-th) found in
    the index, and how many documents reach 80% (infini-gram's decontamination criterion). A set
    from a source no index holds has almost none."""
    import numpy as np
    from teragram.index.engine import Index

    idx = Index(index)
    out = {}
    for set_dir in sorted((data / "heldout").iterdir()):
        for half in ("valid", "test"):
            f = set_dir / f"{half}.jsonl.zst"
            if not f.exists():
                continue
            shares = []
            for r in read_jsonl(f):
                ids = np.asarray(idx.tokenize(r["text"]), dtype=np.int64)
                starts = range(0, max(len(ids) - n + 1, 0), stride)
                if starts:
                    shares.append(sum(idx.count(ids[i : i + n]).count > 0 for i in starts) / len(starts))
            a = np.asarray(shares)
            out[f"{set_dir.name}/{half}"] = {"docs": len(a), "mean_share": float(a.mean()), "docs_ge_80pct": int((a >= 0.8).sum())}
    return out


def smoke() -> int:
    """`index` (a nested index: the tokens per byte, the plan, one part built, composed; then the
    whole extra corpus, and the package pool's stage nested on it, a part per bucket) and
    `overlap` on a tiny DATA: the embedded corpus's files, with an extra corpus and a package
    pool of two buckets per corpus cut from its documents. export and heldout read Debian
    packages: not run."""
    with smoke_context(True) as tmp:
        data = smoke_data(tmp)
        text = "".join(r["text"] for r in read_jsonl(data / "ppl" / "train-everyday.jsonl.zst"))
        size = len(text) // (2 * (len(EXTRA) + len(STAGES[1].names)))
        for i, (stage, name) in enumerate((st, n) for st in STAGES for n in st.names):
            docs = [[{"text": text[(2 * i + b) * size : (2 * i + b + 1) * size], "path": f"{name}/doc{b}", "corpus": name}] for b in (0, 1)]
            sizes = [write_jsonl(data / stage.exports / name / f"b{b:02d}.jsonl.zst", d) for b, d in enumerate(docs)]
            manifest = {"corpus": name, "buckets": 2, "docs": [s["docs"] for s in sizes], "bytes": [s["bytes"] for s in sizes]}
            (data / stage.exports / name / "manifest.json").write_text(json.dumps(manifest))
        base = json.loads((data / "idx-050m" / "manifest.json").read_text())["counts"]["tokens"]
        opts = ["--data", str(data), "--shard-tokens", "65536", "--workers", "1"]
        main(["index", *opts, "--name", "idx-smoke", "--tokens", str(base + 1)])
        main(["index", *opts, "--name", "idx-smoke-all", "--all"])
        main(["index", *opts, "--name", "idx-smoke-pool", "--all", "--pool", "--part-buckets", "1"])
        one = [*map(Path, _inputs(data / "idx-050m")), *sorted((data / "extra").glob("*/b*.jsonl.zst"))]
        _run_build(data, one, data / "idx-smoke-one", 65536, 1)  # the extra corpus in one piece
        main(["index", *opts, "--name", "idx-smoke-pool-on", "--all", "--pool", "--on", str(data / "idx-smoke-one")])
        want, got = (
            json.loads((data / n / "manifest.json").read_text())["counts"]["tokens"] for n in ("idx-smoke-pool", "idx-smoke-pool-on")
        )
        assert want == got, (want, got)  # the same text (documents cut at other shard ends)
        main(["overlap", "--data", str(data), "--index", str(data / "idx-smoke")])
        print((data / "READY.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    if ap.parse_known_args(argv)[0].smoke:
        return smoke()
    sub = ap.add_subparsers(dest="cmd", required=True)
    for c in ("export", "heldout", "index", "overlap"):
        p = sub.add_parser(c)
        p.add_argument("--data", required=True)
        if c == "heldout":
            p.add_argument("--sets", nargs="+", choices=HELDOUT_SETS, default=list(HELDOUT_SETS))
        if c == "overlap":
            p.add_argument("--index", required=True)
        if c in ("export", "index"):
            p.add_argument("--pool", action="store_true", help="the package pool (tools.package_pool), under DATA/extra2")
        if c == "index":
            p.add_argument("--name", required=True)
            p.add_argument("--part-buckets", type=int, default=0, help="buckets per part built (0: one part)")
            p.add_argument(
                "--on", type=Path, help="with --pool: an index built in one piece from idx-050m's text and the whole extra corpus"
            )
            g = p.add_mutually_exclusive_group(required=True)
            g.add_argument("--tokens", type=float, help="target token count (estimated from tokens per byte)")
            g.add_argument("--all", action="store_true", help="every bucket of the extra corpus")
            p.add_argument("--shard-tokens", type=int, default=1 << 28)
            p.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    data = Path(args.data)
    (data / "logs").mkdir(parents=True, exist_ok=True)
    if args.cmd == "export":
        export_pool(data) if args.pool else export_all(data)
    elif args.cmd == "heldout":
        print(json.dumps(heldout(data, tuple(args.sets), pool=data / POOL_DIR / "pool.json"), indent=1))
    elif args.cmd == "overlap":
        res = overlap(Path(args.index), data)
        print(json.dumps(res, indent=1))
        for k, v in res.items():
            note_ready(
                data,
                f"13-gram overlap of heldout/{k} with {Path(args.index).name}: mean {v['mean_share']:.1%} of a document's 13-grams, {v['docs_ge_80pct']} of {v['docs']} docs >= 80%",
            )
    else:
        build(
            data,
            args.name,
            None if args.all else args.tokens,
            args.shard_tokens,
            args.workers,
            pool=args.pool,
            part_buckets=args.part_buckets,
            on=args.on,
        )
    return 0


if __name__ == "__main__":
    sys.stdout = io.TextIOWrapper(sys.stdout.buffer, line_buffering=True)
    sys.exit(main())
