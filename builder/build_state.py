"""What a build is and where it stands: its options (BuildConfig) and their identity, the
cursor into the input stream, the skipped-input counts, the output directory's build state
and its completed shards (the markers a resumed build trusts)."""

from __future__ import annotations

import fcntl
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from teragram.index import format as fmt
from teragram.index import readers
from teragram.index import tokenizer as tok_mod
from teragram.index.errors import BuildError

from .executors import default_memory_gb

EXAMPLES = 5  # example paths kept per skip reason in the report
STATE = "build-state.json"  # the identity of the build an output directory holds


@dataclass(frozen=True)
class BuildConfig:
    inputs: tuple[str, ...]
    out: str
    tokenizer: str | None = None
    vocab_size: int = 32000
    shard_tokens: int = 1 << 30
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    tokenizer_sample_bytes: int = 64 << 20
    executor: str = "local"
    ray_address: str | None = None
    shard_dirs: tuple[str, ...] = ()  # shard i goes to shard_dirs[i % len] (default: OUT/shards)
    progress: bool = True
    memory_gb: float | None = None  # bound on the build's peak RSS, children included (default: default_memory_gb())
    sa_part_tokens: int | None = None  # cap on the positions of one suffix-array part (default: what memory allows)

    @property
    def memory_bytes(self) -> int:
        return int((self.memory_gb if self.memory_gb is not None else default_memory_gb()) * 2**30)

    def identity(self) -> dict:
        """The options that determine the bytes of the index (not workers, not executor)."""
        tok = tok_mod.digest(self.tokenizer) if self.tokenizer else None
        return {
            "format_version": fmt.FORMAT_VERSION,
            "inputs": list(self.inputs),
            "tokenizer_digest": tok,
            "vocab_size": None if tok else self.vocab_size,
            "shard_tokens": self.shard_tokens,
            "tokenizer_sample_bytes": None if tok else self.tokenizer_sample_bytes,
            "shard_dirs": [str(Path(d).resolve()) for d in self.shard_dirs],
        }


@dataclass
class Cursor:
    """Position in the input stream: next file, next record in it, next part of that record."""

    file: int = 0
    record: int = 0
    part: int = 0

    def key(self) -> tuple[int, int, int]:
        return (self.file, self.record, self.part)


@dataclass
class SkipStats:
    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def add(self, s: readers.Skip) -> None:
        reason = s.reason.split(":")[0]
        self.counts[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < EXAMPLES:
            ex.append(s.source if s.record <= 0 else f"{s.source}#{s.record}")

    def to_json(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "examples": dict(sorted(self.examples.items()))}

    @classmethod
    def from_json(cls, d: dict) -> SkipStats:
        return cls(Counter(d["counts"]), {k: list(v) for k, v in d["examples"].items()})


def prepare_out(cfg: BuildConfig) -> tuple[Path, IO]:
    """The output directory, made if new; if it holds a build, that build must be this one
    (same identity), and its temporary files are removed. Returns it with the open build state,
    locked: a second build of the same directory is refused while this one holds it."""
    out = Path(cfg.out)
    ident = cfg.identity()
    state = out / STATE
    if out.exists() and any(out.iterdir()):
        if not state.exists():
            if (out / "manifest.json").exists():
                raise BuildError(f"output directory {out} holds a different teragram index (no build state); choose another --out")
            raise BuildError(f"output directory {out} is not empty and holds no teragram build; choose another --out")
        old = fmt.read_json(state)
        if old != ident:
            raise BuildError(f"output directory {out} holds a different index (built with other inputs or options); choose another --out")
        lock = _lock(state)
        for tmp in out.rglob(".*.tmp-*"):
            tmp.unlink()
    else:
        out.mkdir(parents=True, exist_ok=True)
        fmt.write_json(state, ident)
        lock = _lock(state)
    (out / "shards").mkdir(exist_ok=True)
    return out, lock


def _lock(state: Path) -> IO:
    """The build state opened and locked (released when the file is closed, or the process ends)."""
    f = open(state, "rb")  # noqa: SIM115 -- held for the whole build
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise BuildError(f"another build-index is writing {state.parent}; wait for it to end") from None
    return f


def completed_shards(out: Path) -> list[dict]:
    """Markers of shards 0..k-1, the longest contiguous run of completed shards."""
    done = []
    while True:
        m = fmt.shard_marker(out, len(done))
        if not m.exists():
            return done
        rec = fmt.read_json(m)
        ok = all((out / f["path"]).exists() and (out / f["path"]).stat().st_size == f["size"] for f in rec["files"])
        if not ok:
            return done
        done.append(rec)
