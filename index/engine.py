"""The query engine: infini-gram's operations over a sharded teragram index, exactly.

Open an index once (everything is memory-mapped; nothing is loaded), then ask:

    idx = Index("idx/")
    idx.count([5, 17])                 -> CountResult(count, approx=False)
    idx.prob([5], 17)                  -> ProbResult(prompt_cnt, cont_cnt, prob)
    idx.ntd([5])                       -> NtdResult(prompt_cnt, tokens, counts, approx=False)
    idx.infgram_prob([3, 5], 17)       -> InfgramProbResult(..., suffix_len)
    idx.infgram_ntd([3, 5])            -> InfgramNtdResult(..., suffix_len)
    idx.longest_match([3, 5])          -> LongestMatch(length, cont, count)
    idx.docs([3, 5], max=10)           -> DocsResult(count, docs=[...])
    idx.count_cnf([[[3, 5], [9]], [[7]]]), idx.search_docs_cnf(...)  -> AND/OR queries (cnf.py)
    idx.score(ids)                     -> Features: per-position features in one pass

Semantics are infini-gram's (its package is the test oracle) on the same token stream:
  * count(ids): occurrences of the n-gram; no occurrence spans two documents. The empty
    n-gram counts every position including one per document end: tokens + documents.
  * prob = count(prompt + [cont]) / count(prompt), -1.0 when the prompt does not occur.
  * ntd(prompt): count of each token following the prompt; a document end is reported as
    the tokenizer's EOS id (infini-gram reports its eos_token_id there).
  * infgram_*: the same on the longest suffix of the prompt that occurs (suffix_len).
Where infini-gram approximates (ntd of prompts occurring more than max_support = 1000
times, by sampling the suffix array), teragram is exact: in a suffix array the occurrences
of a prompt are sorted by the token that follows, so each distinct next token is one
contiguous block whose end a galloping search finds; ntd costs O(k log count) for k distinct
next tokens, never O(count). ``approx`` is therefore always False.

This module holds the Index; its answers (and their JSON, token texts beside the ids) are in
results.py, one shard's arrays (opened from its manifest entry) in shard.py, the manifest's
checks in format.py, the shards' interleaved searches in fanout.py and the incremental scorer
in scorer.py.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import TypeVar

import numpy as np

from . import cnf
from . import format as fmt
from .bulk import continuations
from .cancel import check_cancelled
from .errors import QueryError
from .fanout import ShardSet
from .features import Features, top_counts
from .results import (
    CountResult,
    DocHit,
    DocsResult,
    InfgramNtdResult,
    InfgramProbResult,
    LongestMatch,
    NtdResult,
    Occurrence,
    ProbResult,
    Provenance,
    with_tokens,
)
from .scorer import Scorer
from .shard import Shard, advise
from .tokenizer import load as load_tokenizer

__all__ = ["DOCS_SCAN", "OPS", "CountResult", "DocHit", "DocsResult", "Index", "InfgramNtdResult", "InfgramProbResult", "LongestMatch"]
__all__ += ["NtdResult", "Occurrence", "ProbResult", "Provenance", "Scorer", "Shard", "advise", "as_index", "with_tokens"]

T = TypeVar("T")

OPS = ("count", "prob", "ntd", "infgram-prob", "infgram-ntd", "longest-match", "docs")
DOCS_SCAN = 100_000  # occurrences examined to list matching documents
DIST_CACHE_ELEMENTS = 1 << 25  # next-token histogram entries kept across queries (~0.5 GiB with their counts)


class Index:
    """A teragram index opened for queries. Cheap to open: every array is memory-mapped.

    access: "random" (the default) advises the kernel that the tokens and the suffix array are
    read at random (MADV_RANDOM): a search on a cold page cache then reads the pages it needs
    and not the read-ahead around each (count on 2.43B tokens in 12 shards, cold: 889 ms ->
    10 ms; measured in docs/results.md, section 2). "normal" keeps the kernel's read-ahead, for code
    that scans the arrays in order (the builder's features).

    threads: on how many threads the shards are searched (the kernels release the GIL). The
    default, 1, searches all shards in one call, their binary searches interleaved step by
    step (index/fanout.py): on a warm page cache a query takes tens of microseconds, less than
    handing it to a thread (docs/research/2026-12-01-index-engine-at-scale.md). More threads each search a
    run of consecutive shards; they pay when searches wait on the disk (a cold or
    larger-than-memory index), where a page fault stalls its thread.

    shards: open only these shards (their places in the manifest's list) as an index of their
    own: counts, ntd([]) and n_positions are theirs. A cluster's holders open theirs this way.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        threads: int = 1,
        access: str = "random",
        shards: Sequence[int] | None = None,
        manifest: dict | None = None,
    ):
        if access not in ("random", "normal"):
            raise ValueError(f"access must be 'random' or 'normal', not {access!r}")
        self.path = Path(path)
        self.manifest = manifest if manifest is not None else fmt.read_manifest(self.path)  # given: the build's, before it is written
        tk = self.manifest["tokenizer"]
        self.vocab_size: int = tk["vocab_size"]
        self.eos_id: int = tk["eos_id"]
        self.sep: int = self.manifest["separator"]
        held = self.manifest["shards"]
        if shards is not None:  # these shards alone, as an index of their own (the cluster's holders: cluster.py)
            if any(not 0 <= i < len(held) for i in shards):
                raise ValueError(f"shards {list(shards)}: the index has shards 0..{len(held) - 1}")
            held = [held[i] for i in shards]
        self.n_tokens: int = sum(s["n_tokens"] for s in held)
        self.n_docs: int = sum(s["n_docs"] for s in held)
        self.n_positions: int = sum(s["n_positions"] for s in held)
        self.shards = [Shard.open(self.path, s, self.manifest["token_dtype"]) for s in held]
        self._whole = shards is None or list(shards) == list(range(len(self.manifest["shards"])))
        if access == "random":
            for sh in self.shards:
                sh.random = True
                advise(sh.searched, mmap.MADV_RANDOM)
        self._n_threads = max(1, min(threads, len(self.shards)))
        self._pool = ThreadPoolExecutor(self._n_threads, thread_name_prefix="shard") if self._n_threads >= 2 else None
        self._dist_cache: dict[tuple, tuple] = {}  # next-token histograms of large intervals (_keep)
        self._dist_cache_elements = 0
        self._uni_top: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def threads(self) -> int:
        """On how many threads the shards are searched (threads= capped at the number of shards)."""
        return self._n_threads

    @contextmanager
    def readahead(self):
        """Bulk work with the kernel's read-ahead back on: many searches whose neighbours in
        suffix-array order come next read pages the next searches need (bulk held-out
        estimates on a cold 1.09B index: 2.1k tokens/s/core under MADV_RANDOM, 4.7k with it)."""
        advised = [s for s in self.shards if s.random]
        for s in advised:
            advise(s.searched, mmap.MADV_NORMAL)
        try:
            yield self
        finally:
            for s in advised:
                advise(s.searched, mmap.MADV_RANDOM)

    # ---- tokenizer ---------------------------------------------------------------------------

    @cached_property
    def tokenizer(self):
        """The index's tokenizer (index/tokenizer.py: sentencepiece or Hugging Face), its EOS the manifest's."""
        return load_tokenizer(self.path / self.manifest["tokenizer"]["file"]["path"], eos_id=self.eos_id)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def piece(self, token: int) -> str:
        """The text of one token id as the tokenizer writes it ("" for EOS past the vocabulary)."""
        return self.tokenizer.id_to_piece(int(token)) if 0 <= int(token) < self.vocab_size else ""

    @cached_property
    def piece_json(self) -> list[str]:
        """Every token id's piece as a JSON string (EOS past the vocabulary: ""), for writing a
        next-token histogram (results.answer_json)."""
        return [json.dumps(self.piece(i), ensure_ascii=False) for i in range(max(self.vocab_size, self.eos_id + 1))]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

    @cached_property
    def meta(self):
        from .meta import MetaStore

        return MetaStore(self.path)

    # ---- validation --------------------------------------------------------------------------

    def check_ids(self, ids, *, allow_empty: bool, what: str = "ids") -> np.ndarray:
        try:
            arr = np.asarray(list(ids), dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise QueryError(f"{what} must be a list of integers") from None
        if arr.ndim != 1:
            raise QueryError(f"{what} must be a flat list of integers")
        if not allow_empty and arr.size == 0:
            raise QueryError(f"{what} must not be empty")
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise QueryError(f"token id {bad} outside the vocabulary [0, {self.vocab_size})")
        return arr

    def check_token(self, cont, what: str = "cont") -> int:
        if isinstance(cont, bool) or not isinstance(cont, (int, np.integer)):
            raise QueryError(f"{what} must be an integer token id")
        if not 0 <= int(cont) < self.vocab_size:
            raise QueryError(f"{what} {cont} outside the vocabulary [0, {self.vocab_size})")
        return int(cont)

    # ---- operations --------------------------------------------------------------------------

    @cached_property
    def shard_set(self) -> ShardSet:
        """All the shards as one set searched together (index/fanout.py), for bulk scoring."""
        if len(self._groups) == 1:
            return self._groups[0][1]
        return ShardSet.of(self.shards, self.vocab_size)

    @cached_property
    def merged(self):
        """The short frequent contexts' histograms summed over all the shards (index/merged.py),
        or None (an index of one shard, one built before them, or opened on some shards)."""
        if not self._whole or len(self.shards) < 2:
            return None
        from . import merged

        return merged.load(self.path, self.manifest, self.vocab_size)

    @cached_property
    def trigrams(self) -> np.ndarray | None:
        """(S, W) uint64: each shard's filter of the 3-token strings it holds (index/trigrams.py), or None as merged."""
        if not self._whole or len(self.shards) < 2:
            return None
        from . import trigrams

        return trigrams.load(self.path, self.manifest)

    @cached_property
    def _groups(self) -> list[tuple[slice, ShardSet]]:
        """The shards as the sets searched together (fanout.py): all in one, or consecutive
        runs of shards, one per thread; each with its place among the shards."""
        edges = np.linspace(0, len(self.shards), self._n_threads + 1).round().astype(int).tolist()
        return [(slice(a, b), ShardSet.of(self.shards[a:b], self.vocab_size)) for a, b in zip(edges[:-1], edges[1:])]

    def _per_group(self, fn: Callable[[slice, ShardSet], T]) -> list[T]:
        """fn over every group of shards, in shard order, in the thread pool if there is one; a cancelled query stops between groups."""
        if self._pool is None:
            return [check_cancelled() or fn(*g) for g in self._groups]
        check_cancelled()
        return list(self._pool.map(lambda g: fn(*g), self._groups))

    def _find(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every shard's suffix-array interval of q: (lo, hi), (n_shards,) int64 each."""
        return _joined(self._per_group(lambda _, g: g.find(q)))

    def _narrow(self, pat: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every shard's interval of pat inside its interval [lo, hi) of pat[:-1]."""
        return _joined(self._per_group(lambda part, g: g.narrow(pat, lo[part], hi[part])))

    def suffix_intervals(self, q: np.ndarray, cont: int = -1) -> tuple[int, np.ndarray]:
        """(l, intervals): the longest suffix of q that occurs, and (4, n_shards) int64: every
        shard's interval of it, lo then hi (empty in a shard that lacks it; every rank when l is
        0), then of it + [cont] (empty if cont < 0)."""
        parts = self._per_group(lambda _, g: g.longest_suffix(q, cont))
        if len(parts) == 1:
            return parts[0]
        sl = max(x for x, _ in parts)
        return sl, np.concatenate([iv if x == sl else iv * 0 for x, iv in parts], axis=1)

    def _total(self, q_len: int, lo: np.ndarray, hi: np.ndarray) -> int:
        """Occurrences of a q_len-token pattern from its intervals (the empty one: every position)."""
        return self.n_positions if q_len == 0 else int((hi - lo).sum())

    def count_intervals(self, q: np.ndarray) -> tuple[int, list[tuple[int, int]]]:
        lo, hi = self._find(q)
        return self._total(len(q), lo, hi), list(zip(lo.tolist(), hi.tolist()))

    def count(self, ids) -> CountResult:
        q = self.check_ids(ids, allow_empty=True)
        return CountResult(self._total(len(q), *self._find(q)))

    def prob(self, prompt, cont) -> ProbResult:
        q = self.check_ids(prompt, allow_empty=True, what="prompt")
        return self._prob(q, self.check_token(cont))

    def _prob(self, q: np.ndarray, cont: int) -> ProbResult:
        lo, hi = self._find(q)
        prompt_cnt = self._total(len(q), lo, hi)
        if prompt_cnt == 0:
            return ProbResult(0, 0, -1.0)
        clo, chi = self._narrow(np.append(q, cont), lo, hi)
        cont_cnt = int((chi - clo).sum())
        return ProbResult(prompt_cnt, cont_cnt, cont_cnt / prompt_cnt)

    def _unigram(self) -> np.ndarray:
        total = np.zeros(max(self.vocab_size, self.eos_id + 1), dtype=np.int64)
        for s in self.shards:
            total[: len(s.unigram)] += s.unigram.astype(np.int64)
        total[self.eos_id] += self.n_docs
        return total

    @cached_property
    def unigram(self) -> np.ndarray:
        """Count of every id over all positions, document ends counted as EOS (ntd([]))."""
        return self._unigram()

    def _keep(self, key, value: tuple, elements: int) -> None:
        """Keep a histogram (or a summary holding one) of `elements` entries; all are dropped
        when they would pass DIST_CACHE_ELEMENTS."""
        if self._dist_cache_elements + elements > DIST_CACHE_ELEMENTS:
            self._dist_cache.clear()
            self._dist_cache_elements = 0
        self._dist_cache[key] = value
        self._dist_cache_elements += elements

    def shard_dist(self, s: Shard, lo: int, hi: int, d: int) -> tuple[np.ndarray, np.ndarray]:
        """Next-token histogram of one shard's interval, SEP mapped to EOS; kept when large."""
        key = (s.id, lo, hi, d)
        hit = self._dist_cache.get(key)
        if hit is not None:
            return hit
        t, c = s.blocks(lo, hi, d)
        if len(t) and t[-1] == self.sep:  # SEP sorts last; EOS never occurs in the stream
            t = t.copy()
            t[-1] = self.eos_id
            order = np.argsort(t, kind="stable")
            t, c = t[order], c[order]
        if hi - lo > 256:
            self._keep(key, (t, c), len(t))
        return t, c

    def _dist(self, q: np.ndarray, segs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        if q.size == 0:
            u = self.unigram
            nz = np.nonzero(u)[0]
            return nz, u[nz]
        return self.segs_dist(segs, len(q))

    def segs_dist(self, segs: list[tuple[int, int]], d: int) -> tuple[np.ndarray, np.ndarray]:
        """Next-token histogram after the shards' intervals of one d-token pattern, summed (a
        large one kept, like one shard's)."""
        held = [(s, a, b) for s, (a, b) in zip(self.shards, segs) if b > a]
        if not held:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if len(held) == 1:
            return self.shard_dist(*held[0], d)
        key = (d, tuple(segs))
        hit = self._dist_cache.get(key)
        if hit is not None:
            return hit
        parts = [check_cancelled() or self.shard_dist(s, a, b, d) for s, a, b in held]
        toks = np.concatenate([p[0] for p in parts])
        cnts = np.concatenate([p[1] for p in parts])
        u, inv = np.unique(toks, return_inverse=True)
        out = u, np.bincount(inv, weights=cnts).astype(np.int64)
        if len(toks) > 256:
            self._keep(key, out, len(u))
        return out

    def _ntd(self, q: np.ndarray) -> NtdResult:
        return self._ntd_in(q, *self._find(q))

    def _ntd_in(self, q: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> NtdResult:
        """ntd of q, given every shard's interval of q."""
        prompt_cnt = self._total(len(q), lo, hi)
        segs = list(zip(lo.tolist(), hi.tolist()))
        if prompt_cnt == 0:
            return NtdResult.empty()
        toks, cnts = self._dist(q, segs)
        return NtdResult(prompt_cnt, toks, cnts)

    def ntd(self, prompt) -> NtdResult:
        return self._ntd(self.check_ids(prompt, allow_empty=True, what="prompt"))

    def infgram_prob(self, prompt, cont) -> InfgramProbResult:
        q = self.check_ids(prompt, allow_empty=True, what="prompt")
        c = self.check_token(cont)
        sl, iv = self.suffix_intervals(q, c)
        prompt_cnt = self._total(sl, iv[0], iv[1])
        if prompt_cnt == 0:
            return InfgramProbResult(0, 0, -1.0, suffix_len=sl)
        cont_cnt = int((iv[3] - iv[2]).sum())
        return InfgramProbResult(prompt_cnt, cont_cnt, cont_cnt / prompt_cnt, suffix_len=sl)

    def infgram_ntd(self, prompt) -> InfgramNtdResult:
        q = self.check_ids(prompt, allow_empty=True, what="prompt")
        sl, iv = self.suffix_intervals(q)
        r = self._ntd_in(q[len(q) - sl :], iv[0], iv[1])
        return InfgramNtdResult(r.prompt_cnt, r.tokens, r.counts, r.approx, suffix_len=sl)

    def latest_cont(self, segs: list[tuple[int, int]], length: int) -> int:
        """Token after the most recent occurrence (latest shard, largest position)."""
        for s, (a, b) in reversed(list(zip(self.shards, segs))):
            if b > a:
                p = s.most_recent(a, b)
                t = int(s.tok[p + length])
                return self.eos_id if t == self.sep else t
        return -1

    def longest_match(self, ids) -> LongestMatch:
        q = self.check_ids(ids, allow_empty=False)
        sl, iv = self.suffix_intervals(q)
        if sl == 0:
            return LongestMatch(0, -1, self.n_positions)
        return LongestMatch(sl, self.latest_cont(list(zip(iv[0].tolist(), iv[1].tolist())), sl), int((iv[1] - iv[0]).sum()))

    def docs(self, ids, *, max: int = 10, context: int = 20) -> DocsResult:
        q = self.check_ids(ids, allow_empty=False)
        if max < 1:
            raise QueryError("max must be a positive integer")
        cnt, segs = self.count_intervals(q)
        hits: list[DocHit] = []
        approx = False
        for place, (a, b) in enumerate(segs):
            if b > a and len(hits) < max:
                found, cut = self.shard_docs(place, a, b, len(q), max - len(hits), context)
                hits += found
                approx |= cut
        return DocsResult(cnt, hits, approx)

    count_cnf = cnf.count_cnf
    search_docs_cnf = cnf.search_docs_cnf
    cnf_parts = cnf.local_parts  # what count_cnf and search_docs_cnf merge (ClusterIndex's: its holders')

    def shard_docs(self, place: int, a: int, b: int, length: int, n: int, context: int = 20) -> tuple[list[DocHit], bool]:
        """The first n documents (in corpus order) holding a length-token match whose interval
        in shard `place` is [a, b), and whether only its first DOCS_SCAN occurrences were read."""
        s = self.shards[place]
        pos = np.sort(s.sa.to_numpy(a, min(b, a + DOCS_SCAN)))
        docs = np.searchsorted(s.starts, pos, side="right") - 1
        _, first = np.unique(docs, return_index=True)
        hits = []
        for j in np.sort(first)[:n]:
            check_cancelled()  # a cancelled query stops here, in each shard it reads
            p, d = int(pos[j]), int(docs[j])
            ds, de = int(s.starts[d]), int(s.starts[d + 1]) - 1
            lo, hi = max(ds, p - context), min(de, p + length + context)
            hits.append(DocHit(s.first_doc + d, s.id, p - ds, self.meta.doc(s.first_doc + d), self.decode(s.tok[lo:hi])))
        return hits, b - a > DOCS_SCAN

    def following(self, occ: Occurrence, n: int) -> np.ndarray:
        """Up to n tokens that follow the occurrence in its document (fewer at the document's end): (<= n,) int64."""
        s = self.shards[occ.shard]
        a = occ.pos + occ.length
        t = np.asarray(s.tok[a : a + max(n, 0)], np.int64)
        end = np.flatnonzero(t == self.sep)
        return t[: end[0]] if len(end) else t

    def provenance(self, occ: Occurrence) -> Provenance:
        s = self.shards[occ.shard]
        d = s.doc_of(occ.pos)
        m = self.meta.doc(s.first_doc + d)
        return Provenance(s.first_doc + d, m["source"], int(m["record"]), occ.pos - int(s.starts[d]), occ.length)

    # ---- per-position features ---------------------------------------------------------------

    def score(self, ids, *, top_k: int = 4, max_len: int = 64, targets: bool = False) -> Features:
        """Index features for every position of a token sequence (one document), in one pass.

        The same features the builder computes in bulk for held-out text (against the whole
        index; index/bulk.py); see index.features.Features for the fields. max_len caps the
        match length (<= 0: uncapped). targets: also how often the next token follows each match.
        """
        q = self.check_ids(ids, allow_empty=True)
        f = continuations(self, q, np.array([0, len(q)]), [max_len], top_k=top_k)[max_len]
        return f if targets else dataclasses.replace(f, target_cnt=None)

    def position_features(self, q: np.ndarray, t: int, per: list[tuple[int, int, int]], top_k: int, out: Features, row: int) -> None:
        """Merge the shards' (match length, interval) at position t into out's row."""
        L = max((int(x[0]) for x in per), default=0)
        if L == 0:
            if self._uni_top is None or len(self._uni_top[0]) != top_k:
                self._uni_top = top_counts(*self._dist(np.zeros(0, np.int64), []), top_k)
            out.length[row], out.cont[row], out.count[row] = 0, -1, self.n_positions
            out.topk_ids[row], out.topk_cnt[row] = self._uni_top
            return
        segs = [(int(a), int(b)) if int(x) == L else (0, 0) for x, a, b in per]
        out.length[row] = L
        out.count[row] = sum(b - a for a, b in segs)
        out.cont[row] = self.latest_cont(segs, L)
        out.topk_ids[row], out.topk_cnt[row] = top_counts(*self._dist(q[t - L + 1 : t + 1], segs), top_k)

    def scorer(self, *, top_k: int = 4, max_len: int = 64) -> Scorer:
        """An incremental scorer: append tokens one at a time (generation), get each new
        position's features; they equal score() of the whole sequence, position by position."""
        return Scorer(self, top_k, max_len)


def as_index(index) -> Index:
    """An opened index as it is (an Index, or a ClusterIndex: index/cluster.py), or the index
    directory at this path opened: what the library's passes over an index take."""
    return Index(index) if isinstance(index, (str, Path)) else index


def _joined(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The groups' (lo, hi) arrays, one after another."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
