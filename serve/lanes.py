"""The server's lanes: a pool of worker threads per kind of request, so that a cheap query never
waits for a thread behind expensive ones (serve/app.py). A request waiting for its lane holds no
thread; a stream is produced in one thread of its lane."""

from __future__ import annotations

import asyncio
import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

QUERY_TYPES = ("count", "prob", "ntd", "infgram_prob", "infgram_ntd", "search_docs")  # infini-gram's API
SEARCH_QUERIES = ("count", "prob", "infgram_prob")  # binary searches only: the fast lane


def _pool(n: int, name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(n, thread_name_prefix=name)


@dataclass
class Lanes:
    """A pool of worker threads per kind of request; a request waits in its pool's queue."""

    search: ThreadPoolExecutor = field(default_factory=lambda: _pool(8, "search"))
    enumerate: ThreadPoolExecutor = field(default_factory=lambda: _pool(4, "enumerate"))
    model: ThreadPoolExecutor = field(default_factory=lambda: _pool(4, "model"))
    stream: ThreadPoolExecutor = field(default_factory=lambda: _pool(2, "stream"))  # streams from the model's process


async def in_lane(lane: ThreadPoolExecutor, fn, *args):
    """fn(*args) in a thread of the lane."""
    return await asyncio.get_running_loop().run_in_executor(lane, partial(fn, *args))


async def produced(make, lane: ThreadPoolExecutor):
    """The items of the generator make() as they come, produced in one thread of the lane: a
    stream holds one thread from its first item to its last, and stops producing when its
    client goes away."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()
    gone = threading.Event()
    end = object()

    def produce() -> None:
        gen = make()
        try:
            for x in gen:
                loop.call_soon_threadsafe(items.put_nowait, x)
                if gone.is_set():
                    break
            loop.call_soon_threadsafe(items.put_nowait, end)
        except Exception as e:  # noqa: BLE001  (raised again where the stream is read)
            loop.call_soon_threadsafe(items.put_nowait, e)
        finally:
            gen.close()  # its model lock released now, not when collected

    task = loop.run_in_executor(lane, produce)
    try:
        while (x := await items.get()) is not end:
            if isinstance(x, Exception):
                raise x
            yield x
    finally:
        gone.set()
        await asyncio.shield(task)


def settle() -> None:
    """Keep what a server process has loaded by now (the index's objects, the tokenizer, the
    libraries: torch's modules alone are hundreds of thousands of objects) out of the garbage
    collector's full passes, which walked all of it and stalled every request of the process for
    tens of milliseconds (a count's p99 for a client of its own at 2.43B tokens under 64 clients:
    88-115 ms, 47-49 ms with it; docs/research/2026-12-07-results-history.md)."""
    gc.collect()
    gc.freeze()
