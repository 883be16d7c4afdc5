"""An index's tokenizer: a sentencepiece model (trained here on a bounded sample of the corpus,
or given), or a Hugging Face tokenizer (`tokenizer.json`, read by the `tokenizers` library).

One type, `Tokenizer`, speaks for both: encode/decode, the text of one id, the vocabulary size,
the EOS id and the special ids, and the digest. An index holds its tokenizer's file as
`tokenizer.model` (sentencepiece) or `tokenizer.json` (Hugging Face), byte for byte as given, so
the digest (blake2b-128 of that file) is the same wherever the file is copied: the manifest
records it with the kind, and every build, saved outputs and checkpoint compares tokenizers by it.

A document is the tokenizer's plain encoding of its text: no BOS/EOS or other special token is
added, and a special token's text inside a document ("<|endoftext|>" written out) is encoded as
the text it is, never as the special id (`tokenizers`' encode_special_tokens), so a special id,
EOS included, never occurs inside an indexed document and a document's end is only its
separator.

Trained sentencepiece models round-trip every text exactly: identity normalization, no
whitespace collapsing, no dummy prefix, byte fallback for anything outside the learned pieces.
Ids 0, 1, 2 are <unk>, <s>, </s>; encoding never emits <s> or </s>, so </s> (EOS) is free to mean
"end of document" in next-token distributions and model inputs.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import sentencepiece as spm

from .errors import BuildError, TokenizerMismatch

FILES = {"sentencepiece": "tokenizer.model", "hf": "tokenizer.json"}  # kind -> its file in an index
# End-of-document tokens by name, for a Hugging Face tokenizer given without a tokenizer_config.json
# that names its eos_token (GPT-2, Pythia, OLMo; Llama 3; Llama 2, Mistral, T5; Gemma).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
# A sentencepiece "sentence" is one line of a document; long lines are cut so training
# stays bounded (the model still encodes longer lines, through byte fallback if needed).
_MAX_LINE = 8192


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _kind_of(data: bytes) -> str:
    """A tokenizer.json is a JSON object; a sentencepiece model is a protobuf (never starts with '{')."""
    return "hf" if data.lstrip()[:1] == b"{" else "sentencepiece"


class Tokenizer:
    """A sentencepiece or Hugging Face tokenizer with one interface (sentencepiece's names:
    `encode` takes a text or a list of texts, `id_to_piece`, `get_piece_size`).

    eos_id: the id reported for "end of document" (manifest's tokenizer.eos_id); by default
    sentencepiece's </s>, a Hugging Face tokenizer's EOS (`hf_eos_id`), else the vocabulary size
    (an id past every token)."""

    def __init__(self, data: bytes, *, name: str = "tokenizer", eos_id: int | None = None, config: dict | None = None):
        self.data, self.name = data, name
        self.kind = _kind_of(data)
        if self.kind == "hf":
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._hf = HFTokenizer.from_str(data.decode("utf-8"))
            except Exception as e:  # tokenizers raises a bare Exception with serde's message
                raise BuildError(
                    f"unreadable tokenizer {name}: not a Hugging Face tokenizer.json ({str(e).splitlines()[0][:120]})"
                ) from None
            self._hf.encode_special_tokens = True  # "<|endoftext|>" in a document is text, not the special id
            self.vocab_size = max(self._hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1
            default_eos = hf_eos_id(self._hf, config, self.vocab_size)
        else:
            self._sp = spm.SentencePieceProcessor()
            try:
                self._sp.LoadFromSerializedProto(data)
            except Exception:  # sentencepiece raises a bare RuntimeError/OSError with a C++ message
                raise BuildError(f"unreadable tokenizer model {name}: not a sentencepiece model or a tokenizer.json") from None
            self.vocab_size = self._sp.get_piece_size()
            e = self._sp.eos_id()
            default_eos = e if e >= 0 else self.vocab_size
        self.eos_id = default_eos if eos_id is None else int(eos_id)

    @property
    def file_name(self) -> str:
        """Its file's name in an index directory."""
        return FILES[self.kind]

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids that are no text: sentencepiece's control and unknown ids, a Hugging Face
        tokenizer's special added tokens."""
        if self.kind == "hf":
            return frozenset(i for i, t in self._hf.get_added_tokens_decoder().items() if t.special)
        return frozenset(i for i in range(self.vocab_size) if self._sp.is_control(i) or self._sp.is_unknown(i))

    @cached_property
    def digest(self) -> str:
        """blake2b-128 of its file: the tokenizer's identity."""
        return _digest(self.data)

    def get_piece_size(self) -> int:
        return self.vocab_size

    def encode(self, text: str | list[str]) -> list[int] | list[list[int]]:
        """Token ids of a text (a list of ids), or of each text of a list (a list of lists)."""
        if self.kind == "sentencepiece":
            return self._sp.encode(text)
        if isinstance(text, str):
            return self._hf.encode(text, add_special_tokens=False).ids
        return [e.ids for e in self._hf.encode_batch(list(text), add_special_tokens=False)]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids as uint32 (the builder's workers)."""
        return [np.asarray(ids, dtype=np.uint32) for ids in self.encode(texts)]

    def decode(self, ids) -> str:
        """The text of the ids; special ids (EOS, BOS, ...) write nothing."""
        ids = [int(i) for i in ids]
        if self.kind == "sentencepiece":
            return self._sp.decode(ids)
        return self._hf.decode(ids, skip_special_tokens=True)

    def id_to_piece(self, token: int) -> str:
        """The piece of one id as the tokenizer spells it (sentencepiece "▁the", byte-level BPE "Ġthe")."""
        if self.kind == "sentencepiece":
            return self._sp.id_to_piece(int(token))
        return self._hf.id_to_token(int(token)) or ""


def hf_eos_id(hf, config: dict | None, vocab_size: int) -> int:
    """A Hugging Face tokenizer's end-of-document id: tokenizer_config.json's eos_token when given,
    else the first special token named in EOS_NAMES, else vocab_size."""
    eos = (config or {}).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and hf.token_to_id(eos) is not None:
        return int(hf.token_to_id(eos))
    special = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    return next((special[n] for n in EOS_NAMES if n in special), vocab_size)


def source(path: Path | str) -> tuple[Path, dict | None]:
    """The tokenizer file a user names (--tokenizer): a sentencepiece .model or a tokenizer.json,
    or a directory holding tokenizer.json (a Hugging Face model directory; its
    tokenizer_config.json, if any, is returned to name the EOS) or tokenizer.model (an index)."""
    p = Path(path)
    if p.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (p / name).is_file():
                cfg = p / "tokenizer_config.json"
                try:
                    config = json.loads(cfg.read_text()) if name == "tokenizer.json" and cfg.is_file() else None
                except (OSError, ValueError) as e:
                    raise BuildError(f"unreadable {cfg}: {e}") from None
                return p / name, config
        raise BuildError(f"{p}: a directory without tokenizer.json or tokenizer.model")
    return p, None


def load(path: Path | str, *, eos_id: int | None = None) -> Tokenizer:
    """Load a tokenizer (a file or a directory, as `source` reads it), with a one-line error for
    a missing, unreadable or unknown file."""
    p, config = source(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise BuildError(f"cannot read tokenizer model {p}: {e.strerror}") from None
    return Tokenizer(data, name=str(p), eos_id=eos_id, config=config)


def digest(path: Path | str) -> str:
    """The tokenizer's identity: blake2b-128 of its file (a file, or a directory as `source` reads
    it), as every index manifest (tokenizer.digest, tokenizer.file.blake2b), build, saved outputs
    and joint checkpoint records it; two tokenizers are the same when their digests are."""
    p, _ = source(path)
    try:
        return _digest(p.read_bytes())
    except OSError as e:
        raise BuildError(f"cannot read tokenizer model {p}: {e.strerror}") from None


def check_same(directory: Path | str, index_dir: Path | str, *, recorded: str | None = None) -> None:
    """Refuse (TokenizerMismatch, one line) ids made with another tokenizer than the index's: a
    directory teragram wrote (held-out features, saved outputs) read against an index. The rule is
    the digest of the tokenizer's file (`digest`), that the directory holds a copy of or records
    (`recorded`, its manifest's): a tokenizer.json converted from a sentencepiece model is another
    tokenizer, even where it gives the same ids. (A transformers model's tokenizer is another
    thing and is checked by its ids: model/hf/adapter.py check_tokenizer.)"""
    mine, theirs = recorded or digest(directory), digest(index_dir)
    if mine != theirs:
        raise TokenizerMismatch(f"{directory} was made with another tokenizer than {index_dir} ({mine[:12]} vs {theirs[:12]})")


def find(directory: Path | str) -> Path:
    """The tokenizer file a directory written by teragram holds (an index, held-out features,
    saved outputs): tokenizer.model or tokenizer.json."""
    for name in FILES.values():
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    raise BuildError(f"{directory}: no tokenizer.model or tokenizer.json")


def copy(src_dir: Path | str, dst_dir: Path | str) -> Path:
    """Copy the tokenizer file of one teragram directory into another (same name); its path there.
    A tokenizer file of the other kind already there is removed: a directory holds one."""
    src = find(src_dir)
    dst = Path(dst_dir) / src.name
    for name in FILES.values():
        if name != src.name:
            (Path(dst_dir) / name).unlink(missing_ok=True)
    shutil.copyfile(src, dst)
    return dst


@dataclass(frozen=True)
class RoundTrip:
    """How many sampled documents decode back to their text: `failed` of `docs` do not."""

    docs: int
    failed: int
    example: str | None = None  # the source of the first that does not

    @property
    def share(self) -> float:
        return self.failed / self.docs if self.docs else 0.0

    def warning(self, name: str) -> str | None:
        """One line naming a tokenizer that does not round-trip, with the share of documents; None if it does."""
        if not self.failed:
            return None
        return (
            f"tokenizer {name} does not round-trip: decoding gives other text for {self.failed:,} of {self.docs:,} sampled "
            f"documents ({100 * self.share:.1f}%, e.g. {self.example}); the index is exact on its ids, but text shown from it differs"
        )

    def to_json(self) -> dict:
        return {"docs": self.docs, "failed": self.failed, "example": self.example}


def round_trip(tok: Tokenizer, docs: Iterable[tuple[str, str]], batch: int = 64) -> RoundTrip:
    """Encode and decode each (source, text) and count the documents whose text comes back other."""
    n, failed, example = 0, 0, None
    buf: list[tuple[str, str]] = []

    def check() -> None:
        nonlocal n, failed, example
        for (src, text), ids in zip(buf, tok.encode([t for _, t in buf])):
            n += 1
            if tok.decode(ids) != text:
                failed += 1
                example = example or src
        buf.clear()

    for d in docs:
        buf.append(d)
        if len(buf) >= batch:
            check()
    check()
    return RoundTrip(n, failed, example)


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
