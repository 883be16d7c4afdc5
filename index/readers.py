"""Streaming corpus readers: turn input paths into documents, counting what they skip.

The corpus format is shared: `build` indexes it, `features --corpus` and `eval --corpus` read
held-out text in it, so it lives beside the index format rather than in the builder.

Readers implement only "read one file". ``walk`` lists input files in a deterministic order
(sorted, recursive); ``read_file`` yields ``Doc`` records and ``Skip`` records for one file.
Bad input never stops a build: binary files, invalid UTF-8, empty documents, malformed JSON
lines and corrupt parquet files are skipped and counted, with example paths in the report.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import BuildError

# Bytes of a file sniffed for NUL bytes to call it binary (what git and grep do).
_SNIFF = 8192


@dataclass(frozen=True)
class Doc:
    source: str  # path as given / found
    record: int  # record number inside the file (0 for a plain text file)
    text: str


@dataclass(frozen=True)
class Skip:
    source: str
    record: int
    reason: str  # one of: binary, invalid-utf8, empty, bad-json, no-text-field, corrupt-parquet, unreadable


def walk(inputs: list[str]) -> list[Path]:
    """Files under the inputs (recursive, sorted, hidden entries included); missing input is an error."""
    files: list[Path] = []
    for raw in inputs:
        p = Path(raw)
        if not p.exists():
            raise BuildError(f"input not found: {raw}")
        if p.is_dir():
            files.extend(sorted(q for q in p.rglob("*") if q.is_file()))
        else:
            files.append(p)
    return files


def _kind(path: Path) -> tuple[str, str | None]:
    """(format, compression) from the file name: 'x.jsonl.gz' -> ('jsonl', 'gz')."""
    suffixes = [s.lower() for s in path.suffixes]
    comp = None
    if suffixes and suffixes[-1] in (".gz", ".zst"):
        comp = suffixes[-1][1:]
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    if last in (".jsonl", ".json"):
        return "jsonl", comp
    if last == ".parquet":
        return "parquet", comp
    return "text", comp


def _open_bytes(path: Path, comp: str | None) -> io.BufferedIOBase:
    if comp == "gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if comp == "zst":
        import zstandard

        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return io.BufferedReader(raw)  # type: ignore[arg-type]  # adds readline/iteration
    return open(path, "rb")


def _decode(source: str, record: int, raw: bytes) -> Doc | Skip:
    if b"\0" in raw[:_SNIFF]:
        return Skip(source, record, "binary")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Skip(source, record, "invalid-utf8")
    if not text.strip():
        return Skip(source, record, "empty")
    return Doc(source, record, text)


def _text_of(source: str, record: int, text: object) -> Doc | Skip:
    if not isinstance(text, str):
        return Skip(source, record, "no-text-field")
    if not text.strip():
        return Skip(source, record, "empty")
    return Doc(source, record, text)


def read_file(path: Path, source: str | None = None) -> Iterator[Doc | Skip]:
    """Documents of one file, in record order."""
    src = source if source is not None else str(path)
    fmt, comp = _kind(path)
    try:
        if fmt == "parquet":
            yield from _read_parquet(path, src, comp)
            return
        with _open_bytes(path, comp) as f:
            if fmt == "jsonl":
                for i, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        yield Skip(src, i, "bad-json")
                        continue
                    yield _text_of(src, i, obj.get("text") if isinstance(obj, dict) else None)
            else:
                yield _decode(src, 0, f.read())
    except (OSError, EOFError) as e:  # unreadable, bad gzip/zstd stream
        yield Skip(src, -1, f"unreadable: {type(e).__name__}")


def _read_parquet(path: Path, src: str, comp: str | None) -> Iterator[Doc | Skip]:
    """A parquet file is read whole before any record is yielded, so a corrupt file is skipped
    entirely rather than half-included (its text column must fit in memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if comp is not None:
            with _open_bytes(path, comp) as f:
                pf = pq.ParquetFile(pa.BufferReader(f.read()))
        else:
            pf = pq.ParquetFile(path)
        if "text" not in pf.schema_arrow.names:
            yield Skip(src, -1, "no-text-field")
            return
        texts = pf.read(columns=["text"]).column(0).to_pylist()
    except (pa.ArrowException, OSError) as e:
        yield Skip(src, -1, f"corrupt-parquet: {str(e).splitlines()[0][:80]}")
        return
    for i, text in enumerate(texts):
        yield _text_of(src, i, text)
