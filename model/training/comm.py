"""Data-parallel communication for `teragram train` on ordinary networks (torch.distributed: NCCL on
GPUs, gloo on CPU).

compress = "1bit" (OneBit): a DDP communication hook that sends one sign bit per element and
one fp32 scale per row of each matrix (per chunk of a vector), with error feedback, in the
two-phase compressed all-reduce of 1-bit Adam (Tang et al. 2021) / TScale:
  1. each rank adds its residual to its values, cuts every parameter of the bucket by rows into
     W chunks (chunk r belongs to rank r), quantises each row to scale * sign (scale = mean |x|
     over the row, which keeps its L1 norm) and keeps what the quantisation lost as its
     residual; an all-to-all of the packed bits sends chunk r to rank r;
  2. rank r averages the W decoded chunks it received, adds its own (server) residual,
     quantises the average the same way and keeps that residual; an all-gather of the packed
     bits gives every rank the whole average.
What is compressed: with SGD the gradient; with AdamW (after compress_after steps whose
gradients are all-reduced in bf16) the momentum, as 1-bit Adam does: each rank forms
b1 m + (1 - b1) g from its own gradient and the compressed average becomes everyone's m.
AdamW's step leaves its second moment v alone (optim.AdamW); each rank keeps its own v from its
own gradient, and every variance_every steps the ranks' v are averaged (a bf16 all-reduce) into
AdamW's, so that all ranks divide by the same v; an update moves no element by more than lr.
Measured on the way (tiny model): compressed gradients into Adam lose (200 steps: loss 4.28 vs
DDP's 3.50; a second moment of sign-compressed values is one value per row, and Adam's
per-element scaling amplifies the sign noise of small gradients); momenta with a v frozen once
lag and then diverge (1,500 steps: 4.24 vs 4.07 at step 500, NaN at the end: an embedding row
first seen after the freeze has v = 0).
A rank sends 2 (W-1)/W * n/8 bytes (+ scales) per n elements, 1/32 of the ring all-reduce's
2 (W-1)/W * 4n for fp32 gradients, on any number of ranks (the scales add 4 bytes per row:
1/25.6 with 128-wide rows, 1/30.7 with 768). Chunks are cut per parameter, so the arithmetic
does not depend on how DDP groups parameters into buckets (it regroups them after the first
step): a run resumed from a checkpoint, residuals included, continues exactly.

sync = "local" (LocalSGD): DiLoCo (Douillard et al. 2023): every worker takes H inner steps
with its own optimizer on its own data, then the workers average their parameter deltas from
the last exchange (the pseudo-gradient), each weighted by the inner steps it took, and apply an
outer SGD step with Nesterov momentum to the shared weights. Workers of different speeds
(straggler = "deadline"): a round ends for a worker after H inner steps or when it has run
(1 + slack) times as long as the fastest worker needs for H steps (measured in the previous
round), whichever is first, and the outer step uses whatever each worker did. A fast worker so
waits at most slack * H of its own steps plus one of the slow worker's per round (the first
round has no measurement and waits). straggler = "wait": every worker takes all H steps
(deterministic; exact resume). The deltas travel in fp32 or bf16 (outer_dtype: half the
bytes), and the outer lr may ramp linearly over the run's rounds (outer_lr_end; set from the
round's index, so a resumed run ramps the same).

Bytes a rank sends are counted from the buffers each collective moves, under the ring
algorithms (all-reduce 2 (W-1)/W of the buffer, all-to-all and all-gather (W-1)/W of what the
rank contributes), for every mode; link_gbps > 0 simulates a slow link by sleeping
bytes / bandwidth after each collective (communication then does not overlap compute).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

# ---- bit packing ----------------------------------------------------------------------------------


def _bits(device) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack(positive: torch.Tensor) -> torch.Tensor:
    """(..., 8k) bool -> (..., k) uint8, element i of each byte in bit i."""
    return (positive.view(*positive.shape[:-1], -1, 8).to(torch.uint8) * _bits(positive.device)).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """(..., k) uint8 -> (..., 8k) bool."""
    return (packed.unsqueeze(-1) & _bits(packed.device)).ne(0).view(*packed.shape[:-1], -1)


class Link:
    """Bytes this rank has sent, and an optional simulated bandwidth (bits/s) that each
    collective's bytes wait for."""

    def __init__(self, world: int, gbps: float = 0.0):
        self.world, self.gbps, self.sent = world, gbps, 0

    def send(self, nbytes: float) -> None:
        self.sent += int(nbytes)
        if self.gbps > 0:
            time.sleep(nbytes * 8 / (self.gbps * 1e9))

    def allreduce_bytes(self, t: torch.Tensor) -> float:
        return 2 * (self.world - 1) / self.world * t.numel() * t.element_size()


def counted_allreduce(link: Link, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP's own all-reduce (gradient / world, summed), with its bytes counted."""
    fut = default_hooks.allreduce_hook(None, bucket)
    link.send(link.allreduce_bytes(bucket.buffer()))
    return fut


# ---- 1-bit compressed all-reduce --------------------------------------------------------------------


class _Layout:
    """How one DDP bucket's flat gradient maps onto a (W, C) matrix whose row r holds chunk r of
    every parameter, and the residuals of the bucket's elements (`worker` in bucket order,
    `server` for this rank's chunks, row r). A matrix is cut by rows (rank r gets rows
    [r k, (r+1) k), k = ceil(rows / W)) and each row has its own scale, so a row whose gradient
    is zero (an embedding row of a token not in the batch) is sent as exact zeros; a vector is one
    row (rank 0's). Each chunk is padded to a multiple of 8 columns. seg maps a column to its
    segment (a row of a chunk); count (W, S) is the number of elements of each segment."""

    def __init__(self, names: list[str], shapes: list[tuple[int, ...]], world: int, rank: int, device):
        self.names, self.numels = names, [math.prod(s) for s in shapes]
        caps, idx, seg, count = [], [], [], []
        off = nseg = 0
        for n, shape in zip(self.numels, shapes):
            rows = shape[0] if len(shape) >= 2 else 1
            D, k = n // rows, math.ceil(rows / world)
            cap = 8 * math.ceil(k * D / 8)
            j = torch.arange(n, device=device)
            i = j // D
            idx.append((i // k, off + (i % k) * D + j % D))  # (rank, column)
            col = torch.arange(cap, device=device)
            seg.append(nseg + torch.clamp(col // D, max=k - 1))
            count.append([[D if r * k + m < rows else 0 for m in range(k)] for r in range(world)])
            caps.append(cap)
            off += cap
            nseg += k
        self.caps, self.C = caps, off
        self.offs = [sum(caps[:i]) for i in range(len(caps))]
        self.idx = torch.cat([r * self.C + c for r, c in idx])  # bucket position -> position in the flattened (W, C)
        self.seg = torch.cat(seg)
        valid = torch.zeros(world * self.C, dtype=torch.bool, device=device)
        valid[self.idx] = True
        self.valid = valid.view(world, self.C)
        cnt = torch.tensor([sum((c[r] for c in count), []) for r in range(world)], device=device)
        self.count = cnt.float().clamp(min=1)  # (W, S)
        self.worker = torch.zeros(sum(self.numels), device=device)
        self.vlocal = torch.zeros(sum(self.numels), device=device)  # this rank's own second moment (AdamW)
        self.server = torch.zeros(self.C, device=device)
        self.rank = rank

    def server_slice(self, p: int) -> torch.Tensor:
        return self.server[self.offs[p] : self.offs[p] + self.caps[p]]

    def worker_slices(self) -> list[torch.Tensor]:
        return list(torch.split(self.worker, self.numels))

    def vlocal_slices(self) -> list[torch.Tensor]:
        return list(torch.split(self.vlocal, self.numels))


def _quantise(
    x: torch.Tensor, seg: torch.Tensor, count: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., C) -> (signs, scales (..., P), decoded (..., C)): per segment scale = mean |x|."""
    scale = torch.zeros(*x.shape[:-1], count.shape[-1], device=x.device).index_add_(-1, seg, x.abs() * valid) / count
    pos = x >= 0
    s = scale[..., seg]
    return pos, scale, torch.where(pos, s, -s) * valid


def _decode(bits: torch.Tensor, scales: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    s = scales[..., seg]
    return torch.where(unpack(bits), s, -s)


class OneBit:
    """The 1-bit hook's state: the residuals (error feedback) and the bytes sent. Register with
    ddp.register_comm_hook(state, OneBit.hook)."""

    def __init__(self, model: nn.Module, link: Link):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.names = {p.data_ptr(): n for n, p in model.named_parameters()}
        self.link = link
        self.layouts: dict[tuple[str, ...], _Layout] = {}
        self.worker: dict[str, torch.Tensor] = {}  # name -> view of this rank's residual
        self.server: dict[str, torch.Tensor] = {}  # name -> view of the residual of this rank's chunk
        self.active = False  # False: a bf16 all-reduce (the warm-up that the optimizer's variance needs)
        self.momentum: tuple[float, dict[str, torch.Tensor]] | None = None  # (b1, name -> AdamW's m): send momenta
        self.variance: tuple[float, dict[str, torch.Tensor]] | None = None  # (b2, name -> AdamW's v)
        self.vlocal: dict[str, torch.Tensor] = {}  # name -> view of this rank's own second moment

    def start(self, model: nn.Module, opt) -> None:
        """Compress from now on. With AdamW (optim.AdamW): its step stops updating v (each rank
        tracks its own, averaged in by sync_variance) and the hook sends the momentum
        b1 m + (1 - b1) g instead of the gradient (1-bit Adam); with SGD the gradient."""
        from teragram.model.training.optim import AdamW, freeze_variance

        self.active = True
        if isinstance(opt, AdamW):
            freeze_variance(opt)
            b1 = opt.param_groups[0]["betas"][0]
            self.momentum = (b1, {n: opt.state[p]["exp_avg"] for n, p in model.named_parameters() if p in opt.state})
            b2 = opt.param_groups[0]["betas"][1]
            self.variance = (b2, {n: opt.state[p]["exp_avg_sq"] for n, p in model.named_parameters() if p in opt.state})

    def sync_variance(self, opt) -> None:
        """AdamW's second moment := the mean of the ranks' own (collective; one bf16 all-reduce)."""
        names = sorted(self.vlocal)
        flat = torch.cat([self.vlocal[n].reshape(-1) for n in names]).to(torch.bfloat16)
        dist.all_reduce(flat)
        self.link.send(self.link.allreduce_bytes(flat))
        for n, v in zip(names, torch.split(flat.float() / self.world, [self.vlocal[n].numel() for n in names])):
            self.variance[1][n].copy_(v.view_as(self.variance[1][n]))
        for g in opt.param_groups:
            steps = [float(opt.state[p]["step"]) for p in g["params"] if p in opt.state]
            g["variance_frozen_at"] = steps[0]  # its bias correction

    def _layout(self, bucket) -> _Layout:
        params = bucket.parameters()
        key = tuple(self.names[p.data_ptr()] for p in params)
        L = self.layouts.get(key)
        if L is None:  # a new bucket (DDP regroups once after the first step): carry the residuals over
            buf = bucket.buffer()
            L = _Layout(list(key), [tuple(p.shape) for p in params], self.world, self.rank, buf.device)
            for i, (name, w, v) in enumerate(zip(key, L.worker_slices(), L.vlocal_slices())):
                if name in self.worker:
                    w.copy_(self.worker[name].reshape(-1))
                self.worker[name] = w
                if name in self.vlocal:
                    v.copy_(self.vlocal[name].reshape(-1))
                elif self.variance is not None:
                    v.copy_(self.variance[1][name].reshape(-1))
                self.vlocal[name] = v
                s = L.server_slice(i)
                if name in self.server:
                    s.copy_(self.server[name])
                self.server[name] = s
            self.layouts[key] = L
        return L

    @staticmethod
    def hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
        self, buf = state, bucket.buffer()
        if not self.active:  # the warm-up: DDP's all-reduce in bf16 (torch's hook), half the bytes
            fut = default_hooks.bf16_compress_hook(None, bucket)
            self.link.send(self.link.allreduce_bytes(buf) / buf.element_size() * 2)
            return fut
        L, W, r = state._layout(bucket), state.world, state.rank
        g = buf.float()
        if self.variance is not None:  # this rank's second moment from its own gradient
            L.vlocal.mul_(self.variance[0]).addcmul_(g, g, value=1 - self.variance[0])
        if self.momentum is not None:  # this rank's momentum from its own gradient
            b1, m = self.momentum
            g = torch.cat([m[n].reshape(-1) for n in L.names]).float().lerp_(g, 1 - b1)
        g += L.worker
        G = torch.zeros(W * L.C, device=buf.device)
        G[L.idx] = g
        G = G.view(W, L.C)
        pos, scale, q = _quantise(G, L.seg, L.count, L.valid)
        L.worker.copy_(g - q.view(-1)[L.idx])
        send = torch.cat([pack(pos), scale.view(torch.uint8)], 1).contiguous()  # row r goes to rank r
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        self.link.send(send.numel() * (W - 1) / W)
        c8 = L.C // 8
        avg = _decode(recv[:, :c8], recv[:, c8:].contiguous().view(torch.float32), L.seg).mean(0)
        v = avg * L.valid[r] + L.server
        pos2, scale2, q2 = _quantise(v, L.seg, L.count[r], L.valid[r])
        L.server.copy_(v - q2)
        send2 = torch.cat([pack(pos2), scale2.view(torch.uint8)]).contiguous()
        out = torch.empty(W * send2.numel(), dtype=torch.uint8, device=buf.device)  # flat: gloo wants (W n,)
        dist.all_gather_into_tensor(out, send2)
        out = out.view(W, -1)
        self.link.send(send2.numel() * (W - 1))
        full = _decode(out[:, :c8], out[:, c8:].contiguous().view(torch.float32), L.seg)
        buf.copy_(full.view(-1)[L.idx])
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut

    # -- checkpoints: collective; rank 0 gets the state of every rank --
    def state_dict(self) -> dict | None:
        mine = {
            "worker": {n: t.detach().cpu().clone() for n, t in self.worker.items()},
            "server": {n: t.detach().cpu().clone() for n, t in self.server.items()},
            "vlocal": {n: t.detach().cpu().clone() for n, t in self.vlocal.items()},
        }
        every = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        if self.rank != 0:
            return None
        return {"world": self.world, "ranks": every}

    def load_state_dict(self, sd: dict) -> bool:
        """Take this rank's residuals (False, and nothing taken, when the world size differs)."""
        if sd["world"] != self.world:
            return False
        dev = next(iter(self.layouts.values())).worker.device if self.layouts else None
        mine = sd["ranks"][self.rank]
        self.worker = {n: t.to(dev) if dev else t for n, t in mine["worker"].items()}
        self.server = {n: t.to(dev) if dev else t for n, t in mine["server"].items()}
        self.vlocal = {n: t.to(dev) if dev else t for n, t in mine.get("vlocal", {}).items()}
        return True


# ---- local SGD (DiLoCo) --------------------------------------------------------------------------------


class LocalSGD:
    """The shared weights, the outer Nesterov SGD over them and the round's timing. exchange()
    is collective: every worker calls it at the end of each round."""

    def __init__(
        self,
        model: nn.Module,
        *,
        every: int,
        lr: float,
        momentum: float,
        straggler: str,
        slack: float,
        link: Link,
        dtype: torch.dtype = torch.float32,
        lr_end: float | None = None,
        rounds: int = 1,
    ):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.dtype = dtype  # of the deltas on the wire
        self.lr, self.lr_end, self.rounds = lr, lr_end, rounds  # the outer lr ramps linearly to lr_end over the rounds
        with torch.no_grad():  # every worker starts from rank 0's weights (as DDP does)
            for p in self.params:
                dist.broadcast(p, 0)
        self.shared = [nn.Parameter(p.detach().clone().float(), requires_grad=False) for p in self.params]
        self.outer = torch.optim.SGD(self.shared, lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.every, self.straggler, self.slack, self.link = every, straggler, slack, link
        self.world = dist.get_world_size()
        self.budget = math.inf  # the first round has no measurement
        self.restart()

    def skip(self) -> bool:
        """Whether this worker's round is out of time (straggler = deadline): skip the inner step."""
        return self.straggler == "deadline" and self.done > 0 and time.time() > self.deadline

    def exchange(self, round_index: int = 0) -> list[int]:
        """Average the workers' deltas, each weighted by the inner steps it took (a worker cut
        short by the deadline counts for what it did), take the outer step (round round_index of
        the run's rounds: where the ramp of the outer lr stands), start the next round.
        Returns the inner steps each worker took in the round that ends."""
        took = self.done
        per_step = (time.time() - self.round_start) / max(1, took)
        dev = "cpu" if dist.get_backend() == "gloo" else self.shared[0].device  # gloo gathers CUDA tensors only through the host
        stats = torch.tensor([took, per_step], dtype=torch.float64, device=dev)
        every = [torch.zeros_like(stats) for _ in range(self.world)]
        dist.all_gather(every, stats)
        self.link.send(stats.numel() * 8 * (self.world - 1))
        took_all = [int(t[0]) for t in every]
        flat = torch.cat([(s - p.detach().float()).reshape(-1) for s, p in zip(self.shared, self.params)])
        flat *= took / sum(took_all)
        flat = flat.to(self.dtype)
        dist.all_reduce(flat)
        self.link.send(self.link.allreduce_bytes(flat))
        for s, d in zip(self.shared, torch.split(flat.float(), [s.numel() for s in self.shared])):
            s.grad = d.view_as(s)
        if self.lr_end is not None:
            self.outer.param_groups[0]["lr"] = self.lr + (self.lr_end - self.lr) * round_index / max(1, self.rounds - 1)
        self.outer.step()
        with torch.no_grad():
            for s, p in zip(self.shared, self.params):
                p.copy_(s)
        self.budget = self.every * min(float(t[1]) for t in every if t[0] > 0) * (1 + self.slack)
        self.restart()
        return took_all

    def restart(self) -> None:
        """Start the round's clock (after the exchange, and again after work outside the round,
        such as rank 0's evaluation, so that it does not eat into the round)."""
        self.round_start = time.time()
        self.deadline = self.round_start + self.budget
        self.done = 0

    def state_dict(self) -> dict:
        return {"outer": self.outer.state_dict(), "shared": [s.detach().cpu() for s in self.shared]}

    def load_state_dict(self, sd: dict) -> None:
        with torch.no_grad():
            for s, t in zip(self.shared, sd["shared"]):
                s.copy_(t)
        self.outer.load_state_dict(sd["outer"])
