"""The builder's exclude-doc features of an index held by a Ray cluster (index/cluster.py),
computed by the holders beside their shards: the same files, byte for byte, as the local pass
(builder/features.py), whose per-shard steps run here on the holders.

For each shard S, held in group G:
1. S's holder computes S's own features (features.own_shard_features: every document of S but
   the position's own) and the matches of S's positions in G's other shards (cross_shard's
   merge-join), keeps them, and returns S's documents and their longest match so far;
2. a holder of every other group matches the documents against its shards, all of which are
   allowed (index/cluster_bulk.py's first round, as for held-out text); the client takes the
   longest match of each position;
3. the groups whose match is that longest return its next-token histogram, latest shard and
   continuation there (cluster_bulk's second round);
4. S's holder merges them with its own as the local pass merges shards (features.merge_matches:
   the longest wins, ties add up, the latest shard's continuation), fills the unmatched positions
   from the whole index's unigram counts (finish_shard_features), and returns the shard's
   features, which the client writes as the local pass does (features.write_shard).

A shard written is marked done: a rerun skips it, and refuses a directory holding features of
another index or configuration (index/features.py's begin). S's documents travel to every other
group's holder (their tokens, as int64).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from teragram.index import cluster_bulk
from teragram.index import format as fmt
from teragram.index.errors import BuildError
from teragram.index.features import FeatureConfig, Features, begin, finish
from tqdm import tqdm

from . import cross_shard
from .features import finish_shard_features, merge_matches, own_shard_features, write_shard


def own_part(holder, key: int, place: int, cfg: FeatureConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step 1 on S's holder: S's own features and its matches in the group's other shards, kept
    under `key`; returns S's documents (ids, starts, as bulk.py takes them) and the longest
    match so far of each of their positions."""
    idx = holder.idx
    j = holder.places.index(place)
    f, aux = own_shard_features(idx, j, cfg)
    matches = {o: cross_shard.other_shard_matches(idx, j, o, cfg.max_len) for o in range(len(idx.shards)) if o != j}
    holder.features_kept = (key, f, aux, matches)
    best = f.length.astype(np.int64)
    for L, _, _ in matches.values():
        best = np.maximum(best, L)
    rows = np.flatnonzero(aux["T"] != idx.sep)  # the documents' positions (not their ends)
    starts = aux["starts"] - np.arange(len(aux["starts"]))
    return aux["T"][rows].astype(np.int64), starts, best[rows]


def merged_part(holder, key: int, place: int, cfg: FeatureConfig, longest: np.ndarray, parts: list, whole: tuple) -> Features:
    """Step 4 on S's holder: the features kept under `key` merged with the other groups' parts
    (cluster_bulk.holder_histograms' answers for the documents' rows) whose longest match is
    `longest` (per row); whole: the whole index's unigram counts and positions."""
    kept = getattr(holder, "features_kept", None)
    if kept is None or kept[0] != key:  # a replica that did not run step 1 for it
        own_part(holder, key, place, cfg)
        kept = holder.features_kept
    holder.features_kept = None
    _, f, aux, matches = kept
    idx = holder.idx
    rows = np.flatnonzero(aux["T"] != idx.sep)
    remote_L = np.zeros(len(aux["T"]), np.int64)
    remote_L[rows] = longest
    at: dict[int, list[tuple]] = {}
    for g_rows, ctx, latest, cont, off, tok, cnt in parts:
        for r, c in zip(g_rows.tolist(), ctx.tolist()):
            a, b = off[c], off[c + 1]
            at.setdefault(int(rows[r]), []).append((int(cnt[a:b].sum()), int(latest[c]), int(cont[c]), tok[a:b], cnt[a:b]))
    j = holder.places.index(place)
    merge_matches(idx, j, f, aux, matches, cfg.top_k > 0, remote=(remote_L, at), places=holder.places)
    finish_shard_features(idx, j, cfg, f, whole)
    return f


def cluster_shard_features(cidx, place: int, cfg: FeatureConfig) -> Features:
    """The exclude-doc features of the shard at `place`, by the holders (steps 1-4 above)."""
    own = cidx.group_of(place)
    others = [g for g in range(len(cidx.groups)) if g != own]
    key = cidx.next_key()
    ids, starts, longest = cidx.run_each(dict.fromkeys([own], ("call", own_part, key, place, cfg)))[own]
    parts = []
    if others and len(ids):
        got = cidx.run_each(dict.fromkeys(others, ("bulk_lengths", key, ids, starts, [cfg.max_len])))
        longest = np.max([longest] + [got[g][0][0] for g in others], axis=0)
        skip = np.zeros(len(ids), bool)
        got = cidx.run_each(
            dict.fromkeys(others, ("bulk_histograms", key, ids, starts, [cfg.max_len], longest[None], skip, cluster_bulk.HEAVY))
        )
        parts = [got[g] for g in others]
    whole = (cidx.unigram, cidx.n_positions)
    return cidx.run_each(dict.fromkeys([own], ("call", merged_part, key, place, cfg, longest, parts, whole)))[own]


def compute_cluster_features(cidx, out: str | Path, cfg: FeatureConfig, *, progress: bool = True) -> dict:
    """Write the exclude-doc features of an index held by a cluster (a ClusterIndex) into `out`,
    shard by shard: the local pass's files (builder/features.compute_features). Resumable per
    shard; returns a report."""
    if cfg.mode != "exclude-doc":
        raise BuildError(f"--cluster computes exclude-doc features of the indexed corpus (or held-out ones, --corpus), not {cfg.mode}")
    out = Path(out)
    ident = begin(cidx.path, out, cfg, None)
    t0 = time.time()
    dtype = np.dtype(cidx.manifest["token_dtype"])
    todo = [(p, s) for p, s in enumerate(cidx.shard_ids) if not (out / f"{s:06d}.done").exists()]
    results = []
    with tqdm(total=len(todo), desc=f"features ({cfg.mode}, cluster)", unit="shard", disable=not progress) as bar:
        for place, shard in todo:
            t = time.time()
            f = cluster_shard_features(cidx, place, cfg)
            write_shard(out, shard, f, dtype, cidx.sep, cfg.top_k)
            results.append({"shard": shard, "positions": int(len(f.length)), "total_s": time.time() - t})
            bar.update(1)
    shards = [fmt.read_json(out / f"{s:06d}.done") for s in cidx.shard_ids]
    report = {"shards": results, "total_s": time.time() - t0}
    finish(out, ident, shards, cidx.n_positions, report)
    return report
