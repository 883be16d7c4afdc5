"""Drafts for speculative decoding, read off exact matches: the continuation of the longest
match of the context in the index (the ∞-gram's most frequent next token, token by token, or
what followed the match's most recent occurrence), or of its longest match earlier in the text
being written (the document cache, as prompt-lookup decoding does). The model verifies a draft
in one forward pass (model/generation/sample.py) and keeps the longest prefix it agrees with.

How far to trust a match is learnt while generating: every drafted token's fate is counted by
where it came from (index or cache) and by the length of the match it extends. A draft goes on
while the estimated probability that all its tokens are accepted stays at least `min_prob`, so
drafting stops early where matches are short or have not been trusted so far; between the
index and the cache, the source with more expected accepted tokens drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SOURCES = ("index", "cache")
N_BUCKETS = 8  # match lengths by powers of two: 0-1, 2-3, 4-7, ..., >= 128
MAX_DRAFT = 256
PRIOR = (1.0, 2.0)  # (accepted, proposed) pseudo-counts of a bucket before it has data
LOOKUPS_KEPT = 100_000  # per-token lookup times a DraftStats keeps (a server keeps one for every request)


def length_bucket(length: int) -> int:
    return min(max(int(length), 1).bit_length() - 1, N_BUCKETS - 1)


def cache_match(q: np.ndarray, max_len: int = 64) -> tuple[int, int]:
    """The longest suffix of q (at most max_len tokens) that also ends earlier in q, and the
    end e of its most recent earlier occurrence (q[e - L : e] == q[len(q) - L :], e < len(q),
    so q[e] is what followed it); (0, -1) when the last token never occurred before."""
    n = len(q)
    ends = np.arange(1, n)
    length, end = 0, -1
    for k in range(1, min(max_len, n - 1) + 1):
        ends = ends[ends >= k]
        ends = ends[q[ends - k] == q[n - k]]
        if not len(ends):
            break
        length, end = k, int(ends[-1])
    return length, end


@dataclass
class Draft:
    tokens: list[int]
    source: str  # "index" | "cache"
    length: int  # length of the match the draft continues


@dataclass
class DraftStats:
    """Counts of drafted and accepted tokens by source and match-length bucket, and of
    forward passes and the tokens they produced."""

    proposed: np.ndarray = field(default_factory=lambda: np.zeros((len(SOURCES), N_BUCKETS), np.int64))
    accepted: np.ndarray = field(default_factory=lambda: np.zeros((len(SOURCES), N_BUCKETS), np.int64))
    forwards: int = 0
    tokens: int = 0
    lookup_s: list[float] = field(default_factory=list)  # index lookups per appended token (the last LOOKUPS_KEPT)

    def rate(self, source: str, length: int) -> float:
        s, b = SOURCES.index(source), length_bucket(length)
        return (self.accepted[s, b] + PRIOR[0]) / (self.proposed[s, b] + PRIOR[1])

    def record(self, draft: Draft | None, n_accepted: int, n_emitted: int) -> None:
        self.forwards += 1
        self.tokens += n_emitted
        if draft is None:
            return
        s = SOURCES.index(draft.source)
        for j in range(len(draft.tokens)):
            b = length_bucket(draft.length + j)
            self.proposed[s, b] += 1
            self.accepted[s, b] += j < n_accepted

    def clear(self) -> None:
        """Forget every count."""
        self.proposed[:] = 0
        self.accepted[:] = 0
        self.forwards = self.tokens = 0
        self.lookup_s = []

    def add_lookups(self, seconds: list[float]) -> None:
        """The seconds of index lookups (features, and the gate's estimates) of appended tokens."""
        self.lookup_s = (self.lookup_s + list(seconds))[-LOOKUPS_KEPT:]

    def merge(self, other: DraftStats) -> None:
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.forwards += other.forwards
        self.tokens += other.tokens
        self.add_lookups(other.lookup_s)

    def to_json(self) -> dict:
        by = {}
        for s, name in enumerate(SOURCES):
            for b in range(N_BUCKETS):
                if self.proposed[s, b]:
                    lo = 0 if b == 0 else 1 << b
                    key = f"{name} {lo}+" if b == N_BUCKETS - 1 else f"{name} {lo}-{(2 << b) - 1}"
                    by[key] = {"drafted": int(self.proposed[s, b]), "accepted": int(self.accepted[s, b])}
        drafted = int(self.proposed.sum())
        return {
            "forward_passes": self.forwards,
            "tokens": self.tokens,
            "tokens_per_forward": self.tokens / max(self.forwards, 1),
            "drafted": drafted,
            "accepted": int(self.accepted.sum()),
            "acceptance_rate": float(self.accepted.sum()) / max(drafted, 1),
            "by_match_length": by,
            "lookup_ms_median": float(np.median(self.lookup_s)) * 1e3 if self.lookup_s else None,
            "lookup_ms_mean": float(np.mean(self.lookup_s)) * 1e3 if self.lookup_s else None,
        }


@dataclass
class Drafter:
    """Proposes drafts of up to max_tokens tokens; its stats carry over between calls (a
    server keeps one, so that what it learnt about a workload is not lost per request)."""

    max_tokens: int = 8
    min_prob: float = 0.1  # draft while P(all drafted tokens accepted) stays at least this
    max_match: int = 64  # longest cache match looked for
    sources: tuple[str, ...] = SOURCES  # ("cache",) alone is prompt-lookup decoding
    # the index's draft: "top", the ∞-gram's argmax token by token, or "recent", what followed the
    # match's most recent occurrence; between index and cache, the one with more "expected"
    # accepted tokens (from the stats) or the "longer" match. Defaults chosen on validation
    # prompts (docs/results.md, section 6).
    index_draft: str = "top"
    choose: str = "expected"
    stats: DraftStats = field(default_factory=DraftStats)

    def __post_init__(self) -> None:
        if not 0 <= self.max_tokens <= MAX_DRAFT:
            raise ValueError(f"draft length {self.max_tokens} outside [0, {MAX_DRAFT}]")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"min_prob {self.min_prob} outside [0, 1]")
        if self.index_draft not in ("recent", "top"):
            raise ValueError(f"index_draft {self.index_draft!r}: expected 'recent' or 'top'")
        if self.choose not in ("longer", "expected"):
            raise ValueError(f"choose {self.choose!r}: expected 'longer' or 'expected'")
        if not self.sources or set(self.sources) - set(SOURCES):
            raise ValueError(f"draft sources {self.sources}: expected some of {SOURCES}")

    def _plan(self, source: str, length: int, n: int) -> tuple[int, float]:
        """How many tokens to draft from a match of this length (while the estimated chance
        that all are accepted is at least min_prob), and how many are expected to be accepted."""
        p, keep, expected = 1.0, 0, 0.0
        while keep < n:
            p *= self.stats.rate(source, length + keep)
            if p < self.min_prob:
                break
            keep += 1
            expected += p
        return keep, expected

    def propose(self, scorer, occurrence, ids: list[int], limit: int) -> Draft | None:
        """A draft after ids (the text so far; `scorer` has read them, `occurrence` is its
        occurrence()): the continuation of the index's longest match or of the text's own
        earlier match (see `choose`), as long as the estimated chance that every token is
        accepted stays at least min_prob."""
        n = min(self.max_tokens, limit)
        if n <= 0:
            return None
        q = np.asarray(ids, np.int64)
        c_len, c_end = cache_match(q, self.max_match) if "cache" in self.sources else (0, -1)
        i_len = occurrence.length if occurrence is not None and "index" in self.sources else 0
        if c_len == 0 and i_len == 0:
            return None
        plans = {s: self._plan(s, L, n) for s, L in (("cache", c_len), ("index", i_len)) if L}
        if self.choose == "longer":
            source = "cache" if c_len >= i_len else "index"
        else:
            source = max(plans, key=lambda s: (plans[s][1], s == "cache"))
        length = c_len if source == "cache" else i_len
        keep = plans[source][0]
        if keep == 0:
            return None
        if source == "cache":
            toks = q[c_end : c_end + keep]
        elif self.index_draft == "top":
            toks = scorer.top_continuation(keep)
        else:
            toks = scorer.idx.following(occurrence, keep)
        return Draft([int(t) for t in toks], source, length) if len(toks) else None
