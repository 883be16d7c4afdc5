"""Multiple-choice accuracy of a model with and without the index (model/evaluation/tasks.py), every
task's whole validation set, with the share of examples found in the index (any 13-gram of
context + answer) and the accuracy on the rest.

    python -m benchmarks.evals --checkpoint RUN --index IDX [--gate GATE.json] [--tasks all] [--name evals]
    python -m benchmarks.evals --results EVALS.json --model-name ... --name evals
    python -m benchmarks.evals --curve RUN/log.jsonl --model-name ... --name evals_curve

--results renders a run of `teragram evals --out EVALS.json` made elsewhere (e.g. on the GPU
machine with its own copy of the index; the index named here is the same build, for its token
count). --curve renders the accuracy logged during training (train --evals=TASKS
--evals_limit=N --eval_every=K) against the step.

Published references for the same tasks (acc_norm where the source gives it): GPT-2 124M,
HellaSwag 0.294 (llm.c's evaluation, 10,042 examples); TScale's 125M, HellaSwag 0.327 without
and 0.360 with its index.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import save, smoke_context, smoke_index, smoke_model, table


def smoke() -> None:
    """The tiny model and index, two tasks' first examples, then --results of that run."""
    with smoke_context(True) as tmp:
        run, idx = smoke_model(tmp), smoke_index(tmp)
        sys.argv = [
            sys.argv[0],
            "--checkpoint",
            str(run),
            "--index",
            str(idx),
            "--tasks",
            "hellaswag,piqa",
            "--limit",
            "3",
            "--batch",
            "4",
        ]
        main()
        raw = json.loads((tmp / "results" / "evals.json").read_text())["raw"]
        (tmp / "run.json").write_text(json.dumps({"tasks": raw, "index": str(idx)}))
        sys.argv = [sys.argv[0], "--results", str(tmp / "run.json"), "--model-name", "tiny", "--name", "evals_results"]
        return main()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="the model, or --outputs")
    ap.add_argument("--outputs", help="the model's outputs (teragram evals --save-outputs)")
    ap.add_argument("--results", help="a saved run of teragram evals --out (nothing is scored here)")
    ap.add_argument("--curve", help="a training run's log.jsonl with evals rows (nothing is scored here)")
    ap.add_argument("--model-name", help="what the model is, for the table (default: the checkpoint)")
    ap.add_argument("--index", help="the index (with --results: read from the saved run)")
    ap.add_argument("--gate")
    ap.add_argument("--tasks", default="all")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--name", default="evals")
    a = ap.parse_args()
    if not (a.curve or a.results or a.index):
        ap.error("--index is required unless --results is given")
    return a


def score(a: argparse.Namespace) -> tuple[list[dict], str]:
    """Every task run here (model/evaluation/tasks.run_task): (their results, the index's description)."""
    from teragram.index.engine import Index
    from teragram.model.checkpoint import load_model
    from teragram.model.evaluation.tasks import TASKS, run_task
    from teragram.model.mixture.gate import Gate

    tasks = list(TASKS) if a.tasks == "all" else a.tasks.split(",")
    idx = Index(a.index)
    where = f"index {a.index} ({idx.n_tokens:,} tokens)"
    model = load_model(a.checkpoint, a.device)[0] if a.checkpoint else None
    gate = Gate.load(a.gate) if a.gate else None
    raw = []
    for name in tasks:
        t = time.time()
        kw = dict(gate=gate, limit=a.limit, device=a.device, batch=a.batch, threads=a.workers, outputs_dir=a.outputs)
        raw.append(run_task(model, idx, name, **kw) | {"seconds": time.time() - t})
        print(raw[-1], flush=True)
    return raw, where


def saved_run(a: argparse.Namespace) -> tuple[list[dict], str]:
    """The tasks' results of a run scored elsewhere (--results); its gate and index become a's."""
    saved = json.loads(Path(a.results).read_text())
    raw, a.gate, a.index = saved["tasks"], saved.get("gate"), saved["index"]
    return raw, f"index {a.index} (on the machine that scored it)"


def task_rows(raw: list[dict]) -> tuple[list[dict], str | None]:
    """One table row per task, and the gated mixture's name when the run has one."""
    mix = "gated" if "gated" in raw[0] else None  # the gate's mixture
    rows = []
    for r in raw:
        row = {"task": r["task"], "examples": r["examples"], "acc": r["model"]["acc"], "acc_norm": r["model"]["acc_norm"]}
        if mix:
            row |= {f"{mix}_acc": r[mix]["acc"], f"{mix}_acc_norm": r[mix]["acc_norm"]}
        row |= {"in_index": r["contaminated_share"], "clean_acc_norm": r["model_clean"]["acc_norm"]}
        if mix:
            row[f"clean_{mix}_acc_norm"] = r[f"{mix}_clean"]["acc_norm"]
        rows.append(row)
    return rows, mix


def report(a: argparse.Namespace, raw: list[dict], where: str, plt) -> None:
    """The table and the plot: benchmarks/results/NAME.*"""
    rows, mix = task_rows(raw)
    cols = list(rows[0])
    md = (
        f"Model {a.model_name or a.checkpoint or a.outputs or a.results}, {where}, gate {a.gate}"
        + (f", scored elsewhere: {a.results}" if a.results else "")
        + ". acc: the candidate with the highest summed log-probability; acc_norm: "
        "per character of the completion; gated: the same through the gated mixture of the model and the index's and "
        "document cache's estimates; in_index: share of examples with a 13-gram of context + answer in the index; clean_*: "
        "accuracy on the others. Chance: 0.25 for 4 candidates (HellaSwag, ARC, SciQ, OpenBookQA), 0.5 for 2 (PIQA, "
        "Winogrande, BoolQ), 0.33 for Social IQa. References: GPT-2 124M HellaSwag acc_norm 0.294 (llm.c); TScale 125M "
        "0.327 without its index, 0.360 with.\n\n"
    )
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["acc_norm"] for r in rows], 0.4, label="model")
    if mix:
        ax.bar([i + 0.2 for i in x], [r[f"{mix}_acc_norm"] for r in rows], 0.4, label=mix)
    ax.set_xticks(list(x), [r["task"] for r in rows], rotation=30)
    ax.set_ylabel("acc_norm")
    ax.legend()
    fig.tight_layout()
    save(
        a.name,
        {
            "rows": rows,
            "raw": raw,
            "checkpoint": a.checkpoint,
            "outputs": a.outputs,
            "results": a.results,
            "index": a.index,
            "gate": a.gate,
        },
        md + table(rows, cols),
        fig,
    )
    print(md + table(rows, cols))


def main() -> None:
    if "--smoke" in sys.argv[1:]:
        return smoke()
    a = parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if a.curve:
        return curve(a, plt)
    raw, where = saved_run(a) if a.results else score(a)
    report(a, raw, where, plt)


def curve(a, plt) -> None:
    """acc_norm of each task logged during training, against the step."""
    logged = [json.loads(x) for x in Path(a.curve).read_text().splitlines() if x.strip()]
    ev = [r for r in logged if "evals" in r]
    if not ev:
        raise SystemExit(f"{a.curve}: no evals rows (train with --evals=TASKS --eval_every=K)")
    tasks = list(ev[-1]["evals"])
    rows = [{"step": r["step"]} | {f"{t} acc_norm ({r['evals'][t]['n']})": r["evals"][t]["acc_norm"] for t in tasks} for r in ev]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for t in tasks:
        ax.plot([r["step"] for r in ev], [r["evals"][t]["acc_norm"] for r in ev], "o-", label=f"{t} (first {ev[-1]['evals'][t]['n']})")
    ax.set_xlabel("step")
    ax.set_ylabel("acc_norm")
    ax.legend()
    fig.tight_layout()
    md = (
        f"Model {a.model_name or a.curve}: acc_norm of each task's first N validation examples (a fixed subset), "
        f"logged during training (`{a.curve}`); no index. Chance: 0.25 (HellaSwag, ARC), 0.5 (PIQA).\n\n"
    )
    save(a.name, {"rows": rows, "log": a.curve}, md + table(rows, list(rows[0])), fig)
    print(md + table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
