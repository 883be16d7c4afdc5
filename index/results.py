"""The answers of the query engine's operations (index.engine.Index), as frozen dataclasses
with the JSON that the CLI and the server give (infini-gram's field names where it has them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

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


@dataclass(frozen=True)
class NtdResult:
    prompt_cnt: int
    result_by_token_id: dict[int, tuple[int, float]]  # token -> (cont_cnt, prob)
    approx: bool = False

    def to_json(self) -> dict:
        return {
            "prompt_cnt": self.prompt_cnt,
            "result_by_token_id": {t: {"cont_cnt": c, "prob": p} for t, (c, p) in self.result_by_token_id.items()},
            "approx": self.approx,
        }


@dataclass(frozen=True)
class InfgramProbResult(ProbResult):
    suffix_len: int = 0

    def to_json(self) -> dict:
        return super().to_json() | {"suffix_len": self.suffix_len}


@dataclass(frozen=True)
class InfgramNtdResult(NtdResult):
    suffix_len: int = 0

    def to_json(self) -> dict:
        return super().to_json() | {"suffix_len": self.suffix_len}


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
