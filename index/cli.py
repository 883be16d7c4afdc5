"""The index's verbs: `teragram verify | stats | tokenize | query`.

Each module's `register(sub)` adds its verbs to the `teragram` parser (serve/main.py), each verb
with its handler (`run`); handlers import library code only when they run.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

from .errors import QueryError, TeragramError


def print_json(obj) -> None:
    print(json.dumps(obj, sort_keys=False))


def cmd_verify(args) -> int:
    from .verify import verify

    problems = verify(args.index, samples=args.samples)
    for p in problems:
        print(f"{args.index}: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"{args.index}: ok")
    return 0


def cmd_warm(args) -> int:
    from tqdm import tqdm

    from .pagecache import index_files, warm

    total = sum(f.stat().st_size for f in index_files(args.index))
    with tqdm(total=total, unit="B", unit_scale=True, desc="warm", disable=args.quiet) as bar:
        rep = warm(args.index, progress=bar.update)
    print(
        f"{args.index}: {rep['bytes'] / 2**30:.2f} GiB in {rep['files']} files read in {rep['seconds']:.1f} s; page cache in large folios {rep['huge_bytes'] / 2**30:+.2f} GiB"
    )
    return 0


def cmd_stats(args) -> int:
    from . import format as fmt

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
        print_json(stats)
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
    from .engine import Index

    ids = Index(args.index).tokenize(args.text)
    if args.json:
        print_json({"ids": ids})
    else:
        print(" ".join(map(str, ids)))
    return 0


def _parse_ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise QueryError(f"--ids must be comma-separated integers, got {s!r}") from None


def _checked(op: str, cont) -> str:
    op = op.replace("_", "-")
    if op in ("prob", "infgram-prob") and cont is None:
        raise QueryError(f'{op} needs a continuation token (--cont / "cont")')
    return op


def _answer(idx, op: str, ids, cont) -> dict:
    """The answer to one query, with each token id's text beside it (results.with_tokens)."""
    from .engine import OPS
    from .results import with_tokens

    op = _checked(op, cont)
    run = {
        "count": lambda: idx.count(ids),
        "prob": lambda: idx.prob(ids, cont),
        "ntd": lambda: idx.ntd(ids),
        "infgram-prob": lambda: idx.infgram_prob(ids, cont),
        "infgram-ntd": lambda: idx.infgram_ntd(ids),
        "longest-match": lambda: idx.longest_match(ids),
        "docs": lambda: idx.docs(ids),
    }
    if op not in run:
        raise QueryError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    return with_tokens(idx, run[op]().to_json(), ids, cont if op in ("prob", "infgram-prob") else None)


BATCH_CHUNK = 1000  # batch lines sent to a cluster's holders at once


def _parse(idx, n: int, line: str):
    """(op, ids, cont) of one batch line, or its answer when it is not a query: {"error": ...}."""
    try:
        q = json.loads(line)
        if not isinstance(q, dict) or "op" not in q:
            raise QueryError('each line must be a JSON object with "op" and "ids"')
        ids = q.get("ids")
        if ids is None:
            ids = idx.tokenize(q["text"]) if isinstance(q.get("text"), str) else []
        return str(q["op"]), ids, q.get("cont")
    except json.JSONDecodeError as e:
        return {"error": f"line {n}: malformed JSON ({e.msg})"}
    except TeragramError as e:
        return {"error": f"line {n}: {e}"}


def _answer_lines(idx, lines: list[tuple[int, str]]) -> list[dict]:
    """The answers to numbered batch lines, in order: a local index answers them one by one, a
    cluster's holders (index/cluster.py) the well-formed ones in one batch."""
    from .cluster import ClusterIndex, Query
    from .results import with_tokens

    out: list = [_parse(idx, n, line) for n, line in lines]
    if not isinstance(idx, ClusterIndex):
        for i, (n, _) in enumerate(lines):
            if isinstance(out[i], tuple):
                try:
                    out[i] = _answer(idx, *out[i])
                except TeragramError as e:
                    out[i] = {"error": f"line {n}: {e}"}
        return out
    sent = []
    for i, (n, _) in enumerate(lines):
        if isinstance(out[i], tuple):
            op, ids, cont = out[i]
            try:
                q = Query(_checked(op, cont), ids, cont)
                idx.check(q)
                sent.append((i, q))
            except TeragramError as e:
                out[i] = {"error": f"line {n}: {e}"}
    for (i, q), r in zip(sent, idx.batch([q for _, q in sent])):
        out[i] = with_tokens(idx, r.to_json(), q.ids, q.cont if q.op in ("prob", "infgram-prob") else None)
    return out


@contextmanager
def opened_index(args):
    """The index of a verb's --index (query's IDX): local, or held by a Ray cluster's actors
    (--cluster, --replicas: add_cluster_args), whose holders end with the block."""
    if not getattr(args, "cluster", None):
        from .engine import Index

        yield Index(args.index)
        return
    from .cluster import ClusterIndex

    with ClusterIndex.open(args.index, address=args.cluster, replicas=args.replicas) as idx:
        yield idx


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """--cluster and --replicas: the index's shards held by a Ray cluster's actors (opened_index)."""
    p.add_argument(
        "--cluster",
        metavar="ADDRESS",
        help="the index's shards held by actors on this Ray cluster (host:port, ray://..., auto), each holder opening"
        " the same index path on its node",
    )
    p.add_argument("--replicas", type=int, default=1, help="with --cluster: holders of each group of shards, each on another node")


def cmd_query(args) -> int:
    with opened_index(args) as idx:
        return _query(idx, args)


def _cnf_query(idx, args) -> dict:
    """The answer to an AND/OR query (--cnf TEXT or --cnf-ids JSON): count (the default) or docs."""
    from . import cnf

    op = (args.op or "count").replace("_", "-")
    if op not in ("count", "docs"):
        raise QueryError(f"AND/OR queries (--cnf, --cnf-ids) are for count and docs only, not {op}")
    if args.cnf is not None:
        ids = cnf.tokenize_cnf(idx, args.cnf)
    else:
        try:
            ids = json.loads(args.cnf_ids)
        except json.JSONDecodeError as e:
            raise QueryError(f"--cnf-ids must be JSON, a list of clauses of terms of token ids ({e.msg})") from None
    kw = dict(max_clause_freq=args.max_clause_freq, max_diff_tokens=args.max_diff_tokens)
    r = idx.count_cnf(ids, **kw) if op == "count" else idx.search_docs_cnf(ids, maxnum=10, **kw)
    return cnf.cnf_json(idx, r.to_json(), ids)


def _query(idx, args) -> int:
    from .cluster import ClusterIndex

    if args.cnf is not None or args.cnf_ids is not None:
        ans = _cnf_query(idx, args)
        if args.json:
            print_json(ans)
        else:
            _print_text(ans)
        return 0
    if args.batch:
        try:
            lines = open(args.batch) if args.batch != "-" else sys.stdin
        except OSError as e:
            raise QueryError(f"cannot read {args.batch}: {e.strerror}") from None
        chunk: list[tuple[int, str]] = []
        for n, line in enumerate(lines, 1):
            if line.strip():
                chunk.append((n, line))
            if len(chunk) == (BATCH_CHUNK if isinstance(idx, ClusterIndex) else 1):
                for ans in _answer_lines(idx, chunk):
                    print(json.dumps(ans), flush=False)
                chunk = []
        for ans in _answer_lines(idx, chunk):
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
        print_json(ans)
    else:
        _print_text(ans)
    return 0


def _print_text(ans: dict) -> None:
    """One line per field; ids beside their text; one line per next token."""
    for k, v in ans.items():
        if k == "tokens":
            continue
        if k == "token_ids":
            print("tokens: " + " ".join(f"{i}:{t!r}" for i, t in zip(v, ans["tokens"])))
        elif k == "result_by_token_id":
            print(f"{k}:")
            for t, e in v.items():
                print(f"  {t:>7} {e['token']!r:<16} cont_cnt {e['cont_cnt']}  prob {e['prob']:.6g}")
        else:
            print(f"{k}: {v}")


def register(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("verify", help="check every file's header, size and checksum, and suffix-array order")
    v.add_argument("index")
    v.add_argument("--samples", type=int, default=2000, help="adjacent suffix-array ranks checked per shard")
    v.set_defaults(run=cmd_verify)

    w = sub.add_parser("warm", help="read an index into the page cache, in 2 MiB pages where the kernel can (faster searches)")
    w.add_argument("index")
    w.add_argument("--quiet", action="store_true")
    w.set_defaults(run=cmd_warm)

    s = sub.add_parser("stats", help="counts and sizes of an index")
    s.add_argument("index")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=cmd_stats)

    t = sub.add_parser("tokenize", help="token ids of a text with the index's tokenizer")
    t.add_argument("index")
    t.add_argument("text")
    t.add_argument("--json", action="store_true")
    t.set_defaults(run=cmd_tokenize)

    q = sub.add_parser("query", help="count, prob, ntd, infgram-prob, infgram-ntd, longest-match, docs")
    q.add_argument("index")
    q.add_argument("op", nargs="?", help="count | prob | ntd | infgram-prob | infgram-ntd | longest-match | docs")
    q.add_argument("text", nargs="?", help="query text (tokenized with the index's tokenizer)")
    q.add_argument("--ids", help="query token ids, comma-separated, instead of text")
    q.add_argument("--cont", type=int, help="continuation token id for prob / infgram-prob")
    q.add_argument("--json", action="store_true", help="infini-gram's field names, as JSON")
    q.add_argument("--batch", help="JSONL file of queries {op, ids, cont}; one JSON answer per line")
    q.add_argument(
        "--cnf", metavar="TEXT", help='AND/OR query for count or docs, infini-gram\'s syntax: "a b OR c AND d" (OR binds tighter)'
    )
    q.add_argument("--cnf-ids", metavar="JSON", help="AND/OR query as token ids: a list of clauses, each a list of terms (lists of ids)")
    q.add_argument("--max-clause-freq", type=int, default=50_000, help="with --cnf: a clause's occurrences read before they are sampled")
    q.add_argument("--max-diff-tokens", type=int, default=100, help="with --cnf: how far apart the clauses' matches may start")
    add_cluster_args(q)
    q.set_defaults(run=cmd_query)
