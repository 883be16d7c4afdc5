"""What several test modules of tests/model share: the tiny training settings and the runs on
conftest's dup_setup and data_root, and random index features."""

import json
from pathlib import Path

import torch
from teragram.index.features import Features
from teragram.model.training.train import TrainConfig

REPO = Path(__file__).resolve().parents[2]
TINY = dict(preset="tiny", block_size=64, batch_size=8, log_every=1, progress=False, warmup=5, lr=3e-3, min_lr=3e-4)
SMALL = TINY | {"block_size": 32, "batch_size": 4}


def rand_feats(B, T, V, k, g) -> Features:
    """Random index features (B, T) over a vocabulary of V with top-k lists of k."""
    length = torch.randint(0, 10, (B, T), generator=g)
    cont = torch.randint(-1, V, (B, T), generator=g)
    ids = torch.randint(-1, V, (B, T, k), generator=g)
    cnt = torch.randint(0, 50, (B, T, k), generator=g) * (ids >= 0)
    count = cnt.sum(-1) + torch.randint(0, 5, (B, T), generator=g)
    return Features(length, cont, count, ids, cnt)


def dup_config(root, name, **kw) -> TrainConfig:
    """A tiny training run on dup_setup's index, features and held-out features (kw: overrides)."""
    base = TINY | {"index": str(root / "idx"), "features": str(root / "feats"), "heldout": str(root / "held"), "out": str(root / name)}
    return TrainConfig(**(base | kw))


def small_config(root, name, **kw) -> TrainConfig:
    """A small resumable training run on data_root's index and features (kw: overrides)."""
    base = SMALL | {"index": str(root / "idx"), "features": str(root / "feats"), "out": str(root / name), "resume": True}
    return TrainConfig(**(base | kw))


def logged_losses(root, name) -> dict[int, float]:
    """step -> training loss, from run `name`'s log."""
    rows = map(json.loads, (root / name / "log.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
