"""Shards as the build writes them: encoded documents collected into shards of bounded size
(ShardWriter), each full shard's tokens written and its indexing (finish_shard: suffix array,
block maxima, unigram counts, completion marker) handed to the executor."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from teragram.index import format as fmt
from teragram.index import readers

from . import shard_index
from .build_state import Cursor, SkipStats


def finish_shard(
    out: str, shard: int, sep: int, vocab: int, marker: dict, memory_bytes: int = 1 << 62, part_positions=None, progress=False
) -> dict:
    """Index one shard whose tokens.bin/docs.bin/docs.jsonl are written: suffix array, block
    maxima, unigram counts, then the completion marker. The unit of work an executor runs;
    memory_bytes bounds its process's resident memory."""
    t = time.time()
    root = Path(out)
    d = fmt.shard_dir(root, shard, marker.get("dir"))
    stats = shard_index.write_shard_arrays(d, sep, vocab, memory_bytes, part_positions=part_positions, progress=progress)
    files = [asdict(fmt.file_record(root, d / n)) for n in fmt.SHARD_FILES]
    marker = marker | stats | {"files": files}
    fmt.write_json(fmt.shard_marker(root, shard), marker)
    shard_index.remove_parts(d)
    return {"shard": shard, "index_s": time.time() - t}


class ShardWriter:
    """Collects encoded documents into shards; writes each full shard's tokens and hands its
    indexing (finish_shard) to the executor."""

    def __init__(
        self, out: Path, shard: int, dtype: np.dtype, vocab: int, shard_tokens: int, skips: SkipStats, executor, shard_dirs=(), **task_kw
    ):
        self.out, self.shard, self.dtype, self.vocab, self.cap = out, shard, dtype, vocab, shard_tokens
        self.shard_dirs = [str(Path(x).resolve()) for x in shard_dirs]
        self.sep = fmt.separator(dtype)
        self.skips = skips
        self.executor = executor
        self.task_kw = task_kw  # memory_bytes, progress: passed on to finish_shard
        self.dir: Path | None = None
        self.starts: list[int] = []
        self.used = 0

    def _open(self) -> None:
        """Start the shard's files: tokens and document metadata are streamed to disk as they
        come, so memory does not grow with the shard."""
        where = self.shard_dirs[self.shard % len(self.shard_dirs)] if self.shard_dirs else None
        self.where = where
        self.dir = fmt.shard_dir(self.out, self.shard, where)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tokens = fmt.StreamWriter(self.dir / "tokens.bin", "tokens", self.dtype.name, None)
        self.meta_tmp = self.dir / ".docs.jsonl.tmp"
        self.meta_file = open(self.meta_tmp, "w")

    def add(self, cur: Cursor, doc: readers.Doc, ids: np.ndarray) -> None:
        """Add one document (split into parts if it alone exceeds a shard)."""
        room = self.cap - 1  # a part plus its separator must fit an empty shard
        pieces = [ids[i : i + room] for i in range(0, len(ids), room)] or [ids]
        for k, piece in enumerate(pieces):
            if k < cur.part:
                continue
            if self.used + len(piece) + 1 > self.cap and self.starts:
                self.flush(Cursor(cur.file, cur.record, k))
            if self.dir is None:
                self._open()
            m = {"source": doc.source, "record": doc.record, "part": k, "start": self.used, "length": len(piece)}
            with fmt.naming(self.meta_tmp):
                self.meta_file.write(json.dumps(m, sort_keys=True) + "\n")
            self.tokens.write(np.append(piece.astype(self.dtype), self.dtype.type(self.sep)))
            self.starts.append(self.used)
            self.used += len(piece) + 1

    def flush(self, cursor: Cursor) -> None:
        if not self.starts:
            return
        d = self.dir
        pos = self.used
        self.tokens.close()
        fmt.write_array(d / "docs.bin", "docs", np.array([*self.starts, pos], dtype=np.uint64))
        self.meta_file.close()
        os.replace(self.meta_tmp, d / "docs.jsonl")
        marker = {
            "shard": self.shard,
            "dir": self.where,
            "n_docs": len(self.starts),
            "n_tokens": int(pos - len(self.starts)),
            "n_positions": int(pos),
            "cursor": asdict(cursor),
            "skips": self.skips.to_json(),
        }
        self.executor.submit(finish_shard, str(self.out), self.shard, self.sep, self.vocab, marker, *self.task_args())
        self.shard += 1
        self.dir, self.starts, self.used = None, [], 0

    def task_args(self) -> tuple:
        kw = self.task_kw
        return (kw.get("memory_bytes", 1 << 62), kw.get("part_positions"), kw.get("progress", False))
