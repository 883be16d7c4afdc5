"""Held-out evaluation: per-token log-probabilities, perplexity and bits per byte.

Each held-out document is read as EOS + its tokens and predicts its tokens + EOS, in windows
of the model's context (no window spans two documents); every token is predicted once.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from teragram.index.errors import TeragramError
from teragram.index.features import Features
from teragram.model.gpt import GPT, to_torch
from teragram.model.mixture import cont_cache as cc
from teragram.model.mixture.estimates import COMPONENTS, heldout_estimates
from teragram.model.mixture.gate import Gate, component_logp, gate_inputs, mix_nll_multi
from teragram.model.training.data import EvalData


@torch.no_grad()
def token_eval(
    model: GPT,
    heldout: str | Path,
    eos: int,
    sep: int,
    device: str = "cpu",
    *,
    batch: int = 16,
    hidden: bool | str = False,
) -> dict:
    """Per predicted token: nll (mixture when the model has one), nll_model (the model's own
    softmax), maxp and top (its most likely token and that token's probability), target, doc
    (document number), pos (index of the target in EOS+doc+EOS order minus one), and with
    hidden=True the final hidden state (for kNN-LM queries; hidden="ffn_in": the continuous
    cache's key states, model/mixture/cont_cache.key_states)."""
    ev = EvalData(heldout, model.cfg.block_size, eos, sep)
    key = "final" if hidden is True else hidden
    was = model.training
    model.eval()
    cuda = str(device).startswith("cuda")
    out: dict[str, list] = {k: [] for k in ("nll", "nll_model", "maxp", "top", "target", "doc", "pos", "hidden")}
    buf: list = []

    def flush():
        T = max(len(b[0]) for b in buf)
        n = len(buf)
        x = torch.full((n, T), eos, dtype=torch.long)
        y = torch.full((n, T), eos, dtype=torch.long)
        mask = torch.zeros((n, T), dtype=torch.bool)
        padded = []  # each window's features, padded with "nothing found" to T positions
        for i, (xx, yy, ff, _, _) in enumerate(buf):
            m = len(xx)
            x[i, :m], y[i, :m], mask[i, :m] = torch.from_numpy(xx), torch.from_numpy(yy), True
            padded.append(Features.combine([ff, Features.empty(T - m, ev.k, (np.int64,) * 5)]))
        f = to_torch(Features.combine(padded, np.stack), device) if model.cfg.use_index else None
        xd, yd = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda), cc.key_states(model, key) if hidden else nullcontext() as got:
            h, _ = model.hidden(xd, f)
            nll, logp = model.head_losses(h, yd, f)
        nll_model = -logp.gather(-1, yd.unsqueeze(-1)).squeeze(-1)
        maxlp, top = logp.max(-1)
        mk = mask.to(device)
        out["nll"].append(nll[mk].cpu().numpy())
        out["nll_model"].append(nll_model[mk].cpu().numpy())
        out["maxp"].append(maxlp[mk].exp().cpu().numpy())
        out["top"].append(top[mk].cpu().numpy())
        out["target"].append(y[mask].numpy())
        if hidden:
            out["hidden"].append(got[0].float()[mk].cpu().numpy())
        for xx, _, _, d, s in buf:
            out["doc"].append(np.full(len(xx), d))
            out["pos"].append(np.arange(s, s + len(xx)))
        buf.clear()

    for d, s, xx, yy, ff in ev.windows():
        buf.append((xx, yy, ff, d, s))
        if len(buf) == batch:
            flush()
    if buf:
        flush()
    model.train(was)
    res = {k: np.concatenate(v) if v else np.zeros(0) for k, v in out.items()}
    return res


def doc_bytes(ev: EvalData, decode) -> np.ndarray:
    """UTF-8 bytes of each held-out document's text."""
    return np.array(
        [
            len(decode(np.asarray(ev.tokens[int(ev.starts[d]) : int(ev.starts[d + 1]) - 1]).tolist()).encode())
            for d in range(len(ev.starts) - 1)
        ]
    )


def summarize(nll: np.ndarray, nbytes: int) -> dict:
    n = len(nll)
    tot = float(np.sum(nll))
    return {
        "tokens": n,
        "loss": tot / max(n, 1),
        "perplexity": math.exp(tot / max(n, 1)),
        "bits_per_byte": tot / math.log(2) / max(nbytes, 1),
        "bytes": int(nbytes),
    }


def evaluate(model: GPT, heldout: str | Path, eos: int, sep: int, device: str = "cpu", batch: int = 16) -> dict:
    """Perplexity and bits per byte of the held-out features' text."""
    from teragram.index.tokenizer import load

    r = token_eval(model, heldout, eos, sep, device, batch=batch)
    ev = EvalData(heldout, model.cfg.block_size, eos, sep)
    sp = load(Path(heldout) / "tokenizer.model")
    return summarize(r["nll"], int(doc_bytes(ev, sp.decode).sum()))


def gated_eval(
    model, index, heldout, device: str = "cpu", *, gate: Gate | None = None, cont_cache: bool = True, workers: int = 1, batch: int = 16
):
    """(gate, per-token nll of the model, per-token nll of the gated mixture) on the held-out
    features' text (index: its directory, or an opened Index or ClusterIndex). With gate=None a
    gate is fit on this text (the better of (t) and, with cont_cache, (t+cc): `gated`), which
    should then be validation text, never the text it will be reported on."""
    from teragram.index.engine import as_index

    idx = as_index(index)
    opts = EvalOptions(gate=gate, fit_gate=gate is None, cont_cache=cont_cache, workers=workers)
    r = token_eval(model, heldout, idx.eos_id, idx.sep, device, batch=batch, hidden=needs_states(opts) and cc.KEY)
    if needs_states(opts):
        r["cont_cache"] = cont_cache_of(r, gate.cont_cache if gate is not None else None, device)
    est = heldout_estimates(idx, heldout, workers)
    mixed, fitted, _ = gated(r, est, np.ones(len(r["nll"]), bool), opts)
    return fitted if fitted is not None else gate, r["nll"], mixed


class Stages(dict):
    """Seconds spent in each stage of an evaluation, by name (`teragram eval --json` reports them
    under "stages_s"): `with stages("model"): ...` adds the block's wall time."""

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - t


@dataclass(frozen=True)
class EvalOptions:
    """What `teragram eval` mixes in and over which documents (see heldout_report)."""

    gate: Gate | None = None  # a fitted index gate to apply
    fit_gate: bool = False  # fit the gate on this text (validation): the candidates compared, the best kept
    cont_cache: bool = True  # a fitted gate may read the continuous cache ((t+cc) among the candidates)
    baseline: str | None = None  # "infini-gram", "infini-gram+cache" or "knn" (baselines.py)
    params: dict | None = None  # the baseline's fitted parameters to apply
    decontaminate: bool = False  # drop documents with >= 80% of their 13-grams in the index
    dense: str | Path | None = None  # the kNN baseline's dense store (default IDX/dense)
    workers: int = 1  # processes for the index estimates


def heldout_report(
    model: GPT, index, heldout, device: str = "cpu", opts: EvalOptions = EvalOptions(), *, batch: int = 16, stages: Stages | None = None
):
    """(report, fitted) of held-out features' text: perplexity and bits per byte of the model,
    or of its mixture with the index gate or a peer's interpolation (with the model alone under
    "model"); fitted is what was fit here (a Gate, or the baseline's parameters), else None.
    With decontaminate, documents with >= 80% of their 13-grams in the index are left out of
    everything, fitting included, and the report says how many. index: its directory, or an
    opened Index or ClusterIndex (index/cluster.py: the estimates computed by its holders)."""
    from teragram.index.engine import as_index
    from teragram.index.tokenizer import load

    idx = as_index(index)
    stages = Stages() if stages is None else stages
    with stages("model"):
        hidden = opts.baseline == "knn" or (needs_states(opts) and cc.KEY)
        r = token_eval(model, heldout, idx.eos_id, idx.sep, device, batch=batch, hidden=hidden)
    ev = EvalData(heldout, model.cfg.block_size, idx.eos_id, idx.sep)
    per_doc = doc_bytes(ev, load(Path(heldout) / "tokenizer.model").decode)
    return mix_report(r, per_doc, idx, heldout, opts, device=device, stages=stages)


def needs_states(opts: EvalOptions) -> bool:
    """Whether the mixture asked for reads the continuous cache (the model's key states)."""
    if opts.gate is not None:
        return opts.gate.cont_cache is not None
    return opts.fit_gate and opts.cont_cache


def halves(doc: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fit_on, held): row masks of the kept rows split by document, every other kept document
    (by number) held out. `--fit-gate` fits each candidate (and the continuous cache's scale) on
    fit_on and compares the candidates on held."""
    docs = np.unique(doc[keep])
    held = np.isin(doc, docs[1::2]) & keep
    return keep & ~held, held


def cont_cache_of(
    r: dict, spec: cc.ContCache | None, device: str = "cpu", *, fit_rows: np.ndarray | None = None
) -> tuple[cc.ContCache, np.ndarray]:
    """(spec, q (N, len(factors))): the continuous cache's probability of every target of
    token_eval's result r (with its key states under "hidden"); without a spec, the scale is fit
    on this text's rows fit_rows (a mask; None: the fitting half of every document, halves),
    which should then be validation text: the half of it that `--fit-gate` fits the candidates
    on, never the half that compares them."""
    if spec is None:
        rows = halves(r["doc"], np.ones(len(r["doc"]), bool))[0] if fit_rows is None else fit_rows
        spec = cc.ContCache(cc.fit_scale(r["hidden"][rows], r["doc"][rows], device, window=cc.WINDOW), window=cc.WINDOW)
    q = cc.target_probs(r["hidden"], r["target"], r["doc"], spec.temperatures, device, window=spec.window)
    return spec, q.astype(np.float32).astype(np.float64)  # as saved outputs keep it: both paths give the same figures


def mix_report(
    r: dict, per_doc: np.ndarray, index, heldout, opts: EvalOptions = EvalOptions(), *, device: str = "cpu", stages: Stages | None = None
):
    """heldout_report's mixing half, from a model's per-token outputs r (token_eval's fields:
    nll, maxp, top, target, doc, and hidden for the kNN baseline; "cont_cache" as saved, or the
    continuous cache's key states under "hidden", read here on device) on the documents of
    `heldout` (held-out features, or saved outputs: model/evaluation/outputs.py), per_doc their
    UTF-8 bytes; index: its directory, or an opened Index or ClusterIndex. With decontaminate,
    the mixture over all documents is reported too ("all_documents"); each stage's seconds
    under "stages_s"."""
    from teragram.index.engine import as_index
    from teragram.index.heldout import DECONTAMINATION_SHARE, contamination
    from teragram.model.mixture import baselines

    idx = as_index(index)
    stages = Stages() if stages is None else stages
    if opts.baseline is not None and opts.baseline not in baselines.BASELINES:
        raise TeragramError(f"unknown baseline {opts.baseline!r}; expected {' or '.join(baselines.BASELINES)}")
    if opts.baseline is not None and (opts.gate is not None or opts.fit_gate):
        raise TeragramError("give either the index gate or a baseline, not both")
    if opts.baseline == "knn" and "hidden" not in r:
        raise TeragramError("the kNN baseline needs the model's hidden states: evaluate with --checkpoint, not saved outputs")
    keep_docs = np.ones(len(per_doc), bool)
    extra = {}
    if opts.decontaminate:
        with stages("decontaminate"):
            keep_docs = contamination(heldout, idx) < DECONTAMINATION_SHARE
        extra["decontaminated"] = {"dropped_docs": int((~keep_docs).sum()), "docs": len(keep_docs)}
    keep = keep_docs[r["doc"].astype(int)]
    if needs_states(opts) and "cont_cache" not in r and "hidden" in r:  # saved outputs bring theirs, or none
        spec = opts.gate.cont_cache if opts.gate is not None else None
        with stages("cont_cache"):
            r["cont_cache"] = cont_cache_of(r, spec, device, fit_rows=halves(r["doc"], keep)[0])
    nbytes = int(per_doc[keep_docs].sum())
    alone = summarize(r["nll"][keep], nbytes)
    fitted = None
    if opts.gate is not None or opts.fit_gate:
        with stages("estimates"):
            est = heldout_estimates(idx, heldout, opts.workers)
        with stages("gate_fit" if opts.fit_gate else "gate"):
            mixed, fitted, info = gated(r, est, keep, opts)
        extra |= info
    elif opts.baseline == "infini-gram":
        est = heldout_estimates(idx, heldout, opts.workers)
        p_inf, groups = est["p_index_infgram"], est["sparse"].astype(int)
        params = opts.params if opts.params is not None else baselines.fit_lambdas(r["nll"][keep], p_inf[keep], groups[keep])
        fitted = None if opts.params is not None else params
        mixed = baselines.apply_lambdas(r["nll"], p_inf, params, groups)
        extra["lambdas"] = {"non_sparse": params.get(0, 0.0), "sparse": params.get(1, 0.0)}
    elif opts.baseline == "infini-gram+cache":
        est = heldout_estimates(idx, heldout, opts.workers)
        p_inf, p_cache, groups = baselines.infgram_cache_inputs(est)
        params = (
            opts.params
            if opts.params is not None
            else baselines.fit_cache_weights(r["nll"][keep], p_inf[keep], p_cache[keep], groups[keep])
        )
        fitted = None if opts.params is not None else params
        mixed = baselines.apply_cache_weights(r["nll"], p_inf, p_cache, params, groups)
        names = ("model", "infgram", "cache")
        extra["weights"] = {baselines.CACHE_GROUPS[g]: dict(zip(names, w, strict=True)) for g, w in params.items()}
    elif opts.baseline == "knn":
        from teragram.index.dense import DenseStore

        dist, vals = DenseStore(opts.dense or Path(idx.path) / "dense").search(r["hidden"], baselines.KNN_NEIGHBOURS)
        y = r["target"].astype(np.int64)
        params = opts.params if opts.params is not None else baselines.fit_knn(r["nll"][keep], dist[keep], vals[keep], y[keep])
        fitted = None if opts.params is not None else params
        mixed = baselines.knn_nll(r["nll"], dist, vals, y, params)
        extra["knn"] = {"lambda": params["lambda"], "temperature": params["temperature"]}
    else:
        return alone | extra | {"stages_s": dict(stages)}, None
    if opts.decontaminate:
        extra["all_documents"] = summarize(mixed, int(per_doc.sum())) | {"model": summarize(r["nll"], int(per_doc.sum()))}
    return summarize(mixed[keep], nbytes) | {"model": alone} | extra | {"stages_s": dict(stages)}, fitted


def gated(r: dict, est: dict, keep: np.ndarray, opts: EvalOptions) -> tuple[np.ndarray, Gate | None, dict]:
    """(per-target nll of the gated mixture, the gate fit here or None, what to report).
    With opts.gate, that gate. With opts.fit_gate, the candidates -- the gate over the exact-match
    estimates (t) and, when the model's states are given, the same gate with the continuous
    cache (t+cc) -- are each fit on half of the kept documents and scored on the other half; the
    better one is fit again on all of them and returned, and every candidate's score reported."""
    spec, q = r.get("cont_cache", (None, None))
    ccols = (q, cc.first_rows(r["doc"])) if q is not None else None
    if opts.gate is not None:
        gate = opts.gate
        if gate.cont_cache is not None and gate.cont_cache != spec:
            raise TeragramError("the gate reads the continuous cache at another scale than these outputs were saved with")
        X = gate_inputs(est, r["maxp"], r["top"], gate.exact_components)
        return mix_nll_multi(component_logp(est, r["nll"], gate.components, ccols), gate(X)), None, {}
    X = gate_inputs(est, r["maxp"], r["top"], COMPONENTS)
    candidates = {"gate": (COMPONENTS, None)}
    if spec is not None:
        candidates["gate+cont_cache"] = (COMPONENTS + spec.names, spec)
    fit_on, held = halves(r["doc"], keep)
    scores, logps = {}, {}
    for name, (comps, s) in candidates.items():
        logps[name] = lp = component_logp(est, r["nll"], comps, ccols)
        if len(candidates) > 1 and held.any() and fit_on.any():
            g = Gate.fit(X[fit_on], lp[fit_on], components=COMPONENTS, cont_cache=s)
            scores[name] = float(math.exp(mix_nll_multi(lp[held], g(X[held])).mean()))
    best = min(scores, key=scores.get) if scores else next(iter(candidates))
    comps, s = candidates[best]
    gate = Gate.fit(X[keep], logps[best][keep], components=COMPONENTS, cont_cache=s)
    info = {"gate_choice": {"chosen": best, "held_out_half_perplexity": scores}} if scores else {}
    return mix_nll_multi(logps[best], gate(X)), gate, info
