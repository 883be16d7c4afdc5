"""Bulk held-out scoring as a user meets it: one pass over held-out text, from a fresh process,
tokens per second per core of the gates' index estimates (the ∞-gram and the fixed orders 2-17,
with counts: model.mixture.estimates.index_estimates_docs) and of held-out features (top-4,
matches capped at 64 tokens: index.heldout.held_out_features).

    python -m benchmarks.heldout_speed --index DATA/idx-050m DATA/idx-2b \\
        --heldout DATA/heldout [--tokens 5000000] [--cold-tokens N] [--threads 1] \\
        [--baseline COMMIT] [--states warm cold+warm cold]

Each (index, state, operation) is measured in a process of its own, which loads the documents
(tokenized once, untimed), opens the index and times one pass over them, the numba kernels loaded
from their cache included (a first run on a machine also compiles them), then, warm, a second pass
through the same opened index (the "repeat" column: what a long run sustains once every page it
needs is mapped; the index keeps no results between passes). The states of the page cache:

  warm       the index read into the page cache by `teragram warm` (index/pagecache.py) before
             the process starts: a machine whose memory holds the index;
  cold+warm  its pages dropped, then `teragram warm` timed as part of the run: from a cold
             start, the way the README tells a user to run (the rate counts the warm's time);
  cold       its pages dropped and nothing more: every page comes from disk at the first touch
             (on the first --cold-tokens tokens only, when given: at billions of tokens a pass
             from disk takes hours).

Checks made before anything is saved (benchmarks.common.save's checks): both passes give the
same digest of their outputs; --baseline's library (a commit, run from a `git archive` of its
library, warm, one pass) gives the same digests on the same index; indexes of the same tokens in
other shardings give the same estimates and the same features but for "cont", the continuation
of the most recent occurrence, which depends on the order of the documents in the index (the same
for indexes built from the same inputs in the same order). Each row also gives the measuring
process's resident memory and the part of it mapped 2 MiB at a time (/proc/self/smaps_rollup).
--heldout takes files or folders (every *.jsonl.zst under them: DATA/heldout is every half of
the four held-out sets, the index side of an index-size evaluation). Writes
benchmarks/results/heldout_speed.{json,md,png}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, SMOKE_HELP, library_at, library_env, save, smoke_context, smoke_index, smoke_jsonl, table

OPS = ("estimates", "features")
STATES = ("warm", "cold+warm", "cold")
ORDER_DEPENDENT = ("cont",)  # features that depend on the order of the index's documents


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def _run_op(idx, docs: list[np.ndarray], op: str, threads: int) -> dict[str, str]:
    """One bulk pass of op over the documents: {"all": digest of every output, "order_free":
    digest of the outputs that do not depend on the index's document order}."""
    if op == "estimates":
        from teragram.model.mixture.estimates import index_estimates_docs

        e = index_estimates_docs(idx, docs, threads=threads)
        d = _digest(e[k] for k in sorted(e))
        return {"all": d, "order_free": d}
    from teragram.index.features import FIELDS, FeatureConfig
    from teragram.index.heldout import held_out_features

    f = held_out_features(idx, docs, FeatureConfig("held-out", 64, 4), threads=threads)
    return {"all": _digest(getattr(f, n) for n in FIELDS), "order_free": _digest(getattr(f, n) for n in FIELDS if n not in ORDER_DEPENDENT)}


def tokenized(index: Path, heldout: list[str], tokens: int, out: Path) -> Path:
    """The held-out documents (every *.jsonl.zst under a folder, sorted) tokenized by the index's
    tokenizer, the first ones up to `tokens` tokens (all if 0), saved to out (.npz: ids, ends)
    for the measuring processes; the index itself is not opened (its pages stay as they are)."""
    from types import SimpleNamespace

    from teragram.index import tokenizer
    from teragram.index.heldout import read_corpus

    files = []
    for p in map(Path, heldout):
        files += sorted(str(f) for f in p.rglob("*.jsonl.zst")) if p.is_dir() else [str(p)]
    docs = read_corpus(SimpleNamespace(tokenizer=tokenizer.load(Path(index) / "tokenizer.model")), files)[0]
    if tokens:
        docs = docs[: int(np.searchsorted(np.cumsum([len(d) for d in docs]), tokens)) + 1]
    np.savez(out, ids=np.concatenate(docs), ends=np.cumsum([len(d) for d in docs]))
    return out


def worker(spec: dict) -> dict:
    """Measure one (index, op) in this fresh process: the tokenized documents loaded, then the
    index opened and one pass timed, then (passes 2) a second through the same opened index."""
    from teragram.index.engine import Index

    with np.load(spec["docs"]) as z:
        docs = np.split(z["ids"], z["ends"][:-1])
    tokens, th = int(sum(len(d) for d in docs)), spec["threads"]
    t = time.perf_counter()
    idx = Index(spec["index"])
    digest = _run_op(idx, docs, spec["op"], th)
    r = {"tokens": tokens, "first_s": time.perf_counter() - t, "digest": digest}
    if spec.get("passes", 2) == 2:
        t = time.perf_counter()
        again = _run_op(idx, docs, spec["op"], th)
        r |= {"repeat_s": time.perf_counter() - t, "repeat_digest": again}
    return r | {"index_tokens": idx.manifest["counts"]["tokens"], "shards": len(idx.shards), "mapped": _mapped()}


def _mapped() -> dict:
    """This process's resident memory and the part of it mapped 2 MiB at a time (GiB; Linux)."""
    try:
        rows = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines() if ":" in line)
    except OSError:
        return {}
    gib = lambda k: round(int(rows[k].split()[0]) / 2**20, 2) if k in rows else None  # noqa: E731
    return {"rss_gib": gib("Rss"), "pmd_mapped_gib": gib("FilePmdMapped")}


def measure(spec: dict, library: Path | None = None) -> dict:
    """worker(spec) in a fresh process (with the library at `library` when given), the index's
    page cache put in spec["state"] first (warm: teragram warm; cold: its pages dropped; cold+warm:
    dropped, then teragram warm, timed)."""
    from teragram.index.pagecache import index_files, warm

    from benchmarks.index_scale import evict

    pre = {}
    if spec["state"] == "warm":
        pre["warmed"] = warm(spec["index"])
    else:
        evict(index_files(spec["index"]))
        if spec["state"] == "cold+warm":
            t = time.perf_counter()
            pre["warmed"] = warm(spec["index"])
            pre["warm_s"] = time.perf_counter() - t
    cmd = [sys.executable, "-m", "benchmarks.heldout_speed", "--worker", json.dumps(spec)]
    r = subprocess.run(cmd, cwd=REPO, env=library_env(library), capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{cmd[:4]} failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.split("RESULT ", 1)[1]) | pre
    s = out["first_s"] + out.get("warm_s", 0.0)
    print(
        f"  {Path(spec['index']).name} {spec['state']} {spec['op']}: {out['tokens']:,} tokens, one pass "
        f"{out['tokens'] / s / spec['threads']:,.0f} tokens/s/core"
        + (f", repeat {out['tokens'] / out['repeat_s'] / spec['threads']:,.0f}" if "repeat_s" in out else ""),
        flush=True,
    )
    return out


def checks(rows: list[dict]) -> dict[str, bool]:
    """The equalities the figures rest on (module docstring), by description."""
    out = {}
    for r in rows:
        if "repeat_digest" in r:
            out[f"{r['index']} {r['state']} {r['op']}: both passes give the same outputs"] = r["repeat_digest"] == r["digest"]
    first = {}  # (index tokens, op, documents) -> the first row measured
    for r in rows:
        ref = first.setdefault((r["index_tokens"], r["op"], r["tokens"]), r)
        if r is ref:
            continue
        same_index = r["index"] == ref["index"]
        key = "all" if same_index else "order_free"
        what = f"{r['code']} on {r['index']} == {ref['code']} on {ref['index']} ({r['op']}{'' if same_index else ', but for cont'})"
        out[what] = r["digest"][key] == ref["digest"][key]
    return out


def _plot(rows: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    mine = [r for r in rows if r["code"] == "this commit"]
    for op in OPS:
        for state in STATES:
            pts = sorted((r["index_tokens"], r["rate"]) for r in mine if r["op"] == op and r["state"] == state)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{op}, {state}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("index tokens")
    ax.set_ylabel("tokens/s/core, one pass")
    ax.legend(fontsize=8)
    ax.set_title("bulk held-out scoring, one pass from a fresh process")
    return fig


def _report(rows: list[dict]) -> str:
    out = []
    for r in rows:
        out.append(
            {
                "code": r["code"],
                "index": r["index"],
                "index tokens": f"{r['index_tokens'] / 1e6:,.0f}M",
                "shards": r["shards"],
                "op": r["op"],
                "page cache": r["state"],
                "tokens": f"{r['tokens']:,}",
                "warm s": f"{r['warm_s']:.0f}" if "warm_s" in r else "",
                "pass s": f"{r['first_s']:.1f}",
                "one pass, tokens/s/core": f"{r['rate']:,.0f}",
                "repeat pass, tokens/s/core": f"{r['tokens'] / r['repeat_s'] / r['threads']:,.0f}" if "repeat_s" in r else "",
                "digest (but cont)": f"{r['digest']['all']} ({r['digest']['order_free']})",
                "resident GiB (2 MiB-mapped)": f"{r['mapped'].get('rss_gib')} ({r['mapped'].get('pmd_mapped_gib')})"
                if r.get("mapped")
                else "",
            }
        )
    note = (
        "One pass: from the process's start of the pass (index opened, kernels loaded) to its end; with cold+warm, "
        "`teragram warm`'s time counted in. Repeat: a second pass through the same opened index. Threads per row: "
        f"{', '.join(sorted({str(r['threads']) for r in rows}))}.\n\n"
    )
    return note + table(out, list(out[0]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", nargs="+", type=Path)
    ap.add_argument("--heldout", nargs="+", type=Path, help="held-out text (JSON lines, files or folders)")
    ap.add_argument("--tokens", type=int, default=5_000_000, help="first documents of --heldout up to this many tokens (0: all)")
    ap.add_argument("--cold-tokens", type=int, default=0, help="state cold: only the first documents up to this many tokens (0: --tokens)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--states", nargs="+", choices=STATES, default=list(STATES))
    ap.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    ap.add_argument("--baseline", help="also the library at this commit (warm, one pass): its digests must be equal")
    ap.add_argument("--name", default="heldout_speed")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    a = ap.parse_args(argv)
    if a.worker:
        print("RESULT " + json.dumps(worker(json.loads(a.worker))))
        return 0
    with smoke_context(a.smoke) as tmp:
        if a.smoke:
            a.index, a.heldout, a.tokens, a.cold_tokens = [smoke_index(tmp)], [smoke_jsonl(tmp, heldout=True)], 5000, 2000
            a.baseline = "HEAD" if (REPO / ".git").exists() else None
        if not a.index or not a.heldout:
            ap.error("--index and --heldout are required")
        rows = []
        with tempfile.TemporaryDirectory(prefix="heldout-speed-") as t:
            lib = library_at(a.baseline, Path(t) / "lib") if a.baseline else None
            for ix in a.index:
                docs = {
                    n: tokenized(ix, [str(p) for p in a.heldout], n, Path(t) / f"docs-{n}.npz")
                    for n in {a.tokens, a.cold_tokens or a.tokens}
                }
                runs = [(state, op, None) for state in a.states for op in a.ops]
                runs += [("warm", op, lib) for op in a.ops if lib is not None]
                for state, op, library in runs:
                    n = a.cold_tokens if state == "cold" and a.cold_tokens else a.tokens
                    spec = {"index": str(ix), "docs": str(docs[n]), "threads": a.threads, "op": op, "state": state}
                    spec["passes"] = 2 if state == "warm" and library is None else 1  # the repeat: the warm rows of this commit
                    r = measure(spec, library) | {"index": ix.name, "op": op, "state": state, "threads": a.threads}
                    r["code"] = f"baseline {a.baseline}" if library is not None else "this commit"
                    r["rate"] = r["tokens"] / (r["first_s"] + r.get("warm_s", 0.0)) / a.threads
                    rows.append(r)
        save(a.name, {"rows": rows}, _report(rows), _plot(rows), checks=checks(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
