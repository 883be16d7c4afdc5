"""What a training run does across ranks: the process group and each rank's device, the model
wrapped for the chosen communication (DDP with a counted or 1-bit all-reduce, or local SGD), and
the optimizer and communication state gathered on rank 0 for a checkpoint."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from teragram.model.gpt import GPT
from teragram.model.training import comm, optim
from teragram.model.training.config import TrainConfig


def setup(cfg: TrainConfig) -> tuple[int, int, str, bool]:
    """rank, world size, device, and whether this call initialised the process group (a caller
    that already has one, e.g. a test running several trainings in one torchrun, keeps it)."""
    if dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    dev = cfg.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if world > 1:
        shared_gpu = False
        if dev == "cuda":  # a host's ranks share its GPUs round-robin when they outnumber them
            local, n = int(os.environ.get("LOCAL_RANK", "0")), max(1, torch.cuda.device_count())
            shared_gpu = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > n
            torch.cuda.set_device(local % n)
            dev = f"cuda:{local % n}"
        if not dist.is_initialized():  # NCCL refuses two ranks on one GPU: gloo then (through host memory)
            dist.init_process_group("nccl" if dev.startswith("cuda") and not shared_gpu else "gloo")
            return rank, world, dev, True
    return rank, world, dev, False


@dataclass
class Wrapped:
    """The model as the step calls it (fwd), and the communication around it: ddp, onebit and
    local are None where unused; link counts (and may throttle) the bytes sent."""

    fwd: torch.nn.Module
    link: comm.Link
    ddp: torch.nn.parallel.DistributedDataParallel | None = None
    onebit: comm.OneBit | None = None
    local: comm.LocalSGD | None = None


def wrap(cfg: TrainConfig, model: GPT, opt, st: dict | None, rank: int, world: int, cuda: bool) -> Wrapped:
    """The model wrapped for cfg's communication, with the communication's state resumed from
    the checkpoint's st where it has one for this world size."""
    master = rank == 0
    w = Wrapped(torch.compile(model) if cuda and cfg.compile else model, comm.Link(world, cfg.link_gbps))
    if world > 1 and cfg.sync == "local":  # no DDP: each worker steps on its own gradients
        w.local = comm.LocalSGD(
            model,
            every=cfg.outer_every,
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
            straggler=cfg.straggler,
            slack=cfg.straggler_slack,
            link=w.link,
            dtype=torch.bfloat16 if cfg.outer_dtype == "bf16" else torch.float32,
            lr_end=cfg.outer_lr_end or None,
            rounds=(cfg.max_steps - 1) // cfg.outer_every + 1,
        )
        if st is not None and st.get("local", {}).get("world") == world:
            w.local.load_state_dict(st["local"])
            opt.load_state_dict(st["local"]["inner"][rank])
        elif st is not None and master:
            print("local SGD starts a new outer optimizer: the checkpoint has none for this world size")
    elif world > 1:
        w.ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if cuda else None)
        if cfg.compress == "1bit":
            w.onebit = comm.OneBit(model, w.link)
            w.ddp.register_comm_hook(w.onebit, comm.OneBit.hook)
            if st is not None and not w.onebit.load_state_dict(st.get("onebit", {"world": 0})) and master:
                print("1-bit compression starts with zero residuals: the checkpoint has none for this world size")
        else:
            w.ddp.register_comm_hook(w.link, comm.counted_allreduce)
        w.fwd = torch.compile(w.ddp) if cuda and cfg.compile else w.ddp
    return w


def gather_states(opt, onebit: comm.OneBit | None, local: comm.LocalSGD | None) -> tuple[dict | None, dict]:
    """The optimizer's whole state and the communication's, on rank 0 (collective): the 1-bit
    residuals of every rank; under local SGD the outer optimizer and every worker's inner state
    (the checkpoint's "optimizer" is rank 0's, so it also resumes in the other modes)."""
    opt_state, extra = optim.full_state_dict(opt), {}
    if onebit is not None:
        extra["onebit"] = onebit.state_dict()
    if local is not None:
        inner: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(opt_state, inner, dst=0)
        extra["local"] = {"world": dist.get_world_size(), "inner": inner, **local.state_dict()}
    return opt_state, extra
