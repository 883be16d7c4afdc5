"""The short frequent contexts' histograms summed over an index's shards (index/merged.py):
exactly the contexts the threshold asks for, each with its brute-force histogram and its
interval in every shard as searched; bulk
features equal with and without them; ignored by an index opened on some of its shards."""

from collections import Counter, defaultdict

import numpy as np
import pytest
from teragram.builder.build import build_from_ids
from teragram.index import contexts, merged
from teragram.index.bulk import continuations
from teragram.index.engine import Index

from tests.conftest import random_docs

MIN = 5


@pytest.fixture(scope="module")
def merged_index(tmp_path_factory, tokenizer_model):
    """Documents over a small alphabet in several shards, built at a low threshold."""
    rng = np.random.default_rng(11)
    docs = random_docs(rng, 150, 5, 40, 1000)
    docs += [docs[4].copy(), docs[4][:12].copy(), docs[4][:12].copy()]
    out = tmp_path_factory.mktemp("merged") / "idx"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(contexts, "MIN_COUNT", MIN)
        build_from_ids(docs, out, tokenizer_model, shard_tokens=900)
    assert len(Index(out).shards) >= 3
    return out, docs


def _decode(key: int, vocab: int) -> tuple[int, ...]:
    bits = merged.key_bits(vocab)
    n = (key.bit_length() - 1) // bits
    return tuple((key >> (bits * (n - 1 - i))) & ((1 << bits) - 1) for i in range(n))


def test_every_short_frequent_context_with_its_histogram(merged_index):
    """The stored contexts are every string of 1..max_len tokens inside a document with at
    least MIN occurrences in the whole index, each with its next tokens counted over all the
    documents (a document's end as EOS), and nothing else."""
    path, docs = merged_index
    idx = Index(path)
    mg = idx.merged
    assert mg is not None and idx.manifest["contexts"]["min_count"] == MIN
    D = merged.max_len(idx.vocab_size)
    follow: dict[tuple, Counter] = defaultdict(Counter)
    for d in docs:
        d = d.tolist()
        for j in range(1, len(d) + 1):
            for i in range(max(0, j - D), j):
                follow[tuple(d[i:j])][d[j] if j < len(d) else idx.eos_id] += 1
    want = {q: dict(c) for q, c in follow.items() if sum(c.values()) >= MIN}
    hist = np.asarray(mg.hist)
    ends = np.asarray(mg.ends)
    got = {}
    for i, k in enumerate(np.asarray(mg.keys).tolist()):
        a = int(ends[i - 1]) if i else 0
        got[_decode(k, idx.vocab_size)] = dict(zip(hist[a : ends[i], 0].tolist(), hist[a : ends[i], 1].tolist()))
    assert got == want
    assert max(len(q) for q in got) == D and len(got) > 100
    assert np.all(np.diff(np.asarray(mg.keys).astype(np.float64)) > 0)
    ss = idx.shard_set
    for i, k in enumerate(np.asarray(mg.keys).tolist()):  # each one's interval in every shard, as searched
        lo, hi = ss.find(np.array(_decode(k, idx.vocab_size), np.int64))
        empty = hi <= lo
        lo[empty], hi[empty] = 0, 0
        assert np.array_equal(mg.spans[i], np.stack([lo, hi], 1)), _decode(k, idx.vocab_size)


def test_bulk_features_equal_with_and_without(merged_index):
    """Bulk features read the summed histograms where they hold a context, and give what the
    shards' own give; an index opened on some shards does not use them."""
    path, docs = merged_index
    rng = np.random.default_rng(2)
    held = [docs[4], docs[7][:20], rng.choice(docs[9], 60), docs[0][:1]]
    ids, starts = np.concatenate(held), np.cumsum([0] + [len(x) for x in held])
    idx = Index(path)
    at = np.arange(len(ids))
    assert (idx.merged.runs(ids, at, np.minimum(at - np.repeat(starts[:-1], np.diff(starts)) + 1, 2))[:, 0] >= 0).sum() > 20
    fields = ("length", "count", "target_cnt", "topk_ids", "topk_cnt", "cont")
    f = continuations(idx, ids, starts, (0, 1, 2, 3, 6), top_k=3)
    plain = Index(path)
    plain.__dict__["merged"] = None
    g = continuations(plain, ids, starts, (0, 1, 2, 3, 6), top_k=3)
    for c in f:
        for n in fields:
            assert np.array_equal(getattr(f[c], n), getattr(g[c], n)), (c, n)
    S = len(idx.shards)
    assert Index(path, shards=list(range(S))).merged is not None
    assert Index(path, shards=list(range(S - 1))).merged is None


def test_a_rebuild_stopped_while_writing_leaves_them_unused(tmp_path, tokenizer_model, monkeypatch):
    """A build stopped between the summed histograms' files leaves an index that answers the
    same without them; the next build writes them."""
    from teragram.builder import build as build_mod
    from teragram.index import format as fmt

    rng = np.random.default_rng(4)
    docs = random_docs(rng, 60, 4, 30, 1000)
    out = tmp_path / "idx"
    monkeypatch.setattr(contexts, "MIN_COUNT", MIN)
    build_from_ids(docs, out, tokenizer_model, shard_tokens=500)
    ids, starts = np.concatenate(docs[:5]), np.cumsum([0] + [len(x) for x in docs[:5]])
    want = continuations(Index(out), ids, starts, (0, 2), top_k=2)
    assert Index(out).merged is not None
    monkeypatch.setattr(contexts, "MIN_COUNT", MIN + 1)  # another threshold: rebuilt by the next run
    write = fmt.write_array

    def stopped(path, kind, arr):
        if kind == "contexts.ends":
            raise KeyboardInterrupt
        write(path, kind, arr)

    monkeypatch.setattr(fmt, "write_array", stopped)
    manifest = fmt.read_manifest(out)
    with pytest.raises(KeyboardInterrupt):
        build_mod._merged_contexts(out, manifest)
    assert Index(out).merged is None  # the manifest's record, the files not all there
    got = continuations(Index(out), ids, starts, (0, 2), top_k=2)
    for c in want:
        assert np.array_equal(want[c].topk_cnt, got[c].topk_cnt) and np.array_equal(want[c].target_cnt, got[c].target_cnt)
    monkeypatch.setattr(fmt, "write_array", write)
    rec = build_mod._merged_contexts(out, manifest)
    assert rec["min_count"] == MIN + 1
