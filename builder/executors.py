"""Executors run the builder's per-shard work units (``finish_shard``) locally or on Ray.

Both take plain functions and picklable arguments, and return results in submission order,
so the index they produce is the same byte for byte.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from concurrent.futures import Future, ProcessPoolExecutor

import psutil

from .sa import sort_bytes

# Share of the memory available at the start that a build uses when --memory is not given.
DEFAULT_MEMORY_SHARE = 0.6


def default_memory_gb() -> float:
    return DEFAULT_MEMORY_SHARE * psutil.virtual_memory().available / 2**30


def tree_rss() -> int:
    """Resident bytes of this process and all its descendants."""
    me = psutil.Process()
    total = me.memory_info().rss
    for c in me.children(recursive=True):
        try:
            total += c.memory_info().rss
        except psutil.Error:
            pass
    return total


def sa_parallelism(workers: int, shard_tokens: int, itemsize: int, memory_bytes: int) -> int:
    """How many shards may be indexed at once, each in one part (sorted whole, then merged),
    within memory_bytes; 1 when even one shard needs parts."""
    per_shard = sort_bytes(shard_tokens, itemsize) + (400 << 20)  # plus a worker's own footprint
    return max(1, min(workers, memory_bytes // per_shard))


def die_with_parent() -> None:
    """Worker initializer: on Linux the worker is sent SIGKILL when the process that started it
    dies, so a build killed with SIGKILL leaves no orphaned workers behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)


class LocalExecutor:
    """Worker processes on this machine (inline when parallelism is 1)."""

    def __init__(self, parallelism: int):
        spawn = mp.get_context("spawn")
        self.pool = ProcessPoolExecutor(parallelism, mp_context=spawn, initializer=die_with_parent) if parallelism > 1 else None
        self.pending: list[Future | object] = []

    def submit(self, fn, *args) -> None:
        self.pending.append(self.pool.submit(fn, *args) if self.pool else fn(*args))

    def results(self) -> list:
        out = [f.result() if isinstance(f, Future) else f for f in self.pending]
        self.pending = []
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def make_executor(kind: str, parallelism: int, ray_address: str | None = None):
    if kind == "local":
        return LocalExecutor(parallelism)
    if kind == "ray":
        from .ray_executor import RayExecutor

        return RayExecutor(ray_address)
    raise ValueError(f"unknown executor {kind!r}")
