"""Held-out evaluation: per-token log-probabilities, perplexity and bits per byte.

Each held-out document is read as EOS + its tokens and predicts its tokens + EOS, in windows
of the model's context (no window spans two documents); every token is predicted once.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from .data import EvalData
from .gpt import GPT, IndexBatch


@torch.no_grad()
def token_eval(model: GPT, heldout: str | Path, eos: int, sep: int, device: str = "cpu", *, batch: int = 16, hidden: bool = False) -> dict:
    """Per predicted token: nll (mixture when the model has one), nll_model (the model's own
    softmax), maxp and top (its most likely token and that token's probability), target, doc
    (document number), pos (index of the target in EOS+doc+EOS order minus one), and with
    hidden=True the final hidden state (for kNN-LM queries)."""
    ev = EvalData(heldout, model.cfg.block_size, eos, sep)
    was = model.training
    model.eval()
    cuda = str(device).startswith("cuda")
    out: dict[str, list] = {k: [] for k in ("nll", "nll_model", "maxp", "top", "target", "doc", "pos", "hidden")}
    buf: list = []

    def flush():
        T = max(len(b[0]) for b in buf)
        n = len(buf)
        x = torch.full((n, T), eos, dtype=torch.long)
        y = torch.full((n, T), eos, dtype=torch.long)
        mask = torch.zeros((n, T), dtype=torch.bool)
        fs = [torch.zeros((n, T), dtype=torch.long), torch.full((n, T), -1, dtype=torch.long), torch.zeros((n, T), dtype=torch.long)]
        fs += [torch.full((n, T, ev.k), -1, dtype=torch.long), torch.zeros((n, T, ev.k), dtype=torch.long)]
        for i, (xx, yy, ff, _, _) in enumerate(buf):
            m = len(xx)
            x[i, :m], y[i, :m], mask[i, :m] = torch.from_numpy(xx), torch.from_numpy(yy), True
            for j in range(5):
                fs[j][i, :m] = torch.from_numpy(ff[j])
        f = IndexBatch(*fs).to(device) if model.cfg.use_index else None
        xd, yd = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            h, _ = model.hidden(xd, f)
            nll, logp = model.head_losses(h, yd, f)
        nll_model = -logp.gather(-1, yd.unsqueeze(-1)).squeeze(-1)
        maxlp, top = logp.max(-1)
        mk = mask.to(device)
        out["nll"].append(nll[mk].cpu().numpy())
        out["nll_model"].append(nll_model[mk].cpu().numpy())
        out["maxp"].append(maxlp[mk].exp().cpu().numpy())
        out["top"].append(top[mk].cpu().numpy())
        out["target"].append(y[mask].numpy())
        if hidden:
            out["hidden"].append(h.float()[mk].cpu().numpy())
        for xx, _, _, d, s in buf:
            out["doc"].append(np.full(len(xx), d))
            out["pos"].append(np.arange(s, s + len(xx)))
        buf.clear()

    for d, s, xx, yy, ff in ev.windows():
        buf.append((xx, yy, ff, d, s))
        if len(buf) == batch:
            flush()
    if buf:
        flush()
    model.train(was)
    res = {k: np.concatenate(v) if v else np.zeros(0) for k, v in out.items()}
    return res


def doc_bytes(ev: EvalData, decode) -> np.ndarray:
    """UTF-8 bytes of each held-out document's text."""
    return np.array(
        [
            len(decode(np.asarray(ev.tokens[int(ev.starts[d]) : int(ev.starts[d + 1]) - 1]).tolist()).encode())
            for d in range(len(ev.starts) - 1)
        ]
    )


def summarize(nll: np.ndarray, nbytes: int) -> dict:
    n = len(nll)
    tot = float(np.sum(nll))
    return {
        "tokens": n,
        "loss": tot / max(n, 1),
        "perplexity": math.exp(tot / max(n, 1)),
        "bits_per_byte": tot / math.log(2) / max(nbytes, 1),
        "bytes": int(nbytes),
    }


def evaluate(model: GPT, heldout: str | Path, eos: int, sep: int, device: str = "cpu", batch: int = 16) -> dict:
    """Perplexity and bits per byte of the held-out features' text."""
    from teragram.index.tokenizer import load

    r = token_eval(model, heldout, eos, sep, device, batch=batch)
    ev = EvalData(heldout, model.cfg.block_size, eos, sep)
    sp = load(Path(heldout) / "tokenizer.model")
    return summarize(r["nll"], int(doc_bytes(ev, sp.decode).sum()))
