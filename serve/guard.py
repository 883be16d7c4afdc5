"""The server's request statistics and its guard: API key, content type and body size checks,
and each path's latency, as a plain ASGI middleware."""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

import numpy as np
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers


class Stats:
    """Requests, errors and latencies (the last 10,000) per path."""

    def __init__(self):
        self.start = time.time()
        self.counts: dict[str, int] = defaultdict(int)
        self.errors: dict[str, int] = defaultdict(int)
        self.lat: dict[str, deque] = defaultdict(lambda: deque(maxlen=10000))
        self.lock = threading.Lock()

    def add(self, path: str, ms: float, ok: bool) -> None:
        with self.lock:
            self.counts[path] += 1
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
                    "p50_ms": float(np.percentile(a, 50)),
                    "p90_ms": float(np.percentile(a, 90)),
                    "p99_ms": float(np.percentile(a, 99)),
                }
            return out


def error(status: int, msg: str) -> JSONResponse:
    return JSONResponse({"error": msg}, status_code=status)


class Guard:
    """API key, content type and body size checks and per-path statistics, as a plain ASGI
    middleware: Starlette's BaseHTTPMiddleware runs every request in a task group of its own,
    and under load at 2.43B that wait was most of a count's p99 (serve_load_2b)."""

    def __init__(self, app, cfg, stats: Stats):
        self.app, self.cfg, self.stats = app, cfg, stats

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t, cfg = time.perf_counter(), self.cfg
        h = Headers(scope=scope)
        if cfg.api_key and h.get("authorization") != f"Bearer {cfg.api_key}":
            refused = error(401, "missing or wrong API key (Authorization: Bearer KEY)")
        elif scope["method"] == "POST" and not h.get("content-type", "").split(";")[0].strip() == "application/json":
            refused = error(415, "content type must be application/json")
        elif int(h.get("content-length") or 0) > cfg.max_body_bytes:
            refused = error(413, f"request body over {cfg.max_body_bytes} bytes")
        else:
            refused = None
        status = [500]

        async def sent(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await (refused or self.app)(scope, receive, sent)
        finally:
            self.stats.add(scope["path"], (time.perf_counter() - t) * 1e3, status[0] < 400)


LOOPBACK = ("::1", "localhost")  # and 127.0.0.0/8


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse, in one line, to bind a public address without an API key: such a server would
    answer anyone who reaches it."""
    from teragram.index.errors import TeragramError

    if host not in LOOPBACK and not host.startswith("127.") and not api_key:
        raise TeragramError(f"serving on {host} needs --api-key (or $TERAGRAM_API_KEY): a public bind without a key answers anyone")
