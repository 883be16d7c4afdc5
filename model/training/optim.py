"""Optimizers for `teragram train`: plain AdamW, ZeRO-1 sharded AdamW under DDP, CPU offload
(model/training/offload.py) and Muon (model/training/muon.py), behind one constructor.

The AdamW variants save the same state dict layout (torch's AdamW layout: state keyed by the index of
the parameter in group order, groups "decay" then "no decay"), so a checkpoint written by one
resumes under another and on any number of ranks: ZeRO-1 consolidates its shards on rank 0
before a save and each rank takes its own shard of the full state on load.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class AdamW(torch.optim.AdamW):
    """torch's AdamW, with the second stage of 1-bit Adam (Tang et al. 2021): after
    freeze_variance() the step leaves the second moment v alone (the 1-bit hook, model/training/comm.py,
    replaces it now and then by the ranks' average of their own), and the "gradient" handed to
    step() is the new first moment m, which the hook computes on each rank from its own gradient,
    b1 m + (1 - b1) g, and averages compressed. Compressing the momentum rather than the gradient,
    and keeping v out of it (a second moment of sign-compressed values is one value per row), is
    what keeps Adam converging like uncompressed Adam. The update is AdamW's,
    p -= lr (wd p + (m / bc1) / (sqrt(v / bc2) + eps)), bc2 that of the step v was last set at,
    bounded by lr per element. The state dict is AdamW's, that step a key of each group."""

    @torch.no_grad()
    def step(self, closure=None):
        if not any("variance_frozen_at" in g for g in self.param_groups):
            return super().step(closure)
        for g in self.param_groups:
            b1 = g["betas"][0]
            bc2 = 1 - g["betas"][1] ** g["variance_frozen_at"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["step"] += 1
                st["exp_avg"].copy_(p.grad)
                p.mul_(1 - g["lr"] * g["weight_decay"])
                m = st["exp_avg"] / (1 - b1 ** float(st["step"]))
                # |update| <= lr per element, as Adam's is when v is current: an element that v has
                # not seen yet (an embedding row of a token new since the last average) must not jump
                p.addcdiv_(m, torch.maximum((st["exp_avg_sq"] / bc2).sqrt_().add_(g["eps"]), m.abs()), value=-g["lr"])


def freeze_variance(opt: AdamW) -> None:
    """From now on opt keeps its second moment and takes momenta for gradients (no-op when frozen)."""
    for g in opt.param_groups:
        steps = [float(opt.state[p]["step"]) for p in g["params"] if p in opt.state]
        if steps and "variance_frozen_at" not in g:
            g["variance_frozen_at"] = steps[0]


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
    sgd: bool = False,
):
    """The optimizer of a training run. zero1 needs an initialised process group; offload keeps
    fp32 masters and moments in CPU memory (build it before the model is cast to bf16); muon
    (neither zero1 nor offload) trains the blocks' matrices with Muon (model/training/muon.py); sgd is
    plain SGD."""
    if muon:
        from teragram.model.training.muon import MuonAdamW

        return MuonAdamW(model, lr=lr, muon_lr=muon_lr, momentum=muon_momentum, weight_decay=weight_decay, betas=betas, cuda=cuda)
    groups = adamw_groups(model, weight_decay)
    if sgd:  # plain SGD (weight decay as L2): linear in the gradient, so averaging its steps averages gradients
        return torch.optim.SGD(groups, lr=lr)
    if offload:
        from teragram.model.training.offload import CPUOffloadAdamW

        return CPUOffloadAdamW(model, groups, lr=lr, betas=betas, cuda=cuda)
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=lr, betas=betas, fused=cuda)
    return AdamW(groups, lr=lr, betas=betas, fused=cuda)


def full_state_dict(opt) -> dict | None:
    """The whole optimizer state on rank 0 (None on the other ranks). Collective under ZeRO-1:
    every rank must call it."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(opt, ZeroRedundancyOptimizer):
        opt.consolidate_state_dict(to=0)
        return opt.state_dict() if opt.global_rank == 0 else None
    return opt.state_dict()
