"""Held-out features: per-token features of other text (a corpus the index does not hold)
against the whole index, written in the feature-file format (index/features.py) with the
text's tokens, document starts and tokenizer, so evaluation reads them on their own.

They are the live `Index.score` of each document, the same features the builder computes in
bulk for the indexed corpus in its leakage-controlled modes.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from . import features as ff
from . import format as fmt
from . import readers
from .engine import Index
from .errors import BuildError


def held_out_features(idx: Index, docs: list[np.ndarray], cfg: ff.FeatureConfig, progress: bool = False) -> ff.Features:
    """Features of other text against the whole index: the live score, document by document."""
    n = sum(len(d) + 1 for d in docs)
    f = ff.Features.empty(n, cfg.top_k)
    p = 0
    for d in tqdm(docs, desc="held-out features", unit="doc", disable=not progress):
        r = idx.score(d, top_k=cfg.top_k, max_len=cfg.max_len)
        e = p + len(d)
        f.length[p:e], f.cont[p:e], f.count[p:e] = r.length, r.cont, r.count
        f.topk_ids[p:e], f.topk_cnt[p:e] = r.topk_ids, r.topk_cnt
        p = e + 1  # the separator row stays empty
    return f


def _chunk(index_dir: str, docs: list[np.ndarray], cfg: ff.FeatureConfig) -> ff.Features:
    return held_out_features(Index(index_dir), docs, cfg)


def read_corpus(idx: Index, corpus: list[str]) -> tuple[list[np.ndarray], list[dict], int]:
    """Token ids of every readable document of the corpus, their sources, and how many
    records were skipped."""
    docs, metas, skipped = [], [], 0
    for path in readers.walk(corpus):
        for item in readers.read_file(path):
            if isinstance(item, readers.Skip):
                skipped += 1
                continue
            ids = np.asarray(idx.tokenizer.encode(item.text), dtype=np.int64)
            docs.append(ids)
            metas.append({"source": item.source, "record": item.record, "length": len(ids)})
    return docs, metas, skipped


def write_held_out(
    idx: Index, out: Path, cfg: ff.FeatureConfig, docs: list[np.ndarray], metas: list[dict], *, progress: bool = False, workers: int = 1
) -> dict:
    """Write the held-out documents' tokens and features as shard 000000 of `out`."""
    if not docs:
        raise BuildError("no readable documents in --corpus")
    d = out / "000000"
    d.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(idx.manifest["token_dtype"])
    stream = np.concatenate([np.append(x, idx.sep) for x in docs]).astype(dtype)
    starts = np.cumsum([0] + [len(x) + 1 for x in docs]).astype(np.uint64)
    fmt.write_array(d / "tokens.bin", "tokens", stream)
    fmt.write_array(d / "docs.bin", "docs", starts)
    t = time.time()
    if workers > 1 and len(docs) > 1:
        bounds = np.linspace(0, len(docs), min(len(docs), 4 * workers) + 1).astype(int)
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            futs = [pool.submit(_chunk, str(idx.path), docs[a:b], cfg) for a, b in zip(bounds[:-1], bounds[1:])]
            parts = [f.result() for f in futs]
        f = ff.Features.combine(parts)
    else:
        f = held_out_features(idx, docs, cfg, progress)
    dt = time.time() - t
    files = ff.write_features(d, f, dtype, idx.sep, cfg.top_k)
    files += [asdict(fmt.file_record(out, d / n)) for n in ("tokens.bin", "docs.bin")]
    shutil.copyfile(idx.path / "tokenizer.model", out / "tokenizer.model")  # held-out features decode on their own
    fmt.write_json(out / "000000.done", {"shard": 0, "files": files, "docs": metas})
    return {"docs": len(docs), "positions": int(len(stream)), "features_s": dt}


def compute_held_out(
    index_dir: str | Path, out: str | Path, cfg: ff.FeatureConfig, corpus: list[str], *, workers: int = 1, progress: bool = True
) -> dict:
    """Held-out features of the corpus's text into `out` (a features directory); returns a report."""
    idx = Index(index_dir)
    out = Path(out)
    if cfg.mode != "held-out":
        cfg = ff.FeatureConfig("held-out", cfg.max_len, cfg.top_k)
    ident = ff.begin(idx.path, out, cfg, corpus)
    t0 = time.time()
    docs, metas, skipped = read_corpus(idx, corpus)
    report = write_held_out(idx, out, cfg, docs, metas, progress=progress, workers=workers)
    report = {"docs": report["docs"], "positions": report["positions"], "skipped": skipped, "features_s": report["features_s"]}
    report["total_s"] = time.time() - t0
    ff.finish(out, ident, [fmt.read_json(out / "000000.done")], report["positions"], report)
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


def contamination(heldout: str | Path, index_dir: str | Path | None = None, n: int = DECONTAMINATION_N) -> np.ndarray:
    """Per document of a held-out features directory, the share of its n-grams in the index:
    read off the stored match lengths when they were capped at >= n, else scored against the
    index (index_dir)."""
    heldout = Path(heldout)
    m = fmt.read_json(heldout / "manifest.json")
    d = heldout / "000000"
    starts = np.asarray(fmt.open_array(d / "docs.bin", "docs")).astype(np.int64)
    if m.get("max_len", 0) >= n:  # saved model outputs (model/outputs.py) store no match lengths
        L = np.asarray(fmt.open_array(d / "length.bin", "feat.length"))
        return np.array([ngram_share(L[starts[k] : starts[k + 1] - 1], n) for k in range(len(starts) - 1)])
    if index_dir is None:
        raise BuildError(f"{heldout}: match lengths capped at {m['max_len']} < {n}; give the index to score against")
    idx = Index(index_dir)
    tok = np.asarray(fmt.open_array(d / "tokens.bin", "tokens")).astype(np.int64)
    return np.array(
        [ngram_share(idx.score(tok[starts[k] : starts[k + 1] - 1], top_k=0, max_len=n).length, n) for k in range(len(starts) - 1)]
    )
