"""An index held by Ray actors on a local cluster of several nodes (index/cluster.py): exactness
against the local index, and the protocol's overhead per query.

    python -m benchmarks.cluster --index IDX [--nodes 4] [--queries 1000] [--replicas 1]

Starts a Ray cluster of --nodes nodes on this machine (ray.cluster_utils.Cluster, one CPU each),
opens IDX on it (one group of consecutive shards per node) and in this process (Index, one
thread), then:
  (a) exactness: --queries random queries of each kind (count, prob, ntd of 1-7-token n-grams
      sampled from the index, half of them with a token changed; infgram-prob, infgram-ntd and
      longest-match of 32-token contexts with up to 3 tokens changed at random; docs of 1-4
      tokens), sent in one batch per kind, each answer compared with the local Index's (the
      seconds of both: the first pass, on a page cache as the machine has it);
  (b) overhead: count and infgram-prob, warm (each query set run once first), the local time per
      query (one call per query, as a local user asks) against the cluster's per query in one
      batch (the bar: within 3x), and the cluster's latency of one query alone.
  (c) with --heldout FILE.jsonl.zst: bulk features of --bulk-tokens tokens of its documents
      (the gates' caps: the ∞-gram and contexts of 1, 2, 4, 8, 16 tokens; top 4), after a pass
      over half as many tokens of other documents of the file, through the holders
      (ClusterIndex.continuations) and locally (index/bulk.py, one thread): every field equal,
      and tokens per CPU-second (the cluster's: the client's and every holder's process CPU
      time; bar: >= 0.5x the local rate).
  (d) with --heldout: gated generation's lookups, token by token (the incremental scorer: the
      new position's features, top 4, and the gates' estimates after it), over --gen-tokens
      tokens of its documents read one at a time as a model would emit them: a local Scorer and
      the cluster's (index/cluster_scorer.py: a round of calls per token), every answer compared;
      median and p90 milliseconds per token.
Same machine, so (b) measures the protocol (Ray's calls, serialisation, merging), not a network.
Writes benchmarks/results/cluster.{json,md,png}.
"""

from __future__ import annotations

import argparse
import operator
import sys
import time
from pathlib import Path

import numpy as np
from teragram.index.engine import Index

from benchmarks.common import SMOKE_HELP, save, smoke_context, smoke_index, smoke_jsonl, table

KINDS = ("count", "prob", "ntd", "infgram-prob", "infgram-ntd", "longest-match", "docs")
OVERHEAD_BAR = 3.0
BULK_BAR = 0.5
BULK_CAPS = (0, 1, 2, 4, 8, 16)  # the gates' estimates (model.mixture.estimates.INDEX)


def heldout_docs(idx: Index, path: str, tokens: int) -> tuple[list, list]:
    """Documents of a held-out file, tokenized: about `tokens` tokens to warm up on, then as many to measure."""
    from benchmarks.common import read_jsonl

    warm, measured, n = [], [], 0
    for r in read_jsonl(Path(path)):
        d = np.asarray(idx.tokenize(r["text"]), np.int64)
        (warm if n < tokens // 2 else measured).append(d)
        n += len(d)
        if n >= tokens // 2 + tokens:
            break
    return warm, measured


def bulk(idx: Index, c, warm: list, docs: list) -> dict:
    """Bulk features of docs locally and through the cluster, after a pass over warm on each."""
    import ray
    from teragram.index.bulk import continuations
    from teragram.index.features import FIELDS

    def flat(ds):
        return np.concatenate(ds), np.cumsum([0] + [len(d) for d in ds])

    (wi, ws), (ids, starts) = flat(warm), flat(docs)
    continuations(idx, wi, ws, BULK_CAPS, top_k=4)
    c.continuations(wi, ws, BULK_CAPS, top_k=4)
    t = time.process_time()
    want = continuations(idx, ids, starts, BULK_CAPS, top_k=4)
    local_cpu = time.process_time() - t
    before, t, wall = ray.get([h.cpu_seconds.remote() for hs in c._holders for h in hs]), time.process_time(), time.perf_counter()
    got = c.continuations(ids, starts, BULK_CAPS, top_k=4)
    client_cpu, wall = time.process_time() - t, time.perf_counter() - wall
    holders_cpu = sum(ray.get([h.cpu_seconds.remote() for hs in c._holders for h in hs])) - sum(before)
    equal = all(np.array_equal(getattr(got[k], f), getattr(want[k], f)) for k in BULK_CAPS for f in (*FIELDS, "target_cnt"))
    n = len(ids)
    return {"tokens": n, "equal": equal, "local_cpu_s": local_cpu, "local_per_cpu_s": n / local_cpu, "cluster_wall_s": wall,
            "client_cpu_s": client_cpu, "holders_cpu_s": holders_cpu, "cluster_per_cpu_s": n / (client_cpu + holders_cpu),
            "ratio": local_cpu / (client_cpu + holders_cpu)}  # fmt: skip


def generation(idx: Index, c, docs: list, tokens: int) -> dict:
    """(d) the lookups of gated generation, local and through the cluster, per token: append
    (the new position's features) then estimates (the gates' contexts), each answer compared."""
    from teragram.index.features import FIELDS

    lengths = {f"k{k}": k for k in BULK_CAPS}
    times: dict[str, list[float]] = {"local": [], "cluster": []}
    equal, n = True, 0
    for d in docs:
        scorers = {"local": idx.scorer(top_k=4, max_len=max(BULK_CAPS)), "cluster": c.scorer(top_k=4, max_len=max(BULK_CAPS))}
        for t in d[: tokens - n].tolist():
            got = {}
            for name, sc in scorers.items():
                t0 = time.perf_counter()
                got[name] = (sc.append(t), sc.estimates(lengths))
                times[name].append(time.perf_counter() - t0)
            (fl, (Ll, el)), (fc, (Lc, ec)) = got["local"], got["cluster"]
            equal &= Ll == Lc and all(np.array_equal(getattr(fl, f), getattr(fc, f)) for f in FIELDS)
            equal &= all(el[k][0] == ec[k][0] and _dist(el[k]) == _dist(ec[k]) for k in lengths)
        for sc in scorers.values():
            sc.close()
        n += min(len(d), tokens - n)
        if n >= tokens:
            break
    row = {"tokens": n, "equal": bool(equal)}
    for name, ts in times.items():
        row[f"{name}_ms_p50"], row[f"{name}_ms_p90"] = (float(np.percentile(ts, q)) * 1e3 for q in (50, 90))
    return row


def _dist(e) -> dict[int, int]:
    """An estimate's next-token counts as {token: count}, whatever their order."""
    return dict(zip(np.asarray(e[1]).tolist(), np.asarray(e[2]).tolist()))


def _ngram(idx: Index, rng, m: int) -> np.ndarray:
    """m consecutive tokens of one document of the index, at a random place."""
    while True:
        s = idx.shards[int(rng.integers(len(idx.shards)))]
        p = int(rng.integers(0, len(s.tok) - m))
        q = np.asarray(s.tok[p : p + m], np.int64)
        if not (q == idx.sep).any():
            return q


def queries(idx: Index, rng, n: int) -> dict[str, list]:
    """n queries (Query) of each kind."""
    from teragram.index.cluster import Query

    def changed(q: np.ndarray, k: int) -> list[int]:
        q = q.copy()
        for j in rng.choice(len(q), size=k, replace=False):
            q[j] = rng.integers(3, idx.vocab_size)
        return [int(x) for x in q]

    out: dict[str, list] = {k: [] for k in KINDS}
    for i in range(n):
        short = changed(_ngram(idx, rng, int(rng.integers(1, 8))), i % 2)
        ctx = changed(_ngram(idx, rng, 33), int(rng.integers(0, 4)))
        cont = ctx.pop()
        out["count"].append(Query("count", short))
        out["prob"].append(Query("prob", short[:-1], short[-1]))
        out["ntd"].append(Query("ntd", short))
        out["infgram-prob"].append(Query("infgram-prob", ctx, cont))
        out["infgram-ntd"].append(Query("infgram-ntd", ctx))
        out["longest-match"].append(Query("longest-match", ctx))
        out["docs"].append(Query("docs", [int(x) for x in _ngram(idx, rng, int(rng.integers(1, 5)))], max=5))
    return out


def local(idx: Index, q):
    """The local Index's answer to a Query."""
    if q.op == "docs":
        return idx.docs(q.ids, max=q.max, context=q.context)
    fn = getattr(idx, q.op.replace("-", "_"))
    return fn(q.ids, q.cont) if q.op in ("prob", "infgram-prob") else fn(q.ids)


def _per_query_us(fn, items) -> float:
    fn(items)  # warm
    t = time.perf_counter()
    fn(items)
    return (time.perf_counter() - t) / len(items) * 1e6


def start_cluster(nodes: int):
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 1 << 28, "include_dashboard": False})
    for _ in range(nodes - 1):
        c.add_node(num_cpus=1, object_store_memory=1 << 28)
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    return c


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--queries", type=int, default=1000, help="queries of each kind")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--heldout", help="JSON-lines file of held-out documents: (c) bulk features")
    ap.add_argument("--bulk-tokens", type=int, default=20000, help="held-out tokens of (c)")
    ap.add_argument("--gen-tokens", type=int, default=2000, help="held-out tokens of (d), read one at a time")
    ap.add_argument("--name", default="cluster", help="results file name")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args(argv)
    if not args.smoke and not args.index:
        ap.error("--index is required")
    return args


def smoke() -> int:
    """The benchmark on the smoke index rebuilt in 6 shards, 20 queries of each kind and 3,000 held-out tokens."""
    with smoke_context(True) as tmp:
        from teragram.builder.build import build_from_ids

        src = Index(smoke_index(tmp))
        docs = [np.asarray(s.tok[a : b - 1]) for s in src.shards for a, b in zip(s.starts[:-1], s.starts[1:])]
        build_from_ids(docs, tmp / "idx", src.path / "tokenizer.model", shard_tokens=src.n_positions // 5 + 1)
        held = str(smoke_jsonl(tmp, heldout=True))
        return main(["--index", str(tmp / "idx"), "--queries", "20", "--heldout", held, "--bulk-tokens", "3000", "--gen-tokens", "200",
                     "--name", "cluster_smoke"])  # fmt: skip


def exactness(c, idx: Index, qs: dict[str, list]) -> list[dict]:
    """(a) every kind's queries through the cluster (one batch) and the local Index: how many answers are equal."""
    exact = []
    for kind, items in qs.items():
        t = time.perf_counter()
        got = c.batch(items)
        wall = time.perf_counter() - t
        t = time.perf_counter()
        want = [local(idx, q) for q in items]
        exact.append({"kind": kind, "queries": len(items), "equal": sum(map(operator.eq, got, want)), "cluster_s": wall,
                      "local_s": time.perf_counter() - t})  # fmt: skip
        print(exact[-1], flush=True)
    return exact


def overheads(c, idx: Index, qs: dict[str, list]) -> list[dict]:
    """(b) time per query, warm: the local Index (one call per query), the cluster (one batch) and one query alone."""
    overhead = []
    for kind in ("count", "infgram-prob"):
        items = qs[kind]
        loc = _per_query_us(lambda xs: [local(idx, q) for q in xs], items)
        bat = _per_query_us(c.batch, items)
        one = _per_query_us(lambda xs: [c.batch([q]) for q in xs], items[: max(1, len(items) // 10)])
        overhead.append({"kind": kind, "local_us": loc, "cluster_batch_us": bat, "ratio": bat / loc, "cluster_one_us": one})
        print(overhead[-1], flush=True)
    return overhead


def report(args, idx: Index, groups: list, exact: list[dict], overhead: list[dict], bulk_row: dict | None, gen_row: dict | None) -> bool:
    """The table and the plot (benchmarks/results/NAME.*); whether every answer was equal."""
    all_equal = all(r["equal"] == r["queries"] for r in exact) and all(r is None or r["equal"] for r in (bulk_row, gen_row))
    within = all(r["ratio"] <= OVERHEAD_BAR for r in overhead)
    md = (
        f"{idx.n_tokens:,} tokens in {len(idx.shards)} shards; a local Ray cluster of {args.nodes} nodes (1 CPU each), "
        f"groups of shards {groups}, {args.replicas} holder(s) per group; {args.queries} queries of each kind.\n\n"
        f"(a) exactness: every answer equal to the local Index's: **{'yes' if all_equal else 'NO'}**\n\n"
        + table(exact, ["kind", "queries", "equal", "cluster_s", "local_s"])
        + f"\n\n(b) overhead per query, warm: local Index (one call per query) against the cluster (one batch); bar <= {OVERHEAD_BAR:g}x: "
        f"**{'met' if within else 'missed'}**. cluster_one_us: one query alone through the cluster.\n\n"
        + table(overhead, ["kind", "local_us", "cluster_batch_us", "ratio", "cluster_one_us"])
    )
    if bulk_row:
        met = bulk_row["ratio"] >= BULK_BAR
        md += (
            f"\n\n(c) bulk features of {bulk_row['tokens']:,} held-out tokens ({args.heldout}; caps {BULK_CAPS}, top 4) after a warm-up pass: "
            f"every field equal: **{'yes' if bulk_row['equal'] else 'NO'}**; tokens per CPU-second, cluster (client + holders) "
            f"against local; bar >= {BULK_BAR:g}x: **{'met' if met else 'missed'}**\n\n"
            + table(
                [bulk_row],
                [
                    "tokens",
                    "local_cpu_s",
                    "local_per_cpu_s",
                    "cluster_wall_s",
                    "client_cpu_s",
                    "holders_cpu_s",
                    "cluster_per_cpu_s",
                    "ratio",
                ],
            )
        )
    if gen_row:
        md += (
            f"\n\n(d) gated generation's lookups, {gen_row['tokens']:,} held-out tokens read one at a time (the new position's "
            f"features, top 4, capped at {max(BULK_CAPS)}, and the gates' estimates after it): every answer equal: "
            f"**{'yes' if gen_row['equal'] else 'NO'}**; milliseconds per token, the local Scorer against the cluster's\n\n"
            + table([gen_row], ["tokens", "local_ms_p50", "local_ms_p90", "cluster_ms_p50", "cluster_ms_p90"])
        )
    save(
        args.name,
        {"index": str(Path(args.index)), "tokens": idx.n_tokens, "shards": len(idx.shards), "nodes": args.nodes, "replicas": args.replicas,
         "groups": groups, "exactness": exact, "all_equal": all_equal, "overhead": overhead, "overhead_bar": OVERHEAD_BAR,
         "bulk": bulk_row, "bulk_bar": BULK_BAR, "generation": gen_row},
        md,
        _plot(overhead),
        checks={"every cluster answer == the local Index's": all_equal},
    )  # fmt: skip
    return all_equal


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        return smoke()
    import ray
    from teragram.index.cluster import ClusterIndex

    idx = Index(args.index)
    qs = queries(idx, np.random.default_rng(0), args.queries)
    t0 = time.time()
    cluster = start_cluster(args.nodes)
    try:
        c = ClusterIndex.open(args.index, replicas=args.replicas)
        print(f"cluster of {args.nodes} nodes and {len(c.groups)} groups up in {time.time() - t0:.1f} s", flush=True)
        exact = exactness(c, idx, qs)
        overhead = overheads(c, idx, qs)
        bulk_row = gen_row = None
        if args.heldout:
            warm, docs = heldout_docs(idx, args.heldout, args.bulk_tokens)
            bulk_row = bulk(idx, c, warm, docs)
            print(bulk_row, flush=True)
            gen_row = generation(idx, c, docs, args.gen_tokens)
            print(gen_row, flush=True)
        groups = [[c.shard_ids[p] for p in g] for g in c.groups]
        c.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0 if report(args, idx, groups, exact, overhead, bulk_row, gen_row) else 1


def _plot(rows: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = np.arange(len(rows))
    for i, (key, label) in enumerate([("local_us", "local Index, per query"), ("cluster_batch_us", "cluster, batched, per query")]):
        ax.bar(x + (i - 0.5) * 0.38, [r[key] for r in rows], 0.38, label=label)
    ax.set_xticks(x, [r["kind"] for r in rows])
    ax.set_ylabel("microseconds per query")
    ax.set_title("Queries through a local Ray cluster against one process")
    ax.legend()
    return fig


if __name__ == "__main__":
    sys.exit(main())
