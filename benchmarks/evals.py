"""Multiple-choice accuracy of a model with and without the index (model/evals.py), every
task's whole validation set, with the share of examples found in the index (any 13-gram of
context + answer) and the accuracy on the rest.

    python -m benchmarks.evals --checkpoint RUN --index IDX [--gate GATE.json] [--tasks all] [--name evals]

Published references for the same tasks (acc_norm where the source gives it): GPT-2 124M,
HellaSwag 0.294 (llm.c's evaluation, 10,042 examples); TScale's 125M, HellaSwag 0.327 without
and 0.360 with its index.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import save, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="the model, or --outputs")
    ap.add_argument("--outputs", help="the model's outputs (teragram evals --save-outputs)")
    ap.add_argument("--model-name", help="what the model is, for the table (default: the checkpoint)")
    ap.add_argument("--index", required=True)
    ap.add_argument("--gate")
    ap.add_argument("--tasks", default="all")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--name", default="evals")
    a = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from teragram.index.engine import Index
    from teragram.model.evals import TASKS, run_task
    from teragram.model.gate import Gate
    from teragram.model.train import load_model

    model = load_model(a.checkpoint, a.device)[0] if a.checkpoint else None
    idx = Index(a.index)
    gate = Gate.load(a.gate) if a.gate else None
    tasks = list(TASKS) if a.tasks == "all" else a.tasks.split(",")
    rows, raw = [], []
    for name in tasks:
        t = time.time()
        r = run_task(model, idx, name, gate=gate, limit=a.limit, device=a.device, batch=a.batch, threads=a.workers, outputs_dir=a.outputs)
        r["seconds"] = time.time() - t
        raw.append(r)
        row = {"task": name, "examples": r["examples"], "acc": r["model"]["acc"], "acc_norm": r["model"]["acc_norm"]}
        if gate is not None:
            row |= {"gated_acc": r["gated"]["acc"], "gated_acc_norm": r["gated"]["acc_norm"]}
        row |= {"in_index": r["contaminated_share"], "clean_acc_norm": r["model_clean"]["acc_norm"]}
        if gate is not None:
            row["clean_gated_acc_norm"] = r["gated_clean"]["acc_norm"]
        rows.append(row)
        print(row, flush=True)
    cols = list(rows[0])
    md = (
        f"Model {a.model_name or a.checkpoint or a.outputs}, index {a.index} "
        f"({idx.n_tokens:,} tokens), gate {a.gate}. acc: the candidate with the highest summed log-probability; acc_norm: "
        "per character of the completion; gated: the same through the gated mixture of the model and the index's and "
        "document cache's estimates; in_index: share of examples with a 13-gram of context + answer in the index; clean_*: "
        "accuracy on the others. Chance: 0.25 for 4 candidates (HellaSwag, ARC, SciQ, OpenBookQA), 0.5 for 2 (PIQA, "
        "Winogrande, BoolQ), 0.33 for Social IQa. References: GPT-2 124M HellaSwag acc_norm 0.294 (llm.c); TScale 125M "
        "0.327 without its index, 0.360 with.\n\n"
    )
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["acc_norm"] for r in rows], 0.4, label="model")
    if gate is not None:
        ax.bar([i + 0.2 for i in x], [r["gated_acc_norm"] for r in rows], 0.4, label="gated")
    ax.set_xticks(list(x), [r["task"] for r in rows], rotation=30)
    ax.set_ylabel("acc_norm")
    ax.legend()
    fig.tight_layout()
    save(
        a.name,
        {"rows": rows, "raw": raw, "checkpoint": a.checkpoint, "outputs": a.outputs, "index": a.index, "gate": a.gate},
        md + table(rows, cols),
        fig,
    )
    print(md + table(rows, cols))


if __name__ == "__main__":
    main()
