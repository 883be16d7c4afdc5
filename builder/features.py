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
  held-out     (`--corpus`) the whole index: the same features as the live `Index.score`
               (index/heldout.py).
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
Exclude-doc length + continuation of a sharded index skip the pairs: the shards' suffix arrays
are merged into one of the whole index, chunk by chunk within a memory budget, and the one-shard
kernels answer every shard at once (builder/merged_features.py).

The files these features are written to, and their reading, are index/features.py's; held-out
features are index/heldout.py's.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import psutil
from teragram.index import format as fmt
from teragram.index import packed
from teragram.index.engine import Index
from teragram.index.errors import BuildError
from teragram.index.features import MODES, FeatureConfig, Features, begin, finish, write_features
from teragram.index.heldout import compute_held_out
from tqdm import tqdm

from . import cross_shard, merged_features
from . import feature_kernels as FK

HEAVY = 64  # intervals with more occurrences than this go through the grouped pass
HEAVY_K0 = 4  # without top-k, scan only tiny intervals: the block maxima answer the rest faster


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
    ms = np.zeros(n_pos, np.uint8)
    if mode == FK.CAUSAL:
        FK.longest_previous(sa, lcp, ms)
    else:
        FK.longest_other_doc(sa, lcp, sadoc, ms)
    length = np.zeros(n_pos, np.uint8)
    FK.match_lengths_from_ms(ms, starts, cfg.max_len, length)
    del ms
    f = dataclasses.replace(Features.empty(n_pos, max(k, 0)), length=length)
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
        outs = (f.cont, pos, f.count, f.topk_ids, f.topk_cnt)
        nh = FK.own_shard(
            T, sa, rank, doc, starts, ivl_a, ivl_b, length, mode, idx.sep, idx.eos_id, k, HEAVY if k else HEAVY_K0, s.samax, s.off2, s.off3, doc_ranks,
            outs, (ht, ha, hb),
        )  # fmt: skip
        if k:
            vocab1 = max(idx.vocab_size, idx.eos_id + 1)
            FK.heavy_groups(T, sa, doc, starts, length, mode, idx.sep, idx.eos_id, k, vocab1, ht[:nh], ha[:nh], hb[:nh], outs)
    aux = {"T": T, "sa": sa, "rank": rank, "doc": doc, "lcp": lcp, "pos": pos, "starts": starts, "mode": mode}
    return f, aux


MERGED_MEMORY_SHARE = 0.6  # of the memory available when the features start
MERGED_MIN_CHUNK = 1 << 16  # positions: with less room than this per chunk, the pairwise path


def _merged_memory(idx: Index) -> int:
    return int(MERGED_MEMORY_SHARE * psutil.virtual_memory().available)


def _merged_path(idx: Index, cfg: FeatureConfig) -> bool:
    """Whether the features come from the merged suffix array of all shards, chunk by chunk
    (builder/merged_features.py), rather than shard by shard with a merge-join per pair:
    exclude-doc length + continuation of a sharded index, when the whole index's arrays (a byte
    and a token per position) leave room for chunks in the memory available."""
    if not (cfg.mode == "exclude-doc" and cfg.top_k == 0 and len(idx.shards) > 1):
        return False
    return merged_features.layout(idx, _merged_memory(idx), scratch=True)[1] >= MERGED_MIN_CHUNK


def merged_exclude_doc_lengths(idx: Index, cfg: FeatureConfig, scratch: Path | None = None, progress: bool = False):
    """Per shard (length, cont as stored: token dtype, SEP for none) and the run's statistics;
    scratch: where the chunks' merges wait between the two passes (else merged twice)."""
    return merged_features.exclude_doc_lengths_conts(idx, cfg.max_len, memory_bytes=_merged_memory(idx), scratch=scratch, progress=progress)


def merged_exclude_doc_features(
    idx: Index, cfg: FeatureConfig, *, max_chunk_positions: int | None = None, scratch: Path | None = None
) -> list[Features]:
    """Exclude-doc length + continuation of every shard's positions (count left undefined, -1)
    from the merged suffix array of all shards (builder/merged_features.py), where "another
    document" spans every shard and the most recent occurrence is the largest position (shards
    in order)."""
    per_shard, _ = merged_features.exclude_doc_lengths_conts(
        idx, cfg.max_len, memory_bytes=_merged_memory(idx), max_chunk_positions=max_chunk_positions, scratch=scratch
    )
    out = []
    for length, cont in per_shard:
        f = dataclasses.replace(Features.empty(len(length), 0), length=length.copy())
        f.cont[cont != idx.sep] = cont[cont != idx.sep]
        f.count[:] = -1
        f.count[np.asarray(idx.shards[len(out)].tok) == idx.sep] = 0
        out.append(f)
    return out


def _unigram_features(idx: Index, shard: int, cfg: FeatureConfig, f: Features, whole: tuple[np.ndarray, int]) -> None:
    """Fill the L = 0 positions: the empty suffix's allowed occurrences are allowed positions.
    whole: the whole index's unigram counts and positions (exclude-doc)."""
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
        total = whole[0].copy()
        docs = np.searchsorted(starts, zero, side="right") - 1
        for d in np.unique(docs):
            ds, de = starts[d], starts[d + 1]
            own = np.bincount(np.where(T[ds:de] == idx.sep, idx.eos_id, T[ds:de]), minlength=V)
            rest = total - own
            nz = np.nonzero(rest)[0]
            ids, cs = _topk(nz, rest[nz], k)
            sel = zero[docs == d]
            f.count[sel] = whole[1] - (de - ds)
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


def shard_features(idx: Index, shard: int, cfg: FeatureConfig, *, pairwise: bool = False) -> tuple[Features, dict]:
    """All features of one shard's positions in causal or exclude-doc mode (merged over shards).
    With top_k = 0 only length and cont are computed (count is left undefined). Exclude-doc
    length + continuation of a sharded index come from the merged suffix array of all shards
    (computed for this one shard's sake: compute_features does it once for all); pairwise
    takes the merge-join per pair of shards instead (the reference the benchmark compares)."""
    with_topk = cfg.top_k > 0
    t0 = time.time()
    if _merged_path(idx, cfg) and not pairwise:
        return merged_exclude_doc_features(idx, cfg)[shard], {"total_s": time.time() - t0}
    f, aux = own_shard_features(idx, shard, cfg)
    stats = {"own_s": time.time() - t0}
    others = [j for j in range(len(idx.shards)) if (j < shard if cfg.mode == "causal" else j != shard)]
    if others:
        t1 = time.time()
        matches = {j: cross_shard.other_shard_matches(idx, shard, j, cfg.max_len) for j in others}
        merge_matches(idx, shard, f, aux, matches, with_topk)
        stats["others_s"] = time.time() - t1
    finish_shard_features(idx, shard, cfg, f)
    stats["total_s"] = time.time() - t0
    return f, stats


def finish_shard_features(idx: Index, shard: int, cfg: FeatureConfig, f: Features, whole: tuple[np.ndarray, int] | None = None) -> None:
    """The merged features' last steps: the unmatched positions read the allowed unigram counts
    (with top-k), the separators' rows are empty. whole: the whole index's unigram counts and
    positions (default idx's; a cluster's holder has only its group's)."""
    if cfg.top_k > 0:
        _unigram_features(idx, shard, cfg, f, whole or (idx.unigram, idx.n_positions))
    sep_pos = np.asarray(idx.shards[shard].tok) == idx.sep
    f.length[sep_pos] = 0
    f.cont[sep_pos] = -1
    f.count[sep_pos] = 0
    f.topk_ids[sep_pos] = -1
    f.topk_cnt[sep_pos] = 0


Remote = tuple[np.ndarray, dict[int, list[tuple]]]


def merge_matches(
    idx: Index, shard: int, f: Features, aux: dict, matches: dict, with_topk: bool, *, remote: Remote | None = None, places=None
) -> None:
    """Merge into f (a shard's own features, own_shard_features) the matches of its positions in
    the other allowed shards: matches {j: (L, lo, hi)} in idx's shard j (cross_shard); remote,
    those of shards held elsewhere (a cluster's other groups, builder/cluster_features.py): per
    position their longest match, and where it is the longest of all, its parts (count, latest
    shard's place, the continuation there, next tokens, their counts). The longest L wins; on a
    tie the counts and histograms add up and cont comes from the most recent source (the latest
    shard, then the largest position). places: the place in the whole index of each of idx's
    shards (default: idx is the whole index)."""
    k = f.topk_ids.shape[1]
    place = list(places) if places is not None else list(range(len(idx.shards)))
    own_L = f.length.astype(np.int64)
    lengths = [L for L, _, _ in matches.values()] + ([remote[0]] if remote else [])
    best = own_L.copy()
    for L in lengths:
        best = np.maximum(best, L)
    touched = np.zeros(len(best), bool)
    for L in lengths:
        touched |= (L == best) & (best > 0)
    buf_t = np.empty(HEAVY * 64, np.int64)
    buf_c = np.empty(HEAVY * 64, np.int64)
    for t in np.nonzero(touched)[0]:
        Lt = int(best[t])
        count = 0
        recent = (-1, -1, -1)  # (shard's place, position, cont)
        hists = []
        if own_L[t] == Lt:
            count += int(f.count[t])
            if f.cont[t] >= 0:
                recent = (place[shard], int(aux["pos"][t]), int(f.cont[t]))
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
            if (place[j], p) > recent[:2]:
                c = int(o.tok[p + Lt])
                recent = (place[j], p, idx.eos_id if c == idx.sep else c)
            if with_topk:
                hists.append(idx.shard_dist(o, a, b, Lt))
        for n, latest, c, toks, cnts in remote[1].get(int(t), ()) if remote else ():
            count += n
            if (latest, 0) > recent[:2]:  # another group's shard: never this one's place
                recent = (latest, 0, c)
            if with_topk:
                hists.append((toks, cnts))
        f.length[t] = Lt
        f.count[t] = count
        f.cont[t] = recent[2]
        if with_topk:
            ids, cs = _topk(*_merge_hist(hists), k)
            f.topk_ids[t], f.topk_cnt[t] = ids, np.minimum(cs, np.iinfo(np.int32).max)


# ---- orchestration ---------------------------------------------------------------------------


def _feature_task(index_dir: str, out: str, shard: int, cfg: FeatureConfig) -> dict:
    """Compute, write and mark one shard's features (the unit an executor runs)."""
    idx = Index(index_dir, access="normal")  # scans its shards in order
    f, stats = shard_features(idx, shard, cfg)
    write_shard(Path(out), shard, f, np.dtype(idx.manifest["token_dtype"]), idx.sep, cfg.top_k)
    return {"shard": shard, "positions": int(len(f.length))} | stats


def write_shard(out: Path, shard: int, f: Features, token_dtype: np.dtype, sep: int, k: int) -> None:
    """Write one shard's features, then its marker (the shard is done: a rerun skips it)."""
    files = write_features(out / f"{shard:06d}", f, token_dtype, sep, k)
    fmt.write_json(out / f"{shard:06d}.done", {"shard": shard, "files": files})


def _merged_feature_task(index_dir: str, out: str, shards: list[int], cfg: FeatureConfig, progress: bool = False) -> dict:
    """Compute all shards' features at once (the merged suffix array, chunk by chunk), write
    and mark `shards`."""
    idx = Index(index_dir, access="normal")
    per_shard, stats = merged_exclude_doc_lengths(idx, cfg, scratch=Path(out) / "scratch", progress=progress)
    none = np.zeros(0, np.int64)  # count and top-k: not computed, not written (k = 0)
    for shard in shards:
        length, cont = per_shard[shard]
        write_shard(Path(out), shard, Features(length, cont, none, none, none), np.dtype(idx.manifest["token_dtype"]), idx.sep, 0)
    return {"merged_shards": shards, "positions": int(sum(len(x) for x, _ in per_shard))} | stats


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
    Shards are computed in parallel, by local processes or as Ray tasks; exclude-doc length +
    continuation of a sharded index in one task, from the merged suffix array of all shards.
    An index held by a Ray cluster's actors: builder/cluster_features.py (the same files)."""
    if corpus is not None:
        return compute_held_out(index_dir, out, cfg, corpus, workers=workers, progress=progress)
    from .executors import make_executor

    idx = Index(index_dir, access="normal")  # scans its shards in order
    out = Path(out)
    if cfg.mode not in MODES:
        raise BuildError("held-out features need --corpus")
    ident = begin(idx.path, out, cfg, corpus)
    t0 = time.time()
    todo = [s.id for s in idx.shards if not (out / f"{s.id:06d}.done").exists()]
    ex = make_executor(executor, min(workers, max(1, len(todo))), ray_address)
    bar = tqdm(total=len(todo), desc=f"features ({cfg.mode})", unit="shard", disable=not progress)
    try:
        merged = _merged_path(idx, cfg)
        if merged and todo:
            ex.submit(_merged_feature_task, str(idx.path), str(out), todo, cfg, progress)
        for s in [] if merged else todo:
            ex.submit(_feature_task, str(idx.path), str(out), s, cfg)
        results = ex.results()
        bar.update(len(todo))
    finally:
        ex.close()
        bar.close()
    shards = [fmt.read_json(out / f"{s.id:06d}.done") for s in idx.shards]
    positions = sum(s.tok.shape[0] for s in idx.shards)
    report = {"shards": results, "total_s": time.time() - t0}
    finish(out, ident, shards, positions, report)
    return report
