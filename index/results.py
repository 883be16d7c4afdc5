"""The answers of the query engine's operations (index.engine.Index), as frozen dataclasses
with the JSON that the CLI and the server give (infini-gram's field names where it has them)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .engine import Index


@dataclass(frozen=True)
class CountResult:
    count: int
    approx: bool = False

    def to_json(self) -> dict:
        return {"count": self.count, "approx": self.approx}


@dataclass(frozen=True)
class ProbResult:
    prompt_cnt: int
    cont_cnt: int
    prob: float

    def to_json(self) -> dict:
        return {"prompt_cnt": self.prompt_cnt, "cont_cnt": self.cont_cnt, "prob": self.prob}


@dataclass(frozen=True, eq=False)
class NtdResult:
    """The next tokens after a prompt: their ids (ascending) and counts, as arrays (a histogram at
    2.43B tokens has up to a vocabulary's entries, and most callers want arrays)."""

    prompt_cnt: int
    tokens: np.ndarray  # int64, ascending
    counts: np.ndarray  # int64, > 0
    approx: bool = False

    def __post_init__(self):  # int64, read-only views: the engine keeps large histograms and answers with them
        for name in ("tokens", "counts"):
            v = np.asarray(getattr(self, name), np.int64).view()
            v.flags.writeable = False
            object.__setattr__(self, name, v)

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        pairs = ((getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self))
        return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in pairs)

    @classmethod
    def empty(cls, approx: bool = False) -> NtdResult:
        return cls(0, np.zeros(0, np.int64), np.zeros(0, np.int64), approx)

    @cached_property
    def result_by_token_id(self) -> dict[int, tuple[int, float]]:
        """token -> (cont_cnt, prob), infini-gram's form."""
        n = self.prompt_cnt
        return {t: (c, c / n) for t, c in zip(self.tokens.tolist(), self.counts.tolist())}

    def to_json(self, entries: bool = True) -> dict:
        """entries=False: the next tokens left out ({}), for a writer of its own (answer_json)."""
        by_id = {t: {"cont_cnt": c, "prob": p} for t, (c, p) in self.result_by_token_id.items()} if entries else {}
        return {"prompt_cnt": self.prompt_cnt, "result_by_token_id": by_id, "approx": self.approx}


@dataclass(frozen=True)
class InfgramProbResult(ProbResult):
    suffix_len: int = 0

    def to_json(self) -> dict:
        return super().to_json() | {"suffix_len": self.suffix_len}


@dataclass(frozen=True, eq=False)
class InfgramNtdResult(NtdResult):
    suffix_len: int = 0

    def to_json(self, entries: bool = True) -> dict:
        return super().to_json(entries) | {"suffix_len": self.suffix_len}


@dataclass(frozen=True)
class LongestMatch:
    length: int  # longest suffix of the ids that occurs
    cont: int  # token after its most recent occurrence (EOS at a document end; -1 if length 0)
    count: int  # occurrences of that suffix

    def to_json(self) -> dict:
        return {"suffix_len": self.length, "cont": self.cont, "count": self.count}


@dataclass(frozen=True)
class Occurrence:
    """Where a match occurs: shard (its place in Index.shards), start position, match length."""

    shard: int
    pos: int
    length: int


@dataclass(frozen=True)
class Provenance:
    """The document an occurrence lies in, from the LMDB metadata."""

    doc_id: int
    source: str  # the file it was read from
    record: int  # its record number in that file (0 for a plain text file)
    offset: int  # token offset of the match's start inside the document
    length: int  # match length, in tokens

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DocHit:
    doc_id: int
    shard: int
    offset: int  # token offset of the match inside the document
    metadata: dict
    snippet: str

    def to_json(self) -> dict:
        return {
            "doc_ix": self.doc_id,
            "shard": self.shard,
            "needle_offset": self.offset,
            "metadata": self.metadata,
            "snippet": self.snippet,
        }


@dataclass(frozen=True)
class DocsResult:
    count: int
    docs: list[DocHit]
    approx: bool = False  # True when only the first DOCS_SCAN occurrences were looked at

    def to_json(self) -> dict:
        return {"cnt": self.count, "approx": self.approx, "documents": [d.to_json() for d in self.docs]}


def with_tokens(idx: Index, answer: dict, ids, cont: int | None = None) -> dict:
    """A query's JSON answer with each token id's text beside it, as infini-gram's API gives
    them: the query's `token_ids` and `tokens`, a `token` in each next-token entry, and
    `cont_token` beside a continuation id (the query's `cont`, or longest-match's). The existing
    fields stay as they are."""
    out = dict(answer)
    if isinstance(cont, int):
        out["cont_token"] = idx.piece(cont)
    if "result_by_token_id" in out:
        out["result_by_token_id"] = {k: v | {"token": idx.piece(int(k))} for k, v in out["result_by_token_id"].items()}
    elif isinstance(out.get("cont"), int):
        out["cont_token"] = idx.piece(out["cont"])
    return out | {"token_ids": [int(i) for i in ids], "tokens": [idx.piece(int(i)) for i in ids]}


def answer_json(idx: Index, answer, ids, **extra) -> bytes:
    """The server's body for a query's answer: exactly the bytes of Starlette's JSONResponse of
    with_tokens(idx, answer.to_json(), ids) | extra, its next-token ids as strings. A next-token
    histogram is written from its arrays, each entry one formatted string: the nested dicts and
    json.dumps held the server's interpreter for tens of milliseconds on a 32,000-entry histogram
    (json.dumps is one C call, which no other thread interrupts), and every count waited."""
    ntd = isinstance(answer, NtdResult)
    out = with_tokens(idx, answer.to_json(entries=False) if ntd else answer.to_json(), ids) | extra
    body = json.dumps(out, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    if ntd and len(answer.tokens):
        n, pieces = answer.prompt_cnt, idx.piece_json
        probs = (answer.counts / n).tolist()  # counts < 2**53: the same doubles as int / int
        entries = ",".join(
            [
                f'"{t}":{{"cont_cnt":{c},"prob":{p!r},"token":{pieces[t]}}}'
                for t, c, p in zip(answer.tokens.tolist(), answer.counts.tolist(), probs)
            ]
        )
        key = '"result_by_token_id":{}'  # the first occurrence: the answer's keys come before the query's pieces
        body = body.replace(key, f'"result_by_token_id":{{{entries}}}', 1)
    return body.encode("utf-8")
