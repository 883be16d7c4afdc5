"""Training text as token shards, for a run whose text is not an index's (`teragram train
--data DIR`): text larger than one machine keeps, or brought to the trainer while it trains.

DIR/manifest.json lists every shard (name, tokens, digest), the vocabulary and the separator
before the run starts, so that its schedule is fixed from the first step. A shard is an array
file of the index's format (kind "tokens": documents' ids, each followed by the separator),
stored as NAME or compressed as NAME.zst (unpacked beside it when first read). A shard that is
not there yet is waited for, and the seconds spent waiting are counted; one whose digest is not
the manifest's is refused.

One epoch, in order: shard s is cut into windows of block_size + 1 tokens, block_size apart,
shuffled by (seed, s, epoch); the windows of all shards, shard after shard, are taken in turn,
batch_size per micro-step and rank. Every token is read once an epoch, the shards in the order
the manifest lists them (write_shards shuffles documents before it cuts shards, so each is a
uniform sample), and a resumed run reads exactly the windows an uninterrupted one would.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from teragram.index import format as fmt
from teragram.index.errors import TeragramError

FORMAT = "teragram-token-shards"
POLL_S = 0.5  # how often a missing shard is looked for


def write_shards(
    out: Path, docs: Iterable[np.ndarray], *, shard_tokens: int, vocab_size: int, eos_id: int, separator: int, tokenizer: str | None = None
) -> dict:
    """Documents (arrays of ids, in the order given) into shards of about shard_tokens tokens
    under OUT (a document is never split), then OUT/manifest.json. Returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if separator < 1 << 16 else np.uint32
    shards: list[dict] = []
    w, n = None, 0

    def close() -> None:
        path = w.close()
        shards.append({"name": path.name, "tokens": w.count, "blake2b": fmt.file_digest(path)})

    try:
        for d in docs:
            if w is None:
                w, n = fmt.ArrayWriter(out / f"shard{len(shards):04d}.bin", "tokens", dtype), 0
            w.append(d)
            w.append([separator])
            n += len(d) + 1
            if n >= shard_tokens:
                close()
                w = None
        if w is not None:
            close()
            w = None
    finally:
        if w is not None:
            w.abort()
    if not shards:
        raise TeragramError(f"{out}: no documents to write")
    m = {"format": FORMAT, "vocab_size": vocab_size, "eos_id": eos_id, "separator": separator, "tokenizer": tokenizer}
    m |= {"shards": shards, "tokens": sum(s["tokens"] for s in shards)}
    fmt.write_json(out / "manifest.json", m)
    return m


def documents(index, order: Iterable[int] | None = None) -> Iterator[np.ndarray]:
    """The ids of an index's documents (an opened Index), in `order` (global document numbers;
    default all, in the index's order): what write_shards takes."""
    firsts = np.array([s.first_doc for s in index.shards], dtype=np.int64)
    for d in range(int(firsts[-1] + len(index.shards[-1].starts) - 1)) if order is None else order:
        s = index.shards[int(np.searchsorted(firsts, d, side="right") - 1)]
        k = d - s.first_doc
        yield np.asarray(s.tok[int(s.starts[k]) : int(s.starts[k + 1]) - 1])


def read_manifest(path: Path) -> dict:
    m = fmt.read_json(Path(path) / "manifest.json")
    if m.get("format") != FORMAT:
        raise TeragramError(f"{path}: not token shards (its manifest.json is not a {FORMAT} manifest)")
    return m


class TokenShards:
    """The windows of token shards (the module's docstring), with TrainData's interface."""

    def __init__(self, path: str | Path, block_size: int, world: int = 1):
        self.path = Path(path)
        m = read_manifest(self.path)
        self.sep, self.eos, self.vocab_size = m["separator"], m["eos_id"], m["vocab_size"]
        self.tokenizer = m.get("tokenizer")
        self.block_size, self.world = block_size, world
        self.shards = m["shards"]
        self.windows = np.array([max(0, (s["tokens"] - 1) // block_size) for s in self.shards], dtype=np.int64)
        if not self.windows.sum():
            raise TeragramError(f"{path}: no shard holds more than block_size + 1 = {block_size + 1} tokens")
        self.first = np.concatenate([[0], np.cumsum(self.windows)])
        self.waited_s = 0.0  # seconds spent waiting for shards not there yet
        self._open: dict[int, np.ndarray] = {}
        self._order: dict[tuple[int, int], np.ndarray] = {}

    @property
    def epoch_windows(self) -> int:
        return int(self.first[-1])

    def tokens(self, s: int) -> np.ndarray:
        """Shard s's ids (waiting for it, unpacking it, checking its digest once)."""
        if s not in self._open:
            for old in [k for k in self._open if k < s]:
                del self._open[old]  # shards are read in order: the ones before are done
            self._open[s] = self._load(s)
        return self._open[s]

    def _load(self, s: int) -> np.ndarray:
        info = self.shards[s]
        path = self.path / info["name"]
        packed = path.with_name(path.name + ".zst")
        t = time.time()
        while not path.exists() and not packed.exists():
            time.sleep(POLL_S)
        self.waited_s += time.time() - t
        if not path.exists():
            _unpack(packed, path)
        if fmt.file_digest(path) != info["blake2b"]:
            raise TeragramError(f"{path}: its digest is not the manifest's (a damaged or foreign shard)")
        tok = fmt.open_array(path, "tokens")
        if len(tok) != info["tokens"]:
            raise TeragramError(f"{path}: {len(tok):,} tokens, the manifest says {info['tokens']:,}")
        return tok

    def window(self, g: int, seed: int) -> np.ndarray:
        """The g-th window of the run (epochs after the first reshuffled)."""
        epoch, g = divmod(g, self.epoch_windows)
        s = int(np.searchsorted(self.first, g, side="right") - 1)
        key = (s, epoch)
        if key not in self._order:
            self._order = {k: v for k, v in self._order.items() if k[0] >= s}
            self._order[key] = np.random.default_rng([seed, s, epoch]).permutation(int(self.windows[s]))
        a = int(self._order[key][g - self.first[s]]) * self.block_size
        return np.asarray(self.tokens(s)[a : a + self.block_size + 1])

    def batch(self, step: int, batch_size: int, *, seed: int = 0, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor, None]:
        g0 = (step * self.world + rank) * batch_size
        w = np.stack([self.window(g0 + j, seed) for j in range(batch_size)]).astype(np.int64)
        w[w == self.sep] = self.eos
        return torch.from_numpy(w[:, :-1]), torch.from_numpy(w[:, 1:]), None


def _unpack(packed: Path, path: Path) -> None:
    import zstandard

    tmp = path.with_name(path.name + ".part")
    with open(packed, "rb") as src, open(tmp, "wb") as dst:
        zstandard.ZstdDecompressor().copy_stream(src, dst)
    tmp.replace(path)
