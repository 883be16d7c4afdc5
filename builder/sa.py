"""Suffix arrays for one shard, built in parts that fit a memory budget and merged from disk.

The stream is doc0 SEP doc1 SEP ... with SEP the largest value of the token dtype, so it
compares greater than every vocabulary id. Suffixes are ordered by their tokens up to and
including their document's SEP, and suffixes equal that far (the same document tail) by
position: no comparison ever runs past a document end, so the order of a shard's suffixes
does not depend on how the shard is cut into parts. Suffixes starting at a SEP are never the
answer to a query (queries hold vocabulary ids only), so they are dropped: the array has one
entry per real token.

A part is a run of whole documents. Its suffixes are sorted with divsufsort over the part
alone (then the runs of suffixes equal through their SEP re-sorted by position), written to
``sa.parts/NNNN.bin`` with a completion marker, and the parts are merged by ``sa_merge``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numba as nb
import numpy as np
import pydivsufsort
from teragram.index import format as fmt
from teragram.index.errors import BuildError

PARTS_DIR = "sa.parts"
LCP_MAX = 0xFFFF  # part lcp values saturate here (a lower bound is all the merge needs)
# Working memory of the merge besides the shard's tokens: read buffers and the output chunk.
MERGE_BUFFER_BYTES = 64 << 20


def _bytes_per_position(itemsize: int, sa_entry: int) -> int:
    """Resident bytes per position while a part is sorted: its tokens, their big-endian byte
    string and divsufsort's array over those bytes (sa_entry bytes per byte); then, the byte
    string freed, the tokens, that array, and the tie flags and lcp values of the sweep."""
    return max(itemsize * (2 + sa_entry), itemsize * (1 + sa_entry) + 3)


def sort_bytes(positions: int, itemsize: int) -> int:
    """Peak bytes of sorting one part of this many positions."""
    return positions * _bytes_per_position(itemsize, 4 if positions * itemsize < 2**31 else 8)


def max_part_positions(budget: int, itemsize: int) -> int:
    """The largest part (in positions) whose sort fits in `budget` bytes."""
    m = budget // _bytes_per_position(itemsize, 4)
    if m * itemsize >= 2**31:
        m = max((2**31 - 1) // itemsize, budget // _bytes_per_position(itemsize, 8))
    return int(m)


@nb.njit(cache=True, nogil=True)
def _compact(sa, tok, itemsize, sep):
    """Keep the byte suffixes that start a token which is not SEP, as token offsets, in place
    at the front of sa; returns how many."""
    j = 0
    for i in range(sa.shape[0]):
        b = sa[i]
        if b % itemsize == 0 and tok[b // itemsize] != sep:
            sa[j] = b // itemsize
            j += 1
    return j


@nb.njit(cache=True, nogil=True)
def _ties_by_position(sa, n, tok, sep, lcp):
    """divsufsort orders suffixes equal through their SEP (the same document tail) by what
    follows; order each such run, contiguous in sa[:n], by position instead.

    Runs are found with Kasai's longest-common-prefix sweep, stopped at the SEP: linear in the
    part however long its duplicated documents. The inverse suffix array it needs lives in
    sa[n:], free once the array is compacted (sa holds one entry per byte of the part).
    lcp[r] receives the common prefix of ranks r - 1 and r (never through a SEP, at most
    LCP_MAX), which the re-sorting of runs leaves unchanged.
    """
    m = tok.shape[0]
    isa = sa[n : n + m]
    isa[:] = -1
    for r in range(n):
        isa[sa[r]] = r
    tied = np.zeros(n, np.bool_)  # rank r is equal through its SEP to rank r - 1
    h = 0
    lcp[0] = 0
    for i in range(m):
        r = isa[i]
        if r <= 0:
            h = 0
            continue
        j = sa[r - 1]
        k = h
        while True:
            x = tok[i + k]
            if x != tok[j + k]:
                break
            if x == sep:
                tied[r] = True
                break
            k += 1
        lcp[r] = k if k < LCP_MAX else LCP_MAX
        h = k - 1 if k > 0 else 0
    r = 0
    while r < n:
        e = r + 1
        while e < n and tied[e]:
            e += 1
        if e - r > 1:
            sa[r:e] = np.sort(sa[r:e])
        r = e


def sorted_suffixes(tokens: np.ndarray, sep: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the non-separator tokens of a run of whole documents (it ends with SEP),
    sorted by their suffixes in the shard order, and the lcp of each with the one before.
    (n,) -> (n - #SEP,) int32 or int64, (n - #SEP,) uint16"""
    tokens = np.ascontiguousarray(tokens)
    if tokens.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint16)
    text = tokens.astype(tokens.dtype.newbyteorder(">")).view(np.uint8)
    sa = pydivsufsort.divsufsort(text)
    del text
    n = _compact(sa, tokens, tokens.dtype.itemsize, sep)
    lcp = np.empty(n, np.uint16)
    _ties_by_position(sa, n, tokens, sep, lcp)
    return sa[:n], lcp


def suffix_array(tokens: np.ndarray, sep: int) -> np.ndarray:
    """sorted_suffixes without the lcp values."""
    return sorted_suffixes(tokens, sep)[0]


@dataclass(frozen=True)
class Plan:
    """Parts of a shard: part i covers positions [bounds[i], bounds[i+1]), whole documents."""

    bounds: tuple[int, ...]

    @property
    def n_parts(self) -> int:
        return len(self.bounds) - 1


def plan_parts(starts: np.ndarray, max_positions: int) -> Plan:
    """Cut the documents (start offsets, then the total) into parts of at most max_positions."""
    starts = np.asarray(starts, dtype=np.int64)
    total = int(starts[-1])
    bounds = [0]
    while bounds[-1] < total:
        a = bounds[-1]
        k = int(np.searchsorted(starts, a + max_positions, side="right")) - 1
        b = int(starts[k])
        if b <= a:
            doc = int(np.searchsorted(starts, a, side="right")) - 1
            length = int(starts[doc + 1] - starts[doc])
            raise BuildError(
                f"a document of {length} tokens does not fit a suffix-array part of at most {max_positions} positions; "
                "raise --memory (or --sa-part-tokens)"
            )
        bounds.append(b)
    return Plan(tuple(bounds))


def part_path(shard_dir: Path, i: int) -> Path:
    return Path(shard_dir) / PARTS_DIR / f"{i:06d}.bin"


def lcp_path(shard_dir: Path, i: int) -> Path:
    return part_path(shard_dir, i).with_suffix(".lcp")


def part_done(shard_dir: Path, i: int) -> bool:
    """Whether part i is complete: its marker exists and its files have the sizes it records."""
    marker = part_path(shard_dir, i).with_suffix(".done")
    if not marker.exists():
        return False
    rec = fmt.read_json(marker)
    p, q = part_path(shard_dir, i), lcp_path(shard_dir, i)
    return p.exists() and p.stat().st_size == rec.get("size") and q.exists() and q.stat().st_size == rec.get("lcp_size")


def prepare_parts(shard_dir: Path, plan: Plan) -> None:
    """Start the parts directory, or keep it when it holds parts of this same plan."""
    d = Path(shard_dir) / PARTS_DIR
    plan_file = d / "plan.json"
    if d.exists() and (not plan_file.exists() or fmt.read_json(plan_file) != list(plan.bounds)):
        shutil.rmtree(d)
    d.mkdir(exist_ok=True)
    for tmp in d.glob(".*.tmp-*"):
        tmp.unlink()
    if not plan_file.exists():
        fmt.write_json(plan_file, list(plan.bounds))


def sort_part(shard_dir: Path, plan: Plan, i: int, sep: int, pos_dtype: str) -> None:
    """Sort part i's suffixes and write them (shard positions, pos_dtype) with its marker."""
    path = Path(shard_dir) / "tokens.bin"
    h = fmt.read_header(path)
    dtype = fmt.open_array(path, "tokens").dtype
    a, b = plan.bounds[i], plan.bounds[i + 1]
    tokens = np.fromfile(path, dtype=dtype, count=b - a, offset=fmt.HEADER_SIZE + a * dtype.itemsize)
    if len(tokens) != b - a or h.count < b:
        raise BuildError(f"{path}: shorter than its documents (truncated?)")
    sa, lcp = sorted_suffixes(tokens, sep)
    del tokens
    out = part_path(shard_dir, i)
    w = fmt.StreamWriter(out, "sa.part", pos_dtype, len(sa))
    step = 1 << 22
    for lo in range(0, len(sa), step):
        w.write(sa[lo : lo + step].astype(np.int64) + a)
    w.close()
    fmt.write_array(lcp_path(shard_dir, i), "sa.part.lcp", lcp)
    sizes = {"size": out.stat().st_size, "lcp_size": lcp_path(shard_dir, i).stat().st_size}
    fmt.write_json(out.with_suffix(".done"), sizes | {"count": len(sa)})
