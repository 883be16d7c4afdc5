"""Index lookups of gated generation against indexes of growing size and shard count (issue 48):
milliseconds of index lookups per generated token (the features of the new position and the
gate's estimates after it: index/scorer.py), for the incremental scorer and for the lookups from
scratch it replaced (model.mixture.gate.lookup_estimates), on the same prompts and seeds.

    python -m benchmarks.gated_generation --checkpoint RUN --index DATA/idx-050m DATA/idx-2b \\
        --valid DATA/heldout/timeshift/valid.jsonl.zst \\
        --prompts DATA/heldout/timeshift/test.jsonl.zst DATA/heldout/prose/test.jsonl.zst

Per index, a gate is fit for the model and that index with the product's command (`teragram
eval --fit-gate` on the first --valid-docs documents of --valid), then every prompt (the first
PROMPT_TOKENS tokens of the first --n-prompts documents of each --prompts file) is continued by
--new-tokens sampled tokens (temperature 0.8, top-p 0.95, seed 0), both ways, in one process on
one thread, after the index's files are read through (page cache warm: at 2.43B a cold one
doubled the median); the texts must be identical. Writes benchmarks/results/gated_generation.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import SMOKE_HELP, save, smoke_context, smoke_index, smoke_jsonl, smoke_model, smoke_short_fits, table

PROMPT_TOKENS = 64


def _valid_file(src: Path, n_docs: int, out: Path) -> Path:
    """The first n_docs documents of a JSON-lines file, as one (so the gate fit stays short)."""
    import zstandard

    from benchmarks.common import read_jsonl

    out.parent.mkdir(parents=True, exist_ok=True)
    with zstandard.open(out, "wt", encoding="utf-8") as f:
        for k, r in enumerate(read_jsonl(src)):
            if k >= n_docs:
                break
            f.write(json.dumps({"text": r["text"], "path": r.get("path", str(k))}) + "\n")
    return out


def fit_gate(checkpoint: Path, index: Path, valid: Path, out: Path) -> dict:
    """The product's gate fit for this model and index (`teragram eval --fit-gate`, run in this
    process); its wall time."""
    from teragram.serve.main import main as teragram

    t = time.time()
    rc = teragram(
        ["eval", "--checkpoint", str(checkpoint), "--index", str(index), "--corpus", str(valid), "--fit-gate", str(out), "--quiet"]
    )
    if rc:
        raise SystemExit(f"teragram eval --fit-gate exited {rc}")
    return {"fit_s": time.time() - t}


def prompts_of(idx, files: list[Path], n: int) -> list[list[int]]:
    from teragram.index.heldout import read_corpus

    out = []
    for f in files:
        docs = [d for d in read_corpus(idx, [f])[0] if len(d) >= PROMPT_TOKENS][:n]
        out += [[int(x) for x in d[:PROMPT_TOKENS]] for d in docs]
    return out


def run(model, idx, gate, prompts: list[list[int]], new_tokens: int, scratch: bool) -> tuple[list[list[int]], list[float], float]:
    """Continue every prompt; (texts, the scorer's lookup seconds per appended token, wall
    seconds). scratch: the gate's estimates looked up from scratch per token, outside the scorer
    (the path before it gave them)."""
    from teragram.model.generation import sample

    keep = sample.index_lengths
    if scratch:
        sample.index_lengths = lambda g: {}  # no scorer estimates: next_distribution looks them up
    texts, lookups, t0 = [], [], time.perf_counter()
    try:
        for p in prompts:
            g = sample.generate(model, idx, p, max_new_tokens=new_tokens, temperature=0.8, top_p=0.95, seed=0, gate=gate)
            texts.append(g.new_ids)
            lookups += g.stats.lookup_s
    finally:
        sample.index_lengths = keep
    return texts, lookups, time.perf_counter() - t0


def measure(checkpoint: Path, index: Path, gate_path: Path, prompts_files: list[Path], n_prompts: int, new_tokens: int) -> dict:
    import torch
    from teragram.index.engine import Index
    from teragram.index.pagecache import warm
    from teragram.model.checkpoint import load_model
    from teragram.model.mixture.gate import Gate

    torch.set_num_threads(1)
    warm(index)
    model, _ = load_model(checkpoint)
    gate = Gate.load(gate_path)
    prompts = prompts_of(Index(index), prompts_files, n_prompts + 1)
    warm, prompts = prompts[:: n_prompts + 1], [p for k, p in enumerate(prompts) if k % (n_prompts + 1)]
    run(model, Index(index), gate, warm, new_tokens, False)  # compiles the kernels, warms the page cache
    # each way on an index opened afresh: no histogram kept from the other run's identical text
    new, lk, wall = run(model, Index(index), gate, prompts, new_tokens, False)
    old, _, wall_old = run(model, Index(index), gate, prompts, new_tokens, True)
    idx = Index(index)
    tokens = sum(len(t) for t in new)
    return {
        "index": index.name,
        "index_tokens": idx.manifest["counts"]["tokens"],
        "shards": len(idx.shards),
        "prompts": len(prompts),
        "tokens": tokens,
        "lookup_ms_median": float(np.median(lk)) * 1e3,
        "lookup_ms_p90": float(np.percentile(lk, 90)) * 1e3,
        "lookup_ms_mean": float(np.mean(lk)) * 1e3,
        "tokens_per_s": tokens / wall,
        "tokens_per_s_scratch": sum(len(t) for t in old) / wall_old,
        "identical": new == old,
    }


def _plot(rows: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = [r["index_tokens"] for r in rows]
    ax.plot(x, [r["lookup_ms_median"] for r in rows], marker="o", label="lookups per token, median")
    ax.plot(x, [r["lookup_ms_p90"] for r in rows], marker="o", label="p90")
    ax.set_xscale("log")
    ax.set_xlabel("index tokens")
    ax.set_ylabel("ms")
    ax.legend()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--index", nargs="+", type=Path)
    ap.add_argument("--valid", type=Path, help="validation text the gates are fit on (JSON lines)")
    ap.add_argument("--valid-docs", type=int, default=40)
    ap.add_argument("--prompts", nargs="+", type=Path, help="held-out text whose documents' starts are the prompts")
    ap.add_argument("--n-prompts", type=int, default=10, help="prompts per --prompts file")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--work", type=Path, default=Path("/tmp/gated-generation"))
    ap.add_argument("--name", default="gated_generation")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    a = ap.parse_args(argv)
    with smoke_context(a.smoke) as tmp:
        if a.smoke:
            smoke_short_fits()
            a.checkpoint, a.index = smoke_model(tmp), [smoke_index(tmp)]
            a.valid = a.prompts = smoke_jsonl(tmp, heldout=True)
            a.prompts, a.valid_docs, a.n_prompts, a.new_tokens, a.work = [a.valid], 3, 2, 8, tmp / "work"
        if not (a.checkpoint and a.index and a.valid and a.prompts):
            ap.error("--checkpoint, --index, --valid and --prompts are required")
        valid = _valid_file(a.valid, a.valid_docs, a.work / "valid.jsonl.zst")
        rows = []
        for ix in a.index:
            gate = a.work / f"gate-{ix.name}.json"
            fit = fit_gate(a.checkpoint, ix, valid, gate) if not gate.exists() or a.smoke else {"fit_s": None}
            r = measure(a.checkpoint, ix, gate, a.prompts, a.n_prompts, a.new_tokens) | fit
            print(f"{ix.name}: lookups {r['lookup_ms_median']:.3f} ms/token median, identical {r['identical']}", flush=True)
            rows.append(r)
        cols = ["index", "index_tokens", "shards", "prompts", "tokens", "lookup_ms_median", "lookup_ms_p90", "lookup_ms_mean"]
        cols += ["tokens_per_s", "tokens_per_s_scratch", "identical", "fit_s"]
        md = table([{c: (f"{r[c]:.3f}" if isinstance(r[c], float) else r[c]) for c in cols} for r in rows], cols)
        checks = {f"{r['index']}: the incremental lookups' text == the from-scratch lookups'": r["identical"] for r in rows}
        save(a.name, {"rows": rows, "prompt_tokens": PROMPT_TOKENS, "new_tokens": a.new_tokens}, md, _plot(rows), checks=checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
