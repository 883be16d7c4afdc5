"""The continuous cache (Grave et al., 2017): the next token estimated from the document's own
earlier hidden states. At a position i, each earlier position j < i of the same document (the
last WINDOW of them, as Grave et al.'s cache holds the last few thousand) votes
for the token that followed it, with weight softmax_j(-||h_i - h_j||^2 / T); p(y) is the summed
weight of the votes for y. It needs no store and no second model: only the states the served
model computes anyway (`KEY`: the input of the last block's feed-forward; `key_states` reads
them, and the final states the kNN-LM baseline's queries are, during any forward pass).

The post-hoc gate (model/mixture/gate.py) reads it at several temperatures as more estimates,
(t+cc). The temperatures are FACTORS x a scale that is a property of the model: the median
squared distance from a state to its nearest earlier state in the same document, measured on
the validation text the gate is fit on and saved with the gate. A document's first position has
no history: there the cache defers to the model, so every mixture stays a distribution.

Bulk (`target_probs`, for evaluation and scoring) and live (`LiveCache`, for generation) give the
same numbers on the same states.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from teragram.index.errors import TeragramError

KEY_STATES = ("final", "ffn_in")  # ln_f's output (GPT.hidden's); the last block's ln_2 output (its feed-forward's input)
KEY = "ffn_in"  # the key states the cache compares
FACTORS = (0.05, 0.1, 0.2, 0.5, 1.0)  # temperatures, x the model's scale: the gate weighs them on validation
WINDOW = 4096  # the earlier positions a position sees: cost and memory stay linear in a document's length
# query rows per distance block in bulk: a block's (BLOCK, BLOCK + WINDOW) float64 tensors, ~9 MB,
# stay in cache (2048 rows, 100 MB tensors: 5x slower)
BLOCK = 256
GPU_BLOCK = 2048  # on a GPU: fewer, larger kernels (a block's tensors ~100 MB)


def component_names(factors=FACTORS) -> tuple[str, ...]:
    """The gate's names of the cache at each temperature factor: cont_cache_0.05x, ..."""
    return tuple(f"cont_cache_{f:g}x" for f in factors)


@dataclass(frozen=True)
class ContCache:
    """What a gate needs to recompute the continuous cache: the key states compared, the model's
    distance scale (fit on validation) and the temperature factors (one estimate each)."""

    scale: float
    factors: tuple[float, ...] = FACTORS
    key: str = KEY
    window: int = WINDOW

    @property
    def temperatures(self) -> list[float]:
        return [f * self.scale for f in self.factors]

    @property
    def names(self) -> tuple[str, ...]:
        return component_names(self.factors)

    def to_json(self) -> dict:
        return {"scale": self.scale, "factors": list(self.factors), "key": self.key, "window": self.window}

    @classmethod
    def from_json(cls, d: dict) -> ContCache:
        return cls(float(d["scale"]), tuple(float(f) for f in d["factors"]), str(d["key"]), int(d["window"]))


@contextmanager
def key_states(model, key: str):
    """Within it, a list that receives the `key` states (B, T, C) of each forward of `model`
    (KEY_STATES: "final", the output of ln_f, as GPT.hidden returns it; "ffn_in", the output of
    the last block's ln_2, its feed-forward's input)."""
    if key not in KEY_STATES:
        raise TeragramError(f"key states {key!r}: one of {', '.join(KEY_STATES)}")
    got: list = []
    if hasattr(model, "hook_key_states"):  # a transformers model (model/hf/adapter.py) finds its own
        hook = model.hook_key_states(key, got.append)
    else:
        mod = model.transformer.ln_f if key == "final" else model.transformer.h[-1].ln_2
        hook = mod.register_forward_hook(lambda m, i, o: got.append(o))
    try:
        yield got
    finally:
        hook.remove()


def runs(doc: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each document's rows; refused unless each document's rows are one run."""
    doc = np.asarray(doc)
    cuts = np.flatnonzero(np.diff(doc)) + 1
    out = list(zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [len(doc)]]).tolist(), strict=True)) if len(doc) else []
    if len({int(doc[a]) for a, _ in out}) != len(out):
        raise ValueError("a document's rows come in one run, in order")
    return out


class _Scratch:
    """Reusable flat buffers for the blocks of a bulk pass: a fresh (block, block + WINDOW) tensor
    per operation costs its page faults each time on a CPU (the work itself is a few passes)."""

    def __init__(self, device):
        self.device, self.bufs, self.masks = device, {}, {}

    def get(self, name: str, rows: int, cols: int, dtype=None):
        import torch

        dtype = torch.float64 if dtype is None else dtype
        b = self.bufs.get(name)
        if b is None or b.numel() < rows * cols:
            b = self.bufs[name] = torch.empty(rows * cols, dtype=dtype, device=self.device)
        return b[: rows * cols].view(rows, cols)

    def mask(self, rows: int, cols: int, off: int, window: int, block: int):
        """(rows, cols) bool: True where row r (position off + r of the columns) may not read
        column c: c >= off + r or c < off + r - window. Full blocks' masks are kept."""
        import torch

        key = (rows, cols, off)
        if key in self.masks:
            return self.masks[key]
        j = torch.arange(cols, device=self.device)[None]
        i = torch.arange(off, off + rows, device=self.device)[:, None]
        m = (j >= i) | (j < i - window)
        if rows == block:
            self.masks[key] = m
        return m


def _distances(h, n2, qa: int, qb: int, window: int, scratch: _Scratch, block: int):
    """(k0, squared distances (qb - qa, qb - k0)) from rows qa..qb of h (float64, centred; n2 its
    rows' squared norms) to rows k0..qb, k0 = max(0, qa - window); +inf where j >= i or
    j < i - window (a row sees only the `window` rows before it). In scratch's buffer "d"."""
    import torch

    k0 = max(0, qa - window)
    d = torch.mm(h[qa:qb], h[k0:qb].T, out=scratch.get("d", qb - qa, qb - k0))
    d.mul_(-2).add_(n2[None, k0:qb]).add_(n2[qa:qb, None]).clamp_min_(0)
    return k0, d.masked_fill_(scratch.mask(qb - qa, qb - k0, qa - k0, window, block), float("inf"))


def _centred(hidden, device: str):
    import torch

    h = (hidden if torch.is_tensor(hidden) else torch.as_tensor(np.asarray(hidden))).to(device).double()
    return h - h.mean(0) if len(h) else h  # any shift gives the same distances; centring keeps them precise


def nearest_distances(hidden: np.ndarray, doc: np.ndarray, device: str = "cpu", *, window: int = WINDOW) -> np.ndarray:
    """(n,) squared distance from each row's state to the nearest of the `window` earlier states of
    its document (NaN at a document's first row)."""
    import torch

    out, scratch = np.full(len(doc), np.nan), _Scratch(device)
    for a, b in runs(doc):
        h = _centred(hidden[a:b], device)
        n2 = (h * h).sum(1)
        for qa in range(1, b - a, BLOCK):
            qb = min(qa + BLOCK, b - a)
            out[a + qa : a + qb] = torch.min(_distances(h, n2, qa, qb, window, scratch, BLOCK)[1], 1).values.cpu().numpy()
    return out


def fit_scale(hidden: np.ndarray, doc: np.ndarray, device: str = "cpu", *, window: int = WINDOW) -> float:
    """The model's distance scale on (validation) text: the median nearest-earlier-state distance."""
    d = nearest_distances(hidden, doc, device, window=window)
    d = d[np.isfinite(d)]
    if not len(d) or float(np.median(d)) <= 0:
        return 1.0  # no document of two tokens, or all states equal: any scale gives the same estimates
    return float(np.median(d))


def target_probs(
    hidden: np.ndarray,
    target: np.ndarray,
    doc: np.ndarray,
    temps,
    device: str = "cpu",
    *,
    window: int = WINDOW,
    block: int = BLOCK,
    start: int = 0,
) -> np.ndarray:
    """(n, len(temps)) float64: per row i, the cache's probability of target_i at each temperature,
    from the `window` rows before it in its document (row j votes for target_j, the token after
    it). Rows are token_eval's (each document's in order); 0 at a document's first row. Rows
    before `start` (a document's earlier rows, read only as history) are left 0."""
    import torch

    out = np.zeros((len(target), len(temps)))
    block = block if str(device) == "cpu" else GPU_BLOCK
    scratch = _Scratch(device)
    for a, b in runs(doc):
        h = _centred(hidden[a:b], device)
        n2 = (h * h).sum(1)
        t = torch.as_tensor(np.asarray(target[a:b], np.int64), device=device)
        o = torch.zeros((b - a, len(temps)), dtype=torch.float64, device=device)
        for qa in range(max(1, start - a), b - a, block):  # the first row has nothing before it
            qb = min(qa + block, b - a)
            k0, d = _distances(h, n2, qa, qb, window, scratch, block)
            B, K = d.shape
            hit = scratch.get("hit", B, K).copy_(torch.eq(t[k0:qb][None], t[qa:qb, None], out=scratch.get("eq", B, K, torch.bool)))
            prod = scratch.get("prod", B, K)
            for c, w in enumerate(_softmax_weights(d, temps, scratch)):
                o[qa:qb, c] = torch.mul(w, hit, out=prod).sum(1) / w.sum(1)
        out[a:b] = o.cpu().numpy()  # one copy a document: on a GPU, no wait per block
    return out


def _powers(temps) -> list[int | None]:
    """Per temperature, r = max(temps) / temp where r is a whole number of at most 64 (the
    FACTORS: 20, 10, 5, 2, 1), else None."""
    top = max(temps)
    out = []
    for temp in temps:
        r = top / temp
        out.append(round(r) if abs(r - round(r)) < 1e-9 and 1 <= round(r) <= 64 else None)
    return out


def _softmax_weights(d, temps, scratch: _Scratch) -> list:
    """Per temperature, exp(-(d - min d) / temp) over each row of squared distances d (+inf: no
    vote): softmax(-d / temp) unnormalized, made in d and scratch's buffers. One exp at the
    largest temperature; the others are its whole powers (exp(-x / (T / r)) = exp(-x / T)^r), by
    repeated squaring: one exp and a few products instead of an exp per temperature (the same
    to ~1e-12; with the buffers, 1.3x on a CPU over real key states)."""
    import torch

    top, powers = max(temps), _powers(temps)
    y = d.sub_(d.min(1, keepdim=True).values).mul_(1.0 / top)  # >= 0; +inf where no vote
    # a weight below exp(-700) of the row's largest (1) is made 0 at every power: subnormal
    # products are 6x slower, and the most such weights add up to is 4096 exp(-700 / r) (1e-12 at r = 20)
    y.masked_fill_(torch.gt(y, 700.0 / max(r or 1 for r in powers), out=scratch.get("eq", *y.shape, torch.bool)), float("inf"))
    other = {c: torch.mul(y, -top / temp, out=scratch.get(f"t{c}", *y.shape)).exp_() for c, temp in enumerate(temps) if powers[c] is None}
    have = {1: y.neg_().exp_()}

    def power(r: int):
        if r not in have:
            half = power(r // 2)
            p = torch.mul(half, half, out=scratch.get(f"p{r}", *y.shape))
            have[r] = p.mul_(have[1]) if r % 2 else p
        return have[r]

    return [power(r) if r is not None else other[c] for c, r in enumerate(powers)]


def first_rows(doc: np.ndarray) -> np.ndarray:
    """(n,) bool: a document's first row, where the cache has no history."""
    doc = np.asarray(doc)
    return np.concatenate([[True], doc[1:] != doc[:-1]]) if len(doc) else np.zeros(0, bool)


class LiveCache:
    """The cache of one document as it is generated: the key states of its positions so far and
    the token after each, and the cache's next-token distributions at a new state. Positions are
    the document's (0: its first token); `start` is the first one held (a prompt longer than the
    model's context is read from its last window)."""

    def __init__(self, spec: ContCache, vocab_size: int):
        self.spec, self.V = spec, vocab_size
        self.start = 0
        self.states: list[np.ndarray] = []  # (C,) float64 per position whose next token is known
        self.next_tokens: list[int] = []

    @property
    def end(self) -> int:
        """One past the last position held."""
        return self.start + len(self.states)

    def add(self, position: int, state: np.ndarray, next_token: int) -> None:
        if not self.states:
            self.start = position
        elif position != self.end:
            raise ValueError(f"position {position} added after {self.end - 1}")
        self.states.append(np.asarray(state, np.float64))
        self.next_tokens.append(int(next_token))

    def truncate(self, end: int) -> None:
        """Keep the positions before `end`."""
        n = max(0, end - self.start)
        del self.states[n:], self.next_tokens[n:]

    def distributions(self, state: np.ndarray, upto: int | None = None) -> np.ndarray | None:
        """(len(factors), V) next-token distributions at `state` from the positions held before
        `upto` (default: all), or None without any (the cache defers to the model)."""
        n = len(self.states) if upto is None else min(max(0, upto - self.start), len(self.states))
        first = max(0, n - self.spec.window)
        if n == 0:
            return None
        H = np.stack(self.states[first:n])
        q = np.asarray(state, np.float64)
        mu = H.mean(0)  # distances do not depend on the shift; centring keeps them precise
        H, q = H - mu, q - mu
        d = np.maximum((q * q).sum() + (H * H).sum(1) - 2 * H @ q, 0)
        out = np.zeros((len(self.spec.factors), self.V))
        toks = np.asarray(self.next_tokens[first:n])
        for c, temp in enumerate(self.spec.temperatures):
            z = -d / temp
            w = np.exp(z - z.max())
            np.add.at(out[c], toks, w / w.sum())
        return out
