"""The incremental scorer: an index's per-position features for a sequence that grows one
token at a time (generation), each equal to Index.score of the whole sequence at that position."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from . import kernels as K
from .features import SCORE_DTYPES, Features
from .results import Occurrence
from .shard import Shard


class Searched(Protocol):
    """What the scorer reads of an index (index.engine.Index is one)."""

    shards: list[Shard]
    eos_id: int

    def check_token(self, cont, what: str = "cont") -> int: ...

    def position_features(self, q: np.ndarray, t: int, per: list[tuple[int, int, int]], top_k: int, out: Features, row: int) -> None: ...

    def segs_dist(self, segs: list[tuple[int, int]], d: int) -> tuple[np.ndarray, np.ndarray]: ...


class Scorer:
    def __init__(self, idx: Searched, top_k: int, max_len: int):
        self.idx, self.top_k, self.max_len = idx, top_k, max_len
        self.ids = np.zeros(256, np.int64)
        self.n = 0
        self.state = [np.array([0, 0, s.n], np.int64) for s in idx.shards]

    def append(self, token: int) -> Features:
        """Features of the new last position (a one-row Features)."""
        tok = self.idx.check_token(token, "token")
        if self.n == len(self.ids):
            self.ids = np.concatenate([self.ids, np.zeros(len(self.ids), np.int64)])
        self.ids[self.n] = tok
        t = self.n
        self.n += 1
        cap = self.max_len if self.max_len > 0 else 1 << 62
        per = [K.match_step(s.tok, s.sa.words, s.sa.width, s.n, self.ids, t, cap, st) for s, st in zip(self.idx.shards, self.state)]
        out = Features.empty(1, self.top_k, SCORE_DTYPES)
        self.idx.position_features(self.ids[: self.n], t, per, self.top_k, out, 0)
        return out

    def snapshot(self) -> tuple[int, list[np.ndarray]]:
        """The scorer's state after the tokens so far; restore() returns to it (speculative
        decoding appends drafted tokens, then drops those the model rejects)."""
        return self.n, [st.copy() for st in self.state]

    def restore(self, snap: tuple[int, list[np.ndarray]]) -> None:
        self.n, states = snap
        self.state = [st.copy() for st in states]

    def _longest(self) -> tuple[int, list[tuple[int, int]]]:
        """The last position's longest match length and each shard's interval of it ((0, 0)
        in a shard where the match is shorter)."""
        lens = [self.n - int(st[0]) for st in self.state]  # state [start, lo, hi]: match ids[start:n]
        L = max(lens, default=0)
        return L, [(int(st[1]), int(st[2])) if x == L and L > 0 else (0, 0) for st, x in zip(self.state, lens)]

    def top_continuation(self, n: int) -> np.ndarray:
        """Up to n tokens continuing the last position's longest match by the ∞-gram's most
        frequent next token (ties: the smaller id), again and again: what a model that had
        learnt the corpus by heart would write greedily. Stops at a document end: (<= n,) int64."""
        L, segs = self._longest()
        if L == 0:
            return np.zeros(0, np.int64)
        idx = self.idx
        out = []
        for d in range(L, L + n):
            toks, cnts = idx.segs_dist(segs, d)
            if not len(toks):
                break
            t = int(toks[np.lexsort((toks, -cnts))[0]])
            if t == idx.eos_id:
                break
            out.append(t)
            segs = [K.narrow(s.tok, s.sa.words, s.sa.width, a, b, d, t) if b > a else (0, 0) for s, (a, b) in zip(idx.shards, segs)]
        return np.asarray(out, np.int64)

    def occurrence(self) -> Occurrence | None:
        """The most recent occurrence of the last position's longest match -- the one whose
        next token is that position's `cont` feature -- or None when nothing matched."""
        L, segs = self._longest()
        if L == 0:
            return None
        j = max(j for j, (a, b) in enumerate(segs) if b > a)  # the latest shard, as the cont feature
        return Occurrence(j, self.idx.shards[j].most_recent(*segs[j]), L)
