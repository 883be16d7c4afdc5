"""The HTTP API under hostile input: bad UTF-8, lone surrogates, huge numbers, negative counts,
deep JSON, bodies over the cap (with and without a Content-Length), too many streams from one
client, and slow clients (a stream never read, a body never finished) -- each a one-line 4xx
or no harm to other clients, never a 5xx, a traceback or a server gone."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest
from fastapi.testclient import TestClient
from teragram.serve.app import ServeConfig, create_app
from teragram.serve.model_routes import MAX_STOPS

from tests.serve.test_app import checkpoint  # noqa: F401 (the tiny model the server runs)
from tests.serve.test_cancel import endpoint_stats, post_and_leave, serving
from tools.page.browser import server

J = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def app(real_index, checkpoint):  # noqa: F811
    return create_app(ServeConfig(index=str(real_index), checkpoint=str(checkpoint), max_tokens=64, max_streams_per_client=2))


@pytest.mark.parametrize(
    "path,body,msg",
    [
        pytest.param("/", b"[" * 100_000 + b"]" * 100_000, "nested too deeply", id="deep array"),
        pytest.param(
            "/", b'{"query_type": "count", "query_ids": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nested too deeply", id="deep query_ids"
        ),
        pytest.param("/", b'{"query_type": "count", "query": "\xff\xfe\xc3"}', "not UTF-8", id="bad UTF-8 query"),
        pytest.param("/v1/completions", b'{"prompt": "\xc3\x28"}', "not UTF-8", id="bad UTF-8 prompt"),
        pytest.param("/", b'{"query_type": "count", "query": "a\\ud800b"}', "lone surrogate", id="lone surrogate query"),
        pytest.param("/v1/completions", b'{"prompt": "\\udfff"}', "lone surrogate", id="lone surrogate prompt"),
        pytest.param("/v1/score", b'{"text": "x\\ud800"}', "lone surrogate", id="lone surrogate score"),
        pytest.param("/", b'{"query_type": "count", "query_ids": [' + b"9" * 5000 + b"]}", "too many digits", id="5000-digit id"),
        pytest.param("/", b'{"query_type": "count", "query_ids": [18446744073709551617]}', "list of integers", id="id over 64 bits"),
        pytest.param(
            "/", b'{"query_type": "count", "query_ids": [[[18446744073709551617]]]}', "list of integers", id="AND/OR id over 64 bits"
        ),
        pytest.param("/", b'{"query_type": "count", "query_ids": [-5]}', "outside the vocabulary", id="negative id"),
        pytest.param("/", b'{"query_type": "search_docs", "query": "the", "maxnum": 1e400}', "maxnum", id="maxnum 1e400"),
        pytest.param("/", b'{"query_type": "search_docs", "query": "the", "maxnum": NaN}', "maxnum", id="maxnum NaN"),
        pytest.param("/", b'{"query_type": "search_docs", "query": "the", "maxnum": -3}', "maxnum", id="negative maxnum"),
        pytest.param("/", b'{"query_type": "search_docs", "query": "the", "maxnum": 101}', "maxnum", id="maxnum over the page"),
        pytest.param("/", b'{"query_type": "search_docs", "query": "the", "offset": -1}', "offset", id="negative offset"),
        pytest.param("/", b'{"query_type": "search_docs", "query": "the", "offset": 99999999}', "offset", id="offset over the cap"),
        pytest.param("/v1/completions", b'{"prompt": "x", "max_tokens": 1e308}', "max_tokens", id="max_tokens 1e308"),
        pytest.param("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', "max_tokens", id="negative max_tokens"),
        pytest.param("/v1/completions", b'{"prompt": "x", "max_tokens": 65}', "over the cap of 64", id="max_tokens over the cap"),
        pytest.param("/v1/completions", b'{"prompt": "x", "seed": 123456789012345678901234567890}', "seed", id="seed over 64 bits"),
        pytest.param("/v1/completions", b'{"prompt": "x", "seed": -1}', "seed", id="negative seed"),
        pytest.param("/v1/completions", json.dumps({"prompt": "x", "stop": ["a"] * (MAX_STOPS + 1)}).encode(), "stop", id="too many stops"),
        pytest.param("/v1/score", b'{"ids": [1, -2]}', "outside the vocabulary", id="negative id scored"),
    ],
)
def test_hostile_bodies_get_a_one_line_4xx(app, path, body, msg):
    r = TestClient(app, raise_server_exceptions=False).post(path, content=body, headers=J)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert msg in err and "\n" not in err and "Traceback" not in err


def test_body_caps_with_and_without_a_content_length(app):
    c = TestClient(app, raise_server_exceptions=False)
    big = b'{"query_type": "count", "query": "' + b"a" * (2 << 20) + b'"}'
    assert c.post("/", content=big, headers=J).status_code == 413
    r = c.post("/", content=iter([big[:100], big[100:]]), headers=J)  # chunked: no Content-Length
    assert r.status_code == 413 and "over 1048576 bytes" in r.json()["error"]
    assert c.post("/", content=iter([b'{"query_type": "count",', b' "query": "the"}']), headers=J).status_code == 200
    assert c.post("/", content=b"{}", headers=J | {"content-length": "-1"}).status_code == 400


def test_a_score_whose_client_goes_stops_waiting_for_the_model(app):
    """A scoring request waiting for the model (its lock held) whose client goes is dropped, never
    sent to the model's process: counted cancelled, not an error; the next score is answered."""
    with serving(app) as url:
        before = endpoint_stats(url, "/v1/score", cancelled=0, timeout_s=0)
        with app.state.served.model_lock:
            post_and_leave(url, "/v1/score", {"text": "The kernel"}, 0.3)
            got = endpoint_stats(url, "/v1/score", cancelled=before.get("cancelled", 0) + 1)
        assert got.get("cancelled") == before.get("cancelled", 0) + 1 and got["errors"] == before.get("errors", 0)
        r = httpx.post(url + "/v1/score", json={"text": "The kernel"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["token_ids"]) >= 2


def test_streams_per_client_are_capped(app):
    """With the model busy, a client's streams wait holding their slots: one over the cap is a 429 at
    once; when they end, the client may stream again."""
    lock = app.state.served.model_lock
    body = {"prompt": "The", "max_tokens": 4, "stream": True}
    with TestClient(app) as c, ThreadPoolExecutor(4) as ex:
        with lock:
            waiting = [ex.submit(c.post, "/v1/completions", json=body) for _ in range(2)]
            time.sleep(1.0)
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 429 and "2 streams already open" in r.json()["error"]
        assert all(w.result(timeout=60).status_code == 200 for w in waiting)
        assert c.post("/v1/completions", json=body).status_code == 200


@pytest.fixture(scope="module")
def live(real_index, checkpoint):  # noqa: F811
    with server(["--index", str(real_index), "--checkpoint", str(checkpoint)]) as running:
        yield running


def _raw(url: str, request: bytes) -> socket.socket:
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow reader: the server's writes back up soon
    s.sendall(request)
    return s


def test_slow_clients_do_not_block_others(live):
    """Streams that are never read and bodies that never finish hold nothing the other clients
    need: their queries and completions are answered meanwhile, and the server lives on."""
    url = live.url
    body = json.dumps({"prompt": "The kernel", "max_tokens": 64, "stream": True}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    never_read = [_raw(url, head + b"Content-Length: %d\r\n\r\n" % len(body) + body) for _ in range(2)]
    never_done = [_raw(url, head + b"Content-Length: 1000\r\n\r\n" + body[:10]) for _ in range(20)]
    try:
        time.sleep(0.5)
        t = time.perf_counter()
        r = httpx.post(url + "/", json={"query_type": "count", "query": "the"}, timeout=10)
        assert r.status_code == 200 and r.json()["count"] > 0
        r = httpx.post(url + "/v1/completions", json={"prompt": "The", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "The", "max_tokens": 8, "stream": True}, timeout=60) as s:
            assert s.status_code == 200 and any(line == "data: [DONE]" for line in s.iter_lines())
        assert time.perf_counter() - t < 60
    finally:
        for s in never_read + never_done:
            s.close()
    time.sleep(0.5)
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert "Traceback" not in live.log()
