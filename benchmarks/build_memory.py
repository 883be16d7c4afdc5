"""Build under a memory budget: wall time, peak RSS of the whole process tree, bytes per token.

    python -m benchmarks.build_memory [--mb 400] [--memory 2,8] [--shard-tokens 1073741824]
    python -m benchmarks.build_memory --corpus FILE... --tokenizer TOK.model --memory 8 \
        --out IDX --name build_memory_2b                          # a given corpus, index kept

Runs `build-index` on the first MB of linux-source-6.1 (train split), or on --corpus, once per
--memory value, with the same tokenizer (trained once, or --tokenizer), and samples the summed
RSS of the build and all its workers every 0.1 s (ru_maxrss alone reports the largest single
process, also recorded). Writes benchmarks/results/NAME.{md,json}.

    python -m benchmarks.build_memory --contexts IDX [--baseline COMMIT] --name contexts_memory_2b

The stored contexts' table (index/contexts.py) of every shard of an existing index, built again
into a temporary folder by a process of its own (the shard's files dropped from the page cache
first), at this commit and at COMMIT's library in the same run: peak RSS and its anonymous part
(RSS less file-backed pages: the table's own buffers, not the mapped arrays it reads), seconds,
and whether both commits' tables are the same bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from teragram.index import format as fmt

from benchmarks.common import (
    SMOKE_HELP,
    default_workdir,
    library_at,
    library_env,
    linux_corpus,
    save,
    smoke_context,
    smoke_index,
    smoke_jsonl,
    table,
)


def run_sampled(cmd: list[str], **kw) -> dict:
    """Run cmd; wall time, the peak of the summed RSS of its process tree (and of its anonymous
    part: RSS less file-backed pages), and ru_maxrss."""
    t = time.time()
    p = subprocess.Popen(cmd, **kw)
    peak = peak_anon = 0
    at_peak: list = []  # (process name and arguments, RSS MB) when the sum peaked
    done = threading.Event()

    def sample() -> None:
        nonlocal peak, peak_anon
        proc = psutil.Process(p.pid)
        while not done.is_set():
            try:
                procs = [proc, *proc.children(recursive=True)]
                mem = [q.memory_info() for q in procs]
                rss = [(" ".join(q.cmdline())[:80], m.rss / 2**20) for q, m in zip(procs, mem)]
                total = sum(m.rss for m in mem)
                peak_anon = max(peak_anon, sum(m.rss - m.shared for m in mem))
                if total > peak:
                    peak, at_peak[:] = total, rss
            except psutil.Error:
                pass
            time.sleep(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, status, ru = os.wait4(p.pid, 0)
    done.set()
    th.join()
    if os.waitstatus_to_exitcode(status) != 0:
        raise subprocess.CalledProcessError(status, cmd)
    cpu = ru.ru_utime + ru.ru_stime
    return {
        "wall_s": time.time() - t,
        "cpu_s": cpu,
        "peak_tree_rss_mb": peak / 2**20,
        "peak_anon_mb": peak_anon / 2**20,
        "ru_maxrss_mb": ru.ru_maxrss / 1024,
        "at_peak": at_peak,
    }


TABLE = """
import json, sys
from pathlib import Path
from teragram.index import contexts, format as fmt
d, out = Path(sys.argv[1]), Path(sys.argv[2])
sa = fmt.open_packed(d / "sa.bin", "sa")
print(json.dumps(contexts.write(out, fmt.open_array(d / "tokens.bin", "tokens"), sa.words, sa.width, sa.count)))
"""


def contexts_rows(index: Path, work: Path, baseline: str | None) -> list[dict]:
    """Each shard's table built again, by this commit's library and the baseline's."""
    from benchmarks.index_scale import evict

    libs = {"this commit": None}
    if baseline:
        libs = {f"baseline {baseline}": library_at(baseline, work / "lib")} | libs
    rows = []
    for s in fmt.read_json(index / "manifest.json")["shards"]:
        d = fmt.shard_dir(index, s["shard"], s.get("dir"))
        digests = set()
        for code, lib in libs.items():
            out = work / "table"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            evict([d / "tokens.bin", d / "sa.bin"])
            r = run_sampled([sys.executable, "-c", TABLE, str(d), str(out)], env=library_env(lib))
            files = [out / n for n in ("contexts.nodes.bin", "contexts.hist.bin")]
            digests.add(tuple(fmt.file_digest(f) for f in files))
            rows.append(
                {
                    "code": code,
                    "shard": s["shard"],
                    "tokens": s["n_tokens"],
                    "table_mb": sum(f.stat().st_size for f in files) / 2**20,
                    "wall_s": r["wall_s"],
                    "peak_rss_mb": r["peak_tree_rss_mb"],
                    "peak_anon_mb": r["peak_anon_mb"],
                }
            )
            print(rows[-1], flush=True)
        for r in rows[-len(libs) :]:
            r["same_bytes"] = len(digests) == 1
    shutil.rmtree(work / "table", ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=400, help="MB of linux-source-6.1 text (train split)")
    ap.add_argument("--memory", default="2,8", help="comma-separated --memory values (GiB)")
    ap.add_argument("--shard-tokens", type=int, default=1 << 30)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--workdir", default=str(default_workdir()))
    ap.add_argument("--keep", action="store_true", help="keep the index of the last --memory value")
    ap.add_argument("--corpus", nargs="+", help="files to index instead of linux-source-6.1")
    ap.add_argument("--tokenizer", help="an existing tokenizer (with --corpus)")
    ap.add_argument("--out", help="where the index of the last --memory value goes (kept)")
    ap.add_argument("--name", default="build_memory")
    ap.add_argument("--vocab-size", type=int, default=32000, help="the tokenizer trained when --tokenizer is not given")
    ap.add_argument("--contexts", type=Path, help="an index whose shards' stored contexts are built again and measured")
    ap.add_argument("--baseline", help="with --contexts: the library at this commit too, in the same run")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args(argv)
    if args.smoke:
        with smoke_context(True) as tmp:
            c = str(smoke_jsonl(tmp))
            main(["--corpus", c, "--workdir", str(tmp), "--memory", "1", "--workers", "1", "--vocab-size", "512"])
            return main(["--contexts", str(smoke_index(tmp)), "--workdir", str(tmp), "--name", "contexts_memory"])
    if args.contexts:
        rows = contexts_rows(args.contexts, Path(args.workdir) / "contexts-memory", args.baseline)
        md = f"The stored contexts of each shard of {args.contexts}, built again by a process of its own (its files evicted first).\n\n"
        checks = {f"shard {r['shard']}: the same bytes from every library": r["same_bytes"] for r in rows}
        save(args.name, {"rows": rows, "index": str(args.contexts)}, md + table(rows, list(rows[0])), checks=checks)
        return 0
    w = Path(args.workdir)
    corpus = [Path(c) for c in args.corpus] if args.corpus else [linux_corpus(w, args.mb, "train")]
    tok = Path(args.tokenizer) if args.tokenizer else w / f"tok{args.vocab_size}.model"
    if not tok.exists():
        from teragram.index import readers
        from teragram.index import tokenizer as tok_mod

        texts = (d.text for d in readers.read_file(corpus[0]) if isinstance(d, readers.Doc))
        tok.write_bytes(tok_mod.train(texts, args.vocab_size, sample_bytes=32 << 20, threads=args.workers))
    rows = []
    budgets = [float(x) for x in args.memory.split(",")]
    for gb in budgets:
        last = gb == budgets[-1]
        out = Path(args.out) if args.out and last else w / f"build-memory-{gb:g}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "teragram.builder.cli", *map(str, corpus), "--out", str(out), "--tokenizer", str(tok)]
        cmd += ["--shard-tokens", str(args.shard_tokens), "--workers", str(args.workers), "--memory", str(gb)]
        r = run_sampled(cmd)
        m = fmt.read_json(out / "manifest.json")
        n = m["counts"]["tokens"]
        sizes = {
            name: sum((out / f["path"]).stat().st_size for s in m["shards"] for f in s["files"] if f["path"].endswith(name))
            for name in ("tokens.bin", "sa.bin")
        }
        rep = fmt.read_json(out / "build-report.json")
        rows.append(
            {
                "memory_gb": gb,
                "tokens": n,
                "shards": m["counts"]["shards"],
                "wall_s": r["wall_s"],
                "cpu_s": r["cpu_s"],
                "index_s": rep["timings"]["index_task_s"],
                "peak_tree_rss_mb": r["peak_tree_rss_mb"],
                "ru_maxrss_mb": r["ru_maxrss_mb"],
                "bytes_per_token": (sizes["tokens.bin"] + sizes["sa.bin"]) / n,
                "at_peak": r["at_peak"],
            }
        )
        print(rows[-1], flush=True)
        if not ((args.keep or args.out) and last):
            shutil.rmtree(out)
    cols = list(rows[0])
    what = (
        f"{len(corpus)} files ({sum(c.stat().st_size for c in corpus) / 1e9:.2f} GB)"
        if args.corpus
        else f"{args.mb:g} MB of linux-source-6.1 (train split)"
    )
    md = f"Build of {what}, --shard-tokens {args.shard_tokens}, --workers {args.workers}.\n\n"
    cols.remove("at_peak")
    save(args.name, {"rows": rows, "corpus": [str(c) for c in corpus]}, md + table(rows, cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
