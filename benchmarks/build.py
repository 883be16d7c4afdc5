"""Build benchmark: teragram's build-index against infini-gram's indexer on the same token ids.

    python -m benchmarks.build [--mb 170] [--workers 2]

1. Exports the first --mb MB of the train split (by path hash) of Debian's linux-source-6.1
   (about 50M tokens with a 32000-piece tokenizer) as JSON lines (zstd), cached.
2. Runs `build-index` on it end to end (tokenizer training, tokenization, suffix arrays):
   wall time per phase, peak RSS, bytes per token on disk.
3. Indexes the very same token ids again with teragram alone (index time only: one shard;
   and two shards built in parallel) and with infini-gram's indexer (`infini_gram.indexing`
   on tokenized.0/offset.0 written in its own layout), each in a measured subprocess.
Prints a table and writes benchmarks/results/build.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import SMOKE_HELP, default_workdir, linux_corpus, run_measured, save, smoke_context, smoke_jsonl, table


def doc_ids(idx_dir: Path) -> list[np.ndarray]:
    from teragram.index.engine import Index

    idx = Index(idx_dir)
    out = []
    for s in idx.shards:
        tok, st = np.asarray(s.tok), np.asarray(s.starts).astype(np.int64)
        out += [tok[st[k] : st[k + 1] - 1] for k in range(len(st) - 1)]
    return out


def write_infinigram(docs: list[np.ndarray], save_dir: Path) -> None:
    save_dir.mkdir(parents=True, exist_ok=True)
    offsets, pos = [], 0
    with open(save_dir / "tokenized.0", "wb") as f:
        for d in docs:
            offsets.append(pos)
            b = b"\xff\xff" + np.asarray(d, dtype="<u2").tobytes()
            f.write(b)
            pos += len(b)
    np.asarray(offsets, dtype="<u8").tofile(save_dir / "offset.0")


_FROM_IDS = """
import sys, numpy as np
from benchmarks.build import doc_ids
from teragram.builder.build import build_from_ids
docs = doc_ids({src!r})
import time; t = time.time()
build_from_ids(docs, {out!r}, {src!r} + "/tokenizer.model", shard_tokens={shard}, workers={workers})
print("INDEX_S", time.time() - t)
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=127, help="MB of linux-source-6.1 text, train split (about 50M tokens at 127)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--workdir", default=str(default_workdir()))
    ap.add_argument("--corpus", help="use this corpus file instead of exporting linux-source")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    return ap.parse_args(argv)


def build_end_to_end(corpus: Path, w: Path, repo: str, workers: int, vocab_size: int) -> tuple[dict, dict, dict]:
    """1. build-index on the corpus, end to end, into WORKDIR/tg (the index later benchmarks use):
    (its table row, its results, its manifest)."""
    tg = w / "tg"
    run_measured(["rm", "-rf", str(tg), str(w / "tg1"), str(w / "tg2"), str(w / "ig")])
    m = run_measured(
        [
            sys.executable,
            "-m",
            "teragram.builder.cli",
            str(corpus),
            "--out",
            str(tg),
            "--workers",
            str(workers),
            "--vocab-size",
            str(vocab_size),
            "--quiet",
        ],
        cwd=repo,
    )
    rep = json.loads((tg / "build-report.json").read_text())
    man = json.loads((tg / "manifest.json").read_text())
    n = man["counts"]["tokens"]
    sizes: dict[str, int] = {}
    for s in man["shards"]:
        for f in s["files"]:
            sizes[Path(f["path"]).name] = sizes.get(Path(f["path"]).name, 0) + f["size"]
    lmdb = sum(p.stat().st_size for p in (tg / "meta.lmdb").glob("*"))
    data = {"corpus": {"file": str(corpus), "bytes": corpus.stat().st_size, "tokens": n, "docs": man["counts"]["docs"]}}
    data["teragram_build"] = m | {"timings": rep["timings"], "bytes": sizes | {"meta.lmdb": lmdb}}
    row = {
        "run": "teragram build-index (end to end)",
        "wall s": m["wall_s"],
        "index s": rep["timings"]["index_task_s"],
        "tokenize s": rep["timings"]["tokenize_index_s"],
        "peak RSS MiB": m["peak_rss_mb"],
        "B/token (tokens+SA)": (sizes["tokens.bin"] + sizes["sa.bin"]) / n,
        "B/token (other)": (sum(sizes.values()) - sizes["tokens.bin"] - sizes["sa.bin"] + lmdb) / n,
    }
    return row, data, man


def index_same_ids(w: Path, repo: str, man: dict, workers: int) -> tuple[list[dict], dict]:
    """2. teragram's index alone on the same ids (one shard; two shards in parallel): (rows, results)."""
    n = man["counts"]["tokens"]
    rows, data = [], {}
    for label, shard, nw, out in (
        ("1 shard", 1 << 30, 1, w / "tg1"),
        (f"2 shards, {workers} workers", n // 2 + 2 * man["counts"]["docs"], workers, w / "tg2"),
    ):
        code = _FROM_IDS.format(repo=repo, src=str(w / "tg"), out=str(out), shard=shard, workers=nw)
        mm = run_measured([sys.executable, "-c", code], cwd=repo, stdout=open(w / "from_ids.log", "w"))
        index_s = float(open(w / "from_ids.log").read().split("INDEX_S")[1])
        mo = json.loads((out / "manifest.json").read_text())
        b = sum(f["size"] for s in mo["shards"] for f in s["files"] if Path(f["path"]).name in ("tokens.bin", "sa.bin"))
        data[f"teragram_index_{label}"] = mm | {"index_s": index_s, "shards": mo["counts"]["shards"]}
        rows.append(
            {
                "run": f"teragram index, same ids ({label})",
                "index s": index_s,
                "peak RSS MiB": mm["peak_rss_mb"],
                "B/token (tokens+SA)": b / n,
            }
        )
    return rows, data


def index_infinigram(w: Path, n: int, workers: int) -> tuple[dict, dict]:
    """2. infini-gram's indexer on the same ids, in its own layout under WORKDIR/ig: (row, results)."""
    ig = w / "ig"
    write_infinigram(doc_ids(w / "tg"), ig)
    (w / "ig_data").mkdir(exist_ok=True)
    mi = run_measured(
        [
            sys.executable,
            "-m",
            "infini_gram.indexing",
            "--data_dir",
            str(w / "ig_data"),
            "--save_dir",
            str(ig),
            "--token_dtype",
            "u16",
            "--cpus",
            str(workers),
            "--mem",
            "4",
            "--ulimit",
            "20000",
        ],
        stdout=open(w / "ig.log", "w"),
        stderr=open(w / "ig.err", "w"),
    )
    ig_bytes = (ig / "tokenized.0").stat().st_size + (ig / "table.0").stat().st_size
    result = mi | {
        "bytes": {
            "tokenized.0": (ig / "tokenized.0").stat().st_size,
            "table.0": (ig / "table.0").stat().st_size,
            "offset.0": (ig / "offset.0").stat().st_size,
        }
    }
    row = {
        "run": f"infini-gram indexer, same ids (--cpus {workers})",
        "index s": mi["wall_s"],
        "peak RSS MiB": mi["peak_rss_mb"],
        "B/token (tokens+SA)": ig_bytes / n,
    }
    return row, result


def report(rows: list[dict], data: dict, man: dict) -> None:
    """The ratios against infini-gram's indexer, the table and the plot: benchmarks/results/build.*"""
    n = man["counts"]["tokens"]
    tg_bpt, ig_bpt = rows[0]["B/token (tokens+SA)"], rows[-1]["B/token (tokens+SA)"]
    ig_s = data["infinigram_index"]["wall_s"]
    best = min(data[k]["index_s"] for k in data if k.startswith("teragram_index_"))
    data["ratios"] = {
        "bytes_per_token": tg_bpt,
        "index_time_ratio_best": best / ig_s,
        "index_time_ratio_1shard": data["teragram_index_1 shard"]["index_s"] / ig_s,
    }
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 3.5))
    labels = [r["run"].replace(", same ids", "\n") for r in rows]
    ax[0].barh(labels, [r["index s"] for r in rows], color=["C0", "C0", "C0", "C1"])
    ax[0].set_xlabel("index build time (s), tokenization excluded")
    ax[1].barh(labels, [r["B/token (tokens+SA)"] for r in rows], color=["C0", "C0", "C0", "C1"])
    ax[1].axvline(6, color="k", ls="--", lw=1)
    ax[1].set_xlabel("bytes per token: tokens + suffix array")
    ax[1].set_yticks([])
    fig.suptitle(f"{n / 1e6:.1f}M tokens of linux-source-6.1")
    md = table(rows, ["run", "wall s", "tokenize s", "index s", "peak RSS MiB", "B/token (tokens+SA)", "B/token (other)"])
    md += (
        f"\n\n{n:,} tokens, {man['counts']['docs']:,} documents. Tokens+SA {tg_bpt:.3f} B/token (infini-gram {ig_bpt:.3f}); "
        f"index time {best:.1f}s = {data['ratios']['index_time_ratio_best']:.2f}x infini-gram's {ig_s:.1f}s (one shard: "
        f"{data['ratios']['index_time_ratio_1shard']:.2f}x)."
    )
    save("build", data, md, fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        with smoke_context(True) as tmp:
            return main(["--corpus", str(smoke_jsonl(tmp)), "--workdir", str(tmp / "w"), "--workers", "1", "--vocab-size", "512"])
    repo = str(Path(__file__).resolve().parents[1])
    w = Path(args.workdir)
    w.mkdir(parents=True, exist_ok=True)
    corpus = Path(args.corpus) if args.corpus else linux_corpus(w, args.mb, "train")
    row, data, man = build_end_to_end(corpus, w, repo, args.workers, args.vocab_size)
    same_rows, same_data = index_same_ids(w, repo, man, args.workers)
    ig_row, ig_data = index_infinigram(w, man["counts"]["tokens"], args.workers)
    report([row, *same_rows, ig_row], data | same_data | {"infinigram_index": ig_data}, man)
    return 0


if __name__ == "__main__":
    sys.exit(main())
