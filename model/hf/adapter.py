"""A transformers causal LM (`AutoModelForCausalLM`) behind the interface that evaluation,
generation and the server use of the native GPT (model/gpt.py): `hidden` (the last hidden states
and a key/value cache, for incremental decoding), `head_losses`, `head_stats`, `next_distribution`, `lm_head`,
`cfg` (vocabulary, context) and the continuous cache's key states (`hook_key_states`).

    teragram eval | sample | serve --hf-model DIR [--dtype bfloat16] ...

The model has no index inputs: its next-token distribution is mixed with the index's estimates
and the caches by the post-hoc gate, as a plain native model's is. Its tokenizer must be the
index's (`check_tokenizer`: the same ids on probe text), checked before its weights are loaded.
It runs in its own dtype (`--dtype`; bfloat16 on a GPU, float32 on a CPU by default), never under
the native path's autocast. The continuous cache's key states ("ffn_in") are the input of its
last layer's feed-forward, as the native GPT's are (the output of its last block's ln_2); "final"
are its last hidden states (what output_hidden_states gives last).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from teragram.index.errors import TeragramError, TokenizerMismatch
from teragram.model.gpt import GPTConfig
from teragram.model.hf import DTYPES

EVAL_BLOCK_BYTES = 2**26  # head_stats makes its logits a block of rows at a time: 64 MB of float32 each
FEED_FORWARD_NAMES = ("mlp", "feed_forward", "ffn")  # a decoder layer's feed-forward, by the names transformers models give it
# What a transformers tokenizer must encode as the index's does: prose, code, digits, runs of
# spaces and newlines, tabs, punctuation, non-Latin scripts and text that looks like special tokens
PROBE = (
    "The kernel's scheduler picks the next task.\n\n  static int foo(struct bar *b) {\n\treturn b->x[42] + 0x1F;\n}\n"
    "A hacker is a person who enjoys exploring the details of programmable systems -- 1984, 3.14159, 2^32.\n"
    "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, русский; emoji 🙂.   <s> </s> <|endoftext|> [CLS]   end"
)


def hf_error(what: str, e: BaseException) -> TeragramError:
    line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return TeragramError(f"{what}: {line}")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise TeragramError("--hf-model needs the transformers package: pip install 'teragram[hf]'") from None
    return transformers


def load_tokenizer(path: str):
    """The model's tokenizer (AutoTokenizer), refused with one line when it has none."""
    try:
        return _transformers().AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise hf_error(f"{path}: cannot load its tokenizer", e) from None


def check_tokenizer(tok, idx, name: str, *, model_vocab: int | None = None) -> None:
    """Refuse (TokenizerMismatch, one line) a transformers tokenizer that is not the index's: one
    giving other ids on PROBE than the index's tokenizer, another end-of-text id where both have
    one, or a model whose output has fewer rows than the index has ids."""
    # the index encodes a special token's text in a document as text (index/tokenizer.py), where a
    # transformers tokenizer by default gives the special id: compared as the index encodes
    ids = tok(PROBE, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    want = idx.tokenize(PROBE)
    if ids != want:
        at = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
        raise TokenizerMismatch(
            f"{name}: its tokenizer is not the index's (probe text: {len(ids)} tokens against the index's {len(want)},"
            f" first difference at token {at}): build the index with the model's tokenizer (build-index --tokenizer {name})"
        )
    eos = getattr(tok, "eos_token_id", None)
    if eos is not None and eos != idx.eos_id:
        raise TokenizerMismatch(f"{name}: its end-of-text id is {eos}, the index's {idx.eos_id}")
    if model_vocab is not None and model_vocab < idx.vocab_size:
        raise TokenizerMismatch(f"{name}: the model predicts {model_vocab} ids, the index has {idx.vocab_size}")


def default_dtype(device: str) -> str:
    return "bfloat16" if str(device).startswith("cuda") else "float32"


def load_hf(path: str, *, index=None, device: str = "cpu", dtype: str | None = None, context: int | None = None):
    """(HFModel, meta) of a transformers causal LM (a local directory, or a hub name where the
    hub can be reached); with `index` (an opened index), its tokenizer is checked against the
    index's before the weights are read."""
    tf = _transformers()
    if index is not None:
        check_tokenizer(load_tokenizer(path), index, path)
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise TeragramError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    kw = {"dtype" if int(tf.__version__.split(".")[0]) >= 5 else "torch_dtype": getattr(torch, dtype)}
    try:
        lm = tf.AutoModelForCausalLM.from_pretrained(path, **kw)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise hf_error(f"{path}: cannot load a transformers causal LM", e) from None
    model = HFModel(lm.to(device).eval(), name=str(path), context=context)
    if index is not None and model.cfg.vocab_size < index.vocab_size:
        raise TokenizerMismatch(f"{path}: the model predicts {model.cfg.vocab_size} ids, the index has {index.vocab_size}")
    meta = {"step": 0, "model": {"hf_model": str(path), "class": type(lm).__name__, "dtype": dtype, "block_size": model.cfg.block_size}}
    return model, meta


class HFModel(torch.nn.Module):
    """A transformers causal LM with the native GPT's interface (module doc). `cfg` is a
    GPTConfig of its shape, without index inputs; the context (block_size) is the model's
    positions, or `context` when that is smaller."""

    def __init__(self, lm, *, name: str, context: int | None = None):
        super().__init__()
        self.lm = lm
        self.name = name
        self.base = lm.base_model
        self.lm_head = lm.get_output_embeddings()
        if self.base is lm or self.lm_head is None:
            raise TeragramError(f"{name}: a causal LM with a base model and an output layer is needed ({type(lm).__name__})")
        c = lm.config
        positions = getattr(c, "max_position_embeddings", None)
        block = min(n for n in (positions, context) if n) if positions or context else None
        if not block:
            raise TeragramError(f"{name}: its config gives no maximum length: give --context N")
        self.cfg = GPTConfig(
            vocab_size=int(self.lm_head.weight.shape[0]),
            block_size=int(block),
            n_layer=int(getattr(c, "num_hidden_layers", 0) or 0),
            n_head=int(getattr(c, "num_attention_heads", 0) or 0),
            n_embd=int(c.hidden_size),
            use_index=False,
            mixture=False,
            arch="hf",
        )
        self.ffn = _last_feed_forward(self.base, self.cfg.n_layer)
        params = inspect.signature(self.base.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers 5's name, or 4's
        self._check_head()

    def _check_head(self) -> None:
        """Refuse a model whose logits are not its output layer applied to its last hidden
        states (a soft-capped or scaled head): its distribution would differ from its own."""
        x = torch.arange(1, 9, device=self.lm_head.weight.device)[None] % self.cfg.vocab_size
        with torch.no_grad():
            want = self.lm(input_ids=x).logits.float()
            got = self._logits(self.hidden(x)[0]).float()
        if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max())):
            raise TeragramError(f"{self.name}: its logits are not its output layer applied to its last hidden states (not supported)")

    def hidden(self, idx: torch.Tensor, f=None, kv=None, pos0: int = 0):
        """Last hidden states (B, T, C) of token ids idx (B, T) after the cached positions kv
        (transformers' cache, from an earlier call; None: none; pos0 is their count), and the
        cache with them."""
        with torch.autocast(idx.device.type, enabled=False):
            out = self.base(input_ids=idx, use_cache=True, **({self._cache_arg: kv} if kv is not None else {}))
        return out.last_hidden_state, out["cache"] if "cache" in out else out.get("past_key_values")

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.lm_head.weight
        with torch.autocast(h.device.type, enabled=False):
            return self.lm_head(h.to(w.dtype))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, f=None):
        """logits (B, T, V) when targets is None; else (per-token loss (B, T), None)."""
        h, _ = self.hidden(idx)
        return self._logits(h) if targets is None else (self.head_losses(h, targets)[0], None)

    def head_losses(self, h: torch.Tensor, targets: torch.Tensor, f=None):
        """The per-token loss (B, T) and the model's log-softmax (B, T, V), float32."""
        logp = F.log_softmax(self._logits(h).float(), dim=-1)
        return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), logp

    def head_stats(self, h: torch.Tensor, targets: torch.Tensor, f=None):
        """What evaluation reads of the head (GPT.head_stats): the per-token loss (B, T), the
        log-probability of the targets, of the most likely token and that token (each (B, T)),
        float32, a block of rows at a time (the (B, T, V) log-softmax is never made)."""
        B, T, C = h.shape
        hf, yf = h.reshape(-1, C), targets.reshape(-1)
        rows = max(1, EVAL_BLOCK_BYTES // (4 * self.cfg.vocab_size))
        lp_y, lp_max, top = [], [], []
        with torch.no_grad():
            for a in range(0, len(hf), rows):
                logp = F.log_softmax(self._logits(hf[a : a + rows]).float(), dim=-1)  # (rows, V)
                m, t = logp.max(-1)
                lp_y.append(logp.gather(-1, yf[a : a + rows, None])[:, 0])
                lp_max.append(m)
                top.append(t)
        lp_y = torch.cat(lp_y).view(B, T)
        return -lp_y, lp_y, torch.cat(lp_max).view(B, T), torch.cat(top).view(B, T)

    @torch.no_grad()
    def next_distribution(self, h_last: torch.Tensor, f_last=None) -> torch.Tensor:
        return F.softmax(self._logits(h_last).float(), dim=-1)

    @staticmethod
    def crop_cache(kv, n: int):
        """The cache kept to its first n positions (drafted tokens rejected)."""
        if hasattr(kv, "crop"):
            if kv.get_seq_length() > n:
                kv.crop(n - kv.get_seq_length())  # a negative length: that many positions removed (transformers 4 and 5)
            return kv
        return tuple((k[:, :, :n], v[:, :, :n]) for k, v in kv)  # a legacy tuple cache

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hook_key_states(self, key: str, sink):
        """A hook handle that gives sink the `key` states (B, T, C) of each forward: "final" the
        last hidden states, "ffn_in" the input of the last layer's feed-forward."""
        if key == "final":
            return self.base.register_forward_hook(lambda m, i, o: sink(o[0]))
        if self.ffn is None:
            raise TeragramError(f"{self.name}: no feed-forward found in its last layer for the continuous cache: give --no-cont-cache")
        return self.ffn.register_forward_pre_hook(lambda m, a, kw: sink(a[0] if a else next(iter(kw.values()))), with_kwargs=True)


def _last_feed_forward(base: torch.nn.Module, n_layer: int):
    """The feed-forward module of the last decoder layer (the last element of the model's list
    of n_layer layers), or None."""
    for m in base.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n_layer and n_layer:
            for name in FEED_FORWARD_NAMES:
                if isinstance(getattr(m[-1], name, None), torch.nn.Module):
                    return getattr(m[-1], name)
    return None
