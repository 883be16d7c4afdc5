"""Peers' interpolations of a model with retrieval estimates, fit on validation text.

infini-gram mixes the model with the ∞-gram distribution

    p(y) = (1 - λ) p_model(y) + λ p_inf(y),   p_inf(y) = cnt(s y) / cnt(s)

where s is the longest suffix of the context found in the index, with one constant λ for
"sparse" positions (a single continuation follows s) and one for the rest, each picked from a
grid by validation loss. kNN-LM mixes in the same way, with one λ, the distribution of a dense
store's nearest neighbours' next tokens (softmax of -distance / temperature). Both are
`teragram eval --baseline infini-gram|knn`, fit with --fit-lambdas on validation text.
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

BASELINES = ("infini-gram", "knn")


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
    return params
