"""A jointly trained model's gate refit on validation text after training, the LM frozen.

The joint gate (model/mixture/joint.py) learns its weights on training positions, whose exclude-doc
estimates are far more reliable than new text's (long matches are common there and rare in new
text), so it trusts the estimates more than new text warrants. The post-hoc gate (model/mixture/gate.py)
has no such bias: it is fit on held-out validation text. `refit_gate` puts the joint gate on the
same footing: starting from the trained gate, it refits the gate's weights by maximum likelihood
of the mixture on one validation set; the LM and its head are untouched. Test text is then
scored with the refit gate: `gated_nll` from the same cached inputs, or token_eval with the gate
installed in the model (`install_gate`), which give the same numbers.

What the gate reads is fixed while it is refit, so it is computed once (`gate_inputs`): each
target's final hidden state, the model's log-probability of it, its top token and that token's
probability, and the estimates. The fit and the evaluation then run only the gate: a few small
matrix products per step, seconds for 0.5M targets on a GPU.

Which weights move, and why the fit cannot overfit badly. By default the statistics' weights --
the table of per-bucket weights (counts, shares, suffix lengths, the model's confidence), the
agreement weights and the bias: one-hot features, the post-hoc gate's family, about 5k numbers
that 0.5M validation targets pin down as well as they pin down the post-hoc gate. The projection
of the hidden state keeps its trained value: it is a dense map of a 768-dimensional input (10k
numbers at 12 estimates), and validation text is a few hundred documents of correlated tokens,
so refitting it can fit those documents rather than the kind of text (`hidden=True` refits it
too, for comparison). Every refit weight is pulled toward its trained value by an L2 penalty:
a bucket that validation text rarely visits keeps what training learned, and the softmax's
redundant directions (one constant added to every column) stay where training left them.
Full-batch L-BFGS with a fixed iteration budget: deterministic, no learning rate to tune.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from teragram.index.errors import TeragramError
from teragram.model.checkpoint import weights_digest
from teragram.model.evaluation.perplexity import token_eval
from teragram.model.gpt import GPT
from teragram.model.mixture import joint
from teragram.model.mixture.estimates import heldout_docs

L2 = 1e-4  # penalty per squared distance from the trained weights (the post-hoc gate's weight decay)
STEPS = 100  # L-BFGS iterations (at most; it stops earlier when the loss stops moving)
CHUNK = 1 << 16  # targets per gate pass: bounds the (rows, features, 1 + M) lookup's memory
KIND = "joint-gate"
VERSION = 1


@dataclass(frozen=True)
class GateInputs:
    """What a joint model's gate and mixture read at each target of held-out text, in token_eval's
    order; tensors on one device."""

    hidden: torch.Tensor  # (n, C) float32: the final hidden state
    est: joint.Est  # (n, M) and (n,): the estimates (joint.to_torch)
    maxp: torch.Tensor  # (n,) float32: the model's top probability
    top: torch.Tensor  # (n,) int64: its most likely token
    lp_target: torch.Tensor  # (n,) float32: its log-probability of the target

    def __len__(self) -> int:
        return len(self.maxp)

    def select(self, rows) -> GateInputs:
        """The targets at `rows` (a slice, or a boolean mask or indices (n,))."""
        if not isinstance(rows, slice):
            rows = torch.as_tensor(np.asarray(rows), device=self.maxp.device)
        return GateInputs(*(v.map(lambda x: x[rows]) if isinstance(v, joint.Est) else v[rows] for v in self._values()))

    def _values(self) -> list:
        return [getattr(self, f.name) for f in fields(self)]


def gate_inputs(
    model: GPT, heldout, index, device: str = "cpu", *, batch: int = 16, threads: int = 1, dense: joint.Est | None = None, knn=None,
    est: joint.Est | None = None,
) -> tuple[GateInputs, dict]:  # fmt: skip
    """The gate's inputs on held-out features' text (index: an Index or its directory; the
    estimates on `threads` threads, a kNN datastore's given as `dense` or taken from `knn`, or all of
    them given as `est`, joint.heldout_est's of this text) and token_eval's result there with the
    trained gate (nll, nll_model, maxp, top, target, doc, pos): one pass of the model."""
    from teragram.index.engine import Index

    if not model.cfg.joint:
        raise TeragramError("only a jointly trained model (train --gate=joint) has a gate to refit; fit a post-hoc gate (eval --fit-gate)")
    idx = index if isinstance(index, Index) else Index(index)
    joint.check_index(model.cfg, idx)
    docs = heldout_docs(heldout)
    if est is None:  # given ones are checked against the text by token_eval
        est = joint.heldout_est(idx, docs, model.cfg.joint, model.cfg.joint_top_k, threads, dense, knn)
    r = token_eval(model, heldout, idx.eos_id, idx.sep, device, batch=batch, hidden=True, index=idx, estimates=est)
    row0 = np.concatenate([[0], np.cumsum([len(d) + 1 for d in docs])]).astype(np.int64)  # each document's first row in est
    order = row0[r["doc"].astype(np.int64)] + r["pos"].astype(np.int64)

    def put(x: np.ndarray, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x, dtype)).to(device)

    h = r.pop("hidden").reshape(len(order), model.cfg.n_embd)
    inputs = GateInputs(
        put(h, np.float32),
        joint.to_torch(est.map(lambda x: x[order]), device),
        put(r["maxp"], np.float32),
        put(r["top"], np.int64),
        put(-r["nll_model"], np.float32),
    )
    return inputs, r


def refit_gate(model: GPT, inputs: GateInputs, *, hidden: bool = False, l2: float = L2, steps: int = STEPS) -> joint.JointGate:
    """A copy of the model's gate refit on `inputs` (validation text): the mean nll of the
    mixture plus l2 x the squared distance of the refit weights from the trained ones, minimised
    from the trained gate by full-batch L-BFGS. The statistics' weights move; with hidden=True
    the hidden state's projection too (see the module's docstring). The model is not changed."""
    if len(inputs) == 0:
        raise TeragramError("no validation targets to refit the gate on")
    gate = copy.deepcopy(model.joint_gate).float().to(inputs.maxp.device).train()
    gate.requires_grad_(False)
    free = {n: p for n, p in gate.named_parameters() if hidden or not n.startswith("hidden.")}
    start = {n: p.detach().clone() for n, p in free.items()}
    for p in free.values():
        p.requires_grad_(True)
    opt = torch.optim.LBFGS(list(free.values()), lr=1, max_iter=steps, history_size=20, line_search_fn="strong_wolfe")
    n = len(inputs)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        total = l2 * sum(((p - start[k]) ** 2).sum() for k, p in free.items())
        total.backward()
        total = total.detach()
        for a in range(0, n, CHUNK):  # the mean's gradient, accumulated a chunk at a time
            x = inputs.select(slice(a, a + CHUNK))
            part = joint.mixture_nll(gate(x.hidden, x.est, x.maxp, x.top), x.lp_target, x.est).sum() / n
            part.backward()
            total = total + part.detach()
        return total

    with torch.enable_grad():
        opt.step(closure)
    return gate.requires_grad_(False).eval()


@torch.no_grad()
def gated_nll(gate: joint.JointGate, inputs: GateInputs) -> np.ndarray:
    """Per target (n,) float32: -log p(target) of the mixture with `gate` -- token_eval's nll with
    this gate in the model (on CUDA under the same bf16 autocast as token_eval)."""
    cuda = inputs.maxp.is_cuda
    out = []
    for a in range(0, len(inputs), CHUNK):
        x = inputs.select(slice(a, a + CHUNK))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            out.append(joint.mixture_nll(gate(x.hidden, x.est, x.maxp, x.top), x.lp_target, x.est).float().cpu().numpy())
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def refit_report(model: GPT, index_dir, heldout, device: str = "cpu", opts=None, *, hidden: bool = False, batch: int = 16):
    """(report, gate, fit): model.evaluate.heldout_report of a joint model whose gate is refit on
    this (validation) text, plus "refit": how the gate was fit (fit, for save_gate) and the
    perplexity the trained gate gives on the same targets. With opts.decontaminate, contaminated
    documents are left out of the fit as they are out of the report."""
    from teragram.index.engine import Index
    from teragram.index.heldout import DECONTAMINATION_SHARE, contamination
    from teragram.index.tokenizer import load
    from teragram.model.evaluation.perplexity import EvalOptions, doc_bytes, mix_report
    from teragram.model.training.data import EvalData

    opts = opts or EvalOptions()
    idx = Index(index_dir)
    inputs, r = gate_inputs(model, heldout, idx, device, batch=batch, threads=opts.workers, knn=opts.knn)
    keep = np.ones(len(inputs), bool)
    if opts.decontaminate:
        keep = (contamination(heldout, index_dir) < DECONTAMINATION_SHARE)[r["doc"].astype(np.int64)]
    gate = refit_gate(model, inputs.select(keep), hidden=hidden)
    nll = gated_nll(gate, inputs)
    fit = {"targets": int(keep.sum()), "hidden": hidden, "l2": L2, "steps": STEPS}
    fit |= {"nll_trained_gate": float(r["nll"][keep].mean()), "nll_refit_gate": float(nll[keep].mean())}
    per_doc = doc_bytes(EvalData(heldout, model.cfg.block_size, idx.eos_id, idx.sep), load(Path(heldout) / "tokenizer.model").decode)
    report, _ = mix_report(r | {"nll": nll}, per_doc, index_dir, heldout, opts)
    return report | {"refit": fit | {"perplexity_trained_gate": float(np.exp(fit["nll_trained_gate"]))}}, gate, fit


# ---- the refit gate on disk: safetensors, with what it belongs to -------------------------------


def lm_digest(model: GPT) -> str:
    """A refit gate belongs to the LM whose hidden states and probabilities it was fit on, and is
    refused by any other: checkpoint.weights_digest."""
    return weights_digest(model)


def save_gate(path, model: GPT, gate: joint.JointGate, fit: dict | None = None) -> Path:
    """Write a refit gate of `model` (fit: how it was fit, kept in the file's metadata)."""
    from safetensors.torch import save_file

    path = Path(path)
    meta = {
        "kind": KIND,
        "version": str(VERSION),
        "components": json.dumps(list(model.cfg.joint)),
        "joint_hidden": json.dumps(bool(model.cfg.joint_hidden)),
        "lm": lm_digest(model),
        "fit": json.dumps(fit or {}),
    }
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in gate.state_dict().items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


def load_gate(path, model: GPT) -> joint.JointGate:
    """A refit gate saved by save_gate, for `model`; one of another model (other estimates, other
    LM parameters) or a file that is not a refit gate is refused."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    if not model.cfg.joint:
        raise TeragramError(f"{path}: a refit joint gate, for a jointly trained model (this one has no joint gate)")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError) as e:
        raise TeragramError(f"{path}: not a refit joint gate ({e})") from None
    if meta.get("kind") != KIND or meta.get("version") != str(VERSION):
        raise TeragramError(f"{path}: not a refit joint gate of version {VERSION} (teragram eval --refit-gate writes them)")
    comps = tuple(json.loads(meta["components"]))
    if comps != model.cfg.joint or json.loads(meta["joint_hidden"]) != model.cfg.joint_hidden:
        raise TeragramError(f"{path}: a gate over {', '.join(comps)}; this model's gate mixes {', '.join(model.cfg.joint)}")
    if meta["lm"] != lm_digest(model):
        raise TeragramError(f"{path}: refit for another model (its LM's parameters differ from this checkpoint's)")
    gate = copy.deepcopy(model.joint_gate)
    gate.load_state_dict({k: v.to(next(gate.parameters()).device) for k, v in tensors.items()})
    return gate.eval()


def install_gate(model: GPT, gate: joint.JointGate) -> None:
    """Make `gate` the model's own: token_eval, sample and serve then mix with it."""
    model.joint_gate.load_state_dict(gate.state_dict())


def use_gate_file(model: GPT, path) -> None:
    """Install the refit gate saved at `path` (load_gate's checks: refused for another model)."""
    install_gate(model, load_gate(path, model))
