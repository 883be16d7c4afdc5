"""A model's per-token outputs mixed with the index's and the caches' estimates (the gate) or by a
peer's interpolation, a chunk of documents at a time (model/evaluation/stream.py), and the fits
of what is mixed: `mix_stream`, `teragram eval`'s mixing half.

Per chunk: the estimates of its documents, the ∞-gram's match lengths that decontamination
reads, the continuous cache from the model's key states, then either the mixture (a gate or
parameters given) or its inputs spilled for the fit. After the last chunk a fit reads the spill:
the gate's candidates (choose_gate) or a baseline's parameters, and mixes every token with them.
What an evaluation is asked to mix (EvalOptions) and its stage timer (Stages) live here too.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from teragram.index.errors import TeragramError
from teragram.model.evaluation.stream import CHUNK_TOKENS, FIT_ROWS, DocSums, Spill, blocks, prefetch, sample_rows
from teragram.model.mixture import cont_cache as cc
from teragram.model.mixture.estimates import COMPONENTS, docs_estimates, infgram_lengths, piece_estimates
from teragram.model.mixture.gate import Gate, GateX, component_logp, gate_inputs, mix_nll_multi

_STAGES_LOCK = threading.Lock()


class Stages(dict):
    """Seconds spent in each stage of an evaluation, by name (`teragram eval --json` reports them
    under "stages_s"): `with stages("model"): ...` adds the block's wall time. Stages of a
    streamed evaluation overlap (the model runs ahead, the index's side looks several chunks up
    at once and sums each one's time): their sum exceeds the wall time."""

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            with _STAGES_LOCK:
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
    chunk_tokens: int = CHUNK_TOKENS  # targets read, run and mixed at a time (peak memory follows it)
    fit_rows: int = FIT_ROWS  # tokens a candidate gate (or a baseline's parameters) is fit on at most
    spill: str | Path | None = None  # where a fit's per-token inputs are spilled (default: the system's temporary directory)


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
    r: dict, spec: cc.ContCache | None, device: str = "cpu", *, fit_rows: np.ndarray | None = None, before=None
) -> tuple[cc.ContCache, np.ndarray]:
    """(spec, q (N, len(factors))): the continuous cache's probability of every target of
    forward_docs's result r (with its key states under "hidden", an array or a tensor); without
    a spec, the scale is fit on this text's rows fit_rows (a mask; None: the fitting half of
    every document, halves), which should then be validation text: the half of it that
    `--fit-gate` fits the candidates on, never the half that compares them. before: (key states,
    targets) of the last rows of r's first document read in an earlier piece (ContCarry)."""
    import torch

    h = r["hidden"]
    if spec is None:
        rows = halves(r["doc"], np.ones(len(r["doc"]), bool))[0] if fit_rows is None else fit_rows
        hr = h[torch.as_tensor(rows, device=h.device)] if torch.is_tensor(h) else h[rows]
        spec = cc.ContCache(cc.fit_scale(hr, r["doc"][rows], device, window=cc.WINDOW), window=cc.WINDOW)
    target, doc, m = r["target"], r["doc"], 0
    if before is not None and len(before[1]):
        hb, tb = before
        m = len(tb)
        h = torch.cat([torch.as_tensor(hb).to(h.device), h]) if torch.is_tensor(h) else np.concatenate([hb, h])
        target, doc = np.concatenate([tb, target]), np.concatenate([np.full(m, doc[0]), doc])
    q = cc.target_probs(h, target, doc, spec.temperatures, device, window=spec.window, start=m)[m:]
    return spec, q.astype(np.float32).astype(np.float64)  # as saved outputs keep it: both paths give the same figures


class ContCarry:
    """The continuous cache over a stream of chunks (stream.Chunk) whose documents may come in
    pieces: a piece reads the last `window` key states (and targets) of its document's earlier
    pieces; the scale is the one given, or fit on the first chunk (cont_cache_of)."""

    def __init__(self, spec: cc.ContCache | None, device: str = "cpu"):
        self.spec, self.device, self.before = spec, device, None

    def __call__(self, ch, fit_rows: np.ndarray | None = None) -> tuple[cc.ContCache, np.ndarray]:
        r = ch.r
        before = self.before if ch.offset else None
        self.spec, q = cont_cache_of(r, self.spec, self.device, fit_rows=fit_rows, before=before)
        self.before = None
        if ch.open:
            h = r["hidden"]
            h = h.float().cpu().numpy() if hasattr(h, "cpu") else np.asarray(h)
            t = np.asarray(r["target"], np.int64)
            if before is not None:
                h, t = np.concatenate([before[0], h]), np.concatenate([before[1], t])
            self.before = (h[-self.spec.window :], t[-self.spec.window :])
        return self.spec, q


def first_rows(r: dict) -> np.ndarray:
    """(N,) bool: the rows of outputs r that are their document's first target, where the
    continuous cache has no history (a piece's first row is not: stream.Chunk)."""
    return np.asarray(r["pos"]) == 0 if "pos" in r else cc.first_rows(r["doc"])


def gate_weights(gate: Gate, r: dict, est: dict) -> np.ndarray:
    """The gate's mixture weights (N, M) at every target of r (the model's outputs) from the
    estimates est: what the gate reads before the target is known."""
    return gate(gate_inputs(est, r["maxp"], r["top"], gate.exact_components))


def apply_gate(gate: Gate, r: dict, est: dict, weights: np.ndarray | None = None) -> np.ndarray:
    """Per-target nll of the gated mixture of r (the model's outputs, with "cont_cache" when the
    gate reads it) and the estimates est (weights: gate_weights's, when computed already)."""
    spec, q = r.get("cont_cache", (None, None))
    if gate.cont_cache is not None and gate.cont_cache != spec:
        raise TeragramError("the gate reads the continuous cache at another scale than these outputs were saved with")
    ccols = (q, first_rows(r)) if q is not None else None
    w = gate_weights(gate, r, est) if weights is None else weights
    return mix_nll_multi(component_logp(est, r["nll"], gate.components, ccols), w)


def fit_inputs(r: dict, est: dict) -> tuple[GateX, np.ndarray, cc.ContCache | None]:
    """(X, logp, spec) that `--fit-gate` fits on: the gate's features over every exact-match
    estimate and the log-probabilities of the model, each estimate and, when r has it, the
    continuous cache (its columns last: (t) is the first 1 + len(COMPONENTS) columns)."""
    spec, q = r.get("cont_cache", (None, None))
    ccols = (q, first_rows(r)) if q is not None else None
    comps = COMPONENTS + (spec.names if spec is not None else ())
    return gate_inputs(est, r["maxp"], r["top"], COMPONENTS), component_logp(est, r["nll"], comps, ccols), spec


def _mixed(gate: Gate, X: GateX, lp: np.ndarray, rows=None) -> np.ndarray:
    """The gate's mixture nll of rows (a mask; None: all) of X and logp, a block at a time."""
    m = len(gate.components) + 1
    out = []
    for b in blocks(len(X)):
        sel = np.arange(b.start, b.stop) if rows is None else b.start + np.flatnonzero(rows[b])
        out.append(mix_nll_multi(np.asarray(lp[sel])[:, :m], gate(X[sel])))
    return np.concatenate(out) if out else np.zeros(0)


def choose_gate(X: GateX, lp: np.ndarray, keep: np.ndarray, held: np.ndarray, spec, fit_rows: int) -> tuple[Gate, dict]:
    """The `--fit-gate` choice: the gate over the exact-match estimates (t) and, with the
    continuous cache's columns in lp (spec), the same gate with it (t+cc), each fit on at most
    fit_rows tokens of the kept rows not held (a fixed random sample) and scored on every held
    row; the better one fit again on at most fit_rows of all kept rows."""
    candidates = {"gate": (1 + len(COMPONENTS), None)}
    if spec is not None:
        candidates["gate+cont_cache"] = (lp.shape[1], spec)
    fit_on = keep & ~held
    scores = {}
    if len(candidates) > 1 and held.any() and fit_on.any():
        rows = sample_rows(fit_on, fit_rows)
        Xs, lps = X[rows], np.asarray(lp[rows])
        for name, (m, s) in candidates.items():
            g = Gate.fit(Xs, lps[:, :m], components=COMPONENTS, cont_cache=s)
            scores[name] = float(math.exp(_mixed(g, X, lp, held).mean()))
    best = min(scores, key=scores.get) if scores else next(iter(candidates))
    m, s = candidates[best]
    rows = sample_rows(keep, fit_rows)
    gate = Gate.fit(X[rows], np.asarray(lp[rows])[:, :m], components=COMPONENTS, cont_cache=s)
    info = {"gate_choice": {"chosen": best, "held_out_half_perplexity": scores}} if scores else {}
    return gate, info | {"gate_fit_rows": {"fit_on": len(rows), "kept": int(keep.sum())}}


def gated(r: dict, est: dict, keep: np.ndarray, opts: EvalOptions) -> tuple[np.ndarray, Gate | None, dict]:
    """(per-target nll of the gated mixture, the gate fit here or None, what to report) of outputs
    and estimates held in memory: opts.gate applied, or with opts.fit_gate the choose_gate fit
    on the kept rows (halves: every other kept document held out)."""
    if opts.gate is not None:
        return apply_gate(opts.gate, r, est), None, {}
    X, lp, spec = fit_inputs(r, est)
    gate, info = choose_gate(X, lp, keep, halves(r["doc"], keep)[1], spec, opts.fit_rows)
    return _mixed(gate, X, lp), gate, info


# ---- a peer's interpolation (model/mixture/baselines.py) ----------------------------------------


def _baseline_inputs(name: str, r: dict, est: dict | None, store) -> dict[str, np.ndarray]:
    from teragram.model.mixture import baselines

    if name == "infini-gram":
        return {"nll": r["nll"], "p_inf": est["p_index_infgram"], "groups": est["sparse"].astype(np.uint8)}
    if name == "infini-gram+cache":
        p_inf, p_cache, groups = baselines.infgram_cache_inputs(est)
        return {"nll": r["nll"], "p_inf": p_inf, "p_cache": p_cache, "groups": groups.astype(np.uint8)}
    h = r["hidden"]
    dist, vals = store.search(h.cpu().numpy() if hasattr(h, "cpu") else np.asarray(h), baselines.KNN_NEIGHBOURS)
    return {"nll": r["nll"], "dist": dist, "vals": vals, "y": np.asarray(r["target"], np.int64)}


def _baseline_fit(name: str, a: dict, keep: np.ndarray) -> dict:
    from teragram.model.mixture import baselines

    k = {n: np.asarray(v[keep]) for n, v in a.items() if n not in ("doc", "keep")}
    if name == "infini-gram":
        return baselines.fit_lambdas(k["nll"], k["p_inf"], k["groups"].astype(int))
    if name == "infini-gram+cache":
        return baselines.fit_cache_weights(k["nll"], k["p_inf"], k["p_cache"], k["groups"].astype(int))
    return baselines.fit_knn(k["nll"], k["dist"], k["vals"], k["y"])


def _baseline_apply(name: str, a: dict, params: dict, rows=slice(None)) -> np.ndarray:
    from teragram.model.mixture import baselines

    a = {n: np.asarray(v[rows]) for n, v in a.items() if n not in ("doc", "keep")}
    if name == "infini-gram":
        return baselines.apply_lambdas(a["nll"], a["p_inf"], params, a["groups"].astype(int))
    if name == "infini-gram+cache":
        return baselines.apply_cache_weights(a["nll"], a["p_inf"], a["p_cache"], params, a["groups"].astype(int))
    return baselines.knn_nll(a["nll"], a["dist"], a["vals"], a["y"], params)


def _baseline_info(name: str, params: dict) -> dict:
    from teragram.model.mixture import baselines

    if name == "infini-gram":
        return {"lambdas": {"non_sparse": params.get(0, 0.0), "sparse": params.get(1, 0.0)}}
    if name == "infini-gram+cache":
        w = {baselines.CACHE_GROUPS[g]: dict(zip(baselines.CACHE_WEIGHTS, v, strict=True)) for g, v in params.items()}
        return {"weights": w}
    return {"knn": {"lambda": params["lambda"], "temperature": params["temperature"]}}


def _check(opts: EvalOptions) -> None:
    from teragram.model.mixture import baselines

    if opts.baseline is not None and opts.baseline not in baselines.BASELINES:
        raise TeragramError(f"unknown baseline {opts.baseline!r}; expected {' or '.join(baselines.BASELINES)}")
    if opts.baseline is not None and (opts.gate is not None or opts.fit_gate):
        raise TeragramError("give either the index gate or a baseline, not both")


def doc_shares(lengths: np.ndarray, docs) -> np.ndarray:
    """Per document, the share of its 13-grams in the index (index/heldout.ngram_share) from the
    ∞-gram's match length of each target row (the estimates' index_length: a document of n
    tokens has n + 1 rows, the first without context)."""
    from teragram.index.heldout import ngram_share

    at, out = 0, []
    for d in docs:
        out.append(ngram_share(lengths[at + 1 : at + len(d) + 1]))
        at += len(d) + 1
    return np.asarray(out)


def inflight(workers: int) -> tuple[int, int]:
    """(chunks looked up at once, threads each) for `workers` estimate threads: a chunk's lookup
    has serial parts (sorts, the document cache of its longest document), so many threads are
    best spent on several chunks at a time, two threads each (the estimates' stage runs ahead
    of the mixing by as many chunks: peak memory grows with it)."""
    n = max(1, min(8, workers // 2))
    return n, max(1, workers // n)


def _lookup(ch, idx, opts: EvalOptions, stages: Stages, threads: int, carried: int) -> np.ndarray | None:
    """Fill in a chunk's index side (its estimates ch.est, a given gate's weights ch.weights) and
    return the ∞-gram's match length of each of its target rows (None when nothing reads it).
    A piece's index estimates read the document from where the ∞-gram's match at its previous
    target starts (`carried`: that target's match length)."""
    estimating = opts.gate is not None or opts.fit_gate or opts.baseline in ("infini-gram", "infini-gram+cache")
    lengths = None
    if estimating or opts.decontaminate:
        with stages("estimates" if estimating else "decontaminate"):
            if ch.piece:
                context = ch.offset - 1 - carried if ch.offset else 0
                got = piece_estimates(idx, ch.prefix, ch.docs[0], last=not ch.open, context=context, workers=threads, cache=estimating)
                ch.est = got if estimating else None
                lengths = got["index_length"] if estimating else got
            else:
                ch.est = docs_estimates(idx, ch.docs, threads) if estimating else None
                lengths = ch.est["index_length"] if estimating else infgram_lengths(idx, ch.docs, threads)
    if opts.gate is not None:
        with stages("gate_weights"):
            ch.weights = gate_weights(opts.gate, ch.r, ch.est)
    return lengths


def _looked_up(chunks, idx, opts: EvalOptions, stages: Stages):
    """The chunks, in order, with the index's side filled in (_lookup) and, with decontaminate,
    which documents are kept (ch.keep; a document read in pieces: known at its last piece, True
    until then). Several chunks are looked up at once (`inflight`); a piece after a document's
    first waits for the piece before it (its match length)."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from teragram.index.heldout import DECONTAMINATION_N, DECONTAMINATION_SHARE

    n, threads = inflight(opts.workers)
    carried, hits = 0, [0, 0]  # an open document's last ∞-gram length; its 13-grams in the index and all of them
    pending: deque = deque()

    def done():
        nonlocal carried, hits
        ch, fut = pending.popleft()
        lengths = fut.result()
        if ch.piece and lengths is not None:
            carried = int(lengths[-1])
        if opts.decontaminate:
            with stages("decontaminate"):
                if not ch.piece:
                    ch.keep = doc_shares(lengths, ch.docs) < DECONTAMINATION_SHARE
                else:  # doc_shares's rows: target j >= DECONTAMINATION_N reads the n-gram ending at token j - 1
                    at = ch.offset + np.arange(len(lengths)) >= DECONTAMINATION_N
                    hits = hits if ch.offset else [0, 0]
                    hits = [hits[0] + int((lengths[at] >= DECONTAMINATION_N).sum()), hits[1] + int(at.sum())]
                    ch.keep = np.array([ch.open or (hits[0] / hits[1] if hits[1] else 0.0) < DECONTAMINATION_SHARE])
        return ch

    with ThreadPoolExecutor(n) as pool:
        for ch in chunks:
            if ch.offset:  # a later piece reads the match length its previous piece ends with
                while pending:
                    yield done()
            pending.append((ch, pool.submit(_lookup, ch, idx, opts, stages, threads, carried)))
            while len(pending) >= n or (pending and pending[0][1].done()):
                yield done()
        while pending:
            yield done()


def mix_stream(chunks, index, opts: EvalOptions | None = None, *, device: str = "cpu", stages: Stages | None = None):
    """(report, fitted) of the chunks' model outputs (stream.Chunk with r and nbytes), mixed as
    opts asks: perplexity and bits per byte of the model, or of its mixture with the index gate
    or a peer's interpolation (the model alone under "model"); fitted: what was fit here (a Gate,
    or a baseline's parameters), else None. With decontaminate, documents with >= 80% of their
    13-grams in the index are left out of everything, fitting included; the mixture over all
    documents is reported too ("all_documents"). Each stage's seconds under "stages_s"."""
    from teragram.index.engine import as_index

    idx = as_index(index)
    opts = EvalOptions() if opts is None else opts
    stages = Stages() if stages is None else stages
    _check(opts)
    gating = opts.gate is not None or opts.fit_gate
    fitting = opts.fit_gate or (opts.baseline is not None and opts.params is None)
    cont = ContCarry(opts.gate.cont_cache if opts.gate is not None else None, device)
    spec, store = cont.spec, None
    sums, spill, kept, width = DocSums(), Spill(opts.spill) if fitting else None, 0, 0
    try:
        for ch in prefetch(_looked_up(chunks, idx, opts, stages)):  # the index's side a chunk ahead, in a thread of its own
            r = ch.r
            if opts.baseline == "knn" and "hidden" not in r:
                raise TeragramError("the kNN baseline needs the model's hidden states: evaluate with --checkpoint, not saved outputs")
            if opts.baseline == "knn" and store is None:
                from teragram.index.dense import DenseStore

                store = DenseStore(opts.dense or Path(idx.path) / "dense")
            local = np.asarray(r["doc"], np.int64) - ch.first
            est, keep_docs = ch.est, ch.keep if ch.keep is not None else np.ones(len(ch.docs), bool)
            rank = kept + np.cumsum(keep_docs) - 1  # halves: every other kept document, counted over the whole text
            kept += int(keep_docs.sum()) - ch.open  # an open document is counted at its last piece (kept until then)
            keep, held = keep_docs[local], (keep_docs & (rank % 2 == 1))[local]
            if needs_states(opts) and "cont_cache" not in r and "hidden" in r:  # saved outputs bring theirs, or none
                with stages("cont_cache"):
                    r["cont_cache"] = cont(ch, fit_rows=keep & ~held)  # the scale fit on the first chunk's fitting half
                    spec = cont.spec
            mixed = None
            if opts.gate is not None:
                with stages("gate"):
                    mixed = apply_gate(opts.gate, r, est, ch.weights)
            elif opts.fit_gate:
                with stages("gate_fit"):
                    X, lp, spec = fit_inputs(r, est)
                    width = X.width
                    spill.add(cols=X.cols.astype(np.uint16), logp=lp, doc=local + ch.first)
            elif opts.baseline is not None:
                with stages("baseline"):
                    a = _baseline_inputs(opts.baseline, r, est, store)
                    if opts.params is not None:
                        mixed = _baseline_apply(opts.baseline, a, opts.params)
                    else:
                        spill.add(**a, doc=local + ch.first)
            sums.add(ch.first, len(ch.docs), local + ch.first, r["nll"], mixed, ch.nbytes, keep_docs, cont=ch.offset > 0)
            ch.r = ch.est = ch.weights = None
        fitted, info = None, {}
        if spill is not None:
            a = spill.arrays()
            keep_docs = sums.get("keep").astype(bool)  # a document's keep is known after its last piece: the rows' are read from it
            held_docs = keep_docs & (np.cumsum(keep_docs) % 2 == 0)  # every other kept document, counted over the whole text
            keep, held = keep_docs[a["doc"]], held_docs[a["doc"]]
            n_docs, total = len(keep_docs), None
            with stages("gate_fit" if opts.fit_gate else "baseline"):
                if opts.fit_gate:
                    X, lp = GateX(a["cols"], width), a["logp"]
                    fitted, info = choose_gate(X, lp, keep, held, spec, opts.fit_rows)
                    total = _by_doc(a["doc"], (_mixed(fitted, X[b], lp[b]) for b in blocks(len(X))), n_docs)
                else:
                    fitted = _baseline_fit(opts.baseline, a, keep)
                    total = _by_doc(a["doc"], (_baseline_apply(opts.baseline, a, fitted, b) for b in blocks(len(a["nll"]))), n_docs)
            sums.parts["mixed"] = [total]
    finally:
        if spill is not None:
            spill.close()
    if not sums.parts["n"]:
        raise TeragramError("no readable documents in the held-out text")
    keep_docs = sums.get("keep").astype(bool)
    extra = {"decontaminated": {"dropped_docs": int((~keep_docs).sum()), "docs": len(keep_docs)}} if opts.decontaminate else {}
    alone = sums.report("model", keep_docs)
    if not (gating or opts.baseline is not None):
        return alone | extra | {"stages_s": dict(stages)}, None
    if opts.baseline is not None:
        info = _baseline_info(opts.baseline, opts.params if opts.params is not None else fitted)
    if opts.decontaminate:
        extra["all_documents"] = sums.report("mixed") | {"model": sums.report("model")}
    return sums.report("mixed", keep_docs) | {"model": alone} | extra | info | {"stages_s": dict(stages)}, fitted


def _by_doc(doc: np.ndarray, parts, n_docs: int) -> np.ndarray:
    """Per document, the sum of per-row values given a block of rows at a time (in row order)."""
    out, at = np.zeros(n_docs), 0
    for p in parts:
        out += np.bincount(np.asarray(doc[at : at + len(p)], np.int64), weights=p, minlength=n_docs)
        at += len(p)
    return out
