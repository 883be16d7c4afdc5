"""Sentencepiece tokenizer: train one on a bounded sample of the corpus, or load a given one.

Trained models round-trip every text exactly: identity normalization, no whitespace
collapsing, no dummy prefix, byte fallback for anything outside the learned pieces. Ids 0, 1, 2
are <unk>, <s>, </s>; encoding never emits <s> or </s>, so </s> (EOS) is free to mean
"end of document" in next-token distributions and model inputs.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from . import format as fmt
from .errors import BuildError

# A sentencepiece "sentence" is one line of a document; long lines are cut so training
# stays bounded (the model still encodes longer lines, through byte fallback if needed).
_MAX_LINE = 8192


def digest(path: Path | str) -> str:
    """The tokenizer's identity: blake2b-128 of its model file, as every index manifest
    (tokenizer.file.blake2b), build, saved outputs and joint checkpoint records it; two
    tokenizers are the same when their digests are."""
    try:
        return fmt.file_digest(Path(path))
    except OSError as e:
        raise BuildError(f"cannot read tokenizer model {path}: {e.strerror}") from None


def load(path: Path | str) -> spm.SentencePieceProcessor:
    """Load a sentencepiece model, with a one-line error for a missing or unreadable file."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise BuildError(f"cannot read tokenizer model {path}: {e.strerror}") from None
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(data)
    except Exception:  # sentencepiece raises a bare RuntimeError/OSError with a C++ message
        raise BuildError(f"unreadable tokenizer model {path}: not a sentencepiece model") from None
    return sp


def _lines(texts: Iterable[str], budget_bytes: int) -> Iterator[str]:
    used = 0
    for text in texts:
        for line in text.split("\n"):
            if not line:
                continue
            line = line[:_MAX_LINE]
            used += len(line) + 1
            yield line
            if used >= budget_bytes:
                return


def train(texts: Iterable[str], vocab_size: int, *, sample_bytes: int = 64 << 20, threads: int = 2) -> bytes:
    """Train a BPE model on at most sample_bytes of the texts; returns the serialized model."""
    out = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_lines(texts, sample_bytes),
            model_writer=out,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=0.9995,
            max_sentence_length=_MAX_LINE * 4,
            input_sentence_size=0,
            num_threads=threads,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
        )
    except RuntimeError as e:
        # e.g. "Vocabulary size is too high" on a tiny sample
        raise BuildError(f"tokenizer training failed: {str(e).splitlines()[-1]}") from None
    return out.getvalue()


def eos_id(sp: spm.SentencePieceProcessor) -> int:
    """The id reported for "end of document": </s> when the model has one, else vocab size."""
    e = sp.eos_id()
    return e if e >= 0 else sp.get_piece_size()
