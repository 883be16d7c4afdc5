"""Muon (momentum orthogonalised by Newton-Schulz) for the blocks' weight matrices, with AdamW
for everything else (embeddings, the head, gains, the index inputs and the mixture gate).

Muon keeps an SGD momentum buffer per matrix and replaces the (Nesterov) update by an
approximation of its nearest semi-orthogonal matrix U V^T (G = U S V^T), computed by a few steps
of a quintic Newton-Schulz iteration whose coefficients push all singular values into roughly
[0.7, 1.2] quickly rather than exactly to 1 (the public speed-run recipe). A fused (3C, C)
query/key/value matrix is orthogonalised as three (C, C) blocks. The update is scaled by
sqrt(max(1, rows / cols)) so its RMS does not shrink for tall matrices.
"""

from __future__ import annotations

import torch
import torch.nn as nn

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic x -> a x + b x^3 + c x^5 on the singular values


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """An approximation of U V^T for g = U S V^T (2-D), in bf16 on CUDA and fp32 on CPU."""
    a, b, c = NS_COEFFS
    x = g.bfloat16() if g.is_cuda else g.float()
    x = x / (x.norm() + 1e-7)  # every singular value <= 1
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T  # iterate on the short side: (r, r) products with r = min(rows, cols)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return (x.T if tall else x).to(g.dtype)


class Muon(torch.optim.Optimizer):
    def __init__(self, params, *, lr: float, momentum: float = 0.95, ns_steps: int = 5, lr_scale: float = 1.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, ns_steps=ns_steps, lr_scale=lr_scale))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            mom = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.mul_(mom).add_(p.grad)
                u = p.grad.add(buf, alpha=mom)  # Nesterov
                rows, cols = u.shape
                blocks = u.split(cols) if rows == 3 * cols else (u,)
                o = torch.cat([orthogonalize(x, group["ns_steps"]) for x in blocks])
                r = blocks[0].shape[0]
                p.add_(o, alpha=-group["lr"] * max(1.0, r / cols) ** 0.5)


class MuonAdamW:
    """Muon for the 2-D matrices of the transformer blocks, AdamW for the other parameters."""

    def __init__(self, model: nn.Module, *, lr: float, muon_lr: float, momentum: float, weight_decay: float, betas, cuda: bool):
        hidden = {id(p) for n, p in model.named_parameters() if n.startswith("transformer.h.") and p.dim() == 2}
        params = [p for p in model.parameters() if p.requires_grad]
        self.muon = Muon([p for p in params if id(p) in hidden], lr=muon_lr, momentum=momentum, lr_scale=muon_lr / lr)
        rest = [p for p in params if id(p) not in hidden]
        groups = [
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.adamw = torch.optim.AdamW(groups, lr=lr, betas=betas, fused=cuda)

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.muon.load_state_dict(sd["muon"])
        self.adamw.load_state_dict(sd["adamw"])
