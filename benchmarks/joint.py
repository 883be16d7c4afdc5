"""Joint training of the LM and the index gate (model/joint.py) against the post-hoc gate and the
peers, on the index-size benchmark's data: the same 125M, steps and text as its model (a).

    python -m benchmarks.index_size prepare --data DATA --carry .carry15       # here: text + held-out halves
    python -m benchmarks.joint gpu --carry .carry15 --work W --out OUT --stage prep   # on the GPU machine
    python -m benchmarks.joint gpu --carry .carry15 --work W --out OUT --stage train --variants joint,plain
    python -m benchmarks.joint eval --joint OUT --outputs DATA/outputs-125m --index DATA/idx-050m   # here

`prep` indexes the training text with the carried tokenizer, writes exclude-doc features at every
context length the estimates need and the training positions' estimates (model/joint.py), and the
held-out features. `train` trains each variant with benchmarks/perplexity.py's GPU settings and
saves its per-target nll on every held-out half (with the index on that machine: the gate reads the
hidden state, so a joint model's evaluation cannot be split like the post-hoc one's). Variants:
  joint     every estimate (index ∞-gram and 2..17-grams, the cache's), the gate reads h
  nohidden  the same without the hidden state (the ablation)
  nocache   the index's estimates only
  plain     the model alone, for the step rate on the same machine
`eval` reports them beside the post-hoc variants and the peers of benchmarks/index_size.py at the
model's own index (its cached results), on all and decontaminated test text.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import save, sh, table

CAPS = (1, 2, 4, 8, 16, 255)  # the fixed orders' context lengths and the ∞-gram's cap (model/joint.py)
VARIANTS = {
    "joint": [],
    "nohidden": ["--joint_hidden=false"],
    "nocache": ["--joint_components=index_infgram,index_2gram,index_3gram,index_5gram,index_9gram,index_17gram"],
    "plain": [],
}
NAMES = {
    "joint": "(j) joint: LM + gate over index and cache, trained together",
    "nohidden": "(j-h) joint, gate without the hidden state",
    "nocache": "(j-c) joint, index estimates only",
}
SETS = ("indist", "timeshift", "prose")
HALVES = ("valid", "test")


def stage_prep(carry: Path, work: Path) -> dict:
    from teragram.model import joint

    py, n = sys.executable, os.cpu_count() or 1
    train = [carry / "train-code.jsonl.zst", carry / "train-english.jsonl.zst"]
    t = time.time()
    sh(py, "-m", "teragram.builder.cli", *train, "--out", work / "idx", "--tokenizer", carry / "tokenizer.model", "--workers", n, "--quiet")
    ph = {"index_s": time.time() - t}
    t = time.time()
    procs = [  # one process per context length: each is one pass over the (single) shard
        subprocess.Popen(
            [py, "-m", "teragram.serve.cli", "features", str(work / "idx"), "--out", str(work / f"len-{c}"), "--mode", "exclude-doc"]
            + ["--max-len", str(c), "--top-k", "4", "--quiet"]
        )
        for c in CAPS
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("exclude-doc features failed")
    ph["features_s"] = time.time() - t
    t = time.time()
    joint.write_train_estimates(work / "idx", [work / f"len-{c}" for c in CAPS], work / "est", 4, workers=n)
    ph["estimates_s"] = time.time() - t
    t = time.time()
    from teragram.builder.features import FeatureConfig, compute_features

    for s in SETS:
        for h in HALVES:
            compute_features(
                work / "idx",
                work / "held" / f"{s}-{h}",
                FeatureConfig("held-out", 64, 1),
                corpus=[str(carry / s / f"{h}.jsonl.zst")],
                workers=n,
            )
    ph["heldout_s"] = time.time() - t
    print(json.dumps(ph))
    return ph


def stage_train(work: Path, out: Path, variants: list[str], steps: int | None, scale: str = "gpu") -> None:
    import torch
    from teragram.index.engine import Index
    from teragram.model.evaluate import token_eval
    from teragram.model.train import load_model

    from benchmarks.perplexity import SCALES, train_cmd

    s = dict(SCALES[scale])
    if steps:
        s["steps"] = steps
    idx = Index(work / "idx")
    info = {}
    for v in variants:
        t = time.time()
        cmd = [a for a in train_cmd("a", work, s) if not a.startswith("--out=")] + [f"--out={work / 'runs' / v}"]
        if v != "plain":
            feats = ",".join(str(work / f"len-{c}") for c in CAPS)
            cmd += ["--gate=joint", f"--joint_features={feats}", f"--joint_estimates={work / 'est'}", *VARIANTS[v]]
        else:
            cmd += [f"--max_steps={min(300, s['steps'])}", "--checkpoint=false"]
        sh(*cmd)
        log = [json.loads(x) for x in open(work / "runs" / v / "log.jsonl")]
        info[v] = {"train_s": time.time() - t, "log": log}
        if v == "plain":
            continue
        t = time.time()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model, _ = load_model(work / "runs" / v, device)
        for name in SETS:
            for h in HALVES:
                r = token_eval(
                    model,
                    work / "held" / f"{name}-{h}",
                    idx.eos_id,
                    idx.sep,
                    device,
                    batch=s["eval_batch"],
                    index=idx,
                    threads=os.cpu_count() or 1,
                )
                np.savez_compressed(
                    out / f"{v}-{name}-{h}.npz",
                    nll=r["nll"].astype(np.float32),
                    nll_model=r["nll_model"].astype(np.float32),
                    target=r["target"].astype(np.int32),
                    doc=r["doc"].astype(np.int32),
                )
        info[v]["eval_s"] = time.time() - t
        (out / "joint_gpu.json").write_text(json.dumps(info, indent=1))
    (out / "joint_gpu.json").write_text(json.dumps(info, indent=1))


def _rate(log: list[dict], skip: int = 100) -> float:
    """Tokens per second after the first `skip` steps (compilation and warm-up left out)."""
    rows = [r for r in log if "tokens_per_s" in r]
    a = next(r for r in rows if r["step"] >= skip)
    b = rows[-1]
    tok_a, tok_b = a["tokens_per_s"] * a["elapsed_s"], b["tokens_per_s"] * b["elapsed_s"]
    return (tok_b - tok_a) / (b["elapsed_s"] - a["elapsed_s"])


def stage_eval(joint_out: Path, outputs: Path, index: Path) -> dict:
    from teragram.index.bulk import continuations
    from teragram.index.engine import Index
    from teragram.model.estimates import heldout_docs
    from teragram.model.outputs import load_outputs

    from benchmarks.index_size import _contamination

    gpu = json.loads((joint_out / "joint_gpu.json").read_text())
    posthoc = json.loads((outputs / "eval" / f"{index.name}.json").read_text())
    idx = Index(index)
    res = {"index": index.name, "sets": {}, "rates": {}}
    if "plain" in gpu:
        plain = _rate(gpu["plain"]["log"])
        res["rates"] = {v: {"tokens_per_s": _rate(g["log"]), "vs_plain": _rate(g["log"]) / plain} for v, g in gpu.items()}
    variants = [v for v in NAMES if (joint_out / f"{v}-indist-test.npz").exists()]
    for s in SETS:
        row = {}
        for h in HALVES:
            o = load_outputs(outputs / "unpacked" / f"{s}-{h}")
            docs = heldout_docs(o.path)
            starts = np.concatenate([[0], np.cumsum([len(d) + 1 for d in docs])])
            keep = None
            if h == "test":  # documents with >= 80% of their 13-grams in the index: index_size's rule
                lens = np.array([len(d) for d in docs])
                st = np.concatenate([[0], np.cumsum(lens)])
                L = continuations(idx, np.concatenate(docs), st, [0], threads=os.cpu_count() or 1)[0].length
                first = st[:-1] + np.arange(len(docs))
                length = np.zeros(len(L) + len(docs), np.int64)
                m = np.ones(len(length), bool)
                m[first] = False
                length[m] = L
                keep = _contamination({"index_length": length}, starts) < 0.8
            for v in variants:
                z = np.load(joint_out / f"{v}-{s}-{h}.npz")
                if not np.array_equal(z["target"], o.target.astype(np.int32)):
                    raise SystemExit(f"{v} {s}-{h}: the joint run's targets differ from the outputs' (other held-out text)")
                row.setdefault(v, {})[h] = float(np.exp(z["nll"].mean()))
                if keep is not None:
                    row[v]["test_decontaminated"] = float(np.exp(z["nll"][keep[o.doc.astype(int)]].mean()))
                    row[v]["model_alone_test"] = float(np.exp(z["nll_model"].mean()))
        p = posthoc["sets"][s]
        res["sets"][s] = {"joint": row, "posthoc": {k: p[k] for k in ("ppl", "ppl_valid", "ppl_decontaminated")}}
    return res


def report(res: dict) -> None:
    names = {"a": "(a) no index", "c": "(c) infini-gram interpolation", "c+c": "(c+cache) infini-gram + document cache"}
    names |= {"a+c": "(a+c) post-hoc cache gate", "t-c": "(t-c) post-hoc index gate", "t": "(t) post-hoc index + cache gate"}
    lines = []
    for s, r in res["sets"].items():
        rows = []
        for k, n in names.items():
            if k in r["posthoc"]["ppl"]:
                p = r["posthoc"]
                rows.append(
                    {"variant": n, "valid": p["ppl_valid"][k], "test": p["ppl"][k], "test decontaminated": p["ppl_decontaminated"][k]}
                )
        for v, j in r["joint"].items():
            rows.append({"variant": NAMES[v], "valid": j["valid"], "test": j["test"], "test decontaminated": j["test_decontaminated"]})
        lines += [f"**{s}** (perplexity)", "", table(rows, ["variant", "valid", "test", "test decontaminated"]), ""]
        best_peer = min(r["posthoc"]["ppl_decontaminated"].get(k, np.inf) for k in ("c", "c+c"))
        if "joint" in r["joint"]:
            j = r["joint"]["joint"]["test_decontaminated"]
            t = r["posthoc"]["ppl_decontaminated"]["t"]
            lines.append(
                f"- {s}: joint (j) {j:.3g} vs post-hoc (t) {t:.3g} = {j / t:.3f}x; {100 * (1 - j / best_peer):.1f}% below the best peer ({best_peer:.3g})."
            )
            lines.append("")
    if res["rates"]:
        rows = [{"variant": v, "tokens/s after step 100": r["tokens_per_s"], "vs plain": r["vs_plain"]} for v, r in res["rates"].items()]
        lines.append(table(rows, ["variant", "tokens/s after step 100", "vs plain"]))
    save("joint", res, "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["gpu", "eval"])
    ap.add_argument("--carry", type=Path)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--stage", dest="gpu_stage", choices=["prep", "train", "all"], default="all")
    ap.add_argument("--variants", default="joint,plain")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--scale", choices=["gpu", "cpu"], default="gpu", help="gpu: the 125M; cpu: the tiny model (a smoke test)")
    ap.add_argument("--joint", type=Path)
    ap.add_argument("--outputs", type=Path)
    ap.add_argument("--index", type=Path)
    a = ap.parse_args(argv)
    if a.stage == "gpu":
        a.out.mkdir(parents=True, exist_ok=True)
        if a.gpu_stage in ("prep", "all"):
            (a.out / "prep.json").write_text(json.dumps(stage_prep(a.carry, a.work)))
        if a.gpu_stage in ("train", "all"):
            stage_train(a.work, a.out, a.variants.split(","), a.steps, a.scale)
    else:
        report(stage_eval(a.joint, a.outputs, a.index))
    return 0


if __name__ == "__main__":
    sys.exit(main())
