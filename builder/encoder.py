"""The build's tokenizer workers: batches of texts encoded in input order, with a bounded
number of batches in flight, in a local process pool or as Ray tasks."""

from __future__ import annotations

import multiprocessing as mp
from collections import deque
from collections.abc import Iterator

import numpy as np

from .executors import die_with_parent

_TOK = None  # the worker's tokenizer, set by _init_worker from the file's bytes it is given


def _init_worker(model: bytes, threads: bool = False) -> None:
    """Load the tokenizer (sentencepiece or Hugging Face: index/tokenizer.py) in this worker.
    threads: whether a Hugging Face tokenizer may encode a batch on threads of its own (the
    build's one process does; a pool of worker processes, one core each, does not)."""
    global _TOK
    import os

    from teragram.index.tokenizer import Tokenizer

    die_with_parent()
    if not threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOK = Tokenizer(model)


def _encode(texts: list[str]) -> list[np.ndarray]:
    return _TOK.encode_batch(texts)  # type: ignore[union-attr]


def _encode_with(model: bytes, texts: list[str]) -> list[np.ndarray]:
    """A Ray task: encode with the given tokenizer file's bytes (loaded once per worker process)."""
    global _TOK_MODEL
    if _TOK is None or _TOK_MODEL != model:
        _init_worker(model)
        _TOK_MODEL = model
    return _encode(texts)


_TOK_MODEL: bytes | None = None


class Encoder:
    """Encodes batches of texts in order with a bounded number of batches in flight, in a
    local process pool or as Ray tasks."""

    def __init__(self, model: bytes, workers: int, ray: bool = False):
        self.workers = workers
        self.pool = None
        self.ray = None
        if ray:
            import ray as ray_mod

            self.ray = ray_mod
            self.model_ref = ray_mod.put(model)
            self.task = ray_mod.remote(max_retries=3)(_encode_with)
        elif workers > 1:
            self.pool = mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(model,))
        else:
            _init_worker(model, threads=True)

    def _submit(self, texts: list[str]):
        if self.ray is not None:
            return self.task.remote(self.model_ref, texts)
        return self.pool.apply_async(_encode, (texts,))

    def _get(self, r):
        return self.ray.get(r) if self.ray is not None else r.get()

    def map(self, batches: Iterator[tuple[object, list[str]]]) -> Iterator[tuple[object, list[np.ndarray]]]:
        if self.pool is None and self.ray is None:
            for tag, texts in batches:
                yield tag, _encode(texts)
            return
        window: deque = deque()
        for tag, texts in batches:
            window.append((tag, self._submit(texts)))
            if len(window) >= 4 * self.workers:
                t, r = window.popleft()
                yield t, self._get(r)
        while window:
            t, r = window.popleft()
            yield t, self._get(r)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None
