"""One shard of an opened index: its memory-mapped arrays (tokens, document starts, suffix
array, its range maxima, unigram counts) and the searches that read one shard alone."""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from . import contexts, top_cache
from . import format as fmt
from . import kernels as K
from .errors import IndexFormatError


@dataclass
class Shard:
    id: int
    first_doc: int
    tok: np.ndarray
    starts: np.ndarray  # (n_docs + 1,) uint64
    sa: fmt.PackedArray
    samax: np.ndarray
    unigram: np.ndarray
    random: bool = False  # the searched arrays are advised MADV_RANDOM (Index(access="random"))
    dir: Path | None = None  # where its stored samples may be (top_cache.load)
    marker: Path | None = None  # its completion marker (what the build recorded of it)
    off2: int = field(init=False)
    off3: int = field(init=False)

    def __post_init__(self) -> None:
        n = self.sa.count
        self.off2 = -(-n // fmt.SAMAX_BLOCKS[0])
        self.off3 = self.off2 + -(-n // fmt.SAMAX_BLOCKS[1])

    @classmethod
    def open(cls, root: Path, entry: dict, token_dtype: str) -> Shard:
        """The shard of the index at root that a manifest entry describes, its arrays memory-mapped
        (each file's header checked); IndexFormatError if its tokens are not the manifest's: of
        another type or length, or, by its completion marker, rebuilt since the manifest was
        written (then the index's metadata and derived tables describe the text it held before)."""
        d = fmt.shard_dir(root, entry["shard"], entry.get("dir"))
        tok = fmt.open_array(d / "tokens.bin", "tokens")
        if tok.dtype.name != token_dtype or len(tok) != entry["n_positions"]:
            raise IndexFormatError(f"{d / 'tokens.bin'}: does not match the manifest")
        marker = fmt.marker_of(root, entry["shard"], entry.get("dir"))
        if marker is not None and _tokens_digest(fmt.read_json(marker)) != _tokens_digest(entry):
            raise IndexFormatError(
                f"{d}: rebuilt after {root}'s manifest was written (other tokens than it records); run build-index on the index again"
            )
        return cls(
            entry["shard"],
            entry["first_doc"],
            tok,
            fmt.open_array(d / "docs.bin", "docs"),
            fmt.open_packed(d / "sa.bin", "sa"),
            fmt.open_array(d / "samax.bin", "samax"),
            fmt.open_array(d / "unigram.bin", "unigram"),
            dir=d,
            marker=marker,
        )

    @property
    def n(self) -> int:
        return self.sa.count

    @property
    def searched(self) -> tuple[np.ndarray, ...]:
        """The arrays a search reads at random: tokens, suffix array, its range maxima."""
        return (self.tok, self.sa.words, self.samax)

    @cached_property
    def top(self) -> top_cache.TopCache:
        """The top levels of the suffix array, in memory: the builder's stored samples, else built
        on first use (a strided read of the whole suffix array, done with the kernel's read-ahead
        even when searches go without)."""
        stored = None if self.dir is None else top_cache.load(self.dir, self.tok, self.sa.words, self.sa.width, self.n)
        if stored is not None:
            return stored
        if self.random:
            advise(self.searched, mmap.MADV_NORMAL)
        try:
            return top_cache.build(self.tok, self.sa.words, self.sa.width, self.n, top_cache.STEP_LOG2)
        finally:
            if self.random:
                advise(self.searched, mmap.MADV_RANDOM)

    @cached_property
    def contexts(self) -> contexts.Contexts | None:
        """The stored histograms of the shard's frequent contexts (index/contexts.py), if any, at the
        threshold its marker records (1,024 for a table built before it was recorded; without a
        marker, the lowest any shard stores)."""
        if self.dir is None:
            return None
        known = self.marker is not None and self.marker.exists()
        return contexts.load(self.dir, fmt.read_json(self.marker).get("context_min_count", 1024) if known else contexts.MIN_COUNT)

    def blocks(self, lo: int, hi: int, d: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, counts) following the interval's common prefix of length d: stored for a
        frequent context, else enumerated."""
        if self.contexts is not None and hi - lo >= self.contexts.min_count:
            got = self.contexts.find(lo, hi, d)
            if got is not None:
                return got
        cap = min(hi - lo, len(self.unigram) + 1)  # distinct next tokens: every token and SEP at most
        while True:
            out_t = np.empty(cap, dtype=np.int64)
            out_c = np.empty(cap, dtype=np.int64)
            k = K.next_token_blocks(self.tok, self.sa.words, self.sa.width, lo, hi, d, out_t, out_c)
            if k >= 0:
                return out_t[:k], out_c[:k]
            cap = hi - lo

    def most_recent(self, lo: int, hi: int) -> int:
        return int(K.range_max(self.sa.words, self.sa.width, self.samax, self.off2, self.off3, lo, hi))

    def doc_of(self, pos: int) -> int:
        return int(np.searchsorted(self.starts, pos, side="right")) - 1


def _tokens_digest(record: dict) -> str | None:
    """The digest of tokens.bin that a marker or a manifest's shard entry records."""
    return next((f["blake2b"] for f in record.get("files", ()) if Path(f["path"]).name == "tokens.bin"), None)


def advise(arrays, advice: int) -> None:
    """madvise the memory maps under numpy memmaps, or under views of them (arrays not
    memory-mapped are left alone)."""
    for a in arrays:
        while a is not None and getattr(a, "_mmap", None) is None:
            a = getattr(a, "base", None)
        if a is not None:
            a._mmap.madvise(advice)
