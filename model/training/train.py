"""`teragram train --config FILE.toml [--key=value ...]`: train a GPT with or without index inputs.

Reads token shards and feature shards through memmaps. On CUDA: bf16 autocast, torch.compile,
fused AdamW; on CPU: float32. Warmup + cosine schedule, gradient clipping and accumulation,
multi-GPU with torchrun (DDP; gloo on CPU). Checkpoints hold the model (safetensors) and the
optimizer, RNG and step (the data position: batches are a function of the step), so a resumed
run continues the same loss curve. Logs: OUT/log.jsonl, a progress bar, OUT/loss.png.

Settings for memory, speed and convergence (each a config key; `check` refuses, with one line
and before any work, a value or a combination that cannot work):
  recompute = none | attn | block   activation checkpointing (model/gpt.py); recompute_blocks = N:
                                   only the first N blocks (selective)
  zero1 = true                      AdamW state sharded across DDP ranks (model/training/optim.py)
  offload = none | optimizer        fp32 masters and Adam moments in CPU memory (model/training/offload.py)
  precision = bf16 | fp8 | int8     the blocks' linear layers in fp8 or int8 (model/training/lowp.py)
  arch = gpt2 | modern              rotary, RMSNorm, QK-norm, ReLU^2, untied head (model/gpt.py)
  tie_head = true | false           override the arch's head tying (modern + true: GPT-2's parameter count)
  optimizer = adamw | muon | sgd    Muon for the blocks' matrices (model/training/muon.py); plain SGD
Across ranks and hosts (model/training/comm.py; torchrun, NCCL or gloo; bytes sent logged for every mode):
  compress = none | 1bit            signs + a scale per row, with error feedback (a DDP comm hook), after
                                    compress_after bf16 steps; AdamW then sends momenta (1-bit Adam)
  sync = every-step | local         local: DiLoCo, an outer Nesterov step every outer_every steps
  straggler = deadline | wait       local: a slow worker's round ends at the fast ones' pace, or all wait
  outer_dtype = fp32 | bf16         local: the precision of the deltas sent (bf16: half the bytes)
  outer_lr_end = 0                  local: > 0, the outer lr ramps from outer_lr to it over the rounds
  link_gbps = 0                     > 0: simulate a link of that bandwidth (benchmarks)
Checkpoints of every setting use one layout and resume under any other setting that uses the
same optimizer (adamw's state resumes with or without zero1 and offload, on any world size).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from teragram.index import format as fmt
from teragram.index import tokenizer
from teragram.index.features import Features
from teragram.model.checkpoint import check_resume, commit, save_checkpoint
from teragram.model.config import ConfigError
from teragram.model.evaluation.perplexity import evaluate
from teragram.model.gpt import GPT, GPTConfig, blinded, to_device
from teragram.model.mixture import joint, knn
from teragram.model.training import comm, lowp, optim
from teragram.model.training.data import TrainData
from teragram.model.training.offload import CPUOffloadAdamW
from tqdm import tqdm


@dataclass(frozen=True)
class TrainConfig:
    index: str = ""
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
    gate: str = "none"  # "joint": the index gate's mixture in the loss, trained with the LM (model/mixture/joint.py)
    joint_features: tuple[str, ...] = ()  # exclude-doc feature directories, one per --max-len (gate = joint)
    joint_estimates: str = ""  # where the training positions' estimates are written once ("": FEATURES[0]/../joint)
    joint_components: tuple[str, ...] = ()  # the estimates mixed in (model/mixture/estimates.py names); (): every one available
    joint_top_k: int = 4  # continuations kept per index estimate (the features' --top-k)
    joint_hidden: bool = True  # the gate reads the final hidden state (false: the ablation without it)
    joint_detach: bool = False  # ... without its gradient (the gate's loss does not shape the trunk)
    joint_lm_weight: float = 0.0  # the loss adds this times the LM's own nll (0: the mixture's alone)


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
    "gate": ("none", "joint"),
}


def check(cfg: TrainConfig) -> None:
    """Refuse, with one line, a setting or a combination that cannot work, before any work."""
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
            raise ConfigError("evals during training score models without index inputs (features unset; a joint gate is scored)")
        evals.data_root()  # the evaluation sets are installed, or one line saying how
    if cfg.gate == "joint":
        if not cfg.joint_features:
            raise ConfigError("gate = joint needs joint_features: exclude-doc feature directories (teragram features --mode exclude-doc)")
        if cfg.use_index and cfg.features is not None:
            raise ConfigError("gate = joint trains a model without index inputs: leave features unset or use_index = false")
        if cfg.joint_components:
            joint.check_components(cfg.joint_components)
        if cfg.evals and any(c in joint.DENSE for c in cfg.joint_components):
            raise ConfigError(
                "evals during training mix each candidate's estimates, and training has no kNN store for dense_knn's:"
                " score the checkpoint with `teragram evals --knn-keys RUN`"
            )
    if cfg.joint_detach and (cfg.gate != "joint" or not cfg.joint_hidden):
        raise ConfigError(
            f"joint_detach goes with gate = joint and joint_hidden = true (got gate = {cfg.gate}, joint_hidden = {cfg.joint_hidden})"
        )
    if cfg.joint_lm_weight < 0 or (cfg.joint_lm_weight and cfg.gate != "joint"):
        raise ConfigError(f"joint_lm_weight must be >= 0 and goes with gate = joint (got {cfg.joint_lm_weight}, gate = {cfg.gate})")
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


# ---- training --------------------------------------------------------------------------------


def _setup(cfg: TrainConfig) -> tuple[int, int, str, bool]:
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


def _to(x, device):
    """A tensor or a (torch) Features or Est record to the device (None stays None)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor | joint.Est):
        return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x.map(lambda t: t.to(device, non_blocking=True))
    return to_device(x, device, non_blocking=True)


def train(cfg: TrainConfig) -> dict:
    check(cfg)
    rank, world, device, own_group = _setup(cfg)
    if world > 1:
        agree(cfg)
    master = rank == 0
    torch.manual_seed(cfg.seed + rank)
    use_index = cfg.use_index and cfg.features is not None
    vocab = fmt.read_json(Path(cfg.index) / "manifest.json")["tokenizer"]["vocab_size"]
    top_k = fmt.read_json(Path(cfg.features) / "manifest.json")["top_k"] if use_index else 0
    mcfg = model_config(cfg, vocab, top_k)
    est = None
    if cfg.gate == "joint":
        est_dir = Path(cfg.joint_estimates or Path(cfg.joint_features[0]).parent / "joint")
        if master:
            joint.write_train_estimates(cfg.index, cfg.joint_features, est_dir, cfg.joint_top_k, os.cpu_count() or 1, cfg.progress)
        if world > 1:
            dist.barrier()
        comps = cfg.joint_components or tuple(fmt.read_json(est_dir / "manifest.json")["components"])
        if any(c in joint.DENSE for c in comps) and (cfg.heldout or cfg.evals):
            raise ConfigError(
                f"the gate reads {', '.join(c for c in comps if c in joint.DENSE)}, which evaluation during training has no"
                " source for: leave heldout and evals unset and score with the dense estimates (benchmarks/joint.py)"
            )
        est = joint.open_train_estimates(est_dir, cfg.index, comps, cfg.joint_top_k)
        store = fmt.read_json(est_dir / "manifest.json").get("dense_knn", {}) if any(c in joint.DENSE for c in comps) else {}
        mcfg = replace(
            mcfg,
            joint=comps,
            joint_knn=knn.kept(store),
            joint_top_k=cfg.joint_top_k,
            joint_hidden=cfg.joint_hidden,
            joint_detach=cfg.joint_detach,
            joint_lm_weight=cfg.joint_lm_weight,
            joint_tokenizer=tokenizer.digest(Path(cfg.index) / "tokenizer.model"),
        )
    data = TrainData(cfg.index, cfg.features if use_index else None, mcfg.block_size, est)
    out = Path(cfg.out)
    model = GPT(mcfg).to(device)
    model.set_recompute(cfg.recompute, cfg.recompute_blocks)
    lowp.convert(model, cfg.precision)
    start, st = 0, None
    if cfg.resume and (out / "latest.json").exists():
        check_resume(cfg, out)
        ck = out / fmt.read_json(out / "latest.json")["checkpoint"]
        sd = load_file(str(ck / "model.safetensors"))
        sd.setdefault("lm_head.weight", sd["transformer.wte.weight"])  # tied (gpt2 arch)
        model.load_state_dict(sd)
        st = torch.load(ck / "state.pt", map_location="cpu" if cfg.offload != "none" else device, weights_only=False)
    cuda = device.startswith("cuda")
    opt = optim.build(
        model,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=(cfg.beta1, cfg.beta2),
        cuda=cuda,
        zero1=cfg.zero1 and world > 1,
        offload=cfg.offload == "optimizer",
        muon=cfg.optimizer == "muon",
        muon_lr=cfg.muon_lr,
        muon_momentum=cfg.muon_momentum,
        sgd=cfg.optimizer == "sgd",
    )
    if cfg.offload == "optimizer" and cuda:
        model.to(torch.bfloat16)  # the fp32 masters live in CPU memory
    if st is not None:
        opt.load_state_dict(st["optimizer"])
        torch.set_rng_state(st["torch_rng"])
        start = st["step"]
    if master:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"model": asdict(mcfg), "train": asdict(cfg), "commit": commit()}, indent=1))
    fwd = torch.compile(model) if cuda and cfg.compile else model
    ddp = onebit = local = None
    link = comm.Link(world, cfg.link_gbps)
    if world > 1 and cfg.sync == "local":  # no DDP: each worker steps on its own gradients
        local = comm.LocalSGD(
            model,
            every=cfg.outer_every,
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
            straggler=cfg.straggler,
            slack=cfg.straggler_slack,
            link=link,
            dtype=torch.bfloat16 if cfg.outer_dtype == "bf16" else torch.float32,
            lr_end=cfg.outer_lr_end or None,
            rounds=(cfg.max_steps - 1) // cfg.outer_every + 1,
        )
        if st is not None and st.get("local", {}).get("world") == world:
            local.load_state_dict(st["local"])
            opt.load_state_dict(st["local"]["inner"][rank])
        elif st is not None and master:
            print("local SGD starts a new outer optimizer: the checkpoint has none for this world size")
    elif world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if cuda else None)
        if cfg.compress == "1bit":
            onebit = comm.OneBit(model, link)
            ddp.register_comm_hook(onebit, comm.OneBit.hook)
            if st is not None and not onebit.load_state_dict(st.get("onebit", {"world": 0})) and master:
                print("1-bit compression starts with zero residuals: the checkpoint has none for this world size")
        else:
            ddp.register_comm_hook(link, comm.counted_allreduce)
        fwd = torch.compile(ddp) if cuda and cfg.compile else ddp
    tokens_per_step = cfg.batch_size * mcfg.block_size * cfg.grad_accum * world
    log = open(out / "log.jsonl", "a") if master else None
    bar = tqdm(total=cfg.max_steps, initial=start, desc="train", unit="step", disable=not (master and cfg.progress))
    t0 = time.time()
    last = {"step": start}
    batches = _prefetch(data, cfg, rank, start, pin=cuda)
    tasks = None
    if master and cfg.evals:
        from teragram.index.engine import Index
        from teragram.model.evaluation.tasks import prepare

        idx = Index(cfg.index)
        est_of = None
        if cfg.gate == "joint":  # the candidates' estimates, once: its own mixture is scored beside the model
            from teragram.model.evaluation.tasks import joint_estimates

            est_of = lambda docs: joint_estimates(model, idx, docs, os.cpu_count() or 1)  # noqa: E731
        tasks = prepare(cfg.evals, cfg.evals_limit, idx.tokenize, est_of)
    for step in range(start, cfg.max_steps):
        lr = lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        loss_sum = 0.0
        skip = local is not None and local.skip()  # this worker's round is out of time
        if onebit is not None and step >= cfg.compress_after and not onebit.active:
            onebit.start(model, opt)  # AdamW: momenta from now on; its own step leaves v to the hook
        for micro in range(cfg.grad_accum):
            x, y, f, e = next(batches)
            if skip:
                continue
            if f is not None and cfg.index_dropout > 0:
                f = blind(f, cfg.index_dropout, torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 64 + micro * 8 + rank))
            x, y, f, e = _to(x, device), _to(y, device), _to(f, device), _to(e, device)
            sync = ddp is None or micro == cfg.grad_accum - 1
            ctx = ddp.no_sync() if (ddp is not None and not sync) else _null()
            with ctx, torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss, _ = fwd(x, y, f, e)
                loss = loss.mean() / cfg.grad_accum
            loss.backward()
            loss_sum += loss.item() if not cuda or (step + 1) % cfg.log_every == 0 else 0.0
        if not skip:
            if isinstance(opt, CPUOffloadAdamW):
                opt.step(cfg.grad_clip)  # clips the fp32 gradients on the CPU
            else:
                if cfg.grad_clip > 0 and not (onebit is not None and onebit.momentum is not None):  # not momenta
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
            opt.zero_grad(set_to_none=True)
            if onebit is not None and onebit.variance is not None and (step + 1) % cfg.variance_every == 0:
                onebit.sync_variance(opt)  # collective
        bar.update(1)
        took = None
        if local is not None:
            local.done += not skip
            if (step + 1) % cfg.outer_every == 0 or step + 1 == cfg.max_steps:
                took = local.exchange(step // cfg.outer_every)  # collective
        if took is not None or ((step + 1) % cfg.log_every == 0 or step == start or step + 1 == cfg.max_steps) and not skip:
            el = time.time() - t0
            done_tokens = tokens_per_step // world * (step + 1 - start)  # this rank's
            tps = tokens_per_step * (step + 1 - start) / max(el, 1e-9)
            last = {"step": step + 1, "loss": loss_sum, "lr": lr, "tokens_per_s": tps, "elapsed_s": el}
            if world > 1:
                last |= {"comm_bytes": link.sent, "comm_bytes_per_token": link.sent / max(1, done_tokens)}
            if took is not None:
                last["round_steps"] = took  # inner steps each worker took in the round that ended
            if skip:
                del last["loss"]
            if master:
                log.write(json.dumps(last) + "\n")
                log.flush()
                bar.set_postfix(loss=f"{loss_sum:.3f}", tok_s=f"{tps:,.0f}")
        if cfg.checkpoint and cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0 and step + 1 < cfg.max_steps:
            opt_state, extra = _states(opt, onebit, local)  # collective under ZeRO-1, 1bit, local
            if master:
                save_checkpoint(out, model, opt_state, step + 1, cfg, _masters(opt), extra)
        if master and (cfg.heldout or tasks) and cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.max_steps:
            log.write(json.dumps(_evaluate(cfg, model, data, device, tasks, step + 1)) + "\n")
            log.flush()
        if took is not None:
            local.restart()  # the evaluation and checkpoint are not the next round's time
    bar.close()
    result = dict(last)
    final = cfg.checkpoint and cfg.max_steps > start
    opt_state, extra = _states(opt, onebit, local) if final else (None, None)
    if master:
        if final:
            save_checkpoint(out, model, opt_state, cfg.max_steps, cfg, _masters(opt), extra)
        if cfg.heldout or tasks:
            row = _evaluate(cfg, model, data, device, tasks, cfg.max_steps)
            result |= {k: v for k, v in row.items() if k != "step"}
            log.write(json.dumps(row) + "\n")
        log.close()
        plot_log(out)
    if world > 1:
        dist.barrier()
        if own_group:
            dist.destroy_process_group()
    return result


def _states(opt, onebit: comm.OneBit | None, local: comm.LocalSGD | None) -> tuple[dict | None, dict]:
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


def _evaluate(cfg: TrainConfig, model: GPT, data: TrainData, device: str, tasks: dict | None, step: int) -> dict:
    """A log row: the held-out loss ("eval") and the downstream tasks' accuracy ("evals")."""
    row: dict = {"step": step}
    if cfg.heldout:
        row["eval"] = evaluate(model, cfg.heldout, data.eos, data.sep, device, index=cfg.index if cfg.gate == "joint" else None)
    if tasks:
        from teragram.model.evaluation.tasks import downstream

        row["evals"] = downstream(model, tasks, data.eos, device)
    return row


def _masters(opt) -> dict | None:
    return opt.master_weights() if isinstance(opt, CPUOffloadAdamW) else None


def blind(f: Features, p: float, gen: torch.Generator) -> Features:
    """Features with a share p of the sequences set to "no match" (L = 0, nothing found): the
    model keeps learning to predict without the index (deterministic per step, for resume)."""
    m = torch.rand(f.length.shape[0], generator=gen) < p  # (B,)
    if not m.any():
        return f
    return blinded(f, m)


def _prefetch(data: TrainData, cfg: TrainConfig, rank: int, start: int, pin: bool):
    """Batches for steps start.. in order, prepared by a background thread (a few ahead)."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=4)

    def work():
        for step in range(start, cfg.max_steps):
            for micro in range(cfg.grad_accum):
                x, y, f, e = data.batch(step * cfg.grad_accum + micro, cfg.batch_size, seed=cfg.seed, rank=rank)
                if pin:
                    x, y = x.pin_memory(), y.pin_memory()
                    f = None if f is None else f.map(lambda t: t.pin_memory())
                    e = None if e is None else e.map(lambda t: t.pin_memory())
                q.put((x, y, f, e))

    threading.Thread(target=work, daemon=True).start()
    while True:
        yield q.get()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ---- evaluation: model/evaluation/perplexity.py ----------------------------------------------------------


def plot_log(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if x.strip()]
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r and r.get("loss")]
    ev = [(r["step"], r["eval"]["loss"]) for r in rows if "eval" in r]
    ds = [r for r in rows if "evals" in r]
    fig, axes = plt.subplots(1, 2 if ds else 1, figsize=(11 if ds else 6, 3.5), squeeze=False)
    ax = axes[0, 0]
    if tr:
        ax.plot(*zip(*tr), label="train")
    if ev:
        ax.plot(*zip(*ev), "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    if ds:
        bx = axes[0, 1]
        for t in ds[-1]["evals"]:
            bx.plot([r["step"] for r in ds], [r["evals"][t]["acc_norm"] for r in ds], "o-", label=f"{t} ({ds[-1]['evals'][t]['n']})")
            if "joint" in ds[-1]["evals"][t]:
                bx.plot([r["step"] for r in ds], [r["evals"][t]["joint"]["acc_norm"] for r in ds], "s--", label=f"{t}, its gate")
        bx.set_xlabel("step")
        bx.set_ylabel("acc_norm")
        bx.legend()
    fig.savefig(out / "loss.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
