"""The server's request statistics and its guard: API key, content type and body size checks,
and each path's latency, as a plain ASGI middleware; and the count of each client's open
streams."""

from __future__ import annotations

import threading
import time
import weakref
from collections import defaultdict, deque

import numpy as np
from fastapi.exceptions import HTTPException  # FastAPI passes its own on from where a body is read, as they are
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from teragram.index.errors import TeragramError

CLIENT_GONE = 499  # the status of a request stopped because its client went away (nginx's "client closed request"); no one reads it


class Stats:
    """Requests, errors, requests cancelled (their clients gone: no errors, no latency) and
    latencies (the last 10,000) per path."""

    def __init__(self):
        self.start = time.time()
        self.counts: dict[str, int] = defaultdict(int)
        self.errors: dict[str, int] = defaultdict(int)
        self.cancelled: dict[str, int] = defaultdict(int)
        self.lat: dict[str, deque] = defaultdict(lambda: deque(maxlen=10000))
        self.lock = threading.Lock()

    def add(self, path: str, ms: float, ok: bool, *, cancelled: bool = False) -> None:
        with self.lock:
            self.counts[path] += 1
            if cancelled:
                self.cancelled[path] += 1
                return
            if not ok:
                self.errors[path] += 1
            self.lat[path].append(ms)

    def summary(self) -> dict:
        with self.lock:
            out = {}
            for p, n in self.counts.items():
                a = np.asarray(self.lat[p]) if self.lat[p] else np.zeros(1)
                out[p] = {
                    "requests": n,
                    "errors": self.errors[p],
                    "cancelled": self.cancelled[p],
                    "p50_ms": float(np.percentile(a, 50)),
                    "p90_ms": float(np.percentile(a, 90)),
                    "p99_ms": float(np.percentile(a, 99)),
                }
            return out


def error(status: int, msg: str) -> JSONResponse:
    return JSONResponse({"error": msg}, status_code=status)


def body_error(exc: Exception) -> str | None:
    """What was wrong with a body that FastAPI could not parse (its own message names no cause)."""
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        return "JSON nested too deeply"
    if isinstance(cause, UnicodeDecodeError):
        return "the body is not UTF-8"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "a number in the body has too many digits"
    return None


def public(scope) -> bool:
    """The page's own files (serve/page.py), which hold no data: served without the API key, so
    that the page can load and ask for it."""
    return scope["method"] in ("GET", "HEAD") and (scope["path"] == "/" or scope["path"].startswith("/static/"))


class Guard:
    """API key, content type and body size checks and per-path statistics, as a plain ASGI
    middleware: Starlette's BaseHTTPMiddleware runs every request in a task group of its own,
    and under load at 2.43B that wait was most of a count's p99 (serve_load_2b). A body is
    measured as it arrives too, so that one sent in chunks without a Content-Length is held to
    the same cap."""

    def __init__(self, app, cfg, stats: Stats):
        self.app, self.cfg, self.stats = app, cfg, stats

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t, cfg = time.perf_counter(), self.cfg
        h = Headers(scope=scope)
        if cfg.api_key and h.get("authorization") != f"Bearer {cfg.api_key}" and not public(scope):
            refused = error(401, "missing or wrong API key (Authorization: Bearer KEY)")
        elif scope["method"] == "POST" and not h.get("content-type", "").split(";")[0].strip() == "application/json":
            refused = error(415, "content type must be application/json")
        elif not h.get("content-length", "0").isdigit():
            refused = error(400, "Content-Length must be a number of bytes")
        elif int(h.get("content-length") or 0) > cfg.max_body_bytes:
            refused = error(413, f"request body over {cfg.max_body_bytes} bytes")
        else:
            refused = None
        status = [500]
        got = [0]

        async def measured():
            msg = await receive()
            got[0] += len(msg.get("body", b""))
            if got[0] > cfg.max_body_bytes:  # raised where the route reads its body: FastAPI passes it on as it is
                raise HTTPException(413, f"request body over {cfg.max_body_bytes} bytes")
            return msg

        async def sent(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await (refused or self.app)(scope, measured, sent)
        finally:
            self.stats.add(scope["path"], (time.perf_counter() - t) * 1e3, status[0] < 400, cancelled=status[0] == CLIENT_GONE)


class TooManyStreams(TeragramError):
    status = 429


class Streams:
    """Streams open at once per client address, within a cap: one client cannot hold every
    thread that produces streams while others wait."""

    def __init__(self):
        self.open: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()

    def take(self, client: str, cap: int):
        """Count a new stream of the client's, or refuse it (TooManyStreams, a 429): a function
        that gives the slot back, once however often it is called."""
        with self.lock:
            if self.open[client] >= cap:
                raise TooManyStreams(f"{cap} streams already open from {client}: wait for one to end")
            self.open[client] += 1
        done: list = []

        def release() -> None:
            with self.lock:
                if not done:
                    done.append(True)
                    self.open[client] -= 1
                    if not self.open[client]:
                        del self.open[client]

        return release


def released(stream, release):
    """The async iterator `stream`, calling release() when it ends or is closed, or when it is
    dropped unstarted (a client gone before the first chunk)."""

    async def items():
        try:
            async for x in stream:
                yield x
        finally:
            release()

    gen = items()
    weakref.finalize(gen, release)
    return gen


LOOPBACK = ("::1", "localhost")  # and 127.0.0.0/8


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse, in one line, to bind a public address without an API key: such a server would
    answer anyone who reaches it."""
    if host not in LOOPBACK and not host.startswith("127.") and not api_key:
        raise TeragramError(f"serving on {host} needs --api-key (or $TERAGRAM_API_KEY): a public bind without a key answers anyone")
