"""Token shards (model/training/shards.py): one epoch reads every window once (brute force over
the shards), a missing shard is waited for and a compressed one unpacked, a damaged one refused,
and `train --data` trains from them without an index."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch
import zstandard
from teragram.index.errors import TeragramError
from teragram.model.config import ConfigError
from teragram.model.training.shards import TokenShards, documents, write_shards
from teragram.model.training.train import TrainConfig, logs_step, train

from tests.model.conftest import TINY

SEP, T = 65535, 16


def _docs(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 100, size=int(rng.integers(5, 90))) for _ in range(n)]


def _write(path, docs, shard_tokens=700):
    return write_shards(path, docs, shard_tokens=shard_tokens, vocab_size=100, eos_id=2, separator=SEP)


def _all_windows(path, m) -> Counter:
    """Brute force: every window of every shard (block T + 1, T apart), EOS for the separator."""
    c = Counter()
    for s in m["shards"]:
        raw = np.fromfile(path / s["name"], dtype=np.uint16)[-s["tokens"] :].astype(np.int64)
        raw[raw == SEP] = 2
        for a in range(0, (len(raw) - 1) // T * T, T):
            c[tuple(raw[a : a + T + 1])] += 1
    return c


def test_an_epoch_reads_every_window_once(tmp_path):
    docs = _docs()
    m = _write(tmp_path, docs)
    assert len(m["shards"]) >= 3 and m["tokens"] == sum(len(d) + 1 for d in docs)
    data = TokenShards(tmp_path, T)
    want = _all_windows(tmp_path, m)
    assert data.epoch_windows == sum(want.values())
    for epoch in range(2):  # each epoch all of them, in another order
        first = epoch * data.epoch_windows
        got = [tuple(data.window(g, seed=5)) for g in range(first, first + data.epoch_windows)]
        got = Counter(tuple(np.where(np.array(w) == SEP, 2, w)) for w in got)
        assert got == want
    B = 4  # micro-step m reads windows m * B ..
    x, y, _ = data.batch(3, B, seed=5)
    for i in range(B):
        w = data.window(3 * B + i, seed=5).astype(np.int64)
        assert np.array_equal(np.where(w == SEP, 2, w), np.concatenate([x[i].numpy(), y[i, -1:].numpy()]))
    # two ranks of a world of 2 read disjoint windows that together are the epoch's
    two = [TokenShards(tmp_path, T, world=2) for _ in range(2)]
    got = Counter()
    for step in range(data.epoch_windows // (2 * B)):
        for rank, d in enumerate(two):
            x, y, _ = d.batch(step, B, seed=5, rank=rank)
            got.update(tuple(np.concatenate([a.numpy(), b[-1:].numpy()])) for a, b in zip(x, y, strict=True))
    assert sum(got.values()) == data.epoch_windows // (2 * B) * 2 * B and not got - want


def test_a_missing_shard_is_waited_for_and_a_compressed_one_unpacked(tmp_path):
    m = _write(tmp_path, _docs(seed=1))
    want = TokenShards(tmp_path, T).batch(len(m["shards"]) * 6, 4, seed=1)[0]  # a batch in a later shard
    later = TokenShards(tmp_path, T)
    g = (len(m["shards"]) * 6) * 4
    s = int(np.searchsorted(later.first, g, side="right") - 1)
    path = tmp_path / m["shards"][s]["name"]
    packed = zstandard.ZstdCompressor(level=3).compress(path.read_bytes())
    path.unlink()

    def arrive():
        time.sleep(1.0)
        tmp = path.with_name(path.name + ".zst.part")
        tmp.write_bytes(packed)
        tmp.replace(path.with_name(path.name + ".zst"))

    threading.Thread(target=arrive).start()
    got = later.batch(len(m["shards"]) * 6, 4, seed=1)[0]
    assert later.waited_s >= 0.5 and path.exists()
    assert torch_equal(got, want)


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


def test_a_damaged_shard_is_refused(tmp_path):
    m = _write(tmp_path, _docs(seed=2))
    path = tmp_path / m["shards"][0]["name"]
    b = bytearray(path.read_bytes())
    b[-3] ^= 1
    path.write_bytes(bytes(b))
    with pytest.raises(TeragramError, match="digest is not the manifest's"):
        TokenShards(tmp_path, T).batch(0, 2)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(TeragramError, match="not token shards"):
        TokenShards(tmp_path, T)


def test_train_from_shards_without_an_index(tmp_path, held_root):
    from teragram.index.engine import Index

    idx = Index(held_root / "idx")
    tok = idx.manifest["tokenizer"]
    docs = list(documents(idx))
    assert np.array_equal(
        np.concatenate([np.append(d, idx.manifest["separator"]) for d in docs]), np.concatenate([s.tok for s in idx.shards])
    )
    m = write_shards(
        tmp_path / "shards",
        docs,
        shard_tokens=20000,
        vocab_size=tok["vocab_size"],
        eos_id=tok["eos_id"],
        separator=idx.manifest["separator"],
    )
    cfg = TINY | {
        "data": str(tmp_path / "shards"),
        "out": str(tmp_path / "run"),
        "max_steps": 12,
        "log_every": 5,
        "heldout": str(held_root / "held"),
    }
    r = train(TrainConfig(**cfg))
    assert r["step"] == 12 and np.isfinite(r["loss"]) and r["eval"]["perplexity"] > 1
    rows = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl") if '"tokens_per_s"' in line]
    assert all(row["input_wait_s"] >= 0 for row in rows) and m["tokens"] == sum(len(s.tok) for s in idx.shards)
    # a row after the first step, every log_every-th and the last, each with the loss it read (CUDA reads only those)
    assert [row["step"] for row in rows] == [s + 1 for s in range(12) if logs_step(TrainConfig(**cfg), s, 0)] == [1, 5, 10, 12]
    assert all(row["loss"] > 0 for row in rows)
    damaged = tmp_path / "damaged"  # a shard damaged on its way: the run stops with its one line
    write_shards(damaged, docs, shard_tokens=20000, vocab_size=tok["vocab_size"], eos_id=tok["eos_id"], separator=idx.manifest["separator"])
    (damaged / "shard0000.bin").write_bytes(b"\0" * 100)
    with pytest.raises(TeragramError, match="digest is not the manifest's"):
        train(TrainConfig(**(cfg | {"data": str(damaged), "out": str(tmp_path / "run2")})))
    with pytest.raises(ConfigError, match="leave features unset"):
        train(TrainConfig(**(cfg | {"features": str(held_root / "held")})))
    with pytest.raises(ConfigError, match="index is required"):
        train(TrainConfig(**(TINY | {"out": str(tmp_path / "x")})))


def test_the_batch_thread_stops_when_the_trainer_leaves_early():
    """A run that stops mid-way (an error, the last step) leaves no thread making batches: one
    still inside torch when the interpreter exits aborts the process."""
    from types import SimpleNamespace

    from teragram.model.training.batches import prefetch

    made = []

    class Data:
        def batch(self, i, b, seed, rank):
            made.append(i)
            return torch.zeros(b, 4), torch.zeros(b, 4), None

    cfg = SimpleNamespace(max_steps=10_000, grad_accum=2, batch_size=3, seed=0)
    with prefetch(Data(), cfg, rank=0, start=5, pin=False) as batches:
        x, _, _ = next(batches)
        assert x.shape == (3, 4) and made[0] == 10  # step 5, micro-step 0
    assert not batches.thread.is_alive() and len(made) < 100  # a few ahead, not the whole run
