"""Evaluation streamed over held-out text of any size, in bounded memory.

The text is read a chunk at a time: a run of whole documents of at most `chunk_tokens` targets.
A document longer than that is read in pieces (`split`: cut at multiples of the model's batch of
windows, so that it runs the same batches of the same windows), each a chunk of its own that carries the document's
earlier tokens (`prefix`): peak memory follows the chunk size, not the text's nor the longest
document's size, and every figure is the one of the document read whole (the stages carry what
they need from the earlier pieces: mixing.py, perplexity.py). Each chunk is tokenized, given held-out
features when the model reads them, run through the model, looked up in the index (the
estimates, and the ∞-gram's match lengths that decontamination reads), and mixed. Only each
document's sums are kept in memory: its targets, the model's and the mixture's summed loss, its
UTF-8 bytes and whether decontamination keeps it. What a fit needs from every token (a gate's
inputs as GateX columns and the components' log-probabilities, a baseline's inputs) is spilled
to memory-mapped files in a temporary directory and read back a block or a sample at a time.

The model runs one chunk ahead in a background thread (`prefetch`), so that on a GPU its forward
pass overlaps the index's estimates on the CPU.

Fitting at scale (`--fit-gate`): the continuous cache's scale is fit on the fitting half of the
first chunk's documents; each candidate gate is fit on a fixed random sample of at most
`fit_rows` tokens of the fitting half, compared on every token of the held-out half, and the
better one fit again on a sample of every kept token. With text of at most one chunk and
`fit_rows` tokens this is exactly the fit on the whole text.
"""

from __future__ import annotations

import math
import queue
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from teragram.index import format as fmt

CHUNK_TOKENS = 262_144  # targets per chunk (docs/research/2026-12-07-eval-streaming.md)
FIT_ROWS = 200_000  # tokens a candidate gate is fit on at most: 3 fits in about a minute on 2 cores
BLOCK = 1 << 18  # rows scored at a time from a spill


@dataclass
class Chunk:
    """A run of whole documents, or a piece of one: the first one's number in the whole text,
    their token ids (no separator), their sources, and, as the stream fills them in, their
    held-out features, the model's per-target outputs `r` (model.evaluation.perplexity.forward_docs's
    fields, with global document numbers) and each document's UTF-8 bytes.

    A piece (`offset` > 0 or `open`) is one document's targets offset .. offset + len(docs[0])
    (+ 1, its EOS, unless open: the document goes on in the next chunk); `prefix` holds the
    document's tokens before it. A piece's bytes are 0 but the last one's: the whole document's."""

    first: int
    docs: list[np.ndarray]
    metas: list[dict] | None = None
    feats: object = None
    r: dict | None = None
    nbytes: np.ndarray | None = None
    est: dict | None = None  # the index's and the document cache's estimates (model/mixture/estimates.py)
    keep: np.ndarray | None = None  # with decontamination: the documents kept
    weights: np.ndarray | None = None  # a given gate's mixture weights at every target
    offset: int = 0  # a piece: its first target's position in the document
    open: bool = False  # a piece that is not the document's last
    prefix: np.ndarray | None = None  # a piece: the document's tokens before it

    @property
    def targets(self) -> int:
        return sum(len(d) + 1 for d in self.docs) - self.open

    @property
    def piece(self) -> bool:
        return self.offset > 0 or self.open


def pieces(n_targets: int, chunk_tokens: int, split: int) -> list[tuple[int, int]]:
    """Target ranges [s, e) of a document of n_targets read in pieces of at most chunk_tokens
    (at least `split`), each starting at a multiple of split (the model's context times its
    batch: a piece's windows are the whole document's, run in the same batches)."""
    from teragram.index.heldout import piece_rows

    return piece_rows(n_targets, max(split, chunk_tokens // split * split))


def _pieces(first: int, ids: np.ndarray, meta, chunk_tokens: int, split: int) -> Iterator[Chunk]:
    """The chunks of one document read in pieces (ids: all its tokens)."""
    n = len(ids)
    for s, e in pieces(n + 1, chunk_tokens, split):
        yield Chunk(first, [ids[s : min(e, n)]], [meta], offset=s, open=e <= n, prefix=ids[:s])


def cut(lengths, chunk_tokens: int) -> list[tuple[int, int]]:
    """Runs [a, b) of documents of about chunk_tokens targets (len + 1 each), at least one each."""
    ends = np.cumsum(np.asarray(lengths, np.int64) + 1)
    out, a = [], 0
    while a < len(ends):
        base = ends[a - 1] if a else 0
        b = max(a + 1, int(np.searchsorted(ends, base + chunk_tokens, side="right")))
        out.append((a, b))
        a = b
    return out


def corpus_chunks(
    idx, corpus: list[str], chunk_tokens: int = CHUNK_TOKENS, skipped: list | None = None, *, split: int | None = None
) -> Iterator[Chunk]:
    """Chunks of the readable documents of files or folders, tokenized as they are read; each
    unreadable record is appended to `skipped` (readers.Skip). A document longer than a chunk
    is read in pieces cut at multiples of `split` (None: it is a chunk of its own)."""
    from teragram.index.heldout import iter_corpus

    docs, metas, n, first = [], [], 0, 0
    for ids, meta in iter_corpus(idx, corpus, skipped):
        if docs and n + len(ids) + 1 > chunk_tokens:  # at most chunk_tokens, or one document longer than that
            yield Chunk(first, docs, metas)
            first += len(docs)
            docs, metas, n = [], [], 0
        if split and len(ids) + 1 > chunk_tokens:
            yield from _pieces(first, ids, meta, chunk_tokens, split)
            first += 1
            continue
        docs.append(ids)
        metas.append(meta)
        n += len(ids) + 1
    if docs:
        yield Chunk(first, docs, metas)


def heldout_chunks(heldout, chunk_tokens: int = CHUNK_TOKENS, *, features: bool = False, split: int | None = None) -> Iterator[Chunk]:
    """Chunks of a held-out features directory (index/heldout.py) or saved outputs'
    (model/evaluation/outputs.py) documents, read from its memory-mapped files; with features,
    each chunk's held-out features too (decoded, laid out doc0 SEP doc1 SEP ...; a piece's: its
    tokens', then the separator's when it ends the document). A document longer than a chunk
    is read in pieces cut at multiples of `split` (None: it is a chunk of its own)."""
    from teragram.index.features import open_features

    heldout = Path(heldout)
    d = heldout / "000000"
    m = fmt.read_json(heldout / "manifest.json")
    tok = fmt.open_array(d / "tokens.bin", "tokens")
    st = np.asarray(fmt.open_array(d / "docs.bin", "docs")).astype(np.int64)
    metas = m["docs"] if isinstance(m.get("docs"), list) else fmt.read_json(heldout / "000000.done")["docs"]
    feats = open_features(d, m["top_k"]) if features else None
    sep = int(tok[st[1] - 1]) if len(st) > 1 else 0
    for a, b in cut(np.diff(st) - 1, chunk_tokens):
        n = int(st[b] - st[a] - 1)
        if split and b == a + 1 and n + 1 > chunk_tokens:
            ids = np.asarray(tok[st[a] : st[a] + n]).astype(np.int64)
            for ch in _pieces(a, ids, metas[a], chunk_tokens, split):
                if feats is not None:
                    lo = st[a] + ch.offset
                    hi = lo + ch.targets
                    ch.feats = feats.map(lambda x, lo=lo, hi=hi: x[lo:hi]).decoded(sep)
                yield ch
            continue
        ids = np.asarray(tok[st[a] : st[b]]).astype(np.int64)
        docs = [ids[st[k] - st[a] : st[k + 1] - 1 - st[a]] for k in range(a, b)]
        f = feats.map(lambda x, a=a, b=b: x[st[a] : st[b]]).decoded(sep) if feats is not None else None
        yield Chunk(a, docs, metas[a:b], f)


def prefetch(items: Iterable, depth: int = 1) -> Iterator:
    """The items of an iterable produced `depth` ahead in a background thread (a model's forward
    pass on the GPU, or the tokenizer, while the caller computes the index's estimates). An
    exception raised there is raised here, at the item it stopped."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def run():
        try:
            for x in items:
                if stop.is_set():
                    return
                q.put((x, None))
            q.put((done, None))
        except BaseException as e:  # noqa: BLE001 -- handed to the consumer
            q.put((done, e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        while True:
            x, err = q.get()
            if x is done:
                if err is not None:
                    raise err
                return
            yield x
    finally:
        stop.set()
        while t.is_alive():  # let the producer see stop (a full queue blocks it)
            try:
                q.get(timeout=0.1)
            except queue.Empty:
                pass


def text_size(corpus: list[str]) -> int:
    """About the bytes of text in the corpus's files, for a progress bar's ETA: a file's size,
    a gzip file's recorded length, a zstd file's frame content size where it records one."""
    import struct

    import zstandard
    from teragram.index import readers

    total = 0
    for p in readers.walk(corpus):
        size = p.stat().st_size
        try:
            if p.suffix == ".gz" and size >= 4:
                with open(p, "rb") as f:
                    f.seek(-4, 2)
                    size = struct.unpack("<I", f.read(4))[0] or size
            elif p.suffix == ".zst":
                with open(p, "rb") as f:
                    n = zstandard.frame_content_size(f.read(18))
                size = n if n > 0 else size
        except (OSError, struct.error, zstandard.ZstdError):  # an estimate only: the file's size stands
            pass
        total += size
    return total


def progress(chunks: Iterable[Chunk], total: int | None, *, unit: str = "tok", quiet: bool = False) -> Iterator[Chunk]:
    """The chunks, with a progress bar (and ETA) on stderr: targets done of `total` (unit "tok"),
    or UTF-8 bytes of text done of about `total` (unit "B")."""
    from tqdm import tqdm

    with tqdm(total=total, unit=unit, unit_scale=True, desc="eval", disable=quiet) as bar:
        for ch in chunks:
            bar.update(int(np.sum(ch.nbytes)) if unit == "B" else ch.targets)
            yield ch


@dataclass
class DocSums:
    """Per document: targets, summed loss of the model and of the mixture, UTF-8 bytes, and
    whether decontamination keeps it; a report (perplexity, bits per byte) from any selection.
    A document read in pieces is one document: each piece's sums add to it, its last sets keep."""

    parts: dict[str, list] = field(default_factory=lambda: {k: [] for k in ("n", "model", "mixed", "bytes", "keep")})

    def add(
        self, first: int, n_docs: int, doc: np.ndarray, nll: np.ndarray, mixed: np.ndarray | None, nbytes, keep, *, cont: bool = False
    ) -> None:
        """A chunk's documents [first, first + n_docs) (cont: the first one goes on from the last
        chunk's last one, a piece of it) from its rows' document numbers and losses."""
        local = np.asarray(doc, np.int64) - first
        new = {
            "n": np.bincount(local, minlength=n_docs),
            "model": np.bincount(local, weights=np.asarray(nll, np.float64), minlength=n_docs),
            "mixed": np.bincount(local, weights=np.asarray(mixed, np.float64), minlength=n_docs) if mixed is not None else None,
            "bytes": np.array(nbytes, np.int64),
            "keep": np.array(keep, bool),
        }
        for name, a in new.items():
            if cont and a is not None:
                last = next(p for p in reversed(self.parts[name]) if len(p))  # the document's earlier pieces' entry
                last[-1] = a[0] if name == "keep" else last[-1] + a[0]
                a = a[1:]
            if len(a) if a is not None else True:
                self.parts[name].append(a)

    def get(self, name: str) -> np.ndarray:
        return np.concatenate(self.parts[name]) if self.parts[name] else np.zeros(0)

    def report(self, which: str, keep: np.ndarray | None = None) -> dict:
        k = slice(None) if keep is None else keep
        return figures(int(self.get("n")[k].sum()), float(self.get(which)[k].sum()), int(self.get("bytes")[k].sum()))


def figures(n: int, total: float, nbytes: int) -> dict:
    """Tokens, mean loss, perplexity and bits per byte of n targets of summed loss `total`."""
    return {
        "tokens": n,
        "loss": total / max(n, 1),
        "perplexity": math.exp(total / max(n, 1)),
        "bits_per_byte": total / math.log(2) / max(nbytes, 1),
        "bytes": int(nbytes),
    }


class Spill:
    """Per-token arrays appended chunk by chunk to raw files in a temporary directory (`dir`,
    default the system's), read back whole as memory maps (`arrays`); removed on close."""

    def __init__(self, dir: str | Path | None = None):
        self.root = Path(tempfile.mkdtemp(prefix="teragram-spill-", dir=dir))
        self.files: dict = {}
        self.kinds: dict[str, tuple[np.dtype, tuple]] = {}

    def add(self, **arrays) -> None:
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            if name not in self.files:
                self.files[name] = open(self.root / f"{name}.bin", "wb")
                self.kinds[name] = (a.dtype, a.shape[1:])
            elif (a.dtype, a.shape[1:]) != self.kinds[name]:
                raise ValueError(f"spill {name}: {a.dtype}{a.shape[1:]} after {self.kinds[name]}")
            a.tofile(self.files[name])

    def arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for name, f in self.files.items():
            f.close()
            dtype, shape = self.kinds[name]
            n = (self.root / f"{name}.bin").stat().st_size // (dtype.itemsize * int(np.prod(shape)))
            out[name] = np.memmap(self.root / f"{name}.bin", dtype, "r", shape=(n, *shape)) if n else np.zeros((0, *shape), dtype)
        return out

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        shutil.rmtree(self.root, ignore_errors=True)


def sample_rows(mask: np.ndarray, n: int) -> np.ndarray:
    """The rows of a mask, or a fixed random sample of n of them (sorted) when there are more."""
    rows = np.flatnonzero(mask)
    return rows if len(rows) <= n else np.sort(np.random.default_rng(0).choice(rows, n, replace=False))


def blocks(n: int, size: int = BLOCK) -> Iterator[slice]:
    for a in range(0, n, size):
        yield slice(a, min(a + size, n))
