"""An index held by Ray actors on a local cluster of several nodes (index/cluster.py) answers
every kind of query exactly as one process holding every shard (AND/OR queries included):
compared with a local Index of the same shards and with brute force. A lost holder is a one-line error naming its shards, or,
with replicas, the same exact answer from another copy, also when the node dies mid-batch."""

import contextlib
import json
import re
import threading
import time

import numpy as np
import pytest
from teragram.builder.build import build_from_ids
from teragram.index.cnf import cnf_json
from teragram.index.engine import Index
from teragram.index.errors import ClusterError, QueryError
from teragram.index.results import CountResult

from tests.conftest import copytree, random_cnf, random_docs
from tests.oracle import Oracle

ray = pytest.importorskip("ray")
from teragram.index.cluster import ClusterIndex, Query  # noqa: E402

NODES = 4


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of NODES nodes of one CPU each, started on this machine."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(NODES - 1):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def random_index(tmp_path_factory, tokenizer_model):
    """Random documents over a small alphabet (n-grams repeat a lot) in 6 or more shards."""
    docs = random_docs(np.random.default_rng(21), 150, 6, 60, 1000)
    docs += [np.concatenate([docs[3], docs[4]]), docs[9][:40].copy()]  # long repeats, across shards
    out = tmp_path_factory.mktemp("cluster") / "idx"
    build_from_ids(docs, out, tokenizer_model, shard_tokens=700)
    idx = Index(out)
    assert len(idx.shards) >= 6
    return idx, Oracle(docs, idx.eos_id)


@pytest.fixture(scope="module")
def held(cluster, random_index):
    """The random index held by one holder per node, and its local twin."""
    idx, orc = random_index
    with ClusterIndex.open(idx.path) as c:
        yield c, idx, orc


def _queries(rng, orc, n: int, vocab: int) -> list[Query]:
    """Every kind of query on n-grams sampled from the corpus (long contexts included), perturbed
    ones and absent ones, and on the empty prompt."""
    out = []
    for i in range(n):
        d = orc.docs[rng.integers(len(orc.docs))]
        m = int(rng.integers(1, 40 if i % 3 == 0 else 8))
        p = int(rng.integers(0, max(1, len(d) - m + 1)))
        q = d[p : p + m].copy()
        if i % 4 == 1 and len(q):
            q[rng.integers(len(q))] = rng.integers(3, vocab)
        elif i % 4 == 2:
            q = rng.integers(3, vocab, size=m)
        q = [int(x) for x in q] if i < n - 1 else []
        c = int(rng.integers(3, vocab)) if rng.random() < 0.3 else int(d[min(p + m, len(d) - 1)])
        out += [Query("count", q), Query("prob", q, c), Query("ntd", q), Query("infgram-prob", q, c), Query("infgram-ntd", q)]
        if q:
            out += [Query("longest-match", q), Query("docs", q, max=int(rng.integers(1, 6)), context=int(rng.integers(0, 8)))]
    return out


def _local(idx: Index, q: Query):
    run = {
        "count": lambda: idx.count(q.ids),
        "prob": lambda: idx.prob(q.ids, q.cont),
        "ntd": lambda: idx.ntd(q.ids),
        "infgram-prob": lambda: idx.infgram_prob(q.ids, q.cont),
        "infgram-ntd": lambda: idx.infgram_ntd(q.ids),
        "longest-match": lambda: idx.longest_match(q.ids),
        "docs": lambda: idx.docs(q.ids, max=q.max, context=q.context),
    }
    return run[q.op]()


def _check_exact(c: ClusterIndex, idx: Index, queries: list[Query]) -> None:
    got = c.batch(queries)
    for q, r in zip(queries, got):
        assert r == _local(idx, q), q


def test_every_query_equals_the_local_index_and_brute_force(held):
    c, idx, orc = held
    assert len(c.groups) == NODES
    assert len({nodes[0] for _, nodes in c.placement()}) == NODES  # one group per node
    queries = _queries(np.random.default_rng(3), orc, 120, idx.vocab_size)
    got = c.batch(queries)
    for q, r in zip(queries, got):
        assert r == _local(idx, q), q
        ids = q.ids
        if q.op == "count":
            assert r.count == orc.count(ids)
        elif q.op == "ntd":
            assert {t: n for t, (n, _) in r.result_by_token_id.items()} == orc.next_tokens(ids) and r.prompt_cnt == orc.count(ids)
        elif q.op == "infgram-prob":
            sl = orc.suffix_len(ids)
            assert r.suffix_len == sl and (r.prompt_cnt, r.cont_cnt) == orc.prob(ids[len(ids) - sl :], q.cont)[:2]
        elif q.op == "infgram-ntd":
            sl = orc.suffix_len(ids)
            assert r.suffix_len == sl and {t: n for t, (n, _) in r.result_by_token_id.items()} == orc.next_tokens(ids[len(ids) - sl :])
        elif q.op == "longest-match":
            L, cont, cnt, _ = orc.feature_at(ids, len(ids) - 1, len(ids), 1)
            assert (r.length, r.cont, r.count) == (L, cont, cnt)
        elif q.op == "docs":
            assert r.count == orc.count(ids)
            assert [h.doc_id for h in r.docs] == sorted({d for d, _ in orc.occurrences(ids)})[: q.max]
    # the one-query methods and the intervals
    q = queries[0].ids
    assert c.count(q) == idx.count(q) and c.infgram_ntd(q) == idx.infgram_ntd(q) and c.docs(q, max=3) == idx.docs(q, max=3)
    assert c.count_intervals(np.asarray(q)) == idx.count_intervals(np.asarray(q))


def _check_cnf(c: ClusterIndex, idx: Index, rng, docs: list, n: int, mcf: list[int], diff: list[int]) -> tuple[int, int]:
    """n random AND/OR queries answer through the cluster as through the local Index: counts,
    approx flags and documents (all of them, or the first few); (how many sampled, how many nonzero)."""
    sampled = nonzero = 0
    for _ in range(n):
        q = random_cnf(rng, docs, idx.vocab_size)
        kw = dict(max_clause_freq=int(rng.choice(mcf)), max_diff_tokens=int(rng.choice(diff)))
        more = dict(maxnum=int(rng.choice([1, 3, 10_000])), context=int(rng.integers(0, 8)))
        r = c.search_docs_cnf(q, **more, **kw)
        assert r == idx.search_docs_cnf(q, **more, **kw), (q, kw, more)
        assert c.count_cnf(q, **kw) == idx.count_cnf(q, **kw) == CountResult(r.count, r.approx), (q, kw)
        sampled += r.approx
        nonzero += r.count > 0
    return sampled, nonzero


def test_and_or_queries_equal_the_local_index(held, monkeypatch):
    """AND/OR queries, sampled ones too (a small max_clause_freq: the holders seed each shard's
    sample by its place in the whole index and read the whole index's per-shard limit), each
    answered in one call to a holder of every group."""
    c, idx, orc = held
    sampled, nonzero = _check_cnf(c, idx, np.random.default_rng(64), orc.docs, 50, [10, 60, 50_000], [2, 10, 100])
    assert sampled >= 10 and nonzero >= 25
    calls = []
    monkeypatch.setattr(c, "run_each", lambda tasks, **kw: calls.append(tasks) or ClusterIndex.run_each(c, tasks, **kw))
    q = [[[int(orc.docs[0][0])]], [[int(orc.docs[0][1])]]]
    assert c.search_docs_cnf(q, maxnum=5) == idx.search_docs_cnf(q, maxnum=5)
    assert len(calls) == 1 and sorted(calls[0]) == list(range(NODES))
    for bad, kw in (([[[5]]] * 5, {}), ([[[5, idx.vocab_size]]], {}), ([[[5]]], {"max_clause_freq": 0})):
        with pytest.raises(QueryError) as local:
            idx.count_cnf(bad, **kw)
        with pytest.raises(QueryError, match=f"^{re.escape(str(local.value))}$"):
            c.count_cnf(bad, **kw)


def test_uneven_groups_on_real_text(cluster, real_index):
    """Real text, groups of one and of several shards (not in shard order), each group on two
    nodes' holders."""
    idx = Index(real_index)
    n = len(idx.shards)
    assert n >= 3
    docs = []
    for s in idx.shards:
        tok, st = np.asarray(s.tok), np.asarray(s.starts)
        docs += [tok[st[k] : st[k + 1] - 1].astype(np.int64) for k in range(len(st) - 1)]
    orc = Oracle(docs, idx.eos_id)
    with ClusterIndex.open(real_index, groups=[list(range(1, n)), [0]], replicas=2) as c:  # the first group holds the later shards
        _check_exact(c, idx, _queries(np.random.default_rng(5), orc, 40, idx.vocab_size))
        _check_cnf(c, idx, np.random.default_rng(6), docs, 10, [200, 50_000], [100])


def test_malformed_queries_fail_as_locally(held):
    c, idx, _ = held
    bad = [Query("count", [1, idx.vocab_size]), Query("count", ["a"]), Query("longest-match", []), Query("docs", [])]
    bad += [Query("prob", [1], "x"), Query("prob", [1]), Query("docs", [5], max=0)]
    for q in bad:
        with pytest.raises(QueryError) as local:
            _local(idx, q)
        with pytest.raises(QueryError) as remote:
            c.batch([q])
        assert str(remote.value) == str(local.value)
    with pytest.raises(QueryError, match="unknown op 'nope'"):
        c.batch([Query("nope", [1])])
    with pytest.raises(QueryError, match="^query 1: token id"):
        c.batch([Query("count", [5]), Query("count", [-1])])


def test_lost_holders(cluster, random_index):
    """Without replicas, a lost node is a one-line error naming its shards; with two, the answers
    stay exact, also for a batch in flight when the node dies; with both copies lost, the error."""
    idx, orc = random_index
    extra = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != extra.node_id]
    nodes = [extra.node_id] + others[:2]  # group 0 on the node that will die
    queries = _queries(np.random.default_rng(8), orc, 40, idx.vocab_size)
    with ClusterIndex.open(idx.path, nodes=nodes) as one, ClusterIndex.open(idx.path, nodes=nodes, replicas=2) as two:
        _check_exact(one, idx, queries[:20])
        _check_exact(two, idx, queries[:20])
        assert [len(hs) for _, hs in two.placement()] == [2, 2, 2]
        killer = threading.Timer(0.2, cluster.remove_node, (extra,))  # the node dies while the batch runs
        killer.start()
        many = queries * 40
        assert two.batch(many) == [_local(idx, q) for q in many]
        killer.join()
        assert len(two._holders[0]) == 1  # the batch saw group 0's first copy die, and asked the second
        _check_exact(two, idx, queries)
        assert [len(hs) for _, hs in two.placement()] == [1, 2, 1]  # group 0's first copy and group 2's second were there
        shards = ", ".join(str(p) for p in one.groups[0])
        with pytest.raises(ClusterError, match=f"^shards {shards} lost: no live holder of them is left") as e:
            one.batch(queries[:5])
        assert "\n" not in str(e.value)
        last = two._holders[0][0]  # the last copy of group 0
        ray.kill(last)
        _wait_dead(last)  # the kill goes through Ray's control store: a call sent at once may still be answered
        with pytest.raises(ClusterError, match=f"^shards {shards} lost"):
            two.count([5])


def _wait_dead(actor, seconds: float = 30.0) -> None:
    """Return once the actor no longer answers (RayActorError); fail after `seconds`."""
    from ray.exceptions import RayActorError

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            ray.get(actor.node.remote(), timeout=seconds)
        except RayActorError:
            return
        time.sleep(0.05)
    pytest.fail(f"the actor still answers {seconds:.0f} s after ray.kill")


def test_query_through_the_cluster(cluster, random_index, held, tmp_path, capsys, monkeypatch):
    """`teragram query --cluster` (one query, an AND/OR query, and a batch file with malformed
    lines) gives the local index's answers."""
    from teragram.index import cli
    from teragram.index.cli import _answer
    from teragram.serve.main import main

    idx, orc = random_index
    ids = ",".join(str(int(t)) for t in orc.docs[4][:3])
    for extra in ([], ["--cluster", cluster.address]):
        assert main(["query", str(idx.path), "infgram-ntd", "--ids", ids, "--json", *extra]) == 0
    local, remote = capsys.readouterr().out.splitlines()
    assert remote == local
    lines = [
        {"op": "count", "ids": [int(t) for t in orc.docs[2][:2]]},
        {"op": "prob", "ids": [5]},
        {"op": "docs", "ids": [int(orc.docs[1][0])]},
    ]
    batch = tmp_path / "q.jsonl"
    batch.write_text("\n".join(map(json.dumps, lines)) + "\nnot json\n")
    assert main(["query", str(idx.path), "--batch", str(batch), "--cluster", cluster.address, "--replicas", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    # the local answers from the fixture's index: a second Index of the same path in this process
    # could not open its document metadata (LMDB refuses an environment open twice in a process)
    assert out[0] == json.dumps(_answer(idx, "count", lines[0]["ids"], None)) and "needs a continuation token" in out[1]
    assert out[2] == json.dumps(_answer(idx, "docs", lines[2]["ids"], None)) and "malformed JSON" in out[3]
    cnf = [[[int(t)] for t in orc.docs[4][:2]], [[int(orc.docs[4][3])]]]
    args = ["query", str(idx.path), "docs", "--cnf-ids", json.dumps(cnf), "--max-clause-freq", "30", "--json", "--cluster", cluster.address]
    monkeypatch.setattr(cli, "opened_index", lambda _: contextlib.nullcontext(held[0]))  # the module's holders: opening is tested above
    assert main(args) == 0
    want = idx.search_docs_cnf(cnf, maxnum=10, max_clause_freq=30)  # the fixture's index (an LMDB opens once in a process: below)
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(cnf_json(idx, want.to_json(), cnf))) and want.approx


def test_a_holder_that_cannot_open_its_shards(cluster, random_index, tmp_path):
    idx, _ = random_index
    bad = copytree(idx.path, tmp_path / "idx")
    tok = bad / "shards" / "000002" / "tokens.bin"
    tok.write_bytes(tok.read_bytes()[:-2])
    with pytest.raises(ClusterError, match=r"^a holder of shards 2 could not open them: .*tokens.bin") as e:
        ClusterIndex.open(bad, groups=[[p] for p in range(len(idx.shards))])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("heavy", [1 << 12, 40])
def test_bulk_features_equal_the_local_ones_and_brute_force(held, heavy, monkeypatch):
    """Features of many documents at once through the holders (index/cluster_bulk.py): equal to
    index/bulk.py's on the local index, field by field and dtype, and to brute force; with the
    frequent contexts (>= heavy occurrences) read through the indexes' kept summaries or not."""
    from teragram.index import cluster_bulk
    from teragram.index.bulk import continuations
    from teragram.index.features import FIELDS

    from tests.index.test_engine import _check_bulk

    monkeypatch.setattr(cluster_bulk, "HEAVY", heavy)

    c, idx, orc = held
    rng = np.random.default_rng(12)
    d = orc.docs[3][:80].copy()
    e = d.copy()
    e[::7] = rng.integers(3, idx.vocab_size, size=len(e[::7]))
    docs = [d, e, rng.integers(3, idx.vocab_size, size=40), np.zeros(0, np.int64), orc.docs[-1], d[:20].copy()]
    docs[-1][4] = idx.eos_id  # EOS inside the text: a document's end
    starts = np.cumsum([0] + [len(x) for x in docs])
    caps = (0, 1, 3, 16)
    want = continuations(idx, np.concatenate(docs), starts, caps, top_k=3)
    for _ in range(2):  # the second time with the frequent contexts the client kept
        got = c.continuations(np.concatenate(docs), starts, caps, top_k=3)
        for cap in caps:
            for name in (*FIELDS, "target_cnt"):
                a, b = getattr(got[cap], name), getattr(want[cap], name)
                assert a.dtype == b.dtype and np.array_equal(a, b), (cap, name)
    assert c.summaries or heavy > 100  # the frequent contexts were kept, and read the second time
    _check_bulk(got, docs, starts, orc, 3)


def test_a_u32_index_through_the_cluster(cluster, tmp_path):
    """A 32-bit index (a vocabulary over 65,535 ids: tests/index/test_widths.py) held by the
    cluster: every kind of query and the bulk features equal the local index's and brute force."""
    from teragram.index.bulk import continuations

    from tests.index.test_engine import _check_bulk
    from tests.index.test_widths import ALPHABET, word_tokenizer

    rng = np.random.default_rng(43)
    docs = [np.array(ALPHABET)[rng.integers(0, len(ALPHABET), size=int(rng.integers(1, 50)))] for _ in range(80)]
    docs += [np.concatenate([docs[3], docs[4]])]
    build_from_ids(docs, tmp_path / "idx", word_tokenizer(tmp_path / "tok" / "tokenizer.json"), shard_tokens=500)
    idx, orc = Index(tmp_path / "idx"), Oracle(docs, Index(tmp_path / "idx").eos_id)
    assert idx.manifest["token_dtype"] == "uint32" and len(idx.shards) >= NODES
    with ClusterIndex.open(idx.path) as c:
        queries = _queries(rng, orc, 40, idx.vocab_size)
        for q, r in zip(queries, c.batch(queries)):
            assert r == _local(idx, q), q
            if q.op == "count":
                assert r.count == orc.count(q.ids)
        held = [docs[-1][:60], rng.choice(ALPHABET, size=30)]
        starts = np.cumsum([0] + [len(x) for x in held])
        got = c.continuations(np.concatenate(held), starts, (0, 3), top_k=2)
        want = continuations(idx, np.concatenate(held), starts, (0, 3), top_k=2)
        for cap in (0, 3):
            assert all(
                np.array_equal(getattr(got[cap], n), getattr(want[cap], n)) for n in ("length", "cont", "count", "topk_ids", "topk_cnt")
            )
        _check_bulk(got, held, starts, orc, 2)


def test_heldout_estimates_through_the_cluster(held):
    """The gates' held-out index estimates (model.mixture.estimates.index_estimates_docs, which
    read index/bulk.py) of a ClusterIndex equal those of the local index."""
    from teragram.model.mixture.estimates import index_estimates_docs

    c, idx, orc = held
    rng = np.random.default_rng(4)
    docs = [orc.docs[7][:50], rng.integers(3, idx.vocab_size, size=30), orc.docs[11]]
    got, want = index_estimates_docs(c, docs), index_estimates_docs(idx, docs)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name


def _scorer_steps(sc, seq, lengths, *, draft_at: int = -1, top: int = 0) -> list:
    """Everything an incremental scorer says token by token along seq: the features, the gates'
    estimates, the occurrence, the tokens after it and the greedy continuation (top > 0); at
    draft_at, three drafted tokens appended, then dropped (snapshot, restore)."""
    out = []
    for t, tok in enumerate(seq):
        if t == draft_at:
            snap = sc.snapshot()
            drafted = [(sc.append(int(x)), sc.estimates(lengths)) for x in seq[:3]]
            sc.restore(snap)
            out.append([(_row(f), _est(e)) for f, e in drafted])
        f = sc.append(int(tok))
        L, est = sc.estimates(lengths)
        occ = sc.occurrence()
        after = sc.idx.following(occ, 5).tolist() if occ else None
        out.append((_row(f), L, _est((L, est)), occ, after, sc.top_continuation(top).tolist() if top else None))
    sc.close()
    return out


def _row(f) -> dict:
    from teragram.index.features import FIELDS

    return {n: (getattr(f, n).dtype.str, getattr(f, n).tolist()) for n in FIELDS}


def _est(e) -> tuple:
    L, est = e
    return L, {k: (n, toks.dtype.str, toks.tolist(), cnts.dtype.str, cnts.tolist()) for k, (n, toks, cnts) in est.items()}


def test_incremental_scorer_equals_the_local_one(held, cluster):
    """Generation's incremental scorer through the holders (index/cluster_scorer.py): token by
    token the local Scorer's features (capped and not), the gates' estimates, the occurrence
    and the tokens after it, the greedy continuation, through a new document (EOS), tokens the
    index lacks, drafts appended and dropped, and a holder that lost the session."""
    c, idx, orc = held
    rng = np.random.default_rng(5)
    d = orc.docs[3][:50].copy()
    e = orc.docs[-2][:30].copy()
    e[::6] = rng.integers(3, idx.vocab_size, size=len(e[::6]))
    seq = np.concatenate([d, [idx.eos_id], orc.docs[9][:45], rng.integers(3, idx.vocab_size, size=8), e, orc.docs[-1][:30]])
    lengths = {"index_infgram": 0, "index_2gram": 1, "index_4gram": 3, "index_8gram": 7}
    for top_k, max_len, draft_at, top in ((3, 24, 60, 6), (2, 5, 20, 0), (4, 0, -1, 3)):
        want = _scorer_steps(idx.scorer(top_k=top_k, max_len=max_len), seq, lengths, draft_at=draft_at, top=top)
        got = _scorer_steps(c.scorer(top_k=top_k, max_len=max_len), seq, lengths, draft_at=draft_at, top=top)
        for t, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a == b, (top_k, max_len, t)
    assert max(x[1] for x in want if isinstance(x, tuple)) >= 30  # long matches were read (across groups' shards)
    sc = c.scorer(top_k=2, max_len=8)
    local = idx.scorer(top_k=2, max_len=8)
    for t, tok in enumerate(seq[:40]):
        if t == 20:  # a holder drops the session: the client sends it the tokens again
            c.run_each({1: ("session", sc.key, -1, [("close",)])})
        assert _row(sc.append(int(tok))) == _row(local.append(int(tok))), t
        assert _est(sc.estimates(lengths)) == _est(local.estimates(lengths)), t
    sc.close()
    assert len(sc.lookup_s) == 40


def test_incremental_scorer_with_a_lost_holder(cluster, random_index):
    """A holder lost mid-generation: its group's replica is sent the tokens so far and the
    features stay the local ones; with the group's last holder lost, one line naming its shards."""
    idx, orc = random_index
    seq = [int(t) for t in orc.docs[3][:30]]
    local = idx.scorer(top_k=2, max_len=8)
    with ClusterIndex.open(idx.path, groups=2, replicas=2) as c:
        sc = c.scorer(top_k=2, max_len=8)
        for t, tok in enumerate(seq):
            if t == 12:
                ray.kill(c._holders[1][0])
            assert _row(sc.append(tok)) == _row(local.append(tok)), t
        assert len(c._holders[1]) == 1
        ray.kill(c._holders[1][0])
        shards = ", ".join(str(p) for p in c.groups[1])
        with pytest.raises(ClusterError, match=f"^shards {shards} lost: no live holder of them is left") as e:
            sc.append(seq[0])
        assert "\n" not in str(e.value)


def test_serve_through_the_cluster(cluster, random_index):
    """`teragram serve --cluster` answers infini-gram's API (AND/OR queries too) as the local server does."""
    from fastapi.testclient import TestClient
    from teragram.serve.app import ServeConfig, create_app

    idx, orc = random_index
    body = {"query_type": "infgram_prob", "query_ids": [int(t) for t in orc.docs[6][:4]]}
    local, remote = (TestClient(create_app(ServeConfig(index=str(idx.path), **kw))) for kw in ({}, {"cluster": cluster.address}))
    answers = [c.post("/", json=body).json() for c in (local, remote)]
    assert {k: v for k, v in answers[0].items() if k != "latency"} == {k: v for k, v in answers[1].items() if k != "latency"}
    cnf = [[[int(orc.docs[6][0])]], [[int(orc.docs[6][2])]]]
    body = {"query_type": "search_docs", "query_ids": cnf, "maxnum": 3, "max_diff_tokens": 5, "max_disp_len": 10}
    got = remote.post("/", json=body).json()
    want = idx.search_docs_cnf(cnf, maxnum=3, max_diff_tokens=5, context=5)  # the fixture's index: its LMDB is open in this process
    assert {k: v for k, v in got.items() if k != "latency"} == json.loads(json.dumps(cnf_json(idx, want.to_json(), cnf)))
    assert len(got["documents"]) == 3


# ---- the model's verbs with the index held by the cluster -------------------------------------


@pytest.fixture(scope="module")
def model_run(tmp_path_factory, random_index):
    """A tiny model with index inputs and a mixture head (random weights: exactness is what is
    checked, not quality) saved as a run, and held-out text: near-copies of indexed documents."""
    import torch
    from teragram.model.checkpoint import save_checkpoint
    from teragram.model.gpt import GPT, GPTConfig
    from teragram.model.training.config import TrainConfig

    idx, orc = random_index
    root = tmp_path_factory.mktemp("cluster-model")
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=idx.vocab_size, block_size=64, max_match=24))
    save_checkpoint(root / "run", model, {}, 0, TrainConfig(index=str(idx.path), out=str(root / "run")))
    (root / "held").mkdir()
    for i in range(0, 60, 6):
        words = idx.decode(np.concatenate([orc.docs[i], orc.docs[i + 1]])).split(" ")
        (root / "held" / f"{i}.txt").write_text(" ".join(w.upper() if j % 7 == 3 else w for j, w in enumerate(words)))
    return root / "run", root / "held"


@pytest.fixture
def quick_gate_fit(monkeypatch):
    """Gates fit in 20 L-BFGS steps: the tests compare fits, not their quality."""
    from teragram.model.mixture import gate as gate_mod

    fit = gate_mod.fit_weights
    monkeypatch.setattr(gate_mod, "fit_weights", lambda X, logp, *, steps, l2: fit(X, logp, steps=20, l2=l2))


def test_eval_through_the_cluster(cluster, held, model_run, quick_gate_fit, tmp_path, capsys):
    """`teragram eval --cluster`: the held-out features and estimates computed by the holders;
    --fit-gate prints the local index's line and saves the same gate (its fit_for the same index
    digest); the report with that gate and --decontaminate is the local one."""
    from teragram.index.features import FeatureConfig
    from teragram.index.heldout import compute_held_out
    from teragram.model.checkpoint import load_model
    from teragram.model.evaluation.perplexity import EvalOptions, heldout_report
    from teragram.model.mixture.gate import Gate
    from teragram.serve.main import main

    c, idx, _ = held
    run, text = model_run
    gate = tmp_path / "gate.json"
    base = ["eval", "--checkpoint", str(run), "--index", str(idx.path), "--corpus", str(text), "--quiet", "--fit-gate", str(gate)]
    out, saved = [], []
    for extra in ([], ["--cluster", cluster.address]):
        assert main([*base, "--no-cont-cache", *extra]) == 0
        out.append(capsys.readouterr().out.splitlines())
        saved.append(gate.read_bytes())
    assert out[1] == out[0] and len(out[0]) == 1 and "with the index gate" in out[0][0], out
    assert saved[1] == saved[0]
    model, _ = load_model(run)
    opts = EvalOptions(gate=Gate.load(gate), decontaminate=True)
    reports = []
    for i, index in enumerate((idx, c)):  # the same features written through either; then the report
        compute_held_out(index, tmp_path / f"feats{i}", FeatureConfig("held-out", 12, 4), [str(text)])
        report = heldout_report(model, index, tmp_path / f"feats{i}", opts=opts)[0]
        reports.append({k: v for k, v in report.items() if k != "stages_s"})  # the figures, not their timings
    assert reports[1] == reports[0], (reports[0], reports[1])
    assert reports[0]["decontaminated"]["docs"] == 10


# ---- the builder's feature passes through the cluster ---------------------------------------


def _feature_files(d) -> dict:
    """Every file of a features directory by its relative path, but the report (its timings)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != "features-report.json"}


@pytest.mark.parametrize("top_k", [0, 3])
def test_exclude_doc_features_through_the_cluster(held, tmp_path, top_k):
    """The exclude-doc features of the indexed corpus computed by the holders beside their shards
    (builder/cluster_features.py): the local pass's files, byte for byte (top_k 0: the local
    pass reads the merged suffix array of all shards; 3: it merges shard by shard)."""
    from teragram.builder.cluster_features import compute_cluster_features
    from teragram.builder.features import compute_features
    from teragram.index.features import FeatureConfig

    c, idx, _ = held
    cfg = FeatureConfig("exclude-doc", 12, top_k)
    compute_features(idx.path, tmp_path / "local", cfg, progress=False)
    compute_cluster_features(c, tmp_path / "cluster", cfg, progress=False)
    want = _feature_files(tmp_path / "local")
    assert len(want) > 10 and _feature_files(tmp_path / "cluster") == want


def _interrupted(monkeypatch, module, name: str, after: int) -> None:
    """module.name raises KeyboardInterrupt on its call after `after` calls (then works again)."""
    fn, calls = getattr(module, name), []

    def wrapped(*a, **kw):
        calls.append(1)
        if len(calls) == after + 1:
            raise KeyboardInterrupt
        return fn(*a, **kw)

    monkeypatch.setattr(module, name, wrapped)


def test_heldout_features_through_the_cluster_resume(held, tmp_path, monkeypatch):
    """Held-out features (--corpus) by the holders, chunk by chunk: the local files, byte for byte,
    also when the pass is interrupted after two chunks and run again; a rerun with another
    configuration is refused and leaves the directory as it was."""
    from teragram.index import heldout
    from teragram.index.errors import BuildError
    from teragram.index.features import FeatureConfig

    c, idx, orc = held
    rng = np.random.default_rng(8)
    text = tmp_path / "text"
    text.mkdir()
    for i in range(7):
        ids = np.concatenate([orc.docs[20 + i][:30], rng.integers(3, idx.vocab_size, size=20)])
        (text / f"{i}.txt").write_text(idx.decode(ids.tolist()))
    cfg = FeatureConfig("held-out", 12, 3)
    monkeypatch.setattr(heldout, "HELD_OUT_CHUNK", 120)
    heldout.compute_held_out(idx, tmp_path / "local", cfg, [str(text)])
    want = _feature_files(tmp_path / "local")
    _interrupted(monkeypatch, heldout, "held_out_features", 2)
    with pytest.raises(KeyboardInterrupt):
        heldout.compute_held_out(c, tmp_path / "cluster", cfg, [str(text)])
    assert sorted(p.name for p in (tmp_path / "cluster" / "chunks").glob("*.done")) == ["000000.done", "000001.done"]
    heldout.compute_held_out(c, tmp_path / "cluster", cfg, [str(text)])
    assert _feature_files(tmp_path / "cluster") == want  # interrupted at the third of 4 runs of <= 120 positions (2 documents each)
    with pytest.raises(BuildError, match="holds features of another index or configuration"):
        heldout.compute_held_out(c, tmp_path / "cluster", FeatureConfig("held-out", 12, 2), [str(text)])
    assert _feature_files(tmp_path / "cluster") == want


def test_features_verb_through_the_cluster_resumes(cluster, random_index, tmp_path, monkeypatch, capsys):
    """`teragram features IDX --cluster` (exclude-doc, replicas 2) interrupted after two shards,
    then run again: it continues with the third, shows its progress bar, and gives the local
    verb's files byte for byte; a rerun with another --max-len is refused with one line."""
    from teragram.builder import cluster_features
    from teragram.serve.main import main

    idx, _ = random_index
    args = ["features", str(idx.path), "--mode", "exclude-doc", "--max-len", "10", "--top-k", "2"]
    assert main([*args, "--out", str(tmp_path / "local"), "--quiet"]) == 0
    remote = [*args, "--out", str(tmp_path / "cluster"), "--cluster", cluster.address, "--replicas", "2"]
    _interrupted(monkeypatch, cluster_features, "cluster_shard_features", 2)
    with pytest.raises(KeyboardInterrupt):
        main([*remote, "--quiet"])
    assert sorted(p.name for p in (tmp_path / "cluster").glob("*.done")) == ["000000.done", "000001.done"]
    capsys.readouterr()
    assert main(remote) == 0
    err = capsys.readouterr().err
    assert f"features (exclude-doc, cluster): 100%|██████████| {len(idx.shards) - 2}/{len(idx.shards) - 2}" in err
    assert _feature_files(tmp_path / "cluster") == _feature_files(tmp_path / "local")
    assert main([*remote, "--max-len", "8"]) == 2  # the last --max-len given counts
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds features of another index or configuration" in err


@pytest.fixture(scope="module")
def gate_file(tmp_path_factory, random_index):
    """A gate over every exact-match estimate (the index's and the document cache's) with random
    weights, so that each weighs in: generation reads every estimate the scorer gives."""
    from teragram.model.mixture import estimates
    from teragram.model.mixture.gate import Gate, gate_inputs

    idx, orc = random_index
    est = estimates.estimates(idx, orc.docs[0][:10])
    n = len(est["index_length"])
    F = gate_inputs(est, np.full(n, 0.5), np.zeros(n, np.int64)).shape[1]
    path = tmp_path_factory.mktemp("gate") / "gate.json"
    Gate(np.random.default_rng(3).normal(size=(F, len(estimates.COMPONENTS)))).save(path)
    return path


def test_sample_through_the_cluster(cluster, random_index, model_run, gate_file, tmp_path, capsys):
    """`teragram sample --cluster`: the index-input model's live features, the gate's estimates,
    drafts from the index and provenance read through the holders give the local text, token for
    token, and the same statistics; --verbose still reports the lookups per token."""
    from teragram.serve.main import main

    idx, orc = random_index
    local = copytree(idx.path, tmp_path / "idx")  # LMDB opens an environment once per process
    run, _ = model_run
    prompt = idx.decode(orc.docs[-2][:12])
    for extra in (["--gate", str(gate_file), "--draft", "4", "--provenance"], ["--temperature", "0"]):
        out, err = [], []  # local, then through the cluster
        for where in ([str(local)], [str(idx.path), "--cluster", cluster.address]):
            args = ["sample", "--checkpoint", str(run), "--index", where[0], prompt, "--max-tokens", "40", "--seed", "7", "--verbose"]
            assert main([*args, *extra, *where[1:]]) == 0
            o, e = capsys.readouterr()
            out.append(o)
            err.append(e.splitlines())
        assert out[1] == out[0] and len(out[0]) > len(prompt)
        assert err[1][:2] == err[0][:2] and "index lookups per token: median" in err[1][2], err
        assert ("provenance (tokens whose context" in out[0]) == ("--provenance" in extra)


def test_serve_a_model_through_the_cluster(cluster, random_index, model_run, gate_file, tmp_path):
    """`teragram serve --cluster --checkpoint`: /v1/completions (drafts, provenance, streamed
    or not) and /v1/score answer as the local server does; /stats reports the lookups."""
    from fastapi.testclient import TestClient
    from teragram.serve.app import ServeConfig, create_app

    idx, orc = random_index
    local = copytree(idx.path, tmp_path / "idx")
    run, _ = model_run
    text = idx.decode(orc.docs[-2][:12])
    apps = [
        TestClient(create_app(ServeConfig(index=str(path), checkpoint=str(run), gate=str(gate_file), **kw)))
        for path, kw in ((local, {}), (idx.path, {"cluster": cluster.address}))
    ]
    completion = {"prompt": text, "max_tokens": 30, "temperature": 0.8, "seed": 4, "draft": 3, "provenance": True}
    answers = []
    for app in apps:
        a = app.post("/v1/completions", json=completion).json()
        streamed = app.post("/v1/completions", json=completion | {"stream": True}).text
        scored = app.post("/v1/score", json={"text": text}).json()
        answers.append(({k: v for k, v in a.items() if k not in ("id", "created")}, streamed.count("data:"), scored))
        drafts = app.get("/stats").json()["drafts"]
        assert drafts["lookup_ms_median"] is not None and drafts["drafted"] > 0
    assert answers[1] == answers[0]
    assert answers[0][0]["usage"]["completion_tokens"] >= 5 and "logprobs_with_gate" in answers[0][2]
