"""Index one shard whose tokens.bin and docs.bin are written, within a memory budget:
sort its suffix-array parts (skipping those already done), merge them, count unigrams.

Peak memory is the larger of one part's sort (``sa.sort_bytes``) and the merge (the shard's
tokens, memory-mapped, its block maxima, and fixed buffers), above the process's own footprint. A rerun after
an interruption at any point redoes only unfinished parts, then the merge, and writes the same
bytes: the order is fixed by the shard's tokens (``builder/sa.py``), not by the parts.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import psutil
from teragram.index import contexts, packed, top_cache
from teragram.index import format as fmt
from teragram.index.errors import BuildError
from tqdm import tqdm

from . import sa as sa_mod
from . import sa_merge

_SORT_SHARE = 0.9  # of the budget a part's sort is sized to: numpy and numba temporaries need the rest


def own_rss() -> int:
    return psutil.Process().memory_info().rss


def write_shard_arrays(
    shard_dir: Path, sep: int, vocab: int, memory_bytes: int, *, part_positions: int | None = None, progress: bool = False
) -> dict:
    """Build and write sa.bin, samax.bin, unigram.bin and the suffix array's samples (top.*.bin,
    index/top_cache.py); returns their statistics.

    memory_bytes bounds this process's resident memory while it works; a budget that cannot
    hold the shard's tokens plus the merge buffers, or one document's part, is a BuildError.
    part_positions caps the size of a part below what the budget allows.
    """
    shard_dir = Path(shard_dir)
    tok = fmt.open_array(shard_dir / "tokens.bin", "tokens")
    starts = np.asarray(fmt.open_array(shard_dir / "docs.bin", "docs"))
    n = len(tok)
    itemsize = tok.dtype.itemsize
    budget = memory_bytes - own_rss()
    merge_need = n * itemsize + n // 8 + sa_mod.MERGE_BUFFER_BYTES  # tokens, samax (twice, at its concatenation)
    if budget < merge_need:
        gb = (merge_need + own_rss()) / 2**30
        raise BuildError(
            f"--memory {memory_bytes / 2**30:.2f} GB cannot merge a shard of {n} positions (needs {gb:.2f} GB); raise --memory or lower --shard-tokens"
        )
    max_part = sa_mod.max_part_positions(int(budget * _SORT_SHARE), itemsize)  # the sort maps nothing else
    if part_positions is not None:
        max_part = min(max_part, part_positions)
    plan = sa_mod.plan_parts(starts, max_part)
    sa_mod.prepare_parts(shard_dir, plan)
    pos_dtype = "uint32" if n <= 2**32 else "uint64"
    todo = [i for i in range(plan.n_parts) if not sa_mod.part_done(shard_dir, i)]
    bar = tqdm(total=n, unit="tok", unit_scale=True, desc=f"sort {plan.n_parts} part(s)", disable=not progress)
    bar.update(n - sum(plan.bounds[i + 1] - plan.bounds[i] for i in todo))
    for i in todo:
        sa_mod.sort_part(shard_dir, plan, i, sep, pos_dtype)
        bar.update(plan.bounds[i + 1] - plan.bounds[i])
    bar.close()
    counts = [fmt.read_json(sa_mod.part_path(shard_dir, i).with_suffix(".done"))["count"] for i in range(plan.n_parts)]
    width = packed.width_for(max(n - 1, 0))
    sa_merge.merge_parts(shard_dir, counts, tok, sep, width, progress=progress)
    n_real = sa_merge.write_unigram(shard_dir, tok, sep, vocab)
    if n_real != sum(counts):
        raise BuildError(f"{shard_dir}: suffix array has {sum(counts)} entries for {n_real} tokens (corrupt part?)")
    sa = fmt.open_packed(shard_dir / "sa.bin", "sa")
    top_cache.write(shard_dir, tok, sa.words, sa.width, sa.count)
    stored = contexts.write(shard_dir, tok, sa.words, sa.width, sa.count)
    return {"sa_entries": int(sum(counts)), "sa_width": width} | stored


def add_contexts(root: Path, marker: dict) -> dict:
    """A completed shard built before its frequent contexts' histograms were stored
    (index/contexts.py), or stored at another threshold than contexts.min_count's: the table
    (re)written and recorded in its marker; the marker returned. A run stopped while it rewrites
    one leaves the shard complete without a table (answers the same, enumerated), which the
    next run adds."""
    d = fmt.shard_dir(root, marker["shard"], marker.get("dir"))
    stored = any(Path(f["path"]).name == contexts.NODES_FILE for f in marker["files"])
    sa = fmt.open_packed(d / "sa.bin", "sa")
    if stored and marker.get("context_min_count", 1024) == contexts.min_count(sa.count):  # 1024: before it was recorded
        return marker
    table = (contexts.NODES_FILE, contexts.HIST_FILE)
    marker = marker | {"files": [r for r in marker["files"] if Path(r["path"]).name not in table]}
    if stored:  # the old table unrecorded, then removed: a run stopped from here on leaves a shard without one
        fmt.write_json(fmt.shard_marker(root, marker["shard"]), marker)
        for n in table:
            (d / n).unlink(missing_ok=True)
    stats = contexts.write(d, fmt.open_array(d / "tokens.bin", "tokens"), sa.words, sa.width, sa.count)
    marker = marker | stats | {"files": marker["files"] + [asdict(fmt.file_record(root, d / n)) for n in table]}
    fmt.write_json(fmt.shard_marker(root, marker["shard"]), marker)
    return marker


def remove_parts(shard_dir: Path) -> None:
    """Delete a finished shard's parts (after its completion marker is written)."""
    shutil.rmtree(Path(shard_dir) / sa_mod.PARTS_DIR, ignore_errors=True)
