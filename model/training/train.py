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

This module holds the loop and its steps; the settings and their checks are in config.py, the
ranks' set-up and communication in ranks.py, the batches' way to the step in batches.py, the
log's figure in plot.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from teragram.index import format as fmt
from teragram.model.checkpoint import check_resume, commit, save_checkpoint
from teragram.model.config import ConfigError
from teragram.model.evaluation.perplexity import evaluate
from teragram.model.gpt import GPT, GPTConfig
from teragram.model.training import lowp, optim, ranks
from teragram.model.training.batches import blind, on_device, prefetch
from teragram.model.training.config import CHOICES, TrainConfig, agree, check, lr_at, model_config
from teragram.model.training.data import TrainData
from teragram.model.training.offload import CPUOffloadAdamW
from teragram.model.training.plot import plot_log
from teragram.model.training.shards import TokenShards, read_manifest
from tqdm import tqdm

# The settings (config.py), the batches (batches.py) and the log's figure (plot.py) are
# importable from here too.
__all__ = ["CHOICES", "TrainConfig", "agree", "blind", "check", "lr_at", "model_config", "plot_log", "train"]


def train(cfg: TrainConfig) -> dict:
    """Train (or resume) the run cfg describes; returns its last log row (with the final
    evaluation's figures when it has held-out data or tasks)."""
    check(cfg)
    rank, world, device, own_group = ranks.setup(cfg)
    if world > 1:
        agree(cfg)
    torch.manual_seed(cfg.seed + rank)
    run = _start(cfg, rank, world, device)
    start = run.start
    tokens_per_step = cfg.batch_size * run.model.cfg.block_size * cfg.grad_accum * world
    t0 = time.time()
    last = {"step": start}
    if run.master and cfg.evals:
        run.tasks = _tasks(cfg)
    with prefetch(run.data, cfg, rank, start, pin=run.cuda) as batches:
        for step in range(start, cfg.max_steps):
            lr = lr_at(cfg, step)
            local = run.comm.local
            outer = local is not None and ((step + 1) % cfg.outer_every == 0 or step + 1 == cfg.max_steps)
            logged = outer or logs_step(cfg, step, start)
            loss_sum, skip = _step(run, step, lr, batches, read_loss=logged)
            run.bar.update(1)
            took = None
            if local is not None:
                local.done += not skip
                if outer:
                    took = local.exchange(step // cfg.outer_every)  # collective
            if took is not None or logged and not skip:
                el = time.time() - t0
                last = _log_row(run, step, loss_sum, lr, el, tokens_per_step, took, skip, batches.wait_s)
            _checkpoint_and_evaluate(run, step)
            if took is not None:
                local.restart()  # the evaluation and checkpoint are not the next round's time
    run.bar.close()
    result = _finish(run, last)
    if world > 1:
        dist.barrier()
        if own_group:
            dist.destroy_process_group()
    return result


@dataclass
class _Run:
    """One rank's training run once set up: what the steps read and update."""

    cfg: TrainConfig
    rank: int
    world: int
    device: str
    out: Path
    model: GPT
    data: TrainData | TokenShards
    opt: torch.optim.Optimizer
    comm: ranks.Wrapped
    start: int  # the step it starts (or resumes) at
    bar: tqdm
    log: object | None  # OUT/log.jsonl, open on rank 0
    tasks: dict | None = None  # the downstream tasks evaluated on rank 0 (train() prepares them)

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def _start(cfg: TrainConfig, rank: int, world: int, device: str) -> _Run:
    """The model, data, optimizer and communication, resumed from OUT's latest checkpoint
    when there is one; rank 0 writes OUT/config.json and opens the log. (The tasks come later:
    their preparation counts in the run's elapsed time.)"""
    master = rank == 0
    mcfg = _model_config(cfg)
    if cfg.data is not None:
        data = TokenShards(cfg.data, mcfg.block_size, world)
        if cfg.index and data.tokenizer not in (None, fmt.read_json(Path(cfg.index) / "manifest.json")["tokenizer"]["file"]["blake2b"]):
            raise ConfigError(f"{cfg.data}: token shards of another tokenizer than {cfg.index}'s")
    else:
        data = TrainData(cfg.index, cfg.features if cfg.use_index and cfg.features is not None else None, mcfg.block_size)
    out = Path(cfg.out)
    model = GPT(mcfg).to(device)
    model.set_recompute(cfg.recompute, cfg.recompute_blocks)
    lowp.convert(model, cfg.precision)
    st = _resume_state(cfg, out, model, device)
    cuda = device.startswith("cuda")
    opt = _optimizer(cfg, model, world, cuda)
    start = 0
    if st is not None:
        opt.load_state_dict(st["optimizer"])
        torch.set_rng_state(st["torch_rng"])
        start = st["step"]
    if master:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"model": asdict(mcfg), "train": asdict(cfg), "commit": commit()}, indent=1))
    wrapped = ranks.wrap(cfg, model, opt, st, rank, world, cuda)
    log = open(out / "log.jsonl", "a") if master else None
    bar = tqdm(total=cfg.max_steps, initial=start, desc="train", unit="step", disable=not (master and cfg.progress))
    return _Run(cfg, rank, world, device, out, model, data, opt, wrapped, start, bar, log)


def _model_config(cfg: TrainConfig) -> GPTConfig:
    """The model's configuration (its vocabulary the index's, its top-k the features')."""
    use_index = cfg.use_index and cfg.features is not None
    if cfg.data is not None:
        vocab = read_manifest(Path(cfg.data))["vocab_size"]
    else:
        vocab = fmt.read_json(Path(cfg.index) / "manifest.json")["tokenizer"]["vocab_size"]
    top_k = fmt.read_json(Path(cfg.features) / "manifest.json")["top_k"] if use_index else 0
    return model_config(cfg, vocab, top_k)


def _resume_state(cfg: TrainConfig, out: Path, model: GPT, device: str) -> dict | None:
    """With resume and a checkpoint in OUT: its weights loaded into model, and its state
    (optimizer, RNG, step, communication); None to start afresh."""
    if not (cfg.resume and (out / "latest.json").exists()):
        return None
    check_resume(cfg, out)
    ck = out / fmt.read_json(out / "latest.json")["checkpoint"]
    sd = load_file(str(ck / "model.safetensors"))
    sd.setdefault("lm_head.weight", sd["transformer.wte.weight"])  # tied (gpt2 arch)
    model.load_state_dict(sd)
    return torch.load(ck / "state.pt", map_location="cpu" if cfg.offload != "none" else device, weights_only=False)


def _optimizer(cfg: TrainConfig, model: GPT, world: int, cuda: bool):
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
    return opt


def _tasks(cfg: TrainConfig) -> dict:
    """The downstream tasks, prepared once (rank 0)."""
    from teragram.index.engine import Index
    from teragram.model.evaluation.tasks import prepare

    return prepare(cfg.evals, cfg.evals_limit, Index(cfg.index).tokenize)


def logs_step(cfg: TrainConfig, step: int, start: int) -> bool:
    """Whether the log gets a row after step: every log_every steps, the run's first and its last."""
    return (step + 1) % cfg.log_every == 0 or step == start or step + 1 == cfg.max_steps


def _step(run: _Run, step: int, lr: float, batches, *, read_loss: bool) -> tuple[float, bool]:
    """One optimizer step over grad_accum micro-batches: (the loss summed over them, read on CUDA
    only where read_loss says the step is logged; whether this worker skipped the step, its
    local-SGD round being out of time)."""
    cfg, opt, c = run.cfg, run.opt, run.comm
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    loss_sum = 0.0
    skip = c.local is not None and c.local.skip()  # this worker's round is out of time
    if c.onebit is not None and step >= cfg.compress_after and not c.onebit.active:
        c.onebit.start(run.model, opt)  # AdamW: momenta from now on; its own step leaves v to the hook
    for micro in range(cfg.grad_accum):
        x, y, f = next(batches)
        if skip:
            continue
        if f is not None and cfg.index_dropout > 0:
            f = blind(f, cfg.index_dropout, torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 64 + micro * 8 + run.rank))
        x, y, f = (on_device(v, run.device) for v in (x, y, f))
        sync = c.ddp is None or micro == cfg.grad_accum - 1
        ctx = c.ddp.no_sync() if (c.ddp is not None and not sync) else _null()
        with ctx, torch.autocast("cuda", dtype=torch.bfloat16, enabled=run.cuda):
            loss, _ = c.fwd(x, y, f)
            loss = loss.mean() / cfg.grad_accum
        loss.backward()
        loss_sum += loss.item() if not run.cuda or read_loss else 0.0
    if not skip:
        if isinstance(opt, CPUOffloadAdamW):
            opt.step(cfg.grad_clip)  # clips the fp32 gradients on the CPU
        else:
            if cfg.grad_clip > 0 and not (c.onebit is not None and c.onebit.momentum is not None):  # not momenta
                torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
            opt.step()
        opt.zero_grad(set_to_none=True)
        if c.onebit is not None and c.onebit.variance is not None and (step + 1) % cfg.variance_every == 0:
            c.onebit.sync_variance(opt)  # collective
    return loss_sum, skip


def _log_row(run: _Run, step: int, loss_sum: float, lr: float, el: float, tokens_per_step: int, took, skip: bool, wait_s: float) -> dict:
    """The log row after step (written by rank 0, with the progress bar's figures); input_wait_s:
    the seconds so far the steps waited for their batches (text not read or not there yet)."""
    done_tokens = tokens_per_step // run.world * (step + 1 - run.start)  # this rank's
    tps = tokens_per_step * (step + 1 - run.start) / max(el, 1e-9)
    last = {"step": step + 1, "loss": loss_sum, "lr": lr, "tokens_per_s": tps, "elapsed_s": el, "input_wait_s": wait_s}
    if isinstance(run.data, TokenShards):
        last["shard_wait_s"] = run.data.waited_s  # the reader's own waits for shards not there yet
    if run.world > 1:
        link = run.comm.link
        last |= {"comm_bytes": link.sent, "comm_bytes_per_token": link.sent / max(1, done_tokens)}
    if took is not None:
        last["round_steps"] = took  # inner steps each worker took in the round that ended
    if skip:
        del last["loss"]
    if run.master:
        run.log.write(json.dumps(last) + "\n")
        run.log.flush()
        run.bar.set_postfix(loss=f"{loss_sum:.3f}", tok_s=f"{tps:,.0f}")
    return last


def _checkpoint_and_evaluate(run: _Run, step: int) -> None:
    """The checkpoint and the evaluation due after step (not the last: _finish does those)."""
    cfg = run.cfg
    if cfg.checkpoint and cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0 and step + 1 < cfg.max_steps:
        opt_state, extra = ranks.gather_states(run.opt, run.comm.onebit, run.comm.local)  # collective under ZeRO-1, 1bit, local
        if run.master:
            save_checkpoint(run.out, run.model, opt_state, step + 1, cfg, _masters(run.opt), extra)
    if run.master and (cfg.heldout or run.tasks) and cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.max_steps:
        run.log.write(json.dumps(_evaluate(run, step + 1)) + "\n")
        run.log.flush()


def _finish(run: _Run, last: dict) -> dict:
    """The final checkpoint and evaluation, the log closed and drawn; returns the result row."""
    cfg = run.cfg
    result = dict(last)
    final = cfg.checkpoint and cfg.max_steps > run.start
    opt_state, extra = ranks.gather_states(run.opt, run.comm.onebit, run.comm.local) if final else (None, None)
    if run.master:
        if final:
            save_checkpoint(run.out, run.model, opt_state, cfg.max_steps, cfg, _masters(run.opt), extra)
        if cfg.heldout or run.tasks:
            row = _evaluate(run, cfg.max_steps)
            result |= {k: v for k, v in row.items() if k != "step"}
            run.log.write(json.dumps(row) + "\n")
        run.log.close()
        plot_log(run.out)
    return result


def _evaluate(run: _Run, step: int) -> dict:
    """A log row: the held-out loss ("eval") and the downstream tasks' accuracy ("evals")."""
    cfg, data = run.cfg, run.data
    row: dict = {"step": step}
    if cfg.heldout:
        row["eval"] = evaluate(run.model, cfg.heldout, data.eos, data.sep, run.device)
    if run.tasks:
        from teragram.model.evaluation.tasks import downstream

        row["evals"] = downstream(run.model, run.tasks, data.eos, run.device)
    return row


def _masters(opt) -> dict | None:
    return opt.master_weights() if isinstance(opt, CPUOffloadAdamW) else None


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
