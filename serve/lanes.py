"""The server's lanes: a pool of worker threads per kind of request, so that a cheap query never
waits for a thread behind expensive ones (serve/app.py). A request waiting for its lane holds no
thread; a stream is produced in one thread of its lane. A request whose client goes away stops:
a stream at its next item, a query at its index's next check (unless_gone, index/cancel.py)."""

from __future__ import annotations

import asyncio
import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

from teragram.index.cancel import cancellable, check_cancelled

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


async def unless_gone(receive, lane: ThreadPoolExecutor, fn, *args):
    """fn(*args) in a thread of the lane, stopped when the client goes away first: its event is
    set and the work raises Cancelled at its next check_cancelled() (index/cancel.py), in the
    index's loops over shards or while it waits for its lane or the model's lock, so the thread
    is free for the next request. receive: the request's ASGI receive, its body already read;
    what it gives next is the client's http.disconnect."""
    gone = threading.Event()

    def run():
        with cancellable(gone):
            check_cancelled()  # gone while waiting for the lane
            return fn(*args)

    work = asyncio.get_running_loop().run_in_executor(lane, run)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        if watch.done() and watch.exception() is None:  # (an error of receive's is no disconnect)
            gone.set()
        return await work
    finally:
        watch.cancel()
        gone.set()  # (stops the work too where this request is itself cancelled: the server stopping)


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


LOCK_CHECK_S = 0.05  # how often a request waiting for a lock looks whether its client has gone


def acquire(lock: threading.Lock) -> None:
    """Take the lock, or raise Cancelled while waiting for it if the request is cancelled."""
    while not lock.acquire(timeout=LOCK_CHECK_S):
        check_cancelled()


@contextmanager
def holding(lock: threading.Lock):
    """The lock held for a block, its wait cancellable (acquire)."""
    acquire(lock)
    try:
        yield
    finally:
        lock.release()


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
