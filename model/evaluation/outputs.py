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
    OUT/tokenizer.model        the tokenizer the ids were made with (the index's file, copied:
      or tokenizer.json        tokenizer.model or tokenizer.json, index/tokenizer.py)
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
    tokenizer.copy(heldout, out)
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
            "tokenizer": tokenizer.digest(out),
            "tokens": int(len(r["nll"])),
            "docs": [m | {"bytes": int(b)} for m, b in zip(metas, docs_bytes, strict=True)],
        }
        | ({"cont_cache": spec.to_json()} if spec is not None else {}),
    )
    return out


class OutputsWriter:
    """Saved outputs written a chunk at a time (model/evaluation/stream.py's chunks, with the
    model's outputs r and, when kept, the continuous cache's target probabilities under
    r["cont_cache"]); `close` writes the manifest. The directory is save_outputs's."""

    def __init__(self, out, idx, *, checkpoint: str, step: int, model: str | None = None):
        self.out, self.idx = Path(out), idx
        self.d = self.out / "000000"
        self.d.mkdir(parents=True, exist_ok=True)
        dtype = np.dtype(idx.manifest["token_dtype"]) if hasattr(idx, "manifest") else np.uint32
        self.tokens = fmt.ArrayWriter(self.d / "tokens.bin", "tokens", dtype)
        self.starts = fmt.ArrayWriter(self.d / "docs.bin", "docs", np.uint64)
        self.fields = {name: fmt.ArrayWriter(self.d / f"out.{name}.bin", f"out.{name}", dt) for name, dt in FIELDS.items()}
        self.cc: list[fmt.ArrayWriter] = []
        self.spec = None
        self.head = {"kind": KIND, "version": VERSION, "checkpoint": str(checkpoint), "step": int(step)}
        self.head |= {"model": model} if model else {}  # checkpoint.weights_digest: a gate fit on these outputs belongs to it
        self.docs: list[dict] = []
        self.n = 0

    def add(self, ch) -> None:
        """A chunk's documents and outputs; a piece of a document (stream.Chunk) goes on from the
        last one's, and the document's source and bytes are recorded with its last piece."""
        r = ch.r
        for ids in ch.docs:
            if not ch.offset:
                self.starts.append([self.n])
            self.tokens.append(np.asarray(ids) if ch.open else np.append(np.asarray(ids), self.idx.sep))
            self.n += len(ids) + (not ch.open)
        for name, w in self.fields.items():
            w.append(np.asarray(r[name]))
        spec, q = r.get("cont_cache", (None, None))
        if spec is not None and not self.cc:
            self.spec = spec
            self.cc = [fmt.ArrayWriter(self.d / f"out.{name}.bin", f"out.cc{c}", np.float32) for c, name in enumerate(spec.names)]
        if spec != self.spec:
            raise TeragramError("saved outputs hold one continuous cache's scale")
        for c, w in enumerate(self.cc):
            w.append(q[:, c])
        if ch.open:
            return
        metas = ch.metas or [{"source": "", "record": k, "length": len(ids) + ch.offset} for k, ids in enumerate(ch.docs, ch.first)]
        self.docs += [m | {"bytes": int(b)} for m, b in zip(metas, ch.nbytes, strict=True)]

    def abort(self) -> None:
        """Remove what was written: no partial outputs directory is left to be mistaken for one."""
        for w in [self.tokens, self.starts, *self.fields.values(), *self.cc]:
            w.abort()

    def close(self) -> Path:
        self.starts.append([self.n])
        for w in [self.tokens, self.starts, *self.fields.values(), *self.cc]:
            w.close()
        tokenizer.copy(self.idx.path, self.out)
        m = self.head | {"tokenizer": tokenizer.digest(self.out), "tokens": self.n, "docs": self.docs}
        fmt.write_json(self.out / "manifest.json", m | ({"cont_cache": self.spec.to_json()} if self.spec is not None else {}))
        return self.out


def saving(chunks, writer: OutputsWriter, spec=None, device: str = "cpu", *, keep_hidden: bool = False):
    """The chunks, each saved by `writer` on its way, with the continuous cache's target
    probabilities (r["cont_cache"]) at the scale of `spec` (a ContCache), or at one fit on the
    first chunk (which should then be validation text): on the half of its documents that
    `--fit-gate` fits on (perplexity.halves). The key states are dropped unless keep_hidden."""
    from teragram.model.evaluation.mixing import ContCarry

    cont = ContCarry(spec, device)
    try:
        for ch in chunks:
            if "hidden" in ch.r and "cont_cache" not in ch.r:
                ch.r["cont_cache"] = cont(ch)
                if not keep_hidden:
                    ch.r.pop("hidden")
            writer.add(ch)
            yield ch
    except BaseException:
        writer.abort()
        raise
    writer.close()


def save_model_outputs(
    out, model, heldout, idx, device: str = "cpu", *, meta: dict, source: str, cont_cache=None, batch: int = 16, chunk_tokens=None
):
    """Run the model over held-out features' text (made against the index idx) once and save
    its outputs, a chunk of documents at a time; returns the continuous cache's settings they
    were saved with: those of `cont_cache` (a ContCache, e.g. of validation outputs saved
    earlier), or one fit on this text (which should then be validation text), see `saving`."""
    from teragram.model.checkpoint import weights_digest
    from teragram.model.evaluation.perplexity import model_chunks
    from teragram.model.evaluation.stream import CHUNK_TOKENS, heldout_chunks
    from teragram.model.mixture import cont_cache as cc

    split = model.cfg.block_size * batch  # pieces of whole batches of windows
    chunks = heldout_chunks(heldout, chunk_tokens or CHUNK_TOKENS, features=model.cfg.use_index, split=split)
    w = OutputsWriter(out, idx, checkpoint=source, step=meta["step"], model=weights_digest(model))
    for ch in saving(model_chunks(model, idx, chunks, device, batch=batch, hidden=cc.KEY), w, cont_cache, device):
        ch.r = None
    return w.spec


def outputs_chunks(outputs: ModelOutputs, chunk_tokens: int, *, cont_cache: bool = True):
    """Chunks of saved outputs (stream.Chunk with r and nbytes), read from their memory maps."""
    from teragram.model.evaluation.stream import heldout_chunks

    st = np.asarray(fmt.open_array(outputs.path / "000000" / "docs.bin", "docs")).astype(np.int64)
    nbytes = outputs.doc_bytes
    for ch in heldout_chunks(outputs.path, chunk_tokens, split=1):
        a = st[ch.first] + ch.offset  # targets and the tokens' layout (each document's + SEP) have the same rows
        b = a + ch.targets
        r = {name: np.asarray(getattr(outputs, name)[a:b]) for name in ("nll", "maxp", "target", "doc", "pos")}
        r["top"] = np.asarray(outputs.top[a:b]).astype(np.int64)
        if outputs.cont_cache is not None and cont_cache:
            r["cont_cache"] = (outputs.cont_cache[0], np.asarray(outputs.cont_cache[1][a:b]))
        ch.r, ch.nbytes = r, nbytes[ch.first : ch.first + len(ch.docs)] * (not ch.open)  # a document's bytes with its last piece
        yield ch


def outputs_report(outputs: ModelOutputs, index, opts):
    """`teragram eval --outputs`: model.evaluation.mixing.mix_stream of saved outputs and an
    index of the same tokenizer (its directory, or an opened Index or ClusterIndex)."""
    from teragram.index.engine import as_index
    from teragram.model.evaluation.mixing import mix_stream
    from teragram.model.evaluation.stream import prefetch

    idx = as_index(index)
    check_tokenizer(outputs, idx.path)
    return mix_stream(prefetch(outputs_chunks(outputs, opts.chunk_tokens, cont_cache=opts.cont_cache)), idx, opts)


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
    tok = fmt.open_array(d / "tokens.bin", "tokens")
    st = np.asarray(fmt.open_array(d / "docs.bin", "docs")).astype(np.int64)
    if len(st) - 1 != len(m["docs"]) or n != len(tok):  # every document predicts len(ids) + 1 targets
        raise IndexFormatError(f"{path}: {len(st) - 1} documents and {len(tok)} positions for {n} targets")
    last = np.zeros(len(tok), bool)
    last[st[1:] - 1] = True  # the separator slot: the document's EOS target
    for a in range(0, n, 1 << 22):  # a block of targets at a time: memory stays bounded
        b = min(a + (1 << 22), n)
        order = st[np.asarray(arrays["doc"][a:b], np.int64)] + np.asarray(arrays["pos"][a:b], np.int64)
        expect = np.asarray(tok)[order].astype(np.int64)
        if not np.array_equal(np.where(last[order], expect, arrays["target"][a:b]), expect):
            raise IndexFormatError(f"{path}: the saved targets are not the documents' tokens")
    ccache = None
    if "cont_cache" in m:
        from teragram.model.mixture.cont_cache import ContCache

        spec = ContCache.from_json(m["cont_cache"])
        cols = [fmt.open_array(d / f"out.{c}.bin", f"out.cc{k}") for k, c in enumerate(spec.names)]
        ccache = (spec, Columns(cols, n))
    return ModelOutputs(path, m, **arrays, cont_cache=ccache)


class Columns:
    """The continuous cache's saved probabilities (N, len(factors)) as float64, read from their
    memory-mapped columns only where indexed (q[rows], q[rows, c], q[:, c])."""

    def __init__(self, cols: list, n: int):
        self.cols, self.n = cols, n

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, len(self.cols))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        rows, c = key if isinstance(key, tuple) else (key, None)
        if c is not None:
            return np.asarray(self.cols[c][rows], np.float64)
        return np.stack([np.asarray(col[rows], np.float64) for col in self.cols], 1) if self.cols else np.zeros((0, 0))

    def __array__(self, dtype=None, copy=None):
        return self[:].astype(dtype or np.float64)


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
    tokenizer.copy(outputs.path, dst)
    fmt.write_json(dst / "manifest.json", outputs.manifest | {"tokens": n, "docs": outputs.manifest["docs"][:k]})
    return load_outputs(dst)


def check_tokenizer(outputs: ModelOutputs, index_dir: str | Path) -> None:
    """Outputs are mixed only with an index of the same tokenizer (its file's digest:
    index/tokenizer.py check_same)."""
    if "tokenizer" in outputs.manifest:
        tokenizer.check_same(outputs.path, index_dir, recorded=outputs.manifest["tokenizer"])
        return
    # outputs saved before the one digest recorded the file's sha256
    mine, theirs = outputs.manifest["tokenizer_sha256"], hashlib.sha256(tokenizer.find(index_dir).read_bytes()).hexdigest()
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
