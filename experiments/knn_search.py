"""One inverted list's step of the kNN store's search (model/mixture/knn.Datastore.search) at the joint
recipe's shapes, each operation timed alone, with the alternatives a faster search would use.

The training positions' search is what a joint run waits on (27 s per 2M-query chunk, 23 chunks
on the H200); its profile (results/knn_search_profile.txt) puts 43% of the GPU time in topk, 41%
in the TF32 GEMM and 13% in the exclude-doc mask. Per list, today: the list's float16 keys
gathered and made float32, |k|^2 - 2 q.k by a TF32 addmm, the query's own document masked, the k
nearest by topk. Measured here on random keys and queries of the recipe's sizes (a list of ~11.5k
of 47M keys, probed by ~15.6k of 2M queries):
  - the GEMM in TF32 (today), in full float32, and from float16 queries and keys with float32
    accumulation and output (TF32 keeps 10 bits of mantissa, as float16 does);
  - topk sorted (today) and unsorted, and on float16 distances;
  - the mask as today (eq, then masked_fill) and as one torch.where.
Each GEMM's k nearest are compared with float64's: the share of them among float64's.

    python -m experiments.knn_search [--queries 15600 --keys 11500 --dim 768 --k 64]
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.common import EXPERIMENT_RESULTS, save, smoke_context, table


def _timed(f, reps: int, cuda: bool):
    import torch

    out = f()  # warm-up (and the result)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3, out


def measure(nq: int, L: int, C: int, k: int, reps: int, device: str) -> dict:
    import torch

    cuda = device.startswith("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    keys16 = (torch.randn(L, C, generator=g) * 0.5).half().to(device)  # the store's keys: float16, centred
    q = (torch.randn(nq, C, generator=g) * 0.5).to(device)
    kn = (keys16.float() ** 2).sum(1)[None]
    ms, err, d = {}, {}, {}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        ms["gemm tf32, keys made float32 (today)"], d["tf32"] = _timed(lambda: torch.addmm(kn, q, keys16.float().T, alpha=-2), reps, cuda)
        torch.backends.cuda.matmul.allow_tf32 = False
        ms["gemm float32"], d["float32"] = _timed(lambda: torch.addmm(kn, q, keys16.float().T, alpha=-2), reps, cuda)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    q16 = q.half()
    try:
        ms["gemm float16 in, float32 out (k.k added in a second pass)"], d["float16"] = _timed(
            lambda: kn - 2 * torch.mm(q16, keys16.T, out_dtype=torch.float32), reps, cuda
        )
    except (RuntimeError, TypeError, NotImplementedError) as e:  # mm's out_dtype: CUDA only
        err["gemm float16 in, float32 out (k.k added in a second pass)"] = str(e).splitlines()[0][:200]
    ref = torch.addmm(kn.double(), q.double(), keys16.double().T, alpha=-2)
    near = torch.zeros(ref.shape, dtype=torch.bool, device=device).scatter_(1, torch.topk(ref, k, 1, largest=False).indices, True)
    del ref
    same = {name: float(near.gather(1, torch.topk(x, k, 1, largest=False).indices).float().mean()) for name, x in d.items()}
    del near
    x = d["tf32"]
    ms["topk sorted (today)"], _ = _timed(lambda: torch.topk(x, k, 1, largest=False), reps, cuda)
    ms["topk unsorted"], _ = _timed(lambda: torch.topk(x, k, 1, largest=False, sorted=False), reps, cuda)
    x16 = x.half()
    ms["topk of float16 distances"], _ = _timed(lambda: torch.topk(x16, k, 1, largest=False), reps, cuda)
    qdoc = torch.randint(0, 1000, (nq,), generator=g).to(device)
    kdoc = torch.randint(0, 1000, (L,), generator=g).to(device)
    inf = torch.tensor(float("inf"), device=device)
    ms["mask: eq + masked_fill (today)"], _ = _timed(lambda: x.masked_fill_(qdoc[:, None] == kdoc[None], float("inf")), reps, cuda)
    ms["mask: one torch.where"], _ = _timed(lambda: torch.where(qdoc[:, None] == kdoc[None], inf, x), reps, cuda)
    return {"ms": ms, "errors": err, "same_neighbours_as_float64": same}


def main(argv: list[str] | None = None) -> int:
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):  # every operation on tiny shapes, CPU
        with smoke_context(True):
            return main(["--queries", "64", "--keys", "128", "--dim", "16", "--k", "4", "--reps", "1"])
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=15_600, help="queries probing the list (2M x 32 probes / 4,096 lists)")
    ap.add_argument("--keys", type=int, default=11_500, help="keys in the list (47M / 4,096)")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--name", default="knn_search")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    r = measure(a.queries, a.keys, a.dim, a.k, a.reps, device)
    r |= {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    r |= {"shapes": {"queries": a.queries, "keys": a.keys, "dim": a.dim, "k": a.k}, "reps": a.reps}
    rows = [{"operation": op, "ms": f"{t:.3f}"} for op, t in r["ms"].items()]
    rows += [{"operation": op, "ms": f"failed: {e}"} for op, e in r["errors"].items()]
    md = (
        f"One inverted list's search step on {r['device']} (torch {r['torch']}): {a.queries:,} queries x {a.keys:,} keys of {a.dim},"
        f" k = {a.k}; mean of {a.reps} after a warm-up.\n\n"
        + table(rows, ["operation", "ms"])
        + "\n\nThe share of each GEMM's k nearest among float64's: "
        + ", ".join(f"{n} {s:.4f}" for n, s in r["same_neighbours_as_float64"].items())
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(list(r["ms"]), list(r["ms"].values()))
    ax.invert_yaxis()
    ax.set_xlabel("ms per list")
    ax.set_title(f"one list's search step, {r['device']}")
    save(a.name, r, md, fig, results=EXPERIMENT_RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
