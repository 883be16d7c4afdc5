"""Generation with live index lookups: every new token is appended to the index's incremental
scorer, whose features for it feed the next step; keys and values are cached.

    teragram sample --checkpoint RUN --index IDX "prompt" [--max-tokens 100] [--temperature 0.8]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from teragram.index.engine import Index
from teragram.index.features import Features

from .gate import next_distribution
from .gpt import GPT, to_torch


@dataclass
class Generation:
    ids: list[int]  # prompt + generated
    n_prompt: int
    features: list[Features]  # one row per position, as seen while generating
    stopped: str  # "eos", "stop", "length"

    @property
    def new_ids(self) -> list[int]:
        return self.ids[self.n_prompt :]

    def long_matches(self, at_least: int = 16) -> int:
        """Generated tokens whose context had an index match of at least this many tokens."""
        return sum(int(f.length[0]) >= at_least for f in self.features[self.n_prompt - 1 : -1])


def _batch(rows: list[Features], device) -> Features:
    return to_torch(Features.combine(rows).map(lambda a: a[None]), device)  # (1, T) / (1, T, k)


def _pick(p: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    """Sample from probabilities p (V,) with temperature, top-k and nucleus filtering."""
    if temperature <= 0:
        return int(p.argmax())
    logp = torch.log(p.clamp_min(1e-30)) / temperature
    if top_k > 0:
        kth = torch.topk(logp, min(top_k, logp.numel())).values[-1]
        logp = torch.where(logp < kth, torch.full_like(logp, -float("inf")), logp)
    q = torch.softmax(logp, -1)
    if 0 < top_p < 1:
        srt, order = torch.sort(q, descending=True)
        keep = torch.cumsum(srt, 0) - srt < top_p
        q = torch.zeros_like(q).scatter(0, order[keep], srt[keep])
        q = q / q.sum()
    return int(torch.multinomial(q, 1, generator=gen))


@torch.no_grad()
def stream(
    model: GPT,
    idx: Index,
    prompt: list[int],
    *,
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop: list[list[int]] | None = None,
    seed: int = 0,
    state: dict | None = None,
    gate=None,
):
    """Yield (token, features of the new position) one generated token at a time.
    `state` (a dict, optional) receives "features" (all positions so far) and "stopped".
    With `gate` (model.gate.Gate) the model's distribution is mixed with the index's ∞-gram
    and fixed-order estimates, and the document cache's, for the document so far."""
    if not prompt:
        prompt = [idx.eos_id]  # an empty prompt starts a document
    state = {} if state is None else state
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    use_index = model.cfg.use_index
    sc = idx.scorer(top_k=model.cfg.top_k, max_len=model.cfg.max_match)
    feats = [sc.append(t) for t in prompt]
    state["features"] = feats
    state["stopped"] = "length"
    ids = list(prompt)
    gen = torch.Generator().manual_seed(seed)
    B = model.cfg.block_size
    kv = None
    pos0 = 0
    x = torch.tensor([ids[-B:]], device=device)
    f = _batch(feats[-B:], device) if use_index else None
    try:
        for _ in range(max_new_tokens):
            h, kv = model.hidden(x, f, kv, pos0)
            pos0 += x.shape[1]
            p = model.next_distribution(h[:, -1], _batch(feats[-1:], device) if use_index else None)[0].cpu()
            if gate is not None:
                doc = ids[1:] if ids[0] == idx.eos_id else ids
                soft = torch.softmax(model.lm_head(h[:, -1]).float(), -1)[0].cpu().double().numpy()
                p = torch.from_numpy(next_distribution(idx, doc, p.double().numpy(), gate, soft)).float()
            tok = _pick(p, temperature, top_k, top_p, gen)
            ids.append(tok)
            feats.append(sc.append(tok))
            yield tok, feats[-1]
            if tok == idx.eos_id:
                state["stopped"] = "eos"
                return
            if stop and any(len(s) and ids[-len(s) :] == s for s in stop):
                state["stopped"] = "stop"
                return
            if pos0 >= B:  # context full: recompute the last B tokens without the cache
                kv, pos0 = None, 0
                x = torch.tensor([ids[-B:]], device=device)
                f = _batch(feats[-B:], device) if use_index else None
            else:
                x = torch.tensor([[tok]], device=device)
                f = _batch(feats[-1:], device) if use_index else None
    finally:
        model.train(was)


def generate(model: GPT, idx: Index, prompt: list[int], **kw) -> Generation:
    """Generate to the end (see stream for the arguments)."""
    state: dict = {}
    new = [tok for tok, _ in stream(model, idx, prompt, state=state, **kw)]
    prompt = prompt or [idx.eos_id]
    return Generation(list(prompt) + new, len(prompt), state["features"], state["stopped"])
