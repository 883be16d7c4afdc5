"""AND/OR (CNF) queries against the infini-gram package on the same token ids in the same shards:
counts, the ranges each count is made of, and the documents listed; the errors; the verb (the
HTTP endpoint: tests/serve/test_cnf_http.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from teragram.index import cnf as C
from teragram.index.engine import Index
from teragram.index.errors import QueryError

from tests.conftest import random_cnf
from tests.index.test_infinigram import write_infinigram_tokens

pytest.importorskip("infini_gram")


def _shard_docs(shard) -> list[np.ndarray]:
    tok, st = np.asarray(shard.tok), np.asarray(shard.starts, np.int64)
    return [tok[st[k] : st[k + 1] - 1].astype(np.int64) for k in range(len(st) - 1)]


@pytest.fixture(scope="module")
def engines(real_index, tmp_path_factory):
    """teragram's multi-shard index and infini-gram's index of the same documents, shard by shard
    (one infini-gram index directory per teragram shard: the CNF algorithm works per shard)."""
    from infini_gram.engine import InfiniGramEngine

    idx = Index(real_index)
    assert len(idx.shards) >= 3
    root = tmp_path_factory.mktemp("ig-cnf")
    dirs = []
    for shard in idx.shards:
        S = root / f"{shard.id}" / "S"
        write_infinigram_tokens(_shard_docs(shard), S)
        args = ["--data_dir", str(S.parent), "--save_dir", str(S), "--token_dtype", "u16", "--cpus", "1", "--mem", "1", "--ulimit", "1024"]
        subprocess.run([sys.executable, "-m", "infini_gram.indexing", *args], check=True, capture_output=True)
        dirs.append(str(S))
    ig = InfiniGramEngine(index_dir=dirs, eos_token_id=idx.eos_id, vocab_size=65535, version=4, token_dtype="u16")
    return idx, ig


def _sampled(idx, cnf, max_clause_freq) -> bool:
    """Whether some clause passes the per-shard limit in some shard (both engines then sample)."""
    limit = -(-max_clause_freq // len(idx.shards))
    for clause in cnf:
        per_shard = np.zeros(len(idx.shards), np.int64)
        for q in clause:
            per_shard += [b - a for a, b in idx.count_intervals(np.asarray(q))[1]]
        if per_shard.max() > limit:
            return True
    return False


def _ig_starts(ig_ptrs) -> list[list[int]]:
    """infini-gram's range starts as teragram's token positions: its shard holds b'\\xff\\xff' before
    each document where teragram's holds a separator after it, so byte ptr = 2 * (position + 1)."""
    return [sorted(p // 2 - 1 for p in ptrs) for ptrs in ig_ptrs]


def test_random_cnf_queries_equal_infini_gram(engines):
    idx, ig = engines
    docs = [d for s in idx.shards for d in _shard_docs(s)]
    rng = np.random.default_rng(64)
    compared, sampled, nonzero, multi = 0, 0, 0, 0
    for i in range(640):
        cnf = random_cnf(rng, docs, idx.vocab_size)
        mcf = 50_000 if i % 8 else int(rng.choice([200, 2_000]))
        diff = 100 if i % 3 else int(rng.integers(1, 300))
        kw = dict(max_clause_freq=mcf, max_diff_tokens=diff)
        ours = idx.count_cnf(cnf, **kw)
        if _sampled(idx, cnf, mcf):  # infini-gram samples other occurrences (index/cnf.py): ours is flagged
            sampled += 1
            assert ours.approx or ours.to_json() == ig.count_cnf(cnf, **kw) == {"count": 0, "approx": False}, cnf  # a clause absent
            continue
        theirs = ig.find_cnf(cnf, **kw)
        assert ours.to_json() == {"count": theirs["cnt"], "approx": theirs["approx"]} == ig.count_cnf(cnf, **kw), (cnf, kw)
        count, _, ranges = C.find_cnf(idx, cnf, **kw)
        if count:
            assert [sorted(lo.tolist()) for lo, _ in ranges] == _ig_starts(theirs["ptrs_by_shard"]), cnf
        got = idx.search_docs_cnf(cnf, maxnum=10_000, **kw)
        want = {s.first_doc + int(np.searchsorted(s.starts, p, side="right")) - 1 for s, ps in zip(idx.shards, ranges) for p in ps[0]}
        assert got.count == count and {h.doc_id for h in got.docs} == want
        if count and i % 10 == 0:  # infini-gram's random documents are among ours
            ig_docs = ig.search_docs_cnf(cnf, maxnum=3, max_disp_len=20, **kw)["documents"]
            assert {d["doc_ix"] for d in ig_docs} <= want
        compared += 1
        nonzero += count > 0
        multi += count > 0 and len(cnf) > 1
    print(f"compared {compared}, sampled {sampled}, nonzero {nonzero}, nonzero with AND {multi}")
    assert compared >= 500 and nonzero >= 150 and multi >= 50 and sampled >= 5


def _frequent(idx) -> list[list[list[int]]]:
    """The two most frequent tokens, ANDed."""
    a, b = (int(t) for t in np.argsort(idx.unigram[: idx.vocab_size])[-2:])
    return [[[a]], [[b]]]


def test_documents_are_listed_in_corpus_order_with_the_match(engines):
    idx, _ = engines
    r = idx.search_docs_cnf(_frequent(idx), maxnum=3, context=5, max_clause_freq=10**8)
    assert r.count > 0 and len(r.docs) == 3
    assert [h.doc_id for h in r.docs] == sorted({h.doc_id for h in r.docs})
    assert all("source" in h.metadata and h.snippet for h in r.docs)
    assert r.to_json()["documents"][0]["doc_ix"] == r.docs[0].doc_id


def test_text_syntax_is_infini_grams(engines):
    idx, _ = engines
    text = "the kernel OR a driver AND memory"
    assert C.is_cnf_text(text) and not C.is_cnf_text("ANDROID OR")
    assert C.parse_cnf_text(text) == [["the kernel", "a driver"], ["memory"]]
    ids = C.tokenize_cnf(idx, text)
    assert ids == [[idx.tokenize("the kernel"), idx.tokenize("a driver")], [idx.tokenize("memory")]]
    j = C.cnf_json(idx, idx.count_cnf(ids).to_json(), ids)
    assert j["token_ids"] == ids and j["tokens"][1][0] == [idx.piece(i) for i in ids[1][0]]


@pytest.mark.parametrize(
    "cnf, kw, msg",
    [
        ([], {}, "non-empty list of clauses"),
        ("the", {}, "non-empty list of clauses"),
        ([[]], {}, "clause 1 must be a non-empty list"),
        ([[[5]], [[]]], {}, "clause 2 term 1 must not be empty"),
        ([[[5]]] * 5, {}, "at most 4 clauses"),
        ([[[5]] * 5], {}, "clause 1 has 5 terms; at most 4"),
        ([[[5, 10**6]]], {}, "token id 1000000 outside the vocabulary"),
        ([[[5, -1]]], {}, "token id -1 outside the vocabulary"),
        ([[["a"]]], {}, "clause 1 term 1 must be a list of integers"),
        ([[[5]]], {"max_clause_freq": 0}, "max_clause_freq must be a positive integer"),
        ([[[5]]], {"max_diff_tokens": 1.5}, "max_diff_tokens must be a positive integer"),
    ],
)
def test_bad_queries_are_one_line_errors(engines, cnf, kw, msg):
    idx, _ = engines
    with pytest.raises(QueryError, match=msg):
        idx.count_cnf(cnf, **kw)
    with pytest.raises(QueryError, match="maxnum must be a positive integer"):
        idx.search_docs_cnf([[[5]]], maxnum=0)


def test_query_verb(engines, real_index, capsys):
    from teragram.serve.main import main

    idx, _ = engines
    ids = C.tokenize_cnf(idx, "the OR a AND kernel")
    assert main(["query", str(real_index), "--cnf", "the OR a AND kernel", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == C.cnf_json(idx, idx.count_cnf(ids).to_json(), ids)
    ids = _frequent(idx)
    args = [str(real_index), "docs", "--cnf-ids", json.dumps(ids), "--max-diff-tokens", "20", "--json"]
    code = "import sys; from teragram.serve.main import main; sys.exit(main(['query', *sys.argv[1:]]))"
    out = json.loads(subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True).stdout)  # its own LMDB
    assert out["cnt"] == idx.count_cnf(ids, max_diff_tokens=20).count and 0 < len(out["documents"]) <= 10
    assert main(["query", str(real_index), "ntd", "--cnf", "the AND a"]) == 2
    assert "count and docs only" in capsys.readouterr().err
