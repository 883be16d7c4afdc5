"""The dense store of every training position, searched as the kNN-LM searches it (Khandelwal et
al., 2020): keys are a model's states at every training position of an index's shards (float16,
centred, in device memory: ~72 GB for 47M positions of a 125M model), values the next tokens.
Which states (KEY_STATES) is chosen on validation (the joint recipe's kNN stage). The search is
an inverted file (k-means centroids, each query probing the nearest few lists, as FAISS's IVF)
with exact float32 distances to the probed keys, so that the store built twice from the same
model and index answers the same. The estimates made from its neighbours are in knn.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
from teragram.index.errors import TeragramError

CENTROIDS = 4096  # the paper's inverted lists
NPROBE = 32  # lists probed per query (the paper's 32)
KMEANS_SAMPLE = 1_000_000  # keys the centroids are fit on
KMEANS_ITERS = 20
QUERY_CHUNK = 131_072  # queries searched at once (their 1024 neighbours each stay in GPU memory)
SEED = 20261201
KEY_STATES = ("final", "ffn_in")  # ln_f's output; the last block's ln_2 output (the FFN's input: Khandelwal et al.'s keys)


def train_windows(n: int, T: int) -> list[tuple[int, int]]:
    """(start, first kept target) of windows of T + 1 tokens over a stream of n tokens, so that
    every target position 1..n-1 is predicted exactly once: consecutive windows, the last one
    moved back to end at the stream's end and keeping only targets not seen before."""
    if n < 2:
        return []
    if n <= T + 1:
        return [(0, 0)]
    out = [(a, 0) for a in range(0, n - T - 1, T)]
    last = n - T - 1
    done = out[-1][0] + T  # targets 1..done are covered
    if done < n - 1:
        out.append((last, done - last))  # window row j predicts position last + 1 + j
    return out


def _windows_of(tokens: np.ndarray, T: int, sep: int, eos: int):
    for a, keep in train_windows(len(tokens), T):
        w = np.asarray(tokens[a : a + T + 1]).astype(np.int64)
        w[w == sep] = eos
        yield w[:-1], w[1:], keep


def kmeans(x, k: int, iters: int, seed: int):
    """Lloyd's k-means (float32) from k distinct random points; an empty cluster keeps its centroid."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    c = x[torch.randperm(len(x), generator=g)[:k].to(x.device)].clone()
    for _ in range(iters):
        a = assign(x, c)
        s = torch.zeros_like(c).index_add_(0, a, x)
        n = torch.bincount(a, minlength=len(c)).to(x.dtype)
        c = torch.where(n[:, None] > 0, s / n.clamp_min(1)[:, None], c)
    return c


def assign(x, c, chunk: int = 65536):
    """The nearest centroid of each row of x."""
    import torch

    cn = (c * c).sum(1)
    return torch.cat([(cn[None] - 2 * x[a : a + chunk] @ c.T).argmin(1) for a in range(0, len(x), chunk)])


@contextmanager
def _tf32():
    """The store's float32 matmuls in TF32 (k-means, assignment, search): the keys are fp16, so
    TF32's 10-bit inputs lose nothing more; the sums stay float32."""
    import torch

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


@contextmanager
def key_states(model, key: str):
    """Within it, a list that receives the `key` states (B, T, C) of each forward of `model`
    (KEY_STATES: "final", the output of ln_f, as GPT.hidden returns it; "ffn_in", the output of
    the last block's ln_2, its feed-forward's input)."""
    if key not in KEY_STATES:
        raise TeragramError(f"kNN keys {key!r}: one of {', '.join(KEY_STATES)}")
    mod = model.transformer.ln_f if key == "final" else model.transformer.h[-1].ln_2
    got: list = []
    hook = mod.register_forward_hook(lambda m, i, o: got.append(o))
    try:
        yield got
    finally:
        hook.remove()


def states(model, x, key: str):
    """The `key` states (B, T, C) of windows x (B, T) under `model` (no gradient)."""
    import torch

    with torch.no_grad(), key_states(model, key) as got:
        model.hidden(x)
    return got[-1]


class Datastore:
    """Keys (N, C) float16, centred on mu, their values (N,) int32, and an inverted file: the
    keys' ids grouped by nearest centroid (ids[off[c]:off[c+1]] are list c)."""

    @_tf32()
    def __init__(self, keys, vals, *, centroids: int = CENTROIDS, sample: int = KMEANS_SAMPLE, iters: int = KMEANS_ITERS, seed: int = SEED):
        import torch

        self.keys, self.vals = keys, vals
        g = torch.Generator(device="cpu").manual_seed(seed)
        rows = torch.randperm(len(keys), generator=g)[: min(sample, len(keys))].to(keys.device)
        self.cent = kmeans(keys[rows].float(), min(centroids, len(rows)), iters, seed)
        a = torch.cat([assign(keys[s : s + (1 << 20)].float(), self.cent) for s in range(0, len(keys), 1 << 20)])
        self.ids = torch.argsort(a, stable=True)
        self.off = torch.cat([torch.zeros(1, dtype=torch.long, device=a.device), torch.bincount(a, minlength=len(self.cent)).cumsum(0)])
        self.kn = torch.cat([(keys[s : s + (1 << 22)].float() ** 2).sum(1) for s in range(0, len(keys), 1 << 22)])

    @_tf32()
    def exact(self, q, k: int, chunk: int = 1 << 20):
        """(squared distances, ids) of the k nearest keys by brute force (float32)."""
        import torch

        qn = (q * q).sum(1, keepdim=True)
        best_d = torch.full((len(q), 0), float("inf"), device=q.device)
        best_i = torch.zeros((len(q), 0), dtype=torch.long, device=q.device)
        for s in range(0, len(self.keys), chunk):
            d = qn + self.kn[s : s + chunk][None] - 2 * q @ self.keys[s : s + chunk].float().T
            dv, dj = torch.topk(d, min(k, d.shape[1]), dim=1, largest=False)
            best_d, j = torch.topk(torch.cat([best_d, dv], 1), min(k, best_d.shape[1] + dv.shape[1]), dim=1, largest=False)
            best_i = torch.gather(torch.cat([best_i, dj + s], 1), 1, j)
        return best_d, best_i

    @_tf32()
    def search(self, q, k: int, nprobe: int = NPROBE, max_elems: int = 1 << 29, qdoc=None, kdoc=None):
        """(squared distances, ids) of the k nearest keys among the nprobe nearest lists of each
        query (ids -1 and distance inf where fewer than k keys were probed). All queries go at
        once: one pass over the lists, each scored against the queries probing it. With qdoc
        (nq,) and kdoc (N,), document numbers, a query's own document's keys are left out."""
        import torch

        nq = len(q)
        npr = min(nprobe, len(self.cent))
        probe = torch.cat(  # (nq, nprobe), 2^17 queries' centroid scores at a time
            [torch.topk(assign_scores(q[a : a + (1 << 17)], self.cent), npr, dim=1, largest=False).indices for a in range(0, nq, 1 << 17)]
        )
        lists = probe.reshape(-1)
        order = torch.argsort(lists, stable=True)
        qof = (order // probe.shape[1]).contiguous()  # query of each (list, query) pair, grouped by list
        bounds = torch.cat(
            [torch.zeros(1, dtype=torch.long, device=q.device), torch.bincount(lists, minlength=len(self.cent)).cumsum(0)]
        ).tolist()
        off = self.off.tolist()
        qn = (q * q).sum(1)
        best_d = torch.full((nq, k), float("inf"), device=q.device)
        best_i = torch.full((nq, k), -1, dtype=torch.long, device=q.device)
        for c in range(len(self.cent)):
            if bounds[c] == bounds[c + 1] or off[c] == off[c + 1]:
                continue
            ids = self.ids[off[c] : off[c + 1]]
            kc = self.keys[ids].float()
            knc = self.kn[ids][None]
            kdc = kdoc[ids][None] if qdoc is not None else None
            qs_all = qof[bounds[c] : bounds[c + 1]]
            step = max(1, max_elems // len(ids))
            for a in range(0, len(qs_all), step):
                qs = qs_all[a : a + step]
                d = torch.addmm(knc, q[qs], kc.T, alpha=-2)  # |k|^2 - 2 q.k: the ranking; |q|^2 added to the k kept
                if kdc is not None:
                    d.masked_fill_(qdoc[qs][:, None] == kdc, float("inf"))
                kk = min(k, d.shape[1])
                dv, dj = torch.topk(d, kk, dim=1, largest=False)
                dv = dv + qn[qs][:, None]
                md, mj = torch.topk(torch.cat([best_d[qs], dv], 1), k, dim=1, largest=False)
                best_i[qs] = torch.gather(torch.cat([best_i[qs], torch.where(torch.isfinite(dv), ids[dj], -1)], 1), 1, mj)
                best_d[qs] = md
        return best_d, best_i

    def neighbours(self, q, k: int, nprobe: int = NPROBE, **kw):
        """search's squared distances and the neighbours' values (-1 where there is none)."""
        import torch

        d, i = self.search(q, k, nprobe, **kw)
        return d, torch.where(i >= 0, self.vals[i.clamp_min(0)].long(), -1)


def queries(hidden: np.ndarray, rows, mu, device: str):
    """Held-out hidden states (rows of them) as queries: float32 on device, centred as the keys are."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(hidden[rows], np.float32)).to(device) - mu


def assign_scores(q, c):
    """Squared distances (up to a per-query constant) of queries to centroids."""
    return (c * c).sum(1)[None] - 2 * q @ c.T


def build(model, index_dir: Path, device: str, batch: int = 64, key: str = "final", every: int = 1):
    """The datastore of every training position of the index's shards under `model`: keys are
    its `key` states (float16, centred), values the next tokens (every > 1: the positions of
    every every-th window only, a sample)."""
    import torch
    from teragram.index import format as fmt

    m = fmt.read_json(Path(index_dir) / "manifest.json")
    sep, eos = m["separator"], m["tokenizer"]["eos_id"]
    T = model.cfg.block_size
    toks = [fmt.open_array(fmt.shard_dir(Path(index_dir), s["shard"], s.get("dir")) / "tokens.bin", "tokens") for s in m["shards"]]
    N = sum(max(len(t) - 1, 0) for t in toks)
    if every > 1:  # at most a window's T more per shard (its last, moved back), one window more in all
        N = (N + len(toks) * T) // every + T
    C = model.cfg.n_embd
    keys = torch.empty((N, C), dtype=torch.float16, device=device)
    vals = torch.empty(N, dtype=torch.int32, device=device)
    model.eval()
    cuda = str(device).startswith("cuda")
    mu = None
    n = 0
    buf: list = []

    def flush():
        nonlocal n, mu
        x = torch.from_numpy(np.stack([b[0] for b in buf])).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            h = states(model, x, key).float()
        if mu is None:
            mu = h.reshape(-1, C).mean(0)  # any vector gives the same distances; centring keeps fp16 precise
        for j, (_, y, keep) in enumerate(buf):
            r = len(y) - keep
            keys[n : n + r] = (h[j, keep:] - mu).half()
            vals[n : n + r] = torch.from_numpy(y[keep:]).to(device, torch.int32)
            n += r
        buf.clear()

    w = 0
    for t in toks:
        for x, y, keep in _windows_of(t, T, sep, eos):
            if len(x) < T:  # a stream shorter than a window
                continue
            w += 1
            if (w - 1) % every:
                continue
            buf.append((x, y, keep))
            if len(buf) == batch:
                flush()
    if buf:
        flush()
    return keys[:n], vals[:n], mu
