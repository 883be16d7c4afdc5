"""The dense store of every training position, searched as the kNN-LM searches it (Khandelwal et
al., 2020), and its estimate as a component of the joint gate (model/mixture/joint.py's dense_knn).

Keys are a model's states at every training position of an index's shards (float16, centred, in
device memory: ~72 GB for 47M positions of a 125M model on the H200), values the next tokens. Which
states (KEY_STATES) is chosen on validation (benchmarks/knnlm.choose_key): the final hidden state,
what the head reads, or the paper's, the last block's feed-forward input after its layer norm.
The search is an inverted file (k-means centroids, each query probing the nearest few lists, as
FAISS's IVF) with exact float32 distances to the probed keys, so that the store built
twice from the same model and index answers the same. benchmarks/knnlm.py measures the kNN-LM
peer with it and writes the dense_knn estimates of training positions (exclude-doc) and held-out
text in bulk; `KnnSource` gives the same estimate live (`teragram sample/serve --knn-keys`) and in
bulk for `teragram eval`, with the settings a jointly trained model keeps (GPTConfig.joint_knn).
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
K_JOINT = 64  # neighbours of the joint gate's kNN estimate (its p(target) against k = 1024's is measured: knn_est.json)
KEY_STATES = ("final", "ffn_in")  # ln_f's output; the last block's ln_2 output (the FFN's input: Khandelwal et al.'s keys)
DIST_EDGES = np.geomspace(0.02, 20.0, 19)  # the nearest distance / scale: the estimate's buckets 1..20 (0: no neighbour)
# the joint gate's dense components (model/mixture/joint.DENSE, in its order): the kNN estimate at the temperature fit on
# validation times these, so that the gate chooses per token how sharp it is (benchmarks/gate_headroom.py's (t+knn3):
# the post-hoc gate over (a)'s estimate at three temperatures against the one fit on validation)
MULTIPLES = (1.0, 0.5, 2.5)


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


def knn_target_probs(d, nb_vals, target, temps):
    """p_knn(target) (n, len(temps)): softmax(-d / T) over the neighbours, summed where the
    neighbour's value is the target (missing neighbours: d = inf, weight 0)."""
    import torch

    hit = (nb_vals == target[:, None]).float()
    out = []
    for t in temps:
        w = torch.softmax(-d / t, dim=1)
        out.append((w * hit).sum(1))
    return torch.nan_to_num(torch.stack(out, 1))  # no neighbour at all: 0


def cache_target_probs(hidden: np.ndarray, target: np.ndarray, doc: np.ndarray, temps, device: str = "cpu", block: int = 2048):
    """The continuous cache (Grave et al., 2017) over a text's own states, with the kNN-LM's
    distance: per predicted token i, p(target_i) = softmax over the earlier predicted tokens j of
    its document of -||h_i - h_j||^2 / T, summed where target_j == target_i (j's next token, known
    at i). Rows are token_eval's (a document's in order); one float32 column per temperature of
    `temps`, 0 at a document's first token."""
    import torch

    out = np.zeros((len(target), len(temps)), np.float32)
    for a, b in _runs(doc):
        h = torch.from_numpy(np.asarray(hidden[a:b], np.float64)).to(device)  # float64: exact enough for the nearest, fast on an H200
        n2 = (h * h).sum(1)
        t = torch.from_numpy(target[a:b].astype(np.int64)).to(device)
        for qa in range(1, b - a, block):  # the first row has nothing before it
            qb = min(qa + block, b - a)
            d = (n2[qa:qb, None] + n2[None, :qb] - 2 * h[qa:qb] @ h[:qb].T).clamp_min(0)
            later = torch.arange(qb, device=device)[None] >= torch.arange(qa, qb, device=device)[:, None]
            d = d.masked_fill(later, float("inf"))
            hit = (t[:qb][None] == t[qa:qb, None]).float()
            for c, temp in enumerate(temps):
                out[a + qa : a + qb, c] = (torch.softmax(-d / temp, dim=1) * hit).sum(1).cpu().numpy()
    return out


def _runs(doc) -> list[tuple[int, int]]:
    """(start, end) of each document's rows; refused unless each document's rows are one run."""
    doc = np.asarray(doc)
    cuts = np.flatnonzero(np.diff(doc)) + 1
    runs = list(zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [len(doc)]]).tolist(), strict=True)) if len(doc) else []
    if len({int(doc[a]) for a, _ in runs}) != len(runs):
        raise ValueError("a document's rows come in one run, in order")
    return runs


def doc_neighbours(h, doc, vals, k: int, max_elems: int = 1 << 28):
    """The continuous cache's neighbours (dense_cache): per row i, the k nearest (squared distance,
    float64) among the earlier rows j < i of its own document, and their values (j's next token,
    known at i): the kNN estimate over the document's own states, as Grave et al.'s (2017) cache
    over its hidden states. h (n, C) tensor, doc (n,) document numbers (numpy; each document's rows
    in one run, in order), vals (n,) long tensor on h's device. Returns (d (n, k) float32, inf
    where fewer than k rows came before; nb (n, k) long, -1 there)."""
    import torch

    n, dev = len(h), h.device
    d_out = torch.full((n, k), float("inf"), device=dev)
    nb_out = torch.full((n, k), -1, dtype=torch.long, device=dev)
    for a, b in _runs(doc):
        if b - a < 2:
            continue
        x = h[a:b].double()
        x = x - x.mean(0)  # any vector gives the same distances; centring keeps them precise
        n2 = (x * x).sum(1)
        block = max(1, min(2048, max_elems // (b - a)))
        for qa in range(1, b - a, block):  # the first row has nothing before it
            qb = min(qa + block, b - a)
            d = (n2[qa:qb, None] + n2[None, :qb] - 2 * x[qa:qb] @ x[:qb].T).clamp_min(0)
            d.masked_fill_(torch.arange(qb, device=dev)[None] >= torch.arange(qa, qb, device=dev)[:, None], float("inf"))
            kk = min(k, qb)
            dv, dj = torch.topk(d, kk, dim=1, largest=False)
            d_out[a + qa : a + qb, :kk] = dv.float()
            nb_out[a + qa : a + qb, :kk] = torch.where(torch.isfinite(dv), vals[a + dj], -1)
    return d_out, nb_out


def cache_columns(h, doc, vals, target, k: int, temp: float, scale: float, rows: int = 1 << 21) -> dict:
    """dense_cache's joint.Est columns (estimate_columns' at one temperature) of every row, from
    doc_neighbours over documents taken together up to `rows` rows at a time (one longer document
    alone): h, vals, target on one device, doc numpy. numpy arrays (n, 1)."""
    doc = np.asarray(doc)
    runs, parts, i = _runs(doc), [], 0
    while i < len(runs):
        a, j = runs[i][0], i + 1
        while j < len(runs) and runs[j][1] - a <= rows:  # whole documents from row a
            j += 1
        b = runs[j - 1][1]
        d, nb = doc_neighbours(h[a:b], doc[a:b], vals[a:b], k)
        parts.append(estimate_columns(d, nb, target[a:b], [temp], scale))
        i = j
    if not parts:  # no rows: estimate_columns' empty columns
        parts.append(estimate_columns(*doc_neighbours(h[:0], doc[:0], vals[:0], k), target[:0], [temp], scale))
    return {f: np.concatenate([p[f] for p in parts]) for f in parts[0]}


def estimate_columns(d, nb, target, temps, scale: float) -> dict:
    """The kNN estimate at each temperature of `temps` as joint components, numpy columns (n, M)
    of model/mixture/joint.Est: q = p_knn(target) (softmax(-d / temp) over the neighbours), rest 0 (1
    without any neighbour: it defers to the model), in the count's place the nearest distance's
    bucket (in units of `scale`; 0: none), the share of the nearest neighbour's token and that
    token as top (-1: none)."""
    import torch
    from teragram.model.mixture.gate import SHARE_EDGES

    has = torch.isfinite(d[:, 0])
    edges = torch.as_tensor(DIST_EDGES, dtype=d.dtype, device=d.device)
    near = torch.where(has, torch.bucketize(torch.where(has, d[:, 0], 0) / scale, edges, right=True) + 1, 0)
    share_edges = torch.as_tensor(SHARE_EDGES, dtype=d.dtype, device=d.device)
    same = (nb == nb[:, :1]) | (nb < 0)
    every = same.all(1)  # every neighbour the nearest's token: share 1 exactly (a float sum may fall short of the last edge)
    shares = []
    for temp in temps:
        w = torch.nan_to_num(torch.softmax(-d / temp, dim=1))  # no neighbour at all: 0
        share = torch.where(every, 1.0, (w * same).sum(1).clamp_max(1.0))
        shares.append(torch.where(has, torch.bucketize(share, share_edges, right=True), 0))
    M = len(temps)
    return {
        "q": knn_target_probs(d, nb, target, temps).cpu().numpy().astype(np.float32),
        "rest": (~has).float()[:, None].repeat(1, M).cpu().numpy(),
        "count": near[:, None].repeat(1, M).cpu().numpy().astype(np.uint8),
        "share": torch.stack(shares, 1).cpu().numpy().astype(np.uint8),
        "top": torch.where(has, nb[:, 0], -1)[:, None].repeat(1, M).cpu().numpy().astype(np.int32),
    }


def as_est(cols: dict):
    """estimate_columns' arrays as a model/mixture/joint.Est (the per-position fields zero: with_columns
    keeps the index's); a column (n,) of an older file is one component."""
    from teragram.model.mixture.joint import Est

    cols = {f: np.asarray(v).reshape(len(v), -1) for f, v in cols.items()}
    z = np.zeros(len(cols["q"]), np.uint8)
    return Est(*(cols[f] for f in ("q", "rest", "count", "share", "top")), z, z, z)


# what a model trained with dense_knn keeps of its store (GPTConfig.joint_knn): KnnSource rebuilds it
SETTINGS = (
    "k", "nprobe", "centroids", "temperature_scale", "temperature_factor", "keys", "mu_abs_sum", "build_batch", "key",
    "temperature_multiples", "cache_temperature",
)  # fmt: skip
# settings estimates written before them did not keep: their value (no cache_temperature: no dense_cache)
OPTIONAL = {"key": "final", "temperature_multiples": (1.0,), "cache_temperature": None}


def kept(store) -> tuple:
    """The (name, value) pairs of SETTINGS in `store` (a mapping, e.g. read from JSON), lists as
    tuples: what GPTConfig.joint_knn holds."""
    store = dict(store)
    return tuple((f, tuple(store[f]) if isinstance(store[f], list) else store[f]) for f in SETTINGS if f in store)


class KnnSource:
    """dense_knn's estimate outside training: the store of every training position of the index
    under the keys model (the checkpoint the training estimates were made with, e.g. the joint
    benchmark's plain (a)), rebuilt and searched with the settings the jointly trained model keeps.
    `documents` gives held-out text's estimates in bulk (for token_eval and /v1/score), `live` one
    position's with its distribution (for generation); both see what benchmarks/knnlm.joint_estimates
    wrote for held-out text. The keys live in device memory (2 bytes x n_embd per training position)."""

    def __init__(self, keys_model, index_dir: str | Path, settings, components, device: str = "cpu"):
        from teragram.model.mixture.joint import DENSE

        settings = OPTIONAL | dict(settings)
        missing = [f for f in SETTINGS if f not in settings]
        if missing:
            raise TeragramError(f"the model's dense_knn settings lack {', '.join(missing)}: its estimates predate a live store")
        self.components = tuple(c for c in components if c in DENSE)  # the dense ones of the gate's components, in its order
        mult = settings["temperature_multiples"]
        had = [*DENSE[: len(mult)], *(["dense_cache"] if settings["cache_temperature"] is not None else [])]
        if not self.components or any(c not in had for c in self.components):
            raise TeragramError(
                f"the gate reads {', '.join(self.components) or 'no dense component'}; its kNN estimates had {', '.join(had)}"
            )
        self.model, self.device = keys_model.eval(), device
        self.key = settings["key"]
        keys, vals, self.mu = build(keys_model, index_dir, device, settings["build_batch"], self.key)  # mu: its first batch's mean
        got, want = float(self.mu.double().abs().sum()), settings["mu_abs_sum"]
        if len(keys) != settings["keys"] or abs(got - want) > 1e-4 * abs(want):
            raise TeragramError(
                f"the kNN store's keys model gives {len(keys):,} keys (mean state |sum| {got:.6g}); the gate was trained with"
                f" {settings['keys']:,} ({want:.6g}): another keys model or index"
            )
        self.ds = Datastore(keys, vals, centroids=settings["centroids"])
        self.k, self.nprobe, self.scale = settings["k"], settings["nprobe"], settings["temperature_scale"]
        temp = settings["temperature_factor"] * self.scale  # fit on validation; each component's a multiple of it
        self.temps = [settings["cache_temperature"] if c == "dense_cache" else temp * mult[DENSE.index(c)] for c in self.components]
        self.knn_cols = [j for j, c in enumerate(self.components) if c != "dense_cache"]  # searched in the store
        self.cache_col = self.components.index("dense_cache") if "dense_cache" in self.components else None
        self.V = keys_model.cfg.vocab_size
        self._last = None  # live's last window, its key/value cache and states, one tuple (read and replaced whole)
        self._done = None  # live's document so far: its complete windows' ids and states (dense_cache reads every earlier state)

    def _hidden(self, windows: list[np.ndarray], batch: int):
        """The keys model's key states (n, C) float32 of every position of windows of at
        most block_size ids, in order (a batch padded on the right: causal, nothing read)."""
        import torch

        cuda = str(self.device).startswith("cuda")
        out = []
        for a in range(0, len(windows), batch):
            ws = windows[a : a + batch]
            x = np.zeros((len(ws), max(len(w) for w in ws)), np.int64)
            for j, w in enumerate(ws):
                x[j, : len(w)] = w
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                h = states(self.model, torch.from_numpy(x).to(self.device), self.key)
            out += [h[j, : len(w)].float() for j, w in enumerate(ws)]
        return torch.cat(out) if out else torch.zeros((0, self.model.cfg.n_embd), device=self.device)

    def _window_states(self, w: np.ndarray):
        """The keys model's states (len(w), C) float32 of every position of window w. Generation
        asks for a window that extends the one before: the last call's key/value cache is kept, so
        only the new tokens run (a window that does not extend it, after a rejected draft or at a
        window's start, runs whole)."""
        import torch

        last = self._last
        if last is not None and np.array_equal(last[0], w):
            return last[2]
        grow = last is not None and len(last[0]) < len(w) and np.array_equal(last[0], w[: len(last[0])])
        new, kv, pos0 = (w[len(last[0]) :], last[1], len(last[0])) if grow else (w, None, 0)
        cuda = str(self.device).startswith("cuda")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda), key_states(self.model, self.key) as got:
            _, kv = self.model.hidden(torch.from_numpy(new[None]).to(self.device), kv=kv, pos0=pos0)
        h = got[-1][0].float()
        h = torch.cat([last[2], h]) if grow else h
        self._last = (w.copy(), kv, h)
        return h

    def _last_state(self, w: np.ndarray):
        """The keys model's state (1, C) float32 at the last position of window w (_window_states')."""
        return self._window_states(w)[-1:]

    def _columns(self, d, nb, dc, nbc, target) -> dict:
        """estimate_columns of the store's neighbours (d, nb) at the kNN components' temperatures and
        of the document's own (dc, nbc) at dense_cache's, as columns in the gate's order."""
        parts = {}
        if self.knn_cols:
            c = estimate_columns(d, nb, target, [self.temps[j] for j in self.knn_cols], self.scale)
            parts |= {j: {f: v[:, i : i + 1] for f, v in c.items()} for i, j in enumerate(self.knn_cols)}
        if self.cache_col is not None:
            parts[self.cache_col] = estimate_columns(dc, nbc, target, [self.temps[self.cache_col]], self.scale)
        return {f: np.concatenate([parts[j][f] for j in range(len(self.components))], 1) for f in parts[0]}

    def documents(self, docs: list[np.ndarray], eos: int, batch: int = 16):
        """Every target's estimate of documents read as held-out text (EOS + the document,
        predicting the document + EOS, in windows of block_size from its start: EvalData's), a
        joint.Est (a column per component) in model.evaluate.token_eval's order (joint.heldout_est's dense=)."""
        import torch

        T = self.model.cfg.block_size
        windows, targets, rowdoc = [], [], []
        for i, d in enumerate(docs):
            x = np.concatenate([[eos], np.asarray(d, np.int64)])
            windows += [x[s : s + T] for s in range(0, len(x), T)]
            targets.append(np.concatenate([np.asarray(d, np.int64), [eos]]))
            rowdoc.append(np.full(len(x), i))
        tgt = torch.from_numpy(np.concatenate(targets)).to(self.device)
        step, hidden = max(1, QUERY_CHUNK // T), []
        for a in range(0, len(windows), step):
            hidden.append(self._hidden(windows[a : a + step], batch))
        d = nb = dc = nbc = None
        if self.knn_cols:
            found = [self.ds.neighbours(h - self.mu, self.k, self.nprobe) for h in hidden]
            d, nb = torch.cat([f[0] for f in found]), torch.cat([f[1] for f in found])
        if self.cache_col is not None:
            dc, nbc = doc_neighbours(torch.cat(hidden), np.concatenate(rowdoc), tgt, self.k)
        return as_est(self._columns(d, nb, dc, nbc, tgt))

    def _document_states(self, x: np.ndarray):
        """The keys model's states of every position of x (EOS + a document's ids so far), window by
        window as `documents` reads them: its complete windows' kept from the call before."""
        import torch

        T = self.model.cfg.block_size
        cut = (len(x) - 1) // T * T  # the last window's start
        done = self._done
        if done is None or len(done[0]) > cut or not np.array_equal(done[0], x[: len(done[0])]):
            done = (x[:0], torch.zeros((0, self.model.cfg.n_embd), device=self.device))
        if len(done[0]) < cut:
            more = self._hidden([x[s : s + T] for s in range(len(done[0]), cut, T)], 16)
            done = (x[:cut].copy(), torch.cat([done[1], more]))
        self._done = done
        return torch.cat([done[1], self._window_states(x[cut:])])

    def live(self, context, eos: int):
        """For the next token after `context` (a document's ids so far): the estimate's one-row
        Est (q unused) and each component's distribution (M, V), softmax(-d / T) summed by the
        neighbours' tokens. The keys model reads the position's window as `documents` does (its
        key/value cache kept from the call before: `_window_states`); dense_cache reads every
        earlier state of the document (`_document_states`)."""
        import torch

        T = self.model.cfg.block_size
        x = np.concatenate([[eos], np.asarray(context, np.int64)])
        d = nb = dc = nbc = None
        if self.cache_col is None:
            q = self._last_state(x[(len(x) - 1) // T * T :])
        else:
            h = self._document_states(x)
            q = h[-1:]
            y = h.double() - h.double().mean(0)
            dist = ((y[:-1] - y[-1]) ** 2).sum(1)
            dc = torch.full((1, self.k), float("inf"), device=h.device)
            nbc = torch.full((1, self.k), -1, dtype=torch.long, device=h.device)
            if len(dist):
                dv, dj = torch.topk(dist, min(self.k, len(dist)), largest=False)
                dc[0, : len(dv)] = dv.float()
                nbc[0, : len(dv)] = torch.from_numpy(x[1:]).to(h.device)[dj]
        if self.knn_cols:
            d, nb = self.ds.neighbours(q - self.mu, self.k, self.nprobe)
        dev = q.device
        cols = self._columns(d, nb, dc, nbc, torch.full((1,), -1, device=dev))
        out = np.zeros((len(self.temps), self.V))
        for j, temp in enumerate(self.temps):
            dd, nn = (dc, nbc) if j == self.cache_col else (d, nb)
            w = torch.nan_to_num(torch.softmax(-dd[0].double() / temp, 0)) * (nn[0] >= 0)
            out[j] = torch.zeros(self.V, dtype=torch.float64).index_add_(0, nn[0].clamp_min(0).cpu(), w.cpu()).numpy()
        return as_est(cols), out


def require_store(model, given) -> None:
    """Refuse, before any work, a jointly trained model whose gate reads dense_knn when no store is
    `given` (the KnnSource, or the --knn-keys that will build it)."""
    from teragram.model.mixture.joint import DENSE

    if given is None and model is not None and any(c in DENSE for c in model.cfg.joint):
        raise TeragramError(
            "this model's gate reads the kNN-LM's estimate (dense_knn): give --knn-keys RUN, the run whose states key its store"
        )


def source_for(model, keys_checkpoint, index_dir, device: str = "cpu") -> KnnSource | None:
    """The KnnSource of a jointly trained model whose gate reads dense_knn, rebuilt from
    `keys_checkpoint` (--knn-keys: the run whose hidden states key the store) over the index;
    None when the gate reads none (or no keys are given: whoever needs the estimates refuses)."""
    from teragram.model.checkpoint import load_model
    from teragram.model.mixture.joint import DENSE

    reads = any(c in DENSE for c in model.cfg.joint)
    if keys_checkpoint and not reads:
        raise TeragramError("--knn-keys: this model's gate reads no kNN estimate (it was not trained with dense_knn)")
    if not (keys_checkpoint and reads):
        return None
    keys_model, _ = load_model(keys_checkpoint, device)
    return KnnSource(keys_model, index_dir, model.cfg.joint_knn, model.cfg.joint, device)
