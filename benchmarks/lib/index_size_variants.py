"""The variants of the index-size benchmark (benchmarks/index_size.py's docstring says what each
is) on one held-out set's saved outputs and index estimates: each fit on the validation half and
applied to the test half; the product's choice as `teragram eval --fit-gate` makes it; and which
test documents are decontaminated (fewer than 80% of their 13-grams in the index)."""

from __future__ import annotations

import numpy as np

HALVES = ("valid", "test")  # of each held-out set: every λ and gate is fit on valid, reported on test
NAMES = {
    "a": "(a) no index",
    "c": "(c) infini-gram interpolation",
    "c+c": "(c+cache) infini-gram interpolation + document cache",
    "t-c": "(t-c) index gate, index estimates only",
    "a+c": "(a+c) cache gate, no index",
    "t": "(t) index + cache gate",
}
# with outputs saved with the continuous cache (the gpu stage's since issue 46)
CC_NAMES = {
    "a+cc": "(a+c+cc) cache gate + continuous cache, no index",
    "t+cc": "(t+cc) index + cache gate + continuous cache",
    "choice": "product: eval --fit-gate's choice",
}
FIT_ROWS = 100_000  # each gate is fit on this many validation targets (a fixed random sample)


def contamination_share(est: dict, starts: np.ndarray) -> np.ndarray:
    """Per document, the share of its 13-grams found in the index (index.heldout.ngram_share, the
    rule `teragram eval --decontaminate` applies): the ∞-gram match of the context before
    target j + 1 is the longest match ending at the document's position j."""
    from teragram.index.heldout import ngram_share

    # the targets of document k sit at starts[k] .. starts[k + 1] - 1 (its ids, then EOS)
    return np.array([ngram_share(est["index_length"][int(starts[k]) + 1 : int(starts[k + 1])]) for k in range(len(starts) - 1)])


def clean_documents(o, est: dict) -> np.ndarray:
    """Per document of saved outputs `o` (model/evaluation/outputs.py), whether it is decontaminated: fewer
    than 80% of its 13-grams in the index (infini-gram's criterion). A target's: [o.doc]."""
    from teragram.index import format as fmt
    from teragram.index.heldout import DECONTAMINATION_SHARE

    starts = np.asarray(fmt.open_array(o.path / "000000" / "docs.bin", "docs")).astype(np.int64)
    return contamination_share(est, starts) < DECONTAMINATION_SHARE


def variants(o: dict, est: dict, cache_only: dict | None) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    """Per-target nll of each variant on valid and test, and the peers' fitted weights; λ, weights
    and gates fit on valid. The cache-only gates (a+c; a+cc with the continuous cache) read no
    index: each is fit once per set (cache_only, when given, holds those results by name)."""
    from teragram.model.evaluation.outputs import gated_outputs
    from teragram.model.mixture import baselines, estimates

    nll = {"a": {h: o[h].nll.astype(np.float64) for h in HALVES}}
    groups = {h: est[h]["sparse"].astype(int) for h in HALVES}
    lam = baselines.fit_lambdas(nll["a"]["valid"], est["valid"]["p_index_infgram"], groups["valid"])
    nll["c"] = {h: baselines.apply_lambdas(nll["a"][h], est[h]["p_index_infgram"], lam, groups[h]) for h in HALVES}
    mix = {h: baselines.infgram_cache_inputs(est[h]) for h in HALVES}  # (p_inf, p_cache, groups)
    cw = baselines.fit_cache_weights(nll["a"]["valid"], *mix["valid"])
    nll["c+c"] = {h: baselines.apply_cache_weights(nll["a"][h], *mix[h][:2], cw, mix[h][2]) for h in HALVES}
    gated = {"t-c": dict(components=estimates.INDEX), "a+c": dict(components=estimates.CACHE), "t": dict(components=estimates.COMPONENTS)}
    if o["valid"].cont_cache is not None:
        gated |= {"t+cc": dict(cont_cache=True), "a+cc": dict(components=estimates.CACHE, cont_cache=True)}
    for v, kw in gated.items():
        if cache_only and v in cache_only:
            nll[v] = cache_only[v]
            continue
        gate, nll_valid = gated_outputs(o["valid"], est["valid"], fit_rows=FIT_ROWS, **kw)
        nll[v] = {"valid": nll_valid, "test": gated_outputs(o["test"], est["test"], gate)[1]}
    weights = {
        "c": {"non-sparse": lam.get(0, 0.0), "sparse": lam.get(1, 0.0)},
        "c+c": {baselines.CACHE_GROUPS[g]: dict(zip(baselines.CACHE_WEIGHTS, wg, strict=True)) for g, wg in cw.items()},
    }
    if o["valid"].cont_cache is not None:
        nll["choice"], weights["choice"] = product_choice(o, est)
    return nll, weights


def product_choice(o: dict, est: dict) -> tuple[dict[str, np.ndarray], dict]:
    """What `teragram eval --outputs VALID --fit-gate G` then `--outputs TEST --gate G` give: the
    product's gate, chosen and fit on every validation target (model/evaluation/perplexity.gated,
    the code eval runs), and applied to the test half. Returns (per-target nll, its choice)."""
    from teragram.model.evaluation.mixing import gated
    from teragram.model.evaluation.outputs import gated_outputs
    from teragram.model.evaluation.perplexity import EvalOptions

    v = o["valid"]
    r = {"nll": v.nll, "maxp": v.maxp, "top": v.top.astype(np.int64), "target": v.target, "doc": v.doc, "cont_cache": v.cont_cache}
    nll_valid, gate, info = gated(r, est["valid"], np.ones(len(v.nll), bool), EvalOptions(fit_gate=True))
    return {"valid": nll_valid, "test": gated_outputs(o["test"], est["test"], gate)[1]}, info.get(
        "gate_choice", {"chosen": "gate+cont_cache" if gate.cont_cache is not None else "gate", "held_out_half_perplexity": {}}
    )  # one validation document: nothing to choose on
