"""Training speed of the 125M model with and without index inputs (needs one or two CUDA GPUs).

    python -m benchmarks.train_speed [--steps 60] [--work DIR]
    python -m benchmarks.train_speed --suite features [--shapes 125m,350m] [--steps 30]

The features suite (issue 16) runs each training setting (recompute, CPU offload, fp8, int8,
the modern block with AdamW and with Muon) in this one process with the same data and seed,
eager (no torch.compile: a compile per setting and shape would not fit the few minutes this
suite has), and reports tokens/s after warm-up, the peak GPU memory and the loss after the last
step; it writes train_speed_features.{json,md,png}. ZeRO-1 is measured by
benchmarks/train_memory.py (it needs two processes).

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
from dataclasses import replace
from pathlib import Path

from benchmarks.common import save, sh, smoke_context, smoke_features, smoke_index, table


def rate(log: Path, after: int) -> tuple[float, int]:
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "tokens_per_s" in r]
    a = next(r for r in rows if r["step"] >= after)
    b = rows[-1]
    per_step = b["tokens_per_s"] * b["elapsed_s"] / (b["step"] - rows[0]["step"] + 1)  # tokens per step
    return per_step * (b["step"] - a["step"]) / (b["elapsed_s"] - a["elapsed_s"]), b["step"] - a["step"]


def prepare(w: Path, index: str | None, features: str | None) -> None:
    """The embedded corpus's index and exclude-doc features in w (built once), unless given."""
    if index:
        return
    repo = str(Path(__file__).resolve().parents[1])
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
            [py, "-m", "teragram.serve.main", "features", str(w / "idx"), "--out", str(w / "feats"), "--workers", "4", "--quiet"],
            cwd=repo,
            check=True,
            env=env,
        )
    if not (w / "held" / "manifest.json").exists():  # the embedded held-out documents: the suite's held-out loss
        sh(
            py,
            "-m",
            "teragram.serve.main",
            "features",
            w / "idx",
            "--out",
            w / "held",
            "--corpus",
            Path(repo) / "data/default/heldout",
            "--quiet",
        )


SETTINGS = {
    "bf16": {},
    "recompute attn": {"recompute": "attn"},
    "recompute block": {"recompute": "block"},
    "offload optimizer": {"offload": "optimizer"},
    "fp8": {"precision": "fp8"},
    "int8": {"precision": "int8"},
    "modern block, AdamW": {"arch": "modern"},
    "modern block, Muon": {"arch": "modern", "optimizer": "muon"},
    "modern block, tied head, Muon": {"arch": "modern", "optimizer": "muon", "tie_head": True},
}


def _vocab_topk(cfg) -> tuple[int, int]:
    vocab = json.loads((Path(cfg.index) / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    top_k = json.loads((Path(cfg.features) / "manifest.json").read_text())["top_k"]
    return vocab, top_k


def convergence(data: dict, shapes: list[str], window: int = 50) -> str:
    """Per setting: the mean training loss of the last 100 steps against bf16's (same tokens), and
    the first step where the loss, averaged over `window` steps, reaches bf16's final mean."""
    rows = []
    for shape in shapes:
        base = data["settings"].get(f"{shape} / bf16")
        if not base or "curve" not in base:
            continue
        for key, d in data["settings"].items():
            if not key.startswith(f"{shape} /") or "curve" not in d:
                continue
            losses = [v for _, v in d["curve"]]
            steps = [st for st, _ in d["curve"]]
            avg = [
                sum(losses[max(0, i - window // 2 + 1) : i + 1]) / len(losses[max(0, i - window // 2 + 1) : i + 1])
                for i in range(len(losses))
            ]
            reach = next((st for st, a in zip(steps, avg) if st >= window and a <= base["loss_last100"]), None)
            rows.append(
                {
                    "setting": key,
                    "parameters": f"{d['params'] / 1e6:.1f}M",
                    "loss, last 100 steps": f"{d['loss_last100']:.4f}",
                    "vs bf16": f"{100 * (d['loss_last100'] / base['loss_last100'] - 1):+.2f}%",
                    "steps to bf16's final loss": reach if reach is not None else "not reached",
                }
            )
            if "heldout_loss" in d and "heldout_loss" in base:
                rows[-1]["held-out loss"] = f"{d['heldout_loss']:.4f} ({100 * (d['heldout_loss'] / base['heldout_loss'] - 1):+.2f}%)"
            if len(d.get("heldout_curve", [])) > 1 and "heldout_loss" in base:
                hit = next((st for st, v in d["heldout_curve"] if v <= base["heldout_loss"]), None)
                rows[-1]["steps to bf16's final held-out loss"] = hit if hit is not None else "not reached"
    if not rows:
        return ""
    cols = list(dict.fromkeys(c for r in rows for c in r))
    return (
        "Convergence at equal tokens (training loss, steps measured on its moving average; held-out loss: the embedded corpus's "
        "held-out documents, after the last step and, with --eval-every, along the way):\n\n" + table(rows, cols)
    )


def features_suite(args, w: Path) -> int:
    import shutil

    import torch
    from teragram.model.config import ConfigError
    from teragram.model.gpt import GPT
    from teragram.model.training.train import TrainConfig, model_config, train

    cuda = torch.cuda.is_available()
    rows, data = [], {"settings": {}}
    warm = args.warmup_steps
    for shape in args.shapes.split(","):
        for name, kw in SETTINGS.items():
            if args.settings and name not in args.settings.split(";"):
                continue
            steps = args.offload_steps if "offload" in kw else args.steps
            out = w / "features" / f"{shape}-{name.replace(' ', '_').replace(',', '')}"
            shutil.rmtree(out, ignore_errors=True)
            cfg = TrainConfig(
                index=str(args.index or w / "idx"),
                features=str(args.features or w / "feats"),
                heldout=None if args.index else str(w / "held"),
                eval_every=args.eval_every,
                out=str(out),
                preset=shape,
                batch_size=args.batch_size,
                block_size=args.block_size,
                max_steps=steps,
                warmup=min(10, steps // 2),
                lr=6e-4,
                min_lr=6e-5,
                log_every=2,
                progress=False,
                resume=False,
                checkpoint=False,
                compile=args.compile,
                **kw,
            )
            key = f"{shape} / {name}"
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                r = train(cfg)
            except (
                ConfigError,
                RuntimeError,
                TypeError,
                ValueError,
            ) as e:  # a refusal, an out-of-memory, a kernel's limit: recorded, the suite goes on
                msg = str(e).splitlines()[0][:160]
                data["settings"][key] = {"error": msg}
                rows.append({"shape": shape, "setting": name, "note": msg})
                print(key, "failed:", msg, flush=True)
                _report_features(args, rows, data, warm)
                continue
            tps, n = rate(out / "log.jsonl", min(warm, steps // 3))  # after the first steps (allocation, warm-up)
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            if shape not in data:
                vocab = json.loads((Path(cfg.index) / "manifest.json").read_text())["tokenizer"]["vocab_size"]
                for arch in ("gpt2", "modern"):
                    m = GPT(model_config(replace(cfg, arch=arch), vocab, 4))
                    data.setdefault(shape, {})[f"params_{arch}"] = m.num_params()
                    data[shape][f"block_params_{arch}"] = sum(p.numel() for p in m.transformer.h[0].parameters())
            base = data["settings"].get(f"{shape} / bf16", {}).get("tokens_per_s")
            curve = [(x["step"], x["loss"]) for x in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in x]
            last = [v for st, v in curve if st > steps - 100]  # the mean of the last 100 steps' training loss
            d = {"tokens_per_s": tps, "timed_steps": n, "loss": r["loss"], "loss_last100": sum(last) / len(last), "steps": steps}
            d |= {"peak_gib": peak, "curve": curve, "params": GPT(model_config(cfg, *_vocab_topk(cfg))).num_params()}
            if "eval" in r:
                d["heldout_loss"] = r["eval"]["loss"]
                rows_log = map(json.loads, (out / "log.jsonl").read_text().splitlines())
                d["heldout_curve"] = sorted({x["step"]: x["eval"]["loss"] for x in rows_log if "eval" in x}.items())
            data["settings"][key] = d
            rows.append(
                {
                    "shape": shape,
                    "setting": name,
                    "tokens/s": tps,
                    "vs bf16": tps / base if base else "",
                    "peak GiB": peak if peak is not None else "",
                    "loss after N steps": r["loss"],
                    "N": steps,
                }
            )
            print(key, d, flush=True)
            _report_features(args, rows, data, warm)
    return 0


def _report_features(args, rows: list[dict], data: dict, warm: int) -> None:
    """Save the features suite's table so far (after every setting: a run cut short keeps what it measured)."""
    md = table(rows, ["shape", "setting", "tokens/s", "vs bf16", "peak GiB", "loss after N steps", "N", "note"])
    md += "\n\n" + convergence(data, args.shapes.split(","))
    counts = "; ".join(
        f"{s}: {data[s]['params_gpt2'] / 1e6:.1f}M parameters (GPT-2 block), {data[s]['params_modern'] / 1e6:.1f}M (modern block, untied head); "
        f"per block {data[s]['block_params_gpt2']:,} vs {data[s]['block_params_modern']:,}"
        for s in args.shapes.split(",")
        if s in data
    )
    md += (
        f"\n\n{args.batch_size} sequences of {args.block_size} tokens per step, index inputs + mixture, "
        f"{'torch.compile' if args.compile else 'eager (no torch.compile)'}, bf16 autocast, fused AdamW unless stated; tokens/s after the "
        f"first {warm} steps (a third of the offload runs); peak GPU memory of the whole run. Parameters without learned positions: {counts}. "
        "The loss after N steps is one run per setting (same data and seed)."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "tokens/s" in r]
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(ok) + 1))
    ax.barh([f"{r['shape']} {r['setting']}" for r in ok], [r["tokens/s"] / 1e3 for r in ok])
    ax.invert_yaxis()
    ax.set_xlabel("thousand tokens/s")
    save(args.name, data, md, fig)
    plt.close(fig)


def smoke() -> int:
    """The features suite, tiny shape on CPU, on the smoke index (the index suite is 125M on GPUs)."""
    with smoke_context(True) as tmp:
        idx, feats = smoke_index(tmp), smoke_features(tmp)
        sys.argv = [sys.argv[0], "--suite", "features", "--shapes", "tiny", "--settings", "bf16;recompute attn;modern block, Muon"]
        sys.argv += ["--steps", "3", "--warmup-steps", "1", "--batch-size", "2", "--block-size", "32", "--work", str(tmp / "w")]
        sys.argv += ["--index", str(idx), "--features", str(feats)]
        return main()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--work", default="/tmp/tg-speed")
    ap.add_argument("--suite", choices=("index", "features"), default="index")
    ap.add_argument("--shapes", default="125m,350m", help="features suite: model presets")
    ap.add_argument("--batch-size", type=int, default=16, help="features suite: sequences per step")
    ap.add_argument("--block-size", type=int, default=1024, help="features suite: context")
    ap.add_argument("--offload-steps", type=int, default=12, help="features suite: steps of the (slow) offload runs")
    ap.add_argument("--eval-every", type=int, default=0, help="features suite: held-out loss every N steps (0: after the last)")
    ap.add_argument("--settings", help="features suite: only these settings (names separated by ;)")
    ap.add_argument("--name", default="train_speed_features", help="features suite: results file name")
    ap.add_argument("--compile", action="store_true", help="features suite: torch.compile each run")
    ap.add_argument("--index", help="an existing index (with --features) instead of building one in --work")
    ap.add_argument("--features", help="its exclude-doc features")
    return ap.parse_args()


def index_suite(args: argparse.Namespace, w: Path) -> int:
    """The 125M model with and without index inputs on one GPU, and with them on two under DDP when there are two."""
    import torch

    repo = str(Path(__file__).resolve().parents[1])
    py = sys.executable
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    common = [
        f"--index={args.index or w / 'idx'}",
        f"--features={args.features or w / 'feats'}",
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
        subprocess.run([py, "-m", "teragram.serve.main", "train", *common, f"--out={out}", *extra], cwd=repo, check=True, env=env)
        tps, n = rate(out / "log.jsonl", args.warmup_steps)
        data[name] = {"tokens_per_s": tps, "timed_steps": n, "gpus": 1}
        rows.append({"variant": name, "GPUs": 1, "tokens/s": tps, "vs 521k reference": tps / 521e3})
    if torch.cuda.device_count() >= 2:
        out = w / "ddp"
        subprocess.run(["rm", "-rf", str(out)])
        subprocess.run(
            [
                py,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "-m",
                "teragram.serve.main",
                "train",
                *common,
                f"--out={out}",
            ],
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


def main() -> int:
    if "--smoke" in sys.argv[1:]:
        return smoke()
    args = parse_args()
    w = Path(args.work)
    prepare(w, args.index, args.features)
    if args.suite == "features":
        return features_suite(args, w)
    return index_suite(args, w)


if __name__ == "__main__":
    sys.exit(main())
