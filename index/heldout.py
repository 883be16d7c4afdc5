"""Held-out features: per-token features of other text (a corpus the index does not hold)
against the whole index, written in the feature-file format (index/features.py) with the
text's tokens, document starts and tokenizer, so evaluation reads them on their own.

They are `Index.score`'s features of each document (computed for all documents at once,
index/bulk.py), the same features the builder computes in bulk for the indexed corpus in its
leakage-controlled modes.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from . import features as ff
from . import format as fmt
from . import readers, tokenizer
from .bulk import continuations
from .engine import Index, as_index
from .errors import BuildError


def held_out_features(idx: Index, docs: list[np.ndarray], cfg: ff.FeatureConfig, threads: int = 1) -> ff.Features:
    """Features of other text against the whole index, one row per position of the documents
    laid out as doc0 SEP doc1 SEP ... (the separator rows stay empty): Index.score's, computed
    for all documents at once (index/bulk.py)."""
    lens = np.array([len(d) for d in docs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)])
    ids = np.concatenate([np.asarray(d, np.int64) for d in docs]) if docs else np.zeros(0, np.int64)
    r = continuations(idx, ids, starts, [cfg.max_len], top_k=cfg.top_k, threads=threads)[cfg.max_len]
    f = ff.Features.empty(int(lens.sum() + len(docs)), cfg.top_k)
    rows = np.ones(len(f.length), bool)
    rows[starts[1:] + np.arange(len(docs))] = False  # each document's separator row
    for name in ff.FIELDS:
        getattr(f, name)[rows] = getattr(r, name)
    return f


def iter_corpus(idx: Index, corpus: list[str], skipped: list | None = None):
    """(token ids, source) of every readable document of the corpus, a document at a time; each
    unreadable record is appended to `skipped`."""
    for path in readers.walk(corpus):
        for item in readers.read_file(path):
            if isinstance(item, readers.Skip):
                if skipped is not None:
                    skipped.append(item)
                continue
            ids = np.asarray(idx.tokenizer.encode(item.text), dtype=np.int64)
            yield ids, {"source": item.source, "record": item.record, "length": len(ids)}


def read_corpus(idx: Index, corpus: list[str]) -> tuple[list[np.ndarray], list[dict], int]:
    """Token ids of every readable document of the corpus, their sources, and how many
    records were skipped."""
    skipped: list = []
    pairs = list(iter_corpus(idx, corpus, skipped))
    return [p[0] for p in pairs], [p[1] for p in pairs], len(skipped)


HELD_OUT_CHUNK = 1 << 20  # positions whose features are computed, written and recorded at a time


def _chunk_features(out: Path, i: int, key: dict, compute, sep: int, dtype, top_k: int) -> ff.Features:
    """The features of chunk i of `out`, which holds `key` (its documents [a, b), and of a long
    document's piece its rows [s, e)): read back when its marker says it holds them and its files
    have the recorded sizes, else computed (compute()), written and marked."""
    d, marker = out / "chunks" / f"{i:06d}", out / "chunks" / f"{i:06d}.done"
    if marker.exists():
        m = fmt.read_json(marker)
        sized = all((out / r["path"]).exists() and (out / r["path"]).stat().st_size == r["size"] for r in m["files"])
        if {k: m.get(k) for k in ("docs", "rows")} == {"rows": None} | key and sized:
            return ff.open_features(d, top_k).decoded(sep)
    f = compute()
    files = ff.write_features(d, f, dtype, sep, top_k)
    fmt.write_json(marker, key | {"files": [r | {"path": str(Path("chunks") / r["path"])} for r in files]})
    return f


def piece_rows(n_rows: int, size: int) -> list[tuple[int, int]]:
    """Rows [s, e) of a document's features (its n positions, then its separator's row) in pieces
    of at most `size` rows."""
    return [(s, min(s + size, n_rows)) for s in range(0, n_rows, size)]


def piece_features(idx, ids: np.ndarray, s: int, e: int, back: int, cfg: ff.FeatureConfig, threads: int = 1) -> ff.Features:
    """Rows [s, e) of held_out_features of one document (ids, all its tokens; row len(ids): its
    separator's), computed over the document from `back` tokens before s on: the rows of the
    document read whole when no match at a row >= s starts earlier. So it is with back the
    length of the match at s - 1 (a match grows by at most one token a position, capped or not),
    or cfg.max_len (no match is longer)."""
    c0 = max(0, s - back)
    f = held_out_features(idx, [ids[c0 : min(e, len(ids))]], cfg, threads=threads)
    return f.map(lambda v: v[s - c0 : e - c0])


def write_held_out(idx: Index, out: Path, cfg: ff.FeatureConfig, docs, metas=None, *, workers: int = 1, progress: bool = False) -> dict:
    """Write the held-out documents' tokens and features as shard 000000 of `out`, a run of
    about HELD_OUT_CHUNK positions at a time, a document longer than that in pieces of as many
    rows (docs and metas: lists; or metas None and docs an iterable of (ids, meta), read a
    document at a time), so that memory stays bounded whatever the text's size (a document's
    tokens are held whole). Each run's features are also written and marked under out/chunks/:
    a rerun after an interruption reads the marked ones back."""
    d = out / "000000"
    d.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(idx.manifest["token_dtype"])
    toks, starts = fmt.ArrayWriter(d / "tokens.bin", "tokens", dtype), fmt.ArrayWriter(d / "docs.bin", "docs", np.uint64)
    fw = ff.FeaturesWriter(d, dtype, idx.sep, cfg.top_k)
    t, n, kept, buf, i = time.time(), 0, [], [], 0

    def chunk(key: dict, compute, bar, rows: int) -> ff.Features:
        nonlocal i
        f = _chunk_features(out, i, key, compute, idx.sep, dtype, cfg.top_k)
        fw.add(f)
        bar.update(rows)
        i += 1
        return f

    def flush(bar):
        nonlocal buf
        if buf:
            ab = [len(kept) - len(buf), len(kept)]
            chunk({"docs": ab}, lambda b=buf: held_out_features(idx, b, cfg, threads=workers), bar, sum(len(x) + 1 for x in buf))
            buf = []

    try:
        with tqdm(desc="features (held-out)", unit="tok", unit_scale=True, disable=not progress) as bar:
            for ids, meta in docs if metas is None else zip(docs, metas, strict=True):
                if buf and sum(len(x) + 1 for x in buf) + len(ids) + 1 > HELD_OUT_CHUNK:  # runs of at most HELD_OUT_CHUNK
                    flush(bar)
                starts.append([n])
                toks.append(np.append(ids, idx.sep))
                n += len(ids) + 1
                kept.append(meta)
                if len(ids) + 1 <= HELD_OUT_CHUNK:
                    buf.append(ids)
                    continue
                carried, k = 0, len(kept) - 1  # a long document, in pieces (buf is empty here)
                for s, e in piece_rows(len(ids) + 1, HELD_OUT_CHUNK):
                    f = chunk(
                        {"docs": [k, k + 1], "rows": [s, e]},
                        lambda s=s, e=e, c=carried, ids=ids: piece_features(idx, ids, s, e, c, cfg, workers),
                        bar,
                        e - s,
                    )
                    carried = int(f.length[-1])
            flush(bar)
        if not kept:
            raise BuildError("no readable documents in --corpus")
    except BaseException:
        for w in (toks, starts):
            w.abort()
        fw.abort()
        raise
    starts.append([n])
    files = fw.close() + [asdict(fmt.file_record(out, w.close())) for w in (toks, starts)]
    tokenizer.copy(idx.path, out)  # held-out features decode on their own
    fmt.write_json(out / "000000.done", {"shard": 0, "files": files, "docs": kept})
    return {"docs": len(kept), "positions": n, "features_s": time.time() - t}


def compute_held_out(index, out: str | Path, cfg: ff.FeatureConfig, corpus: list[str], *, workers: int = 1, progress: bool = False) -> dict:
    """Held-out features of the corpus's text into `out` (a features directory); returns a report.
    index: its directory, or an opened Index or ClusterIndex (index/cluster.py). Resumable: a
    rerun of the same command continues after the last chunk recorded (write_held_out); one
    with another index or configuration is refused."""
    idx = as_index(index)
    out = Path(out)
    if cfg.mode != "held-out":
        cfg = ff.FeatureConfig("held-out", cfg.max_len, cfg.top_k)
    ident = ff.begin(idx.path, out, cfg, corpus)
    t0 = time.time()
    skipped: list = []
    report = write_held_out(idx, out, cfg, iter_corpus(idx, corpus, skipped), workers=workers, progress=progress)
    report = {"docs": report["docs"], "positions": report["positions"], "skipped": len(skipped), "features_s": report["features_s"]}
    report["total_s"] = time.time() - t0
    ff.finish(out, ident, [fmt.read_json(out / "000000.done")], report["positions"], report)
    shutil.rmtree(out / "chunks", ignore_errors=True)  # the whole is written and marked
    return report


# ---- decontamination -----------------------------------------------------------------------

DECONTAMINATION_N = 13  # infini-gram's criterion: a document with >= 80% of its 13-grams in the index
DECONTAMINATION_SHARE = 0.8


def ngram_share(lengths: np.ndarray, n: int = DECONTAMINATION_N) -> float:
    """The share of a document's n-grams that occur in the index, from its positions' match
    lengths: the n-gram ending at t occurs exactly when the longest match there is >= n.
    A document shorter than n has no n-grams: share 0."""
    ll = np.asarray(lengths)[n - 1 :]
    return float((ll >= n).mean()) if len(ll) else 0.0


def contamination(heldout: str | Path, index=None, n: int = DECONTAMINATION_N) -> np.ndarray:
    """Per document of a held-out features directory, the share of its n-grams in the index:
    read off the stored match lengths when they were capped at >= n, else scored against the
    index (its directory, or an opened Index or ClusterIndex)."""
    heldout = Path(heldout)
    m = fmt.read_json(heldout / "manifest.json")
    d = heldout / "000000"
    starts = np.asarray(fmt.open_array(d / "docs.bin", "docs")).astype(np.int64)
    if m.get("max_len", 0) >= n:  # saved model outputs (model/evaluation/outputs.py) store no match lengths
        L = np.asarray(fmt.open_array(d / "length.bin", "feat.length"))
        return np.array([ngram_share(L[starts[k] : starts[k + 1] - 1], n) for k in range(len(starts) - 1)])
    if index is None:
        raise BuildError(f"{heldout}: match lengths capped at {m['max_len']} < {n}; give the index to score against")
    idx = as_index(index)
    tok = np.asarray(fmt.open_array(d / "tokens.bin", "tokens")).astype(np.int64)
    return np.array(
        [ngram_share(idx.score(tok[starts[k] : starts[k + 1] - 1], top_k=0, max_len=n).length, n) for k in range(len(starts) - 1)]
    )
