"""Generation with live index lookups: every new token is appended to the index's incremental
scorer, whose features for it feed the next step; keys and values are cached.

    teragram sample --checkpoint RUN --index IDX "prompt" [--max-tokens 100] [--temperature 0.8]
                    [--draft 8] [--provenance] [--verbose] [--cluster ADDRESS]

With drafts (model/generation/draft.py) each forward pass verifies up to N tokens read off the longest
exact match of the context, in the index or earlier in the text, and keeps the longest prefix
the model agrees with plus one token of its own: greedy decoding gives the same tokens as
without drafts, and sampling the same distribution (speculative sampling with a draft that is
one token for sure: accept it with the target's probability of it, else sample the target
without it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from teragram.index.engine import Index, Provenance
from teragram.index.features import Features
from teragram.model.generation.draft import Draft, Drafter, DraftStats
from teragram.model.gpt import GPT, to_torch
from teragram.model.mixture.cont_cache import LiveCache, key_states
from teragram.model.mixture.gate import index_lengths, next_mixture

PROVENANCE_MIN = 8  # a token's provenance is reported when its context matches this many tokens


@dataclass(frozen=True)
class Token:
    id: int
    features: Features  # the index features of the new position (one row)
    provenance: Provenance | None  # the document of its longest match (>= PROVENANCE_MIN), when asked for
    drafted: bool  # an accepted draft token (else the model's own pick)
    gate_weights: np.ndarray | None = None  # with a gate: its weights when this token was drawn (the model, then gate.components)


@dataclass
class Generation:
    ids: list[int]  # prompt + generated
    n_prompt: int
    features: list[Features]  # one row per position, as seen while generating
    stopped: str  # "eos", "stop", "length"
    provenance: list[Provenance | None]  # per generated token (empty unless asked for)
    stats: DraftStats

    @property
    def new_ids(self) -> list[int]:
        return self.ids[self.n_prompt :]

    def long_matches(self, at_least: int = 16) -> int:
        """Generated tokens whose context had an index match of at least this many tokens."""
        return sum(int(f.length[0]) >= at_least for f in self.features[self.n_prompt - 1 : -1])


def _batch(rows: list[Features], device) -> Features:
    return to_torch(Features.combine(rows).map(lambda a: a[None]), device)  # (1, T) / (1, T, k)


def _target(p: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution sampled from (V,): p with temperature, top-k and nucleus filtering."""
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
    return q


def _verify(p: torch.Tensor, draft: list[int], temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> tuple[int, int]:
    """How many draft tokens to keep, and the token after them, from the distributions p
    (n + 1, V) at the draft's positions (row j predicts draft[j]; the last row follows the
    whole draft). Greedy: the drafts the argmax agrees with, then the argmax. Sampling: draft
    token d is kept with probability q(d) (q: the filtered target); at the first rejection the
    token is drawn from q without d -- together exactly a draw from q."""
    if temperature <= 0:
        best = p.argmax(-1).tolist()
        j = 0
        while j < len(draft) and best[j] == draft[j]:
            j += 1
        return j, best[j]
    p = p.float().cpu()
    for j, d in enumerate(draft):
        q = _target(p[j], temperature, top_k, top_p)
        if float(torch.rand((), generator=gen)) < float(q[d]):
            continue
        q[d] = 0.0
        return j, int(torch.multinomial(q / q.sum(), 1, generator=gen))
    return len(draft), int(torch.multinomial(_target(p[-1], temperature, top_k, top_p), 1, generator=gen))


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
    draft: int | Drafter = 0,
    provenance: bool = False,
):
    """Yield a Token per generated token. `idx`: an Index, or a ClusterIndex (index/cluster.py),
    whose holders keep the scorer's state beside their shards (index/cluster_scorer.py).
    `state` (a dict, optional) receives "features" (all positions so far), "stopped" and
    "stats" (DraftStats of this call). With `gate` (model.gate.Gate) the model's distribution
    is mixed with the index's ∞-gram and fixed-order estimates, and the document cache's, for
    the document so far. `draft`: the longest draft (0: none), or a Drafter to use (and to
    keep learning in). `provenance`: give each token the document of its longest index match."""
    if not prompt:
        prompt = [idx.eos_id]  # an empty prompt starts a document
    drafter = draft if isinstance(draft, Drafter) else Drafter(max_tokens=int(draft))
    state = {} if state is None else state
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    use_index = model.cfg.use_index
    sc = idx.scorer(top_k=model.cfg.top_k, max_len=model.cfg.max_match)
    feats = [sc.append(t) for t in prompt]
    lengths = index_lengths(gate) if gate is not None else {}
    est = sc.estimates(lengths) if lengths else None  # the gate's index estimates after the last token
    stats = DraftStats()
    state.update(features=feats, stopped="length", stats=stats)
    ids = list(prompt)
    gen = torch.Generator().manual_seed(seed)
    B = model.cfg.block_size
    start = max(0, len(ids) - B)  # the window: keys/values of ids[start : start + cached] are cached
    kv, cached = None, 0
    made = 0
    # the index's longest match is looked up only for what needs it: drafts, provenance
    want_occ = (drafter.max_tokens > 0 and "index" in drafter.sources) or provenance
    occ = sc.occurrence() if want_occ else None
    # a gate reading the continuous cache: the key states of every position so far, with the token after each
    cache = LiveCache(gate.cont_cache, model.cfg.vocab_size) if gate is not None and gate.cont_cache is not None else None
    mix = dict(temperature=temperature, gate=gate, cache=cache, ests=None)  # what the next-token distributions read

    try:
        while made < max_new_tokens:
            if len(ids) - start > B:  # the context is full: a window of the last B tokens, recomputed
                start, kv, cached = len(ids) - B, None, 0
            pending = ids[start + cached :]
            room = min(B - (len(ids) - start), max_new_tokens - made - 1)  # predictions this window still allows
            d: Draft | None = drafter.propose(sc, occ, ids, room) if drafter.max_tokens else None
            dt = d.tokens if d else []
            drows, dests = _drafted(sc, dt, lengths) if dt and (use_index or lengths) else ([], [])
            x = torch.tensor([pending + dt], device=device)
            f = _batch(feats[len(feats) - len(pending) :] + drows, device) if use_index else None
            mix["ests"] = [est, *dests] if lengths else None
            h, kv, cache_states = _forward(model, x, f, kv, cached, cache, start + cached, ids + dt, len(dt) + 1)
            p, weights = _distributions(model, idx, h[0, -(len(dt) + 1) :], [feats[-1], *drows], ids + dt, cache_states=cache_states, **mix)
            n_ok, nxt = _verify(p, dt, temperature, top_k, top_p, gen)
            if cache is not None:  # keep the accepted positions; the last one's next token is nxt
                cache.truncate(len(ids) - 1 + n_ok)
                cache.add(len(ids) - 1 + n_ok, cache_states[n_ok], nxt)
            cached += len(pending) + n_ok
            if n_ok < len(dt):
                kv = model.crop_cache(kv, cached)
            new = dt[:n_ok] + [nxt]
            stats.record(d, n_ok, len(new))
            drafter.stats.record(d, n_ok, len(new))
            for j, tok in enumerate(new):
                ids.append(tok)
                feats.append(sc.append(tok))
                occ = sc.occurrence() if want_occ else None
                prov = idx.provenance(occ) if provenance and occ is not None and occ.length >= PROVENANCE_MIN else None
                made += 1
                yield Token(tok, feats[-1], prov, j < n_ok, weights[j] if weights else None)
                if tok == idx.eos_id:
                    state["stopped"] = "eos"
                    return
                if stop and any(len(s) and ids[-len(s) :] == s for s in stop):
                    state["stopped"] = "stop"
                    return
            est = sc.estimates(lengths) if lengths else None
    finally:
        model.train(was)
        sc.close()
        stats.add_lookups(sc.lookup_s[len(prompt) :])
        drafter.stats.add_lookups(sc.lookup_s[len(prompt) :])


def _drafted(sc, dt: list[int], lengths: dict[str, int]) -> tuple[list[Features], list]:
    """The drafted positions' features and the gate's estimates after each (none without
    lengths), the scorer left as it was."""
    snap = sc.snapshot()
    rows, ests = [], []
    for t in dt:
        rows.append(sc.append(t))
        ests.append(sc.estimates(lengths) if lengths else None)
    sc.restore(snap)
    return rows, ests


def _distributions(
    model: GPT,
    idx: Index,
    h: torch.Tensor,
    rows: list[Features],
    toks: list[int],
    *,
    temperature: float,
    gate,
    cache,
    cache_states,
    ests,
) -> tuple[torch.Tensor, list[np.ndarray]]:
    """Next-token distributions (n, V), and the gate's weights for each (none without a gate), from the last n hidden states h (n, C), rows their
    positions' features, toks the text up to the first of them (greedy: what is argmaxed);
    the continuous cache (a LiveCache, if the gate reads it) holds the positions before the last
    of them, cache_states their key states; ests the gate's index estimates of each row (the
    incremental scorer's, None: looked up from scratch)."""
    device = h.device
    use_index = model.cfg.use_index
    if temperature <= 0 and gate is None and not (use_index and model.cfg.mixture):
        return model.lm_head(h), []  # greedy from the model alone: its logits have the same argmax
    f = to_torch(Features.combine(rows).map(lambda a: a[:, None]), device) if use_index else None
    p = model.next_distribution(h, f)
    if gate is None:
        return p, []
    soft = torch.softmax(model.lm_head(h).float(), -1).cpu().double().numpy()
    out, weights = [], []
    for j in range(len(h)):
        n = len(toks) - len(h) + 1 + j  # the tokens before this row's prediction
        doc = _doc(toks, n, idx.eos_id)
        ccd = cache.distributions(cache_states[j], upto=n - 1) if cache is not None else None
        e = ests[j] if ests is not None else None
        mixed, w = next_mixture(idx, doc, p[j].cpu().double().numpy(), gate, soft[j], ccd, e)
        out.append(torch.from_numpy(mixed).float())
        weights.append(w)
    return torch.stack(out), weights


def _forward(model: GPT, x, f, kv, cached: int, cache: LiveCache | None, p0: int, known: list[int], n_rows: int):
    """One forward pass of x (its first token at position p0 of the text), with the key states of
    its positions added to the continuous cache when one is kept (every position but the last of
    `known`, the text with the draft, has its next token): (h, kv, the last n_rows' key states)."""
    if cache is None:
        h, kv = model.hidden(x, f, kv, cached)
        return h, kv, None
    with key_states(model, cache.spec.key) as got:
        h, kv = model.hidden(x, f, kv, cached)
    keys = got[-1][0].double().cpu().numpy()  # (len(x), C)
    for pos in range(max(cache.end, p0), len(known) - 1):
        cache.add(pos, keys[pos - p0], known[pos + 1])
    return h, kv, keys[-n_rows:]


def _doc(toks: list[int], n: int, eos: int) -> list[int]:
    """The document so far in the first n tokens (a leading EOS starts it, and is not part of it)."""
    doc = toks[:n]
    return doc[1:] if doc and doc[0] == eos else doc


def generate(model: GPT, idx: Index, prompt: list[int], **kw) -> Generation:
    """Generate to the end (see stream for the arguments)."""
    state: dict = {}
    toks = list(stream(model, idx, prompt, state=state, **kw))
    prompt = prompt or [idx.eos_id]
    prov = [t.provenance for t in toks] if kw.get("provenance") else []
    return Generation(list(prompt) + [t.id for t in toks], len(prompt), state["features"], state["stopped"], prov, state["stats"])
