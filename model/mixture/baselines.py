"""Peers' interpolations of a model with retrieval estimates, fit on validation text.

infini-gram mixes the model with the ∞-gram distribution

    p(y) = (1 - λ) p_model(y) + λ p_inf(y),   p_inf(y) = cnt(s y) / cnt(s)

where s is the longest suffix of the context found in the index, with one constant λ for
"sparse" positions (a single continuation follows s) and one for the rest, each picked from a
grid by validation loss. kNN-LM mixes in the same way, with one λ, the distribution of a dense
store's nearest neighbours' next tokens (softmax of -distance / temperature). Both are
`teragram eval --baseline infini-gram|knn`, fit with --fit-lambdas on validation text.

infini-gram's interpolation plus the document cache (the same longest-match cache the gate
reads, estimates.py's cache_longest) is a fixed-weight interpolation of three distributions,

    p(y) = w_model p_model(y) + w_inf p_inf(y) + w_cache p_cache(y),

the classic cache language model's recipe (Kuhn & De Mori) on top of infini-gram's: one set of
weights per group of positions -- sparse or not, crossed with whether the context occurred
earlier in the document -- fit by EM on validation text (deleted interpolation: the weights
that maximise its likelihood). Without an earlier occurrence p_cache is undefined: those groups
mix the model and the ∞-gram only. It is the peer of the gate that reads the same cache.
"""

from __future__ import annotations

import numpy as np

LAMBDAS = np.array([0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99])


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


# ---- infini-gram's interpolation plus the document cache ------------------------------------

CACHE_WEIGHTS = ("model", "infgram", "cache")  # the order of each group's weights
CACHE_GROUPS = ("non-sparse", "sparse", "non-sparse, cached", "sparse, cached")  # infgram_cache_inputs' groups 0..3
EM_ITERATIONS = 1000  # at most; EM stops earlier once the mean loss moves by < EM_TOLERANCE nats
EM_TOLERANCE = 1e-9


def infgram_cache_inputs(est: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(p_inf, p_cache, groups) of each target from estimates.py's estimates. Groups: 0 and 1
    non-sparse and sparse ∞-gram without an earlier occurrence of the context in the document,
    2 and 3 the same with one. Both depend on the context only, not on the target."""
    groups = est["sparse"].astype(int) + 2 * (est["count_cache_longest"] > 0)
    return est["p_index_infgram"], est["p_cache_longest"], groups


def _em_weights(P: np.ndarray) -> np.ndarray:
    """The mixture weights (on the simplex) of the columns of P (n, k), each a distribution's
    probability of the observed targets, that maximise sum log(P @ w): EM from uniform weights.
    The objective is concave, so EM reaches its maximum."""
    w = np.full(P.shape[1], 1.0 / P.shape[1])
    prev = np.inf
    for _ in range(EM_ITERATIONS):
        mix = P @ w + 1e-300  # (n,)
        loss = float(-np.log(mix).mean())
        if prev - loss < EM_TOLERANCE:
            break
        prev = loss
        w = w * (P / mix[:, None]).mean(0)  # the mean responsibility of each distribution
        w /= w.sum()
    return w


def fit_cache_weights(nll_model: np.ndarray, p_inf: np.ndarray, p_cache: np.ndarray, groups: np.ndarray) -> dict[int, tuple[float, ...]]:
    """The weights (model, infgram, cache) of each group of infgram_cache_inputs, by EM on
    these (validation) targets; groups 0 and 1 (no earlier occurrence) mix the model and the
    ∞-gram only, their cache weight is 0."""
    p_model = np.exp(-np.asarray(nll_model, np.float64))
    out = {}
    for grp in np.unique(groups):
        m = groups == grp
        cols = [p_model[m], p_inf[m]] + ([p_cache[m]] if grp >= 2 else [])
        w = _em_weights(np.stack(cols, 1))
        out[int(grp)] = (*map(float, w), *([0.0] if grp < 2 else []))
    return out


def apply_cache_weights(
    nll_model: np.ndarray, p_inf: np.ndarray, p_cache: np.ndarray, weights: dict[int, tuple[float, ...]], groups: np.ndarray
) -> np.ndarray:
    """Per-target nll of the interpolation with fit_cache_weights' weights (a group with none:
    the model alone)."""
    W = np.array([weights.get(g, (1.0, 0.0, 0.0)) for g in range(4)])[np.asarray(groups, int)]  # (n, 3)
    p = W[:, 0] * np.exp(-np.asarray(nll_model, np.float64)) + W[:, 1] * p_inf + W[:, 2] * p_cache
    return -np.log(p + 1e-300)


# ---- kNN-LM --------------------------------------------------------------------------------

KNN_NEIGHBOURS = 64
KNN_TEMPERATURES = (0.3, 1.0, 3.0, 10.0)  # times the median distance to the nearest key


def fit_knn(nll_model: np.ndarray, dist: np.ndarray, vals: np.ndarray, target: np.ndarray) -> dict:
    """kNN-LM's temperature (a grid of multiples of the median nearest distance) and λ (grid),
    by validation loss: {"temperature", "temperature_factor", "lambda"}."""
    from teragram.index.dense import knn_probs

    scale = float(np.median(dist[:, 0])) + 1e-6
    best = None
    for factor in KNN_TEMPERATURES:
        p = knn_probs(dist, vals, target, factor * scale)
        lam = fit_lambdas(nll_model, p, np.zeros(len(p), int))[0]
        loss = float(mix_nll(nll_model, p, lam).mean())
        if best is None or loss < best[0]:
            best = (loss, factor, lam)
    _, factor, lam = best
    return {"temperature": factor * scale, "temperature_factor": factor, "lambda": lam}


def knn_nll(nll_model: np.ndarray, dist: np.ndarray, vals: np.ndarray, target: np.ndarray, params: dict) -> np.ndarray:
    """Per-token nll of the model mixed with the kNN distribution by fit_knn's parameters."""
    from teragram.index.dense import knn_probs

    return mix_nll(nll_model, knn_probs(dist, vals, target, params["temperature"]), params["lambda"])


# ---- fitted parameters, saved and loaded ---------------------------------------------------

BASELINES = ("infini-gram", "infini-gram+cache", "knn")  # eval --baseline


def save_params(path, baseline: str, params: dict) -> None:
    """Write a baseline's fitted parameters (eval --fit-lambdas) as JSON."""
    import json
    from pathlib import Path

    Path(path).write_text(json.dumps({"baseline": baseline, "params": params}, indent=1) + "\n")


def load_params(path, baseline: str) -> dict:
    """A baseline's parameters from save_params; another baseline's or an unreadable file is
    refused with a one-line error."""
    import json
    from pathlib import Path

    from teragram.index.errors import TeragramError

    try:
        d = json.loads(Path(path).read_text())
        kind, params = d["baseline"], d["params"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TeragramError(f"{path}: not baseline parameters ({e.__class__.__name__}); fit them with --fit-lambdas") from None
    if kind != baseline:
        raise TeragramError(f"{path}: parameters of the {kind} baseline, not {baseline}")
    if baseline == "infini-gram":
        return {int(k): float(v) for k, v in params.items()}
    if baseline == "infini-gram+cache":
        return {int(k): tuple(map(float, v)) for k, v in params.items()}
    return params
