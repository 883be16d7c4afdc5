"""Interpolation of a model's next-token distribution with estimates read off the index.

infini-gram's recipe (`fit_lambdas`) mixes the model with the ∞-gram distribution

    p(y) = (1 - λ) p_model(y) + λ p_inf(y),   p_inf(y) = cnt(s y) / cnt(s)

where s is the longest suffix of the context found in the index, with one constant λ for
"sparse" positions (a single continuation follows s) and one for the rest, tuned on
validation text. `Gate` generalises it: a softmax gate over M components -- the model, the
∞-gram and fixed-order estimates cnt(s_k y) / cnt(s_k) for the last k tokens s_k (all from
the same suffix arrays) -- whose weights are a log-linear function of what is known before
the next token is seen: each suffix's length and count, how concentrated its continuations
are, the model's confidence and whether model and index agree on the most likely token. It
is fit by maximum likelihood on validation text. Every mixture is a proper distribution for
every context, so perplexities stay honest.

Besides the index, the gate mixes in the *document cache*: the same kind of estimates read off
the document's own earlier text (the continuations of the last k tokens where they occurred
before in this document, and of its longest such match). Held-out text is, by construction,
not in the index, but it repeats itself -- identifiers, boilerplate, whole lines of code -- and
a small model's attention copies poorly. Both are exact-match lookups; neither sees a token
before it is predicted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numba as nb
import numpy as np
from teragram.index import format as fmt
from teragram.index.errors import TeragramError

LAMBDAS = np.array([0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99])
LEN_EDGES = np.array([1, 2, 3, 4, 5, 7, 10, 15, 23, 35, 64, 128])  # suffix-length buckets
MAXP_EDGES = np.linspace(0.1, 0.9, 9)  # the model's top probability
SHARE_EDGES = np.array([0.2, 0.4, 0.6, 0.8, 1.0])  # the top continuation's share; 1.0 = sparse


def mix_nll(nll_model: np.ndarray, p_inf: np.ndarray, g: np.ndarray) -> np.ndarray:
    return -np.log(g * p_inf + (1 - g) * np.exp(-nll_model) + 1e-300)


def fit_lambdas(nll_model: np.ndarray, p_inf: np.ndarray, groups: np.ndarray) -> dict[int, float]:
    """infini-gram's interpolation: the λ per group (0 non-sparse, 1 sparse) from a grid that
    minimises the validation loss."""
    best = {}
    for grp in np.unique(groups):
        m = groups == grp
        losses = [float(mix_nll(nll_model[m], p_inf[m], lam).sum()) for lam in LAMBDAS]
        best[int(grp)] = float(LAMBDAS[int(np.argmin(losses))])
    return best


def apply_lambdas(nll_model: np.ndarray, p_inf: np.ndarray, lams: dict[int, float], groups: np.ndarray) -> np.ndarray:
    g = np.array([lams.get(0, 0.0), lams.get(1, 0.0)])[groups.astype(int)]
    return mix_nll(nll_model, p_inf, g)


def gate_features(suffix_len: np.ndarray, maxp: np.ndarray, counts, top_shares, agrees, cache_len=None) -> np.ndarray:
    """Design matrix (N, F) of the gate. Per estimate (the longest-suffix one first, then the
    others): one-hot log2 count of its suffix, one-hot share of its most frequent continuation
    (the last bucket: sparse, a single continuation), and whether that continuation is also
    the model's most likely token. Plus one-hot length of the first estimate's suffix (and its
    copy for sparse positions), of the document cache's longest match (cache_len, when the
    first estimate is the index's), one-hot model confidence, and a bias."""
    n = len(suffix_len)
    nl, nm, nc, ns = len(LEN_EDGES) + 1, len(MAXP_EDGES) + 1, 21, len(SHARE_EDGES) + 1
    r = np.arange(n)
    sparse = np.asarray(top_shares[0]) >= 1.0
    B = np.zeros((n, 2 * nl), np.float32)
    lb = np.searchsorted(LEN_EDGES, suffix_len, side="right")
    B[r, lb] = 1
    B[r[sparse], nl + lb[sparse]] = 1
    blocks = [B]
    if cache_len is not None:
        B = np.zeros((n, nl), np.float32)
        B[r, np.searchsorted(LEN_EDGES, cache_len, side="right")] = 1
        blocks.append(B)
    for c, sh, ag in zip(counts, top_shares, agrees, strict=True):
        B = np.zeros((n, nc + ns + 1), np.float32)
        B[r, np.clip(np.floor(np.log2(np.maximum(c, 0) + 1)).astype(int), 0, nc - 1)] = 1
        B[r, nc + np.searchsorted(SHARE_EDGES, sh, side="right")] = 1
        B[:, -1] = ag
        blocks.append(B)
    B = np.zeros((n, nm + 1), np.float32)
    B[r, np.searchsorted(MAXP_EDGES, maxp, side="right")] = 1
    B[:, -1] = 1  # bias
    blocks.append(B)
    return np.concatenate(blocks, 1)


def mix_nll_multi(logp: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """-log sum_m w_m p_m, from component log-probabilities (N, M) and weights (N, M)."""
    z = logp + np.log(weights + 1e-300)
    m = z.max(1)
    return -(m + np.log(np.exp(z - m[:, None]).sum(1)))


@dataclass
class Gate:
    """Mixture weights softmax(X W) over the model and the estimates named by `components`
    (column 0, the model, is the reference: its logit is 0), fit on validation text."""

    W: np.ndarray  # (F, len(components))
    components: tuple[str, ...] = ()  # estimates mixed in (see COMPONENTS); () means all

    def __post_init__(self) -> None:
        self.components = tuple(self.components) or COMPONENTS
        bad = [c for c in self.components if c not in COMPONENTS]
        if bad or self.components[0] not in ("", "c") or len(set(self.components)) != len(self.components):
            raise TeragramError(f"a gate over unknown or misordered estimates {self.components}")
        if self.W.ndim != 2 or self.W.shape[1] != len(self.components):
            raise TeragramError(f"gate weights of shape {self.W.shape} for {len(self.components)} estimates")

    @classmethod
    def fit(cls, X: np.ndarray, logp: np.ndarray, *, components=(), steps: int = 300, l2: float = 1e-4) -> Gate:
        """X (N, F) gate features; logp (N, M) log-probability of the actual next token under
        the model, then each component."""
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        Xt = torch.from_numpy(np.ascontiguousarray(X, np.float32)).to(dev).double()
        lp = torch.from_numpy(np.maximum(logp.astype(np.float64), -700.0)).to(dev)
        W = torch.zeros((X.shape[1], logp.shape[1] - 1), dtype=torch.float64, device=dev, requires_grad=True)
        opt = torch.optim.LBFGS([W], lr=1, max_iter=steps, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            z = torch.cat([torch.zeros(len(Xt), 1, dtype=Xt.dtype, device=dev), Xt @ W], 1)
            nll = -torch.logsumexp(torch.log_softmax(z, 1) + lp, 1)
            loss = nll.mean() + l2 * (W[:-1] ** 2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        return cls(W.detach().cpu().numpy().copy(), tuple(components))

    def __call__(self, X: np.ndarray) -> np.ndarray:
        z = np.concatenate([np.zeros((len(X), 1)), X.astype(np.float64) @ self.W], 1)
        z -= z.max(1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(1, keepdims=True)

    def save(self, path: str | Path) -> None:
        edges = {
            "len_edges": LEN_EDGES.tolist(),
            "maxp_edges": MAXP_EDGES.tolist(),
            "share_edges": SHARE_EDGES.tolist(),
            "orders": list(ORDERS),
            "cache_lengths": list(CACHE_LENGTHS),
        }
        fmt.write_json(Path(path), {"W": self.W.tolist(), "components": list(self.components), **edges})

    @classmethod
    def load(cls, path: str | Path) -> Gate:
        """A saved gate; one saved with other feature buckets or orders is refused."""
        try:
            d = json.loads(Path(path).read_text())
            W = np.array(d["W"], np.float64)
            same = d["len_edges"] == LEN_EDGES.tolist() and d["maxp_edges"] == MAXP_EDGES.tolist()
            same = same and d["share_edges"] == SHARE_EDGES.tolist() and d["orders"] == list(ORDERS)
            same = same and d["cache_lengths"] == list(CACHE_LENGTHS)
            comps = tuple(d["components"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TeragramError(f"{path}: not a teragram index gate ({e}); fit it again with this version") from e
        if not same or W.ndim != 2 or W.shape[1] != len(comps):
            raise TeragramError(f"{path}: a gate made for other features (fit it again with this version)")
        try:
            return cls(W, comps)
        except TeragramError as e:
            raise TeragramError(f"{path}: {e}") from e


# ---- the index's estimates, in bulk (evaluation, calibration) and live (generation) ---------

ORDERS = (1, 2, 4, 8, 16)  # fixed-order estimates: the continuations of the last k tokens
SUFFIXES = ("", *map(str, ORDERS))  # the index's: the ∞-gram, then the fixed orders
CACHE = ("c", *(f"c{k}" for k in ORDERS))  # the document cache's: its longest match, then the orders
COMPONENTS = SUFFIXES + CACHE
CACHE_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the cache's longest match: the longest of these


def index_estimates(idx, ids) -> dict[str, np.ndarray]:
    """For each target of a document read as EOS + ids (ids[0] .. ids[-1], then EOS): each
    estimate's probability of the target (p, p1, p2, ...), its suffix's count, the share of its
    most frequent continuation and that continuation (share*, count*, top*), the ∞-gram's suffix
    length (length) and sparsity. The first target sees no context: the unigram distribution."""
    ids = np.asarray(ids, np.int64)
    n = len(ids)
    uni = idx.unigram
    p0, share0, top0 = (uni[ids[0]] if n else 0) / idx.n_positions, uni.max() / idx.n_positions, int(np.argmax(uni))
    out = {"length": np.concatenate([[0], np.zeros(n, np.int64)])}
    for sfx in SUFFIXES:
        r = idx.score(ids, top_k=1, max_len=int(sfx or 0), targets=True)  # max_len 0: uncapped, the ∞-gram
        cnt = np.maximum(r.count, 1)
        out[f"p{sfx}"] = np.concatenate([[p0], r.target_cnt / cnt])
        out[f"count{sfx}"] = np.concatenate([[idx.n_positions], r.count])
        out[f"share{sfx}"] = np.concatenate([[share0], r.topk_cnt[:, 0] / cnt])
        out[f"top{sfx}"] = np.concatenate([[top0], r.topk_ids[:, 0]]).astype(np.int64)
        if not sfx:
            out["length"][1:] = r.length
    out["sparse"] = out["share"] >= 1.0
    return out


@nb.njit(cache=True)
def _running_counts(key, pair, y, n_keys, n_pairs, o_cnt, o_pair, o_top, o_topc):
    """For each target j in order: how often key[j] occurred before (o_cnt), how often followed
    by y[j] (o_pair), and the most frequent follower so far (o_top; count desc, id asc) with
    its count; then record occurrence j. key -1: no context of this order."""
    ctx = np.zeros(n_keys, np.int64)
    pc = np.zeros(n_pairs, np.int64)
    topc = np.zeros(n_keys, np.int64)
    topt = np.full(n_keys, -1, np.int64)
    for j in range(key.shape[0]):
        kk = key[j]
        if kk < 0:
            continue
        q = pair[j]
        o_cnt[j] = ctx[kk]
        o_pair[j] = pc[q]
        o_top[j] = topt[kk]
        o_topc[j] = topc[kk]
        ctx[kk] += 1
        pc[q] += 1
        if pc[q] > topc[kk] or (pc[q] == topc[kk] and y[j] < topt[kk]):
            topc[kk] = pc[q]
            topt[kk] = y[j]


def _row_ids(rows: np.ndarray) -> np.ndarray:
    """Dense ids of equal rows (exact: rows compared as bytes)."""
    rows = np.ascontiguousarray(rows)
    v = rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).ravel()
    return np.unique(v, return_inverse=True)[1].ravel()


def _cache_order(ids: np.ndarray, y: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
    """Per target j (context ids[:j]): earlier occurrences in the document of its last k tokens
    (ending before j), how many were followed by y[j], and the most frequent follower."""
    n = len(y)
    cnt, pair, top, topc = np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, -1, np.int64), np.zeros(n, np.int64)
    if len(ids) >= k:
        kid = _row_ids(np.lib.stride_tricks.sliding_window_view(ids, k))  # context of target j = k, k+1, ...
        pid = _row_ids(np.stack([kid, y[k:]], 1))
        key = np.concatenate([np.full(k, -1), kid])
        pr = np.concatenate([np.full(k, -1), pid])
        _running_counts(key, pr, y, kid.max() + 1, pid.max() + 1, cnt, pair, top, topc)
    return cnt, pair, top, topc


def _pack(name: str, cnt, pair, top, topc) -> dict[str, np.ndarray]:
    c = np.maximum(cnt, 1)
    return {f"p{name}": pair / c, f"count{name}": cnt, f"share{name}": topc / c, f"top{name}": top}


def cache_estimates(ids, eos: int) -> dict[str, np.ndarray]:
    """The document cache's estimates, aligned with index_estimates (targets ids[0..], EOS):
    for k in ORDERS the continuations of the last k tokens where they occurred earlier in the
    document (pc{k}, countc{k}, sharec{k}, topc{k}: all zero, top -1, without one), and the same
    for the longest of CACHE_LENGTHS that occurred earlier (pc, ..., its length clength)."""
    ids = np.asarray(ids, np.int64)
    y = np.append(ids, eos)
    n = len(y)
    out = {}
    longest = [np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, -1, np.int64), np.zeros(n, np.int64)]
    clen = np.zeros(n, np.int64)
    for k in sorted(set(CACHE_LENGTHS) | set(ORDERS)):
        st = _cache_order(ids, y, k)
        if k in ORDERS:
            out |= _pack(f"c{k}", *st)
        if k in CACHE_LENGTHS:
            m = st[0] > 0
            for a, b in zip(longest, st, strict=True):
                a[m] = b[m]
            clen[m] = k
    return out | _pack("c", *longest) | {"clength": clen}


def estimates(idx, ids) -> dict[str, np.ndarray]:
    """index_estimates and cache_estimates of one document."""
    return index_estimates(idx, ids) | cache_estimates(ids, idx.eos_id)


_OPEN: dict[str, object] = {}  # index directory -> open Index, per process


def _estimates_doc(args):
    index_dir, ids = args
    from teragram.index.engine import Index

    if index_dir not in _OPEN:
        _OPEN.clear()  # one index open per process at a time
        _OPEN[index_dir] = Index(index_dir)
    return estimates(_OPEN[index_dir], ids)


def heldout_estimates(index_dir, heldout, workers: int = 1) -> dict[str, np.ndarray]:
    """estimates (index and document cache) of every document of a held-out feature directory
    (index/heldout.py), concatenated in model.evaluate.token_eval's order."""
    from multiprocessing import get_context

    from teragram.index import format as fmt

    d = Path(heldout) / "000000"
    tok = np.asarray(fmt.open_array(d / "tokens.bin", "tokens")).astype(np.int64)
    st = np.asarray(fmt.open_array(d / "docs.bin", "docs")).astype(np.int64)
    jobs = [(str(index_dir), tok[st[k] : st[k + 1] - 1]) for k in range(len(st) - 1)]
    if workers > 1:
        with get_context("spawn").Pool(workers) as pool:
            parts = pool.map(_estimates_doc, jobs, chunksize=4)
    else:
        parts = [_estimates_doc(j) for j in jobs]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def gate_inputs(est: dict[str, np.ndarray], maxp: np.ndarray, top: np.ndarray, components=COMPONENTS) -> np.ndarray:
    """The gate's design matrix from the estimates and the model's top token and its
    probability at the same positions."""
    first = components[0]
    return gate_features(
        est["length"] if first == "" else est["clength"],
        maxp,
        [est[f"count{s}"] for s in components],
        [est[f"share{s}"] for s in components],
        [top == est[f"top{s}"] for s in components],
        est["clength"] if first == "" and "c" in components else None,
    )


def component_logp(est: dict[str, np.ndarray], nll_model: np.ndarray, components=COMPONENTS) -> np.ndarray:
    """(N, 1 + M) log-probability of each target under the model and each estimate. An estimate
    without occurrences (the cache early in a document) defers to the model, so that every
    mixture stays a distribution."""
    lp = [np.where(est[f"count{s}"] > 0, np.log(est[f"p{s}"] + 1e-300), -nll_model) for s in components]
    return np.stack([-nll_model, *lp], 1)


def _cache_live(q: np.ndarray, V: int, components) -> tuple[dict[str, tuple[np.ndarray, int]], int]:
    """The document cache's distributions (and counts) after context q, as cache_estimates
    defines them, and its longest match: the earlier ends e of the last k tokens are narrowed
    one token at a time."""
    want = {int(c[1:]) for c in components if c in CACHE and c != "c"}
    kmax = max(want | (set(CACHE_LENGTHS) if "c" in components else set()), default=0)
    out = {}
    ends = np.arange(1, len(q))  # e: a context ending at q[e-1], followed by q[e]
    hit = {}
    for k in range(1, kmax + 1):
        ends = ends[ends >= k]
        ends = ends[q[ends - k] == q[len(q) - k]] if len(q) >= k else ends[:0]
        hit[k] = ends
    for k in want:
        out[f"c{k}"] = hit[k]
    if "c" in components:
        found = [k for k in CACHE_LENGTHS if len(hit[k])]
        out["c"] = hit[found[-1]] if found else ends[:0]
        out["clength"] = found[-1] if found else 0
    dists = {}
    for c, e in out.items():
        if c == "clength":
            continue
        d = np.bincount(q[e], minlength=V)[:V].astype(np.float64)
        dists[c] = (d / max(len(e), 1), len(e))
    return dists, out.get("clength", 0)


def next_distribution(idx, context, p_model: np.ndarray, gate: Gate, p_softmax: np.ndarray | None = None) -> np.ndarray:
    """The gated next-token distribution (V,) after `context` (a document's tokens so far, EOS
    not included), for generation: the same mixture estimates + gate give in bulk.
    p_model is the model's final distribution; p_softmax its own softmax when the model has
    a mixture head (the gate's confidence and agreement features read the softmax, as in
    model.evaluate.token_eval)."""
    V = len(p_model)
    q = np.asarray(context, np.int64)
    p_softmax = p_model if p_softmax is None else p_softmax
    top_m = int(np.argmax(p_softmax))
    comps = gate.components
    dists, counts = {}, {}
    length = 0
    if any(c in SUFFIXES for c in comps):
        if len(q) == 0:  # a document's first token: every index estimate is the unigram distribution
            for s in SUFFIXES:
                dists[s], counts[s] = idx.unigram / idx.n_positions, idx.n_positions
        else:
            length = idx.infgram_ntd(q).suffix_len
            for s in (c for c in comps if c in SUFFIXES):
                k = length if not s else min(length, int(s))
                r = idx.ntd(q[len(q) - k :] if k else q[:0])
                d = np.zeros(V)
                if r.result_by_token_id:
                    t = np.fromiter(r.result_by_token_id, np.int64)
                    d[t] = [c for c, _ in r.result_by_token_id.values()]
                    d /= r.prompt_cnt
                dists[s], counts[s] = d, r.prompt_cnt
    cache, clen = _cache_live(q, V, comps)
    for c, (d, n) in cache.items():
        dists[c], counts[c] = d, n
    X = gate_features(
        np.array([length if comps[0] == "" else clen]),
        np.array([p_softmax[top_m]]),
        [np.array([counts[c]]) for c in comps],
        [np.array([dists[c].max()]) for c in comps],
        [np.array([counts[c] > 0 and int(np.argmax(dists[c])) == top_m]) for c in comps],
        np.array([clen]) if comps[0] == "" and "c" in comps else None,
    )
    w = gate(X)[0]
    return w[0] * p_model + sum(wi * (dists[c] if counts[c] > 0 else p_model) for wi, c in zip(w[1:], comps, strict=True))


def gated_eval(model, index_dir, heldout, device: str = "cpu", *, gate: Gate | None = None, workers: int = 1, batch: int = 16):
    """(gate, per-token nll of the model, per-token nll of the gated mixture) on the held-out
    features' text. With gate=None a gate is fit on this text, which should then be validation
    text, never the text it will be reported on."""
    from teragram.index.engine import Index

    from .evaluate import token_eval

    idx = Index(index_dir)
    r = token_eval(model, heldout, idx.eos_id, idx.sep, device, batch=batch)
    est = heldout_estimates(index_dir, heldout, workers)
    comps = gate.components if gate is not None else COMPONENTS
    X, logp = gate_inputs(est, r["maxp"], r["top"], comps), component_logp(est, r["nll"], comps)
    if gate is None:
        gate = Gate.fit(X, logp, components=comps)
    return gate, r["nll"], mix_nll_multi(logp, gate(X))
