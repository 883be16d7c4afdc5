"""The holders of an index held by a Ray cluster (index/cluster.py): each a Ray actor on a node
that stores its group of shards, an Index of those shards alone, answering the client's parts of
queries for them. A batch of parts travels packed (pack): a few arrays, not one per query."""

from __future__ import annotations

import time

import numpy as np

from . import cluster_bulk, cluster_scorer, cnf
from .engine import Index
from .results import Occurrence, Provenance


class ShardHolder:
    """A Ray actor's shards: an Index of them alone. `parts` answers a batch of parts of queries
    (below: one method per kind), each for these shards only."""

    def __init__(self, path: str, places: list[int]):
        self.idx = Index(path, shards=places)
        self.places = places

    def node(self) -> str:
        """The id of the Ray node this holder runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def parts(self, batch: tuple) -> list:
        """The parts asked by a packed batch (pack), in order."""
        kinds, flat, offsets, args = batch
        return [getattr(self, f"part_{k}")(flat[offsets[i] : offsets[i + 1]], *a) for i, (k, a) in enumerate(zip(kinds, args))]

    def unigram(self) -> np.ndarray:
        return self.idx.unigram

    def cpu_seconds(self) -> float:  # this holder's process's, for measurements
        return time.process_time()

    bulk_lengths = cluster_bulk.holder_lengths  # a bulk pass's two rounds (cluster_bulk.py)
    bulk_histograms = cluster_bulk.holder_histograms
    session = cluster_scorer.holder_session  # generation's incremental scorers (cluster_scorer.py)

    def following(self, place: int, pos: int, length: int, n: int) -> np.ndarray:
        """Index.following of an occurrence in the shard at `place` (in the whole index)."""
        return self.idx.following(Occurrence(self.places.index(place), pos, length), n)

    def provenance(self, place: int, pos: int, length: int) -> Provenance:
        return self.idx.provenance(Occurrence(self.places.index(place), pos, length))

    def cnf_part(self, terms: list, limit: int, diff: int, maxnum: int, context: int) -> cnf.ShardsPart:
        """These shards' part of a checked AND/OR query (index/cnf.py's shards_part, as the local Index runs it)."""
        return cnf.shards_part(self.idx, terms, self.places, limit, diff, maxnum=maxnum, context=context)

    def call(self, fn, *args):
        """fn(self, *args) here, beside these shards: a pass that is not the index's own (the
        builder's exclude-doc features, builder/cluster_features.py) brings its functions."""
        return fn(self, *args)

    def part_count(self, q: np.ndarray) -> int:
        return self.idx.count_intervals(q)[0]

    def part_intervals(self, q: np.ndarray) -> list[tuple[int, int]]:
        return self.idx.count_intervals(q)[1]

    def part_prob(self, q: np.ndarray, cont: int) -> tuple[int, int]:
        r = self.idx.prob(q, cont)
        return r.prompt_cnt, r.cont_cnt

    def part_ntd(self, q: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """(count, next tokens, their counts): ntd([]) reads the unigram counts, as Index does."""
        n, segs = self.idx.count_intervals(q)
        if len(q) == 0:
            toks = np.flatnonzero(self.idx.unigram)
            return n, toks, self.idx.unigram[toks]
        if n == 0:
            return 0, np.zeros(0, np.int64), np.zeros(0, np.int64)
        return (n, *self.idx.segs_dist(segs, len(q)))

    def part_suffix(self, q: np.ndarray, cont: int) -> tuple[int, int, int]:
        """(l, count, count with cont): this group's longest suffix of q and its counts."""
        sl, iv = self.idx.suffix_intervals(q, cont)
        n = self.idx.n_positions if sl == 0 else int((iv[1] - iv[0]).sum())
        return sl, n, int((iv[3] - iv[2]).sum())

    def part_match(self, q: np.ndarray) -> tuple[int, int, int, int]:
        """(l, count, latest shard's place, its continuation): this group's longest suffix of q."""
        sl, iv = self.idx.suffix_intervals(q)
        if sl == 0:
            return 0, self.idx.n_positions, -1, -1
        segs = list(zip(iv[0].tolist(), iv[1].tolist()))
        latest = max(i for i, (a, b) in enumerate(segs) if b > a)
        return sl, int((iv[1] - iv[0]).sum()), self.places[latest], self.idx.latest_cont(segs, sl)

    def part_docs(self, q: np.ndarray, place: int, a: int, b: int, n: int, context: int) -> tuple[list, bool]:
        """Index.shard_docs of the shard at `place` (in the whole index) and its interval [a, b) of q."""
        return self.idx.shard_docs(self.places.index(place), a, b, len(q), n, context)


def pack(tasks: list[tuple]) -> tuple:
    """Tasks (kind, ids, *ints) as (kinds, every task's ids in one int64 array, where each
    task's start, the ints): a few arrays pickle in microseconds, a thousand small ones do not."""
    qs = [t[1] for t in tasks]
    offsets = np.cumsum([0] + [len(q) for q in qs])
    flat = np.concatenate(qs).astype(np.int64) if qs else np.zeros(0, np.int64)
    return [t[0] for t in tasks], flat, offsets, [t[2:] for t in tasks]
