"""A query whose client goes away stops (serve/lanes.py unless_gone, index/cancel.py): the server
sees the disconnect, the query stops at its next shard, its lane's thread is free for the next
query, and /stats counts it as cancelled, not as an error, with no traceback logged."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from teragram.index.engine import Index
from teragram.serve.app import ServeConfig, create_app
from teragram.serve.lanes import Lanes

from tests.conftest import copytree

SLOW_S = 0.3  # each shard's documents read this long: a query of several shards is slow
GONE_AFTER_S = 0.2  # the client goes while the first shard is read


@contextmanager
def serving(app):
    """The app served by uvicorn in a thread of this process (so that a test can slow its index
    down), on a free loopback port; its lifespan is left to whoever made the app."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", http="httptools"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def post_and_leave(url: str, path: str, body: dict, after_s: float) -> None:
    """POST body to path, then close the connection after_s later, unanswered."""
    data = json.dumps(body).encode()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(data))
        )
        s.sendall(data)
        time.sleep(after_s)


def endpoint_stats(url: str, path: str, *, cancelled: int, timeout_s: float = 30.0) -> dict:
    """/stats of path once it counts `cancelled` cancelled requests (recorded as their handlers end)."""
    t = time.time()
    while True:
        got = httpx.get(url + "/stats").json()["endpoints"].get(path, {})
        if got.get("cancelled") == cancelled or time.time() - t > timeout_s:
            return got
        time.sleep(0.05)


@pytest.fixture(scope="module")
def app(real_index, tmp_path_factory):  # a copy: an index's LMDB opens once in a process, and other tests' servers may hold it
    app = create_app(ServeConfig(index=str(copytree(real_index, tmp_path_factory.mktemp("cancel") / "idx"))))
    app.state.served.lanes = Lanes(search=ThreadPoolExecutor(1), enumerate=ThreadPoolExecutor(1))  # one thread a lane
    return app


def test_a_query_whose_client_goes_frees_its_lane(app, monkeypatch, caplog):
    idx = app.state.served.idx
    body = {"query_type": "search_docs", "query": "the", "maxnum": 100}
    visits, shard_docs = [], Index.shard_docs
    monkeypatch.setattr(Index, "shard_docs", lambda *a, **kw: visits.append(1) or shard_docs(*a, **kw))
    idx.docs(idx.tokenize("the"), max=100)
    every = len(visits)  # the shards the whole query reads
    assert every >= 3

    def slow(*a, **kw):
        visits.append(1)
        time.sleep(SLOW_S)
        return shard_docs(*a, **kw)

    monkeypatch.setattr(Index, "shard_docs", slow)
    visits.clear()
    caplog.set_level(logging.WARNING)
    with serving(app) as url:
        post_and_leave(url, "/", body, GONE_AFTER_S)
        # the next query of the same lane (enumerate, one thread) runs once the first has stopped
        r = httpx.post(url + "/", json={"query_type": "ntd", "query": "the"}, timeout=60)
        assert r.status_code == 200 and r.json()["prompt_cnt"] > 0
        assert 1 <= len(visits) < every  # the query stopped early: at its next shard after the client went
        got = endpoint_stats(url, "/ (search_docs)", cancelled=1)
        assert got["cancelled"] == 1 and got["errors"] == 0 and got["requests"] == 1
        assert endpoint_stats(url, "/", cancelled=1)["errors"] == 0
        monkeypatch.setattr(Index, "shard_docs", shard_docs)
        r = httpx.post(url + "/", json=body, timeout=60)  # the same query, its client staying: answered
        assert r.status_code == 200 and r.json()["cnt"] > 0
    assert not [rec for rec in caplog.records if rec.exc_info or "Traceback" in rec.getMessage()]
