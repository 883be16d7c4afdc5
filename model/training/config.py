"""The training run's settings: TrainConfig, the checks that refuse a setting or a combination
that cannot work (before any work, on every rank), the learning-rate schedule and the model
configuration a run trains."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from teragram.model.config import ConfigError
from teragram.model.gpt import GPTConfig
from teragram.model.training import lowp


@dataclass(frozen=True)
class TrainConfig:
    index: str = ""
    data: str | None = None  # token shards (model/training/shards.py) to train on instead of the index's text
    features: str | None = None  # training features (None: baseline without index inputs)
    heldout: str | None = None  # held-out features (teragram features --corpus) for evaluation
    out: str = "runs/train"
    preset: str = "tiny"
    use_index: bool = True
    index_inputs: tuple[str, ...] = ("cont", "len", "cnt", "topk")
    mixture: bool = True
    index_dropout: float = 0.0  # share of training sequences whose index features are blinded
    block_size: int = 0  # 0: the preset's
    batch_size: int = 16  # per rank and micro-step
    grad_accum: int = 1
    max_steps: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 1337
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end
    evals: tuple[str, ...] = ()  # downstream tasks (model/evaluation/tasks.py: hellaswag, arc_easy, ...) run with each evaluation
    evals_limit: int = 500  # each task's first N validation examples: a fixed subset
    ckpt_every: int = 0  # 0: only at the end
    device: str = "auto"
    compile: bool = True  # on CUDA
    resume: bool = True
    checkpoint: bool = True  # false: no checkpoints at all (speed benchmarks)
    progress: bool = True
    arch: str = "gpt2"  # "gpt2" | "modern": rotary, RMSNorm, QK-norm, ReLU^2 MLP, untied head
    tie_head: bool | None = None  # head tied to the token embedding; None: the arch's default (gpt2 tied, modern untied)
    optimizer: str = "adamw"  # "adamw" | "muon": Muon for the blocks' matrices, AdamW for the rest
    muon_lr: float = 0.02  # Muon's peak learning rate (follows lr's warmup and cosine)
    muon_momentum: float = 0.95
    recompute: str = "none"  # activation recompute: none | attn | block
    recompute_blocks: int = 0  # recompute = block: only the first this many blocks (0: all)
    precision: str = "bf16"  # "bf16" (autocast; fp32 on CPU) | "fp8" | "int8" matmuls in the blocks' linears
    zero1: bool = False  # shard the optimizer state across data-parallel ranks (ZeRO stage 1)
    offload: str = "none"  # "optimizer": fp32 master weights and Adam moments in CPU memory
    compress: str = "none"  # "1bit": gradients as signs + one scale per row, with error feedback
    compress_after: int = 50  # 1bit: steps all-reduced in bf16 first; then AdamW's momentum is sent (1-bit Adam)
    variance_every: int = 100  # 1bit + adamw: the ranks' own second moments averaged into AdamW's every this many steps
    sync: str = "every-step"  # "local": local SGD (DiLoCo), workers exchange weight deltas every outer_every steps
    outer_every: int = 50  # H: inner steps per round (sync = local)
    outer_lr: float = 0.7  # the outer Nesterov SGD's learning rate (DiLoCo's)
    outer_momentum: float = 0.9
    straggler: str = "deadline"  # local: "deadline" (a slow worker's round ends early) | "wait" (every worker takes H steps)
    straggler_slack: float = 0.25  # deadline = (1 + slack) x the fastest worker's time for H steps
    outer_dtype: str = "fp32"  # local: the deltas' precision on the wire ("bf16": half the bytes)
    outer_lr_end: float = 0.0  # local: > 0, the outer lr ramps linearly from outer_lr (first round) to this (last)
    link_gbps: float = 0.0  # > 0: simulate a link of this bandwidth (a sleep per byte sent)


CHOICES = {
    "arch": ("gpt2", "modern"),
    "optimizer": ("adamw", "muon", "sgd"),
    "recompute": ("none", "attn", "block"),
    "offload": ("none", "optimizer"),
    "precision": ("bf16", "fp8", "int8"),
    "compress": ("none", "1bit"),
    "sync": ("every-step", "local"),
    "straggler": ("deadline", "wait"),
    "outer_dtype": ("fp32", "bf16"),
}


def check(cfg: TrainConfig) -> None:
    """Refuse, with one line, a setting or a combination that cannot work, before any work."""
    if cfg.data is not None and cfg.features is not None and cfg.use_index:
        raise ConfigError("data (token shards) trains a model without index inputs: leave features unset")
    if not cfg.index and (cfg.data is None or cfg.evals):
        raise ConfigError("index is required (the training text and tokenizer; with data, for evals' tokenizer)")
    for key, allowed in CHOICES.items():
        if getattr(cfg, key) not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}, not {getattr(cfg, key)!r}")
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.precision == "fp8" and not (cuda and lowp.fp8_supported()):
        raise ConfigError("precision = fp8 needs a CUDA GPU of compute capability >= 8.9")
    if cfg.offload != "none" and cfg.zero1:
        raise ConfigError("offload = optimizer and zero1 cannot be combined (the CPU optimizer is not sharded); choose one")
    if cfg.optimizer == "muon" and cfg.zero1:
        raise ConfigError("optimizer = muon and zero1 cannot be combined (Muon needs whole matrices); use adamw with zero1")
    if cfg.optimizer == "muon" and cfg.offload != "none":
        raise ConfigError("optimizer = muon and offload = optimizer cannot be combined; offload supports adamw only")
    if cfg.optimizer == "sgd" and (cfg.zero1 or cfg.offload != "none"):
        raise ConfigError("optimizer = sgd has no state to shard or offload; use adamw with zero1 or offload")
    if cfg.evals:
        from teragram.model.evaluation import tasks as evals

        unknown = [t for t in cfg.evals if t not in evals.TASKS]
        if unknown:
            raise ConfigError(f"unknown evals task(s) {', '.join(unknown)}; known: {', '.join(evals.TASKS)}")
        if cfg.use_index and cfg.features is not None:
            raise ConfigError("evals during training score models without index inputs (leave features unset)")
        evals.data_root()  # the evaluation sets are installed, or one line saying how
    if cfg.recompute_blocks < 0 or (cfg.recompute_blocks and cfg.recompute != "block"):
        raise ConfigError(
            f"recompute_blocks must be >= 0 and goes with recompute = block (got {cfg.recompute_blocks}, recompute = {cfg.recompute})"
        )
    if cfg.variance_every < 1:
        raise ConfigError(f"variance_every must be >= 1, not {cfg.variance_every}")
    if cfg.outer_every < 1:
        raise ConfigError(f"outer_every must be >= 1, not {cfg.outer_every}")
    if cfg.link_gbps < 0 or cfg.straggler_slack < 0:
        raise ConfigError("link_gbps and straggler_slack must be >= 0")
    if cfg.compress == "1bit" and (cfg.optimizer not in ("adamw", "sgd") or cfg.zero1 or cfg.offload != "none"):
        raise ConfigError("compress = 1bit needs optimizer = adamw or sgd, without zero1 or offload (it takes over AdamW's moments)")
    if cfg.compress == "1bit" and cfg.optimizer == "adamw" and cfg.compress_after < 1:
        raise ConfigError("compress = 1bit with adamw needs compress_after >= 1: AdamW's moments start in those steps")
    if (cfg.outer_dtype != "fp32" or cfg.outer_lr_end) and cfg.sync != "local":
        raise ConfigError("outer_dtype and outer_lr_end set local SGD's outer step: they need sync = local")
    if cfg.outer_lr_end < 0:
        raise ConfigError(f"outer_lr_end must be > 0 (a ramp's end) or 0 (none), not {cfg.outer_lr_end}")
    if cfg.sync == "local":
        if cfg.compress != "none":
            raise ConfigError(
                "compress = 1bit compresses every step's gradients; sync = local exchanges weight deltas, use compress = none"
            )
        if cfg.zero1 or cfg.offload != "none":
            raise ConfigError("sync = local keeps a whole optimizer on every worker; it cannot be combined with zero1 or offload")
        if cfg.ckpt_every % cfg.outer_every:
            raise ConfigError(
                f"sync = local checkpoints at the end of a round: ckpt_every must be a multiple of outer_every ({cfg.outer_every})"
            )


def agree(cfg: TrainConfig) -> None:
    """Refuse, on every rank, ranks started with different settings (collective)."""
    mine = {k: v for k, v in asdict(cfg).items() if k != "progress"}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    keys = sorted({k for c in every for k in c if c.get(k) != every[0].get(k)})
    if keys:
        raise ConfigError(f"ranks disagree on the training config ({', '.join(keys)}): start every rank with the same settings")


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.max_steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * frac)) * (cfg.lr - cfg.min_lr)


def model_config(cfg: TrainConfig, vocab_size: int, top_k: int) -> GPTConfig:
    g = GPTConfig.preset(
        cfg.preset,
        vocab_size=vocab_size,
        use_index=cfg.use_index and cfg.features is not None,
        index_inputs=cfg.index_inputs,
        mixture=cfg.mixture,
        top_k=top_k,
        arch=cfg.arch,
        tie_head=cfg.tie_head,
    )
    if cfg.block_size:
        g = replace(g, block_size=cfg.block_size)
    if g.use_index and top_k == 0 and ({"topk", "cnt"} & set(g.index_inputs) or g.mixture):
        g = replace(g, index_inputs=tuple(i for i in g.index_inputs if i in ("cont", "len")), mixture=False)
    return g
