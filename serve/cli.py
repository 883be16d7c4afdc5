"""`teragram SUBCOMMAND ...`: one command with a subcommand per user action.

Each subcommand is a thin layer over library code, imported only when it runs. Library errors
(TeragramError) are printed as one line, `teragram: error: ...`, with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from teragram.index.errors import QueryError, TeragramError


def _print_json(obj) -> None:
    print(json.dumps(obj, sort_keys=False))


# ---- index subcommands -----------------------------------------------------------------------


def cmd_verify(args) -> int:
    from teragram.index.verify import verify

    problems = verify(args.index, samples=args.samples)
    for p in problems:
        print(f"{args.index}: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"{args.index}: ok")
    return 0


def cmd_stats(args) -> int:
    from teragram.index import format as fmt

    m = fmt.read_json(Path(args.index) / "manifest.json")
    root = Path(args.index)
    by_kind: dict[str, int] = {}
    for s in m["shards"]:
        for f in s["files"]:
            name = Path(f["path"]).name
            by_kind[name] = by_kind.get(name, 0) + f["size"]
    lmdb = sum(p.stat().st_size for p in (root / "meta.lmdb").glob("*"))
    n = max(1, m["counts"]["tokens"])
    stats = {
        "index": str(root),
        "counts": m["counts"],
        "vocab_size": m["tokenizer"]["vocab_size"],
        "token_dtype": m["token_dtype"],
        "sa_width_bits": sorted({s["sa_width"] for s in m["shards"]}),
        "bytes": by_kind | {"meta.lmdb": lmdb},
        "bytes_per_token": {
            "tokens+sa": (by_kind.get("tokens.bin", 0) + by_kind.get("sa.bin", 0)) / n,
            "all": (sum(by_kind.values()) + lmdb) / n,
        },
        "skipped": m["skipped"]["counts"],
    }
    if args.json:
        _print_json(stats)
    else:
        c = m["counts"]
        print(f"index       {root}")
        print(f"documents   {c['docs']:,}   tokens {c['tokens']:,}   shards {c['shards']}")
        print(f"vocabulary  {stats['vocab_size']:,} ({stats['token_dtype']} tokens, {stats['sa_width_bits']}-bit suffix-array pointers)")
        for k, v in sorted(stats["bytes"].items()):
            print(f"  {k:<12} {v:>14,} bytes  {v / n:6.3f} B/token")
        print(f"tokens + suffix array: {stats['bytes_per_token']['tokens+sa']:.3f} bytes/token")
        if stats["skipped"]:
            print("skipped     " + ", ".join(f"{k}={v}" for k, v in stats["skipped"].items()))
    return 0


def cmd_tokenize(args) -> int:
    from teragram.index.engine import Index

    ids = Index(args.index).tokenize(args.text)
    if args.json:
        _print_json({"ids": ids})
    else:
        print(" ".join(map(str, ids)))
    return 0


def _parse_ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise QueryError(f"--ids must be comma-separated integers, got {s!r}") from None


def _answer(idx, op: str, ids, cont) -> dict:
    op = op.replace("_", "-")
    if op in ("prob", "infgram-prob") and cont is None:
        raise QueryError(f'{op} needs a continuation token (--cont / "cont")')
    if op == "count":
        return idx.count(ids).to_json()
    if op == "prob":
        return idx.prob(ids, cont).to_json()
    if op == "ntd":
        return idx.ntd(ids).to_json()
    if op == "infgram-prob":
        return idx.infgram_prob(ids, cont).to_json()
    if op == "infgram-ntd":
        return idx.infgram_ntd(ids).to_json()
    if op == "longest-match":
        return idx.longest_match(ids).to_json()
    if op == "docs":
        return idx.docs(ids).to_json()
    from teragram.index.engine import OPS

    raise QueryError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")


def cmd_query(args) -> int:
    from teragram.index.engine import Index

    idx = Index(args.index)
    if args.batch:
        try:
            lines = open(args.batch) if args.batch != "-" else sys.stdin
        except OSError as e:
            raise QueryError(f"cannot read {args.batch}: {e.strerror}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
                if not isinstance(q, dict) or "op" not in q:
                    raise QueryError('each line must be a JSON object with "op" and "ids"')
                ids = q.get("ids")
                if ids is None:
                    ids = idx.tokenize(q["text"]) if isinstance(q.get("text"), str) else []
                ans = _answer(idx, str(q["op"]), ids, q.get("cont"))
            except json.JSONDecodeError as e:
                ans = {"error": f"line {n}: malformed JSON ({e.msg})"}
            except TeragramError as e:
                ans = {"error": f"line {n}: {e}"}
            print(json.dumps(ans), flush=False)
        return 0
    if args.op is None:
        raise QueryError("give OP and TEXT (or --ids), or --batch FILE")
    if args.ids is not None:
        ids = _parse_ids(args.ids)
    elif args.text is not None:
        ids = idx.tokenize(args.text)
    else:
        raise QueryError("give TEXT or --ids")
    ans = _answer(idx, args.op, ids, args.cont)
    if args.json:
        _print_json(ans)
    else:
        for k, v in ans.items():
            print(f"{k}: {v}")
    return 0


def cmd_features(args) -> int:
    from teragram.builder.features import FeatureConfig, compute_features

    cfg = FeatureConfig(mode=args.mode, max_len=args.max_len, top_k=args.top_k)
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


def cmd_train(args, overrides: list[str]) -> int:
    from teragram.model.config import load
    from teragram.model.train import TrainConfig, train

    cfg = load(TrainConfig, args.config, overrides)
    r = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        loss = r.get("loss", float("nan"))
        msg = f"trained {cfg.out}: step {r['step']}" + (f", loss {loss:.4f}" if loss == loss else " (already complete)")
        if "eval" in r:
            msg += f", held-out perplexity {r['eval']['perplexity']:.3f} ({r['eval']['bits_per_byte']:.4f} bits/byte)"
        print(msg)
    return 0


def cmd_eval(args) -> int:
    import tempfile

    from teragram.builder.features import FeatureConfig, compute_features
    from teragram.index.engine import Index
    from teragram.model.train import evaluate, load_model

    model, meta = load_model(args.checkpoint, args.device)
    idx = Index(args.index)
    if model.cfg.vocab_size != idx.vocab_size:
        from teragram.index.errors import TokenizerMismatch

        raise TokenizerMismatch(f"checkpoint vocabulary {model.cfg.vocab_size} != index vocabulary {idx.vocab_size}")
    with tempfile.TemporaryDirectory() as tmp:
        feats = args.features_out or tmp
        cfg = FeatureConfig("held-out", model.cfg.max_match, max(model.cfg.top_k, 1))
        compute_features(args.index, feats, cfg, corpus=args.corpus, progress=not args.quiet)
        if args.gate or args.fit_gate:
            r = _gated(args, model, idx, feats)
        else:
            r = evaluate(model, feats, idx.eos_id, idx.sep, args.device)
    if args.json:
        _print_json(r)
    else:
        msg = f"{args.checkpoint}: perplexity {r['perplexity']:.3f}, {r['bits_per_byte']:.4f} bits/byte over {r['tokens']:,} tokens ({r['bytes']:,} bytes)"
        if "model" in r:
            msg += f" with the index gate {r['gate']}; the model alone: perplexity {r['model']['perplexity']:.3f}"
        print(msg)
    return 0


def _gated(args, model, idx, feats) -> dict:
    """The model alone and mixed with the index's and the document cache's estimates by a gate
    (loaded, or fit here)."""
    from teragram.builder.tokenizer import load as load_tok
    from teragram.model import interp
    from teragram.model.data import EvalData
    from teragram.model.evaluate import doc_bytes, summarize

    gate = interp.Gate.load(args.gate) if args.gate else None
    gate, nll_model, nll_gated = interp.gated_eval(model, args.index, feats, args.device, gate=gate, workers=args.workers)
    if args.fit_gate:
        gate.save(args.fit_gate)
    ev = EvalData(feats, model.cfg.block_size, idx.eos_id, idx.sep)
    nbytes = int(doc_bytes(ev, load_tok(Path(feats) / "tokenizer.model").decode).sum())
    return summarize(nll_gated, nbytes) | {"model": summarize(nll_model, nbytes), "gate": args.gate or args.fit_gate}


def cmd_sample(args) -> int:
    from teragram.index.engine import Index
    from teragram.model.interp import Gate
    from teragram.model.sample import generate
    from teragram.model.train import load_model

    model, _ = load_model(args.checkpoint, args.device)
    idx = Index(args.index)
    g = generate(
        model,
        idx,
        idx.tokenize(args.prompt),
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        gate=Gate.load(args.gate) if args.gate else None,
    )
    print(idx.decode(g.ids))
    if args.verbose:
        print(f"[{len(g.new_ids)} tokens, {g.long_matches()} with an index match of >= 16 tokens; stopped: {g.stopped}]", file=sys.stderr)
    return 0


def cmd_dense(args) -> int:
    from teragram.model.dense import build_store

    info = build_store(
        args.index, args.checkpoint, features_dir=args.features, n_positions=args.positions, device=args.device, out=args.out
    )
    print(
        f"dense store of {info['count']:,} keys ({info['dims']} dims, IVF{info['nlist']},PQ{info['m']}) -> {args.out or args.index + '/dense'}"
    )
    return 0


def cmd_serve(args) -> int:
    from .app import ServeConfig, serve

    serve(
        ServeConfig(
            index=args.index,
            checkpoint=args.checkpoint,
            gate=args.gate,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            device=args.device,
        )
    )
    return 0


# ---- parser ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="teragram", description="Exact-match retrieval-augmented language modelling.")
    sub = p.add_subparsers(dest="cmd", required=True)

    from teragram.builder.cli import add_arguments

    b = sub.add_parser("build", help="build an index (same as build-index)")
    add_arguments(b)

    v = sub.add_parser("verify", help="check every file's header, size and checksum, and suffix-array order")
    v.add_argument("index")
    v.add_argument("--samples", type=int, default=2000, help="adjacent suffix-array ranks checked per shard")

    s = sub.add_parser("stats", help="counts and sizes of an index")
    s.add_argument("index")
    s.add_argument("--json", action="store_true")

    t = sub.add_parser("tokenize", help="token ids of a text with the index's tokenizer")
    t.add_argument("index")
    t.add_argument("text")
    t.add_argument("--json", action="store_true")

    q = sub.add_parser("query", help="count, prob, ntd, infgram-prob, infgram-ntd, longest-match, docs")
    q.add_argument("index")
    q.add_argument("op", nargs="?", help="count | prob | ntd | infgram-prob | infgram-ntd | longest-match | docs")
    q.add_argument("text", nargs="?", help="query text (tokenized with the index's tokenizer)")
    q.add_argument("--ids", help="query token ids, comma-separated, instead of text")
    q.add_argument("--cont", type=int, help="continuation token id for prob / infgram-prob")
    q.add_argument("--json", action="store_true", help="infini-gram's field names, as JSON")
    q.add_argument("--batch", help="JSONL file of queries {op, ids, cont}; one JSON answer per line")

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
    f.add_argument("--quiet", action="store_true")

    tr = sub.add_parser("train", help="train a GPT (with or without index inputs); extra --key=value override the config")
    tr.add_argument("--config", help="TOML file with TrainConfig fields")

    ev = sub.add_parser("eval", help="held-out perplexity and bits per byte of a checkpoint")
    ev.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    ev.add_argument("--index", required=True)
    ev.add_argument("--corpus", nargs="+", required=True, help="held-out text")
    ev.add_argument("--features-out", help="keep the held-out features here")
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--gate", help="mix the model with the index's and the document cache's estimates by this gate (from --fit-gate)")
    ev.add_argument("--fit-gate", metavar="OUT", help="fit the index gate on this (validation) text and save it")
    ev.add_argument("--workers", type=int, default=1, help="processes for the index estimates")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--quiet", action="store_true")

    sa = sub.add_parser("sample", help="generate text with live index lookups")
    sa.add_argument("--checkpoint", required=True)
    sa.add_argument("--index", required=True)
    sa.add_argument("prompt")
    sa.add_argument("--max-tokens", type=int, default=100)
    sa.add_argument("--temperature", type=float, default=0.8)
    sa.add_argument("--top-k", type=int, default=0)
    sa.add_argument("--top-p", type=float, default=0.95)
    sa.add_argument("--seed", type=int, default=0)
    sa.add_argument("--device", default="cpu")
    sa.add_argument("--gate", help="mix in the index's and the document cache's estimates with this gate (eval --fit-gate)")
    sa.add_argument("--verbose", action="store_true")

    de = sub.add_parser("dense", help="kNN-LM datastore (FAISS IVF-PQ) of a model's hidden states at training positions")
    de.add_argument("index")
    de.add_argument("--checkpoint", required=True)
    de.add_argument("--features", help="training features (for a model with index inputs)")
    de.add_argument("--positions", type=int, default=1_000_000, help="training positions stored (a sample of whole windows)")
    de.add_argument("--out", help="default IDX/dense")
    de.add_argument("--device", default="cpu")

    se = sub.add_parser("serve", help="HTTP server: index queries, completions, scoring")
    se.add_argument("--index", required=True)
    se.add_argument("--checkpoint", help="model run or checkpoint (without: index queries only)")
    se.add_argument("--gate", help="index gate (teragram eval --fit-gate) mixed into completions and /v1/score")
    se.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    se.add_argument("--port", type=int, default=8080)
    se.add_argument("--api-key", help="require Authorization: Bearer KEY on every request")
    se.add_argument("--device", default="cpu")
    return p


COMMANDS = {
    "verify": cmd_verify,
    "stats": cmd_stats,
    "tokenize": cmd_tokenize,
    "query": cmd_query,
    "features": cmd_features,
    "eval": cmd_eval,
    "sample": cmd_sample,
    "serve": cmd_serve,
}


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra and args.cmd != "train":
        build_parser().parse_args(argv)  # reports the unknown arguments and exits
    try:
        if args.cmd == "train":
            return cmd_train(args, extra)
        if args.cmd == "build":
            from teragram.builder.cli import run

            return run(args)
        return COMMANDS[args.cmd](args)
    except TeragramError as e:
        print(f"teragram: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
