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

This module is the driver; the build's options, cursor and resumable state are in
build_state.py, the tokenizer workers in encoder.py, the shards' writing in shard_writer.py.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
from teragram.index import contexts, merged, readers, trigrams
from teragram.index import format as fmt
from teragram.index import meta as meta_store
from teragram.index import tokenizer as tok_mod
from teragram.index.engine import Index
from teragram.index.errors import BuildError, IndexFormatError
from tqdm import tqdm

from . import shard_index
from .build_state import STATE, BuildConfig, Cursor, SkipStats, completed_shards, prepare_out
from .encoder import Encoder
from .executors import LocalExecutor, make_executor, sa_parallelism, tree_rss
from .shard_writer import ShardWriter, finish_shard

# BuildConfig, Cursor and SkipStats (build_state.py) and finish_shard (shard_writer.py) are
# importable from here too.
__all__ = ["BuildConfig", "Cursor", "SkipStats", "build", "build_from_ids", "finish_shard"]

_ENCODER_RSS = 256 << 20  # resident memory of one tokenizer worker with its in-flight batches
_REPORT = "build-report.json"
ROUND_TRIP_BYTES = 4 << 20  # text encoded and decoded back to check the tokenizer's round trip


def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024


def _doc_stream(files: list[Path], start: Cursor) -> Iterator[tuple[Cursor, readers.Doc | readers.Skip]]:
    """Documents and skips from the cursor on, in input order (records before it are read past)."""
    for fi in range(start.file, len(files)):
        for item in readers.read_file(files[fi]):
            if fi == start.file and 0 <= item.record < start.record:
                continue
            yield Cursor(fi, item.record, 0), item


def _place_tokenizer(cfg: BuildConfig, files: list[Path], out: Path) -> tok_mod.Tokenizer:
    """The index's tokenizer, its file placed in `out` (tokenizer.model or tokenizer.json): a
    copy of --tokenizer, byte for byte, or (on the first run) one trained on a bounded sample of
    the corpus. EOS: a Hugging Face model directory's tokenizer_config.json names it."""
    if cfg.tokenizer:
        tok = tok_mod.load(cfg.tokenizer)  # validates
        dst = out / tok.file_name
        if not dst.exists():
            tmp = dst.with_name(f".{dst.name}.tmp")
            tmp.write_bytes(tok.data)
            os.replace(tmp, dst)
        return tok
    dst = out / tok_mod.FILES["sentencepiece"]
    if not dst.exists():
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
    return tok_mod.load(dst)


def _sample_docs(files: list[Path], budget: int = ROUND_TRIP_BYTES, max_files: int = 64) -> Iterator[tuple[str, str]]:
    """(source, text) of a sample of the corpus for the round-trip check: the first documents of
    up to max_files files spread evenly over the input, about budget bytes of text in all."""
    picked = [
        files[i]
        for i in sorted({int(k * len(files) / max_files) for k in range(max_files)} if len(files) > max_files else range(len(files)))
    ]
    each = max(1, budget // len(picked))
    for f in picked:
        used = 0
        for item in readers.read_file(f):
            if isinstance(item, readers.Doc):
                yield (item.source if item.record < 0 else f"{item.source}#{item.record}"), item.text
                used += len(item.text)
                if used >= each:
                    break


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
    out, lock = prepare_out(cfg)
    timings: dict[str, float] = {}

    tok = _place_tokenizer(cfg, files, out)
    timings["tokenizer_s"] = time.time() - t0
    round_trip = tok_mod.round_trip(tok, _sample_docs(files))
    timings["round_trip_s"] = time.time() - t0 - timings["tokenizer_s"]
    vocab = tok.vocab_size
    dtype = fmt.token_dtype(max(vocab, tok.eos_id + 1))

    # phase 2: resume after the last contiguous completed shard
    done = completed_shards(out)
    start = Cursor(**done[-1]["cursor"]) if done else Cursor()
    skips = SkipStats.from_json(done[-1]["skips"]) if done else SkipStats()
    t1 = time.time()
    for m in done:  # parts left by a run killed between a shard's marker and their removal
        shard_index.remove_parts(fmt.shard_dir(out, m["shard"], m.get("dir")))
    done = [shard_index.add_contexts(out, m) for m in done]  # shards built before index/contexts.py
    memory = cfg.memory_bytes
    reserve = tree_rss() + _ENCODER_RSS * cfg.workers
    par = sa_parallelism(cfg.workers, cfg.shard_tokens, dtype.itemsize, memory - reserve) if cfg.executor == "local" else 1
    executor = make_executor(cfg.executor, par, cfg.ray_address)
    task_memory = (memory - reserve) // par + (tree_rss() if par == 1 else 0)
    writer = ShardWriter(
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
    enc = Encoder(tok.data, cfg.workers, ray=cfg.executor == "ray")
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
    markers = completed_shards(out)
    manifest = _finalize(cfg, out, tok, dtype, markers, skips, round_trip)
    timings["finalize_s"] = time.time() - t2
    timings["total_s"] = time.time() - t0
    report = {
        "timings": timings,
        "peak_rss_mb": _peak_rss_mb(),
        "workers": cfg.workers,
        "resumed_from_shard": len(done),
        "counts": manifest["counts"],
        "skipped": manifest["skipped"],
        "tokenizer": {k: manifest["tokenizer"][k] for k in ("kind", "digest", "vocab_size", "round_trip")},
        "token_dtype": manifest["token_dtype"],
    }
    fmt.write_json(out / _REPORT, report)
    lock.close()  # (an exception closes it with the frame)
    return report


def _finalize(
    cfg: BuildConfig, out: Path, tok: tok_mod.Tokenizer, dtype: np.dtype, markers: list[dict], skips: SkipStats, round_trip=None
) -> dict:
    shards = []
    first_doc = 0
    for m in markers:
        shards.append(
            {k: m[k] for k in ("shard", "dir", "n_docs", "n_tokens", "n_positions", "sa_entries", "sa_width", "files")}
            | {"first_doc": first_doc}
        )
        first_doc += m["n_docs"]
    tok_rec = asdict(fmt.file_record(out, out / tok.file_name))
    tokenizer = {"file": tok_rec, "kind": tok.kind, "digest": tok.digest, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id}
    manifest = {
        "format_version": fmt.FORMAT_VERSION,
        "tokenizer": tokenizer | ({"round_trip": round_trip.to_json()} if round_trip is not None else {}),
        "token_dtype": dtype.name,
        "separator": fmt.separator(dtype),
        "counts": fmt.manifest_counts(shards, first_doc),
        "shards": shards,
        "build": cfg.identity(),
        "skipped": skips.to_json(),
    }
    if len(shards) > 1:
        manifest["contexts"] = _merged_contexts(out, manifest)
        manifest["trigrams"] = _trigrams(out, manifest)
    bar = tqdm(total=first_doc, unit="doc", desc="metadata", disable=not cfg.progress)
    meta_store.write(out, markers, manifest, progress=bar.update)
    bar.close()
    fmt.write_json(out / "manifest.json", manifest)
    return manifest


def _merged_contexts(out: Path, manifest: dict) -> dict:
    """The index's frequent short contexts' histograms summed over its shards (index/merged.py):
    kept from the last run if built from these shards (their recorded digests), else (re)built."""
    try:
        last = fmt.read_manifest(out)
    except IndexFormatError:
        last = None
    positions = sum(s["n_positions"] for s in manifest["shards"])
    least = contexts.min_count(positions)
    rec = merged.current(out, (last or {}).get("contexts"), manifest["shards"], manifest["tokenizer"]["vocab_size"], least)
    return rec or merged.write(out, Index(out, access="normal", manifest=manifest))


def _trigrams(out: Path, manifest: dict) -> dict:
    """The shards' 3-token filters (index/trigrams.py): kept from the last run if built from
    these shards (their recorded digests), else (re)built."""
    try:
        last = fmt.read_manifest(out)
    except IndexFormatError:
        last = None
    rec = trigrams.current(out, (last or {}).get("trigrams"), manifest["shards"])
    return rec or trigrams.write(out, Index(out, access="normal", manifest=manifest))


def build_from_ids(
    docs: list[np.ndarray],
    out: str | Path,
    tokenizer: str | Path,
    *,
    shard_tokens: int = 1 << 30,
    workers: int = 1,
    memory_gb: float | None = None,
    sa_part_tokens: int | None = None,
) -> dict:
    """Index already-tokenized documents (ids in the tokenizer's vocabulary) into a fresh `out`.

    For tests and measurements that need an index of exact token sequences (random texts with a
    small alphabet, or the same ids given to infini-gram's indexer). tokenizer: a sentencepiece
    .model or a tokenizer.json (or a directory, as --tokenizer takes it); its vocabulary sets the
    token width. Not resumable.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise BuildError(f"output directory {out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    (out / "shards").mkdir()
    tok = tok_mod.load(tokenizer)
    (out / tok.file_name).write_bytes(tok.data)
    vocab = tok.vocab_size
    dtype = fmt.token_dtype(max(vocab, tok.eos_id + 1))
    cfg = BuildConfig(inputs=("<ids>",), out=str(out), tokenizer=str(tokenizer), shard_tokens=shard_tokens, progress=False)
    fmt.write_json(out / STATE, cfg.identity())
    skips = SkipStats()
    executor = LocalExecutor(workers)
    try:
        memory = {"part_positions": sa_part_tokens} | ({} if memory_gb is None else {"memory_bytes": int(memory_gb * 2**30)})
        writer = ShardWriter(out, 0, dtype, vocab, shard_tokens, skips, executor, **memory)
        for i, ids in enumerate(docs):
            ids = np.asarray(ids)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise BuildError(f"document {i}: ids outside the vocabulary [0, {vocab})")
            writer.add(Cursor(0, i, 0), readers.Doc("<ids>", i, ""), ids)
        writer.flush(Cursor(1, 0, 0))
        executor.results()
    finally:
        executor.close()
    return _finalize(cfg, out, tok, dtype, completed_shards(out), skips)
