"""A native run against its `transformers` export: `teragram export --hf`, then the product path
(`eval --fit-gate` on validation text, `eval --gate` on each held-out set) through `--checkpoint`
and through `--hf-model`, each command a fresh process as a user runs it. Per set: the model's
perplexity alone and gated, native against transformers (the bar: within 0.1%), and each path's
tokens per second in the model's stage (`eval --json`'s stages_s.model: the forward passes).

    python -m benchmarks.hf_model --run RUN --index IDX --valid VALID --sets NAME=DIR ... \\
        [--device cpu|cuda] [--dtypes float32,bfloat16] [--name hf_model_cpu]

On a GPU the transformers model runs in each of --dtypes (default bfloat16 and float32: bfloat16
is what its users run, float32 what compares exactly), the native one under its autocast. Needs
torch, transformers and the index; no lmdb, faiss or fastapi. Writes NAME.{json,md,png} under
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import SMOKE_HELP, save, smoke_context, smoke_corpus, smoke_index, smoke_model, table

BAR = 0.001  # the transformers path's gated perplexity within 0.1% of the native one's


def teragram(*args) -> tuple[dict | None, float]:
    """A `teragram` command in a fresh process: (its --json answer, or None; wall seconds)."""
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "teragram.serve.main", *map(str, args)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"teragram {' '.join(map(str, args))} failed: {r.stderr.strip()[-2000:]}")
    wall = time.perf_counter() - t
    return (json.loads(r.stdout) if "--json" in args else None), wall


def run_path(name: str, model_args: list, index: Path, valid: Path, sets: dict, out: Path, device: str, fit_rows: int) -> list[dict]:
    """The product path through one model: the gate fit on valid (on at most fit_rows tokens), applied to each set."""
    gate = out / f"gate-{name}.json"
    rows = []
    common = ["--index", index, "--device", device, "--quiet", "--json"]
    for set_name, corpus in [("valid", valid), *sets.items()]:
        how = ["--fit-gate", gate, "--fit-rows", fit_rows] if set_name == "valid" else ["--gate", gate]
        r, wall = teragram("eval", *model_args, *common, "--corpus", corpus, *how)
        model_s = r["stages_s"]["model"]
        rows.append(
            {
                "path": name,
                "set": set_name,
                "tokens": r["tokens"],
                "model_perplexity": r["model"]["perplexity"],
                "gated_perplexity": r["perplexity"],
                "gate": r.get("gate_choice", {}).get("chosen"),
                "model_s": model_s,
                "tokens_per_s": r["tokens"] / model_s if model_s else float("nan"),
                "wall_s": wall,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def compare(rows: list[dict]) -> list[dict]:
    """Per set and transformers path: the relative differences from the native path."""
    native = {r["set"]: r for r in rows if r["path"] == "native"}
    out = []
    for r in rows:
        if r["path"] == "native":
            continue
        n = native[r["set"]]
        gated = r["gated_perplexity"] / n["gated_perplexity"] - 1
        out.append(
            {
                "set": r["set"],
                "path": r["path"],
                "native gated": f"{n['gated_perplexity']:.4f}",
                "transformers gated": f"{r['gated_perplexity']:.4f}",
                "gated rel. diff": f"{gated:+.2e}",
                "model alone rel. diff": f"{r['model_perplexity'] / n['model_perplexity'] - 1:+.2e}",
                "within 0.1%": "yes" if abs(gated) <= BAR else "no",
                "native tok/s": f"{n['tokens_per_s']:,.0f}",
                "transformers tok/s": f"{r['tokens_per_s']:,.0f}",
            }
        )
    return out


def plot(rows: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sets = list(dict.fromkeys(r["set"] for r in rows))
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    w = 0.8 / len(paths)
    for j, p in enumerate(paths):
        by = {r["set"]: r for r in rows if r["path"] == p}
        x = np.arange(len(sets)) + j * w
        axes[0].bar(x, [by[s]["gated_perplexity"] for s in sets], w, label=p)
        axes[1].bar(x, [by[s]["tokens_per_s"] for s in sets], w, label=p)
    for ax, title in zip(axes, ("gated perplexity (lower is better)", "model stage, tokens/s")):
        ax.set_xticks(np.arange(len(sets)) + 0.4 - w / 2, sets)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle("The native model and its transformers export through the same product path")
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, help="the native run (a plain model of the gpt2 block)")
    p.add_argument("--index", type=Path)
    p.add_argument("--valid", type=Path, help="validation text: the gates are fit on it")
    p.add_argument("--sets", nargs="+", default=[], metavar="NAME=DIR", help="held-out sets the gates are applied to")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", help="the transformers model's dtypes (default: float32 on a CPU, bfloat16,float32 on a GPU)")
    p.add_argument("--fit-rows", type=int, default=200_000, help="eval --fit-rows (default 200,000, eval's own)")
    p.add_argument("--name", default="hf_model_cpu")
    p.add_argument("--out", type=Path, help="where the export and the gates go (default: RUN/hf-bench)")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args(argv)
    with smoke_context(args.smoke) as tmp:
        if args.smoke:
            held = smoke_corpus(tmp, heldout=True)
            args.run, args.index, args.valid = smoke_model(tmp), smoke_index(tmp), held / "valid"
            args.sets, args.out, args.fit_rows = [], tmp / "hf-bench", 1000  # the gates fit on valid and compared there
        if not (args.run and args.index and args.valid):
            p.error("give --run, --index and --valid (or --smoke)")
        sets = dict(s.split("=", 1) for s in args.sets)
        out = args.out or args.run / "hf-bench"
        out.mkdir(parents=True, exist_ok=True)
        _, export_s = teragram("export", "--hf", out / "hf", "--checkpoint", args.run, "--index", args.index)
        dtypes = (args.dtypes or ("bfloat16,float32" if args.device.startswith("cuda") else "float32")).split(",")
        paths = [("native", ["--checkpoint", args.run])] + [
            (f"transformers {dt}", ["--hf-model", out / "hf", "--dtype", dt]) for dt in dtypes
        ]
        rows = [row for name, how in paths for row in run_path(name, how, args.index, args.valid, sets, out, args.device, args.fit_rows)]
        cmp = compare(rows)
        md = table(cmp, list(cmp[0]))
        md += f"\n\nExport: {export_s:.1f} s (a fresh process). Tokens/s: the model's stage of `eval` (its forward passes), per path."
        save(args.name, {"export_s": export_s, "device": args.device, "rows": rows, "comparison": cmp, "bar": BAR}, md, plot(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
