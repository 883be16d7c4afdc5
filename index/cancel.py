"""Cooperative cancellation of a query: a server stops the work of a client that has gone.

    ev = threading.Event()
    with cancellable(ev):          # in the thread that runs the query
        idx.docs(ids, max=10)      # raises Cancelled at its next check once ev is set

A query's loops over shards (and its other long Python loops) call check_cancelled(); it raises
Cancelled when the event of the innermost cancellable() of the current thread (or context) is
set, and does nothing else: with no cancellable() around it, it reads one context variable. The
compiled kernels are never interrupted: one call of them is short (a shard's search), and a
query is stopped between them. Threads a query hands work to do not inherit the context (a
ThreadPoolExecutor does not copy it): what runs there is checked by the thread that hands it on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from .errors import Cancelled

_event: ContextVar[threading.Event | None] = ContextVar("teragram_cancel", default=None)


@contextmanager
def cancellable(event: threading.Event) -> Iterator[threading.Event]:
    """Queries run inside stop at their next check_cancelled() once `event` is set (from any thread)."""
    token = _event.set(event)
    try:
        yield event
    finally:
        _event.reset(token)


def check_cancelled() -> None:
    """Raise Cancelled if the current cancellable()'s event is set; nothing otherwise."""
    ev = _event.get()
    if ev is not None and ev.is_set():
        raise Cancelled("the query was cancelled")
