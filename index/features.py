"""The feature files: per-token index features stored beside an index's shards.

Layout: FEATS/manifest.json and FEATS/NNNNNN/{length,cont,count,topk_ids,topk_cnt}.bin,
one row per position of IDX/shards/NNNNNN/tokens.bin (topk arrays are (n, k) row-major).
cont and topk_ids use the token dtype with the separator value meaning "none"; counts are
uint32, saturating at 2^32-1. Held-out output (index/heldout.py) also holds tokens.bin,
docs.bin and a copy of the tokenizer. The builder writes the files of the indexed corpus
(builder/features.py); the model reads both kinds (model/training/data.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import format as fmt
from .errors import BuildError

MODES = ("causal", "exclude-doc")
FEATURE_FILES = ("length.bin", "cont.bin", "count.bin", "topk_ids.bin", "topk_cnt.bin")
_U32_MAX = np.iinfo(np.uint32).max


@dataclass(frozen=True)
class FeatureConfig:
    mode: str = "exclude-doc"
    max_len: int = 64
    top_k: int = 4

    def __post_init__(self) -> None:
        if self.mode not in MODES + ("held-out",):
            raise BuildError(f"unknown feature mode {self.mode!r}; expected causal, exclude-doc or held-out")
        if not 1 <= self.max_len <= 255:
            raise BuildError("--max-len must be in [1, 255]")
        if not 0 <= self.top_k <= 64:
            raise BuildError("--top-k must be in [0, 64]")


FIELDS = ("length", "cont", "count", "topk_ids", "topk_cnt")
WORKING_DTYPES = (np.uint8, np.int32, np.int64, np.int32, np.int32)  # the builder's per-shard arrays
SCORE_DTYPES = (np.int32, np.int32, np.int64, np.int32, np.int64)  # Index.score's


@dataclass(frozen=True)
class Features:
    """Per-position index features of a run of positions; position t predicts token t+1.

    length   (n,)   longest l <= max_len with tokens[t-l+1..t] in the allowed text
    cont     (n,)   token after the most recent allowed occurrence of that suffix (EOS at a
                    document end); none when length is 0
    count    (n,)   occurrences of that suffix (tokens + documents when length is 0)
    topk_ids (n, k) most frequent next tokens after the suffix (ties by id), none-padded
    topk_cnt (n, k) their counts
    target_cnt (n,) optional (Index.score(targets=True)): how often the actual next token
                    follows the suffix, the infgram_prob numerator

    "None" is -1 in memory and the separator id in the stored files (open_features returns
    them as stored; `decoded` turns them into int64 with -1). This one record serves the
    index (Index.score), the builder (bulk features), the files and the model, which holds
    torch tensors in it (model.gpt.to_torch).
    """

    length: np.ndarray
    cont: np.ndarray
    count: np.ndarray
    topk_ids: np.ndarray
    topk_cnt: np.ndarray
    target_cnt: np.ndarray | None = None

    @classmethod
    def empty(cls, n: int, k: int, dtypes=WORKING_DTYPES) -> Features:
        """n positions with nothing found (length 0, no cont, count 0), in the given dtypes
        (default: compact working arrays; per-shard counts fit int32)."""
        dl, dc, dn, di, dk = dtypes
        return cls(np.zeros(n, dl), np.full(n, -1, dc), np.zeros(n, dn), np.full((n, k), -1, di), np.zeros((n, k), dk))

    def map(self, fn) -> Features:
        """The record with fn applied to each of the five feature arrays."""
        return Features(*(fn(getattr(self, name)) for name in FIELDS))

    @classmethod
    def combine(cls, parts: list[Features], fn=np.concatenate) -> Features:
        """The records' arrays joined field by field (fn: concatenate, stack, ...)."""
        return cls(*(fn([getattr(p, name) for p in parts]) for name in FIELDS))

    def decoded(self, sep: int) -> Features:
        """Stored features as int64 working arrays, the separator ("none") turned into -1."""
        f = self.map(lambda a: np.asarray(a).astype(np.int64))
        f.cont[f.cont == sep] = -1
        f.topk_ids[f.topk_ids == sep] = -1
        return f

    def to_json(self) -> dict:
        return {name: getattr(self, name).tolist() for name in FIELDS}


class FeaturesWriter:
    """One shard's features written a run of positions at a time (`add`); `close` puts the files
    in place and returns their records. With k = 0 only length and cont (no distribution)."""

    def __init__(self, d: Path, token_dtype: np.dtype, sep: int, k: int):
        d.mkdir(parents=True, exist_ok=True)
        self.d, self.sep, self.k, self.dtype = d, sep, k, np.dtype(token_dtype)
        self.w = {"length": fmt.ArrayWriter(d / "length.bin", "feat.length", np.uint8)}
        self.w["cont"] = fmt.ArrayWriter(d / "cont.bin", "feat.cont", self.dtype)
        if k:
            self.w["count"] = fmt.ArrayWriter(d / "count.bin", "feat.count", np.uint32)
            self.w["topk_ids"] = fmt.ArrayWriter(d / "topk_ids.bin", "feat.topk_ids", self.dtype)
            self.w["topk_cnt"] = fmt.ArrayWriter(d / "topk_cnt.bin", "feat.topk_cnt", np.uint32)

    def _tok(self, a: np.ndarray) -> np.ndarray:
        return np.where(np.asarray(a) < 0, self.sep, a).astype(self.dtype)

    def add(self, f: Features) -> FeaturesWriter:
        self.w["length"].append(np.asarray(f.length).astype(np.uint8))
        self.w["cont"].append(self._tok(f.cont))
        if self.k:
            self.w["count"].append(np.minimum(f.count, _U32_MAX).astype(np.uint32))
            self.w["topk_ids"].append(self._tok(f.topk_ids).reshape(-1))
            self.w["topk_cnt"].append(np.clip(f.topk_cnt, 0, None).astype(np.uint32).reshape(-1))
        return self

    def close(self) -> list[dict]:
        return [asdict(fmt.file_record(self.d.parent, w.close())) for w in self.w.values()]

    def abort(self) -> None:
        for w in self.w.values():
            w.abort()


def write_features(d: Path, f: Features, token_dtype: np.dtype, sep: int, k: int) -> list[dict]:
    """Write one shard's features; with k = 0 only length and cont (no distribution)."""
    return FeaturesWriter(d, token_dtype, sep, k).add(f).close()


def open_features(d: Path, k: int) -> Features:
    """Memory-map one shard's features, as stored (k = 0: count and top-k are zeros / empty)."""
    length = fmt.open_array(d / "length.bin", "feat.length")
    cont = fmt.open_array(d / "cont.bin", "feat.cont")
    if not k:
        z = np.zeros((len(length), 0), np.uint32)
        return Features(length, cont, np.zeros(len(length), np.uint32), z, z)
    return Features(
        length,
        cont,
        fmt.open_array(d / "count.bin", "feat.count"),
        fmt.open_array(d / "topk_ids.bin", "feat.topk_ids").reshape(-1, k),
        fmt.open_array(d / "topk_cnt.bin", "feat.topk_cnt").reshape(-1, k),
    )


def begin(index_path: Path, out: Path, cfg: FeatureConfig, corpus: list[str] | None) -> dict:
    """Create (or resume) a features directory: its identity (format, configuration, index,
    corpus), refusing a directory that holds features of anything else."""
    out.mkdir(parents=True, exist_ok=True)
    ident = {
        "format_version": fmt.FORMAT_VERSION,
        "mode": cfg.mode,
        "max_len": cfg.max_len,
        "top_k": cfg.top_k,
        "index_manifest": fmt.file_digest(index_path / "manifest.json"),
        "corpus": corpus,
    }
    state = out / "features-state.json"
    if state.exists() and fmt.read_json(state) != ident:
        raise BuildError(f"{out} holds features of another index or configuration; choose another --out")
    fmt.write_json(state, ident)
    return ident


def finish(out: Path, ident: dict, shards: list[dict], positions: int, report: dict) -> None:
    """Write the manifest (identity, shards, positions) and the report."""
    fmt.write_json(out / "manifest.json", ident | {"shards": shards, "positions": positions})
    fmt.write_json(out / "features-report.json", report)


def top_counts(toks: np.ndarray, cnts: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """k most frequent (ties: smaller id first), -1/0 padded."""
    ids = np.full(k, -1, np.int32)
    cs = np.zeros(k, np.int64)
    if len(toks):
        order = np.lexsort((toks, -cnts))[:k]
        ids[: len(order)] = toks[order]
        cs[: len(order)] = cnts[order]
    return ids, cs
