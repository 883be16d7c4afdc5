"""Joint training of the LM and the index gate (model/mixture/joint.py) against the post-hoc gate and the
peers, on the index-size benchmark's data: the same 125M, steps and text as its model (a).

    python -m benchmarks.index_size prepare --data DATA --carry .carry15       # here: text + held-out halves
    python -m benchmarks.joint gpu --carry .carry15 --work W --out OUT --stage prep [--then knnest]  # on the GPU machine
    python -m benchmarks.joint gpu --carry .carry15 --work W --out OUT --stage train [--refit]  # at once: W is lost when idle; again: resumes
    python -m tools.device_pipeline start --home H -- python -m benchmarks.joint gpu --stage all ...  # or both stages as one
    python -m tools.device_pipeline wait --home H                 # pipeline that outlives the calls: each call, at once
    python -m benchmarks.index_size eval --outputs OUT --index DATA/idx-050m --name joint_posthoc   # here
    python -m benchmarks.joint eval --joint OUT [OUT2 ...] --index DATA/idx-050m --carry .carry15 \
        --posthoc benchmarks/results/joint_posthoc.json                                # here
    python -m benchmarks.joint --smoke   # every stage above on CPU at tiny scale (smoke_stages), then eval

`prep` indexes the training text with the carried tokenizer, writes exclude-doc features at every
context length the estimates need and the training positions' estimates (model/mixture/joint.py), while
the plain model (a) trains on the idle GPU. `train` writes the held-out features, saves (a)'s
outputs (for the post-hoc gates and the peers, evaluated here by benchmarks/index_size.py), trains
each other variant with benchmarks/perplexity.py's GPU settings and saves its per-target nll on
every held-out half (with the index on that machine: the gate reads the hidden state, so a joint
model's evaluation cannot be split like the post-hoc one's). Variants:
  a         the plain 125M (trained during prep): its outputs
  plain     the plain 125M again, 300 steps alone on the machine: the step rate joint is held to
  joint     every estimate (index ∞-gram and 2..17-grams, the cache's), the gate reads h
  nohidden  the same without the hidden state (the ablation)
  nocache   the index's estimates only
  lm1       joint, the loss adding the LM's own nll (joint_lm_weight = 1): the LM stays a whole LM
  lm1h      lm1 without the hidden state in the gate
  knn       the peer (d): kNN-LM over (a) with every training position in the datastore
            (benchmarks/knnlm.py; its temperature and λ are fit here, by `eval`)
  knnest    (no model) the kNN-LM's estimate as joint components, model/mixture/joint.DENSE (dense_knn at
            the temperature fit on validation, dense_knn_sharp/_broad at 0.5x/2.5x it; dense_cache, the
            same over the document's own earlier states): every held-out target's and every training
            position's, the store's in exclude-doc mode (knnlm.joint_estimates)
  knnj      lm1 with dense_knn as one more component (after knnest, on the same machine)
  knnj3     lm1 with the three dense_knn components
  knnj3w    knnj3 with the LM's own loss at half weight (joint_lm_weight = 0.5)
  knnj3w2   knnj3 with the LM's own loss at twice the weight (joint_lm_weight = 2)
  knnj3c    knnj3 with dense_cache, the continuous cache (Grave et al. 2017) as one more component: the
            kNN estimate over the document's own earlier states under (a) (k nearest, temperature fit
            on validation; knnest writes it beside dense_knn)
  knnj3d    knnj3 with the gate reading the hidden state without its gradient (joint_detach): the
            gate's loss reaches the LM only through the LM's own probabilities (measured: worse
            than knnj3, benchmarks/results/joint_detach.md)
  knnj3sN   knnj3 with its training seeded N (8, 9; knnj3's is 7), knnj3dsN knnj3d likewise:
            replicates, reported with their base as mean and spread (with --prior, also the base of
            earlier runs' results), never chosen
With --refit, each joint variant V is also scored with its gate refit on each set's validation
half after training, the LM frozen (model/mixture/refit.py), as the post-hoc gates are fit per set:
  Vr        the statistics' weights refit (the hidden state's projection as trained)
  Vrh       the hidden state's projection refit too (for a gate that reads it)
With --own-store (and --refit), each variant V whose gate reads the dense components is also
scored with them over a store keyed by its own states, not (a)'s (knnlm.own_store: one model at
inference), the temperature fit again on the in-distribution validation half:
  Vo        its gate as trained; Vor, Vorh: refit as above
`eval` reports them beside the post-hoc variants and the peers measured on the same text with
the same index and (a), on all and decontaminated test text."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from benchmarks import knnlm
from benchmarks.common import save, sh, table

CAPS = (1, 2, 4, 8, 16, 255)  # the fixed orders' context lengths and the ∞-gram's cap (model/mixture/joint.py)
VARIANTS = {
    "joint": [],
    "nohidden": ["--joint_hidden=false"],
    "nocache": ["--joint_components=index_infgram,index_2gram,index_3gram,index_5gram,index_9gram,index_17gram"],
    "plain": [],
    "lm1": ["--joint_lm_weight=1.0"],
    "lm1h": ["--joint_lm_weight=1.0", "--joint_hidden=false"],
    "knnj": ["--joint_lm_weight=1.0", "--joint_components={all},dense_knn"],  # {all}: model/mixture/estimates.COMPONENTS
    "knnj3": ["--joint_lm_weight=1.0", "--joint_components={all},dense_knn,dense_knn_sharp,dense_knn_broad"],
    "knnj3w": ["--joint_lm_weight=0.5", "--joint_components={all},dense_knn,dense_knn_sharp,dense_knn_broad"],
    "knnj3w2": ["--joint_lm_weight=2.0", "--joint_components={all},dense_knn,dense_knn_sharp,dense_knn_broad"],
    "knnj3d": ["--joint_lm_weight=1.0", "--joint_components={all},dense_knn,dense_knn_sharp,dense_knn_broad", "--joint_detach=true"],
    "knnj3c": ["--joint_lm_weight=1.0", "--joint_components={all},dense_knn,dense_knn_sharp,dense_knn_broad,dense_cache"],
}
# replicates: a variant again, its training seeded otherwise (the store and (a) those of the run's
# prep); reported beside it as mean and spread, never candidates on validation
REPLICATES = {f"{b}s{n}": (b, n) for b in ("knnj3", "knnj3d") for n in (8, 9)}
VARIANTS |= {r: [*VARIANTS[b], f"--seed={n}"] for r, (b, n) in REPLICATES.items()}
THEN_OK = {"knn", "knnest"}  # variants that need only (a) and the index: prep can start them once (a) is trained
KEY_NAMES = {"final": "final hidden states", "ffn_in": "last block's feed-forward inputs after its layer norm (the kNN-LM paper's keys)"}
DENSE_ESTIMATES = "est-knn"  # W/est with dense_knn appended (variant knnest), the estimates of the variants reading it
TRAINED = {
    "joint": "(j) joint: LM + gate over index and cache, trained together",
    "nohidden": "(j-h) joint, gate without the hidden state",
    "nocache": "(j-c) joint, index estimates only",
    "lm1": "(j+lm) joint, plus the LM's own loss (joint_lm_weight = 1)",
    "lm1h": "(j+lm-h) the same, gate without the hidden state",
    "knnj": "(j+lm+knn) j+lm, the kNN-LM's estimate one more component (exclude-doc in training)",
    "knnj3": "(j+lm+knn3) j+lm+knn, the kNN estimate at three temperatures (0.5x, 1x, 2.5x the fit one): three components",
    "knnj3w": "(j+lm/2+knn3) j+lm+knn3 with the LM's own loss at half weight (joint_lm_weight = 0.5)",
    "knnj3w2": "(j+2lm+knn3) j+lm+knn3 with the LM's own loss at twice the weight (joint_lm_weight = 2)",
    "knnj3d": "(j+lm+knn3+sg) j+lm+knn3, the gate reading the hidden state without its gradient (joint_detach)",
    "knnj3c": "(j+lm+knn3+cc) j+lm+knn3 with the continuous cache (dense_cache: the kNN estimate over the document's own earlier states)",
}
TRAINED |= {
    r: f"{TRAINED[b].split(' ', 1)[0][:-1]}:s{n}) {TRAINED[b].split(' ', 1)[0][1:-1]} again, its training seeded {n} (a replicate)"
    for r, (b, n) in REPLICATES.items()
}
# --refit: each joint variant's gate refit on each set's validation half, the LM frozen (model/mixture/refit.py)
REFITS = {
    "r": ("gate refit on each set's validation half", False),
    "rh": ("gate and its hidden-state projection refit on each set's validation half", True),
}


def _with_refits(names: dict[str, str]) -> dict[str, str]:
    """Each variant followed by its refits: lm1 -> lm1r "(j+lm/r) ..., gate refit on ...", lm1rh."""
    out = {}
    for v, name in names.items():
        label, rest = name.split(" ", 1)
        out[v] = name
        out |= {f"{v}{s}": f"{label[:-1]}/{s}) {rest}; {what}" for s, (what, _) in REFITS.items()}
    return out


def _reads_dense(v: str) -> bool:
    """Whether variant V's gate reads the dense kNN components (model/mixture/joint.DENSE)."""
    return any("dense_knn" in x for x in VARIANTS.get(v, ()))


# --own-store: the variants reading the dense components, scored over a store keyed by their own states
OWN = {
    f"{v}o": f"{TRAINED[v].split(' ', 1)[0][:-1]}/o) {TRAINED[v].split(' ', 1)[1]}; its kNN store keyed by its own states, not (a)'s"
    for v in TRAINED
    if _reads_dense(v)
}
NAMES = _with_refits(TRAINED) | _with_refits(OWN) | {"knn": "(d) kNN-LM over (a), every training position in the datastore"}
SETS = ("indist", "timeshift", "prose")
HALVES = ("valid", "test")


def _run(work: Path, v: str, seed: int) -> Path:
    """A variant's run directory: WORK/runs/V for seed 7 (every published run's), else
    WORK/runs-seedN/V (a run directory keeps its seed: the trainer refuses another)."""
    return work / ("runs" if seed == 7 else f"runs-seed{seed}") / v


def stage_prep(
    carry: Path, work: Path, scale: str = "gpu", steps: int | None = None, seed: int = 7, joint_inputs: bool = True,
    then: tuple[str, ...] = (), out: Path | None = None, then_args: tuple[str, ...] = (), variants: tuple[str, ...] = (),
) -> tuple[dict, list]:  # fmt: skip
    """Index, exclude-doc features per context length, the training positions' estimates; the
    plain model (a) trains meanwhile on the idle GPU (its step rate is measured again, alone, by
    the variant plain: this run shares the CPUs). joint_inputs False (no joint variant to train,
    e.g. --variants a,knn): the index and (a) only. `then`: variants over (a) (THEN_OK) started
    on the GPU as soon as (a) is trained, beside the estimates, writing to `out` (knnest's search
    only: its merge needs the estimates, so a later train stage finishes it), with `then_args`
    (the kNN options); returned with the phases' times, still running. Once the training
    positions' estimates are written, the CPUs, idle while the search runs, compute the held-out
    halves' index and cache estimates for the joint `variants` to be trained (W/heldest), which
    their evaluations would otherwise wait on."""
    from teragram.index.engine import Index
    from teragram.model.mixture import joint

    from benchmarks.index_size import heldout_features
    from benchmarks.perplexity import SCALES, train_cmd

    py, n = sys.executable, os.cpu_count() or 1
    s = dict(SCALES[scale]) | ({"steps": steps} if steps else {}) | {"seed": seed}
    train = [carry / "train-code.jsonl.zst", carry / "train-english.jsonl.zst"]
    t = time.time()
    sh(py, "-m", "teragram.builder.cli", *train, "--out", work / "idx", "--tokenizer", carry / "tokenizer.model", "--workers", n, "--quiet")
    ph = {"index_s": time.time() - t}
    t = time.time()
    a = subprocess.Popen(
        train_cmd("a", work, s, out=_run(work, "a", seed)), stdout=open(work / "train-a.log", "w"), stderr=subprocess.STDOUT
    )
    follow: list = []
    held_ready = threading.Event()

    def start_then():  # (a)'s followers, once it is trained and the held-out features are written
        held_ready.wait()
        if a.wait() == 0:
            cmd = [py, "-m", "benchmarks.joint", "gpu", "--carry", str(carry), "--work", str(work), "--out", str(out)]
            cmd += (
                ["--stage", "train", "--variants", ",".join(then), "--seed", str(seed), "--scale", scale]
                + (["--steps", str(steps)] if steps else [])
                + list(then_args)
            )
            log = open(work / "train-then.log", "w")
            follow.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"TERAGRAM_KNN_SEARCH_ONLY": "1"}))

    waiter = threading.Thread(target=start_then, daemon=True)
    if then:
        waiter.start()
    t_held = time.time()
    held = heldout_features(work / "idx", work / "held", carry, n)  # here, so that no follower writes them at the same time
    held_ready.set()
    ph["heldout_features_s"] = time.time() - t_held
    procs = [  # one process per context length: each is one pass over the (single) shard
        subprocess.Popen(
            [py, "-m", "teragram.serve.main", "features", str(work / "idx"), "--out", str(work / f"len-{c}"), "--mode", "exclude-doc"]
            + ["--max-len", str(c), "--top-k", "4", "--quiet"]
        )
        for c in (CAPS if joint_inputs else ())
    ]
    if any([p.wait() for p in procs]):  # every pass waited for, then judged
        raise SystemExit("exclude-doc features failed")
    ph["features_s"] = time.time() - t
    t = time.time()
    if joint_inputs:
        joint.write_train_estimates(work / "idx", [work / f"len-{c}" for c in CAPS], work / "est", 4, workers=n)
    ph["estimates_s"] = time.time() - t
    if a.wait():
        raise SystemExit(f"training (a) failed: see {work / 'train-a.log'}")
    ph["a_done_s"] = time.time() - t
    if then:
        waiter.join()
    t = time.time()
    idx = Index(work / "idx")
    for own in dict.fromkeys(_own_components(v) for v in variants if v in VARIANTS and v != "plain"):
        for (name, h), feats in held.items():
            _heldest(work, idx, feats, name, h, own, 4, n)  # 4: the training estimates' top_k, every variant's
    ph["heldout_estimates_s"] = time.time() - t
    print(json.dumps(ph))
    return ph, follow


def _save_nll(path: Path, nll: np.ndarray, r: dict | None) -> None:
    """A variant's per-target nll on one held-out half, beside its LM's own and the targets (r
    None: a refit of the variant whose file holds those, the same LM on the same targets)."""
    more = {} if r is None else {"nll_model": r["nll_model"].astype(np.float32), "target": r["target"].astype(np.int32)}
    np.savez_compressed(path, nll=np.asarray(nll, np.float32), **more)


def load_nll(home: dict, v: str, s: str, h: str) -> dict:
    """A variant's saved nll on one half, with its LM's and the targets (a refit's: its variant's)."""
    z = dict(np.load(home[v] / f"{v}-{s}-{h}.npz"))
    if "target" not in z:
        base = next(b for b in (*TRAINED, *OWN) if v in (f"{b}{x}" for x in REFITS))
        zb = np.load(home[v] / f"{base}-{s}-{h}.npz")
        z |= {"nll_model": zb["nll_model"], "target": zb["target"]}
    return z


def _dense_of(model, out: Path):
    """The held-out halves' dense estimates (knnlm.joint_estimates' files in OUT) for a model whose
    gate reads them: (set, half) -> Est or None."""
    from teragram.model.mixture.joint import DENSE

    wants = any(c in DENSE for c in model.cfg.joint)
    return lambda name, h: knnlm.load_est(out, name, h, model.cfg.joint) if wants else None


def _own_components(v: str) -> tuple[str, ...]:
    """The index and cache components (the dense ones left out) that variant V's gate reads, as
    its trained config will name them (no --joint_components: every one, model/mixture/estimates.COMPONENTS,
    the order W/est's manifest lists them in)."""
    from teragram.model.mixture.estimates import COMPONENTS
    from teragram.model.mixture.joint import DENSE

    arg = next((x.split("=", 1)[1] for x in VARIANTS[v] if x.startswith("--joint_components=")), "{all}")
    return tuple(c for c in arg.format(all=",".join(COMPONENTS)).split(",") if c not in DENSE)


def _heldest(work: Path, idx, feats, name: str, h: str, own: tuple[str, ...], top_k: int, threads: int):
    """joint.heldout_est of one held-out half over the components `own` (no dense ones), kept in
    W/heldest: the same for every variant with these components on this index, so a later
    variant's evaluation (or prep, for the variants it will train) computes them once."""
    from dataclasses import asdict, fields

    from teragram.model.mixture.estimates import heldout_docs
    from teragram.model.mixture.joint import Est, heldout_est

    key = hashlib.blake2b(repr((tuple(own), top_k)).encode(), digest_size=6).hexdigest()
    path = work / "heldest" / f"{name}-{h}-{key}.npz"
    if path.exists():
        with np.load(path) as z:
            return Est(**{f.name: z[f.name] for f in fields(Est)})
    e = heldout_est(idx, heldout_docs(feats), own, top_k, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part.npz")
    np.savez(tmp, **asdict(e))
    os.replace(tmp, path)  # whole or absent: a call cut short leaves no half-written estimates
    return e


def _heldout_est(work: Path, idx, model, feats, name: str, h: str, dense, threads: int):
    """joint.heldout_est of one held-out half for the model's gate: its index and cache columns
    from W/heldest (_heldest), the dense ones (`dense`) appended."""
    from teragram.model.mixture.joint import DENSE, with_columns

    own = tuple(c for c in model.cfg.joint if c not in DENSE)
    e = _heldest(work, idx, feats, name, h, own, model.cfg.joint_top_k, threads)
    return e if dense is None else with_columns(e, dense)


def _eval_refits(
    model, v: str, held: dict, idx, out: Path, device: str, batch: int, threads: int, work: Path, dense_dir: Path | None = None
) -> dict:
    """A joint variant's nll on every held-out half with its trained gate (OUT/V-SET-HALF.npz, as
    without --refit) and with the gate refit on that set's validation half (OUT/Vr-SET-HALF.npz;
    Vrh-...: the hidden state's projection refit too, when the gate reads it). The model runs once
    per half; each fit runs only the gate. The dense components' held-out estimates are read from
    dense_dir (default OUT: (a)'s store). Returns each fit's time and validation nll, and each
    half's time for its inputs (estimates and the model's pass)."""
    from teragram.model.mixture import refit

    info = {"inputs_s": {}}
    dense = _dense_of(model, dense_dir or out)
    for name in SETS:
        inputs, res = {}, {}
        for h in HALVES:
            t = time.time()
            e = _heldout_est(work, idx, model, held[name, h], name, h, dense(name, h), threads)
            inputs[h], res[h] = refit.gate_inputs(model, held[name, h], idx, device, batch=batch, est=e)
            info["inputs_s"][f"{name}-{h}"] = time.time() - t
            _save_nll(out / f"{v}-{name}-{h}.npz", res[h]["nll"], res[h])
        for suffix, (_, hidden) in REFITS.items():
            if hidden and not model.cfg.joint_hidden:
                continue
            t = time.time()
            gate = refit.refit_gate(model, inputs["valid"], hidden=hidden)
            fit_s = time.time() - t
            nll = {h: refit.gated_nll(gate, inputs[h]) for h in HALVES}
            for h in HALVES:
                _save_nll(out / f"{v}{suffix}-{name}-{h}.npz", nll[h], None)
            info[f"{name}-{suffix}"] = {
                "fit_s": fit_s,
                "valid_targets": len(inputs["valid"]),
                "valid_nll_trained_gate": float(res["valid"]["nll"].mean()),
                "valid_nll_refit_gate": float(nll["valid"].mean()),
            }
        del inputs
    return info


def _own_store(model, v: str, held: dict, idx, out: Path, device: str, batch: int, threads: int, work: Path) -> dict:
    """--own-store: variant V scored again with its dense components over a store keyed by its own
    states (knnlm.own_store; its held-out estimates in W/own/V), its gate as trained (OUT/Vo-*)
    and refit (OUT/Vor-*, Vorh-*). Returns the store's info with the refits'."""
    import torch

    t = time.time()
    dense = _dense_of(model, out)  # (a)'s store: only to run the model, whose LM's nll and states are read
    d = work / "own" / v

    def est(name, h):
        return _heldout_est(work, idx, model, held[name, h], name, h, dense(name, h), threads)

    info = knnlm.own_store(model, work / "idx", held, d, device, est, eval_batch=batch) | {"store_s": time.time() - t}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the store's keys (72 GB at 47M positions) given back before the next variant trains
    info["refit"] = _eval_refits(model, f"{v}o", held, idx, out, device, batch, threads, work, dense_dir=d)
    return info


def _done(info: dict, v: str, work: Path, out: Path, refit: bool, own: bool = False) -> bool:
    """Whether an earlier call with this W and OUT finished variant V's part of the train stage
    (info: OUT/joint_gpu.json, each entry written once its step is complete), so that the same
    command, given again after a call cut short, resumes where it stopped and repeats nothing."""
    got = info.get(v, {})
    if v == "a":
        return "outputs_s" in got and all((out / f"outputs-{n}-{h}.tgz").exists() for n in SETS for h in HALVES)
    if v == "knnest":  # the search-only pass beside prep records no train_search_s: its merge is still to do
        return "train_search_s" in got and (work / DENSE_ESTIMATES / "manifest.json").exists()
    if v in ("knn", "plain"):
        return ("total_s" if v == "knn" else "train_s") in got
    own = own and _reads_dense(v)
    files = [out / f"{w}-{n}-{h}.npz" for w in (v, f"{v}o")[: 1 + own] for n in SETS for h in HALVES]
    return "eval_s" in got and (not refit or "refit" in got) and (not own or "own" in got) and all(f.exists() for f in files)


def stage_train(
    carry: Path,
    work: Path,
    out: Path,
    variants: list[str],
    steps: int | None,
    scale: str = "gpu",
    refit: bool = False,
    seed: int = 7,
    knn_key: str = "auto",
    knn_peer: bool = True,
    own: bool = False,
    knn_lists: int = knnlm.CENTROIDS,
) -> None:
    import torch
    from teragram.index.engine import Index
    from teragram.model.checkpoint import load_model
    from teragram.model.evaluation.perplexity import token_eval
    from teragram.model.mixture.estimates import COMPONENTS, heldout_docs
    from teragram.model.mixture.joint import heldout_est

    from benchmarks.index_size import heldout_features, save_outputs_a
    from benchmarks.perplexity import SCALES, train_cmd

    s = dict(SCALES[scale]) | ({"steps": steps} if steps else {}) | {"seed": seed}
    n = os.cpu_count() or 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    idx = Index(work / "idx")
    saved = out / "joint_gpu.json"
    info = json.loads(saved.read_text()) if saved.exists() else {}  # a later call's variants join an earlier call's
    t = time.time()
    held = heldout_features(work / "idx", work / "held", carry, n)
    info["heldout_s"] = time.time() - t
    if {"a", "knn", "knnest"} & set(variants) and not (_run(work, "a", seed) / "latest.json").exists():
        raise SystemExit(f"{_run(work, 'a', seed)}: no (a) of seed {seed}: run --stage prep with the same --seed first")
    for v in sorted(variants, key=lambda v: (v != "a", v != "plain")):  # (a)'s outputs, then plain's short run: the rates need it
        if _done(info, v, work, out, refit, own):
            print(f"{v}: done by an earlier call (OUT/joint_gpu.json): skipped", flush=True)
            continue
        t = time.time()
        if v == "knn":  # the peer (d) over (a), trained during prep
            model, _ = load_model(_run(work, "a", seed), device)
            info[v] = knnlm.run(model, work / "idx", held, out, device, eval_batch=s["eval_batch"], centroids=knn_lists)
            info[v]["total_s"] = time.time() - t
            saved.write_text(json.dumps(info, indent=1))
            del model
            continue
        if v == "knnest":  # dense_knn for the joint gate, over (a) trained during prep
            model, _ = load_model(_run(work, "a", seed), device)
            args = (model, work / "idx", held, work / "est", work / DENSE_ESTIMATES, out, device)
            info[v] = knnlm.joint_estimates(*args, eval_batch=s["eval_batch"], key=knn_key, peer=knn_peer, centroids=knn_lists)
            info[v]["total_s"] = time.time() - t
            saved.write_text(json.dumps(info, indent=1))
            del model
            continue
        if v == "a":  # trained during prep
            save_outputs_a(work, out, held, s["eval_batch"], device, _run(work, "a", seed))
            info[v] = {"outputs_s": time.time() - t, "log": [json.loads(x) for x in open(_run(work, "a", seed) / "log.jsonl")]}
            saved.write_text(json.dumps(info, indent=1))
            continue
        cmd = train_cmd("a", work, s, out=_run(work, v, seed))
        if v != "plain":
            feats = ",".join(str(work / f"len-{c}") for c in CAPS)
            est = work / (DENSE_ESTIMATES if _reads_dense(v) else "est")
            cmd += ["--gate=joint", f"--joint_features={feats}", f"--joint_estimates={est}"]
            cmd += [x.format(all=",".join(COMPONENTS)) for x in VARIANTS[v]]
        else:
            cmd += [f"--max_steps={min(300, s['steps'])}", "--checkpoint=false"]
        last = _run(work, v, seed) / "latest.json"
        if v != "plain" and "train_s" in info.get(v, {}) and last.exists() and json.loads(last.read_text())["step"] >= s["steps"]:
            print(f"{v}: trained by an earlier call: evaluated, not trained again", flush=True)
        else:
            sh(*cmd)
            log = [json.loads(x) for x in open(_run(work, v, seed) / "log.jsonl")]
            info[v] = {"train_s": time.time() - t, "log": log}
            saved.write_text(json.dumps(info, indent=1))
        if v == "plain":
            continue
        t = time.time()
        model, _ = load_model(_run(work, v, seed), device)
        if refit:
            info[v]["refit"] = _eval_refits(model, v, held, idx, out, device, s["eval_batch"], n, work)
        else:
            dense = _dense_of(model, out)
            for (name, h), feats in held.items():
                e = dense(name, h)
                if e is not None:
                    e = heldout_est(idx, heldout_docs(feats), model.cfg.joint, model.cfg.joint_top_k, n, dense=e)
                r = token_eval(model, feats, idx.eos_id, idx.sep, device, batch=s["eval_batch"], index=idx, threads=n, estimates=e)
                _save_nll(out / f"{v}-{name}-{h}.npz", r["nll"], r)
        info[v]["eval_s"] = time.time() - t
        saved.write_text(json.dumps(info, indent=1))
        if own and _reads_dense(v):
            info[v]["own"] = _own_store(model, v, held, idx, out, device, s["eval_batch"], n, work)
            saved.write_text(json.dumps(info, indent=1))
        del model


def _rate(log: list[dict], skip: int = 100) -> float:
    """Tokens per second after the first `skip` steps (compilation and warm-up left out) of the
    log's last run: a run resumed after a call was cut short appends a second one, its step and
    clock started again (its first `skip` steps left out as well). NaN for a run too short to have
    any step after those (e.g. a --steps smoke run)."""
    rows = [r for r in log if "tokens_per_s" in r]
    rows = rows[max([i for i in range(1, len(rows)) if rows[i]["step"] <= rows[i - 1]["step"]], default=0) :]
    a = next((r for r in rows if r["step"] >= rows[0]["step"] + skip), None)
    b = rows[-1]
    if a is None or a is b:
        return float("nan")
    tok_a, tok_b = a["tokens_per_s"] * a["elapsed_s"], b["tokens_per_s"] * b["elapsed_s"]
    return (tok_b - tok_a) / (b["elapsed_s"] - a["elapsed_s"])


def _complete(home: dict, variants: list[str]) -> dict:
    """Per set, the variants with both halves' files in their run directory: one whose files for a
    set did not all come back (a device run cut short) is left out of that set, not the eval."""
    return {s: [v for v in variants if all((home[v] / f"{v}-{s}-{h}.npz").exists() for h in HALVES)] for s in SETS}


def stage_eval(joint_outs: list[Path], index: Path, carry: Path, posthoc: Path, work: Path, workers: int) -> dict:
    """The joint runs' held-out perplexity beside the post-hoc variants and peers that
    benchmarks/index_size.py measured on the same text with the same index (its saved results,
    `posthoc`): the index here must be that one (same token count) and the runs' targets those of
    the carried held-out text, tokenized here. Several GPU runs' outputs may be given: each variant
    is read from the first that has it, and step rates are compared within a run only (each
    run's variants against its own plain)."""
    from teragram.index.bulk import continuations
    from teragram.index.engine import Index
    from teragram.index.heldout import DECONTAMINATION_SHARE
    from teragram.model.mixture import baselines
    from teragram.model.mixture.estimates import heldout_docs

    from benchmarks.index_size import contamination_share, heldout_features

    rows = [r for r in json.loads(posthoc.read_text())["indexes"] if r["index"] == index.name]
    if not rows:
        raise SystemExit(f"{posthoc} has no results for an index named {index.name}")
    ph = rows[0]
    tokens = json.loads((index / "manifest.json").read_text())["counts"]["tokens"]
    if tokens != ph["index_tokens"]:
        raise SystemExit(f"{index} holds {tokens:,} tokens, the post-hoc results' index {ph['index_tokens']:,}")
    idx = Index(index)
    res = {"index": index.name, "index_tokens": tokens, "posthoc_results": str(posthoc), "runs": [str(d) for d in joint_outs]}
    res |= {"sets": {}, "rates": {}}
    home = {}  # variant -> the run directory it is read from
    for d in joint_outs:
        gpu = json.loads((d / "joint_gpu.json").read_text())
        mine = [v for v in NAMES if v not in home and (d / f"{v}-indist-test.npz").exists()]
        home |= {v: d for v in mine}
        plain = _rate(gpu["plain"]["log"]) if "plain" in gpu else None  # rates compared within a run only
        for v in mine:
            if "train_s" in gpu.get(v, {}):
                r = _rate(gpu[v]["log"])
                res["rates"][v] = {"tokens_per_s": r, "vs_plain": r / plain if plain else "", "run": str(d)}
    variants = [v for v in NAMES if v in home and v != "knn"]
    peers = [d for d in joint_outs if (d / "knn-indist-test.npz").exists()]  # (d) from every run that has it: each set takes
    knn = bool(peers)  # the one best on its validation half (runs differ in their keys, model/mixture/knn.KEY_STATES)
    if knn:
        res["knn"] = {str(d): json.loads((d / "knn_gpu.json").read_text()) for d in peers}
    dense = next((home[v] / "knn_est.json" for v in home if v.startswith("knnj") and (home[v] / "knn_est.json").exists()), None)
    if dense is not None:
        res["knn_est"] = json.loads(dense.read_text())
    held = heldout_features(index, work / "held", carry, workers)
    whole = _complete(home, variants)
    res["missing"] = {s: [v for v in variants if v not in whole[s]] for s in SETS if len(whole[s]) < len(variants)}
    for s in SETS:
        row = {}
        if knn:  # temperature and λ fit on this set's validation sample, in each run; the run best there
            fits = []
            for d in peers:
                zv = np.load(d / f"knn-{s}-valid.npz")
                j, lam = knnlm.fit(zv["nll_a"], zv["p_knn"])
                loss = float(baselines.mix_nll(zv["nll_a"].astype(np.float64), zv["p_knn"][:, j], lam).mean())
                info = res["knn"][str(d)]
                fits.append({"run": str(d), "key": info.get("key", "final"), "valid_nll": loss, "column": j,
                             "temperature_factor": info["factors"][j], "lambda": lam})  # fmt: skip
            row["knn"] = min(fits, key=lambda f: f["valid_nll"]) | {"candidates": fits}
        for h in HALVES:
            docs = heldout_docs(held[s, h])
            target = np.concatenate([np.append(d, idx.eos_id) for d in docs]).astype(np.int32)  # each document's ids, then EOS
            doc = np.repeat(np.arange(len(docs)), [len(d) + 1 for d in docs])
            keep = None
            if h == "test":  # documents with >= 80% of their 13-grams in the index: index_size's rule
                if len(target) != ph["sets"][s]["test_tokens"]:
                    raise SystemExit(f"{s} test: {len(target):,} targets here, {ph['sets'][s]['test_tokens']:,} in the post-hoc results")
                lens = np.array([len(d) for d in docs])
                st = np.concatenate([[0], np.cumsum(lens)])
                L = continuations(idx, np.concatenate(docs), st, [0], threads=workers)[0].length
                first = st[:-1] + np.arange(len(docs))
                length = np.zeros(len(L) + len(docs), np.int64)
                m = np.ones(len(length), bool)
                m[first] = False
                length[m] = L
                starts = np.concatenate([[0], np.cumsum(lens + 1)])
                keep = (contamination_share({"index_length": length}, starts) < DECONTAMINATION_SHARE)[doc]
            for v in whole[s]:
                z = load_nll(home, v, s, h)
                if not np.array_equal(z["target"], target):
                    raise SystemExit(f"{v} {s}-{h}: the joint run's targets differ from the held-out text's here")
                r = row.setdefault(v, {})
                r[h] = float(np.exp(z["nll"].mean()))
                r[f"{h}_model_alone"] = float(np.exp(z["nll_model"].mean()))
                if keep is not None:
                    r["test_decontaminated"] = float(np.exp(z["nll"][keep].mean()))
            if knn:
                z = np.load(Path(row["knn"]["run"]) / f"knn-{s}-{h}.npz")
                rows = z["rows"] if "rows" in z else np.arange(len(target))  # older runs kept a sample of validation
                if not np.array_equal(z["target"], target[rows]) or (h == "test" and len(rows) != len(target)):
                    raise SystemExit(f"knn {s}-{h}: the kNN run's targets differ from the held-out text's here")
                r = row["knn"]
                nll = baselines.mix_nll(z["nll_a"].astype(np.float64), z["p_knn"][:, r["column"]], r["lambda"])
                r[h] = float(np.exp(nll.mean()))
                r[f"{h}_model_alone"] = float(np.exp(z["nll_a"].mean()))
                if keep is not None:
                    r["test_decontaminated"] = float(np.exp(nll[keep].mean()))
        p = ph["sets"][s]
        res["sets"][s] = {"joint": row, "posthoc": {k: p[k] for k in ("ppl", "ppl_valid", "ppl_decontaminated")}}
    return res


def replicates(res: dict, priors: list[Path]) -> dict:
    """Per replicated variant V and its refit Vr, per set: the decontaminated test perplexity of V
    and of each replicate in `res`, and of V in each earlier result (`priors`: this eval's JSON
    from other runs, same index and post-hoc results) that `res` lacks; mean, sd (n - 1) and the
    mean against post-hoc (t)."""
    old = []
    for p in priors:
        r = json.loads(p.read_text())
        if (r["index"], r["index_tokens"], Path(r["posthoc_results"]).name) != (
            res["index"],
            res["index_tokens"],
            Path(res["posthoc_results"]).name,
        ):
            raise SystemExit(f"{p}: another index or post-hoc results than this eval's ({r['index']}, {r['posthoc_results']})")
        old.append((p.stem, r))
    out: dict = {}
    for b in sorted({b for b, _ in REPLICATES.values()}):
        for suffix in ("", "r", "o", "or"):
            v = b + suffix
            for s, r in res["sets"].items():
                runs = {f"{v} (this eval)": r["joint"][v]["test_decontaminated"]} if v in r["joint"] else {}
                runs |= {
                    f"{v} ({n})": p["sets"][s]["joint"][v]["test_decontaminated"]
                    for n, p in old
                    if v not in r["joint"] and v in p["sets"][s]["joint"]
                }
                runs |= {
                    f"{rep}{suffix}": r["joint"][rep + suffix]["test_decontaminated"]
                    for rep, (bb, _) in REPLICATES.items()
                    if bb == b and rep + suffix in r["joint"]
                }
                if len(runs) > 1:
                    x = np.array(list(runs.values()))
                    t = r["posthoc"]["ppl_decontaminated"]["t"]
                    out.setdefault(v, {})[s] = {
                        "runs": runs,
                        "mean": float(x.mean()),
                        "sd": float(x.std(ddof=1)),
                        "vs_t": float(x.mean() / t),
                    }
    return out


def report(res: dict, name: str = "joint") -> None:
    names = {"a": "(a) no index", "c": "(c) infini-gram interpolation", "c+c": "(c+cache) infini-gram + document cache"}
    names |= {"a+c": "(a+c) post-hoc cache gate", "t-c": "(t-c) post-hoc index gate", "t": "(t) post-hoc index + cache gate"}
    lines = []
    valid = {v: j["valid"] for v, j in res["sets"].get("indist", {}).get("joint", {}).items() if v in TRAINED and v not in REPLICATES}
    if valid:  # the headline among the trained variants, by validation only (a refit's validation is its fit's)
        v = min(valid, key=valid.get)
        lines += [
            f"Chosen on the in-distribution validation half among the trained joint variants (gates as trained): {NAMES[v]} ({valid[v]:.4g}).",
            "",
        ]
    for s, r in res["sets"].items():
        rows = []
        for k, n in names.items():
            if k in r["posthoc"]["ppl"]:
                p = r["posthoc"]
                rows.append(
                    {"variant": n, "valid": p["ppl_valid"][k], "test": p["ppl"][k], "test decontaminated": p["ppl_decontaminated"][k]}
                )
        for v, j in r["joint"].items():
            rows.append(
                {"variant": NAMES[v], "valid": j["valid"], "test": j["test"], "test decontaminated": j["test_decontaminated"],
                 "its LM alone (test)": j["test_model_alone"]}
            )  # fmt: skip
        cols = ["variant", "valid", "test", "test decontaminated", "its LM alone (test)"]
        lines += [f"**{s}** (perplexity)", "", table(rows, cols), ""]
        peers = {k: r["posthoc"]["ppl_decontaminated"][k] for k in ("c", "c+c") if k in r["posthoc"]["ppl_decontaminated"]}
        if "knn" in r["joint"]:
            peers["d"] = r["joint"]["knn"]["test_decontaminated"]
            lines.append(
                f"- {s}: kNN-LM fit on validation: temperature {r['joint']['knn']['temperature_factor']} x the median nearest "
                f"distance, λ {r['joint']['knn']['lambda']}"
                + (
                    f"; keys: {r['joint']['knn']['key']} states, the lower validation perplexity of "
                    + " and ".join(f"{c['key']} ({math.exp(c['valid_nll']):.4g})" for c in r["joint"]["knn"]["candidates"])
                    if len(r["joint"]["knn"].get("candidates", ())) > 1
                    else ""
                )
                + "."
            )
        best = min(peers, key=peers.get)
        t = r["posthoc"]["ppl_decontaminated"]["t"]
        for v, j in r["joint"].items():
            if v != "knn":
                d = j["test_decontaminated"]
                lines.append(
                    f"- {s}: {NAMES[v].split(' ')[0]} {d:.3g} vs post-hoc (t) {t:.3g} = {d / t:.3f}x; "
                    f"{100 * (1 - d / peers[best]):.1f}% below the best peer ({best}: {peers[best]:.3g})."
                )
        lines.append("")
    for s, vs in res.get("missing", {}).items():
        lines += [f"- {s}: not scored, their files did not all come back: {', '.join(NAMES[v].split(' ')[0] for v in vs)}.", ""]
    for run, k in res.get("knn", {}).items():
        lines.append(
            f"(d) in {Path(run).name}: {k['keys']:,} keys (every training position), {k['centroids']} inverted lists, {k['nprobe']} probed, "
            f"k = {k['k']}; recall of the {k['k']} neighbours against exact search on {knnlm.RECALL_ROWS:,} validation "
            f"queries {k['recall_at_k']:.3f} (nearest neighbour the same: {k['nearest_exact_share']:.3f}); datastore "
            f"{k['keys_s']:.0f} s, search {sum(v for n, v in k.items() if 'search_' in n):.0f} s on the GPU; its temperature and λ fit on "
            + (
                f"the validation halves, its temperatures' scale the median nearest distance of {knnlm.VALID_ROWS:,} of their targets per set."
                if "key" not in k
                else f"the validation halves, its temperatures' scale the in-distribution validation's median nearest distance; keys: (a)'s "
                f"{KEY_NAMES[k['key']]}, dense_knn's store (chosen on validation: below)."
            )
        )
        lines.append("")
    if "knn_est" in res:
        k = res["knn_est"]
        searched = k["keys"] - k.get("unsearched", 0)
        lines.append(
            f"The dense components' store (the (j+lm+knn) variants'): the kNN-LM over (a), k = {k['k']} neighbours among {k['nprobe']} of {k['centroids']} lists, "
            f"temperature {k['temperature_factor']} x the in-distribution validation's median nearest distance ({k['temperature_scale']:.4g}), "
            f"fit there (the other dense components: {', '.join(f'{m}x' for m in k.get('temperature_multiples', [1.0])[1:]) or 'none'} it); p(target) against k = 1024's on {knnlm.VALID_ROWS:,} validation targets: mean |difference| "
            f"{k['k_vs_1024_mean_abs']:.4f}, max {k['k_vs_1024_max_abs']:.3f}. Training positions searched (exclude-doc): "
            f"{searched:,} of {k['keys']:,} ({100 * searched / k['keys']:.0f}%; the rest defer to the model)."
            + (
                f" Keys: (a)'s {KEY_NAMES[k['key']]}, chosen on the in-distribution validation half by the kNN-LM's loss over a store of "
                f"every {knnlm.SELECT_EVERY}rd training window's positions, temperature and λ fit there: "
                + "; ".join(
                    f"{KEY_NAMES[x]} {c['valid_nll']:.4f} nats (perplexity {math.exp(c['valid_nll']):.3g}; (a) alone {math.exp(c['model_nll']):.3g}, "
                    f"{c['keys']:,} keys, temperature {c['temperature_factor']}, λ {c['lambda']})"
                    for x, c in k["key_choice"].items()
                )
                + "."
                if "key_choice" in k
                else f" Keys: (a)'s {KEY_NAMES[k.get('key', 'final')]}" + (" (given: --knn-key)." if "key" in k else ".")
            )
        )
        lines.append("")
    for b, per in res.get("replicates", {}).items():
        rows = []
        for st, r in per.items():
            runs = "; ".join(f"{k} {v:.4g}" for k, v in r["runs"].items())
            rows.append(
                {
                    "set": st,
                    "runs": runs,
                    "mean": r["mean"],
                    "sd": r["sd"],
                    "mean / post-hoc (t)": r["vs_t"],
                    "spread / mean": r["sd"] / r["mean"],
                }
            )
        lines += [
            f"**Replicates of {NAMES[b].split(' ')[0]}** (decontaminated test perplexity; runs differ in the joint training's seed, "
            "and runs of other preps in (a) and its store too):",
            "",
            table(rows, ["set", "runs", "mean", "sd", "mean / post-hoc (t)", "spread / mean"]),
            "",
        ]
    if res["rates"]:
        rows = [
            {"variant": v, "tokens/s after step 100": r["tokens_per_s"], "vs plain": r["vs_plain"], "run": Path(r["run"]).name}
            for v, r in res["rates"].items()
        ]
        lines.append(table(rows, ["variant", "tokens/s after step 100", "vs plain", "run"]))
    save(name, res, "\n".join(lines), _figure(res, names))


def _figure(res: dict, names: dict):
    """Per set, decontaminated test perplexity of each peer and joint variant against post-hoc
    (t)'s, beside the issue's bar (0.9x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(res["sets"]), figsize=(5 * len(res["sets"]), 0.5 + 0.32 * (3 + len(NAMES))), sharey=True)
    for ax, (s, r) in zip(np.atleast_1d(axes), res["sets"].items()):
        dec = r["posthoc"]["ppl_decontaminated"]
        rows = [(names[k].split(" ")[0], dec[k]) for k in ("c+c", "a+c") if k in dec]
        rows += [(NAMES[v].split(" ")[0], j["test_decontaminated"]) for v, j in r["joint"].items()]
        y, x = np.arange(len(rows)), np.array([v / dec["t"] for _, v in rows])
        ax.barh(y, x, color=["#37a" if n.startswith("(j") else "#999" for n, _ in rows])
        ax.set_xlim(0.7, 1.5)  # a peer beyond it: its bar cut, its value written
        for yi, xi in zip(y, x):
            ax.text(min(xi, 1.49), yi, f" {xi:.3f} ", va="center", ha="right" if xi > 1.49 else "left", fontsize=8)
        ax.axvline(1.0, color="k", lw=1)
        ax.axvline(0.9, color="r", ls="--", lw=1, label="bar: 0.9x (t)")
        ax.set_yticks(y, [n for n, _ in rows])
        ax.set_title(f"{s}: (t) = {dec['t']:.3g}")
        ax.set_xlabel("decontaminated test perplexity / post-hoc (t)")
        ax.invert_yaxis()
    np.atleast_1d(axes)[0].legend(loc="lower right")
    fig.tight_layout()
    return fig


SMOKE_VARIANTS = "a,knnest,knnj3"  # the plain model; the dense estimates, with the peer (d) over their store; a joint model reading them
SMOKE_TEXT = 1000  # characters kept of each training document of a smoke run: ~4k training positions
SMOKE_HELD = (8, 150)  # a smoke run's held-out half: 8 documents (experiments/gate_headroom holds out its 8th) of 150 characters
SMOKE_LISTS = 2  # a smoke run's kNN store's inverted lists: its searches (k = 1024) take seconds on CPU


def _smoke_carry(carry: Path) -> None:
    """Cut the carried text down to smoke size: each training document to its first SMOKE_TEXT
    characters; each held-out half to SMOKE_HELD's documents, consecutive pieces of its text."""
    import zstandard

    from benchmarks.common import read_jsonl

    for f in carry.rglob("*.jsonl.zst"):
        docs = list(read_jsonl(f))
        if f.name.startswith("train-"):
            docs = [r | {"text": r["text"][:SMOKE_TEXT]} for r in docs]
        else:
            n, size = SMOKE_HELD
            pieces = [(r, i) for r in docs for i in range(0, len(r["text"]), size)][:n]
            docs = [r | {"text": r["text"][i : i + size], "path": f"{r['path']}#{i}"} for r, i in pieces]
        with zstandard.open(f, "wt", encoding="utf-8") as z:
            z.writelines(json.dumps(r) + "\n" for r in docs)


def smoke_stages(root: Path) -> Path:
    """The GPU machine's stages at smoke scale, on CPU, into ROOT: index_size's prepare on a tiny
    DATA (ROOT/carry, cut down by _smoke_carry), prep and train (--refit --own-store) of
    SMOKE_VARIANTS for 3 steps of the tiny model with a SMOKE_LISTS-list kNN store keyed by the
    final states (ROOT/work, ROOT/out; knnlm.run and choose_key, left out here, are tested in
    tests/), and the post-hoc variants on the same index (index_size's eval of (a)'s outputs:
    ROOT/posthoc.json), which `eval` compares them with. Gate fits are shortened
    (smoke_short_fits) and torch runs one thread (its tensors are tiny; more threads only
    contend on a small machine) unless $OMP_NUM_THREADS says otherwise: for a smoke process only."""
    import torch

    from benchmarks import index_size
    from benchmarks.common import smoke_data, smoke_short_fits

    smoke_short_fits()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the stages' processes too
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    carry, work, out = root / "carry", root / "work", root / "out"
    index_size.main(["prepare", "--data", str(smoke_data(root)), "--carry", str(carry), "--max-mb", "0.001"])
    _smoke_carry(carry)
    work.mkdir(parents=True, exist_ok=True)
    gpu = ["gpu", "--carry", str(carry), "--work", str(work), "--out", str(out), "--scale", "cpu", "--steps", "3"]
    gpu += ["--knn-lists", str(SMOKE_LISTS), "--knn-key", "final"]
    main([*gpu, "--stage", "prep", "--variants", SMOKE_VARIANTS])
    main([*gpu, "--stage", "train", "--variants", SMOKE_VARIANTS, "--refit", "--own-store"])
    res = index_size.stage_eval(out, [work / "idx"], 1)
    (root / "posthoc.json").write_text(json.dumps(res, indent=1, default=float))
    return root


def smoke_joint(tmp: Path) -> Path:
    """A joint run at smoke scale (smoke_stages: carry/, work/ with work/idx, out/, posthoc.json):
    $TERAGRAM_SMOKE_JOINT when set (the smoke test makes one for every script that reads it),
    else made under tmp."""
    if os.environ.get("TERAGRAM_SMOKE_JOINT"):
        return Path(os.environ["TERAGRAM_SMOKE_JOINT"])
    root = tmp / "smoke-joint"
    return root if (root / "posthoc.json").exists() else smoke_stages(root)


@contextmanager
def smoke_study() -> Iterator[tuple[Path, Path]]:
    """For a study's --smoke (experiments/): gate fits as short as the smoke run's (so that a (t)
    refit gives its figure), a temporary folder and the joint smoke run: (tmp, run)."""
    from benchmarks.common import smoke_context, smoke_short_fits

    smoke_short_fits()
    with smoke_context(True) as tmp:
        yield tmp, smoke_joint(tmp)


def smoke() -> int:
    """Every stage at smoke scale (smoke_joint), then `eval` of its run against its post-hoc results."""
    from benchmarks.common import smoke_context

    with smoke_context(True) as tmp:
        root = smoke_joint(tmp)
        args = ["--joint", str(root / "out"), "--index", str(root / "work" / "idx"), "--carry", str(root / "carry")]
        args += ["--posthoc", str(root / "posthoc.json"), "--work", str(root / "work"), "--workers", "1"]
        return main(["eval", *args])


def main(argv: list[str] | None = None) -> int:
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):
        return smoke()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["gpu", "eval"])
    ap.add_argument("--carry", type=Path)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--stage", dest="gpu_stage", choices=["prep", "train", "all"], default="all")
    ap.add_argument("--variants", default="a,plain,joint")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument(
        "--then",
        default="",
        help="prep: variants over (a) to start on the GPU once (a) is trained, beside the estimates (knnest: the search only)",
    )
    ap.add_argument("--seed", type=int, default=7, help="the training runs' seed (7: every published run's; others for replicates)")
    ap.add_argument(
        "--refit",
        action="store_true",
        help="train: also refit each joint variant's gate on each set's validation half (outputs Vr-*, Vrh-*)",
    )
    ap.add_argument(
        "--own-store",
        action="store_true",
        help="train, with --refit: also score each variant reading the dense components over a store keyed by its own states (Vo-*)",
    )
    ap.add_argument("--scale", choices=["gpu", "cpu"], default="gpu", help="gpu: the 125M; cpu: the tiny model (a smoke test)")
    ap.add_argument(
        "--knn-key", choices=["auto", *knnlm.KEY_STATES], default="auto", help="knnest: the store's keys (auto: chosen on validation)"
    )
    ap.add_argument("--no-knn-peer", action="store_true", help="knnest: leave out the peer (d) over the same store (k = 1024)")
    ap.add_argument(
        "--knn-lists",
        type=int,
        default=knnlm.CENTROIDS,
        help="knn, knnest: the datastore's inverted lists (a smoke run's tiny store: a few)",
    )
    ap.add_argument("--joint", type=Path, nargs="+", help="eval: the GPU runs' outputs (a variant: from the first that has it)")
    ap.add_argument("--index", type=Path, help="eval: the model's index, here (DATA/idx-050m)")
    ap.add_argument("--prior", type=Path, nargs="+", help="eval: earlier results (JSON) whose variants replicated here count as runs")
    ap.add_argument("--posthoc", type=Path, default=Path(__file__).parent / "results" / "index_size_050m.json")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--name", default="joint", help="eval: the results' name (benchmarks/results/NAME.md)")
    a = ap.parse_args(argv)
    if a.stage == "gpu":
        if a.own_store and not a.refit:
            raise SystemExit("--own-store scores the variants with their gates refit too: give --refit")
        a.out.mkdir(parents=True, exist_ok=True)
        variants = a.variants.split(",")
        if a.gpu_stage in ("prep", "all"):
            joint_inputs = bool(set(variants) & set(VARIANTS) - {"plain"})  # a joint variant will train: its estimates
            then = tuple(a.then.split(",")) if a.then else ()
            if set(then) - THEN_OK:
                raise SystemExit(f"--then {a.then}: only {', '.join(sorted(THEN_OK))} (over (a), GPU only) can run beside prep")
            knn_args = ("--knn-key", a.knn_key, "--knn-lists", str(a.knn_lists)) + (("--no-knn-peer",) if a.no_knn_peer else ())
            ph, follow = stage_prep(a.carry, a.work, a.scale, a.steps, a.seed, joint_inputs, then, a.out, knn_args, tuple(variants))
            (a.out / "prep.json").write_text(json.dumps(ph))
            if any([p.wait() for p in follow]):
                raise SystemExit(f"--then {a.then} failed: see {a.work / 'train-then.log'}")
        if a.gpu_stage in ("train", "all"):
            stage_train(
                a.carry, a.work, a.out, variants, a.steps, a.scale, a.refit, a.seed, a.knn_key, not a.no_knn_peer, a.own_store, a.knn_lists
            )
    else:
        res = stage_eval(a.joint, a.index, a.carry, a.posthoc, a.work or Path("/tmp/joint-eval"), a.workers)
        res["replicates"] = replicates(res, a.prior or [])
        report(res, a.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
