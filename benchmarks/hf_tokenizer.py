"""An index built with a Hugging Face tokenizer against the sentencepiece index of the same text.

    python -m benchmarks.hf_tokenizer [--corpus FILE_OR_DIR] [--bpe-vocab 50257] [--sp-vocab 32000]

1. Trains a byte-level BPE (GPT-2's scheme: `tokenizers`, ByteLevel pre-tokenizer and decoder,
   <|endoftext|>) of --bpe-vocab ids on the corpus, timed.
2. Builds two indexes of the corpus with `build-index`, each in a measured subprocess: one with
   that tokenizer.json (--tokenizer), one with a sentencepiece model of --sp-vocab pieces that
   build-index trains on the same text (--vocab-size). Build time (tokenizer training apart),
   peak RSS, text bytes per token, index bytes per token.
3. Query latency (median, p90; warm) of count, prob, ntd (1-10 tokens sampled from the index) and
   the ∞-gram's (32-token contexts) on both indexes, and on infini-gram's index of the BPE index's
   very ids (`infini_gram.indexing`), whose every answer must equal teragram's (checked before
   anything is saved; where infini-gram samples, approx, only the counts are compared).
Writes benchmarks/results/hf_tokenizer.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, SMOKE_HELP, default_workdir, run_measured, save, smoke_context, smoke_jsonl, table
from benchmarks.query import _lat, query_ops

OPS = ("count", "prob", "ntd", "infgram_prob", "infgram_ntd")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--corpus", default=str(REPO / "data" / "default" / "train"), help="files or a directory (default: the embedded corpus)"
    )
    ap.add_argument("--workdir", default=str(default_workdir() / "hf_tokenizer"))
    ap.add_argument("--bpe-vocab", type=int, default=50257, help="ids of the byte-level BPE (GPT-2's 50,257 by default)")
    ap.add_argument("--sp-vocab", type=int, default=32000, help="pieces of the sentencepiece model build-index trains")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    return ap.parse_args(argv)


def texts_of(corpus: str):
    from teragram.index import readers

    for f in readers.walk([corpus]):
        for item in readers.read_file(f):
            if isinstance(item, readers.Doc):
                yield item.text


def train_bpe(corpus: str, vocab: int, out: Path) -> float:
    """Train the byte-level BPE on the corpus into out (tokenizer.json); seconds taken."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = time.time()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts_of(corpus), trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return time.time() - t


def build(corpus: str, out: Path, workers: int, tokenizer_args: list[str]) -> dict:
    """build-index in a measured subprocess: wall, peak RSS, its report's timings, bytes."""
    run_measured(["rm", "-rf", str(out)])
    cmd = [sys.executable, "-m", "teragram.builder.cli", corpus, "--out", str(out), "--workers", str(workers), "--quiet", *tokenizer_args]
    m = run_measured(cmd, cwd=REPO)
    rep = json.loads((out / "build-report.json").read_text())
    man = json.loads((out / "manifest.json").read_text())
    files = [f for s in man["shards"] for f in s["files"]]
    tokens_sa = sum(f["size"] for f in files if Path(f["path"]).name in ("tokens.bin", "sa.bin"))
    other = sum(f["size"] for f in files) - tokens_sa + sum(p.stat().st_size for p in (out / "meta.lmdb").glob("*"))
    return m | {
        "report": rep,
        "tokens": man["counts"]["tokens"],
        "docs": man["counts"]["docs"],
        "bytes_tokens_sa": tokens_sa,
        "bytes_other": other,
    }


def infinigram(idx, save_dir: Path):
    """infini-gram's index of the index's very ids (its own layout, u16), and its engine."""
    from infini_gram.engine import InfiniGramEngine

    from benchmarks.build import doc_ids, write_infinigram

    write_infinigram(doc_ids(idx.path), save_dir)
    args = [
        "--data_dir",
        str(save_dir),
        "--save_dir",
        str(save_dir),
        "--token_dtype",
        "u16",
        "--cpus",
        "1",
        "--mem",
        "4",
        "--ulimit",
        "1024",
    ]
    m = run_measured([sys.executable, "-m", "infini_gram.indexing", *args], stdout=subprocess.DEVNULL)
    return InfiniGramEngine(index_dir=str(save_dir), eos_token_id=idx.eos_id, vocab_size=65535, version=4, token_dtype="u16"), m


def same_answers(ops: dict) -> dict:
    """Every query's answer from teragram and infini-gram: {op: (queries compared, sampled by
    infini-gram, different)}; ntd answers infini-gram sampled (approx) are compared by count only."""
    out = {}
    for name, (qs, ours, theirs) in ops.items():
        diff = sampled = 0
        for q in qs:
            a, b = ours(*q), theirs(*q)
            if name in ("ntd", "infgram_ntd"):
                if b["approx"]:
                    sampled += 1
                    same = a.prompt_cnt == b["prompt_cnt"]
                else:
                    same = a.prompt_cnt == b["prompt_cnt"] and a.to_json()["result_by_token_id"] == {
                        int(t): v for t, v in b["result_by_token_id"].items()
                    }
                if name == "infgram_ntd":
                    same = same and a.suffix_len == b["suffix_len"]
            else:
                same = a.to_json() == b
            diff += not same
        out[name] = {"queries": len(qs), "sampled_by_infini_gram": sampled, "different": diff}
    return out


def latency(ops: dict, engine: int) -> dict:
    """Median and p90 ms of each op on one engine (0: teragram, 1: infini-gram), after a warm-up."""
    out = {}
    for name, (qs, *fns) in ops.items():
        _lat(fns[engine], qs[:50])
        a = _lat(fns[engine], qs)
        out[name] = {"median": float(np.median(a)), "p90": float(np.percentile(a, 90))}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        with smoke_context(True) as tmp:
            return main(
                ["--corpus", str(smoke_jsonl(tmp)), "--workdir", str(tmp / "w"), "--bpe-vocab", "800", "--sp-vocab", "512"]
                + ["--queries", "20"]
            )
    from teragram.index.engine import Index

    w = Path(args.workdir)
    corpus_bytes = sum(len(t.encode()) for t in texts_of(args.corpus))
    bpe = w / "bpe" / "tokenizer.json"
    train_s = train_bpe(args.corpus, args.bpe_vocab, bpe)
    runs = {
        "hf": build(args.corpus, w / "hf", args.workers, ["--tokenizer", str(bpe)]),
        "sentencepiece": build(args.corpus, w / "sp", args.workers, ["--vocab-size", str(args.sp_vocab)]),
    }
    runs["hf"]["tokenizer_train_s"] = train_s
    runs["sentencepiece"]["tokenizer_train_s"] = runs["sentencepiece"]["report"]["timings"]["tokenizer_s"]
    hf, sp = Index(w / "hf"), Index(w / "sp")
    ig, ig_build = infinigram(hf, w / "ig")
    hf_ops = query_ops(hf, ig, args.queries)
    agree = same_answers(hf_ops)
    lat = {
        "hf": latency(hf_ops, 0),
        "infini-gram (hf ids)": latency(hf_ops, 1),
        "sentencepiece": latency(query_ops(sp, ig, args.queries), 0),
    }
    rows = []
    for name, r in runs.items():
        idx = hf if name == "hf" else sp
        t = r["report"]["timings"]
        rows.append(
            {
                "tokenizer": f"{'byte-level BPE' if name == 'hf' else 'sentencepiece BPE'} ({idx.vocab_size:,} ids)",
                "token dtype": idx.manifest["token_dtype"],
                "tokens": f"{r['tokens']:,}",
                "text B/token": corpus_bytes / r["tokens"],
                "tokenizer training s": r["tokenizer_train_s"],
                "build s (tokenize + index)": t["total_s"] - t["tokenizer_s"],
                "peak RSS MiB": r["peak_rss_mb"],
                "index B/token (tokens+SA)": r["bytes_tokens_sa"] / r["tokens"],
                "index B/token (all)": (r["bytes_tokens_sa"] + r["bytes_other"]) / r["tokens"],
            }
        )
    cols = list(rows[0])
    lat_rows = [{"engine (index)": k} | {f"{op} median ms": v[op]["median"] for op in OPS} for k, v in lat.items()]
    md = (
        table(rows, cols)
        + "\n\nQuery latency, warm, median of "
        + f"{args.queries:,} queries each:\n\n"
        + table(lat_rows, list(lat_rows[0]))
    )
    md += "\n\nteragram's answers on the BPE index equal infini-gram's on its ids: " + ", ".join(
        f"{op} {a['queries'] - a['different']}/{a['queries']}"
        + (f" ({a['sampled_by_infini_gram']} sampled by infini-gram: counts only)" if a["sampled_by_infini_gram"] else "")
        for op, a in agree.items()
    )
    data = {
        "corpus": {"path": args.corpus, "bytes": corpus_bytes},
        "builds": runs,
        "latency_ms": lat,
        "same_answers": agree,
        "infini_gram_index": ig_build,
    }
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    x = np.arange(len(OPS))
    for i, (k, v) in enumerate(lat.items()):
        ax.bar(x + (i - 1) * 0.27, [v[op]["median"] for op in OPS], 0.27, label=k)
    ax.set_xticks(x, OPS)
    ax.set_yscale("log")
    ax.set_ylabel("median latency (ms)")
    ax.legend()
    ax.set_title(f"{corpus_bytes / 1e6:.0f} MB of text: byte-level BPE vs sentencepiece index")
    checks = {f"{op}: teragram == infini-gram on the BPE ids ({a['different']} differ)": a["different"] == 0 for op, a in agree.items()}
    save("hf_tokenizer", data, md, fig, checks=checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
