"""A model's per-token outputs on held-out text, saved once and mixed later with any index.

Evaluation splits in two: the model runs once (on a GPU) and saves, for every predicted token,
what the index side needs -- the token, the model's loss on it, its most likely token and
that token's probability -- together with the documents' token ids and the tokenizer. The
index side (`evaluate_outputs`, where the big index lives) then computes the index's and the
document cache's estimates of the same targets and mixes them through a gate, exactly as an
evaluation of the model itself would: the model's part of the mixture only ever reads these
four numbers (and the continuous cache's probabilities of the targets, saved beside them).

Directory layout (written with index/format.py's headers, checked on open):

    OUT/manifest.json          kind "model-outputs", checkpoint, tokenizer digest, counts,
                               per-document source, record and UTF-8 bytes
    OUT/tokenizer.model        the tokenizer the ids were made with
    OUT/000000/tokens.bin      the documents' ids: doc0 SEP doc1 SEP ... (as held-out features)
    OUT/000000/docs.bin        document start offsets, then the total length
    OUT/000000/out.*.bin       per target, in the order of model.evaluate.token_eval:
                               nll (float32), maxp (float32), top, target, doc, pos (uint32)
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from teragram.index import format as fmt
from teragram.index import tokenizer
from teragram.index.errors import IndexFormatError, TeragramError, TokenizerMismatch

KIND = "model-outputs"
VERSION = 1
FIELDS = {"nll": np.float32, "maxp": np.float32, "top": np.uint32, "target": np.uint32, "doc": np.uint32, "pos": np.uint32}


@dataclass(frozen=True)
class ModelOutputs:
    """Per-target arrays (N,) and the manifest of a saved outputs directory."""

    path: Path
    manifest: dict
    nll: np.ndarray
    maxp: np.ndarray
    top: np.ndarray
    target: np.ndarray
    doc: np.ndarray
    pos: np.ndarray
    cont_cache: tuple | None = None  # (ContCache, q (N, len(factors))): the continuous cache's p(target), when saved

    @property
    def doc_bytes(self) -> np.ndarray:
        return np.asarray([d["bytes"] for d in self.manifest["docs"]], np.int64)


def save_outputs(
    out: str | Path, r: dict, heldout: str | Path, *, checkpoint: str, step: int, docs_bytes: list[int], model: str | None = None
) -> Path:
    """Write token_eval's result `r` on the held-out directory `heldout` (a held-out features
    directory: its tokens, documents and tokenizer are copied beside the outputs), with the
    continuous cache's target probabilities when r has them (r["cont_cache"]: (spec, q))."""
    out, heldout = Path(out), Path(heldout)
    d = out / "000000"
    d.mkdir(parents=True, exist_ok=True)
    for name in ("tokens.bin", "docs.bin"):
        shutil.copyfile(heldout / "000000" / name, d / name)
    shutil.copyfile(heldout / "tokenizer.model", out / "tokenizer.model")
    for name, dtype in FIELDS.items():
        fmt.write_array(d / f"out.{name}.bin", f"out.{name}", np.asarray(r[name]).astype(dtype))
    spec, q = r.get("cont_cache", (None, None))
    for c, name in enumerate(spec.names if spec is not None else ()):
        fmt.write_array(d / f"out.{name}.bin", f"out.cc{c}", q[:, c].astype(np.float32))  # float32 as the benchmark measured it
    metas = fmt.read_json(heldout / "000000.done")["docs"]
    if len(metas) != len(docs_bytes):
        raise IndexFormatError(f"{heldout}: {len(metas)} documents, {len(docs_bytes)} byte counts")
    fmt.write_json(
        out / "manifest.json",
        {
            "kind": KIND,
            "version": VERSION,
            "checkpoint": str(checkpoint),
            "step": int(step),
            **({"model": model} if model else {}),  # checkpoint.weights_digest: a gate fit on these outputs belongs to it
            "tokenizer": tokenizer.digest(out / "tokenizer.model"),
            "tokens": int(len(r["nll"])),
            "docs": [m | {"bytes": int(b)} for m, b in zip(metas, docs_bytes, strict=True)],
        }
        | ({"cont_cache": spec.to_json()} if spec is not None else {}),
    )
    return out


def save_model_outputs(
    out, model, heldout, idx, device: str = "cpu", *, meta: dict, source: str, hidden: bool = False, cont_cache=None, batch: int = 16
):
    """Run the model over held-out features' text (made against the index idx) once and save
    its outputs; returns (token_eval's result, each document's UTF-8 bytes) for the caller to
    mix as well. The continuous cache's target probabilities are saved too, at the scale of
    `cont_cache` (a ContCache, e.g. of validation outputs saved earlier), or at one fit on this
    text (which should then be validation text): on the half of its documents that `--fit-gate`
    fits on (perplexity.halves)."""
    from teragram.model.evaluation.perplexity import cont_cache_of, doc_bytes, token_eval
    from teragram.model.mixture import cont_cache as cc
    from teragram.model.training.data import EvalData

    eos, sep = idx.eos_id, idx.sep
    r = token_eval(model, heldout, eos, sep, device, batch=batch, hidden=hidden or cc.KEY)
    r["cont_cache"] = cont_cache_of(r, cont_cache, device)
    if hidden is not True:
        r.pop("hidden")
    per_doc = doc_bytes(EvalData(heldout, model.cfg.block_size, eos, sep), idx.decode)
    from teragram.model.checkpoint import weights_digest

    save_outputs(out, r, heldout, checkpoint=source, step=meta["step"], docs_bytes=per_doc.tolist(), model=weights_digest(model))
    return r, per_doc


def outputs_report(outputs: ModelOutputs, index, opts):
    """`teragram eval --outputs`: model.evaluate.mix_report of saved outputs and an index of
    the same tokenizer (its directory, or an opened Index or ClusterIndex)."""
    from teragram.index.engine import as_index
    from teragram.model.evaluation.perplexity import mix_report

    idx = as_index(index)
    check_tokenizer(outputs, idx.path)
    r = {"nll": outputs.nll, "maxp": outputs.maxp, "top": outputs.top.astype(np.int64), "target": outputs.target, "doc": outputs.doc}
    if outputs.cont_cache is not None and opts.cont_cache:
        r["cont_cache"] = outputs.cont_cache
    return mix_report(r, outputs.doc_bytes, idx, outputs.path, opts)


def load_outputs(path: str | Path) -> ModelOutputs:
    """A saved outputs directory, checked: kind, version, array lengths, and that the targets
    are the documents' own tokens (each document read as EOS + ids predicts ids + EOS)."""
    path = Path(path)
    try:
        m = fmt.read_json(path / "manifest.json")
    except (OSError, ValueError) as e:
        raise IndexFormatError(f"{path}: not a model-outputs directory ({e})") from None
    if m.get("kind") != KIND or m.get("version") != VERSION:
        raise IndexFormatError(f"{path}: not a model-outputs directory of version {VERSION}")
    d = path / "000000"
    arrays = {name: np.asarray(fmt.open_array(d / f"out.{name}.bin", f"out.{name}")) for name in FIELDS}
    n = m["tokens"]
    if any(len(a) != n for a in arrays.values()):
        raise IndexFormatError(f"{path}: arrays of different lengths (manifest: {n} targets)")
    tok = np.asarray(fmt.open_array(d / "tokens.bin", "tokens")).astype(np.int64)
    st = np.asarray(fmt.open_array(d / "docs.bin", "docs")).astype(np.int64)
    if len(st) - 1 != len(m["docs"]) or n != len(tok):  # every document predicts len(ids) + 1 targets
        raise IndexFormatError(f"{path}: {len(st) - 1} documents and {len(tok)} positions for {n} targets")
    expect = tok.copy()
    expect[st[1:] - 1] = -1  # the separator slot: the document's EOS target
    got = arrays["target"].astype(np.int64)
    order = st[arrays["doc"].astype(np.int64)] + arrays["pos"].astype(np.int64)
    if not np.array_equal(np.where(expect[order] < 0, -1, got), expect[order]):
        raise IndexFormatError(f"{path}: the saved targets are not the documents' tokens")
    ccache = None
    if "cont_cache" in m:
        from teragram.model.mixture.cont_cache import ContCache

        spec = ContCache.from_json(m["cont_cache"])
        q = (
            np.stack([np.asarray(fmt.open_array(d / f"out.{c}.bin", f"out.cc{k}"), np.float64) for k, c in enumerate(spec.names)], 1)
            if n
            else np.zeros((0, len(spec.names)))
        )
        ccache = (spec, q)
    return ModelOutputs(path, m, **arrays, cont_cache=ccache)


def truncate_outputs(outputs: ModelOutputs, dst: str | Path, max_targets: int) -> ModelOutputs:
    """The first documents of saved outputs, up to max_targets targets, as a new outputs
    directory (documents are saved in the order they were given: a random sample stays one)."""
    dst = Path(dst)
    d, src = dst / "000000", outputs.path / "000000"
    st = np.asarray(fmt.open_array(src / "docs.bin", "docs")).astype(np.int64)
    k = max(1, int(np.searchsorted(st, max_targets, side="right")) - 1)
    n = int(st[k])
    d.mkdir(parents=True, exist_ok=True)
    tok = np.asarray(fmt.open_array(src / "tokens.bin", "tokens"))
    fmt.write_array(d / "tokens.bin", "tokens", tok[:n])
    fmt.write_array(d / "docs.bin", "docs", np.asarray(fmt.open_array(src / "docs.bin", "docs"))[: k + 1])
    for name in FIELDS:
        fmt.write_array(d / f"out.{name}.bin", f"out.{name}", np.asarray(getattr(outputs, name))[:n])
    if outputs.cont_cache is not None:
        spec, q = outputs.cont_cache
        for c, name in enumerate(spec.names):
            fmt.write_array(d / f"out.{name}.bin", f"out.cc{c}", q[:n, c].astype(np.float32))
    shutil.copyfile(outputs.path / "tokenizer.model", dst / "tokenizer.model")
    fmt.write_json(dst / "manifest.json", outputs.manifest | {"tokens": n, "docs": outputs.manifest["docs"][:k]})
    return load_outputs(dst)


def check_tokenizer(outputs: ModelOutputs, index_dir: str | Path) -> None:
    """Outputs are mixed only with an index of the same tokenizer."""
    theirs_file = Path(index_dir) / "tokenizer.model"
    if "tokenizer" in outputs.manifest:
        mine, theirs = outputs.manifest["tokenizer"], tokenizer.digest(theirs_file)
    else:  # outputs saved before the one digest: they recorded the file's sha256
        mine, theirs = outputs.manifest["tokenizer_sha256"], hashlib.sha256(theirs_file.read_bytes()).hexdigest()
    if mine != theirs:
        raise TokenizerMismatch(f"{outputs.path} was made with another tokenizer than {index_dir} ({mine[:12]} vs {theirs[:12]})")


def outputs_estimates(outputs: ModelOutputs, index_dir: str | Path, *, workers: int = 1) -> dict[str, np.ndarray]:
    """The index's and the document cache's estimates of every saved target (aligned with the
    outputs' arrays), after checking that the index speaks the outputs' tokenizer."""
    from teragram.model.mixture.estimates import heldout_estimates

    check_tokenizer(outputs, index_dir)
    est = heldout_estimates(index_dir, outputs.path, workers)
    if len(est["index_length"]) != len(outputs.nll):
        raise IndexFormatError(f"{outputs.path}: {len(outputs.nll)} targets, {len(est['index_length'])} estimates")
    return est


def gated_outputs(
    outputs: ModelOutputs, est: dict[str, np.ndarray], gate=None, *, components=None, cont_cache: bool = False, fit_rows: int | None = None
):
    """(gate, per-target nll of the gated mixture): the gate given, or one fit on these outputs
    (which should then be validation text), on a fixed random sample of fit_rows of them when
    there are more; with cont_cache, the fit gate reads the continuous cache the outputs saved."""
    from teragram.model.mixture.cont_cache import first_rows
    from teragram.model.mixture.estimates import COMPONENTS
    from teragram.model.mixture.gate import Gate, component_logp, gate_inputs, mix_nll_multi

    spec, q = outputs.cont_cache if outputs.cont_cache is not None else (None, None)
    if gate is not None:
        comps, spec = gate.components, gate.cont_cache
        if spec is not None and (outputs.cont_cache is None or outputs.cont_cache[0] != spec):
            raise TeragramError(f"{outputs.path}: the gate reads the continuous cache at a scale these outputs were not saved with")
    else:
        if cont_cache and spec is None:
            raise TeragramError(f"{outputs.path}: saved without the continuous cache")
        spec = spec if cont_cache else None
        comps = tuple(components or COMPONENTS) + (spec.names if spec is not None else ())
    ccols = (q, first_rows(outputs.doc)) if spec is not None else None
    nll = outputs.nll.astype(np.float64)
    X = gate_inputs(est, outputs.maxp.astype(np.float64), outputs.top.astype(np.int64), comps)
    logp = component_logp(est, nll, comps, ccols)
    if gate is None:
        rows = slice(None)
        if fit_rows is not None and len(X) > fit_rows:
            rows = np.sort(np.random.default_rng(0).choice(len(X), fit_rows, replace=False))
        gate = Gate.fit(X[rows], logp[rows], components=tuple(components or COMPONENTS), cont_cache=spec)
    return gate, mix_nll_multi(logp, gate(X))
