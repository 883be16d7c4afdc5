"""Load test of `teragram serve`: 64 concurrent clients on loopback for a bounded time.

    python -m benchmarks.serve_load [--seconds 60] [--clients 64] [--run RUN --name NAME] [--baseline COMMIT] [--cold]

Serves the demo index and tiny index model (runs/default, made by `make demo`; built here if
missing; --run: another folder with idx/ and index-model/, e.g. links to a large index and a
model of its tokenizer) on CPU, then keeps 64 clients busy with a mix of infini-gram-style index
queries (70%), short completions (20%) and scoring requests (10%). Reports requests/s, failures
and p50/p99 latency per endpoint (and the server's own p99, from its /stats), and those of a
65th client in a process of its own (plain http.client, a count every 50 ms: "/ (count),
probe"), whose latency is the server's, not the load generator's (one process of 64 httpx
clients adds its own waits to the tails); --baseline: the same load first against the server of
the library at COMMIT (a `git archive` of it), in the same run. The index is read into the page
cache first, in 2 MiB pages where the kernel can (`teragram warm`, as before serving); --cold:
first the load with the index's files dropped from the page cache just before the server starts,
then warm. Then measures the index-lookup share of a decode step with the 125M model shape
against the ~50M-token linux-source index (if benchmarks/build.py made it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import default_workdir, library_env, save, smoke_context, smoke_index, smoke_model, table

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_demo(run: Path) -> None:
    py = sys.executable
    if not (run / "idx" / "manifest.json").exists():
        subprocess.run(
            [py, "-m", "teragram.builder.cli", "data/default/train", "--out", str(run / "idx"), "--vocab-size", "8000", "--quiet"],
            cwd=REPO,
            check=True,
        )
    if not (run / "feats" / "manifest.json").exists():
        subprocess.run(
            [py, "-m", "teragram.serve.main", "features", str(run / "idx"), "--out", str(run / "feats"), "--quiet"], cwd=REPO, check=True
        )
    if not (run / "index-model" / "latest.json").exists():
        subprocess.run(
            [
                py,
                "-m",
                "teragram.serve.main",
                "train",
                "--config",
                "model/configs/demo.toml",
                f"--index={run / 'idx'}",
                f"--features={run / 'feats'}",
                "--use_index=true",
                "--heldout=",
                f"--out={run / 'index-model'}",
                "--max_steps=100",
                "--progress=false",
            ],
            cwd=REPO,
            check=True,
        )


async def client(http, url, queries, texts, deadline, stats, rng):
    while time.time() < deadline:
        r = rng.random()
        if r < 0.7:
            path, body = "/", queries[rng.randrange(len(queries))]
        elif r < 0.9:
            path, body = (
                "/v1/completions",
                {"prompt": texts[rng.randrange(len(texts))], "max_tokens": 8, "temperature": 0.8, "seed": rng.randrange(1000)},
            )
        else:
            path, body = "/v1/score", {"text": texts[rng.randrange(len(texts))]}
        t = time.perf_counter()
        try:
            resp = await http.post(url + path, json=body)
            ok = resp.status_code == 200
        except Exception:  # noqa: BLE001  (a failed request is counted, whatever the failure)
            ok = False
        key = path if path != "/" else f"/ ({body['query_type']})"
        stats.setdefault(key, []).append(((time.perf_counter() - t) * 1e3, ok))


async def load(url, queries, texts, seconds, n_clients):
    import httpx

    stats: dict = {}
    deadline = time.time() + seconds
    limits = httpx.Limits(max_connections=n_clients, max_keepalive_connections=n_clients)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(client(http, url, queries, texts, deadline, stats, random.Random(i)) for i in range(n_clients)))
    return stats


def lookup_share(index_dir: Path, steps: int = 256) -> dict:
    """Per generated token: index lookup (incremental scorer) vs the 125M model's decode step."""
    import torch
    from teragram.index.engine import Index
    from teragram.model.generation.sample import _batch
    from teragram.model.gpt import GPT, GPTConfig

    idx = Index(index_dir)
    model = GPT(GPTConfig.preset("125m", vocab_size=idx.vocab_size)).eval()
    idx.score(np.asarray(idx.shards[0].tok[200_000:204_000]).astype(np.int64))  # warm: JIT, page cache
    tok = np.asarray(idx.shards[0].tok[1000 : 1000 + 64 + steps]).astype(int).tolist()
    sc = idx.scorer(top_k=4, max_len=64)
    feats = [sc.append(t) for t in tok[:64]]
    with torch.no_grad():
        h, kv = model.hidden(torch.tensor([tok[:64]]), _batch(feats, "cpu"))
        t_lookup = t_model = 0.0
        for i in range(64, 64 + steps):
            t = time.perf_counter()
            f = sc.append(tok[i])
            t_lookup += time.perf_counter() - t
            t = time.perf_counter()
            h, kv = model.hidden(torch.tensor([[tok[i]]]), _batch([f], "cpu"), kv, pos0=i)
            model.next_distribution(h[:, -1], _batch([f], "cpu"))
            t_model += time.perf_counter() - t
    return {
        "lookup_ms": t_lookup / steps * 1e3,
        "model_step_ms": t_model / steps * 1e3,
        "share": t_lookup / (t_lookup + t_model),
        "index_tokens": idx.n_tokens,
        "device": "cpu",
    }


def smoke() -> int:
    """The tiny index and model served, 4 clients for 2 s (no lookup share: no large index)."""
    with smoke_context(True) as tmp:
        run = tmp / "run"
        run.mkdir()
        for name, src in (("idx", smoke_index(tmp)), ("index-model", smoke_model(tmp))):
            (run / name).symlink_to(src.resolve())
        (run / "feats").mkdir()
        (run / "feats" / "manifest.json").touch()  # ensure_demo: the served model reads no training features
        sys.argv = [sys.argv[0], "--run", str(run), "--seconds", "2", "--clients", "4"]
        return main()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--run", default=str(REPO / "runs" / "default"))
    ap.add_argument("--name", default="serve_load", help="the result files' name")
    ap.add_argument("--share-only", action="store_true", help="only the decode-step lookup share (updates serve_load.json)")
    ap.add_argument("--baseline", help="also load the server of the library at this commit (first), e.g. the one before a change")
    ap.add_argument("--cold", action="store_true", help="first the same load with the index's files dropped from the page cache")
    return ap.parse_args()


def share_only() -> int:
    """The decode-step lookup share alone, written into the saved serve_load.json."""
    from benchmarks.common import results_dir

    data = json.loads((results_dir() / "serve_load.json").read_text())
    data["decode_lookup_share"] = share = lookup_share(default_workdir() / "tg")
    (results_dir() / "serve_load.json").write_text(json.dumps(data, indent=1))
    print(json.dumps(share))
    return 0


def request_mix(idx) -> tuple[list[dict], list[str]]:
    """The clients' requests, drawn from the index's first shard (seed 0): 2,000 infini-gram-style
    queries (every query type in turn, 1-7 tokens) and 200 texts of 12 tokens for completions and scoring."""
    rng = np.random.default_rng(0)
    tok = np.asarray(idx.shards[0].tok)
    queries = []
    for i in range(2000):
        m = int(rng.integers(1, 8))
        p = int(rng.integers(0, len(tok) - m))
        ids = [int(x) for x in tok[p : p + m] if x != idx.sep] or [5]
        qt = ["count", "prob", "ntd", "infgram_prob", "infgram_ntd", "search_docs"][i % 6]
        queries.append({"query_type": qt, "query_ids": ids + ([int(tok[p + m])] if qt.endswith("prob") and tok[p + m] != idx.sep else [])})
    texts = [idx.decode(tok[p : p + 12]) for p in rng.integers(0, len(tok) - 12, 200)]
    return queries, texts


PROBE = """
import http.client, json, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
body = json.dumps({"query_type": "count", "query": "static int"})
out, end = [], time.time() + seconds
while time.time() < end:
    t = time.perf_counter()
    conn.request("POST", "/", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    out.append([(time.perf_counter() - t) * 1e3, r.status == 200])
    time.sleep(0.05)
print(json.dumps(out))
"""
PROBE_ROW = "/ (count), probe"  # a 65th client in a process of its own, plain http.client: the latency a user sees


def serve_and_load(
    run: Path, queries: list[dict], texts: list[str], seconds: int, clients: int, library: Path | None = None
) -> tuple[dict, float, dict]:
    """`teragram serve` of RUN/idx and RUN/index-model on a free port (the library at `library`
    when given), kept busy by the clients: (latencies and success per endpoint, wall seconds,
    the server's /stats)."""
    port = _free_port()
    srv = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "teragram.serve.main",
            "serve",
            "--index",
            str(run / "idx"),
            "--checkpoint",
            str(run / "index-model"),
            "--port",
            str(port),
        ],
        cwd=REPO,
        env=library_env(library),
    )
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    probe = None
    try:
        probe = subprocess.Popen([sys.executable, "-c", PROBE, str(port), str(seconds)], stdout=subprocess.PIPE, text=True)
        t = time.time()
        stats = asyncio.run(load(url, queries, texts, seconds, clients))
        wall = time.time() - t
        stats[PROBE_ROW] = [(x, ok) for x, ok in json.loads(probe.communicate(timeout=300)[0])]
        server_stats = httpx.get(url + "/stats").json()
    finally:
        if probe is not None and probe.poll() is None:
            probe.kill()
        srv.terminate()
        srv.wait(10)
    return stats, wall, server_stats


def endpoint_rows(stats: dict, wall: float) -> tuple[list[dict], dict]:
    """One table row per endpoint (requests, failures, requests/s, p50 and p99 latency), and the
    totals of the load clients (the probe's requests are not counted in them)."""
    rows = []
    total = failed = 0
    for k in sorted(stats):
        lat = np.array([x for x, _ in stats[k]])
        fails = sum(not ok for _, ok in stats[k])
        if k != PROBE_ROW:
            total += len(lat)
            failed += fails
        rows.append(
            {
                "endpoint": k,
                "requests": len(lat),
                "failed": fails,
                "req/s": len(lat) / wall,
                "p50 ms": float(np.percentile(lat, 50)),
                "p99 ms": float(np.percentile(lat, 99)),
            }
        )
    return rows, {"requests": total, "failed": failed, "req_per_s": total / wall}


def report(args: argparse.Namespace, idx, rows: list[dict], data: dict) -> None:
    """The table and the plot: benchmarks/results/NAME.*"""
    run, wall, total, share = Path(args.run), data["seconds"], data["total"], data.get("decode_lookup_share")
    cols = ["endpoint", "requests", "failed", "req/s", "p50 ms", "p99 ms"]
    md = table(rows, cols + ["server p99 ms"])
    n_tok = idx.manifest["counts"]["tokens"]
    md += (
        f"\n\n{args.clients} concurrent clients for {wall:.0f} s on loopback against {run / 'idx'} ({n_tok / 1e6:,.0f}M tokens, "
        f"{len(idx.shards)} shards) and the tiny model {run / 'index-model'} on CPU: the load clients' {total['requests']:,} requests, "
        f"{total['failed']} failed, {total['req_per_s']:,.1f} requests/s (the probe's requests, in its row, not counted)."
    )
    if "baseline" in data:
        b = data["baseline"]
        md += (
            f"\n\nThe same load, run first, against the server of the library at {b['commit']}: the load clients' {b['total']['requests']:,} requests, "
            f"{b['total']['failed']} failed, {b['total']['req_per_s']:,.1f} requests/s:\n\n" + table(list(b["endpoints"].values()), cols)
        )
    if "cold" in data:
        c = data["cold"]
        md += (
            f"\n\nCold: the same load, run first, with the index's {c['evicted_files']} files dropped from the page cache just before the server "
            f"started (posix_fadvise DONTNEED): the load clients' {c['total']['requests']:,} requests, {c['total']['failed']} failed, "
            f"{c['total']['req_per_s']:,.1f} requests/s:\n\n" + table(list(c["endpoints"].values()), cols)
        )
    if share:
        md += (
            f"\n\nIndex-lookup share of a decode step, 125M model on this CPU, {share['index_tokens'] / 1e6:.0f}M-token index: lookup {share['lookup_ms']:.3f} ms, "
            f"model step {share['model_step_ms']:.1f} ms -> {share['share']:.2%}."
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh([r["endpoint"] for r in rows], [r["p50 ms"] for r in rows], label="p50")
    ax.barh(
        [r["endpoint"] for r in rows], [r["p99 ms"] - r["p50 ms"] for r in rows], left=[r["p50 ms"] for r in rows], label="p99", alpha=0.5
    )
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.legend()
    save(args.name, data, md, fig)


def main() -> int:
    if "--smoke" in sys.argv[1:]:
        return smoke()
    args = parse_args()
    if args.share_only:
        return share_only()
    run = Path(args.run)
    ensure_demo(run)
    from teragram.index.engine import Index
    from teragram.index.pagecache import index_files, warm

    idx = Index(run / "idx")
    queries, texts = request_mix(idx)
    data: dict = {"clients": args.clients}
    warm(run / "idx")  # as `teragram warm` before `teragram serve`
    if args.baseline:
        import tempfile

        from benchmarks.common import library_at

        with tempfile.TemporaryDirectory() as t:
            stats, wall, _ = serve_and_load(run, queries, texts, args.seconds, args.clients, library_at(args.baseline, Path(t)))
        b_rows, b_total = endpoint_rows(stats, wall)
        data["baseline"] = {"commit": args.baseline, "seconds": wall, "endpoints": {r["endpoint"]: r for r in b_rows}, "total": b_total}
    if args.cold:  # the index's pages dropped just before the server starts (it maps them afresh)
        from benchmarks.index_scale import evict

        files = index_files(run / "idx")  # through linked folders: a composed index links its parts' shards
        evict(files, [a for s in idx.shards for a in (s.tok, s.sa.words, s.samax)])
        stats, wall, _ = serve_and_load(run, queries, texts, args.seconds, args.clients)
        c_rows, c_total = endpoint_rows(stats, wall)
        data["cold"] = {"seconds": wall, "endpoints": {r["endpoint"]: r for r in c_rows}, "total": c_total, "evicted_files": len(files)}
        warm(run / "idx")  # the cold run left it cached in 4 kB pages
    stats, wall, server_stats = serve_and_load(run, queries, texts, args.seconds, args.clients)
    rows, total = endpoint_rows(stats, wall)
    for r in rows:  # the server's own latency (from receiving the request to answering it), where /stats has it
        own = server_stats.get("endpoints", {}).get(r["endpoint"])
        r["server p99 ms"] = own["p99_ms"] if own else ""
    data |= {"seconds": wall, "endpoints": {r["endpoint"]: r for r in rows}}
    data |= {"total": total, "server_stats": server_stats}
    big = default_workdir() / "tg"
    if (big / "manifest.json").exists():
        data["decode_lookup_share"] = lookup_share(big)
    report(args, idx, rows, data)
    print(json.dumps(data["total"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
