"""Per-shard filters of the 3-token strings each shard holds, so that bulk matching
(index/matching.py) skips the searches of shards that cannot hold a string.

Over many shards, most searches of the longest-match pass are made in shards that lack the
string: after a failed extension the shorter matches are probed in every shard from scratch, and
an extension narrows every shard that held the match. A search that finds nothing costs as much as
one that finds something (a full binary search). At 2.43B tokens in 12 shards, an exact test of a
probe's last 3 tokens would have spared half of those searches (held-out code).

Each shard's filter is a blocked Bloom filter: every window of 3 tokens of the shard's stream
(document ends included, so it holds a superset of the strings a search can ask for) sets 3 bits
of one 64-bit word picked by a hash of the window. A string whose 3 bits are not all set in that
word is not in the shard; one that passes may still be absent (then its search finds nothing, as
without the filter): answers never change. A test reads one word, one cache miss, against the
dozen or so of a search.

Words per shard: a power of two, one per POSITIONS_PER_WORD positions of the largest shard (2^20
words, 8 MiB, for shards of 210M positions; 96 MiB for the 2.43B-token index in 12 shards), and
at least MIN_WORDS. Only an index of several shards has them: trigrams.bin, uint64 (shard,
word), recorded in the manifest's "trigrams" (the shards' count and positions, the digest of
their recorded tokens and suffix arrays, format.shards_digest, and the words per shard), and
used only while that record matches the index.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numba as nb
import numpy as np

from . import format as fmt

FILE = "trigrams.bin"
WIDTH = 3  # tokens per filtered string
POSITIONS_PER_WORD = 256
MIN_WORDS = 1 << 10


def words(n_positions: int) -> int:
    """The filter's words per shard for shards of at most n_positions positions."""
    w = MIN_WORDS
    while w * POSITIONS_PER_WORD < n_positions:
        w *= 2
    return w


@nb.njit(inline="always")
def _hash(a, b, c):
    """A 64-bit hash of three token ids (multiply-xorshift rounds)."""
    h = (np.uint64(a) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    h = (h ^ (h >> np.uint64(31)) ^ np.uint64(b)) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(29)) ^ np.uint64(c)) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(32))


@nb.njit(inline="always")
def _bits(h):
    """The 3 bits of a hash's word (from its top 18 bits; its low bits pick the word)."""
    one = np.uint64(1)
    return (one << (h >> np.uint64(58))) | (one << ((h >> np.uint64(52)) & np.uint64(63))) | (one << ((h >> np.uint64(46)) & np.uint64(63)))


@nb.njit(cache=True, nogil=True)
def _fill(tok, out):
    mask = np.uint64(out.shape[0] - 1)
    for p in range(tok.shape[0] - WIDTH + 1):
        h = _hash(tok[p], tok[p + 1], tok[p + 2])
        out[h & mask] |= _bits(h)


def build(shards) -> np.ndarray:
    """(S, W) uint64: each shard's filter (shard.Shard objects, their token streams read once)."""
    out = np.zeros((len(shards), words(max((s.n for s in shards), default=0))), np.uint64)
    for row, s in zip(out, shards):
        _fill(np.asarray(s.tok), row)
    return out


@nb.njit(inline="always")
def word_of(filters, ids, end):
    """(word, bits) of ids[end - 3 : end] in every shard's filter (filters: (S, W) uint64, W a
    power of two): shard s may hold the string only if filters[s, word] has all the bits."""
    h = _hash(ids[end - 3], ids[end - 2], ids[end - 1])
    return np.int64(h & np.uint64(filters.shape[1] - 1)), _bits(h)


def holds(filters: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """(S,) bool: which shards' filters let the 3 tokens ids through (False: the shard lacks them)."""
    w, b = word_of(filters, np.asarray(ids, np.int64), 3)
    return (filters[:, w] & b) == b


def write(root, idx) -> dict:
    """Build and write the filters of an index's shards (idx: the index at root, opened on all
    its shards); returns the manifest's record of them."""
    grams = build(idx.shards)
    fmt.write_array(Path(root) / FILE, "trigrams", grams.reshape(-1))
    rec = {"shards": len(idx.shards), "positions": idx.n_positions, "words": grams.shape[1]}
    rec |= {"built_from": fmt.shards_digest(idx.manifest["shards"])}
    return rec | {"file": asdict(fmt.file_record(root, Path(root) / FILE))}


def current(root, rec: dict | None, shards: list[dict]) -> dict | None:
    """rec (a manifest's "trigrams" record) if the filters were built from these shards (a
    manifest's shard entries: their positions and recorded digests, fmt.shards_digest) and their
    file is there; else None: never used, rebuilt by build-index."""
    want = {"shards": len(shards), "positions": sum(s["n_positions"] for s in shards), "built_from": fmt.shards_digest(shards)}
    if not rec or any(rec.get(k) != v for k, v in want.items()):
        return None
    path = Path(root) / rec["file"]["path"]
    if rec.get("words") is None or not path.exists() or path.stat().st_size != rec["file"]["size"]:
        return None
    return rec


def load(root, manifest: dict) -> np.ndarray | None:
    """(S, W) uint64: the index's filters (memory-mapped), if built from its shards as they are."""
    rec = current(root, manifest.get("trigrams"), manifest["shards"])
    if rec is None:
        return None
    return np.asarray(fmt.open_array(Path(root) / FILE, "trigrams")).reshape(len(manifest["shards"]), rec["words"])
