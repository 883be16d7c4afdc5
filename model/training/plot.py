"""The training log as a figure: OUT/loss.png from OUT/log.jsonl (train and held-out loss; the
downstream tasks' acc_norm when the run evaluated them)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_log(out: Path) -> None:
    """Draw OUT/loss.png from OUT/log.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if x.strip()]
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r and r.get("loss")]
    ev = [(r["step"], r["eval"]["loss"]) for r in rows if "eval" in r]
    ds = [r for r in rows if "evals" in r]
    fig, axes = plt.subplots(1, 2 if ds else 1, figsize=(11 if ds else 6, 3.5), squeeze=False)
    ax = axes[0, 0]
    if tr:
        ax.plot(*zip(*tr), label="train")
    if ev:
        ax.plot(*zip(*ev), "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    if ds:
        bx = axes[0, 1]
        for t in ds[-1]["evals"]:
            bx.plot([r["step"] for r in ds], [r["evals"][t]["acc_norm"] for r in ds], "o-", label=f"{t} ({ds[-1]['evals'][t]['n']})")
        bx.set_xlabel("step")
        bx.set_ylabel("acc_norm")
        bx.legend()
    fig.savefig(out / "loss.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
