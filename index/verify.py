"""`teragram verify`: check every file of an index against what the build recorded.

Each file's header (magic, version, CRC, kind) and size are checked, then its BLAKE2b digest
against the manifest, then the suffix-array order on a random sample of adjacent ranks.
Problems are returned as one line each, naming the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import format as fmt
from . import kernels
from .errors import IndexFormatError

_KINDS = {
    "tokens.bin": "tokens",
    "docs.bin": "docs",
    "sa.bin": "sa",
    "samax.bin": "samax",
    "unigram.bin": "unigram",
    "trigrams.bin": "trigrams",
}


def verify(root: str | Path, *, samples: int = 2000, seed: int = 0) -> list[str]:
    root = Path(root)
    problems: list[str] = []
    try:
        manifest = fmt.read_json(root / "manifest.json")
    except IndexFormatError as e:
        return [str(e)]
    records = (
        [manifest["tokenizer"]["file"]]
        + [f for s in manifest["shards"] for f in s["files"]]
        + manifest.get("contexts", {}).get("files", [])
        + ([manifest["trigrams"]["file"]] if "trigrams" in manifest else [])
    )
    for rec in records:
        path = root / rec["path"]
        if not path.exists():
            problems.append(f"{rec['path']}: missing")
            continue
        kind = _KINDS.get(path.name)
        if kind is not None:
            try:
                h = fmt.read_header(path)
                if h.kind != kind:
                    problems.append(f"{rec['path']}: holds {h.kind!r}, expected {kind!r}")
            except IndexFormatError as e:
                problems.append(str(e).replace(str(root) + "/", ""))
                continue
        size = path.stat().st_size
        if size != rec["size"]:
            problems.append(f"{rec['path']}: size {size}, the build recorded {rec['size']}")
            continue
        if fmt.file_digest(path) != rec["blake2b"]:
            problems.append(f"{rec['path']}: checksum mismatch (content changed since the build)")
    if problems:
        return problems
    try:
        from .meta import MetaStore

        ms = MetaStore(root)
        if ms.manifest() != manifest:
            problems.append("meta.lmdb: its manifest differs from manifest.json")
        if manifest["counts"]["docs"]:
            ms.doc(manifest["counts"]["docs"] - 1)
        ms.close()
    except IndexFormatError as e:
        problems.append(f"meta.lmdb: {e}")
    rng = np.random.default_rng(seed)
    sep = manifest["separator"]
    for s in manifest["shards"]:
        d = fmt.shard_dir(root, s["shard"], s.get("dir"))
        tok = fmt.open_array(d / "tokens.bin", "tokens")
        sa = fmt.open_packed(d / "sa.bin", "sa")
        n = sa.count
        if n < 2:
            continue
        k = min(samples, n - 1)
        ranks = np.arange(n - 1, dtype=np.int64) if k == n - 1 else rng.choice(n - 1, size=k, replace=False).astype(np.int64)
        bad = kernels.first_unordered(tok, sa.words, sa.width, ranks, sep)
        if bad >= 0:
            problems.append(f"shards/{s['shard']:06d}/sa.bin: suffixes out of order or bad pointer at rank {bad}")
    return problems
