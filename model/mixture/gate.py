"""The index gate: a model's next-token distribution mixed with exact-match estimates
(model/mixture/estimates.py) by weights computed from what is known before the token is seen.

A softmax gate over M components -- the model, then the estimates it names -- whose weights
are a log-linear function of each estimate's context count, how concentrated its continuations
are, whether its top continuation is the model's most likely token, the ∞-gram's (or the
cache's) suffix length and the model's confidence. It generalises infini-gram's interpolation
(model/mixture/baselines.py) and is fit by maximum likelihood on validation text. Every mixture is a
proper distribution for every context, so perplexities stay honest; generation computes the
same mixture live (`next_distribution`).

A gate may also read the continuous cache (model/mixture/cont_cache.py: the document's own
earlier hidden states) at several temperatures, as more estimates after the exact-match ones:
(t+cc), the best system measured on text from outside the indexed projects. Its weights come
from the same features; a gate saved without it loads and means what it meant.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from teragram.index import format as fmt
from teragram.index.errors import TeragramError
from teragram.model.mixture.cont_cache import ContCache
from teragram.model.mixture.estimates import CACHE_LENGTHS, COMPONENTS, INDEX, LEGACY_NAMES, ORDERS, cache_live, context_length

LEN_EDGES = np.array([1, 2, 3, 4, 5, 7, 10, 15, 23, 35, 64, 128])  # suffix-length buckets
MAXP_EDGES = np.linspace(0.1, 0.9, 9)  # the model's top probability
SHARE_EDGES = np.array([0.2, 0.4, 0.6, 0.8, 1.0])  # the top continuation's share; 1.0 = sparse


@dataclass
class GateX:
    """The gate's design matrix (N, width) of one-hot blocks and binary columns, stored as the
    columns set in each row: cols (N, B) int32, `width` where a slot is unset (a binary column
    that is 0). X W is then the sum of B rows of W, so that a fit over millions of rows and a
    chunk's weights need neither a dense matrix nor its memory (`dense()` gives it)."""

    cols: np.ndarray  # (N, B) int32
    width: int

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.cols), self.width)

    def __len__(self) -> int:
        return len(self.cols)

    def __getitem__(self, rows) -> GateX:
        return GateX(self.cols[rows], self.width)

    def dense(self) -> np.ndarray:
        X = np.zeros((len(self.cols), self.width), np.float32)
        cols = np.asarray(self.cols, np.int64)
        r, c = np.nonzero(cols < self.width)
        X[r, cols[r, c]] = 1
        return X

    def matmul(self, W: np.ndarray) -> np.ndarray:
        """X W (N, W's columns) in float64."""
        Wp = np.concatenate([np.asarray(W, np.float64), np.zeros((1, W.shape[1]))])
        out = np.zeros((len(self.cols), W.shape[1]))
        for b in range(self.cols.shape[1]):  # one slot at a time: no (N, B, M) temporary (3x faster than torch's embedding bag in float64)
            out += Wp[self.cols[:, b]]
        return out


def gate_features(suffix_len: np.ndarray, maxp: np.ndarray, counts, top_shares, agrees, cache_len=None) -> GateX:
    """Design matrix (N, F) of the gate. Per estimate (the longest-suffix one first, then the
    others): one-hot log2 count of its suffix, one-hot share of its most frequent continuation
    (the last bucket: sparse, a single continuation), and whether that continuation is also
    the model's most likely token. Plus one-hot length of the first estimate's suffix (and its
    copy for sparse positions), of the document cache's longest match (cache_len, when the
    first estimate is the index's), one-hot model confidence, and a bias."""
    nl, nm, nc, ns = len(LEN_EDGES) + 1, len(MAXP_EDGES) + 1, 21, len(SHARE_EDGES) + 1
    sparse = np.asarray(top_shares[0]) >= 1.0
    lb = np.searchsorted(LEN_EDGES, suffix_len, side="right")
    cols, at = [lb, np.where(sparse, nl + lb, -1)], 2 * nl  # -1: unset, made `width` below
    if cache_len is not None:
        cols.append(at + np.searchsorted(LEN_EDGES, cache_len, side="right"))
        at += nl
    for c, sh, ag in zip(counts, top_shares, agrees, strict=True):
        cols.append(at + np.clip(np.floor(np.log2(np.maximum(c, 0) + 1)).astype(int), 0, nc - 1))
        cols.append(at + nc + np.searchsorted(SHARE_EDGES, sh, side="right"))
        cols.append(np.where(np.asarray(ag, bool), at + nc + ns, -1))
        at += nc + ns + 1
    cols.append(at + np.searchsorted(MAXP_EDGES, maxp, side="right"))
    cols.append(np.full(len(suffix_len), at + nm))  # bias
    width = at + nm + 1
    C = np.stack(cols, 1).astype(np.int32) if len(suffix_len) else np.zeros((0, len(cols)), np.int32)
    return GateX(np.where(C < 0, width, C), width)


def mix_nll_multi(logp: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """-log sum_m w_m p_m, from component log-probabilities (N, M) and weights (N, M)."""
    z = logp + np.log(weights + 1e-300)
    m = z.max(1)
    return -(m + np.log(np.exp(z - m[:, None]).sum(1)))


def fit_weights(X, logp: np.ndarray, *, steps: int = 300, l2: float = 1e-4) -> np.ndarray:
    """W (F, M - 1) of the mixture softmax([0, X W]) with the least mean nll of the targets, by
    L-BFGS (features X (N, F), a GateX or dense; logp (N, M): the target's log-probability under
    the model, then each component), an L2 penalty on every weight but the bias (the last
    feature). In float32: the same loss as float64 to 1e-5 on the demo's validation text, several
    times faster on CPU. A GateX is made dense for the fit (on CPU a dense product is faster than
    an embedding bag or a sparse one: 2x and 2-3x on 20k rows), so the rows fit on are bounded by
    the caller (eval --fit-rows)."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    lp = torch.from_numpy(np.maximum(logp, -700.0).astype(np.float32)).to(dev)
    W = torch.zeros((X.shape[1], logp.shape[1] - 1), dtype=torch.float32, device=dev, requires_grad=True)
    Xt = torch.from_numpy(X.dense() if isinstance(X, GateX) else np.ascontiguousarray(X, np.float32)).to(dev)

    def xw():
        return Xt @ W

    opt = torch.optim.LBFGS([W], lr=1, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        z = torch.cat([torch.zeros(len(lp), 1, dtype=lp.dtype, device=dev), xw()], 1)
        nll = -torch.logsumexp(torch.log_softmax(z, 1) + lp, 1)
        loss = nll.mean() + l2 * (W[:-1] ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return W.detach().cpu().double().numpy()


def mixture_weights(X: np.ndarray, W: np.ndarray) -> np.ndarray:
    """(N, M) softmax([0, X W]): the model's weight (its logit 0), then each component's."""
    xw = X.matmul(W) if isinstance(X, GateX) else X.astype(np.float64) @ W
    z = np.concatenate([np.zeros((len(X), 1)), xw], 1)
    z -= z.max(1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(1, keepdims=True)


@dataclass
class Gate:
    """Mixture weights softmax(X W) over the model and the estimates named by `components`
    (column 0, the model, is the reference: its logit is 0), fit on validation text."""

    W: np.ndarray  # (F, len(components))
    components: tuple[str, ...] = ()  # estimates mixed in (estimates.COMPONENTS, then cont_cache's); () means all exact-match ones
    cont_cache: ContCache | None = None  # the continuous cache's settings, when the gate reads it
    fit_for: dict | None = None  # {"model": checkpoint.weights_digest, "index": its manifest's digest}: what it was fit with

    def __post_init__(self) -> None:
        self.components = tuple(self.components) or COMPONENTS
        exact = self.exact_components
        cc = self.cont_cache.names if self.cont_cache is not None else ()
        bad = [c for c in exact if c not in COMPONENTS] or self.components[len(exact) :] != cc
        if bad or not exact or exact[0] not in ("index_infgram", "cache_longest") or len(set(self.components)) != len(self.components):
            raise TeragramError(f"a gate over unknown or misordered estimates {self.components}")
        if self.W.ndim != 2 or self.W.shape[1] != len(self.components):
            raise TeragramError(f"gate weights of shape {self.W.shape} for {len(self.components)} estimates")

    @property
    def exact_components(self) -> tuple[str, ...]:
        """The exact-match estimates (the index's and the document cache's), which also give the
        gate its features."""
        return tuple(c for c in self.components if not c.startswith("cont_cache_"))

    @classmethod
    def fit(
        cls, X: np.ndarray, logp: np.ndarray, *, components=(), cont_cache: ContCache | None = None, steps: int = 300, l2: float = 1e-4
    ) -> Gate:
        """X (N, F) gate features; logp (N, M) log-probability of the actual next token under
        the model, then each component (component_logp's columns)."""
        comps = (tuple(components) or COMPONENTS) + (cont_cache.names if cont_cache is not None else ())
        return cls(fit_weights(X, logp, steps=steps, l2=l2), comps, cont_cache)

    def __call__(self, X: np.ndarray) -> np.ndarray:
        return mixture_weights(X, self.W)

    def shares(self, w: np.ndarray) -> dict[str, float]:
        """One row of weights (the model, then self.components) summed by kind: the model, the
        index's estimates, and the caches' (the document cache's and the continuous cache's)."""
        index = sum(float(x) for x, c in zip(w[1:], self.components) if c in INDEX)
        return {"model": float(w[0]), "index": index, "cache": float(sum(w[1:])) - index}

    def check(self, *, model: str | None, index_dir, name: str = "the gate") -> None:
        """Refuse a gate fit for another model or another index (digests; a gate saved without
        them is taken as it is): its weights mean nothing for another model's probabilities,
        and an index of another size needs its own, refit on validation text."""
        if not self.fit_for:
            return
        if model is not None and self.fit_for.get("model") not in (None, model):
            raise TeragramError(f"{name} was fit for another model's outputs: fit it again for this one (teragram eval --fit-gate)")
        if self.fit_for.get("index") not in (None, index_digest(index_dir)):
            raise TeragramError(
                f"{name} was fit with another index: refit it on validation text against {index_dir} (teragram eval --index {index_dir} --fit-gate)"
            )

    def save(self, path: str | Path) -> None:
        edges = {
            "len_edges": LEN_EDGES.tolist(),
            "maxp_edges": MAXP_EDGES.tolist(),
            "share_edges": SHARE_EDGES.tolist(),
            "orders": list(ORDERS),
            "cache_lengths": list(CACHE_LENGTHS),
        }
        cc = {"cont_cache": self.cont_cache.to_json()} if self.cont_cache is not None else {}
        fit_for = {"fit_for": self.fit_for} if self.fit_for else {}
        fmt.write_json(Path(path), {"W": self.W.tolist(), "components": list(self.components), **edges, **cc, **fit_for})

    @classmethod
    def load(cls, path: str | Path) -> Gate:
        """A saved gate; one saved with other feature buckets or orders is refused. Gates saved
        before the components had names ("", "1", ..., "c", "c1", ...) load under their names."""
        try:
            d = json.loads(Path(path).read_text())
            W = np.array(d["W"], np.float64)
            same = d["len_edges"] == LEN_EDGES.tolist() and d["maxp_edges"] == MAXP_EDGES.tolist()
            same = same and d["share_edges"] == SHARE_EDGES.tolist() and d["orders"] == list(ORDERS)
            same = same and d["cache_lengths"] == list(CACHE_LENGTHS)
            comps = tuple(LEGACY_NAMES.get(c, c) for c in d["components"])
            cc = ContCache.from_json(d["cont_cache"]) if "cont_cache" in d else None
            fit_for = d.get("fit_for")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TeragramError(f"{path}: not a teragram index gate ({e}); fit it again with this version") from e
        if not same or W.ndim != 2 or W.shape[1] != len(comps):
            raise TeragramError(f"{path}: a gate made for other features (fit it again with this version)")
        try:
            return cls(W, comps, cc, fit_for)
        except TeragramError as e:
            raise TeragramError(f"{path}: {e}") from e


def index_digest(index_dir) -> str:
    """An index's identity, as a gate records it: the digest of its manifest."""
    return fmt.file_digest(Path(index_dir) / "manifest.json")


def exact(components) -> tuple[str, ...]:
    """The exact-match estimates among a gate's components (the continuous cache's left out)."""
    return tuple(c for c in components if not c.startswith("cont_cache_"))


def gate_inputs(est: dict[str, np.ndarray], maxp: np.ndarray, top: np.ndarray, components=COMPONENTS) -> np.ndarray:
    """The gate's design matrix from the estimates and the model's top token and its
    probability at the same positions (the continuous cache, if among the components, adds
    no features: its weights read the same ones)."""
    components = exact(components)
    first = components[0]
    return gate_features(
        est["index_length"] if first == "index_infgram" else est["cache_length"],
        maxp,
        [est[f"count_{s}"] for s in components],
        [est[f"share_{s}"] for s in components],
        [top == est[f"top_{s}"] for s in components],
        est["cache_length"] if first == "index_infgram" and "cache_longest" in components else None,
    )


def component_logp(est: dict[str, np.ndarray], nll_model: np.ndarray, components=COMPONENTS, cont_cache=None) -> np.ndarray:
    """(N, 1 + M) log-probability of each target under the model and each estimate. An estimate
    without occurrences (the cache early in a document) defers to the model, so that every
    mixture stays a distribution. A gate reading the continuous cache takes its target
    probabilities from `cont_cache`: (q (N, len(factors)), first (N,) bool: no history)."""
    n_cc = len(components) - len(exact(components))
    if n_cc and cont_cache is None:
        raise TeragramError("this gate reads the continuous cache: the model's states are needed (not saved outputs without them)")
    lp = [np.where(est[f"count_{s}"] > 0, np.log(est[f"p_{s}"] + 1e-300), -nll_model) for s in exact(components)]
    if n_cc:
        q, first = cont_cache
        if q.shape[1] != n_cc:
            raise TeragramError(f"the continuous cache at {q.shape[1]} temperatures given to a gate that reads {n_cc}")
        lp += [np.where(first, -nll_model, np.log(q[:, c] + 1e-300)) for c in range(n_cc)]
    return np.stack([-nll_model, *lp], 1)


def lookup_estimates(idx, q: np.ndarray, lengths: dict[str, int]) -> tuple[int, dict]:
    """(the ∞-gram's suffix length, {name: (count, tokens, counts)}) after the context q, from
    scratch: the continuations of its last min(length, k) tokens (k = 0: the ∞-gram's)."""
    length = idx.infgram_ntd(q).suffix_len if len(q) else 0
    out = {}
    for c, k in lengths.items():
        k = min(length, k) if k else length
        r = idx.ntd(q[len(q) - k :] if k else q[:0])
        out[c] = (r.prompt_cnt, r.tokens, r.counts)
    return length, out


def index_lengths(gate: Gate) -> dict[str, int]:
    """The index estimates a gate reads, with their context lengths (0: the ∞-gram's): what
    index.scorer.Scorer.estimates looks up for it."""
    return {c: context_length(c) for c in gate.exact_components if c in INDEX}


def next_distribution(
    idx,
    context,
    p_model: np.ndarray,
    gate: Gate,
    p_softmax: np.ndarray | None = None,
    cont_cache: np.ndarray | None = None,
    index_estimates: tuple[int, dict] | None = None,
) -> np.ndarray:
    """The gated next-token distribution (V,) after `context`: next_mixture's distribution."""
    return next_mixture(idx, context, p_model, gate, p_softmax, cont_cache, index_estimates)[0]


def next_mixture(
    idx,
    context,
    p_model: np.ndarray,
    gate: Gate,
    p_softmax: np.ndarray | None = None,
    cont_cache: np.ndarray | None = None,
    index_estimates: tuple[int, dict] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The gated next-token distribution (V,) and the gate's weights (M + 1,: the model, then
    gate.components; Gate.shares sums them by kind) after `context` (a document's tokens so far, EOS
    not included), for generation: the same mixture estimates + gate give in bulk.
    p_model is the model's final distribution; p_softmax its own softmax when the model has
    a mixture head (the gate's confidence and agreement features read the softmax, as in
    model.evaluate.token_eval). A gate reading the continuous cache takes its distributions
    (len(factors), V) from `cont_cache` (cont_cache.LiveCache.distributions; None: no history,
    it defers to the model). index_estimates: the index's estimates after the context, as an
    incremental scorer gives them ((the ∞-gram's length, Scorer.estimates(index_lengths(gate))));
    None: looked up here."""
    V = len(p_model)
    q = np.asarray(context, np.int64)
    p_softmax = p_model if p_softmax is None else p_softmax
    top_m = int(np.argmax(p_softmax))
    comps = gate.exact_components
    dists, counts = {}, {}
    length = 0
    if any(c in INDEX for c in comps):
        length, est = index_estimates if index_estimates is not None else lookup_estimates(idx, q, index_lengths(gate))
        for c, (n, toks, cnts) in est.items():
            d = np.zeros(V)
            d[toks] = cnts / max(n, 1)
            dists[c], counts[c] = d, n
    cache, clen = cache_live(q, V, comps)
    for c, (d, n) in cache.items():
        dists[c], counts[c] = d, n
    X = gate_features(
        np.array([length if comps[0] == "index_infgram" else clen]),
        np.array([p_softmax[top_m]]),
        [np.array([counts[c]]) for c in comps],
        [np.array([dists[c].max()]) for c in comps],
        [np.array([counts[c] > 0 and int(np.argmax(dists[c])) == top_m]) for c in comps],
        np.array([clen]) if comps[0] == "index_infgram" and "cache_longest" in comps else None,
    )
    w = gate(X)[0]
    mix = w[0] * p_model + sum(wi * (dists[c] if counts[c] > 0 else p_model) for wi, c in zip(w[1 : 1 + len(comps)], comps, strict=True))
    for c, wi in enumerate(w[1 + len(comps) :]):
        mix = mix + wi * (cont_cache[c] if cont_cache is not None else p_model)
    return mix, w
