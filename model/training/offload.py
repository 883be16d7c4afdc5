"""CPU offload of the optimizer: fp32 master weights, their gradients and the Adam moments live
in (pinned, on a CUDA machine) CPU memory and are updated there by torch's AdamW (fused CPU
kernel on a CUDA machine), so the GPU holds only the bf16 weights and gradients: 4 bytes per
parameter on the GPU instead of 16.

One step: the GPU gradients are copied into the CPU gradient buffers, the norm is clipped and
AdamW updates the masters on the CPU, and the masters are copied back (cast to the GPU dtype)
with non-blocking copies from pinned memory that the next forward waits for on the stream. The
CPU update is not overlapped with the next micro-batch's GPU work: that would need the next
forward to read weights one step stale (a different algorithm); the copies are the only overlap.
On a CPU-only machine the "device" weights are CPU tensors and the step is the plain AdamW step.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class CPUOffloadAdamW:
    """AdamW on CPU fp32 masters of the model's parameters. The groups are optim.adamw_groups's;
    state_dict() is torch's AdamW layout over them, interchangeable with the plain optimizer."""

    def __init__(self, model: nn.Module, groups: list[dict], *, lr: float, betas: tuple[float, float], cuda: bool):
        self.params = [p for g in groups for p in g["params"]]
        by_id = {id(p): n for n, p in model.named_parameters()}
        self.names = [by_id[id(p)] for p in self.params]
        self.masters: list[torch.Tensor] = []
        master_groups = []
        for g in groups:
            ms = []
            for p in g["params"]:
                m = torch.empty(p.shape, dtype=torch.float32, pin_memory=cuda)
                m.copy_(p.detach())
                m.grad = torch.zeros(m.shape, dtype=torch.float32, pin_memory=True) if cuda else None
                ms.append(m)
            self.masters += ms
            master_groups.append({**g, "params": ms})
        self.cuda = cuda
        self.inner = torch.optim.AdamW(master_groups, lr=lr, betas=betas, fused=cuda)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 weights by parameter name (what a checkpoint saves)."""
        return dict(zip(self.names, self.masters))

    def step(self, grad_clip: float = 0.0) -> None:
        live = []
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                m.grad = None  # as in torch's AdamW: a parameter without gradient is left alone
                continue
            if self.cuda:
                m.grad = m.grad if m.grad is not None else torch.zeros(m.shape, dtype=torch.float32, pin_memory=True)
                m.grad.copy_(p.grad, non_blocking=True)
            else:
                m.grad = p.grad.detach().to(torch.float32, copy=True)
            live.append(m)
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # the gradients have landed in CPU memory
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(live, grad_clip)
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m, non_blocking=self.cuda)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.inner.load_state_dict(sd)
