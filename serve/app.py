"""HTTP server: index queries (infini-gram's API shape), OpenAI-style completions, scoring.

    teragram serve --index IDX [--checkpoint CKPT] [--host 127.0.0.1] [--port 8080] [--api-key KEY]
                   [--cluster ADDRESS]

Endpoints: POST / (infini-gram's request/response shape, AND/OR queries too), POST /v1/completions (prompt,
max_tokens, temperature, top_p, stop, stream as server-sent events; draft: up to N tokens
drafted from exact matches and verified in one pass; provenance: each token's indexed document),
POST /v1/score, GET /health, GET /stats. Every bad request gets a 4xx with {"error": "<one line>"}.

Requests run in three lanes of worker threads (Lanes), so that a cheap query never waits for a
thread behind expensive ones: index queries that only search (count, prob, infgram_prob), index
queries that enumerate (ntd, infgram_ntd, search_docs), and requests that run the model
(completions, scoring), whose model calls are serialized by a lock (one model, one device). The
model, its gate and generation's index lookups run in a process of their own
(serve/model_worker.py; in this one with --cluster, whose holders keep generation's lookups for
the process that opened them), so the model's Python never holds this process's interpreter.
Index queries run concurrently (the kernels release the GIL). A response is encoded in its lane's
thread, a next-token histogram from its arrays (results.answer_json). Both processes settle.
"""

from __future__ import annotations

import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from teragram.index.engine import Index
from teragram.index.errors import Cancelled, ClusterError, QueryError, TeragramError
from teragram.index.results import answer_json
from teragram.model.generation.draft import DraftStats
from teragram.serve.guard import CLIENT_GONE, Guard, Stats, Streams, body_error, check_bind, error
from teragram.serve.index_query import InfinigramRequest, answer_cnf, limits, query_ids
from teragram.serve.lanes import QUERY_TYPES, SEARCH_QUERIES, Lanes, settle, unless_gone
from teragram.serve.model_routes import CompletionRequest, ScoreRequest, add_completions, add_score
from teragram.serve.page import add_page


@dataclass(frozen=True)
class ServeConfig:
    index: str
    checkpoint: str | None = None
    hf_model: str | None = None  # a transformers causal LM instead of a checkpoint (model/hf/adapter.py)
    dtype: str | None = None  # its weights' dtype (default bfloat16 on a GPU, float32 on a CPU)
    context: int | None = None  # its context, when shorter than its positions
    gate: str | None = None  # index gate (model/mixture/gate.py) mixed into completions and scores
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    device: str = "cpu"
    max_tokens: int = 512  # cap on generated tokens per request
    max_body_bytes: int = 1 << 20
    max_query_tokens: int = 4096  # cap on tokens of a query / scored text
    cluster: str | None = None  # a Ray cluster's address: the shards held by its actors (index/cluster.py)
    replicas: int = 1  # with cluster: holders of each group of shards
    max_streams_per_client: int = 4  # streamed completions open at once from one client address


@dataclass
class Served:
    """What the server holds: the index, the model and what mixes into it, and the shared state
    of its requests (the model's lock, what drafting has learnt, the endpoints' statistics)."""

    cfg: ServeConfig
    idx: Index  # or a ClusterIndex (--cluster)
    model: object = None
    model_meta: dict = field(default_factory=dict)
    gate: object = None
    model_lock: threading.Lock = field(default_factory=threading.Lock)
    draft_stats: DraftStats = field(default_factory=DraftStats)  # acceptance by match length, across requests
    stats: object = field(default_factory=Stats)
    lanes: Lanes = field(default_factory=Lanes)
    handlers: dict = field(default_factory=dict)  # the routes' work, by name (query, complete, score): warm() calls them
    worker: object = None  # the model's process (serve/model_worker.py), when the model is not in this one
    streams: Streams = field(default_factory=Streams)  # open streams per client (max_streams_per_client)


def load(cfg: ServeConfig, *, with_model: bool = True) -> Served:
    """Open the index and load the model and its gate (with_model False: the index alone, the
    model's process loads them), refusing with one line what cannot serve together (another
    vocabulary or tokenizer, a gate of another model or index)."""
    if cfg.cluster:  # the holders also keep generation's live lookups (index/cluster_scorer.py)
        from teragram.index.cluster import ClusterIndex

        idx = ClusterIndex.open(cfg.index, address=cfg.cluster, replicas=cfg.replicas)
    else:
        idx = Index(cfg.index)
    model = None
    model_meta: dict = {}
    if cfg.gate and not (cfg.checkpoint or cfg.hf_model):
        raise TeragramError("--gate needs --checkpoint or --hf-model")
    if (cfg.checkpoint or cfg.hf_model) and with_model:
        from teragram.model.checkpoint import load_lm

        model, model_meta = load_lm(cfg.checkpoint, cfg.hf_model, index=idx, device=cfg.device, dtype=cfg.dtype, context=cfg.context)
    gate = None
    if cfg.gate and with_model:
        from teragram.model.checkpoint import weights_digest
        from teragram.model.mixture.gate import Gate

        gate = Gate.load(cfg.gate)
        gate.check(model=weights_digest(model), index_dir=cfg.index, name=cfg.gate)
    return Served(cfg, idx, model, model_meta, gate)


def create_app(cfg: ServeConfig) -> FastAPI:
    """The server; its model in a process of its own (serve/model_worker.py), but with --cluster (module doc)."""
    own = (cfg.checkpoint or cfg.hf_model) is not None and cfg.cluster is None
    s = load(cfg, with_model=not own)
    if own:
        from teragram.serve.model_worker import ModelWorker

        s.worker = ModelWorker(_model_process, cfg, s.model_lock)

    @asynccontextmanager
    async def lifespan(app):
        yield
        if s.worker is not None:
            s.worker.close()

    app = FastAPI(title="teragram", version="0.1.0", lifespan=lifespan)
    app.state.served = s
    _add_guards(app, s)
    _add_index_routes(app, s)
    add_completions(app, s)
    add_score(app, s)
    add_page(app)
    warm(s)
    return app


def _model_process(cfg: ServeConfig, conn) -> None:
    """The model's process (serve/model_worker.py): loaded and warmed as a one-process server, then answering."""
    import os

    import torch
    from teragram.serve.model_worker import answer

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # a core left to the index's process (docs/results.md §7)
    try:
        s = load(cfg)
        app = FastAPI()
        add_completions(app, s)
        add_score(app, s)
        warm_model(s)
    except Exception as e:  # noqa: BLE001  (the parent raises it as its one-line error)
        conn.send(("failed", str(e) if isinstance(e, TeragramError) else f"{type(e).__name__}: {e}"))
        return
    settle()
    conn.send(("ready", _model_info(s)))
    answer(conn, s.handlers, {"complete": CompletionRequest, "score": ScoreRequest}, s.draft_stats.to_json)


WARM_TEXT = "The the"


def warm(s: Served) -> None:
    """One request of each kind, answered and dropped before the server listens. A process's
    first call of each compiled index kernel loads it from numba's cache, about a second in all
    at 2.43B tokens, and the first burst of clients waited for it behind each other
    (serve_load_2b: the p99 of every query type was that second); WARM_TEXT's contexts are
    frequent, so a rare one's enumeration is warmed apart. The model's warms itself (warm_model)."""
    _ = s.idx.piece_json  # the pieces' JSON, read by every next-token answer (results.answer_json)
    for qt in QUERY_TYPES:
        s.handlers["query"](InfinigramRequest(query_type=qt, query=WARM_TEXT))
    for shard in getattr(s.idx, "shards", [])[:1]:  # a context too rare to be stored: enumerated
        shard.blocks(0, min(1, shard.n), 0)
    warm_model(s)


def warm_model(s: Served) -> None:
    """A scoring request and two completions, if the model is in this process (their draft statistics dropped)."""
    if s.model is not None:
        s.handlers["score"](ScoreRequest(text=WARM_TEXT))
        for draft in (0, 2):
            s.handlers["complete"](CompletionRequest(prompt=WARM_TEXT, max_tokens=3, temperature=0.8, draft=draft, provenance=True))
        s.draft_stats.clear()


def _model_info(s: Served) -> dict:
    """What /stats says of a loaded model."""
    return {"params": s.model.num_params(), "use_index": s.model.cfg.use_index, "config": s.model_meta.get("model")}


def _add_guards(app: FastAPI, s: Served) -> None:
    """API key, content type and body size checks, per-endpoint statistics, and errors as JSON."""
    cfg, stats = s.cfg, s.stats

    app.add_middleware(Guard, cfg=cfg, stats=stats)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        e = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":
            return error(400, "malformed JSON")
        return error(400, f"{where or 'body'}: {e.get('msg', 'invalid request')}")

    @app.exception_handler(TeragramError)
    async def _teragram(request: Request, exc: TeragramError):
        if isinstance(exc, Cancelled):  # its client has gone (lanes.unless_gone): counted apart from errors
            return error(CLIENT_GONE, "cancelled: the client went away")
        status = getattr(exc, "status", 503 if isinstance(exc, ClusterError) else 400)  # 503: shards without a live holder
        return error(status, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, (exc.status_code == 400 and body_error(exc)) or str(exc.detail))


def _add_index_routes(app: FastAPI, s: Served) -> None:
    """/health, /stats and infini-gram's API at /."""
    cfg, idx, model, draft_stats, stats = s.cfg, s.idx, s.model, s.draft_stats, s.stats

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model is not None or s.worker is not None}

    @app.get("/stats")
    async def get_stats():
        m, drafts = None, None
        if model is not None:
            m, drafts = {"checkpoint": cfg.checkpoint or cfg.hf_model} | _model_info(s), draft_stats.to_json()
        elif s.worker is not None:
            m, drafts = {"checkpoint": cfg.checkpoint or cfg.hf_model} | s.worker.info, s.worker.drafts or DraftStats().to_json()
        return {
            "index": {
                "path": cfg.index,
                "tokens": idx.n_tokens,
                "documents": idx.n_docs,
                "shards": len(idx.manifest["shards"]),
                "vocab_size": idx.vocab_size,
            },
            "model": m,
            "drafts": drafts,
            "limits": limits(cfg),
            "uptime_s": time.time() - stats.start,
            "endpoints": stats.summary(),
        }

    def query(req: InfinigramRequest) -> dict:
        if req.is_cnf():  # AND/OR (serve/index_query.py)
            return answer_cnf(idx, req, cfg.max_query_tokens)
        t = time.perf_counter()
        ids = query_ids(idx, req.query, req.query_ids, cfg.max_query_tokens)
        qt = req.query_type
        if qt == "count":
            r = idx.count(ids)
        elif qt in ("prob", "infgram_prob"):
            if not ids:
                raise QueryError(f"{qt} needs at least one token (the last is the continuation)")
            r = (idx.prob if qt == "prob" else idx.infgram_prob)(ids[:-1], ids[-1])
        elif qt in ("ntd", "infgram_ntd"):
            r = (idx.ntd if qt == "ntd" else idx.infgram_ntd)(ids)
        elif qt == "search_docs":
            r = req.page(idx.docs(ids, max=req.offset + req.maxnum, context=req.max_disp_len // 2))
        else:
            raise QueryError(f"unknown query_type {qt!r}; expected {', '.join(QUERY_TYPES)}")
        body = answer_json(idx, r, ids, latency=(time.perf_counter() - t) * 1e3)
        return Response(body, media_type="application/json")

    s.handlers["query"] = query

    @app.post("/")
    async def infinigram(req: InfinigramRequest, request: Request):
        qt = req.query_type
        t, outcome = time.perf_counter(), "error"
        try:  # stopped if its client goes first: its lane's thread is then free (lanes.unless_gone)
            lane = s.lanes.search if qt in SEARCH_QUERIES and not req.is_cnf() else s.lanes.enumerate
            out = await unless_gone(request.receive, lane, query, req)
            outcome = "ok"
            return out
        except Cancelled:
            outcome = "cancelled"
            raise
        finally:  # each query type's own latency, waiting for its lane included
            if qt in QUERY_TYPES:
                stats.add(f"/ ({qt})", (time.perf_counter() - t) * 1e3, outcome == "ok", cancelled=outcome == "cancelled")


def serve(cfg: ServeConfig) -> None:
    import uvicorn

    check_bind(cfg.host, cfg.api_key)
    app = create_app(cfg)
    settle()
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", loop="uvloop", http="httptools")
