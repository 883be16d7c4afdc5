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

# Peak bytes per token position while one shard's suffix array is built: the uint16 tokens,
# pydivsufsort's int32 array, the filtered copy, the packed words and slack.
SA_BYTES_PER_POSITION = 16


def sa_parallelism(workers: int, shard_tokens: int) -> int:
    """How many shards may be indexed at once without exceeding available memory."""
    avail = psutil.virtual_memory().available
    return max(1, min(workers, avail // max(1, SA_BYTES_PER_POSITION * shard_tokens)))


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
