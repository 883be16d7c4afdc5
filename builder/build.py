"""build-index: stream a corpus into a sharded suffix-array index, resumably.

Phases (each with a progress bar):
  1. tokenizer  copy --tokenizer, or train one on a bounded sample of the corpus
  2. tokenize   documents in input order, encoded by a pool of workers, packed into shards of
                at most --shard-tokens positions; each full shard is written and indexed
                (suffix array, block maxima) and marked done with the input cursor after it
  3. finalize   LMDB document metadata and manifest, written from scratch

Output depends only on the inputs and the options that shape it (tokenizer, vocab size, shard
size), never on --workers or on interruptions: a build killed at any point and rerun with the
same command resumes after the last contiguous completed shard and ends byte-identical to an
uninterrupted one (build-report.json, which holds timings, is the one file that differs).
Memory stays within --memory (BuildConfig.memory_gb), workers included: tokens and document
metadata are streamed to disk as they come, and each shard's suffix array is sorted in parts
that fit what is left of the budget and merged from disk (builder/shard_index.py).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import shutil
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from teragram.index import format as fmt
from teragram.index import meta as meta_store
from teragram.index import readers
from teragram.index import tokenizer as tok_mod
from teragram.index.errors import BuildError
from tqdm import tqdm

from . import shard_index
from .executors import LocalExecutor, default_memory_gb, die_with_parent, make_executor, sa_parallelism, tree_rss

_EXAMPLES = 5  # example paths kept per skip reason in the report
_ENCODER_RSS = 256 << 20  # resident memory of one tokenizer worker with its in-flight batches
_STATE = "build-state.json"
_REPORT = "build-report.json"


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
        if len(ex) < _EXAMPLES:
            ex.append(s.source if s.record <= 0 else f"{s.source}#{s.record}")

    def to_json(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "examples": dict(sorted(self.examples.items()))}

    @classmethod
    def from_json(cls, d: dict) -> SkipStats:
        return cls(Counter(d["counts"]), {k: list(v) for k, v in d["examples"].items()})


# ---- encoding workers ------------------------------------------------------------------------

_SP = None  # the worker's tokenizer, set by _init_worker from the model bytes it is given


def _init_worker(model: bytes) -> None:
    global _SP
    import sentencepiece as spm

    die_with_parent()
    _SP = spm.SentencePieceProcessor()
    _SP.LoadFromSerializedProto(model)


def _encode(texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(ids, dtype=np.uint32) for ids in _SP.encode(texts)]  # type: ignore[union-attr]


def _encode_with(model: bytes, texts: list[str]) -> list[np.ndarray]:
    """A Ray task: encode with the given model (loaded once per worker process)."""
    global _SP, _SP_MODEL
    if _SP is None or _SP_MODEL != model:
        _init_worker(model)
        _SP_MODEL = model
    return _encode(texts)


_SP_MODEL: bytes | None = None


class _Encoder:
    """Encodes batches of texts in order with a bounded number of batches in flight, in a
    local process pool or as Ray tasks."""

    def __init__(self, model: bytes, workers: int, ray: bool = False):
        self.workers = workers
        self.pool = None
        self.ray = None
        if ray:
            import ray as ray_mod

            self.ray = ray_mod
            self.model_ref = ray_mod.put(model)
            self.task = ray_mod.remote(max_retries=3)(_encode_with)
        elif workers > 1:
            self.pool = mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(model,))
        else:
            _init_worker(model)

    def _submit(self, texts: list[str]):
        if self.ray is not None:
            return self.task.remote(self.model_ref, texts)
        return self.pool.apply_async(_encode, (texts,))

    def _get(self, r):
        return self.ray.get(r) if self.ray is not None else r.get()

    def map(self, batches: Iterator[tuple[object, list[str]]]) -> Iterator[tuple[object, list[np.ndarray]]]:
        if self.pool is None and self.ray is None:
            for tag, texts in batches:
                yield tag, _encode(texts)
            return
        window: deque = deque()
        for tag, texts in batches:
            window.append((tag, self._submit(texts)))
            if len(window) >= 4 * self.workers:
                t, r = window.popleft()
                yield t, self._get(r)
        while window:
            t, r = window.popleft()
            yield t, self._get(r)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


# ---- the build -------------------------------------------------------------------------------


def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024


def _prepare_out(cfg: BuildConfig) -> Path:
    out = Path(cfg.out)
    ident = cfg.identity()
    state = out / _STATE
    if out.exists() and any(out.iterdir()):
        if not state.exists():
            if (out / "manifest.json").exists():
                raise BuildError(f"output directory {out} holds a different teragram index (no build state); choose another --out")
            raise BuildError(f"output directory {out} is not empty and holds no teragram build; choose another --out")
        old = fmt.read_json(state)
        if old != ident:
            raise BuildError(f"output directory {out} holds a different index (built with other inputs or options); choose another --out")
        for tmp in out.rglob(".*.tmp-*"):
            tmp.unlink()
    else:
        out.mkdir(parents=True, exist_ok=True)
        fmt.write_json(state, ident)
    (out / "shards").mkdir(exist_ok=True)
    return out


def _doc_stream(files: list[Path], start: Cursor) -> Iterator[tuple[Cursor, readers.Doc | readers.Skip]]:
    """Documents and skips from the cursor on, in input order (records before it are read past)."""
    for fi in range(start.file, len(files)):
        for item in readers.read_file(files[fi]):
            if fi == start.file and 0 <= item.record < start.record:
                continue
            yield Cursor(fi, item.record, 0), item


def _train_tokenizer(cfg: BuildConfig, files: list[Path], dst: Path) -> None:
    if cfg.tokenizer:
        tok_mod.load(cfg.tokenizer)  # validates
        shutil.copyfile(cfg.tokenizer, dst.with_name(".tokenizer.model.tmp"))
        os.replace(dst.with_name(".tokenizer.model.tmp"), dst)
        return
    total = min(cfg.tokenizer_sample_bytes, sum(f.stat().st_size for f in files))
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizer sample", disable=not cfg.progress)

    def texts() -> Iterator[str]:
        for _, doc in _doc_stream(files, Cursor()):
            if isinstance(doc, readers.Doc):
                bar.update(len(doc.text))
                yield doc.text

    model = tok_mod.train(texts(), cfg.vocab_size, sample_bytes=cfg.tokenizer_sample_bytes, threads=max(1, cfg.workers))
    bar.close()
    tmp = dst.with_name(".tokenizer.model.tmp")
    tmp.write_bytes(model)
    os.replace(tmp, dst)


def _completed_shards(out: Path) -> list[dict]:
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


class _ShardWriter:
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


def _batches(stream: Iterator[tuple[Cursor, readers.Doc | readers.Skip]], batch_chars: int = 1 << 20) -> Iterator[tuple[list, list[str]]]:
    """Groups of (cursor, item) with the texts of their documents, about batch_chars each."""
    tags: list = []
    texts: list[str] = []
    size = 0
    for cur, item in stream:
        tags.append((cur, item))
        if isinstance(item, readers.Doc):
            texts.append(item.text)
            size += len(item.text)
        if size >= batch_chars:
            yield tags, texts
            tags, texts, size = [], [], 0
    if tags:
        yield tags, texts


def build(cfg: BuildConfig) -> dict:
    """Run (or resume) a build; returns the build report."""
    if cfg.shard_tokens < 2:
        raise BuildError("--shard-tokens must be at least 2")
    t0 = time.time()
    files = readers.walk(list(cfg.inputs))
    if not files:
        raise BuildError("no input files found")
    out = _prepare_out(cfg)
    timings: dict[str, float] = {}

    tok_path = out / "tokenizer.model"
    if not tok_path.exists():
        _train_tokenizer(cfg, files, tok_path)
    timings["tokenizer_s"] = time.time() - t0
    sp = tok_mod.load(tok_path)
    vocab = sp.get_piece_size()
    dtype = fmt.token_dtype(vocab)

    # phase 2: resume after the last contiguous completed shard
    done = _completed_shards(out)
    start = Cursor(**done[-1]["cursor"]) if done else Cursor()
    skips = SkipStats.from_json(done[-1]["skips"]) if done else SkipStats()
    t1 = time.time()
    for m in done:  # parts left by a run killed between a shard's marker and their removal
        shard_index.remove_parts(fmt.shard_dir(out, m["shard"], m.get("dir")))
    memory = cfg.memory_bytes
    reserve = tree_rss() + _ENCODER_RSS * cfg.workers
    par = sa_parallelism(cfg.workers, cfg.shard_tokens, dtype.itemsize, memory - reserve) if cfg.executor == "local" else 1
    executor = make_executor(cfg.executor, par, cfg.ray_address)
    task_memory = (memory - reserve) // par + (tree_rss() if par == 1 else 0)
    writer = _ShardWriter(
        out,
        len(done),
        dtype,
        vocab,
        cfg.shard_tokens,
        skips,
        executor,
        cfg.shard_dirs,
        memory_bytes=task_memory,
        part_positions=cfg.sa_part_tokens,
        progress=cfg.progress and par == 1,
    )
    total_bytes = sum(f.stat().st_size for f in files)
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenize+index", disable=not cfg.progress)
    bar.update(sum(f.stat().st_size for f in files[: start.file]))
    enc = _Encoder(tok_path.read_bytes(), cfg.workers, ray=cfg.executor == "ray")
    last_file = start.file
    try:
        for tags, encoded in enc.map(_batches(_doc_stream(files, start))):
            it = iter(encoded)
            for cur, item in tags:
                if cur.file != last_file:
                    bar.update(sum(f.stat().st_size for f in files[last_file : cur.file]))
                    last_file = cur.file
                if isinstance(item, readers.Skip):
                    skips.add(item)  # counted in stream order, so a marker's counts match its cursor
                    continue
                if (cur.file, cur.record) == (start.file, start.record):
                    cur = Cursor(cur.file, cur.record, start.part)
                writer.add(cur, item, next(it))
        enc.close()  # every document is encoded: free the workers' memory for the last shard
        writer.flush(Cursor(len(files), 0, 0))
        indexed = executor.results()
    finally:
        enc.close()
        executor.close()
    bar.update(total_bytes - bar.n)
    bar.close()
    timings["tokenize_index_s"] = time.time() - t1
    timings["index_task_s"] = sum(r["index_s"] for r in indexed)

    # phase 3: metadata and manifest, from scratch
    t2 = time.time()
    markers = _completed_shards(out)
    manifest = _finalize(cfg, out, sp, dtype, markers, skips)
    timings["finalize_s"] = time.time() - t2
    timings["total_s"] = time.time() - t0
    report = {
        "timings": timings,
        "peak_rss_mb": _peak_rss_mb(),
        "workers": cfg.workers,
        "resumed_from_shard": len(done),
        "counts": manifest["counts"],
        "skipped": manifest["skipped"],
    }
    fmt.write_json(out / _REPORT, report)
    return report


def _finalize(cfg: BuildConfig, out: Path, sp, dtype: np.dtype, markers: list[dict], skips: SkipStats) -> dict:
    shards = []
    first_doc = 0
    for m in markers:
        shards.append(
            {k: m[k] for k in ("shard", "dir", "n_docs", "n_tokens", "n_positions", "sa_entries", "sa_width", "files")}
            | {"first_doc": first_doc}
        )
        first_doc += m["n_docs"]
    tok_rec = asdict(fmt.file_record(out, out / "tokenizer.model"))
    manifest = {
        "format_version": fmt.FORMAT_VERSION,
        "tokenizer": {"file": tok_rec, "vocab_size": sp.get_piece_size(), "eos_id": tok_mod.eos_id(sp)},
        "token_dtype": dtype.name,
        "separator": fmt.separator(dtype),
        "counts": fmt.manifest_counts(shards, first_doc),
        "shards": shards,
        "build": cfg.identity(),
        "skipped": skips.to_json(),
    }
    bar = tqdm(total=first_doc, unit="doc", desc="metadata", disable=not cfg.progress)
    meta_store.write(out, markers, manifest, progress=bar.update)
    bar.close()
    fmt.write_json(out / "manifest.json", manifest)
    return manifest


def build_from_ids(
    docs: list[np.ndarray],
    out: str | Path,
    tokenizer_model: str | Path,
    *,
    shard_tokens: int = 1 << 30,
    workers: int = 1,
    memory_gb: float | None = None,
    sa_part_tokens: int | None = None,
) -> dict:
    """Index already-tokenized documents (ids in the tokenizer's vocabulary) into a fresh `out`.

    For tests and benchmarks that need an index of exact token sequences (random texts with a
    small alphabet, or the same ids given to infini-gram's indexer). Not resumable.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise BuildError(f"output directory {out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    (out / "shards").mkdir()
    shutil.copyfile(tokenizer_model, out / "tokenizer.model")
    sp = tok_mod.load(out / "tokenizer.model")
    vocab = sp.get_piece_size()
    dtype = fmt.token_dtype(vocab)
    cfg = BuildConfig(inputs=("<ids>",), out=str(out), tokenizer=str(tokenizer_model), shard_tokens=shard_tokens, progress=False)
    fmt.write_json(out / _STATE, cfg.identity())
    skips = SkipStats()
    executor = LocalExecutor(workers)
    try:
        memory = {"part_positions": sa_part_tokens} | ({} if memory_gb is None else {"memory_bytes": int(memory_gb * 2**30)})
        writer = _ShardWriter(out, 0, dtype, vocab, shard_tokens, skips, executor, **memory)
        for i, ids in enumerate(docs):
            ids = np.asarray(ids)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise BuildError(f"document {i}: ids outside the vocabulary [0, {vocab})")
            writer.add(Cursor(0, i, 0), readers.Doc("<ids>", i, ""), ids)
        writer.flush(Cursor(1, 0, 0))
        executor.results()
    finally:
        executor.close()
    return _finalize(cfg, out, sp, dtype, _completed_shards(out), skips)
