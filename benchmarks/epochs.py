"""(a47) trained longer (issue 62, at kNN-LM's terms): the 125M of the index-size benchmark trained
on the same 47M tokens for several step counts (1,500 steps of 32 x 1,024 tokens is one pass over
them), one recipe otherwise (benchmarks/perplexity.py SCALES["gpu"]: peak and final learning rate,
warmup, batch, seed), the step count chosen on validation loss alone (the model by itself on the
validation halves of the held-out sets). The thesis benchmark then puts the chosen run beside
(a47) and (a517).

    python -m benchmarks.index_size prepare --data DATA --carry .carry71 --max-mb 0.6     # here
    cp DATA/hellaswag.tar.zst .carry71/                                                    # here
    python -m tools.device_pipeline start --home /tmp/e71 --out-dir o --seconds 20 -- \\
        python -m benchmarks.epochs gpu --carry .carry71 --work w --out o --steps 6000 3000 1500 --hf-model 3000  # GPU
    python -m tools.device_pipeline wait --home /tmp/e71 --seconds 540                     # GPU, the calls after, at once
    python -m benchmarks.epochs choose --outputs OUT                                       # here
    python -m benchmarks.thesis report --data DATA --outputs DATA/out66 OUT/sN DATA/out62  # here

`gpu` builds the index of the training text with the carried tokenizer (as index_size gpu), then
for each step count, in the order given (the most wanted first: a machine lost later keeps it),
trains a run, saves its outputs on every carried held-out half (OUT/sN/, as index_size gpu
saves them) and, with HellaSwag's set carried, its HellaSwag outputs (OUT/sN/hellaswag.tar.gz,
mixed here by benchmarks/evals.py). With --hf-model N, benchmarks/hf_model.py then compares run
sN exported with `teragram export --hf` against its native path on the four held-out sets (issue
63), its results into OUT/results/. `choose` reads each run's validation loss from its saved
outputs and names the choice.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import save, smoke_context, smoke_data, smoke_index, smoke_short_fits, table


def stage_gpu(carry: Path, work: Path, out: Path, steps: list[int], hf_model: int | None, scale: str = "gpu") -> None:
    """On the GPU machine: the index of the carried training text (kept if WORK/idx has one), then
    per step count a run, its outputs and HellaSwag's in OUT/sN, hf_bench after run hf_model."""
    import torch
    from teragram.index.engine import Index

    from benchmarks.index_size import carried_sets, heldout_features, index_train_text, save_outputs_a
    from benchmarks.perplexity import SCALES, train_cmd
    from benchmarks.thesis import hellaswag_outputs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = os.cpu_count() or 1
    t = time.time()
    if not (work / "idx" / "manifest.json").exists():
        index_train_text(carry, work)
    tokens = Index(work / "idx").n_positions
    index_s, held = time.time() - t, None
    for k in steps:
        s = dict(SCALES[scale], steps=k)
        run, dest = work / "runs" / f"s{k}", out / f"s{k}"
        dest.mkdir(parents=True, exist_ok=True)
        phases = {"index_s": index_s} if held is None else {}
        t = time.time()
        trainer = subprocess.Popen([str(c) for c in train_cmd("a", work, s, out=run)])
        if held is None:  # the held-out features on the CPU while the first run trains
            held = heldout_features(work / "idx", work / "heldout", carry, n)
            phases["features_s"] = time.time() - t
        if trainer.wait():
            raise SystemExit(f"the trainer of s{k} failed ({trainer.returncode})")
        phases["train_s"] = time.time() - t
        t = time.time()
        save_outputs_a(work, dest, held, s["eval_batch"], device, run=run)
        phases["outputs_s"] = time.time() - t
        trained = k * s["batch_size"] * s["block_size"]
        info = {
            "train_log": [json.loads(line) for line in open(run / "log.jsonl")],
            "phases": phases,
            "index_tokens": tokens,
            "schedule": {
                "steps": k,
                "warmup": s["warmup"],
                "trained_tokens": trained,
                "passes": trained / tokens,
                "distinct_tokens": tokens,
            },
            "sets": list(carried_sets(carry)),
            "scale": scale,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        }
        (dest / "gpu.json").write_text(json.dumps(info, indent=1))
        if (carry / "hellaswag.tar.zst").exists():
            t = time.time()
            hellaswag_outputs(carry / "hellaswag.tar.zst", run, work / "idx", work / f"hs-{k}", dest, device)
            info["phases"]["hellaswag_s"] = time.time() - t
            (dest / "gpu.json").write_text(json.dumps(info, indent=1))
        print(json.dumps({"run": f"s{k}", **info["phases"]}), flush=True)
        if k == hf_model:
            hf_bench(carry, work, run, out, device)


def hf_bench(carry: Path, work: Path, run: Path, out: Path, device: str) -> None:
    """benchmarks/hf_model.py on RUN: gates fit on the in-distribution validation half, applied to
    each set's test half; its results into OUT/results."""
    from benchmarks.index_size import carried_sets

    sets = [f"{s}={carry / s / 'test.jsonl.zst'}" for s in carried_sets(carry)]
    env = dict(os.environ, TERAGRAM_RESULTS=str(out / "results"))
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.hf_model",
        "--run",
        run,
        "--index",
        work / "idx",
        "--valid",
        carry / "indist" / "valid.jsonl.zst",
    ]
    cmd += ["--sets", *sets, "--device", device, "--name", f"hf_model_{'gpu' if device == 'cuda' else 'cpu'}", "--out", work / "hfb"]
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, env=env)


def validation_loss(outputs: Path) -> dict:
    """Per validation half of one run's outputs (the .tgz files the gpu stage saved, unpacked once
    into OUTPUTS/unpacked): the model's mean nll per target, and targets."""
    from teragram.model.evaluation.outputs import load_outputs

    res = {}
    for tgz in sorted(outputs.glob("outputs-*-valid.tgz")):
        name = tgz.name.removeprefix("outputs-").removesuffix(".tgz")
        if not (outputs / "unpacked" / name).exists():
            with tarfile.open(tgz) as t:
                t.extractall(outputs / "unpacked", filter="data")
        o = load_outputs(outputs / "unpacked" / name)
        nll = np.asarray(o.nll, np.float64)
        res[name.removesuffix("-valid")] = {"nll": float(nll.mean()), "targets": len(nll)}
    return res


def choose(runs: list[Path], on: str = "indist") -> dict:
    """Each run's validation loss and the choice: the least mean nll on the `on` set's validation
    half (the training text's own distribution); the other sets' are reported beside it."""
    rows = []
    for r in runs:
        g = json.loads((r / "gpu.json").read_text())
        v = validation_loss(r)
        if on not in v:
            raise SystemExit(f"{r}: no {on} validation outputs")
        rows.append(
            {
                "run": r.name,
                "steps": g["schedule"]["steps"],
                "passes": round(g["schedule"]["passes"], 2),
                **{f"{s} valid nll": round(x["nll"], 4) for s, x in v.items()},
            }
        )
    best = min(rows, key=lambda x: x[f"{on} valid nll"])
    return {"on": on, "rows": rows, "chosen": best["run"]}


def plot(res: dict):
    """Validation loss against passes over the training text, one line per set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for col in [c for c in res["rows"][0] if c.endswith("valid nll")]:
        ax.plot([r["passes"] for r in res["rows"]], [r[col] for r in res["rows"]], marker="o", label=col.removesuffix(" valid nll"))
    ax.set_xlabel("passes over the training text")
    ax.set_ylabel("validation loss (nats a token, the model alone)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def smoke() -> int:
    """The gpu stage on CPU (the tiny model, two step counts of a few steps, the smoke index), then choose."""
    from benchmarks.index_size import main as index_size

    smoke_short_fits()
    with smoke_context(True) as tmp:
        carry, work, out = tmp / "carry", tmp / "work", tmp / "out"
        index_size(["prepare", "--data", str(smoke_data(tmp)), "--carry", str(carry), "--max-mb", "0.01"])
        for name in ("indist", "prose"):  # one held-out set: the same steps for each
            shutil.rmtree(carry / name)
        work.mkdir()
        (work / "idx").symlink_to(smoke_index(tmp).resolve())
        from benchmarks import perplexity

        perplexity.SCALES["smoke"] = dict(perplexity.SCALES["cpu"], block_size=128, batch_size=2, warmup=1, eval_batch=16)
        stage_gpu(carry, work, out, [4, 2], None, scale="smoke")
        res = choose([out / "s4", out / "s2"], on="timeshift")
        if res["chosen"] not in ("s4", "s2") or len(res["rows"]) != 2:
            raise SystemExit(f"smoke: {res}")
    return 0


def main(argv: list[str] | None = None) -> int:
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):
        return smoke()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gpu")
    g.add_argument("--carry", type=Path, required=True)
    g.add_argument("--work", type=Path, required=True)
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--steps", type=int, nargs="+", required=True, help="each run's training steps, in the order they run")
    g.add_argument("--hf-model", type=int, help="after the run of this many steps, compare it exported (benchmarks/hf_model.py)")
    c = sub.add_parser("choose")
    c.add_argument("--outputs", type=Path, required=True, help="the gpu stage's OUT (its sN folders)")
    c.add_argument("--on", default="indist", help="the set whose validation half chooses")
    a = ap.parse_args(argv)
    if a.cmd == "gpu":
        stage_gpu(a.carry, a.work, a.out, a.steps, a.hf_model)
        return 0
    runs = sorted((p for p in a.outputs.glob("s*") if (p / "gpu.json").exists()), key=lambda p: int(p.name[1:]))
    res = choose(runs, a.on)
    md = table(res["rows"], list(res["rows"][0]))
    md += f"\n\nChosen on the {res['on']} validation half's loss (the model alone): **{res['chosen']}**."
    save("epochs", res, md, plot(res))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
