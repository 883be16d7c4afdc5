"""A GPT that reads the index: nanoGPT's model, plus index-feature inputs and a mixture head.

For each position t the index supplies (index/features.py): the longest match length L, the continuation token of its most recent occurrence, the match's occurrence count, and
the top-k next tokens after it with their counts. The model adds to the token embedding

    wte(cont) + wlen(L) + wcnt(log2 count) + sum_i (cnt_i / sum cnt) * wte(topk_i)

(the continuation and top-k share the token table) and, with `mixture`, predicts

    p(y) = (1 - g) p_model(y) + g p_index(y),   g = sigmoid(w . h_t + b_len[L] + b_cnt[c])

where p_index puts cnt_i / count on each top-k token and its remaining mass
(1 - sum cnt_i / count) on p_model. use_index=False is the plain GPT baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from teragram.index.features import Features
from torch.utils.checkpoint import checkpoint

N_CNT_BUCKETS = 33  # floor(log2(count + 1)) for counts below 2^32
# Under recompute = "block" the head runs in chunks of rows (_TargetLogp), so that one chunk's
# logits live at a time in forward and in backward: HEAD_CHUNK_BYTES of float32 logits per chunk
# (2097 rows at V = 32000, 1335 at GPT-2's 50257), of which a chunk holds at most two arrays at
# a time (0.5 GiB), against several GiB for the whole head of 16 x 1024 tokens. A (2097, C) x
# (C, V) product still fills a GPU; the cost is one more of them per chunk, in backward.
HEAD_CHUNK_BYTES = 2**28
# In evaluation on a CPU the head's logits are made and reduced this many rows at a time: a
# (512, V) float32 block (16 MB at V = 8000) is reduced while in cache.
HEAD_EVAL_ROWS = 512


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 32000
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False
    use_index: bool = True
    index_inputs: tuple[str, ...] = field(default=("cont", "len", "cnt", "topk"))  # ("cont",) = TScale
    mixture: bool = True
    top_k: int = 4
    max_match: int = 64
    arch: str = "gpt2"  # "gpt2" | "modern" (rotary, RMSNorm, QK-norm, ReLU^2 MLP, untied head)
    tie_head: bool | None = None  # the head shares the token embedding; None: the arch's (gpt2 tied, modern untied)

    @classmethod
    def preset(cls, name: str, **kw) -> GPTConfig:
        shapes = {
            "350m": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # GPT-2 medium's shape
            "125m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
            "small": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
            "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
        }
        if name not in shapes:
            raise ValueError(f"unknown preset {name!r}; known: {', '.join(shapes)}")
        return replace(cls(**shapes[name]), **kw)


def to_torch(f: Features, device=None) -> Features:
    """The one conversion of index features to the model's inputs: int64 tensors (on device),
    -1 meaning none, in the same record. Shapes stay: (B, T) / (B, T, k) for a batch."""
    t = f.map(lambda a: torch.as_tensor(np.asarray(a, dtype=np.int64)))
    return t if device is None else to_device(t, device)


def to_device(f: Features, device, non_blocking: bool = False) -> Features:
    return f.map(lambda t: t.to(device, non_blocking=non_blocking))


def blinded(f: Features, rows: torch.Tensor | None = None) -> Features:
    """These (torch) features with the given sequences ((B,) bool; all by default) set to "no
    match" (L = 0, nothing found)."""
    m = torch.ones(f.length.shape[0], dtype=torch.bool, device=f.length.device) if rows is None else rows
    mm = m[:, None]
    return Features(
        f.length.masked_fill(mm, 0),
        f.cont.masked_fill(mm, -1),
        f.count.masked_fill(mm, 0),
        f.topk_ids.masked_fill(mm[..., None], -1),
        f.topk_cnt.masked_fill(mm[..., None], 0),
    )


def rotate(x: torch.Tensor, pos0: int) -> torch.Tensor:
    """Rotary position embedding of (B, nh, T, hs) at positions pos0.. (half-split layout)."""
    T, hs = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hs, 2, device=x.device, dtype=torch.float32) / hs))  # (hs/2,)
    ang = torch.outer(torch.arange(pos0, pos0 + T, device=x.device, dtype=torch.float32), inv_freq)  # (T, hs/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : hs // 2], x[..., hs // 2 :]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.modern = cfg.arch == "modern"  # QK-norm and rotary positions

    def forward(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None = None, pos0: int = 0):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if self.modern:
            hs = C // self.n_head
            q, k = rotate(F.rms_norm(q, (hs,)), pos0), rotate(F.rms_norm(k, (hs,)), pos0)
        if kv is not None:  # incremental decoding: attend to the cached keys/values too
            k = torch.cat([kv[0], k], dim=2)
            v = torch.cat([kv[1], v], dim=2)
        S = k.shape[2]
        # causal, aligned at the end: query t sees the cache and the new positions up to t
        # (is_causal alone aligns at the start, wrong for T > 1 new positions after a cache)
        mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T) if 1 < T < S else None
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=mask is None and T > 1
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.relu2 = cfg.arch == "modern"  # ReLU^2 instead of GELU

    def forward(self, x):
        h = self.c_fc(x)
        return self.dropout(self.c_proj(F.relu(h).square() if self.relu2 else F.gelu(h)))


def norm(cfg: GPTConfig) -> nn.Module:
    return nn.RMSNorm(cfg.n_embd) if cfg.arch == "modern" else nn.LayerNorm(cfg.n_embd, bias=cfg.bias)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = norm(cfg)
        self.mlp = MLP(cfg)
        self.recompute_attn = False  # set by GPT.set_recompute

    def _attn_out(self, x):
        return self.attn(self.ln_1(x))[0]

    def forward(self, x, kv=None, pos0: int = 0):
        if self.recompute_attn and kv is None and pos0 == 0 and torch.is_grad_enabled():
            a, kv = checkpoint(self._attn_out, x, use_reentrant=False), None  # attention activations recomputed in backward
        else:
            a, kv = self.attn(self.ln_1(x), kv, pos0)
        x = x + a
        return x + self.mlp(self.ln_2(x)), kv

    def forward_no_cache(self, x):
        return self.forward(x)[0]


def count_bucket(count: torch.Tensor) -> torch.Tensor:
    """floor(log2(count + 1)), clamped to the table: 0 for no occurrence."""
    return torch.clamp(torch.floor(torch.log2(count.float() + 1)).long(), 0, N_CNT_BUCKETS - 1)


def _logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The head's logits (n, V) of rows h (n, C), in weight's dtype."""
    return h.to(weight.dtype) @ weight.T


class _TargetLogp(torch.autograd.Function):
    """The model's log-probability of the targets (n,) for rows h (n, C), whose (n, V) logits
    are computed in forward and again in backward, never kept. Saved: h and each row's
    log-sum-exp. Backward's gradient of the logits is g (onehot(y) - softmax), as autograd's
    through log_softmax and gather, in fewer passes over (n, V) than checkpointing that graph
    (which runs its whole forward a second time). weight is the head's parameter (for its
    gradient), weight_lp the same in the product's dtype (autocast's)."""

    @staticmethod
    def forward(ctx, h, weight, weight_lp, targets):
        logits = _logits(h, weight_lp).float()  # (n, V) float32
        logp = F.log_softmax(logits, dim=-1)
        lp_y = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        lse = logits[:, 0] - logp[:, 0]  # (n,) each row's log-sum-exp
        del logits
        ctx.save_for_backward(h, weight_lp, targets, lse)
        ctx.weight_dtype = weight.dtype
        return lp_y

    @staticmethod
    def backward(ctx, g):
        h, weight_lp, targets, lse = ctx.saved_tensors
        p = torch.sub(_logits(h, weight_lp), lse.unsqueeze(-1))  # (n, V) float32: the log-softmax again
        p.exp_().scatter_add_(-1, targets.unsqueeze(-1), p.new_full((len(p), 1), -1.0))  # softmax - onehot(y)
        d = torch.empty_like(p, dtype=weight_lp.dtype)
        torch.mul(p, -g.unsqueeze(-1), out=d)  # the loss's gradient of the logits, in their dtype
        del p
        dh = (d @ weight_lp).to(h.dtype) if ctx.needs_input_grad[0] else None
        dw = (d.T @ h.to(d.dtype)).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.arch not in ("gpt2", "modern"):
            raise ValueError(f"arch must be gpt2 or modern, not {cfg.arch!r}")
        self.cfg = cfg
        layers = dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=norm(cfg),
        )
        if cfg.arch == "gpt2":
            layers["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd)  # modern: rotary positions in attention
        self.transformer = nn.ModuleDict(layers)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if self.tied:
            self.transformer.wte.weight = self.lm_head.weight  # weight tying
        if cfg.use_index:
            self.wlen = nn.Embedding(cfg.max_match + 1, cfg.n_embd)
            self.wcnt = nn.Embedding(N_CNT_BUCKETS, cfg.n_embd)
            if cfg.mixture:
                self.gate = nn.Linear(cfg.n_embd, 1)
                self.gate_len = nn.Embedding(cfg.max_match + 1, 1)
                self.gate_cnt = nn.Embedding(N_CNT_BUCKETS, 1)
        self.recompute = "none"
        self.recompute_blocks = cfg.n_layer
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.use_index:
            for e in (self.wlen, self.wcnt):
                torch.nn.init.zeros_(e.weight)  # index inputs start as no-ops
            if cfg.mixture:
                torch.nn.init.zeros_(self.gate.weight)
                torch.nn.init.constant_(self.gate.bias, -2.0)  # start mostly on the model
                torch.nn.init.zeros_(self.gate_len.weight)
                torch.nn.init.zeros_(self.gate_cnt.weight)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def set_recompute(self, mode: str, blocks: int = 0) -> None:
        """Activation recompute in training: "none", "attn" (each block's attention sub-layer is
        recomputed in backward) or "block" (only each block's input is kept; the whole block is
        recomputed, and the head runs in chunks of rows). Under "block", `blocks` > 0 recomputes
        only the first that many blocks and keeps the others' activations (selective recompute:
        less compute, more memory; 0: every block). Same results, less activation memory, more
        compute."""
        if mode not in ("none", "attn", "block"):
            raise ValueError(f"recompute must be none, attn or block, not {mode!r}")
        if not 0 <= blocks <= self.cfg.n_layer or (blocks and mode != "block"):
            raise ValueError(f"recompute_blocks must be in [0, {self.cfg.n_layer}] and goes with recompute = block (got {blocks}, {mode})")
        self.recompute = mode
        self.recompute_blocks = blocks or self.cfg.n_layer
        for b in self.transformer.h:
            b.recompute_attn = mode == "attn"

    @property
    def tied(self) -> bool:
        return self.cfg.arch == "gpt2" if self.cfg.tie_head is None else self.cfg.tie_head

    def num_params(self) -> int:
        """Parameters without the learned positions (as nanoGPT counts)."""
        wpe = self.transformer.wpe.weight.numel() if "wpe" in self.transformer else 0
        return sum(p.numel() for p in self.parameters()) - wpe

    def _index_embedding(self, f: Features) -> torch.Tensor:
        wte = self.transformer.wte
        inputs = self.cfg.index_inputs
        e = 0
        if "cont" in inputs:
            has = (f.cont >= 0).unsqueeze(-1)
            e = e + wte(f.cont.clamp_min(0)) * has  # (B, T, C)
        if "len" in inputs:
            e = e + self.wlen(f.length.clamp(0, self.cfg.max_match))
        if "cnt" in inputs:
            e = e + self.wcnt(count_bucket(f.count))
        if "topk" in inputs:
            w = f.topk_cnt.float() * (f.topk_ids >= 0)
            w = w / w.sum(-1, keepdim=True).clamp_min(1.0)  # (B, T, k)
            e = e + torch.einsum("btk,btkc->btc", w, wte(f.topk_ids.clamp_min(0)))
        return e

    def hidden(self, idx: torch.Tensor, f: Features | None = None, kv=None, pos0: int = 0):
        """Final hidden states (B, T, C) and the new key/value cache."""
        B, T = idx.shape
        pos = torch.arange(pos0, pos0 + T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx)
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(pos)
        if self.cfg.use_index:
            x = x + self._index_embedding(f)
        x = self.transformer.drop(x)
        new_kv = []
        whole = self.recompute == "block" and kv is None and pos0 == 0 and torch.is_grad_enabled()
        for i, block in enumerate(self.transformer.h):
            if whole and i < self.recompute_blocks:
                x, c = checkpoint(block.forward_no_cache, x, use_reentrant=False), None
            else:
                x, c = block(x, None if kv is None else kv[i], pos0)
            new_kv.append(c)
        return self.transformer.ln_f(x), new_kv

    @staticmethod
    def crop_cache(kv, n: int):
        """The key/value cache kept to its first n positions (drafted tokens rejected)."""
        return [(k[:, :, :n], v[:, :, :n]) for k, v in kv]

    def _gate_and_index(self, h: torch.Tensor, f: Features):
        """Mixture weight g (B, T) and the index distribution's top-k probabilities (B, T, k)."""
        L = f.length.clamp(0, self.cfg.max_match)
        cb = count_bucket(f.count)
        g = torch.sigmoid(self.gate(h).squeeze(-1) + self.gate_len(L).squeeze(-1) + self.gate_cnt(cb).squeeze(-1))
        q = (f.topk_cnt.float() * (f.topk_ids >= 0)) / f.count.float().clamp_min(1.0).unsqueeze(-1)
        return g, q

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, f: Features | None = None):
        """logits (B, T, V) when targets is None; else (per-token loss (B, T), None)."""
        h, _ = self.hidden(idx, f)
        if targets is None:
            return self.lm_head(h)
        return self._final_nll(h, targets, self._model_logp(h, targets), f), None

    def head_losses(self, h: torch.Tensor, targets: torch.Tensor, f: Features | None = None):
        """From final hidden states: the per-token loss (B, T) under the final distribution (the
        mixture when the model has one) and the model's own log-softmax (B, T, V), float32."""
        logp = F.log_softmax(self.lm_head(h).float(), dim=-1)
        return self._final_nll(h, targets, logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), f), logp

    def head_stats(self, h: torch.Tensor, targets: torch.Tensor, f: Features | None = None):
        """What evaluation reads of the head, from final hidden states (B, T, C): the per-token
        loss (B, T) under the final distribution, and the model's own log-probability of the
        targets, of its most likely token and that token (each (B, T)). The logits are made a
        block of rows at a time and reduced there; the (B, T, V) log-softmax is never made. On a
        CPU a block is HEAD_EVAL_ROWS rows, reduced in place by numpy while it is in cache
        (numpy's argmax is vectorized where torch's CPU argmax is not). No gradient."""
        B, T, C = h.shape
        hf, yf = h.reshape(-1, C), targets.reshape(-1)
        cpu = h.device.type == "cpu"
        rows = HEAD_EVAL_ROWS if cpu else max(1, HEAD_CHUNK_BYTES // (4 * self.cfg.vocab_size))
        lp_y, lp_max = torch.empty(len(hf), device=h.device), torch.empty(len(hf), device=h.device)
        top = torch.empty(len(hf), dtype=torch.long, device=h.device)
        w = self.lm_head.weight
        buf = torch.empty((min(rows, len(hf)), self.cfg.vocab_size)) if cpu and w.dtype == h.dtype == torch.float32 else None
        with torch.no_grad():
            for a in range(0, len(hf), rows):
                b = min(a + rows, len(hf))
                if buf is not None:  # one buffer for every block: blocks allocated in turn fragment the C heap (GBs)
                    lg, r = torch.mm(hf[a:b], w.T, out=buf[: b - a]).numpy(), np.arange(b - a)  # (rows, V)
                    t = lg.argmax(-1)
                    m, g = lg[r, t], lg[r, yf[a:b].numpy()]
                    lse = m + np.log(np.exp(np.subtract(lg, m[:, None], out=lg), out=lg).sum(-1))
                    top[a:b], lp_y[a:b], lp_max[a:b] = torch.from_numpy(t), torch.from_numpy(g - lse), torch.from_numpy(m - lse)
                else:
                    logits = self.lm_head(hf[a:b]).float()  # (rows, V)
                    m, top[a:b] = logits.max(-1)
                    lse = torch.logsumexp(logits, -1)
                    lp_y[a:b], lp_max[a:b] = logits.gather(-1, yf[a:b, None])[:, 0] - lse, m - lse
            lp_y = lp_y.view(B, T)
            return self._final_nll(h, targets, lp_y, f), lp_y, lp_max.view(B, T), top.view(B, T)

    def _model_logp(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's log-probability of the targets (B, T) from final hidden states (B, T, C).
        Under recompute = "block" in training, in chunks of rows (HEAD_CHUNK_BYTES, _TargetLogp):
        only one chunk's logits exist at a time, in forward and again (recomputed) in backward."""
        if not (self.recompute == "block" and torch.is_grad_enabled()):
            return F.log_softmax(self.lm_head(h).float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        w, dev = self.lm_head.weight, h.device.type
        w_lp = w.detach().to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else w.detach()
        rows = max(1, HEAD_CHUNK_BYTES // (4 * self.cfg.vocab_size))
        chunks = zip(h.reshape(-1, h.shape[-1]).split(rows), targets.reshape(-1).split(rows))
        return torch.cat([_TargetLogp.apply(hc, w, w_lp, yc) for hc, yc in chunks]).view(targets.shape)

    def _final_nll(self, h, targets, lp_y, f: Features | None) -> torch.Tensor:
        """The per-token loss (B, T) under the final distribution from the model's
        log-probability of the targets lp_y (B, T)."""
        if not (self.cfg.use_index and self.cfg.mixture):
            return -lp_y
        g, q = self._gate_and_index(h.float(), f)
        rest = 1.0 - q.sum(-1)  # index mass left to the model distribution
        q_y = (q * (f.topk_ids == targets.unsqueeze(-1))).sum(-1)
        a = torch.log((1 - g + g * rest).clamp_min(1e-30)) + lp_y
        b = torch.log((g * q_y).clamp_min(1e-30))
        return -torch.logaddexp(a, b)

    @torch.no_grad()
    def next_distribution(self, h_last: torch.Tensor, f_last: Features | None) -> torch.Tensor:
        """Probabilities (B, V) of the next token from the last hidden state (mixture applied)."""
        p = F.softmax(self.lm_head(h_last).float(), dim=-1)
        if not (self.cfg.use_index and self.cfg.mixture):
            return p
        g, q = self._gate_and_index(h_last.float().unsqueeze(1), f_last)
        g, q = g[:, 0], q[:, 0]
        rest = 1.0 - q.sum(-1)
        p = p * (1 - g + g * rest).unsqueeze(-1)
        return p.scatter_add(-1, f_last.topk_ids[:, 0].clamp_min(0), g.unsqueeze(-1) * q)
