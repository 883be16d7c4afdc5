"""Low-precision linear layers for the transformer blocks: fp8 (torch._scaled_mm) and int8
(torch._int_mm). The weights stay in their training dtype (fp32 masters); each matmul quantises
its operands on the fly with dynamic scales, so the optimizer and checkpoints are unchanged.

fp8: per-tensor scales, e4m3 for every operand (activations, weights and output gradients: with
a fresh amax scale each call e4m3's range suffices at this size and every (e4m3, e4m3) product
is supported by the fp8 GEMMs); all three matmuls of a linear (forward, input gradient, weight
gradient) run in fp8. Needs a GPU of compute capability >= 8.9 (train refuses otherwise).

int8: per-token activation scales and per-output-channel weight scales, symmetric, forward
matmul in int8 with int32 accumulation; the backward is the straight-through estimator in the
autocast dtype (gradients of the float linear at the float operands), as in int8 training
recipes that quantise only the forward GEMM.
"""

from __future__ import annotations

import torch
import torch.nn as nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448


def to_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t in e4m3 with a per-tensor scale, and the scale that dequantises it (t ~ t8 * inv)."""
    amax = t.detach().abs().max().float().clamp_min(1e-12)
    scale = E4M3_MAX / amax
    return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale.reciprocal()


def _colmajor(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (what _scaled_mm wants as its second operand)."""
    return t.t().contiguous().t()


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # x (M, K), w (N, K) -> (M, N)
        x8, sx = to_fp8(x)
        w8, sw = to_fp8(w)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.dtypes = (x.dtype, w.dtype)
        return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x8, sx, w8, sw = ctx.saved_tensors
        g8, sg = to_fp8(g.contiguous())
        gx = torch._scaled_mm(g8, _colmajor(w8), scale_a=sg, scale_b=sw, out_dtype=ctx.dtypes[0])  # (M, K)
        gw = torch._scaled_mm(g8.t().contiguous(), _colmajor(x8), scale_a=sg, scale_b=sx, out_dtype=ctx.dtypes[1])  # (N, K)
        return gx, gw


def int8_quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of t (R, K) in int8 with one symmetric scale per row (R,): t ~ q * scale[:, None]."""
    scale = t.detach().abs().amax(dim=-1).float().clamp_min(1e-12) / 127.0
    return torch.round(t.detach().float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int8_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T with per-token / per-channel int8 quantisation, float32 result."""
    xq, sx = int8_quantize(x)
    wq, sw = int8_quantize(w)
    return torch._int_mm(xq, wq.t()).float() * sx[:, None] * sw[None, :]


class _Int8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return int8_matmul(x, w).to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        return g @ w.to(g.dtype), (g.t() @ x.to(g.dtype)).to(w.dtype)


class LowPrecisionLinear(nn.Linear):
    """nn.Linear whose matmul runs in fp8 or int8 (same parameters and state dict)."""

    kind = "fp8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        dt = torch.get_autocast_dtype("cuda") if x.is_cuda and torch.is_autocast_enabled("cuda") else x.dtype
        x2 = x.reshape(-1, shape[-1]).to(dt)  # (M, K)
        fn = _Fp8Matmul if self.kind == "fp8" else _Int8Matmul
        with torch.autocast(x.device.type, enabled=False):
            y = fn.apply(x2.contiguous(), self.weight)
        y = y.to(dt).reshape(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias.to(dt)


class Fp8Linear(LowPrecisionLinear):
    kind = "fp8"


class Int8Linear(LowPrecisionLinear):
    kind = "int8"


def convert(model: nn.Module, precision: str) -> int:
    """The transformer blocks' linear layers switched to fp8 or int8 in place ("bf16": none).
    The head, embeddings and gate stay in the autocast dtype. Returns how many were switched."""
    if precision == "bf16":
        return 0
    cls = {"fp8": Fp8Linear, "int8": Int8Linear}[precision]
    n = 0
    for m in model.transformer.h.modules():
        if type(m) is nn.Linear:
            m.__class__ = cls
            n += 1
    return n


def fp8_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
