"""The 125M headline with the everyday English part (issue 18), trained and scored on the GPU
machine: the perplexity benchmark's recipe for (a) (1,500 steps of 32 x 1,024 tokens, seed 7) on
its text plus train-everyday (benchmarks/perplexity_data.py), the multiple-choice tasks logged
during training, then every task's whole validation set scored alone and through the post-hoc
gate fit on validation text (the indist set's valid half and the everyday part's); perplexity of
every test half (indist, everyday, timeshift, prose), all and decontaminated, alone and gated.

    python -m benchmarks.perplexity_data --out DATA/ppl --parts everyday                  # here
    python -m benchmarks.evals_gpu prepare --data DATA --carry .carry18e                  # here
    python -m benchmarks.evals_gpu train --base .carry15 --carry .carry18e --work W --out OUT   # GPU
    python -m benchmarks.evals_gpu ppl   --base .carry15 --carry .carry18e --work W --out OUT   # GPU, at once
    python -m benchmarks.evals_gpu evals --base .carry15 --carry .carry18e --work W --out OUT   # GPU, at once
    python -m benchmarks.evals --results OUT/evals.json --model-name ... --name evals_125m_english   # here
    python -m benchmarks.evals --curve OUT/log.jsonl --model-name ... --name evals_125m_english_curve
    python -m benchmarks.evals_gpu report --out OUT --note ...                             # here: test perplexity

BASE is the index-size benchmark's carry (benchmarks/index_size.py prepare: the perplexity
benchmark's train-code/train-english, its tokenizer, the indist/timeshift/prose halves); CARRY
holds train-everyday and the everyday part's held-out halves (its held-out documents that
heldout-english does not already hold, split by the perplexity benchmark's rule). `train` indexes
the three training files with BASE's tokenizer and trains (a) on that index's text (~4 minutes
on the H200); `ppl` and `evals` (W must still be there: the machine keeps /tmp only while warm)
fit the gate once, then report perplexity on every test half alone and gated (~5 minutes), and
score the tasks (~7 minutes): one stage per call, each under the device's 10 minutes. OUT holds
only small files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks.common import read_jsonl, sh, smoke_context, smoke_data, smoke_imports, write_jsonl

EVALS = ["--evals=hellaswag,piqa,arc_easy", "--evals_limit=5000", "--eval_every=250"]
TRAIN = ("train-code.jsonl.zst", "train-english.jsonl.zst")


def prepare(data: Path, carry: Path) -> dict:
    """CARRY/train-everyday.jsonl.zst and CARRY/everyday/{valid,test}.jsonl.zst from DATA/ppl."""
    from benchmarks.lib.heldout_sets import split_halves
    from tools import corpora

    ppl = data / "ppl"
    have = {r["path"] for name in ("heldout-code.jsonl.zst", "heldout-english.jsonl.zst") for r in read_jsonl(ppl / name)}
    held = [r for r in read_jsonl(ppl / "heldout-everyday.jsonl.zst") if r["path"] not in have]
    if any(corpora.split_of(r["path"]) != "heldout" for r in held):
        raise SystemExit(f"{ppl / 'heldout-everyday.jsonl.zst'} holds a train-split document")
    carry.mkdir(parents=True, exist_ok=True)
    shutil.copy(ppl / "train-everyday.jsonl.zst", carry / "train-everyday.jsonl.zst")
    info = {half: write_jsonl(carry / "everyday" / f"{half}.jsonl.zst", recs) for half, recs in split_halves(held).items()}
    (carry / "prepare.json").write_text(json.dumps(info, indent=1))
    return info


def _halves_of(base: Path, carry: Path, half: str) -> dict[str, Path]:
    return {"indist": base / "indist" / f"{half}.jsonl.zst", "everyday": carry / "everyday" / f"{half}.jsonl.zst"} | (
        {s: base / s / f"{half}.jsonl.zst" for s in ("timeshift", "prose")} if half == "test" else {}
    )


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def stage_train(
    base: Path, carry: Path, work: Path, out: Path, scale: str = "gpu", steps: int | None = None, limit: int | None = None
) -> dict:
    from benchmarks.perplexity import SCALES, train_cmd

    py, n = sys.executable, os.cpu_count() or 1
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    info: dict = {}
    t = time.time()
    files = [base / f for f in TRAIN] + [carry / "train-everyday.jsonl.zst"]
    sh(py, "-m", "teragram.builder.cli", *files, "--out", work / "idx", "--tokenizer", base / "tokenizer.model", "--workers", n, "--quiet")
    info["index_s"] = time.time() - t
    t = time.time()
    s = dict(SCALES[scale]) | ({"steps": steps} if steps else {})
    evals = EVALS if limit is None else [*EVALS[:1], f"--evals_limit={limit}", f"--eval_every={max(s['steps'] // 2, 1)}"]
    sh(*train_cmd("a", work, s), *evals)
    info["train_s"] = time.time() - t
    shutil.copy(work / "runs" / "a" / "log.jsonl", out / "log.jsonl")
    (out / "train.json").write_text(json.dumps(info, indent=1))
    return info


def _gate(base: Path, carry: Path, work: Path, out: Path, ev: list[str]) -> Path:
    """The post-hoc gate, fit once on the valid halves (kept in WORK: OUT is new each call), and
    a copy in OUT."""
    gate = work / "gate.json"
    if not gate.exists():
        sh(*ev, "--corpus", *_halves_of(base, carry, "valid").values(), "--fit-gate", gate, "--quiet")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(gate, out / "gate.json")
    return gate


def _cli(work: Path, command: str) -> list[str]:
    """`teragram eval` or `teragram evals` of the trained (a) with WORK's index."""
    run, idx = work / "runs" / "a", work / "idx"
    if not (run / "latest.json").exists():
        raise SystemExit(f"{run}: no trained model (run the train stage first, on this machine while it is warm)")
    return [sys.executable, "-m", "teragram.serve.main", command, "--checkpoint", str(run), "--index", str(idx)] + [
        *("--device", _device(), "--workers", str(os.cpu_count() or 1))
    ]


def stage_ppl(base: Path, carry: Path, work: Path, out: Path) -> dict:
    """Each test half's perplexity alone and gated, all and decontaminated (OUT/t/SET[-dc].json,
    each written as it comes). About 5 minutes on the H200."""
    import subprocess

    ev = _cli(work, "eval")
    t = time.time()
    gate = _gate(base, carry, work, out, ev)
    info: dict = {"fit_gate_s": time.time() - t}
    (out / "t").mkdir(parents=True, exist_ok=True)
    t = time.time()
    for name, path in _halves_of(base, carry, "test").items():
        for tag, extra in (("", []), ("-dc", ["--decontaminate"])):
            cmd = [*ev, "--corpus", str(path), "--gate", str(gate), *extra, "--json", "--quiet"]
            (out / "t" / f"{name}{tag}.json").write_text(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    info["test_s"] = time.time() - t
    return info


def stage_evals(base: Path, carry: Path, work: Path, out: Path, limit: int | None = None) -> dict:
    """Every task's whole validation set alone and gated (OUT/evals.json): about 7 minutes on
    the H200 with 16 threads for the index side."""
    gate = _gate(base, carry, work, out, _cli(work, "eval"))
    t = time.time()
    sh(*_cli(work, "evals"), "--gate", gate, "--tasks", "all", "--out", out / "evals.json", *(["--limit", limit] if limit else []))
    return {"evals_s": time.time() - t}


def report(out: Path, earlier: Path, note: str, name: str) -> None:
    """Test perplexity of this run's (a) alone and gated beside the earlier recipe's (a) and
    post-hoc (t) without the English part (benchmarks/index_size.py eval's JSON, same sets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common import save, table

    old = json.loads(earlier.read_text())["indexes"][-1]["sets"]
    rows = []
    for s in ("indist", "everyday", "timeshift", "prose"):
        for tag, key, label in (("", "ppl", "all"), ("-dc", "ppl_decontaminated", "decontaminated")):
            f = out / "t" / f"{s}{tag}.json"
            if not f.exists() and not tag:  # all is decontaminated when it dropped nothing
                f = out / "t" / f"{s}-dc.json"
                if not f.exists() or json.loads(f.read_text())["decontaminated"]["dropped_docs"]:
                    continue
            if not f.exists():
                continue
            r = json.loads(f.read_text())
            row = {"set": s, "text": label, "tokens": r["tokens"]}
            if s in old:
                row |= {"(a) before": old[s][key]["a"], "(t) before": old[s][key]["t"]}
            else:
                row |= {"(a) before": None, "(t) before": None}
            row |= {"(a) with English": r["model"]["perplexity"], "(a)+gate with English": r["perplexity"]}
            rows.append(row)
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    for i, k in enumerate(("(a) before", "(a) with English", "(t) before", "(a)+gate with English")):
        ax.bar([j + (i - 1.5) * 0.2 for j in x], [r[k] or 0 for r in rows], 0.2, label=k)
    ax.set_xticks(list(x), [f"{r['set']} {r['text'][:5]}" for r in rows], rotation=30)
    ax.set_yscale("log")
    ax.set_ylabel("test perplexity")
    ax.legend()
    fig.tight_layout()
    md = (
        f"{note}\n\nTest perplexity of the 125M (a) trained with the everyday English part (train-everyday) and of its "
        f"post-hoc gate (one gate, fit on the indist and everyday valid halves), beside the same recipe without the part "
        f"({earlier}: (a) and its post-hoc (t), whose gate is fit on each set's own valid half). "
        "The everyday set: the part's held-out documents (not in heldout-english).\n\n"
    )
    save(name, {"rows": rows, "outputs": str(out), "earlier": str(earlier), "note": note}, md + table(rows, list(rows[0])), fig)


def main() -> int:
    if "--smoke" in sys.argv[1:]:  # prepare on a tiny DATA; train, ppl, evals need the GPU run's carry (imported only)
        smoke_imports("benchmarks.perplexity")
        with smoke_context(True) as tmp:
            sys.argv = [sys.argv[0], "prepare", "--data", str(smoke_data(tmp)), "--carry", str(tmp / "carry")]
            return main()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["prepare", "train", "ppl", "evals", "report"])
    ap.add_argument("--data", help="prepare: DATA (with DATA/ppl)")
    ap.add_argument("--base", default=".carry15")
    ap.add_argument("--carry", default=".carry18e")
    ap.add_argument("--work", default="/tmp/w18")
    ap.add_argument("--out")
    ap.add_argument("--scale", default="gpu", help="the perplexity benchmark's scale (cpu: the tiny model, for a smoke run)")
    ap.add_argument("--steps", type=int, help="override the scale's steps")
    ap.add_argument("--limit", type=int, help="each task's first N examples only (a smoke run)")
    ap.add_argument("--earlier", help="report: the recipe without the part (its index_size-style results JSON)")
    ap.add_argument("--note", default="", help="report: where and at which commit OUT was made")
    ap.add_argument("--name", default="evals_125m_english_ppl")
    a = ap.parse_args()
    if a.stage == "prepare":
        print(json.dumps(prepare(Path(a.data), Path(a.carry)), indent=1))
        return 0
    if not a.out:
        raise SystemExit("--out is needed for train, evals and report")
    if a.stage == "report":
        if not a.earlier:  # the earlier recipe's file left benchmarks/results/ with the joint recipe
            raise SystemExit("report needs --earlier FILE (e.g. git show 76ffa94:benchmarks/results/joint_posthoc_refit.json > FILE)")
        report(Path(a.out), Path(a.earlier), a.note, a.name)
        return 0
    paths = (Path(a.base), Path(a.carry), Path(a.work), Path(a.out))
    if a.stage == "train":
        info = stage_train(*paths, scale=a.scale, steps=a.steps, limit=a.limit)
    elif a.stage == "ppl":
        info = stage_ppl(*paths)
    else:
        info = stage_evals(*paths, limit=a.limit)
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
