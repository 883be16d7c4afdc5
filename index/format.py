"""The on-disk format of a teragram index. This module alone reads and writes its files.

Every binary file is a 64-byte header followed by a flat little-endian array:

    offset  size  field
    0       8     magic b"TERAGRAM"
    8       16    kind, ASCII, NUL-padded ("tokens", "docs", "sa", "samax", "feat.len", ...)
    24      4     format version (uint32)
    28      8     dtype, ASCII, NUL-padded ("uint16", ..., or "packed" for bit-packed pointers)
    36      4     element width in bits
    40      8     element count (uint64)
    48      12    reserved, zero
    60      4     CRC-32 of bytes 0..59

The body starts at byte 64 and is opened with ``np.memmap``; a "packed" body is a stream of
uint64 words (see ``index/packed.py``). Opening checks magic, version, header CRC, kind, and
that the file size is exactly header + body, so a truncated file is refused by name.

Writes go to a temporary name in the same directory, are fsynced, then renamed into place;
callers then write a completion marker (``write_json`` is atomic too). Resume trusts markers
and recorded sizes, never the mere existence of a file.

Format versions: 2 (written now) and 1 (read). Version 2 indexes hold uint16 token ids when the
vocabulary, EOS included, has at most 65,535 ids (token_dtype), else uint32, so SEP (the dtype's
largest value) is never an id; the width is in tokens.bin's header (dtype, width) and the
manifest (token_dtype); the tokenizer is a sentencepiece model or a Hugging Face tokenizer.json,
its kind and digest in the manifest (tokenizer.kind, tokenizer.digest). Version 1 indexes (a
sentencepiece tokenizer, manifest without kind and digest) open unchanged.

Index directory layout (FORMAT_VERSION 2):

    IDX/manifest.json              build manifest (mirrors the LMDB copy), for humans
    IDX/tokenizer.model            sentencepiece model, or
    IDX/tokenizer.json             Hugging Face tokenizer (index/tokenizer.py)
    IDX/meta.lmdb/                 LMDB: per-document metadata + manifest
    IDX/shards/NNNNNN/tokens.bin   token stream: doc0 SEP doc1 SEP ... (uint16 or uint32; SEP = dtype max)
    IDX/shards/NNNNNN/docs.bin     uint64 start offset of each document, then total length
    IDX/shards/NNNNNN/sa.bin       packed suffix array over the non-SEP positions
    IDX/shards/NNNNNN/samax.bin    uint32 block maxima of the suffix array (range-max queries)
    IDX/shards/NNNNNN/unigram.bin  uint64 count of each vocabulary id in the shard
    IDX/shards/NNNNNN/top.pos.bin  int64 suffix-array samples, every 2^k-th rank (top_cache.py)
    IDX/shards/NNNNNN/top.prefix.bin  the first tokens of those samples' suffixes
    IDX/shards/NNNNNN/contexts.{nodes,hist}.bin  next-token histograms of the frequent contexts
                                   (index/contexts.py)
    IDX/shards/NNNNNN/docs.jsonl   per-document metadata, the source of the LMDB store
    IDX/shards/NNNNNN.done         completion marker: file sizes, digests, input cursor
    IDX/shards/NNNNNN/sa.parts/    while a shard is built only: sorted suffix-array parts
                                   (kind "sa.part", uint32/uint64 positions) with markers
    IDX/features/MODE/NNNNNN/*.bin per-token features, aligned with tokens.bin
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import packed
from .errors import IndexFormatError

FORMAT_VERSION = 2  # what this code writes
READ_VERSIONS = (1, 2)  # what it reads (module docstring)
MAGIC = b"TERAGRAM"
HEADER_SIZE = 64
_HEADER = struct.Struct("<8s16sI8sIQ12s")  # 60 bytes, then the CRC
_DTYPES = {
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "int32": np.int32,
    "int64": np.int64,
    "float32": np.float32,
}
SHARD_FILES = ("tokens.bin", "docs.bin", "docs.jsonl", "sa.bin", "samax.bin", "unigram.bin", "top.pos.bin", "top.prefix.bin")
SHARD_FILES += ("contexts.nodes.bin", "contexts.hist.bin")
# Block sizes (in suffix-array ranks) of the three levels of samax.bin.
SAMAX_BLOCKS = (64, 4096, 262144)


@dataclass(frozen=True)
class Header:
    kind: str
    dtype: str
    width: int
    count: int

    @property
    def body_size(self) -> int:
        if self.dtype == "packed":
            return packed.n_words(self.count, self.width) * 8
        return self.count * np.dtype(_DTYPES[self.dtype]).itemsize


@dataclass(frozen=True)
class FileRecord:
    """What the manifest records of each file: checked by ``teragram verify``."""

    path: str  # relative to the index directory
    size: int
    blake2b: str


def encode_header(h: Header) -> bytes:
    if len(h.kind.encode()) > 16:  # the header's field: a longer kind would be cut and never match on open
        raise ValueError(f"file kind {h.kind!r} is over 16 bytes")
    body = _HEADER.pack(MAGIC, h.kind.encode(), FORMAT_VERSION, h.dtype.encode(), h.width, h.count, bytes(12))
    return body + struct.pack("<I", zlib.crc32(body))


def decode_header(raw: bytes, name: str) -> Header:
    if len(raw) < HEADER_SIZE:
        raise IndexFormatError(f"{name}: truncated header ({len(raw)} bytes)")
    magic, kind, version, dtype, width, count, _ = _HEADER.unpack(raw[:60])
    if magic != MAGIC:
        raise IndexFormatError(f"{name}: not a teragram file (bad magic)")
    (crc,) = struct.unpack("<I", raw[60:64])
    if crc != zlib.crc32(raw[:60]):
        raise IndexFormatError(f"{name}: header checksum mismatch")
    if version not in READ_VERSIONS:
        raise IndexFormatError(f"{name}: format version {version}, this teragram reads {', '.join(map(str, READ_VERSIONS))}")
    dt = dtype.rstrip(b"\0").decode()
    if dt != "packed" and dt not in _DTYPES:
        raise IndexFormatError(f"{name}: unknown dtype {dt!r}")
    return Header(kind.rstrip(b"\0").decode(), dt, width, count)


def read_header(path: Path) -> Header:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except FileNotFoundError:
        raise IndexFormatError(f"{path}: missing") from None
    h = decode_header(raw, str(path))
    size = path.stat().st_size
    if size != HEADER_SIZE + h.body_size:
        raise IndexFormatError(f"{path}: size {size} != {HEADER_SIZE + h.body_size} expected from its header (truncated?)")
    return h


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _finish(tmp: Path, path: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextmanager
def naming(path: Path):
    """An OSError raised inside names `path` (a write to an open file, e.g. on a full disk,
    names no file of its own)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None


def write_array(path: Path, kind: str, arr: np.ndarray) -> None:
    """Atomically write a flat array with its header."""
    path = Path(path)
    arr = np.ascontiguousarray(arr)
    dtype = arr.dtype.name
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype}")
    head = encode_header(Header(kind, dtype, arr.dtype.itemsize * 8, arr.size))  # refused before any file is made
    tmp = _tmp_name(path)
    with naming(tmp), open(tmp, "wb") as f:
        f.write(head)
        arr.astype(arr.dtype.newbyteorder("<"), copy=False).tofile(f)
    _finish(tmp, path)


class ArrayWriter:
    """A flat array written a part at a time (`append`), for arrays that never sit whole in
    memory; `close` writes the header with the final count and puts the file in place
    atomically (until then only a temporary file exists)."""

    def __init__(self, path: Path, kind: str, dtype):
        self.path, self.kind, self.dtype = Path(path), kind, np.dtype(dtype)
        if self.dtype.name not in _DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype.name}")
        self.count = 0
        self.tmp = _tmp_name(self.path)
        self.f = open(self.tmp, "wb")
        self.f.write(bytes(HEADER_SIZE))

    def append(self, arr) -> None:
        a = np.ascontiguousarray(arr, self.dtype).reshape(-1)
        with naming(self.tmp):
            a.astype(self.dtype.newbyteorder("<"), copy=False).tofile(self.f)
        self.count += a.size

    def close(self) -> Path:
        with naming(self.tmp):
            self.f.seek(0)
            self.f.write(encode_header(Header(self.kind, self.dtype.name, self.dtype.itemsize * 8, self.count)))
            self.f.close()
        _finish(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def write_packed(path: Path, kind: str, words: np.ndarray, width: int, count: int) -> None:
    """Atomically write a bit-packed array (words from ``packed.pack``)."""
    path = Path(path)
    if words.size != packed.n_words(count, width):
        raise ValueError("word count does not match count and width")
    tmp = _tmp_name(path)
    with naming(tmp), open(tmp, "wb") as f:
        f.write(encode_header(Header(kind, "packed", width, count)))
        words.astype("<u8", copy=False).tofile(f)
    _finish(tmp, path)


class StreamWriter:
    """Write a flat or packed array chunk by chunk, atomically: the header (with the final
    count) first, the body appended, then fsync and rename on ``close``. A writer abandoned
    before ``close`` leaves only its temporary file, which resume deletes.

    ``count`` None means unknown until ``close`` (flat arrays only). ``dtype`` is a numpy
    dtype name, or "packed" with ``width`` bits (chunks are then uint64
    words from ``packed.pack``; their total must be ``packed.n_words(count, width)``).
    """

    def __init__(self, path: Path, kind: str, dtype: str, count: int | None, width: int = 0):
        self.path = Path(path)
        self.open_count = count is None  # the count is what was written, set on close
        count = 0 if count is None else count
        if dtype != "packed" and dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype}")
        self.dtype = np.dtype("<u8") if dtype == "packed" else np.dtype(_DTYPES[dtype]).newbyteorder("<")
        self.header = Header(kind, dtype, width if dtype == "packed" else self.dtype.itemsize * 8, count)
        self.tmp = _tmp_name(self.path)
        with naming(self.tmp):
            self.f = open(self.tmp, "wb")
            self.f.write(encode_header(self.header))
        self.written = 0

    def write(self, chunk: np.ndarray) -> None:
        with naming(self.tmp):
            self.f.write(np.ascontiguousarray(chunk, dtype=self.dtype).tobytes())
        self.written += chunk.size

    def close(self) -> None:
        with naming(self.tmp):
            if self.open_count:
                self.header = Header(self.header.kind, self.header.dtype, self.header.width, self.written)
                self.f.seek(0)
                self.f.write(encode_header(self.header))
            self.f.close()
        if self.written * self.dtype.itemsize != self.header.body_size:
            raise ValueError(f"{self.path}: wrote {self.written} elements, header says {self.header.body_size // self.dtype.itemsize}")
        _finish(self.tmp, self.path)


def open_array(path: Path, kind: str) -> np.ndarray:
    """Memory-map a flat array after checking its header and size."""
    h = read_header(path)
    if h.kind != kind:
        raise IndexFormatError(f"{path}: holds {h.kind!r}, expected {kind!r}")
    if h.dtype == "packed":
        raise IndexFormatError(f"{path}: packed file opened as a flat array")
    if h.count == 0:
        return np.zeros(0, dtype=_DTYPES[h.dtype])
    return np.memmap(path, dtype=np.dtype(_DTYPES[h.dtype]).newbyteorder("<"), mode="r", offset=HEADER_SIZE, shape=(h.count,))


@dataclass(frozen=True)
class PackedArray:
    words: np.ndarray  # (n_words,) uint64
    width: int
    count: int

    def __len__(self) -> int:
        return self.count

    def to_numpy(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        return packed.unpack(self.words, self.width, self.count, lo, hi)


def open_packed(path: Path, kind: str) -> PackedArray:
    h = read_header(path)
    if h.kind != kind or h.dtype != "packed":
        raise IndexFormatError(f"{path}: holds {h.kind!r}/{h.dtype}, expected packed {kind!r}")
    n = packed.n_words(h.count, h.width)
    words = np.memmap(path, dtype="<u8", mode="r", offset=HEADER_SIZE, shape=(n,))
    return PackedArray(words, h.width, h.count)


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def shards_digest(shards: list[dict]) -> str:
    """The digest of what an index's derived tables (index/merged.py, index/trigrams.py) are built
    from: each shard's positions, token stream and suffix array, by the blake2b digests the build
    recorded of their files (the manifest's shard entries). A table records it when written and is
    used only while it matches the index it is opened with: a shard rebuilt with other text of the
    same length changes it."""
    h = hashlib.blake2b(digest_size=16)
    for s in shards:
        files = {Path(f["path"]).name: f["blake2b"] for f in s["files"]}
        h.update(f"{s['n_positions']}:{files.get('tokens.bin')}:{files.get('sa.bin')};".encode())
    return h.hexdigest()


def marker_of(root: Path, shard: int, where: str | None = None) -> Path | None:
    """A shard's completion marker: ROOT/shards/NNNNNN.done, or, for a shard linked in from
    another index (a composed index), the marker beside the folder the link points to; None if
    neither exists."""
    own = shard_marker(root, shard)
    if own.exists():
        return own
    d = shard_dir(root, shard, where).resolve()
    beside = d.parent / f"{d.name}.done"
    return beside if beside.exists() else None


def file_record(root: Path, path: Path) -> FileRecord:
    """Record a file by its path relative to the index root (absolute when it lies elsewhere)."""
    p = Path(path)
    rel = str(p.relative_to(root)) if p.is_relative_to(root) else str(p.resolve())
    return FileRecord(rel, p.stat().st_size, file_digest(p))


def write_json(path: Path, obj: Any) -> None:
    """Atomically write JSON (sorted keys, so identical content gives identical bytes)."""
    path = Path(path)
    tmp = _tmp_name(path)
    with naming(tmp), open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
    _finish(tmp, path)


def read_json(path: Path) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise IndexFormatError(f"{path}: missing") from None
    except json.JSONDecodeError as e:
        raise IndexFormatError(f"{path}: corrupt JSON ({e})") from None


def read_manifest(root: Path) -> dict:
    """An index's manifest.json, of a format version this code reads (else IndexFormatError); a
    version 1 manifest gets the tokenizer kind and digest that version 2 records."""
    if not (root / "manifest.json").exists():
        raise IndexFormatError(f"{root}: not a teragram index (no manifest.json)")
    manifest = read_json(root / "manifest.json")
    if manifest.get("format_version") not in READ_VERSIONS:
        raise IndexFormatError(
            f"{root}: format version {manifest.get('format_version')}, this teragram reads {', '.join(map(str, READ_VERSIONS))}"
        )
    tk = manifest.get("tokenizer")
    if manifest["format_version"] == 1 and isinstance(tk, dict) and "file" in tk:
        manifest["tokenizer"] = {"kind": "sentencepiece", "digest": tk["file"]["blake2b"]} | tk
    return manifest


# ---- layout -------------------------------------------------------------------------------


def shard_dir(root: Path, shard: int, where: str | None = None) -> Path:
    """A shard's directory: ROOT/shards/NNNNNN, or WHERE/NNNNNN for a shard placed on another
    disk or mount (the manifest's shard entry records "dir")."""
    return (Path(where) if where else Path(root) / "shards") / f"{shard:06d}"


def shard_marker(root: Path, shard: int) -> Path:
    return Path(root) / "shards" / f"{shard:06d}.done"


def features_dir(root: Path, mode: str, shard: int) -> Path:
    return Path(root) / "features" / mode / f"{shard:06d}"


def token_dtype(n_ids: int) -> np.dtype:
    """The token stream's type for ids 0..n_ids-1 (the vocabulary and EOS): uint16 when they all
    fit below the separator (the dtype's largest value, 65,535), so up to 65,535 ids, else uint32."""
    return np.dtype(np.uint16) if n_ids <= 0xFFFF else np.dtype(np.uint32)


def manifest_counts(shards: list[dict], docs: int) -> dict:
    """The manifest's "counts" block for these shard records."""
    return {
        "shards": len(shards),
        "docs": docs,
        "tokens": sum(s["n_tokens"] for s in shards),
        "positions": sum(s["n_positions"] for s in shards),
    }


def separator(dtype: np.dtype) -> int:
    """The document separator: the largest value of the token dtype, never a vocabulary id."""
    return int(np.iinfo(dtype).max)
