"""The incremental scorer (index/scorer.py) of an index held by a Ray cluster (index/cluster.py):
generation's per-token features and the gates' estimates, exactly the local Scorer's, with each
holder keeping a Scorer of its own group of shards per generation session.

Each appended token goes to every group in one round of calls (one call per group); each
group's Scorer reads it and answers for its shards alone, and the client merges the parts as
cluster.py merges the ∞-gram's: a group's Scorer finds the longest suffix of the sequence that
occurs in its shards (L_g); the index's is the longest of the groups' (L), and a group holds a
suffix of length k exactly when L_g >= k (a shard that lacks a suffix lacks every longer one).
So for the features (the match capped at max_len: min(L_g, max_len)) and for each estimate's
context (min(L_g, k); the ∞-gram's: L_g), the groups whose length equals the longest hold it:
their counts and next-token histograms add, the top k is read off the sum (count desc, id asc)
and the continuation is the latest shard's. A group cannot know whether it reaches the longest,
so it sends its part whatever its length: one round per token, never a second.

The estimates' context lengths are learnt from the first estimates() call and asked with every
append after it; snapshot() and restore() (drafts) ride on the next call. A holder without the
session (a replica answering for a lost one, or the session dropped as its least recently used
of SESSIONS) is sent the tokens again, with the call. close() drops the session on the holders.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

from .features import SCORE_DTYPES, Features, top_counts
from .results import Occurrence
from .scorer import Scorer, most_frequent

SESSIONS = 64  # generation sessions a holder keeps; the least recently used is dropped


# ---- the holder's side (a method of cluster_holder.ShardHolder) --------------------------------


def holder_session(holder, key: int, n: int, ops: list[tuple]) -> list | None:
    """Run ops (below) in order on the session `key`, whose Scorer has read n tokens; None when
    this holder does not have it so (the client then sends the tokens again, with "open")."""
    sessions = holder.__dict__.setdefault("sessions", OrderedDict())
    if ops and ops[0][0] == "close":
        sessions.pop(key, None)
        return []
    if ops and ops[0][0] == "open":
        sessions[key] = {"scorer": Scorer(holder.idx, *ops[0][1:]), "saved": None, "top": None}
        ops = ops[1:]
    elif key not in sessions or sessions[key]["scorer"].n != n:
        return None
    sessions.move_to_end(key)
    while len(sessions) > SESSIONS:
        sessions.popitem(last=False)
    s = sessions[key]
    return [_op(holder, s, op, *args) for op, *args in ops]


def _op(holder, s: dict, op: str, *args):
    sc: Scorer = s["scorer"]
    if op == "feed":
        for t in args[0]:
            sc.advance(int(t))
        return None
    if op == "save":
        s["saved"] = sc.snapshot()
        return None
    if op == "restore":
        sc.restore(s["saved"])
        return None
    if op == "append":
        sc.advance(args[0])
        return _match_part(holder, sc), _estimates_part(sc, args[1])
    if op == "estimates":
        return _estimates_part(sc, args[0])
    if op == "top":
        return _top_part(s, sc, *args)
    raise ValueError(f"unknown session op {op!r}")


def _match_part(holder, sc: Scorer) -> tuple:
    """The group's part of the new position: (its longest match L_g, the features' length
    min(L_g, max_len), its count, the latest shard's place and the token after its most recent
    occurrence there, the match's next-token histogram (tokens, counts), and the most recent
    occurrence of the uncapped match (place, position; -1, -1 without one))."""
    L = sc.n - sc.start
    cap = min(L, sc.max_len) if sc.max_len > 0 else L
    z = np.zeros(0, np.int64)
    if L == 0:
        return 0, 0, 0, -1, -1, z, z, -1, -1
    lo, hi = sc.intervals(cap, L)
    segs = [(a, b) if b > a else (0, 0) for a, b in zip(lo.tolist(), hi.tolist())]
    latest = max(j for j, (a, b) in enumerate(segs) if b > a)
    toks, cnts = sc.idx.segs_dist(segs, cap)
    _, match = sc.longest()
    j = max(j for j, (a, b) in enumerate(match) if b > a)
    occ = holder.places[j], sc.idx.shards[j].most_recent(*match[j])
    cont = sc.idx.latest_cont(segs, cap)
    return L, cap, sum(b - a for a, b in segs), holder.places[latest], cont, toks, cnts, *occ


def _estimates_part(sc: Scorer, lengths: tuple[int, ...] | None) -> dict | None:
    """For each context length k of the gates' estimates (0: the ∞-gram's): the group's own
    context (min(L_g, k), or L_g) and its (length, count, tokens, counts)."""
    if lengths is None:
        return None
    L = sc.n - sc.start  # the group's longest match; its intervals are the scorer's
    out = {}
    for k in lengths:
        d = min(L, k) if k else L
        if d == 0:
            out[k] = (0, 0, np.zeros(0, np.int64), np.zeros(0, np.int64))
        else:
            lo, hi = sc.intervals(d, L)
            out[k] = (d, int((hi - lo).sum()), *sc.idx.segs_dist(list(zip(lo.tolist(), hi.tolist())), d))
    return out


def _top_part(s: dict, sc: Scorer, d: int, t: int, rest: int):
    """top_continuation's step on the group's shards: the d-token context (t < 0: the longest
    match's; else the last one's followed by t), and its next-token histogram; or, with rest >
    0 (this group alone holds the context), the next `rest` tokens read off it greedily."""
    segs = sc.longest()[1] if t < 0 else sc.narrow(s["top"], d - 1, t)
    s["top"] = segs
    return sc.greedy(segs, d, rest) if rest else sc.idx.segs_dist(segs, d)


# ---- the client's side --------------------------------------------------------------------------


class ClusterScorer:
    """index.scorer.Scorer's interface (append, estimates, occurrence, top_continuation,
    snapshot, restore, lookup_s) for a ClusterIndex; lookup_s includes the round trips."""

    def __init__(self, cidx, top_k: int, max_len: int):
        self.idx, self.top_k, self.max_len = cidx, top_k, max_len
        self.key = cidx.next_key()
        self.n = 0
        self.lookup_s: list[float] = []
        self._groups = range(len(cidx.groups))
        self._held: list[int] = []  # the tokens the holders' scorers have read (drafts included)
        self._held_saved: int | None = None  # how many of them the holders' snapshot had read
        self._pending: list[tuple] = []  # save / restore, sent before the next call's ops
        self._saved_n: int | None = None  # the latest snapshot's length (the holders keep one)
        self._opened = False
        self._lengths: tuple[int, ...] | None = None  # the estimates' context lengths, asked with each append
        self._last = self._state(None)  # what the groups said of the last position
        self._uni_top = None

    def _call(self, ops: dict[int, list]) -> dict[int, list]:
        """Each group's ops (after the pending ones) on a live holder of it, in one round: their
        answers; a holder without the session is sent the tokens again."""
        sent = {g: self._pending + ops.get(g, []) for g in self._groups}
        sent = {g: o for g, o in sent.items() if o}
        n = len(self._held)
        got = self.idx.run_each({g: ("session", self.key, n, o if self._opened else self._replay() + o) for g, o in sent.items()})
        lost = [g for g, r in got.items() if r is None]
        if lost:
            got |= self.idx.run_each({g: ("session", self.key, n, self._replay() + sent[g]) for g in lost})
        self._opened = True
        for op, *args in self._pending + next(iter(ops.values()), []):  # what changes the state goes to every group
            if op == "save":
                self._held_saved = len(self._held)
            elif op == "restore":
                del self._held[self._held_saved :]
            elif op == "append":
                self._held.append(args[0])
        self._pending = []
        return {g: got[g][len(got[g]) - len(ops[g]) :] for g in ops}

    def _replay(self) -> list[tuple]:
        """The ops that give a holder the session as the others have it."""
        m = len(self._held) if self._held_saved is None else self._held_saved
        ops = [("open", self.top_k, self.max_len), ("feed", self._held[:m])]
        return ops if self._held_saved is None else ops + [("save",), ("feed", self._held[m:])]

    def _state(self, parts: dict | None) -> dict:
        """The last position's groups' (match part, estimates part): each group's longest match,
        the index's (L) and the merged occurrence."""
        if parts is None:
            return {"parts": None, "L": 0, "lengths": [0] * len(self._groups), "occ": None, "est": None}
        lengths = [parts[g][0][0] for g in self._groups]
        L = max(lengths)
        occ = None
        if L:
            place, pos = max((p[0][7], p[0][8]) for p in parts.values() if p[0][0] == L)
            occ = Occurrence(place, int(pos), L)
        est = {g: parts[g][1] for g in self._groups} if self._lengths is not None else None
        return {"parts": parts, "L": L, "lengths": lengths, "occ": occ, "est": est}

    def append(self, token: int) -> Features:
        """Features of the new last position (a one-row Features), as Scorer.append."""
        tok = self.idx.head.check_token(token, "token")
        t0 = time.perf_counter()
        got = self._call({g: [("append", tok, self._lengths)] for g in self._groups})
        self.n += 1
        self._last = self._state({g: got[g][0] for g in self._groups})
        out = self._features()
        self.lookup_s.append(time.perf_counter() - t0)
        return out

    def _features(self) -> Features:
        out = Features.empty(1, self.top_k, SCORE_DTYPES)
        parts = [p[0] for p in self._last["parts"].values()]
        cap = max(p[1] for p in parts)
        if cap == 0:
            if self._uni_top is None:
                u = self.idx.unigram
                self._uni_top = top_counts(np.flatnonzero(u), u[u > 0], self.top_k)
            out.length[0], out.cont[0], out.count[0] = 0, -1, self.idx.n_positions
            out.topk_ids[0], out.topk_cnt[0] = self._uni_top
            return out
        at = [p for p in parts if p[1] == cap]
        out.length[0], out.count[0] = cap, sum(p[2] for p in at)
        out.cont[0] = max(at, key=lambda p: p[3])[4]
        out.topk_ids[0], out.topk_cnt[0] = top_counts(*_summed([(p[5], p[6]) for p in at]), self.top_k)
        return out

    def estimates(self, lengths: dict[str, int]) -> tuple[int, dict[str, tuple[int, np.ndarray, np.ndarray]]]:
        """As Scorer.estimates: read off the last append's parts, or (the first time these
        lengths are asked) from one more round."""
        t0 = time.perf_counter()
        want = tuple(sorted(set(lengths.values())))
        L = self._last["L"]
        est = self._last["est"]
        if L and (est is None or not set(want) <= set(est[0])):
            self._lengths = tuple(sorted(set(want) | set(self._lengths or ())))
            got = self._call({g: [("estimates", self._lengths)] for g in self._groups})
            est = self._last["est"] = {g: got[g][0] for g in self._groups}
        merged = {}
        for k in want:
            d = min(L, k) if k else L
            if d == 0:
                u = self.idx.unigram
                nz = np.flatnonzero(u)
                merged[k] = (self.idx.n_positions, nz, u[nz])
            else:
                at = [est[g][k] for g in self._groups if est[g][k][0] == d]
                merged[k] = (sum(p[1] for p in at), *_summed([(p[2], p[3]) for p in at]))
        if self.lookup_s:
            self.lookup_s[-1] += time.perf_counter() - t0
        return L, {name: merged[k] for name, k in lengths.items()}

    def occurrence(self) -> Occurrence | None:
        """As Scorer.occurrence: its shard is the place in the whole index (ClusterIndex.following
        and provenance read it)."""
        return self._last["occ"]

    def top_continuation(self, n: int) -> np.ndarray:
        """As Scorer.top_continuation: one round per token while more than one group holds the
        context, then the last group reads the rest alone."""
        L, out = self._last["L"], []
        held = [g for g in self._groups if self._last["lengths"][g] == L] if L else []
        d, t = L, -1
        while held and len(out) < n:
            if len(held) == 1:
                out += self._call({held[0]: [("top", d, t, n - len(out))]})[held[0]][0].tolist()
                break
            got = self._call({g: [("top", d, t, 0)] for g in held})
            held = [g for g in held if len(got[g][0][0])]
            if not held:
                break
            t = most_frequent(*_summed([got[g][0] for g in held]))
            if t == self.idx.eos_id:
                break
            out.append(t)
            d += 1
        return np.asarray(out, np.int64)

    def snapshot(self) -> tuple:
        """The state after the tokens so far (the holders keep theirs with the next call)."""
        self._pending.append(("save",))
        self._saved_n = self.n
        return self.n, dict(self._last)

    def restore(self, snap: tuple) -> None:
        """Return to the latest snapshot (the holders keep that one only)."""
        if snap[0] != self._saved_n:
            raise ValueError(f"a cluster's scorer returns to its latest snapshot ({self._saved_n} tokens), not to one of {snap[0]}")
        self.n, last = snap
        self._last = dict(last)
        self._pending.append(("restore",))

    def close(self) -> None:
        """Drop the session on the holders (not waiting for them)."""
        if self._opened:
            self.idx.run_each({g: ("session", self.key, -1, [("close",)]) for g in self._groups}, wait=False)
            self._opened = False


def _summed(hists: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Next-token histograms (tokens sorted, counts) added: tokens sorted, as Index.segs_dist's."""
    hists = [h for h in hists if len(h[0])]
    if len(hists) <= 1:
        return hists[0] if hists else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    toks, inv = np.unique(np.concatenate([h[0] for h in hists]), return_inverse=True)
    cnts = np.zeros(len(toks), np.int64)
    np.add.at(cnts, inv, np.concatenate([h[1] for h in hists]).astype(np.int64))
    return toks, cnts
