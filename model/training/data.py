"""Training and evaluation data: token shards and the feature shards aligned with them.

Training batches are random windows drawn from a generator seeded by (seed, step, rank):
the batch at a step depends on nothing else, so a resumed run draws exactly the batches an
uninterrupted one would, and each DDP rank draws its own. Separators (document ends) enter
the model as EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from teragram.index import format as fmt
from teragram.index.errors import TeragramError
from teragram.index.features import Features, open_features
from teragram.model.gpt import to_torch


@dataclass
class _Shard:
    tokens: np.ndarray
    feats: Features | None  # as stored


class TrainData:
    """Windows of block_size + 1 tokens from an index's shards (+ features, when given)."""

    def __init__(self, index_dir: str | Path, features_dir: str | Path | None, block_size: int):
        self.index_dir = Path(index_dir)
        m = fmt.read_json(self.index_dir / "manifest.json")
        self.sep = m["separator"]
        self.eos = m["tokenizer"]["eos_id"]
        self.vocab_size = m["tokenizer"]["vocab_size"]
        self.block_size = block_size
        self.k = 0
        if features_dir is not None:
            fm = fmt.read_json(Path(features_dir) / "manifest.json")
            if fm["index_manifest"] != fmt.file_digest(self.index_dir / "manifest.json"):
                raise TeragramError(f"{features_dir}: features of another index")
            self.k = fm["top_k"]
        self.shards = []
        for s in m["shards"]:
            tok = fmt.open_array(fmt.shard_dir(self.index_dir, s["shard"], s.get("dir")) / "tokens.bin", "tokens")
            feats = open_features(Path(features_dir) / f"{s['shard']:06d}", self.k) if features_dir is not None else None
            if len(tok) > block_size + 1:
                self.shards.append(_Shard(tok, feats))
        if not self.shards:
            raise TeragramError(f"no shard of {index_dir} holds more than block_size + 1 = {block_size + 1} tokens")
        sizes = np.array([len(s.tokens) - block_size - 1 for s in self.shards], dtype=np.float64)
        self.weights = sizes / sizes.sum()

    @property
    def n_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.shards)

    def batch(self, step: int, batch_size: int, *, seed: int = 0, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor, Features | None]:
        rng = np.random.default_rng([seed, step, rank])
        which = rng.choice(len(self.shards), size=batch_size, p=self.weights)
        xs, ys, fs = [], [], []
        T = self.block_size
        for j in range(batch_size):
            sh = self.shards[which[j]]
            a = int(rng.integers(0, len(sh.tokens) - T - 1))
            w = np.asarray(sh.tokens[a : a + T + 1]).astype(np.int64)
            w[w == self.sep] = self.eos
            xs.append(w[:-1])
            ys.append(w[1:])
            if sh.feats is not None:
                fs.append(_slice_features(sh.feats, a, a + T, self.sep))
        x = torch.from_numpy(np.stack(xs))
        y = torch.from_numpy(np.stack(ys))
        f = to_torch(Features.combine(fs, np.stack)) if fs else None
        return x, y, f


def _slice_features(f: Features, a: int, b: int, sep: int) -> Features:
    return f.map(lambda x: x[a:b]).decoded(sep)


class EvalData:
    """Held-out documents (a features directory made with `teragram features --corpus`): their
    tokens, starts and features (model/evaluation/perplexity.forward_docs cuts them into windows)."""

    def __init__(self, features_dir: str | Path, block_size: int, eos: int, sep: int):
        d = Path(features_dir) / "000000"
        m = fmt.read_json(Path(features_dir) / "manifest.json")
        if m["mode"] != "held-out":
            raise TeragramError(f"{features_dir}: not held-out features (made with --corpus)")
        self.k = m["top_k"]
        self.tokens = fmt.open_array(d / "tokens.bin", "tokens")
        self.starts = np.asarray(fmt.open_array(d / "docs.bin", "docs")).astype(np.int64)
        self.feats = open_features(d, self.k)
        self.block_size, self.eos, self.sep = block_size, eos, sep

    def text_bytes(self, decode) -> int:
        """UTF-8 bytes of the held-out text (for bits per byte)."""
        total = 0
        for d in range(len(self.starts) - 1):
            a, e = int(self.starts[d]), int(self.starts[d + 1]) - 1
            total += len(decode(np.asarray(self.tokens[a:e]).tolist()).encode("utf-8"))
        return total
