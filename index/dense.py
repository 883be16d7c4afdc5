"""The dense store of kNN-LM: a FAISS IVF-PQ index of hidden states, with their next tokens.

IVF-PQ (8-bit codes, two dimensions per sub-quantizer) proposes candidates, which are
re-ranked with fp16 copies of the keys (FAISS Refine): d/2 bytes of codes plus 2d bytes of
copies per key, for near-exact neighbours.

Keys are a trained model's final hidden states at training positions, values the token that
followed. `search` returns the k nearest keys (squared L2) and their values; the kNN-LM turns
them into p_knn(y) proportional to sum over neighbours with value y of exp(-d / T).

    IDX/dense/index.faiss     the FAISS index (IVF-PQ, inner lists probed: nprobe)
    IDX/dense/values.bin      next token of each key (teragram header, uint32)
    IDX/dense/meta.json       dims, count, nlist, m, nprobe, the checkpoint the keys came from
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import format as fmt
from .errors import IndexFormatError


@dataclass(frozen=True)
class DenseConfig:
    nlist: int = 0  # inverted lists; 0: about 4 * sqrt(n)
    m: int = 0  # PQ sub-quantizers; 0: dims / 2 (two dimensions per 8-bit code)
    nprobe: int = 32
    k_factor: int = 4  # candidates re-ranked exactly per neighbour asked for
    train_size: int = 200_000  # keys sampled to train the coarse quantizer and PQ


def build(out: str | Path, keys: np.ndarray, values: np.ndarray, cfg: DenseConfig = DenseConfig(), meta: dict | None = None) -> dict:
    """Train and fill an IVF-PQ index over keys (n, d) float32 -> values (n,)."""
    import faiss

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    keys = np.ascontiguousarray(keys, dtype=np.float32)
    n, d = keys.shape
    nlist = cfg.nlist or max(1, int(4 * np.sqrt(n)))
    m = cfg.m or max(1, d // 2)
    while d % m:
        m -= 1
    # IVF-PQ finds candidates; the k * k_factor best are re-ranked with fp16 copies of the keys
    index = faiss.index_factory(d, f"IVF{nlist},PQ{m}x8,Refine(SQfp16)", faiss.METRIC_L2)
    faiss.downcast_index(faiss.extract_index_ivf(index)).do_polysemous_training = False  # unused: plain PQ search
    rng = np.random.default_rng(0)
    train = keys[rng.choice(n, size=min(n, max(cfg.train_size, 40 * nlist)), replace=False)]
    index.train(train)
    index.add(keys)
    index.k_factor = cfg.k_factor
    faiss.extract_index_ivf(index).nprobe = min(cfg.nprobe, nlist)
    tmp = out / ".index.faiss.tmp"
    faiss.write_index(index, str(tmp))
    tmp.replace(out / "index.faiss")
    fmt.write_array(out / "values.bin", "dense.values", np.asarray(values, dtype=np.uint32))
    info = {"count": n, "dims": d, "nlist": nlist, "m": m, "nprobe": min(cfg.nprobe, nlist), "k_factor": cfg.k_factor} | (meta or {})
    fmt.write_json(out / "meta.json", info)
    return info


class DenseStore:
    def __init__(self, path: str | Path):
        import faiss

        p = Path(path)
        if not (p / "index.faiss").exists():
            raise IndexFormatError(f"{p}: no dense store (build one with `teragram dense`)")
        self.meta = fmt.read_json(p / "meta.json")
        self.index = faiss.read_index(str(p / "index.faiss"))
        faiss.extract_index_ivf(self.index).nprobe = self.meta["nprobe"]
        self.index.k_factor = self.meta["k_factor"]
        self.values = fmt.open_array(p / "values.bin", "dense.values")

    def search(self, queries: np.ndarray, k: int = 64) -> tuple[np.ndarray, np.ndarray]:
        """(squared distances (q, k), next tokens (q, k)); -1 where fewer than k were found."""
        d, i = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
        vals = np.where(i >= 0, np.asarray(self.values)[np.maximum(i, 0)].astype(np.int64), -1)
        return d, vals


def knn_probs(dist: np.ndarray, vals: np.ndarray, targets: np.ndarray, temperature: float) -> np.ndarray:
    """p_knn(target) per query: softmax(-dist / T) summed over neighbours whose value is the target."""
    w = -dist / temperature
    w = np.where(vals >= 0, w, -np.inf)
    w = w - w.max(axis=1, keepdims=True)
    e = np.exp(w)
    e = e / e.sum(axis=1, keepdims=True)
    return (e * (vals == targets[:, None])).sum(axis=1)
