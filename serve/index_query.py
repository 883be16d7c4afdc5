"""infini-gram's request at POST / (serve/app.py): its model, and the answer to an AND/OR query
(count and search_docs of a conjunction of disjunctions of n-grams: index/cnf.py), which its
API takes as a `query` holding " AND " or " OR ", or as `query_ids` nested three deep."""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from teragram.index import cnf
from teragram.index.cluster import ClusterIndex
from teragram.index.errors import QueryError

CNF_QUERY_TYPES = ("count", "search_docs")


class InfinigramRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # infini-gram clients send index/corpus/source/timestamp too
    query_type: str
    query: str | None = None
    query_ids: list[int] | list[list[list[int]]] | None = None  # an n-gram, or clauses of terms (AND/OR)
    maxnum: int = Field(default=1, ge=1, le=100)
    max_disp_len: int = Field(default=100, ge=1, le=10000)
    max_clause_freq: int = Field(default=cnf.MAX_CLAUSE_FREQ, ge=1, le=500_000)  # AND/OR queries; infini-gram API's bounds
    max_diff_tokens: int = Field(default=cnf.MAX_DIFF_TOKENS, ge=1, le=1_000)

    def is_cnf(self) -> bool:
        """Whether this is an AND/OR query (infini-gram's API: by its text, or by its ids' nesting)."""
        if self.query is not None:
            return cnf.is_cnf_text(self.query)
        return bool(self.query_ids) and isinstance(self.query_ids[0], list)


def answer_cnf(idx, req: InfinigramRequest, max_query_tokens: int) -> JSONResponse:
    """The answer to an AND/OR query: infini-gram's fields, its terms' ids and texts nested as the
    query is, and the latency."""
    t = time.perf_counter()
    if req.query_type not in CNF_QUERY_TYPES:
        raise QueryError(f"AND/OR queries are for count and search_docs only, not {req.query_type}")
    if isinstance(idx, ClusterIndex):
        raise QueryError("AND/OR queries are not answered through --cluster")
    if req.query is not None and req.query_ids is not None:
        raise QueryError("give exactly one of query (text) and query_ids")
    ids = cnf.tokenize_cnf(idx, req.query) if req.query is not None else req.query_ids
    n = sum(len(term) for clause in ids for term in clause)
    if n > max_query_tokens:
        raise QueryError(f"query of {n} tokens is over the cap of {max_query_tokens}")
    kw = dict(max_clause_freq=req.max_clause_freq, max_diff_tokens=req.max_diff_tokens)
    if req.query_type == "count":
        r = idx.count_cnf(ids, **kw)
    else:
        r = idx.search_docs_cnf(ids, maxnum=req.maxnum, context=req.max_disp_len // 2, **kw)
    return JSONResponse(cnf.cnf_json(idx, r.to_json(), ids) | {"latency": (time.perf_counter() - t) * 1e3})
