"""An index read into the page cache in 2 MiB pages (`teragram warm INDEX`).

Searches read an index at random, so on a warm page cache their cost is the processor's: each
step of a binary search misses the caches, and, over arrays of many GB, the TLB too; with 4 kB
pages the page-table entries of a 17 GB index fill 34 MB, more than the caches hold, and a miss
can cost two trips to memory. Linux maps a file's page-cache pages with one TLB entry per 2 MiB
where the page cache holds them as 2 MiB folios (ext4, xfs and btrfs with large folios, Linux
6.x); whether it does depends on how the pages came in. Read from disk by sequential
read-ahead, or faulted through a mapping advised MADV_HUGEPAGE, a file is cached in large folios;
written by the build and kept cached, or read in small pieces, it is cached in 4 kB pages and
stays so until evicted. Held-out estimates at 2.43B tokens in 12 shards, the same cached
pages mapped 4 kB at a time: 37.6-41.8k tokens/s/core; 2 MiB at a time: 52.0-53.5k (3 shards:
58.5-60.9k and 70.9-83.0k; docs/research/2026-12-06-bulk-speed.md).

warm() drops each file's cached pages (POSIX_FADV_DONTNEED: pages that a running process maps
stay) and reads the file back through a mapping advised MADV_HUGEPAGE (MADV_POPULATE_READ, or a
read of every page where the kernel lacks it): one sequential read of the index from disk. An
index larger than the machine's memory is not warmed (reading it would evict what it read).
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from pathlib import Path

from .errors import TeragramError

MADV_POPULATE_READ = 22  # Linux >= 5.14; not in Python's mmap module before 3.13
PAGE = 4096


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes ({} where there is none)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        k, _, v = line.partition(":")
        parts = v.split()
        if parts and parts[0].isdigit():
            out[k] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def index_files(path: str | Path) -> list[Path]:
    """The index's array files (every .bin under it, through linked folders: a composed index
    links its shards'), each once, in order."""
    found = set()
    for d, _, names in os.walk(Path(path).resolve(), followlinks=True):
        found.update(Path(d, n).resolve() for n in names if n.endswith(".bin"))
    return sorted(p for p in found if p.is_file())


def _load(f: Path) -> None:
    """The file's cached pages dropped, then read back through a huge-page mapping."""
    with open(f, "rb") as fh:
        fd = fh.fileno()
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
            if hasattr(mmap, "MADV_HUGEPAGE"):
                m.madvise(mmap.MADV_HUGEPAGE)
            try:
                if not sys.platform.startswith("linux"):
                    raise OSError
                m.madvise(MADV_POPULATE_READ)
            except OSError:  # an older kernel: fault every page in by reading it
                view = memoryview(m)
                for i in range(0, len(m), PAGE):
                    view[i]
                view.release()


def warm(path: str | Path, *, progress=None) -> dict:
    """Read the index at path into the page cache, in 2 MiB folios where the kernel can; returns
    {"files", "bytes", "seconds", "huge_bytes"} (huge_bytes: the growth of the page cache's large
    folios, from /proc/meminfo where it tells). Raises if the index does not fit in memory."""
    files = index_files(path)
    if not files:
        raise TeragramError(f"{path}: no index files (*.bin) to warm")
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    mem = meminfo()
    if mem.get("MemTotal") and total > 0.9 * mem["MemTotal"]:
        raise TeragramError(
            f"{path}: {total / 2**30:.1f} GiB of index files do not fit this machine's {mem['MemTotal'] / 2**30:.1f} GiB of memory"
        )
    t0 = time.perf_counter()
    for f, n in zip(files, sizes):
        if n:
            _load(f)
        if progress is not None:
            progress(n)
    after = meminfo()
    return {
        "files": len(files),
        "bytes": total,
        "seconds": round(time.perf_counter() - t0, 2),
        "huge_bytes": after.get("FileHugePages", 0) - mem.get("FileHugePages", 0),
    }
