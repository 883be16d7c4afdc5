"""`teragram export --hf OUT --checkpoint RUN`: a native checkpoint written as a transformers model
(config.json, model.safetensors, the tokenizer as a fast tokenizer), which
`AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)` load without
teragram.

The GPT-2 block is GPT-2's architecture (GPT2LMHeadModel): the same layers, with the linear
layers' weights transposed (GPT-2's Conv1D keeps them as (in, out)), zero biases where the
native model has none, exact GELU, LayerNorm eps 1e-5, the head tied or not as the native one.
The modern block (rotary positions, RMSNorm, weightless QK-norm, ReLU² feed-forward) matches no
standard architecture exactly and is refused. A model with index inputs has none either.

The tokenizer is the index's: a sentencepiece model converted by transformers' own converter
(`SpmConverter.build_tokenizer_from_spm_proto`, which follows the model's normalizer settings),
a Hugging Face tokenizer.json copied byte for byte; either way the written tokenizer, loaded back
with AutoTokenizer, is checked to give the index's ids on PROBE and on a sample of the index's
documents (`verify_tokenizer`), and refused if not.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from teragram.index import tokenizer
from teragram.index.errors import TeragramError, TokenizerMismatch
from teragram.model.hf.adapter import PROBE, _transformers

VERIFY_TOKENS = 200_000  # the index's tokens (whole documents from its first shard) whose text the tokenizers must encode alike
GPT2_LINEAR = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # Conv1D in transformers' GPT-2: weight (in, out)


def fast_tokenizer(path: Path, eos_id: int):
    """The index's tokenizer file (a tokenizer.json, or a sentencepiece tokenizer.model converted)
    as a transformers fast tokenizer that never matches special tokens in text (the index's
    tokenizer never emits them: split_special_tokens)."""
    tf = _transformers()
    if path.name == tokenizer.FILES["hf"]:
        tok = tf.PreTrainedTokenizerFast(tokenizer_file=str(path), split_special_tokens=True)
        eos = tok.convert_ids_to_tokens(eos_id) if 0 <= eos_id < len(tok) else None
        if eos is not None:
            tok.add_special_tokens({"eos_token": eos})
        return tok
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    proto = import_protobuf().ModelProto()
    proto.ParseFromString(path.read_bytes())
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    build = SpmConverter.build_tokenizer_from_spm_proto
    legacy = {"legacy": False} if "legacy" in inspect.signature(build).parameters else {}
    merges = spm_merges(proto) if proto.trainer_spec.model_type == 2 else None  # BPE
    backend = build(proto, vocab, merges=merges, **legacy)
    if backend is None:
        raise TeragramError(f"{path}: transformers cannot convert this sentencepiece model")
    pieces = [p.piece for p in proto.pieces]
    names = {k: v for k, v in {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}.items() if v in vocab}
    if 0 <= eos_id < len(pieces):
        names["eos_token"] = pieces[eos_id]
    return tf.PreTrainedTokenizerFast(tokenizer_object=backend, split_special_tokens=True, **names)


def spm_merges(proto) -> list[tuple[str, str]]:
    """A sentencepiece BPE model's merges: every split of a normal piece into two normal pieces,
    ranked by the piece's score, then id. transformers >= 5.2x builds these itself when given none;
    older versions (5.17 on the GPU machine) build a BPE with no merges, which encodes characters."""
    normal = {p.piece: (p.score, i) for i, p in enumerate(proto.pieces) if p.type == 1}
    ranked = sorted((-r[0], r[1], t[:k], t[k:]) for t, r in normal.items() for k in range(1, len(t)) if t[:k] in normal and t[k:] in normal)
    return [(a, b) for _, _, a, b in ranked]


def verify_tokenizer(tok, idx, *, n_tokens: int = VERIFY_TOKENS) -> int:
    """Refuse (TokenizerMismatch) a tokenizer that gives other ids than the index's on PROBE or on
    the text of the index's first documents (about n_tokens); returns the texts compared."""
    texts = [PROBE]
    sh = idx.shards[0]
    ids = np.asarray(sh.tok[: min(n_tokens, len(sh.tok))]).astype(np.int64)
    cuts = np.flatnonzero(ids == idx.sep)
    texts += [idx.decode(d) for d in np.split(ids, cuts)[: len(cuts)] if len(d)]
    got = tok(texts, add_special_tokens=False)["input_ids"]
    bad = sum(a != idx.tokenize(t) for a, t in zip(got, texts))
    if bad:
        raise TokenizerMismatch(f"the exported tokenizer gives other ids than the index's on {bad} of {len(texts)} texts: not exported")
    return len(texts)


def gpt2_model(model, eos_id: int):
    """A transformers GPT2LMHeadModel with the native GPT-2-block model's weights (eos_id: its
    end-of-text id, the index's)."""
    tf = _transformers()
    c = model.cfg
    config = tf.GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=4 * c.n_embd,
        activation_function="gelu",  # the native MLP's F.gelu: exact, not GPT-2's tanh approximation
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,  # torch's LayerNorm default
        tie_word_embeddings=model.tied,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    hf = tf.GPT2LMHeadModel(config)
    native = model.state_dict()
    sd = {}
    for name, p in hf.state_dict().items():
        src = native.get(name)
        if src is None and name.endswith(".bias"):
            src = torch.zeros_like(p)  # a native model without biases
        if src is None:
            raise TeragramError(f"export: no native weight for {name}")
        if any(name.endswith(f"{lin}.weight") for lin in GPT2_LINEAR):
            src = src.T  # Linear (out, in) -> Conv1D (in, out)
        if src.shape != p.shape:
            raise TeragramError(f"export: {name} is {tuple(src.shape)} natively, {tuple(p.shape)} in GPT-2")
        sd[name] = src.detach().float().contiguous()
    hf.load_state_dict(sd)
    return hf.eval()


def refuse_unmappable(cfg) -> None:
    """One line naming what keeps a native model from a standard transformers architecture."""
    if cfg.use_index:
        raise TeragramError("a model with index inputs has no transformers architecture: export a plain model (train --use_index=false)")
    if cfg.arch != "gpt2":
        raise TeragramError(
            f"the {cfg.arch} block matches no standard transformers architecture exactly: its feed-forward is ReLU² (Llama's and"
            " Qwen's are gated SiLU), its QK-norm has no weights and its rotary positions turn the other way; only the gpt2 block exports"
        )


def export_hf(checkpoint, out, *, index=None) -> dict:
    """Write the native checkpoint (a run or checkpoint directory) as a transformers model to
    `out`, with the tokenizer of `index` (default: the index the run trained on); written to a
    temporary directory and renamed. Returns what was written."""
    from teragram.index.engine import Index
    from teragram.model.checkpoint import load_model

    model, meta = load_model(checkpoint)
    refuse_unmappable(model.cfg)
    index = index or meta.get("train", {}).get("index")
    if not index or not (Path(index) / "manifest.json").exists():
        raise TeragramError(f"export: the index whose tokenizer the model reads was not found ({index}): give --index")
    idx = Index(index)
    if model.cfg.vocab_size != idx.vocab_size:
        raise TokenizerMismatch(f"checkpoint vocabulary {model.cfg.vocab_size} != index vocabulary {idx.vocab_size}")
    src = tokenizer.find(index)
    tok = fast_tokenizer(src, idx.eos_id)
    verify_tokenizer(tok, idx, n_tokens=0)  # the probe text first: a tokenizer that cannot be the index's costs no export
    hf = gpt2_model(model, idx.eos_id)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if src.name == tokenizer.FILES["hf"]:
            shutil.copyfile(src, tmp / src.name)  # the index's tokenizer.json byte for byte: build-index --tokenizer OUT gives its digest
        cfg_file = tmp / "tokenizer_config.json"  # a class transformers 4 knows too (5 writes its backend's name)
        cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
        checked = verify_tokenizer(_transformers().AutoTokenizer.from_pretrained(tmp), idx)  # what a user will load
        (tmp / "teragram.json").write_text(
            json.dumps({"checkpoint": str(checkpoint), "step": meta.get("step"), "index": str(index)}, indent=1)
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written model is left to be loaded
        raise
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return {"out": str(out), "architecture": type(hf).__name__, "params": sum(p.numel() for p in hf.parameters()), "texts_checked": checked}
