"""Checkpoints of `teragram train`: the model in safetensors (fp32), the optimizer, RNG and step
in state.pt, the resolved configs and the git commit in config.json; written to a temporary
directory and renamed, then pointed at by latest.json. `load_model` reads one back for every
verb that runs a model."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from teragram.index import format as fmt
from teragram.index.errors import TeragramError
from teragram.model.config import ConfigError
from teragram.model.gpt import GPT, GPTConfig


def commit() -> str:
    import subprocess

    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def save_checkpoint(
    out: Path, model: GPT, opt_state: dict, step: int, cfg, opt_weights: dict | None = None, extra: dict | None = None
) -> Path:
    """A checkpoint of the model (opt_weights: the fp32 masters, when the optimizer keeps them;
    extra: more state for state.pt, e.g. the communication's)."""
    d = out / "checkpoints" / f"step-{step:07d}"
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = opt_weights if opt_weights is not None else model.state_dict()
    sd = {k: v.detach().float().cpu().contiguous() if v.is_floating_point() else v.detach().cpu().contiguous() for k, v in weights.items()}
    if model.tied:
        sd.pop("lm_head.weight", None)  # tied to wte
    save_file(sd, str(tmp / "model.safetensors"))
    torch.save({"optimizer": opt_state, "step": step, "torch_rng": torch.get_rng_state(), **(extra or {})}, tmp / "state.pt")
    (tmp / "config.json").write_text(
        json.dumps({"model": asdict(model.cfg), "train": asdict(cfg), "step": step, "commit": commit()}, indent=1)
    )
    shutil.rmtree(d, ignore_errors=True)
    os.replace(tmp, d)
    fmt.write_json(out / "latest.json", {"checkpoint": str(d.relative_to(out)), "step": step})
    return d


# what a run learns, beyond its model's shape (a checkpoint of another shape fails to load) and
# its paths (an index may move): a resume must keep them; world size, zero1, offload and
# max_steps may change
RESUME_SAME = ("seed", "batch_size", "grad_accum", "lr", "min_lr", "warmup", "weight_decay", "optimizer", "use_index")


def check_resume(cfg, out: Path) -> None:
    """Refuse to resume a run in OUT that was started with other settings of what it learns
    (a replicate with another seed into the same directory would otherwise continue, or end
    at once as complete, and record the new settings over the old)."""
    if not (out / "config.json").exists():
        return  # checkpoints copied without their run's record: nothing to compare
    was = fmt.read_json(out / "config.json").get("train", {})
    now = json.loads(json.dumps(asdict(cfg)))  # as config.json holds it (tuples as lists)
    diff = [f"{k} {was[k]!r} -> {now[k]!r}" for k in RESUME_SAME if k in was and was[k] != now[k]]
    if diff:
        raise ConfigError(
            f"{out} holds a run started with other settings ({', '.join(diff)}): give another --out, or --resume=false to start over"
        )


# the last commit with the joint recipe (train --gate=joint, its kNN store and gate refit), retired
# since: docs/research/2026-12-04-joint-gate.md says why
JOINT_RETIRED_AT = "66eafbe"
# GPTConfig fields of the joint recipe that checkpoints written before its retirement hold
JOINT_FIELDS = ("joint", "joint_top_k", "joint_hidden", "joint_detach", "joint_tokenizer", "joint_lm_weight", "joint_knn")


def load_model(checkpoint: str | Path, device: str = "cpu") -> tuple[GPT, dict]:
    """A model from a checkpoint directory (or a run directory: its latest checkpoint). A model
    trained with the retired joint gate is refused with one line."""
    p = Path(checkpoint)
    if (p / "latest.json").exists():
        p = p / fmt.read_json(p / "latest.json")["checkpoint"]
    meta = json.loads((p / "config.json").read_text())
    mc = meta["model"]
    if mc.get("joint"):
        raise TeragramError(
            f"{checkpoint}: a model trained with the joint gate (train --gate=joint), retired after commit {JOINT_RETIRED_AT}:"
            f" check that commit out to use it"
        )
    mc = {k: v for k, v in mc.items() if k not in JOINT_FIELDS}  # a plain model saved before the retirement
    mc["index_inputs"] = tuple(mc["index_inputs"])
    model = GPT(GPTConfig(**mc))
    sd = load_file(str(p / "model.safetensors"))
    sd.setdefault("lm_head.weight", sd["transformer.wte.weight"])  # tied (gpt2 arch)
    model.load_state_dict(sd)
    return model.to(device), meta


def weights_digest(model: GPT) -> str:
    """blake2b of every parameter: what a gate fit on a model's outputs belongs to, and is refused
    by any other model."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(np.ascontiguousarray(p.detach().float().cpu().numpy()))
    return h.hexdigest()


def load_lm(checkpoint=None, hf_model=None, *, index=None, device: str = "cpu", dtype: str | None = None, context: int | None = None):
    """(model, meta) of a verb's model: a native checkpoint, or a transformers causal LM
    (model/hf/adapter.py: dtype, context). With `index` (an opened index) a model that cannot read
    its ids is refused with one line, a transformers model's tokenizer before its weights are read."""
    from teragram.index.errors import TokenizerMismatch

    if (checkpoint is None) == (hf_model is None):
        raise TeragramError("give --checkpoint (a teragram run) or --hf-model (a transformers model), one of them")
    if hf_model is not None:
        from teragram.model.hf.adapter import load_hf

        return load_hf(hf_model, index=index, device=device, dtype=dtype, context=context)
    if dtype or context:
        raise TeragramError("--dtype and --context go with --hf-model (a native checkpoint runs under autocast on a GPU)")
    model, meta = load_model(checkpoint, device)
    if index is not None and model.cfg.vocab_size != index.vocab_size:
        raise TokenizerMismatch(f"checkpoint vocabulary {model.cfg.vocab_size} != index vocabulary {index.vocab_size}")
    return model, meta
