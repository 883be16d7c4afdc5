"""LMDB store of per-document metadata and the build manifest.

Keys:  b"doc" + uint64 big-endian global document id -> JSON {source, record, part, shard, start, length}
       b"manifest" -> the manifest JSON (manifest.json mirrors it for humans)
Global ids number documents across shards in build order; shard s holds ids
[first_doc(s), first_doc(s) + n_docs(s)). start/length are token offsets inside the shard.
The environment is written from scratch by the build's final phase, in one transaction, so the
same documents always give the same bytes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import lmdb

from . import format as fmt
from .errors import IndexFormatError

DIRNAME = "meta.lmdb"


def _doc_key(doc_id: int) -> bytes:
    return b"doc" + doc_id.to_bytes(8, "big")


def write(root: Path, markers: list[dict], manifest: dict, progress: Callable[[int], object] | None = None) -> None:
    path = Path(root) / DIRNAME
    tmp = Path(root) / ".meta.lmdb.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    size = sum((fmt.shard_dir(root, m["shard"], m.get("dir")) / "docs.jsonl").stat().st_size for m in markers)
    env = lmdb.open(str(tmp), map_size=max(1 << 24, 4 * size + (1 << 22)), subdir=True, lock=False, sync=True)
    doc_id = 0
    with env.begin(write=True) as txn:
        for m in markers:
            with open(fmt.shard_dir(root, m["shard"], m.get("dir")) / "docs.jsonl") as f:
                for line in f:
                    rec = json.loads(line)
                    rec["shard"] = m["shard"]
                    txn.put(_doc_key(doc_id), json.dumps(rec, sort_keys=True).encode())
                    doc_id += 1
                    if progress is not None:
                        progress(1)
        txn.put(b"manifest", json.dumps(manifest, sort_keys=True).encode())
    env.close()
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


class MetaStore:
    """Read-only view of the metadata of an index."""

    def __init__(self, root: Path):
        path = Path(root) / DIRNAME
        if not (path / "data.mdb").exists():
            raise IndexFormatError(f"{path}: missing LMDB metadata")
        try:
            self.env = lmdb.open(str(path), readonly=True, lock=False, subdir=True)
        except lmdb.Error as e:
            raise IndexFormatError(f"{path}: cannot open LMDB ({e})") from None

    def doc(self, doc_id: int) -> dict:
        with self.env.begin() as txn:
            raw = txn.get(_doc_key(doc_id))
        if raw is None:
            raise IndexFormatError(f"document {doc_id} has no metadata")
        return json.loads(raw)

    def manifest(self) -> dict:
        with self.env.begin() as txn:
            raw = txn.get(b"manifest")
        if raw is None:
            raise IndexFormatError("LMDB holds no manifest")
        return json.loads(raw)

    def close(self) -> None:
        self.env.close()
