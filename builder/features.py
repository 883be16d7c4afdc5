"""Bulk per-token index features, aligned with the token shards, leakage-controlled.

For position t of a document (predicting token t+1), over the *allowed* text:
  length  L: the longest suffix s = tokens[t-L+1..t] occurring in allowed text (L <= max_len,
          never across a document start);
  cont    the token after the most recent allowed occurrence of s (largest (shard, position));
          EOS when that occurrence ends its document; none when L = 0;
  count   allowed occurrences of s; top-k the k most frequent next tokens after them (count
          descending, then id ascending), document ends counted as EOS.
With L = 0 the suffix is empty: every allowed position is an occurrence of it, its next token
the token there (count = allowed positions, top-k = their unigram distribution).

Allowed text, by mode:
  causal       text before the position (TScale's rule): earlier shards, and in its own shard
               occurrences starting before s does (so they end before t);
  exclude-doc  every document but its own;
  held-out     (`--corpus`) the whole index: the same features as the live `Index.score`.
Separator positions (document ends) carry no features: length 0, no cont, count 0.

Per shard, the own-shard part is linear-time: the capped longest-common-prefix array
(Kasai), then the longest allowed match starting at each position (longest previous
factor for causal, nearest other-document ranks for exclude-doc), from which L(t) follows
by a two-pointer pass; s's suffix-array interval comes from two stack sweeps over the lcp
array, and its statistics from a scan (small intervals) or a grouped pass (large ones). In
exclude-doc mode without top-k the same two sweeps also carry each stack entry's largest
positions (of two documents), which answer "most recent occurrence" without any interval. Other
shards allowed by the mode are matched by a merge-join of the two suffix arrays
(builder/cross_shard.py) and merged: the longest L wins;
on a tie the counts and histograms add up and cont comes from the most recent source.

Layout: FEATS/manifest.json and FEATS/NNNNNN/{length,cont,count,topk_ids,topk_cnt}.bin,
one row per position of IDX/shards/NNNNNN/tokens.bin (topk arrays are (n, k) row-major).
cont and topk_ids use the token dtype with the separator value meaning "none"; counts are
uint32, saturating at 2^32-1. Held-out output also holds tokens.bin and docs.bin.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from teragram.index import format as fmt
from teragram.index import packed
from teragram.index.engine import Index
from teragram.index.errors import BuildError
from tqdm import tqdm

from . import cross_shard
from . import feature_kernels as FK

MODES = ("causal", "exclude-doc")
HEAVY = 64  # intervals with more occurrences than this go through the grouped pass
HEAVY_K0 = 4  # without top-k, scan only tiny intervals: the block maxima answer the rest faster
_U32_MAX = np.iinfo(np.uint32).max


@dataclass(frozen=True)
class FeatureConfig:
    mode: str = "exclude-doc"
    max_len: int = 64
    top_k: int = 4

    def __post_init__(self) -> None:
        if self.mode not in MODES + ("held-out",):
            raise BuildError(f"unknown feature mode {self.mode!r}; expected causal, exclude-doc or held-out")
        if not 1 <= self.max_len <= 255:
            raise BuildError("--max-len must be in [1, 255]")
        if not 0 <= self.top_k <= 64:
            raise BuildError("--top-k must be in [0, 64]")


@dataclass
class Features:
    """Features of a run of positions (int64 working arrays)."""

    length: np.ndarray  # (n,)
    cont: np.ndarray  # (n,) -1: none
    count: np.ndarray  # (n,)
    topk_ids: np.ndarray  # (n, k) -1: none
    topk_cnt: np.ndarray  # (n, k)

    @classmethod
    def empty(cls, n: int, k: int) -> Features:
        """Compact working arrays: per-shard counts fit int32 (a shard holds < 2^31 positions)."""
        return cls(
            np.zeros(n, np.uint8),
            np.full(n, -1, np.int32),
            np.zeros(n, np.int64),
            np.full((n, k), -1, np.int32),
            np.zeros((n, k), np.int32),
        )


def _topk(toks: np.ndarray, cnts: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full(k, -1, np.int64)
    cs = np.zeros(k, np.int64)
    if len(toks) and k:
        order = np.lexsort((toks, -cnts))[:k]
        ids[: len(order)] = toks[order]
        cs[: len(order)] = cnts[order]
    return ids, cs


def _merge_hist(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    parts = [p for p in parts if len(p[0])]
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if len(parts) == 1:
        return parts[0]
    u, inv = np.unique(np.concatenate([p[0] for p in parts]), return_inverse=True)
    return u, np.bincount(inv, weights=np.concatenate([p[1] for p in parts])).astype(np.int64)


def own_shard_features(idx: Index, shard: int, cfg: FeatureConfig) -> tuple[Features, dict]:
    """Features of one shard's positions from its own suffix array only (causal/exclude-doc),
    plus the arrays the merge with other shards needs."""
    s = idx.shards[shard]
    T = np.array(s.tok)  # an anonymous copy: numpy backs large arrays with huge pages, mmaps are not
    n_pos = len(T)
    sa = np.empty(s.sa.count, np.int32 if n_pos < 2**31 else np.int64)
    packed.unpack_range(s.sa.words, s.sa.width, 0, s.sa.count, sa)
    starts = np.asarray(s.starts).astype(np.int64)
    mode = FK.CAUSAL if cfg.mode == "causal" else FK.EXCLUDE_DOC
    k = cfg.top_k
    rank = np.empty(n_pos, np.int32 if n_pos < 2**31 else np.int64)
    doc = np.empty(n_pos, np.int32)
    sadoc = np.empty(len(sa), np.int32)
    FK.rank_and_doc(sa, starts, rank, doc, sadoc)
    lcp = np.empty(len(sa), np.uint8)
    FK.kasai_capped(T, sa, rank, idx.sep, cfg.max_len, lcp)
    ms = np.empty(n_pos, np.uint8)
    if mode == FK.CAUSAL:
        FK.longest_previous(sa, lcp, ms)
    else:
        FK.longest_other_doc(sa, lcp, sadoc, ms)
    length = np.zeros(n_pos, np.uint8)
    FK.match_lengths_from_ms(ms, starts, cfg.max_len, length)
    del ms
    f = Features.empty(n_pos, max(k, 0))
    f.length = length
    pos = np.full(n_pos, -1, np.int32 if n_pos < 2**31 else np.int64)
    if mode == FK.EXCLUDE_DOC and not k:  # length + cont only: no intervals needed
        scratch = (np.empty(n_pos, np.int64), np.empty(len(sa), np.int64))
        FK.exclude_doc_recent(T, sa, lcp, sadoc, length, *scratch, idx.sep, idx.eos_id, pos, f.cont)
        f.count[:] = -1
    else:
        del sadoc
        ivl_a = np.zeros(n_pos, sa.dtype)
        ivl_b = np.zeros(n_pos, sa.dtype)
        FK.interval_bounds(sa, lcp, length, np.empty(n_pos, np.int64), np.empty(len(sa), np.int64), ivl_a, ivl_b)
        ht = np.empty(n_pos, np.int32 if n_pos < 2**31 else np.int64)
        ha = np.empty_like(ht)
        hb = np.empty_like(ht)
        doc_ranks = FK.doc_sorted_ranks(rank, starts) if mode == FK.EXCLUDE_DOC and k else np.zeros(0, np.int64)
        nh = FK.own_shard(
            T, sa, rank, doc, starts, ivl_a, ivl_b, length, mode, idx.sep, idx.eos_id, k, HEAVY if k else HEAVY_K0, s.samax, s.off2, s.off3, doc_ranks,
            f.cont, pos, f.count, f.topk_ids, f.topk_cnt, ht, ha, hb,
        )  # fmt: skip
        if k:
            vocab1 = max(idx.vocab_size, idx.eos_id + 1)
            FK.heavy_groups(
                T,
                sa,
                doc,
                starts,
                length,
                mode,
                idx.sep,
                idx.eos_id,
                k,
                vocab1,
                ht[:nh],
                ha[:nh],
                hb[:nh],
                f.cont,
                pos,
                f.count,
                f.topk_ids,
                f.topk_cnt,
            )
    aux = {"T": T, "sa": sa, "rank": rank, "doc": doc, "lcp": lcp, "pos": pos, "starts": starts, "mode": mode}
    return f, aux


def _unigram_features(idx: Index, shard: int, cfg: FeatureConfig, f: Features) -> None:
    """Fill the L = 0 positions: the empty suffix's allowed occurrences are allowed positions."""
    s = idx.shards[shard]
    T = np.asarray(s.tok).astype(np.int64)
    starts = np.asarray(s.starts).astype(np.int64)
    k = f.topk_ids.shape[1]
    real = T != idx.sep
    zero = np.nonzero((f.length == 0) & real)[0]
    if len(zero) == 0:
        return
    V = max(idx.vocab_size, idx.eos_id + 1)
    if cfg.mode == "exclude-doc":
        total = idx.unigram.copy()
        docs = np.searchsorted(starts, zero, side="right") - 1
        for d in np.unique(docs):
            ds, de = starts[d], starts[d + 1]
            own = np.bincount(np.where(T[ds:de] == idx.sep, idx.eos_id, T[ds:de]), minlength=V)
            rest = total - own
            nz = np.nonzero(rest)[0]
            ids, cs = _topk(nz, rest[nz], k)
            sel = zero[docs == d]
            f.count[sel] = idx.n_positions - (de - ds)
            f.topk_ids[sel] = ids
            f.topk_cnt[sel] = np.minimum(cs, np.iinfo(np.int32).max)
    else:  # causal: positions <= t of this shard, and all of the earlier shards
        base = np.zeros(V, np.int64)
        for e in idx.shards[:shard]:
            base[: len(e.unigram)] += e.unigram.astype(np.int64)
            base[idx.eos_id] += len(e.starts) - 1
        prior = sum(e.tok.shape[0] for e in idx.shards[:shard])
        stream = np.where(T == idx.sep, idx.eos_id, T)
        if k:
            FK.causal_unigram(stream, base, zero, k, f.topk_ids, f.topk_cnt)
        f.count[zero] = prior + zero + 1


def shard_features(idx: Index, shard: int, cfg: FeatureConfig) -> tuple[Features, dict]:
    """All features of one shard's positions in causal or exclude-doc mode (merged over shards).
    With top_k = 0 only length and cont are computed (count is left undefined)."""
    with_topk = cfg.top_k > 0
    t0 = time.time()
    f, aux = own_shard_features(idx, shard, cfg)
    stats = {"own_s": time.time() - t0}
    others = [j for j in range(len(idx.shards)) if (j < shard if cfg.mode == "causal" else j != shard)]
    if others:
        t1 = time.time()
        _merge_others(idx, shard, cfg, f, aux, others, with_topk)
        stats["others_s"] = time.time() - t1
    if with_topk:
        _unigram_features(idx, shard, cfg, f)
    sep_pos = np.asarray(idx.shards[shard].tok) == idx.sep
    f.length[sep_pos] = 0
    f.cont[sep_pos] = -1
    f.count[sep_pos] = 0
    f.topk_ids[sep_pos] = -1
    f.topk_cnt[sep_pos] = 0
    stats["total_s"] = time.time() - t0
    return f, stats


def _merge_others(idx: Index, shard: int, cfg: FeatureConfig, f: Features, aux: dict, others: list[int], with_topk: bool) -> None:
    k = f.topk_ids.shape[1]
    matches = {j: cross_shard.other_shard_matches(idx, shard, j, cfg.max_len) for j in others}
    own_L = f.length.astype(np.int64)
    best = own_L.copy()
    for L, _, _ in matches.values():
        best = np.maximum(best, L)
    touched = np.zeros(len(best), bool)
    for L, _, _ in matches.values():
        touched |= (L == best) & (best > 0)
    buf_t = np.empty(HEAVY * 64, np.int64)
    buf_c = np.empty(HEAVY * 64, np.int64)
    for t in np.nonzero(touched)[0]:
        Lt = int(best[t])
        count = 0
        recent = (-1, -1, -1)  # (shard, position, cont)
        hists = []
        if own_L[t] == Lt:
            count += int(f.count[t])
            if f.cont[t] >= 0:
                recent = (shard, int(aux["pos"][t]), int(f.cont[t]))
            if with_topk:
                n_occ = int(f.count[t])
                if len(buf_t) < n_occ:
                    buf_t = np.empty(n_occ, np.int64)
                    buf_c = np.empty(n_occ, np.int64)
                m = FK.restricted_histogram(
                    aux["T"], aux["sa"], aux["rank"], aux["doc"], aux["lcp"], t, Lt, aux["mode"], idx.sep, idx.eos_id, buf_t, buf_c
                )
                hists.append((buf_t[:m].copy(), buf_c[:m].copy()))
        for j, (L, lo, hi) in matches.items():
            if L[t] != Lt:
                continue
            a, b = int(lo[t]), int(hi[t])
            count += b - a
            o = idx.shards[j]
            p = o.most_recent(a, b)
            if (j, p) > recent[:2]:
                c = int(o.tok[p + Lt])
                recent = (j, p, idx.eos_id if c == idx.sep else c)
            if with_topk:
                hists.append(idx._shard_dist(o, a, b, Lt))
        f.length[t] = Lt
        f.count[t] = count
        f.cont[t] = recent[2]
        if with_topk:
            ids, cs = _topk(*_merge_hist(hists), k)
            f.topk_ids[t], f.topk_cnt[t] = ids, np.minimum(cs, np.iinfo(np.int32).max)


def held_out_features(idx: Index, docs: list[np.ndarray], cfg: FeatureConfig, progress: bool = False) -> Features:
    """Features of other text against the whole index: the live score, document by document."""
    n = sum(len(d) + 1 for d in docs)
    f = Features.empty(n, cfg.top_k)
    p = 0
    for d in tqdm(docs, desc="held-out features", unit="doc", disable=not progress):
        r = idx.score(d, top_k=cfg.top_k, max_len=cfg.max_len)
        e = p + len(d)
        f.length[p:e], f.cont[p:e], f.count[p:e] = r.length, r.cont, r.count
        f.topk_ids[p:e], f.topk_cnt[p:e] = r.topk_ids, r.topk_cnt
        p = e + 1  # the separator row stays empty
    return f


# ---- storage ---------------------------------------------------------------------------------

FEATURE_FILES = ("length.bin", "cont.bin", "count.bin", "topk_ids.bin", "topk_cnt.bin")


def write_features(d: Path, f: Features, token_dtype: np.dtype, sep: int, k: int) -> list[dict]:
    """Write one shard's features; with k = 0 only length and cont (no distribution)."""
    d.mkdir(parents=True, exist_ok=True)

    def tok(a: np.ndarray) -> np.ndarray:
        return np.where(a < 0, sep, a).astype(token_dtype)

    fmt.write_array(d / "length.bin", "feat.length", f.length.astype(np.uint8))
    fmt.write_array(d / "cont.bin", "feat.cont", tok(f.cont))
    names = ["length.bin", "cont.bin"]
    if k:
        fmt.write_array(d / "count.bin", "feat.count", np.minimum(f.count, _U32_MAX).astype(np.uint32))
        fmt.write_array(d / "topk_ids.bin", "feat.topk_ids", tok(f.topk_ids).reshape(-1))
        fmt.write_array(d / "topk_cnt.bin", "feat.topk_cnt", np.clip(f.topk_cnt, 0, None).astype(np.uint32).reshape(-1))
        names += ["count.bin", "topk_ids.bin", "topk_cnt.bin"]
    return [asdict(fmt.file_record(d.parent, d / n)) for n in names]


@dataclass(frozen=True)
class FeatureArrays:
    """Memory-mapped features of one shard, as stored (see the module docstring)."""

    length: np.ndarray
    cont: np.ndarray
    count: np.ndarray
    topk_ids: np.ndarray  # (n, k)
    topk_cnt: np.ndarray  # (n, k)


def open_features(d: Path, k: int) -> FeatureArrays:
    """Memory-map one shard's features (k = 0: count and top-k are empty arrays)."""
    length = fmt.open_array(d / "length.bin", "feat.length")
    cont = fmt.open_array(d / "cont.bin", "feat.cont")
    if not k:
        z = np.zeros((len(length), 0), np.uint32)
        return FeatureArrays(length, cont, np.zeros(len(length), np.uint32), z, z)
    return FeatureArrays(
        length,
        cont,
        fmt.open_array(d / "count.bin", "feat.count"),
        fmt.open_array(d / "topk_ids.bin", "feat.topk_ids").reshape(-1, k),
        fmt.open_array(d / "topk_cnt.bin", "feat.topk_cnt").reshape(-1, k),
    )


# ---- orchestration ---------------------------------------------------------------------------


def _feature_task(index_dir: str, out: str, shard: int, cfg: FeatureConfig) -> dict:
    """Compute, write and mark one shard's features (the unit an executor runs)."""
    idx = Index(index_dir)
    f, stats = shard_features(idx, shard, cfg)
    d = Path(out) / f"{shard:06d}"
    files = write_features(d, f, np.dtype(idx.manifest["token_dtype"]), idx.sep, cfg.top_k)
    fmt.write_json(Path(out) / f"{shard:06d}.done", {"shard": shard, "files": files})
    return {"shard": shard, "positions": int(len(f.length))} | stats


def compute_features(
    index_dir: str | Path,
    out: str | Path,
    cfg: FeatureConfig,
    *,
    workers: int = 1,
    corpus: list[str] | None = None,
    progress: bool = True,
    executor: str = "local",
    ray_address: str | None = None,
) -> dict:
    """Write features for the indexed corpus (causal / exclude-doc) or, with `corpus`, for
    other text against the whole index (held-out). Resumable per shard; returns a report.
    Shards are computed in parallel, by local processes or as Ray tasks."""
    from .executors import make_executor

    idx = Index(index_dir)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if corpus is not None and cfg.mode != "held-out":
        cfg = FeatureConfig("held-out", cfg.max_len, cfg.top_k)
    if corpus is None and cfg.mode not in MODES:
        raise BuildError("held-out features need --corpus")
    ident = {
        "format_version": fmt.FORMAT_VERSION,
        "mode": cfg.mode,
        "max_len": cfg.max_len,
        "top_k": cfg.top_k,
        "index_manifest": fmt.file_digest(idx.path / "manifest.json"),
        "corpus": corpus,
    }
    state = out / "features-state.json"
    if state.exists() and fmt.read_json(state) != ident:
        raise BuildError(f"{out} holds features of another index or configuration; choose another --out")
    fmt.write_json(state, ident)
    t0 = time.time()
    if corpus is not None:
        report = _held_out(idx, out, cfg, corpus, progress, workers)
        shards = [fmt.read_json(out / "000000.done")]
        positions = report["positions"]
    else:
        todo = [s.id for s in idx.shards if not (out / f"{s.id:06d}.done").exists()]
        ex = make_executor(executor, min(workers, max(1, len(todo))), ray_address)
        bar = tqdm(total=len(todo), desc=f"features ({cfg.mode})", unit="shard", disable=not progress)
        try:
            for s in todo:
                ex.submit(_feature_task, str(idx.path), str(out), s, cfg)
            results = ex.results()
            bar.update(len(todo))
        finally:
            ex.close()
            bar.close()
        shards = [fmt.read_json(out / f"{s.id:06d}.done") for s in idx.shards]
        positions = sum(s.tok.shape[0] for s in idx.shards)
        report = {"shards": results}
    fmt.write_json(out / "manifest.json", ident | {"shards": shards, "positions": positions})
    report["total_s"] = time.time() - t0
    fmt.write_json(out / "features-report.json", report)
    return report


def _held_out_chunk(index_dir: str, docs: list[np.ndarray], cfg: FeatureConfig) -> Features:
    return held_out_features(Index(index_dir), docs, cfg)


def _held_out(idx: Index, out: Path, cfg: FeatureConfig, corpus: list[str], progress: bool, workers: int) -> dict:
    from . import readers

    docs, metas, skipped = [], [], 0
    for path in readers.walk(corpus):
        for item in readers.read_file(path):
            if isinstance(item, readers.Skip):
                skipped += 1
                continue
            ids = np.asarray(idx.tokenizer.encode(item.text), dtype=np.int64)
            docs.append(ids)
            metas.append({"source": item.source, "record": item.record, "length": len(ids)})
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
        from .executors import LocalExecutor

        ex = LocalExecutor(workers)
        bounds = np.linspace(0, len(docs), min(len(docs), 4 * workers) + 1).astype(int)
        try:
            for a, b in zip(bounds[:-1], bounds[1:]):
                ex.submit(_held_out_chunk, str(idx.path), docs[a:b], cfg)
            parts = ex.results()
        finally:
            ex.close()
        f = Features(*(np.concatenate([getattr(p, n) for p in parts]) for n in ("length", "cont", "count", "topk_ids", "topk_cnt")))
    else:
        f = held_out_features(idx, docs, cfg, progress)
    dt = time.time() - t
    files = write_features(d, f, dtype, idx.sep, cfg.top_k)
    files += [asdict(fmt.file_record(out, d / n)) for n in ("tokens.bin", "docs.bin")]
    import shutil

    shutil.copyfile(idx.path / "tokenizer.model", out / "tokenizer.model")  # held-out features decode on their own
    fmt.write_json(out / "000000.done", {"shard": 0, "files": files, "docs": metas})
    return {"docs": len(docs), "positions": int(len(stream)), "skipped": skipped, "features_s": dt}
