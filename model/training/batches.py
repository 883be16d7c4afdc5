"""Training batches on their way to the step: prepared ahead by a background thread, a share
of their index features blinded (index_dropout), moved to the device."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch
from teragram.index.features import Features
from teragram.model.gpt import blinded, to_device
from teragram.model.training.config import TrainConfig
from teragram.model.training.data import TrainData


def prefetch(data: TrainData, cfg: TrainConfig, rank: int, start: int, pin: bool) -> Iterator[tuple]:
    """Batches (x, y, features) for steps start.. in order, one per micro-step,
    prepared by a background thread (a few ahead)."""
    q: queue.Queue = queue.Queue(maxsize=4)

    def work():
        for step in range(start, cfg.max_steps):
            for micro in range(cfg.grad_accum):
                x, y, f = data.batch(step * cfg.grad_accum + micro, cfg.batch_size, seed=cfg.seed, rank=rank)
                if pin:
                    x, y = x.pin_memory(), y.pin_memory()
                    f = None if f is None else f.map(lambda t: t.pin_memory())
                q.put((x, y, f))

    threading.Thread(target=work, daemon=True).start()
    while True:
        yield q.get()


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
