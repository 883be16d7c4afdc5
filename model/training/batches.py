"""Training batches on their way to the step: prepared ahead by a background thread, a share
of their index features blinded (index_dropout), moved to the device."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import torch
from teragram.index.features import Features
from teragram.model.gpt import blinded, to_device
from teragram.model.training.config import TrainConfig


class prefetch:
    """Batches (x, y, features) for steps start.. in order, one per micro-step, prepared by a
    background thread (a few ahead); wait_s: the seconds the trainer spent waiting for one. An
    error in the thread (a damaged shard) is raised by the next batch asked for, not left to hang.
    Used as a context manager: on leaving, the thread is stopped and joined, so that no thread is
    inside torch when the interpreter exits (which aborts the process)."""

    def __init__(self, data, cfg: TrainConfig, rank: int, start: int, pin: bool):
        self.q: queue.Queue = queue.Queue(maxsize=4)
        self.wait_s = 0.0
        self.stop = threading.Event()

        def put(item) -> bool:
            while not self.stop.is_set():
                try:
                    self.q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    pass
            return False

        def work():
            try:
                for step in range(start, cfg.max_steps):
                    for micro in range(cfg.grad_accum):
                        x, y, f = data.batch(step * cfg.grad_accum + micro, cfg.batch_size, seed=cfg.seed, rank=rank)
                        if pin:
                            x, y = x.pin_memory(), y.pin_memory()
                            f = None if f is None else f.map(lambda t: t.pin_memory())
                        if not put((x, y, f)):
                            return
            except BaseException as e:  # noqa: BLE001 (handed to the trainer's thread)
                put(e)

        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()

    def __enter__(self) -> prefetch:
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def __iter__(self) -> Iterator[tuple]:
        return self

    def __next__(self) -> tuple:
        t = time.perf_counter()
        b = self.q.get()
        self.wait_s += time.perf_counter() - t
        if isinstance(b, BaseException):
            raise b
        return b


def blind(f: Features, p: float, gen: torch.Generator) -> Features:
    """Features with a share p of the sequences set to "no match" (L = 0, nothing found): the
    model keeps learning to predict without the index (deterministic per step, for resume)."""
    m = torch.rand(f.length.shape[0], generator=gen) < p  # (B,)
    if not m.any():
        return f
    return blinded(f, m)


def on_device(x, device):
    """A tensor or a (torch) Features record to the device (None stays None)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    return to_device(x, device, non_blocking=True)
