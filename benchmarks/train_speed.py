"""Training speed of the 125M model with and without index inputs (needs one or two CUDA GPUs).

    python -m benchmarks.train_speed [--steps 60] [--out DIR]

Builds an index of the embedded corpus (32000-piece tokenizer) and its exclude-doc features,
then runs `teragram train` with the 125M preset (B=32, T=1024, bf16, torch.compile, fused
AdamW) for each variant and reads tokens/s from its log between step 20 and the end (after
compilation and warm-up). With two GPUs it also runs the index model under torchrun on both
(32 sequences per GPU) and reports the scaling. Reference: plain PyTorch GPT-2 124M at 521k
tokens/s on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import save, table


def rate(log: Path, after: int) -> tuple[float, int]:
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "tokens_per_s" in r]
    a = next(r for r in rows if r["step"] >= after)
    b = rows[-1]
    per_step = b["tokens_per_s"] * b["elapsed_s"] / (b["step"] - rows[0]["step"] + 1)  # tokens per step
    return per_step * (b["step"] - a["step"]) / (b["elapsed_s"] - a["elapsed_s"]), b["step"] - a["step"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--work", default="/tmp/tg-speed")
    args = ap.parse_args()
    import torch

    repo = str(Path(__file__).resolve().parents[1])
    w = Path(args.work)
    py = sys.executable
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not (w / "feats" / "manifest.json").exists():
        subprocess.run(
            [py, "-m", "teragram.builder.cli", "data/default/train", "--out", str(w / "idx"), "--workers", "16", "--quiet"],
            cwd=repo,
            check=True,
            env=env,
        )
        subprocess.run(
            [py, "-m", "teragram.serve.cli", "features", str(w / "idx"), "--out", str(w / "feats"), "--workers", "4", "--quiet"],
            cwd=repo,
            check=True,
            env=env,
        )
    common = [
        f"--index={w / 'idx'}",
        f"--features={w / 'feats'}",
        "--preset=125m",
        "--batch_size=32",
        "--block_size=1024",
        f"--max_steps={args.steps}",
        "--log_every=5",
        "--progress=false",
        "--resume=false",
        "--warmup=10",
    ]
    rows, data = [], {}
    for name, extra in (("with index inputs + mixture", []), ("without index (baseline)", ["--use_index=false"])):
        out = w / name.split()[0]
        subprocess.run(["rm", "-rf", str(out)])
        subprocess.run([py, "-m", "teragram.serve.cli", "train", *common, f"--out={out}", *extra], cwd=repo, check=True, env=env)
        tps, n = rate(out / "log.jsonl", args.warmup_steps)
        data[name] = {"tokens_per_s": tps, "timed_steps": n, "gpus": 1}
        rows.append({"variant": name, "GPUs": 1, "tokens/s": tps, "vs 521k reference": tps / 521e3})
    if torch.cuda.device_count() >= 2:
        out = w / "ddp"
        subprocess.run(["rm", "-rf", str(out)])
        subprocess.run(
            [py, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "teragram.serve.cli", "train", *common, f"--out={out}"],
            cwd=repo,
            check=True,
            env=env,
        )
        tps, n = rate(out / "log.jsonl", args.warmup_steps)
        one = data["with index inputs + mixture"]["tokens_per_s"]
        data["ddp_2gpu_with_index"] = {"tokens_per_s": tps, "timed_steps": n, "gpus": 2, "scaling": tps / one}
        rows.append(
            {
                "variant": "with index inputs + mixture, DDP",
                "GPUs": 2,
                "tokens/s": tps,
                "vs 521k reference": tps / 521e3,
                "scaling": tps / one,
            }
        )
    md = table(rows, ["variant", "GPUs", "tokens/s", "vs 521k reference", "scaling"])
    md += (
        "\n\n125M preset (12 layers, 768 dims, context 1024), 32 sequences of 1024 tokens per GPU and step, bf16 autocast, torch.compile, "
        f"fused AdamW; tokens/s from the training log after step {args.warmup_steps}."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.8))
    ax.barh([r["variant"] for r in rows], [r["tokens/s"] / 1e3 for r in rows])
    ax.axvline(470, color="k", ls="--", lw=1)
    ax.set_xlabel("thousand tokens/s")
    save("train_speed", data, md, fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
