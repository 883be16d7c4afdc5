"""An index held by Ray actors on the nodes that store its shards, answering as one process.

    idx = ClusterIndex.open("idx/", address="auto", replicas=2)
    idx.count([5, 17])                        -> CountResult, exactly Index("idx/").count([5, 17])
    idx.batch([Query("count", [5, 17]), Query("infgram-prob", [3, 5], 17)])
                                              -> [CountResult, InfgramProbResult]
    idx.count_cnf(cnf), idx.search_docs_cnf(cnf, maxnum=10)    -> AND/OR queries, as Index's

The shards are split into groups of consecutive shards; each group is held by `replicas` holders
(Ray actors, cluster_holder.py; replica r of group g on node (g + r) mod the nodes), each an
Index of its group's shards alone (Index(path, shards=...)), memory-mapped on its node. A batch
goes to one live holder of every group, one actor call each, and the client merges the groups'
parts into exactly the answers of one process holding every shard:

  * count, prob: the groups' counts add (the empty prompt's: their positions add).
  * ntd: the groups' next-token histograms add (ntd([]): their unigram counts and document ends).
  * infgram-prob, longest-match: each group finds its own longest suffix and its counts there. A
    shard that lacks a suffix lacks every longer one, so the index's longest suffix is the
    longest of the groups', and only the groups that reach it hold it: their counts add. One
    round. longest-match's continuation is the one after the latest shard's most recent match.
  * infgram-ntd: the same lengths, then a second round asks only the groups that hold the longest
    suffix for its histogram (a histogram of a group's shorter suffix would be wasted work).
  * docs: the first round gives every shard's interval; then the shards are read in order as
    Index.docs reads them, each round asking the next shards whose occurrences could hold the
    documents still missing (a shard holds at most as many documents as occurrences).

Bulk features (continuations, score) run on the holders beside their shards (cluster_bulk.py);
generation's incremental scorer (scorer()) keeps each group's state on its holders, one round of
calls per new token (cluster_scorer.py).

A holder that dies (its node lost) or does not answer within `timeout` seconds is dropped, and
its group's part of the batch goes to the group's next replica; with none left the query raises
ClusterError naming the group's shards. An answer is whole or not given.

The client opens the index directory itself for its manifest, tokenizer and document metadata
(Index(path, shards=[]): no shard); every holder opens the same path on its own node.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import cluster_bulk, cnf
from .cluster_holder import ShardHolder, pack
from .cluster_scorer import ClusterScorer
from .engine import OPS, Index
from .errors import ClusterError, QueryError, TeragramError
from .features import Features
from .results import CountResult, DocsResult, InfgramNtdResult, InfgramProbResult, LongestMatch, NtdResult, ProbResult

if TYPE_CHECKING:
    from .results import Occurrence, Provenance


@dataclass(frozen=True)
class Query:
    """One query of a batch: op (one of OPS), ids, the continuation of prob and infgram-prob,
    and docs' max and context."""

    op: str
    ids: Sequence[int]
    cont: int | None = None
    max: int = 10
    context: int = 20


class ClusterIndex:
    """An index whose shards are held by Ray actors (ShardHolder), with Index's query methods
    and a batched one (batch). Open it with ClusterIndex.open; close() ends the holders."""

    def __init__(self, path: str | Path, groups: list[list[int]], holders: list[list], *, timeout: float | None = None):
        self.head = Index(path, shards=[])  # manifest, tokenizer, metadata and the queries' checks
        self.path, self.manifest = self.head.path, self.head.manifest
        self.vocab_size, self.eos_id, self.sep = self.head.vocab_size, self.head.eos_id, self.head.sep
        c = self.manifest["counts"]
        self.n_tokens, self.n_docs, self.n_positions = c["tokens"], c["docs"], c["positions"]
        self.shard_ids = [s["shard"] for s in self.manifest["shards"]]
        self.groups = groups
        self.timeout = timeout
        self._holders = holders  # per group, its live holders, the one asked first first
        self._lock = threading.Lock()
        self._keys = 0
        self.summaries: dict[tuple, tuple] = {}  # frequent contexts' merged histograms (cluster_bulk.py)
        self.summary_elements = 0

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        address: str | None = None,
        groups: int | Sequence[Sequence[int]] | None = None,
        replicas: int = 1,
        nodes: Sequence[str] | None = None,
        timeout: float | None = None,
    ) -> ClusterIndex:
        """Start the holders of the index at `path` (the same path on every node) on a Ray
        cluster (`address`; None: the Ray instance this process is connected to, else a new
        local one). groups: how many groups of consecutive shards (default: one per node, at
        most one per shard), or the shards' places of each group. nodes: the Ray node ids to
        hold them (default: every live node); replicas: holders per group, each on another node."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        head = Index(path, shards=[])
        n_shards = len(head.manifest["shards"])
        nodes = list(nodes) if nodes is not None else [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        if not 1 <= replicas <= len(nodes):
            raise ClusterError(f"replicas {replicas}: each replica of a group needs a node of its own, and {len(nodes)} are live")
        if groups is None or isinstance(groups, int):
            n = min(groups or len(nodes), n_shards)
            groups = [a.tolist() for a in np.array_split(np.arange(n_shards), n)]
        groups = [[int(p) for p in g] for g in groups]
        if sorted(p for g in groups for p in g) != list(range(n_shards)):
            raise ClusterError(f"groups {groups}: every shard 0..{n_shards - 1} must be in exactly one group")
        remote = ray.remote(ShardHolder)
        holders = [
            [
                remote.options(
                    num_cpus=0,  # a holder waits on its memory maps, not on a core
                    max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[(g + r) % len(nodes)], soft=False),
                ).remote(str(head.path.resolve()), grp)
                for r in range(replicas)
            ]
            for g, grp in enumerate(groups)
        ]
        idx = cls(head.path, groups, holders, timeout=timeout)
        idx._run({g: [("count", np.zeros(0, np.int64))] for g in range(len(groups))}, every_replica=True)
        return idx

    # ---- what the client holds itself --------------------------------------------------------

    @property
    def tokenizer(self):
        return self.head.tokenizer

    @property
    def meta(self):
        return self.head.meta

    def tokenize(self, text: str) -> list[int]:
        return self.head.tokenize(text)

    def piece(self, token: int) -> str:
        return self.head.piece(token)

    @property
    def piece_json(self) -> list[str]:
        return self.head.piece_json

    def decode(self, ids) -> str:
        return self.head.decode(ids)

    def check_ids(self, ids, *, allow_empty: bool, what: str = "ids") -> np.ndarray:
        return self.head.check_ids(ids, allow_empty=allow_empty, what=what)

    def placement(self) -> list[tuple[list[int], list[str]]]:
        """Each group's shard places and the Ray node ids of its live holders, in the order they
        are asked; a holder that does not answer is dropped as lost."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        out = []
        for g, places in enumerate(self.groups):
            with self._lock:
                hs = list(self._holders[g])
            nodes = []
            for h in hs:
                try:
                    nodes.append(ray.get(h.node.remote(), timeout=self.timeout))
                except (RayActorError, GetTimeoutError):
                    with self._lock:
                        self._holders[g].remove(h)
                    ray.kill(h)
            out.append((places, nodes))
        return out

    def close(self) -> None:
        """End the holders (the Ray connection stays)."""
        import ray

        with self._lock:
            for hs in self._holders:
                for h in hs:
                    ray.kill(h)
            self._holders = [[] for _ in self.groups]

    def __enter__(self) -> ClusterIndex:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the holders' calls ------------------------------------------------------------------

    def _run(self, tasks: dict[int, list], *, every_replica: bool = False) -> dict[int, list]:
        """Each group's tasks (query parts) on a live holder of it (every_replica: on each)."""
        sent: dict[int, object] = {}
        for t in tasks.values():  # one packed copy of a list that many groups are sent
            if id(t) not in sent:
                sent[id(t)] = pack(t)
        return self._send(tasks, lambda h, g: h.parts.remote(sent[id(tasks[g])]), every_replica=every_replica)

    def run_all(self, call: tuple) -> dict[int, object]:
        """call = (a holder method's name, its arguments) on a live holder of every group."""
        return self.run_each(dict.fromkeys(range(len(self.groups)), call))

    def run_each(self, calls: dict[int, tuple], *, wait: bool = True) -> dict[int, object]:
        """calls[g] = (a holder method's name, its arguments) on a live holder of group g, all in
        one round. wait=False: sent to each group's first holder, not waited for (nothing back)."""
        if not wait:
            with self._lock:
                for g, (name, *args) in calls.items():
                    for h in self._holders[g][:1]:
                        getattr(h, name).remote(*args)
            return {}
        return self._send(calls, lambda h, g: getattr(h, calls[g][0]).remote(*calls[g][1:]))

    def next_key(self) -> int:
        """A number not given before: the key of a bulk pass's state kept on the holders."""
        with self._lock:
            self._keys += 1
            return self._keys

    def _send(self, groups, send, *, every_replica: bool = False) -> dict[int, object]:
        """send(holder, g) -> the call's ObjectRef, for every group g on a live holder of it
        (every_replica: on each of them), all sent before any answer is awaited; a holder that
        dies or passes `timeout` is dropped and its group's call goes to the next replica."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        with self._lock:
            asked = {g: list(self._holders[g]) if every_replica else self._holders[g][:1] for g in groups}
        for g, hs in asked.items():
            if not hs:
                raise self._lost(g, "")
        pending = [(g, h, send(h, g)) for g, hs in asked.items() for h in hs]
        out: dict[int, object] = {}
        while pending:
            g, h, ref = pending.pop(0)
            try:
                out[g] = ray.get(ref, timeout=self.timeout)
            except (RayActorError, GetTimeoutError) as e:
                if getattr(e, "actor_init_failed", False):  # it could not open its shards: no replica will
                    cause = e.error_msg.strip().splitlines()[-1]
                    raise ClusterError(f"a holder of shards {self._names(g)} could not open them: {cause}") from None
                nxt = self._drop(g, h, type(e).__name__)
                if not every_replica:
                    pending.append((g, nxt, send(nxt, g)))
            except RayTaskError as e:  # the holder raised: a TeragramError is the caller's to see
                raise (e.cause if isinstance(e.cause, TeragramError) else e) from None
        return out

    def _drop(self, g: int, holder, why: str):
        """Drop a lost holder of group g: the group's next live holder, or ClusterError."""
        import ray

        with self._lock:
            if holder in self._holders[g]:
                self._holders[g].remove(holder)
                ray.kill(holder)  # one that only passed the timeout may still be running
            if self._holders[g]:
                return self._holders[g][0]
        raise self._lost(g, why)

    def _names(self, g: int) -> str:
        return ", ".join(str(self.shard_ids[p]) for p in self.groups[g])

    def _lost(self, g: int, why: str) -> ClusterError:
        cause = f" (the last one: {why})" if why else ""
        return ClusterError(f"shards {self._names(g)} lost: no live holder of them is left{cause}; no answer given")

    # ---- queries -----------------------------------------------------------------------------

    def check(self, query: Query) -> tuple[str, np.ndarray, int]:
        """(op, ids, cont) of a query checked as Index checks it; QueryError if it is malformed."""
        op = query.op.replace("_", "-")
        h = self.head
        if op == "count":
            return op, h.check_ids(query.ids, allow_empty=True), -1
        if op in ("prob", "infgram-prob"):
            q = h.check_ids(query.ids, allow_empty=True, what="prompt")
            return op, q, h.check_token(query.cont)
        if op in ("ntd", "infgram-ntd"):
            return op, h.check_ids(query.ids, allow_empty=True, what="prompt"), -1
        if op in ("longest-match", "docs"):
            q = h.check_ids(query.ids, allow_empty=False)
            if op == "docs" and query.max < 1:
                raise QueryError("max must be a positive integer")
            return op, q, -1
        raise QueryError(f"unknown op {query.op!r}; expected one of {', '.join(OPS)}")

    def batch(self, queries: Iterable[Query | tuple]) -> list:
        """The answers to many queries, in order (Index's result types), from one call to a
        holder of every group (then a second for infgram-ntd queries, and rounds of shard reads
        for docs queries). A malformed query raises QueryError ("query i: ...") before any is sent."""
        queries = [q if isinstance(q, Query) else Query(*q) for q in queries]
        checked = []
        for i, query in enumerate(queries):
            try:
                checked.append(self.check(query))
            except QueryError as e:
                raise QueryError(f"query {i}: {e}" if len(queries) > 1 else str(e)) from None
        first = [_first_part(op, q, c, query) for (op, q, c), query in zip(checked, queries)]
        parts = self._run({g: first for g in range(len(self.groups))})
        per_query = [[parts[g][i] for g in range(len(self.groups))] for i in range(len(checked))]
        second: dict[int, list] = {}
        asked: list[tuple[int, int, list[int]]] = []  # (query, suffix length, groups asked) of the second round
        for i, (op, q, _) in enumerate(checked):
            if op == "infgram-ntd":
                sl = max(p[0] for p in per_query[i])
                gs = [g for g, p in enumerate(per_query[i]) if p[0] == sl]
                for g in gs:
                    second.setdefault(g, []).append(("ntd", q[len(q) - sl :]))
                asked.append((i, sl, gs))
        if second:
            more = self._run(second)
            at = dict.fromkeys(second, 0)
            for i, sl, gs in asked:
                per_query[i] = [sl, [more[g][at[g]] for g in gs]]
                for g in gs:
                    at[g] += 1
        docs = [i for i, (op, _, _) in enumerate(checked) if op == "docs"]
        for i, r in zip(docs, self._docs([(checked[i][1], queries[i], self._segs(per_query[i])) for i in docs])):
            per_query[i] = r
        return [self._merge(op, c, query, per_query[i]) for i, ((op, q, c), query) in enumerate(zip(checked, queries))]

    def _merge(self, op: str, cont: int, query: Query, parts: list):
        """One query's answer from its groups' parts."""
        if op == "count":
            return CountResult(sum(parts))
        if op == "prob":
            n, c = sum(p[0] for p in parts), sum(p[1] for p in parts)
            return ProbResult(n, c, c / n) if n else ProbResult(0, 0, -1.0)
        if op == "ntd":
            return _ntd(parts)
        if op == "infgram-prob":
            sl = max(p[0] for p in parts)
            n, c = (sum(p[i] for p in parts if p[0] == sl) for i in (1, 2))
            return InfgramProbResult(n, c, c / n, suffix_len=sl) if n else InfgramProbResult(0, 0, -1.0, suffix_len=sl)
        if op == "infgram-ntd":
            sl, held = parts
            r = _ntd(held)
            return InfgramNtdResult(r.prompt_cnt, r.tokens, r.counts, r.approx, suffix_len=sl)
        if op == "longest-match":
            sl = max(p[0] for p in parts)
            if sl == 0:
                return LongestMatch(0, -1, self.n_positions)
            at = [p for p in parts if p[0] == sl]
            return LongestMatch(sl, max(at, key=lambda p: p[2])[3], sum(p[1] for p in at))
        return parts  # docs: answered by _docs

    def _segs(self, parts: list) -> list[tuple[int, int]]:
        """Every shard's interval, in shard order, from the groups' parts ("intervals")."""
        segs: list = [None] * len(self.shard_ids)
        for places, ivs in zip(self.groups, parts):
            for p, iv in zip(places, ivs):
                segs[p] = iv
        return segs

    def _docs(self, asked: list[tuple[np.ndarray, Query, list]]) -> list[DocsResult]:
        """Each docs query's documents (q, the query, every shard's interval of q): its shards read
        in order, each round asking the next shards whose occurrences could hold the documents
        still missing, until it has `max` documents or no shard is left (Index.docs's answer)."""
        group_of = {p: g for g, places in enumerate(self.groups) for p in places}
        hits: list[list] = [[] for _ in asked]
        approx, at = [False] * len(asked), [0] * len(asked)
        while True:
            tasks: dict[int, list] = {}
            sent: dict[int, list] = {}  # per group: (query, shard place) of each task
            for i, (q, query, segs) in enumerate(asked):
                need, occ = query.max - len(hits[i]), 0
                while need > 0 and occ < need and at[i] < len(segs):
                    p, (a, b) = at[i], segs[at[i]]
                    at[i] += 1
                    if b > a:
                        tasks.setdefault(group_of[p], []).append(("docs", q, p, a, b, need, query.context))
                        sent.setdefault(group_of[p], []).append((i, p))
                        occ += b - a
            if not tasks:
                break
            got = self._run(tasks)
            for (i, _), (found, cut) in sorted(((x, r) for g in got for x, r in zip(sent[g], got[g])), key=lambda t: t[0]):
                if len(hits[i]) < asked[i][1].max:
                    hits[i] += found[: asked[i][1].max - len(hits[i])]
                    approx[i] |= cut
        return [DocsResult(sum(b - a for a, b in segs), hits[i], approx[i]) for i, (_, _, segs) in enumerate(asked)]

    def count(self, ids) -> CountResult:
        return self.batch([Query("count", ids)])[0]

    def prob(self, prompt, cont) -> ProbResult:
        return self.batch([Query("prob", prompt, cont)])[0]

    def ntd(self, prompt) -> NtdResult:
        return self.batch([Query("ntd", prompt)])[0]

    def infgram_prob(self, prompt, cont) -> InfgramProbResult:
        return self.batch([Query("infgram-prob", prompt, cont)])[0]

    def infgram_ntd(self, prompt) -> InfgramNtdResult:
        return self.batch([Query("infgram-ntd", prompt)])[0]

    def longest_match(self, ids) -> LongestMatch:
        return self.batch([Query("longest-match", ids)])[0]

    def docs(self, ids, *, max: int = 10, context: int = 20) -> DocsResult:
        return self.batch([Query("docs", ids, max=max, context=context)])[0]

    count_cnf = cnf.count_cnf
    search_docs_cnf = cnf.search_docs_cnf

    def cnf_parts(self, terms, *, max_clause_freq: int, max_diff_tokens: int, maxnum: int = 0, context: int = 20) -> list:
        """As Index.cnf_parts: each group's part of a checked AND/OR query, from one call to a holder of it."""
        limit = cnf.shard_limit(max_clause_freq, len(self.shard_ids))
        got = self.run_all(("cnf_part", terms, limit, max_diff_tokens, maxnum, context))
        return [got[g] for g in range(len(self.groups))]

    @cached_property
    def unigram(self) -> np.ndarray:
        """Count of every id over all positions, document ends counted as EOS (as Index.unigram)."""
        return np.sum([u for u in self.run_all(("unigram",)).values()], axis=0)

    def continuations(self, ids: np.ndarray, starts: np.ndarray, caps, *, top_k: int = 1) -> dict:
        """index/bulk.py's continuations (per-position features of many documents, for each cap),
        computed by the holders beside their shards (index/cluster_bulk.py)."""
        return cluster_bulk.continuations(self, ids, starts, caps, top_k=top_k)

    def score(self, ids, *, top_k: int = 4, max_len: int = 64, targets: bool = False) -> Features:
        """As Index.score: the features of every position of one document (the holders' bulk pass)."""
        q = self.head.check_ids(ids, allow_empty=True)
        f = self.continuations(q, np.array([0, len(q)]), [max_len], top_k=top_k)[max_len]
        return f if targets else dataclasses.replace(f, target_cnt=None)

    def scorer(self, *, top_k: int = 4, max_len: int = 64) -> ClusterScorer:
        """As Index.scorer: an incremental scorer whose holders keep their groups' state
        (index/cluster_scorer.py); close() it when the sequence is done."""
        return ClusterScorer(self, top_k, max_len)

    def following(self, occ: Occurrence, n: int) -> np.ndarray:
        """As Index.following, occ.shard a place in the whole index (ClusterScorer.occurrence)."""
        g = self.group_of(occ.shard)
        return self.run_each({g: ("following", occ.shard, occ.pos, occ.length, n)})[g]

    def provenance(self, occ: Occurrence) -> Provenance:
        """As Index.provenance, occ.shard a place in the whole index (ClusterScorer.occurrence)."""
        g = self.group_of(occ.shard)
        return self.run_each({g: ("provenance", occ.shard, occ.pos, occ.length)})[g]

    def group_of(self, place: int) -> int:
        """The group holding the shard at `place` (in the whole index)."""
        return next(g for g, places in enumerate(self.groups) if place in places)

    def count_intervals(self, q) -> tuple[int, list[tuple[int, int]]]:
        """As Index.count_intervals: the count and every shard's suffix-array interval, in shard order."""
        q = self.head.check_ids(q, allow_empty=True)
        parts = self._run({g: [("intervals", q)] for g in range(len(self.groups))})
        segs = self._segs([parts[g][0] for g in range(len(self.groups))])
        return (self.n_positions if len(q) == 0 else sum(b - a for a, b in segs)), segs


def _first_part(op: str, q: np.ndarray, cont: int, query: Query) -> tuple:
    """What a query asks of every group first."""
    if op in ("count", "prob", "ntd"):
        return (op, q) if op != "prob" else (op, q, cont)
    if op == "infgram-prob":
        return ("suffix", q, cont)
    if op == "infgram-ntd":
        return ("suffix", q, -1)
    if op == "longest-match":
        return ("match", q)
    return ("intervals", q)  # docs: the shards are then read in order (ClusterIndex._docs)


def _ntd(parts: list[tuple[int, np.ndarray, np.ndarray]]) -> NtdResult:
    """The groups' next-token histograms added (Index.ntd's answer)."""
    n = sum(p[0] for p in parts)
    if n == 0:
        return NtdResult.empty()
    toks, inv = np.unique(np.concatenate([p[1] for p in parts]), return_inverse=True)
    cnts = np.zeros(len(toks), np.int64)
    np.add.at(cnts, inv, np.concatenate([p[2] for p in parts]).astype(np.int64))
    return NtdResult(n, toks, cnts)
