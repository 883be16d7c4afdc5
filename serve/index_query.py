"""infini-gram's request at POST / (serve/app.py): its model, and the answer to an AND/OR query
(count and search_docs of a conjunction of disjunctions of n-grams: index/cnf.py), which its
API takes as a `query` holding " AND " or " OR ", or as `query_ids` nested three deep."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from teragram.index import cnf
from teragram.index.errors import QueryError
from teragram.index.results import DocsResult


def _unicode(text: str) -> str:
    """JSON can carry a lone surrogate (an escaped half of a pair), which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode (a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]  # a request's text: encodable as UTF-8

CNF_QUERY_TYPES = ("count", "search_docs")
MAX_DOCS = 100  # documents in one answer (a page)
MAX_OFFSET = 10_000  # documents skipped before a page: listing them costs as much as returning them


class InfinigramRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # infini-gram clients send index/corpus/source/timestamp too
    query_type: str
    query: Text | None = None
    query_ids: list[int] | list[list[list[int]]] | None = None  # an n-gram, or clauses of terms (AND/OR)
    maxnum: int = Field(default=1, ge=1, le=MAX_DOCS)
    offset: int = Field(default=0, ge=0, le=MAX_OFFSET)  # search_docs: documents skipped (paging), in corpus order
    max_disp_len: int = Field(default=100, ge=1, le=10000)
    max_clause_freq: int = Field(default=cnf.MAX_CLAUSE_FREQ, ge=1, le=500_000)  # AND/OR queries; infini-gram API's bounds
    max_diff_tokens: int = Field(default=cnf.MAX_DIFF_TOKENS, ge=1, le=1_000)

    def is_cnf(self) -> bool:
        """Whether this is an AND/OR query (infini-gram's API: by its text, or by its ids' nesting)."""
        if self.query is not None:
            return cnf.is_cnf_text(self.query)
        return bool(self.query_ids) and isinstance(self.query_ids[0], list)

    def page(self, r: DocsResult) -> DocsResult:
        """The documents of a search for offset + maxnum of them, past the first offset."""
        return DocsResult(r.count, r.docs[self.offset :], r.approx)


def limits(cfg) -> dict:
    """The server's caps on a request (serve/app.py's ServeConfig and the requests' bounds), as /stats gives them."""
    return {
        "max_query_tokens": cfg.max_query_tokens,
        "max_tokens": cfg.max_tokens,
        "max_body_bytes": cfg.max_body_bytes,
        "max_streams_per_client": cfg.max_streams_per_client,
        "max_docs": MAX_DOCS,
        "max_offset": MAX_OFFSET,
    }


def query_ids(idx, text: str | None, ids: list[int] | None, cap: int) -> list[int]:
    """A request's token ids, from its text or its ids, within the query cap."""
    if (text is None) == (ids is None):
        raise QueryError("give exactly one of query (text) and query_ids")
    ids = idx.tokenize(text) if text is not None else list(ids)
    if len(ids) > cap:
        raise QueryError(f"query of {len(ids)} tokens is over the cap of {cap}")
    return ids


def answer_cnf(idx, req: InfinigramRequest, max_query_tokens: int) -> JSONResponse:
    """The answer to an AND/OR query: infini-gram's fields, its terms' ids and texts nested as the
    query is, and the latency."""
    t = time.perf_counter()
    if req.query_type not in CNF_QUERY_TYPES:
        raise QueryError(f"AND/OR queries are for count and search_docs only, not {req.query_type}")
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
        r = req.page(idx.search_docs_cnf(ids, maxnum=req.offset + req.maxnum, context=req.max_disp_len // 2, **kw))
    return JSONResponse(cnf.cnf_json(idx, r.to_json(), ids) | {"latency": (time.perf_counter() - t) * 1e3})
