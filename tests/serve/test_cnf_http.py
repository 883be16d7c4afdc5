"""AND/OR (CNF) queries at POST / (serve/index_query.py): infini-gram's text and nested ids, the
same answers as the library's (index/cnf.py, tested against infini-gram in tests/index/test_cnf.py),
the errors, the OpenAPI schema."""

from __future__ import annotations

import numpy as np
from fastapi.testclient import TestClient
from teragram.index import cnf as C
from teragram.serve.app import ServeConfig, create_app


def test_http_cnf_queries(real_index):
    c = TestClient(create_app(ServeConfig(index=str(real_index))))
    idx = c.app.state.served.idx  # the server's own (an index's LMDB opens once in a process)
    ids = C.tokenize_cnf(idx, "the OR a AND kernel")
    r = c.post("/", json={"query_type": "count", "query": "the OR a AND kernel"})
    assert r.status_code == 200
    assert {k: r.json()[k] for k in ("count", "approx", "token_ids")} == idx.count_cnf(ids).to_json() | {"token_ids": ids}
    ids = [[[int(t)]] for t in np.argsort(idx.unigram[: idx.vocab_size])[-2:]]  # the two most frequent tokens, ANDed
    r = c.post("/", json={"query_type": "search_docs", "query_ids": ids, "maxnum": 2, "max_diff_tokens": 30, "max_clause_freq": 1000})
    want = idx.search_docs_cnf(ids, maxnum=2, max_diff_tokens=30, max_clause_freq=1000)
    assert r.status_code == 200 and r.json()["cnt"] == want.count > 0
    assert [d["doc_ix"] for d in r.json()["documents"]] == [h.doc_id for h in want.docs]
    r = c.post("/", json={"query_type": "ntd", "query": "the AND a"})
    assert r.status_code == 400 and "count and search_docs only" in r.json()["error"]
    r = c.post("/", json={"query_type": "count", "query_ids": [[[5]]] * 5})
    assert r.status_code == 400 and "at most 4 clauses" in r.json()["error"]
    r = c.post("/", json={"query_type": "count", "query_ids": [[[5]]], "max_diff_tokens": 5000})
    assert r.status_code == 400 and "max_diff_tokens" in r.json()["error"]
    schema = c.get("/openapi.json").json()["components"]["schemas"]["InfinigramRequest"]["properties"]
    assert {"max_clause_freq", "max_diff_tokens"} <= set(schema)
