"""The kNN-LM's estimate (Khandelwal et al., 2020) as a component of the joint gate
(model/mixture/joint.py's dense_knn), and the continuous cache's (Grave et al., 2017; dense_cache).

The estimates come from the neighbours that the dense store of every training position
(datastore.py: keys a model's states, values the next tokens, an inverted file searched with
exact float32 distances) finds for a position's state, or from the document's own earlier
states (doc_neighbours). The joint recipe's kNN stage measures the kNN-LM peer with them and writes
the dense_knn estimates of training positions (exclude-doc) and held-out text in bulk; `KnnSource`
gives the same estimate live (`teragram sample/serve --knn-keys`) and in bulk for `teragram
eval`, with the settings a jointly trained model keeps (GPTConfig.joint_knn).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from teragram.index.errors import TeragramError
from teragram.model.mixture.cont_cache import runs as doc_runs
from teragram.model.mixture.datastore import (
    CENTROIDS,
    KEY_STATES,
    KMEANS_ITERS,
    KMEANS_SAMPLE,
    NPROBE,
    QUERY_CHUNK,
    SEED,
    Datastore,
    assign,
    assign_scores,
    build,
    key_states,
    kmeans,
    queries,
    states,
    train_windows,
)

# The store (datastore.py) is importable from here too.
__all__ = ["CENTROIDS", "KEY_STATES", "KMEANS_ITERS", "KMEANS_SAMPLE", "NPROBE", "QUERY_CHUNK", "SEED", "Datastore", "assign"]
__all__ += ["assign_scores", "build", "key_states", "kmeans", "queries", "states", "train_windows"]
__all__ += ["DIST_EDGES", "K_JOINT", "MULTIPLES", "OPTIONAL", "SETTINGS", "KnnSource", "as_est", "cache_columns"]
__all__ += ["doc_neighbours", "estimate_columns", "kept", "knn_target_probs", "require_store", "source_for"]

K_JOINT = 64  # neighbours of the joint gate's kNN estimate (its p(target) against k = 1024's is measured: knn_est.json)
DIST_EDGES = np.geomspace(0.02, 20.0, 19)  # the nearest distance / scale: the estimate's buckets 1..20 (0: no neighbour)
# the joint gate's dense components (model/mixture/joint.DENSE, in its order): the kNN estimate at the temperature fit on
# validation times these, so that the gate chooses per token how sharp it is (the post-hoc gate over the plain
# model's estimate at three temperatures beat the one fit on validation: docs/research, the joint gate)
MULTIPLES = (1.0, 0.5, 2.5)


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
    for a, b in doc_runs(doc):
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
    runs, parts, i = doc_runs(doc), [], 0
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
    position's with its distribution (for generation); both see what the joint recipe's kNN stage
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
