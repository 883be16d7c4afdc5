"""Brute-force answers to every index query, straight from the document token lists."""

from __future__ import annotations

import numpy as np


class Oracle:
    def __init__(self, docs: list[np.ndarray], eos: int):
        self.docs = [np.asarray(d, dtype=np.int64) for d in docs]
        self.eos = eos
        self.n_positions = sum(len(d) + 1 for d in self.docs)
        # all documents concatenated, each followed by -1 (matches no query token)
        self.flat = np.concatenate([np.append(d, -1) for d in self.docs]) if self.docs else np.zeros(0, np.int64)
        self.doc_of = np.concatenate([np.full(len(d) + 1, k) for k, d in enumerate(self.docs)]) if self.docs else self.flat
        self.start_of = np.cumsum([0] + [len(d) + 1 for d in self.docs])

    def occurrences(self, q) -> list[tuple[int, int]]:
        """(doc, start) of every occurrence, in corpus order (plain elementwise comparison)."""
        q = np.asarray(q, dtype=np.int64)
        m = len(q)
        if m == 0:
            return [(k, p) for k, d in enumerate(self.docs) for p in range(len(d) + 1)]
        n = len(self.flat) - m + 1
        if n <= 0:
            return []
        mask = self.flat[:n] == q[0]
        for j in range(1, m):
            mask &= self.flat[j : n + j] == q[j]
        pos = np.nonzero(mask)[0]
        return [(int(self.doc_of[p]), int(p - self.start_of[self.doc_of[p]])) for p in pos]

    def count(self, q) -> int:
        return self.n_positions if len(q) == 0 else len(self.occurrences(q))

    def next_tokens(self, q) -> dict[int, int]:
        m = len(q)
        if m == 0:
            nxt = self.flat
        else:
            pos = np.array([self.start_of[k] + p for k, p in self.occurrences(q)], dtype=np.int64)
            nxt = self.flat[pos + m] if len(pos) else np.zeros(0, np.int64)
        nxt = np.where(nxt < 0, self.eos, nxt)
        u, c = np.unique(nxt, return_counts=True)
        return {int(a): int(b) for a, b in zip(u, c)}

    def prob(self, q, c) -> tuple[int, int, float]:
        pc = self.count(q)
        if pc == 0:
            return 0, 0, -1.0
        cc = self.count(list(q) + [c])
        return pc, cc, cc / pc

    def suffix_len(self, q) -> int:
        for n in range(len(q), 0, -1):
            if self.count(q[len(q) - n :]):
                return n
        return 0

    def features(self, ids, max_len: int, k: int, allowed=None):
        """Per-position (L, cont, count, topk) of every position of ids; see feature_at."""
        return [self.feature_at(ids, t, max_len, k, allowed) for t in range(len(ids))]

    def feature_at(self, ids, t: int, max_len: int, k: int, allowed=None):
        """(L, cont, count, topk) of position t of ids, by brute force.

        allowed(doc, start, length) -> bool filters occurrences (None: all). "Most recent" is
        the allowed occurrence with the largest (doc, start). With no match (L = 0) the empty
        suffix occurs at every allowed position (start = offset, length 0; offset len(doc) is
        the document end), followed by the token there.
        """
        ids = np.asarray(ids, dtype=np.int64)
        for L in range(min(max_len, t + 1), 0, -1):
            occ = [(dd, p) for dd, p in self.occurrences(ids[t - L + 1 : t + 1]) if allowed is None or allowed(dd, p, L)]
            if occ:
                break
        else:
            L = 0
            occ = [(dd, p) for dd, d in enumerate(self.docs) for p in range(len(d) + 1) if allowed is None or allowed(dd, p, 0)]
        hist: dict[int, int] = {}
        for dd, p in occ:
            d = self.docs[dd]
            nt = int(d[p + L]) if p + L < len(d) else self.eos
            hist[nt] = hist.get(nt, 0) + 1
        top = sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        if L == 0:
            return 0, -1, len(occ), top
        dd, p = max(occ)
        d = self.docs[dd]
        cont = int(d[p + L]) if p + L < len(d) else self.eos
        return L, cont, len(occ), top


def infinigram_engine(docs: list[np.ndarray], save_dir, eos: int, dtype: str = "u16", shards: list[list[np.ndarray]] | None = None):
    """infini-gram's engine over the same documents (`shards`: one index directory per list of
    documents, for its per-shard CNF), in its own layout: per document the separator (every byte
    0xff) then little-endian ids of the width (u16 or u32), u64 document offsets."""
    import subprocess
    import sys
    from pathlib import Path

    from infini_gram.engine import InfiniGramEngine

    width = {"u16": 2, "u32": 4}[dtype]
    dirs = []
    for i, part in enumerate(shards if shards is not None else [docs]):
        S = Path(save_dir) / f"{i}" / "S"
        S.mkdir(parents=True)
        offsets, pos = [], 0
        with open(S / "tokenized.0", "wb") as f:
            for d in part:
                offsets.append(pos)
                b = b"\xff" * width + np.asarray(d, dtype=f"<u{width}").tobytes()
                f.write(b)
                pos += len(b)
        np.asarray(offsets, dtype="<u8").tofile(S / "offset.0")
        args = ["--data_dir", str(S.parent), "--save_dir", str(S), "--token_dtype", dtype, "--cpus", "1", "--mem", "1", "--ulimit", "1024"]
        subprocess.run([sys.executable, "-m", "infini_gram.indexing", *args], check=True, capture_output=True)
        dirs.append(str(S))
    vocab = 65535 if dtype == "u16" else 2**32 - 1
    return InfiniGramEngine(index_dir=dirs, eos_token_id=eos, vocab_size=vocab, version=4, token_dtype=dtype)
