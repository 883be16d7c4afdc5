"""Keys for the kNN-LM dense store: a model's final hidden states at training positions.

    teragram dense IDX --checkpoint RUN [--features FEATS] [--positions 1000000]

Positions are whole training windows drawn like training batches (a documented sample, not
all positions); the value of each key is the token that followed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from teragram.model.gpt import GPT, to_device
from teragram.model.training.data import TrainData


@torch.no_grad()
def collect(
    model: GPT,
    index_dir: str | Path,
    features_dir: str | Path | None,
    n_positions: int,
    *,
    batch: int = 16,
    seed: int = 12345,
    device: str = "cpu",
):
    """(keys (n, C) float32, values (n,) int64) from windows of the training data."""
    data = TrainData(index_dir, features_dir if model.cfg.use_index else None, model.cfg.block_size)
    model.eval()
    keys, vals = [], []
    n = 0
    step = 0
    cuda = str(device).startswith("cuda")
    while n < n_positions:
        x, y, f = data.batch(step, batch, seed=seed)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            h, _ = model.hidden(x.to(device), None if f is None else to_device(f, device))
        keys.append(h.float().reshape(-1, h.shape[-1]).cpu().numpy())
        vals.append(y.reshape(-1).numpy())
        n += y.numel()
        step += 1
    return np.concatenate(keys)[:n_positions], np.concatenate(vals)[:n_positions]


def build_store(
    index_dir: str | Path,
    checkpoint: str | Path,
    *,
    features_dir=None,
    n_positions: int = 1_000_000,
    device: str = "cpu",
    out: str | Path | None = None,
) -> dict:
    from teragram.index import dense
    from teragram.model.checkpoint import load_model

    model, meta = load_model(checkpoint, device)
    keys, vals = collect(model, index_dir, features_dir, n_positions, device=device)
    return dense.build(out or Path(index_dir) / "dense", keys, vals, meta={"checkpoint": str(checkpoint), "step": meta.get("step")})
