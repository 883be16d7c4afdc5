"""The incremental scorer: an index's per-position features for a sequence that grows one
token at a time (generation), each equal to Index.score of the whole sequence at that position,
and the gates' index estimates after it, each from the previous token's match and intervals."""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from . import kernels as K
from .fanout import N_STATE, ShardSet
from .features import SCORE_DTYPES, Features
from .matching import extend, new_memo
from .merged import tables
from .results import Occurrence
from .shard import Shard

MEMO = 1 << 10  # probes after failed extensions remembered per sequence (matching._probe)


class Searched(Protocol):
    """What the scorer reads of an index (index.engine.Index is one)."""

    shards: list[Shard]
    shard_set: ShardSet
    eos_id: int
    n_positions: int
    unigram: np.ndarray
    merged: object  # its summed histograms (index/merged.py) or None

    def check_token(self, cont, what: str = "cont") -> int: ...

    def position_features(self, q: np.ndarray, t: int, per: list[tuple[int, int, int]], top_k: int, out: Features, row: int) -> None: ...

    def segs_dist(self, segs: list[tuple[int, int]], d: int) -> tuple[np.ndarray, np.ndarray]: ...


class Scorer:
    """The longest match of the sequence's end (ids[start:n]) and every shard's interval of it,
    carried from token to token (matching.extend: all shards searched together). `lookup_s`:
    the seconds spent in index lookups per appended token (and per estimates() call)."""

    def __init__(self, idx: Searched, top_k: int, max_len: int):
        self.idx, self.top_k, self.max_len = idx, top_k, max_len
        self.ss = idx.shard_set
        self.ids = np.zeros(256, np.int64)
        self.n = 0
        self.start = 0
        self.lo = np.zeros(len(idx.shards), np.int64)
        self.hi = np.array([s.n for s in idx.shards], np.int64)
        self._st = np.empty((2 * len(idx.shards), N_STATE), np.int64)
        self._memo = new_memo(len(idx.shards), MEMO)
        self._known = tables(idx.merged, idx.trigrams)
        self.lookup_s: list[float] = []

    def advance(self, token: int) -> None:
        """Read one more token: the longest match of the new end and its intervals."""
        tok = self.idx.check_token(token, "token")
        if self.n == len(self.ids):
            self.ids = np.concatenate([self.ids, np.zeros(len(self.ids), np.int64)])
        self.ids[self.n] = tok
        ss = self.ss
        self.start = extend(
            ss.table,
            ss.first_rank,
            ss.pos,
            ss.prefix,
            ss.step_log2,
            ss.contexts,
            self._known,
            self.ids,
            self.start,
            self.n,
            self._st,
            self.lo,
            self.hi,
            self._memo,
        )
        self.n += 1

    def append(self, token: int) -> Features:
        """Features of the new last position (a one-row Features)."""
        t0 = time.perf_counter()
        self.advance(token)
        L = self.n - self.start
        cap = min(L, self.max_len) if self.max_len > 0 else L
        lo, hi = self.intervals(cap, L)
        per = [(cap if b > a else 0, a, b) for a, b in zip(lo.tolist(), hi.tolist())]
        out = Features.empty(1, self.top_k, SCORE_DTYPES)
        self.idx.position_features(self.ids[: self.n], self.n - 1, per, self.top_k, out, 0)
        self.lookup_s.append(time.perf_counter() - t0)
        return out

    def intervals(self, k: int, L: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Every shard's interval of the last k tokens, k <= the longest match L: the match's own,
        or found (every shard together)."""
        L = self.n - self.start if L is None else L
        if k == L:
            return self.lo, self.hi
        return self.ss.find(self.ids[self.n - k : self.n])

    def estimates(self, lengths: dict[str, int]) -> tuple[int, dict[str, tuple[int, np.ndarray, np.ndarray]]]:
        """The index's next-token estimates after the sequence so far, as the gates read them
        (model/mixture/estimates.py): the longest match's length L and, for each name, the
        continuations of the last min(L, k) tokens (k = 0: the longest match, the ∞-gram's) as
        (count, tokens, counts). The match's intervals are the scorer's; a shorter context's
        are found once (every shard together)."""
        t0 = time.perf_counter()
        L = self.n - self.start
        out, seen = {}, {}
        for name, k in lengths.items():
            k = min(L, k) if k else L
            if k not in seen:
                if k == 0:
                    u = self.idx.unigram
                    nz = np.flatnonzero(u)
                    seen[k] = (self.idx.n_positions, nz, u[nz])
                else:
                    lo, hi = self.intervals(k, L)
                    toks, cnts = self.idx.segs_dist(list(zip(lo.tolist(), hi.tolist())), k)
                    seen[k] = (int((hi - lo).sum()), toks, cnts)
            out[name] = seen[k]
        if self.lookup_s:
            self.lookup_s[-1] += time.perf_counter() - t0
        return L, out

    def close(self) -> None:
        """Nothing to let go of here (a cluster's scorer drops its holders' sessions)."""

    def snapshot(self) -> tuple:
        """The scorer's state after the tokens so far; restore() returns to it (speculative
        decoding appends drafted tokens, then drops those the model rejects)."""
        return self.n, self.start, self.lo.copy(), self.hi.copy()

    def restore(self, snap: tuple) -> None:
        self.n, self.start, lo, hi = snap
        self.lo, self.hi = lo.copy(), hi.copy()
        buckets, rows = self._memo  # its strings are positions of ids, which the next tokens overwrite
        buckets[:] = -1
        rows[0, 0] = 0

    def longest(self) -> tuple[int, list[tuple[int, int]]]:
        """The last position's longest match length and each shard's interval of it ((0, 0)
        in a shard that lacks it)."""
        L = self.n - self.start
        return L, [(a, b) if b > a and L > 0 else (0, 0) for a, b in zip(self.lo.tolist(), self.hi.tolist())]

    def top_continuation(self, n: int) -> np.ndarray:
        """Up to n tokens continuing the last position's longest match by the ∞-gram's most
        frequent next token (ties: the smaller id), again and again: what a model that had
        learnt the corpus by heart would write greedily. Stops at a document end: (<= n,) int64."""
        L, segs = self.longest()
        return self.greedy(segs, L, n) if L else np.zeros(0, np.int64)

    def greedy(self, segs: list[tuple[int, int]], length: int, n: int) -> np.ndarray:
        """top_continuation from the shards' intervals `segs` of a context of `length` tokens."""
        out = []
        for d in range(length, length + n):
            toks, cnts = self.idx.segs_dist(segs, d)
            if not len(toks):
                break
            t = most_frequent(toks, cnts)
            if t == self.idx.eos_id:
                break
            out.append(t)
            segs = self.narrow(segs, d, t)
        return np.asarray(out, np.int64)

    def narrow(self, segs: list[tuple[int, int]], d: int, t: int) -> list[tuple[int, int]]:
        """The shards' intervals of a d-token context followed by t, from the context's."""
        return [K.narrow(s.tok, s.sa.words, s.sa.width, a, b, d, t) if b > a else (0, 0) for s, (a, b) in zip(self.idx.shards, segs)]

    def occurrence(self) -> Occurrence | None:
        """The most recent occurrence of the last position's longest match -- the one whose
        next token is that position's `cont` feature -- or None when nothing matched."""
        L, segs = self.longest()
        if L == 0:
            return None
        j = max(j for j, (a, b) in enumerate(segs) if b > a)  # the latest shard, as the cont feature
        return Occurrence(j, self.idx.shards[j].most_recent(*segs[j]), L)


def most_frequent(toks: np.ndarray, cnts: np.ndarray) -> int:
    """The token of a histogram with the largest count (ties: the smaller id)."""
    return int(toks[np.lexsort((toks, -cnts))[0]])
