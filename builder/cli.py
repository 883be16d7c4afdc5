"""The builder's verbs: `teragram build` (also the `build-index` command) and `teragram features`
(registered as index/cli.py's)."""

from __future__ import annotations

import argparse
import os
import sys

from teragram.index.cli import add_cluster_args, opened_index
from teragram.index.errors import TeragramError, os_error_line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("corpus", nargs="+", help="files or directories (recursive): txt, jsonl, parquet, optionally .gz/.zst")
    p.add_argument("--out", required=True, help="index directory to create (or resume)")
    p.add_argument(
        "--tokenizer",
        help="use this tokenizer instead of training one: a sentencepiece .model, a Hugging Face tokenizer.json, "
        "or a model directory holding tokenizer.json (its tokenizer_config.json names the EOS)",
    )
    p.add_argument("--vocab-size", type=int, default=32000, help="vocabulary of the trained tokenizer (default 32000)")
    p.add_argument("--shard-tokens", type=int, default=1 << 30, help="max token positions per shard (default 2^30)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes (default: all cores)")
    p.add_argument("--tokenizer-sample-mb", type=int, default=64, help="text sampled to train the tokenizer (MiB)")
    p.add_argument("--executor", choices=["local", "ray"], default="local")
    p.add_argument("--ray-address", help="Ray cluster address (default: start a local one)")
    p.add_argument("--shard-dirs", help="comma-separated directories (one per disk or mount) to spread the shards over")
    p.add_argument(
        "--memory", type=float, metavar="GiB", help="bound on the build's peak resident memory, workers included (default: 0.6 x available)"
    )
    p.add_argument("--sa-part-tokens", type=int, help="cap on the positions of one suffix-array part (default: what --memory allows)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from teragram.index.tokenizer import RoundTrip

    from .build import BuildConfig, build

    cfg = BuildConfig(
        inputs=tuple(args.corpus),
        out=args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        shard_tokens=args.shard_tokens,
        workers=max(1, args.workers),
        tokenizer_sample_bytes=args.tokenizer_sample_mb << 20,
        executor=args.executor,
        ray_address=args.ray_address,
        shard_dirs=tuple(x for x in (args.shard_dirs or "").split(",") if x),
        progress=not args.quiet,
        memory_gb=args.memory,
        sa_part_tokens=args.sa_part_tokens,
    )
    report = build(cfg)
    c = report["counts"]
    t = report["timings"]
    tk = report["tokenizer"]
    print(
        f"built {args.out}: {c['docs']} documents, {c['tokens']} tokens in {c['shards']} shard(s) "
        f"({report['token_dtype']} ids, {tk['kind']} tokenizer of {tk['vocab_size']:,}); "
        f"{t['total_s']:.1f}s, peak RSS {report['peak_rss_mb']:.0f} MiB"
    )
    warning = RoundTrip(**tk["round_trip"]).warning(args.tokenizer or "(trained)")
    if warning:
        print(f"build-index: warning: {warning}", file=sys.stderr)
    sk = report["skipped"]
    if sk["counts"]:
        print("skipped: " + ", ".join(f"{k}={v}" for k, v in sk["counts"].items()))
        for reason, ex in sk["examples"].items():
            print(f"  {reason}: {', '.join(ex)}")
    return 0


def cmd_features(args) -> int:
    from .features import FeatureConfig, compute_features

    cfg = FeatureConfig(mode=args.mode, max_len=args.max_len, top_k=args.top_k)
    if args.cluster:  # the holders compute them beside their shards
        from teragram.index.heldout import compute_held_out

        from .cluster_features import compute_cluster_features

        with opened_index(args) as idx:
            if args.corpus:
                r = compute_held_out(idx, args.out, cfg, args.corpus, progress=not args.quiet)
            else:
                r = compute_cluster_features(idx, args.out, cfg, progress=not args.quiet)
    else:
        r = compute_features(
            args.index,
            args.out,
            cfg,
            workers=args.workers,
            corpus=args.corpus,
            progress=not args.quiet,
            executor=args.executor,
            ray_address=args.ray_address,
        )
    n = r.get("positions") or sum(s["positions"] for s in r["shards"])
    print(f"features ({'held-out' if args.corpus else args.mode}) of {n:,} positions in {r['total_s']:.1f}s -> {args.out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("build", help="build an index (same as build-index)")
    add_arguments(b)
    b.set_defaults(run=run)

    f = sub.add_parser("features", help="per-token index features of the indexed corpus, or of --corpus text")
    f.add_argument("index")
    f.add_argument("--out", required=True, help="features directory (aligned with the index shards)")
    f.add_argument("--mode", choices=["causal", "exclude-doc"], default="exclude-doc", help="leakage rule for the indexed corpus")
    f.add_argument("--corpus", nargs="+", help="held-out text (files/directories): features against the whole index")
    f.add_argument("--max-len", type=int, default=64, help="match length cap (default 64)")
    f.add_argument("--top-k", type=int, default=4, help="next tokens kept per position (0: length and continuation only)")
    f.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    f.add_argument("--executor", choices=["local", "ray"], default="local")
    f.add_argument("--ray-address")
    f.add_argument("--quiet", action="store_true", help="no progress bars")
    add_cluster_args(f)
    f.set_defaults(run=cmd_features)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="build-index", description="Build a teragram suffix-array index from a corpus.")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except TeragramError as e:
        print(f"build-index: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, an unwritable file: completed shards stay, a rerun resumes
        print(f"build-index: error: {os_error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
