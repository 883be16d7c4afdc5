"""GPU memory of the training settings of issue 16 (run on the lent H200).

    python -m benchmarks.train_memory [--shape 125m] [--batch-size 16] [--cap-gib 8]

1. Per setting (none, recompute attn, recompute block, CPU offload), one process, random tokens,
   the plain GPT (no index inputs: memory of the block stack is what the settings change):
   weights + optimizer state resident on the GPU, the optimizer state alone, the peak of one
   forward + backward above that (activations and gradients) and the gradients, from
   torch.cuda.memory_allocated / max_memory_allocated; and the step time.
2. ZeRO-1 (with two or more GPUs): two processes under torchrun, DDP with plain AdamW vs ZeRO-1;
   optimizer state bytes per rank and tokens/s.
3. Offload under a cap: torch.cuda.set_per_process_memory_fraction limits this process to
   --cap-gib; a ~730M-parameter model (24 layers, 1536 dims) whose fp32 weights, gradients and
   Adam moments need ~11.7 GB trains a few steps with offload = optimizer and fails without.
   Each case runs in its own process (the cap and an out-of-memory state stay there).

Writes benchmarks/results/train_memory.{json,md,png}. `--settings none,block` measures only
those parts (of none, attn, block, offload, zero1, cap) and writes train_memory-none-block.*
instead. `--tiny` runs everything small on CPU (no memory figures there) to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import save, smoke_context, table

VOCAB = 32000
CAP_SHAPE = dict(n_layer=24, n_head=16, n_embd=1536)
SETTINGS = {  # part 1's settings: (table name, build's keywords)
    "none": ("none", {}),
    "attn": ("recompute attn", {"recompute": "attn"}),
    "block": ("recompute block", {"recompute": "block"}),
    "offload": ("offload optimizer", {"offload": True}),
}
PARTS = (*SETTINGS, "zero1", "cap")


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def optimizer_gpu_bytes(opt, cuda: bool = True) -> int:
    """Bytes of optimizer state held on a GPU (ZeRO-1: this rank's shard); cuda=False: anywhere."""
    import torch

    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer wraps the local optimizer
    if not hasattr(inner, "state"):
        return 0  # CPU offload: the state is in CPU memory
    return sum(_bytes([v]) for st in inner.state.values() for v in st.values() if torch.is_tensor(v) and (v.is_cuda or not cuda))


def build(
    shape: dict,
    *,
    recompute: str = "none",
    recompute_blocks: int = 0,
    offload: bool = False,
    zero1: bool = False,
    device: str = "cuda",
    block: int = 1024,
):
    import torch
    from teragram.model.gpt import GPT, GPTConfig
    from teragram.model.training import optim

    cfg = GPTConfig(vocab_size=VOCAB, block_size=block, use_index=False, mixture=False, **shape)
    model = GPT(cfg).to(device)
    model.set_recompute(recompute, recompute_blocks)
    cuda = device.startswith("cuda")
    opt = optim.build(model, lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), cuda=cuda, zero1=zero1, offload=offload)
    if offload and cuda:
        model.to(torch.bfloat16)
    return model, opt


def step(model, opt, fwd, B: int, T: int, device: str, gen) -> None:
    import torch

    x = torch.randint(0, VOCAB, (B, T), generator=gen).to(device)
    y = torch.randint(0, VOCAB, (B, T), generator=gen).to(device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
        loss, _ = fwd(x, y)
    loss.mean().backward()
    if hasattr(opt, "masters"):
        opt.step(1.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    opt.zero_grad(set_to_none=True)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_setting(shape: dict, B: int, T: int, device: str, steps: int, **kw) -> dict:
    import torch

    cuda = device.startswith("cuda")
    model, opt = build(shape, device=device, block=T, **kw)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # the optimizer state exists after the first step
        step(model, opt, model, B, T, device, gen)
    _sync(device)
    r = {}
    if cuda:
        static = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        x = torch.randint(0, VOCAB, (B, T), generator=gen).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(x, x)
        loss.mean().backward()
        torch.cuda.synchronize()
        grads = _bytes(p.grad for p in model.parameters() if p.grad is not None)
        peak = torch.cuda.max_memory_allocated() - static
        opt.zero_grad(set_to_none=True)
        r = {
            "weights_and_optimizer_gib": static / 2**30,
            "optimizer_gib": optimizer_gpu_bytes(opt) / 2**30,
            "fwd_bwd_peak_gib": peak / 2**30,
            "gradients_gib": grads / 2**30,
            "activations_peak_gib": (peak - grads) / 2**30,
        }
    t = time.time()
    for _ in range(steps):
        step(model, opt, model, B, T, device, gen)
    _sync(device)
    r["step_s"] = (time.time() - t) / steps
    r["tokens_per_s"] = B * T / r["step_s"]
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return r


def zero1_worker(out: str, shape: dict, B: int, T: int, steps: int) -> None:
    """Under torchrun: DDP + AdamW vs DDP + ZeRO-1; rank 0 writes per-rank optimizer bytes and tokens/s."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    res = {}
    for zero1 in (False, True):
        model, opt = build(shape, device=device, block=T, zero1=zero1)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if cuda else None)
        gen = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(2):
            step(model, opt, ddp, B, T, device, gen)
        _sync(device)
        mine = torch.tensor([optimizer_gpu_bytes(opt, cuda)], dtype=torch.float64, device=device)
        per_rank = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(per_rank, mine)
        dist.barrier()
        t = time.time()
        for _ in range(steps):
            step(model, opt, ddp, B, T, device, gen)
        _sync(device)
        dt = (time.time() - t) / steps
        res["zero1" if zero1 else "ddp"] = {
            "optimizer_gib_per_rank": [float(v) / 2**30 for v in per_rank],
            "tokens_per_s": B * T * dist.get_world_size() / dt,
        }
        del model, opt, ddp
        if cuda:
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def cap_worker(offload: bool, cap_gib: float, B: int, T: int, steps: int) -> None:
    """One line of JSON: did the cap model train under the memory cap, and how fast."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total)
    r = {"offload": offload, "cap_gib": cap_gib}
    try:
        model, opt = build(CAP_SHAPE, recompute="block", offload=offload, block=T)
        r["params"] = sum(p.numel() for p in model.parameters())
        gen = torch.Generator().manual_seed(0)
        step(model, opt, model, B, T, "cuda", gen)
        torch.cuda.synchronize()
        t = time.time()
        for _ in range(steps):
            step(model, opt, model, B, T, "cuda", gen)
        torch.cuda.synchronize()
        r |= {"trained": True, "tokens_per_s": B * T * steps / (time.time() - t), "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    except torch.cuda.OutOfMemoryError as e:
        r |= {"trained": False, "error": "CUDA out of memory: " + str(e).split(".")[0][:120]}
    print(json.dumps(r), flush=True)


def smoke() -> int:
    """The tiny model on CPU, every setting a CPU has (zero1 and cap need GPUs)."""
    with smoke_context(True):
        sys.argv = [sys.argv[0], "--tiny", "--steps", "2", "--settings", "none,offload,block1"]
        return main()


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """The arguments and the parts to measure (a blockN part registered as a setting)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="125m")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per setting")
    ap.add_argument("--cap-gib", type=float, default=8.0)
    ap.add_argument("--settings", default=",".join(PARTS), help=f"what to measure, of {','.join(PARTS)} (default all)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU: checks the script, no memory figures")
    ap.add_argument("--zero1-worker", help=argparse.SUPPRESS)
    ap.add_argument("--cap-worker", choices=("none", "offload"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    parts = args.settings.split(",")
    for p in parts:  # blockN: recompute = block on the first N blocks only (selective)
        if p.startswith("block") and p[5:].isdigit():
            SETTINGS[p] = (f"recompute block, first {p[5:]} blocks", {"recompute": "block", "recompute_blocks": int(p[5:])})
    if unknown := set(parts) - set(PARTS) - set(SETTINGS):
        ap.error(f"unknown settings {', '.join(sorted(unknown))}; known: {', '.join(PARTS)}, blockN")
    return args, parts


def measure_settings(parts: list[str], shape: dict, B: int, T: int, device: str, steps: int) -> tuple[dict, list[dict]]:
    """1. Each setting named in parts (measure_setting); one that fails is recorded and the others
    go on: (results by setting, table rows)."""
    cuda = device.startswith("cuda")
    settings: dict = {}
    rows = []
    for name, kw in (SETTINGS[k] for k in parts if k in SETTINGS):
        try:
            r = measure_setting(shape, B, T, device, steps, **kw)
        except (RuntimeError, TypeError, ValueError) as e:  # recorded; the other settings go on
            settings[name] = {"error": str(e).splitlines()[0][:160]}
            rows.append({"setting": name, "note": settings[name]["error"]})
            continue
        settings[name] = r
        base = settings.get("none", {})
        if "step_s" not in base:
            base = r
        row = {"setting": name, "tokens/s": r["tokens_per_s"], "step vs none": r["step_s"] / base["step_s"]}
        if cuda:
            row |= {
                "weights+optimizer GiB": r["weights_and_optimizer_gib"],
                "optimizer GiB": r["optimizer_gib"],
                "activations GiB": r["activations_peak_gib"],
                "act. vs none": r["activations_peak_gib"] / base["activations_peak_gib"],
                "gradients GiB": r["gradients_gib"],
            }
        rows.append(row)
        print(name, r, flush=True)
    return settings, rows


def settings_md(rows: list[dict], shape: str, B: int, T: int) -> str:
    md = table(
        rows,
        [
            "setting",
            "weights+optimizer GiB",
            "optimizer GiB",
            "activations GiB",
            "act. vs none",
            "gradients GiB",
            "tokens/s",
            "step vs none",
        ],
    )
    return md + (
        f"\n\n{shape} shape, {B} sequences of {T} tokens, bf16 autocast, eager; activations = peak of one forward + backward "
        "above the resident weights and optimizer state, less the gradients. Bar (recompute block): activations <= 0.4x, step <= 1.35x."
    )


def zero1_part(args: argparse.Namespace, B: int, T: int, ngpu: int, repo: str) -> tuple[dict | None, str]:
    """2. ZeRO-1 against DDP, 2 ranks under torchrun (two GPUs, or --tiny on CPU): (its results,
    None when it could not run; its markdown)."""
    z = entry = None
    if ngpu >= 2 or args.tiny:
        out = Path("/tmp") / f"tg-zero1-{os.getpid()}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "benchmarks.train_memory"]
        cmd += ["--zero1-worker", str(out), "--steps", str(args.steps), "--batch-size", str(B), "--block-size", str(T)]
        r = subprocess.run(
            cmd + (["--tiny"] if args.tiny else ["--shape", args.shape]), cwd=repo, env=dict(os.environ, OMP_NUM_THREADS="1")
        )
        z = json.loads(out.read_text()) if r.returncode == 0 and out.exists() else None
        entry = z or {"error": f"the 2-rank run exited with {r.returncode}"}
    if not z:
        return entry, "\n\nZeRO-1: not measured (" + (entry["error"] if entry else "one GPU; the 2-rank measurement needs two") + ")."
    ratio = max(z["zero1"]["optimizer_gib_per_rank"]) / max(max(z["ddp"]["optimizer_gib_per_rank"]), 1e-12)
    speed = z["zero1"]["tokens_per_s"] / z["ddp"]["tokens_per_s"]
    md = "\n\n" + table(
        [{"2 ranks": k, "optimizer GiB per rank": max(v["optimizer_gib_per_rank"]), "tokens/s": v["tokens_per_s"]} for k, v in z.items()],
        ["2 ranks", "optimizer GiB per rank", "tokens/s"],
    )
    md += f"\n\nZeRO-1 vs DDP on 2 GPUs: optimizer memory per rank {ratio:.2f}x (bar <= 0.55x), tokens/s {speed:.2f}x (bar >= 0.95x)."
    return entry, md


def cap_part(cap_gib: float, repo: str) -> tuple[list[dict], str]:
    """3. The cap model without and with offload, each in a process of its own: (results, markdown)."""
    caps = []
    for mode in ("none", "offload"):
        r = subprocess.run(
            [sys.executable, "-m", "benchmarks.train_memory", "--cap-worker", mode, "--cap-gib", str(cap_gib)],
            cwd=repo,
            capture_output=True,
            text=True,
        )
        line = [x for x in r.stdout.splitlines() if x.startswith("{")]
        caps.append(json.loads(line[-1]) if line else {"offload": mode == "offload", "trained": False, "error": r.stderr.strip()[-200:]})
    md = "\n\n" + table(
        [
            {
                "offload": c["offload"],
                "trained": c["trained"],
                "tokens/s": c.get("tokens_per_s", ""),
                "peak GiB": c.get("peak_gib", ""),
                "error": c.get("error", ""),
            }
            for c in caps
        ],
        ["offload", "trained", "tokens/s", "peak GiB", "error"],
    )
    n = next((c["params"] for c in caps if "params" in c), 0)
    md += (
        f"\n\nUnder a {cap_gib:g} GiB cap (set_per_process_memory_fraction): a {n / 1e6:.0f}M-parameter model (24 layers, 1536 dims, "
        "recompute block, 2 x 1024 tokens per step) whose fp32 weights + gradients + Adam moments need "
        f"{16 * n / 2**30:.1f} GiB."
    )
    return caps, md


def report(data: dict, md: str, parts: list[str], cuda: bool) -> None:
    """The plot, and benchmarks/results/train_memory.* (train_memory-PARTS.* for some parts only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.6))
    key = "activations_peak_gib" if cuda else "step_s"
    ok = {k: v for k, v in data["settings"].items() if key in v}
    ax.barh(list(ok), [v[key] for v in ok.values()])
    ax.invert_yaxis()
    ax.set_xlabel("activation peak (GiB)" if cuda else "step (s)")
    save("train_memory" if set(parts) == set(PARTS) else "-".join(["train_memory", *parts]), data, md, fig)


def main() -> int:
    if "--smoke" in sys.argv[1:]:
        return smoke()
    args, parts = parse_args()
    import torch
    from teragram.model.gpt import GPTConfig

    p = GPTConfig.preset("tiny" if args.tiny else args.shape)
    shape = dict(n_layer=p.n_layer, n_head=p.n_head, n_embd=p.n_embd)
    B, T = (4, 64) if args.tiny else (args.batch_size, args.block_size)
    if args.zero1_worker:
        zero1_worker(args.zero1_worker, shape, B, T, args.steps)
        return 0
    if args.cap_worker:
        cap_worker(args.cap_worker == "offload", args.cap_gib, 2, T, 3)
        return 0
    cuda = torch.cuda.is_available() and not args.tiny
    data: dict = {"shape": args.shape if not args.tiny else "tiny", "batch_size": B, "block_size": T}
    data["settings"], rows = measure_settings(parts, shape, B, T, "cuda" if cuda else "cpu", args.steps)
    md = settings_md(rows, data["shape"], B, T)
    repo = str(Path(__file__).resolve().parents[1])
    if "zero1" in parts:
        z, zero1_md = zero1_part(args, B, T, torch.cuda.device_count() if cuda else 0, repo)
        if z is not None:
            data["zero1_2ranks"] = z
        md += zero1_md
    if cuda and "cap" in parts:
        data["cap"], cap_md = cap_part(args.cap_gib, repo)
        md += cap_md
    report(data, md, parts, cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())
