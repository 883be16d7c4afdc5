"""Build under a memory budget: wall time, peak RSS of the whole process tree, bytes per token.

    python -m benchmarks.build_memory [--mb 400] [--memory 2,8] [--shard-tokens 1073741824]
    python -m benchmarks.build_memory --corpus FILE... --tokenizer TOK.model --memory 8 \
        --out IDX --name build_memory_2b                          # a given corpus, index kept

Runs `build-index` on the first MB of linux-source-6.1 (train split), or on --corpus, once per
--memory value, with the same tokenizer (trained once, or --tokenizer), and samples the summed
RSS of the build and all its workers every 0.1 s (ru_maxrss alone reports the largest single
process, also recorded). Writes benchmarks/results/NAME.{md,json}.
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

from benchmarks.common import SMOKE_HELP, default_workdir, linux_corpus, save, smoke_context, smoke_jsonl, table


def run_sampled(cmd: list[str]) -> dict:
    """Run cmd; wall time, the peak of the summed RSS of its process tree, and ru_maxrss."""
    t = time.time()
    p = subprocess.Popen(cmd)
    peak = 0
    at_peak: list = []  # (process name and arguments, RSS MB) when the sum peaked
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        proc = psutil.Process(p.pid)
        while not done.is_set():
            try:
                procs = [proc, *proc.children(recursive=True)]
                rss = [(" ".join(q.cmdline())[:80], q.memory_info().rss / 2**20) for q in procs]
                total = sum(r for _, r in rss) * 2**20
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
        "ru_maxrss_mb": ru.ru_maxrss / 1024,
        "at_peak": at_peak,
    }


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
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args(argv)
    if args.smoke:
        with smoke_context(True) as tmp:
            c = str(smoke_jsonl(tmp))
            return main(["--corpus", c, "--workdir", str(tmp), "--memory", "1", "--workers", "1", "--vocab-size", "512"])
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
