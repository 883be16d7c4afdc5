"""Optimizers for `teragram train`: plain AdamW, ZeRO-1 sharded AdamW under DDP, CPU offload
(model/offload.py) and Muon (model/muon.py), behind one constructor.

The AdamW variants save the same state dict layout (torch's AdamW layout: state keyed by the index of
the parameter in group order, groups "decay" then "no decay"), so a checkpoint written by one
resumes under another and on any number of ranks: ZeRO-1 consolidates its shards on rank 0
before a save and each rank takes its own shard of the full state on load.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def adamw_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (>= 2 dims) decay; gains and biases do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    cuda: bool,
    zero1: bool = False,
    offload: bool = False,
    muon: bool = False,
    muon_lr: float = 0.02,
    muon_momentum: float = 0.95,
):
    """The optimizer of a training run. zero1 needs an initialised process group; offload keeps
    fp32 masters and moments in CPU memory (build it before the model is cast to bf16); muon
    (neither zero1 nor offload) trains the blocks' matrices with Muon (model/muon.py)."""
    if muon:
        from .muon import MuonAdamW

        return MuonAdamW(model, lr=lr, muon_lr=muon_lr, momentum=muon_momentum, weight_decay=weight_decay, betas=betas, cuda=cuda)
    groups = adamw_groups(model, weight_decay)
    if offload:
        from .offload import CPUOffloadAdamW

        return CPUOffloadAdamW(model, groups, lr=lr, betas=betas, cuda=cuda)
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=lr, betas=betas, fused=cuda)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=cuda)


def full_state_dict(opt) -> dict | None:
    """The whole optimizer state on rank 0 (None on the other ranks). Collective under ZeRO-1:
    every rank must call it."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(opt, ZeroRedundancyOptimizer):
        opt.consolidate_state_dict(to=0)
        return opt.state_dict() if opt.global_rank == 0 else None
    return opt.state_dict()
