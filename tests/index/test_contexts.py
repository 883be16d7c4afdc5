"""The stored next-token histograms of frequent contexts (index/contexts.py): complete and
exact against brute force, used by every path that enumerates continuations, and added to an
index built before them by running its build again."""

from collections import Counter, defaultdict

import numpy as np
import pytest
from teragram.builder.build import build_from_ids
from teragram.index import contexts, merged
from teragram.index import format as fmt
from teragram.index.bulk import continuations
from teragram.index.engine import Index

from tests.conftest import random_docs
from tests.oracle import Oracle

MIN = 3


@pytest.fixture(scope="module")
def small_table_index(tmp_path_factory, tokenizer_model):
    """Repetitive documents (a small alphabet, repeated runs, one long copy) in several shards,
    with every branching context of >= MIN occurrences in a shard stored."""
    rng = np.random.default_rng(5)
    docs = random_docs(rng, 90, 4, 40, 1000)
    docs += [np.concatenate([docs[3], docs[3], docs[5]]), docs[8][:25].copy(), docs[8][:25].copy(), docs[8][:25].copy()]
    out = tmp_path_factory.mktemp("ctx") / "idx"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(contexts, "MIN_COUNT", MIN)
        build_from_ids(docs, out, tokenizer_model, shard_tokens=700)
    idx = Index(out)
    assert len(idx.shards) >= 3
    return out, docs


def _shard_docs(s) -> list[np.ndarray]:
    tok, st = np.asarray(s.tok).astype(np.int64), np.asarray(s.starts).astype(np.int64)
    return [tok[st[k] : st[k + 1] - 1] for k in range(len(st) - 1)]


def test_table_is_every_frequent_branching_context_exactly(small_table_index):
    """Per shard: the contexts (any length, no separator) with >= MIN occurrences and at least
    two distinct continuations (a document's end is one) are exactly the stored ones, each with
    its brute-force histogram; the rest are not stored, and the lookup says so."""
    path, _ = small_table_index
    idx = Index(path)
    stored_total = 0
    for s in idx.shards:
        docs = _shard_docs(s)
        follow: dict[tuple, Counter] = defaultdict(Counter)
        for d in docs:
            for i in range(len(d)):
                for j in range(i + 1, len(d) + 1):
                    follow[tuple(d[i:j].tolist())][int(d[j]) if j < len(d) else idx.sep] += 1
        want = {q: c for q, c in follow.items() if sum(c.values()) >= MIN and len(c) >= 2}
        table = s.contexts
        assert table is not None and len(table.nodes) == len(want)
        stored_total += len(want)
        sub = Index(path)  # the same shard without its table: the intervals by search
        for q, c in follow.items():
            lo, hi = sub._find(np.array(q, np.int64))
            a, b = int(lo[s.id]), int(hi[s.id])
            got = table.find(a, b, len(q))
            if q in want:
                assert got is not None, q
                assert dict(zip(got[0].tolist(), got[1].tolist())) == dict(c), q
            else:
                assert got is None, q
        nodes = np.asarray(table.nodes)
        assert np.all(np.diff(nodes[:, 0] * (1 << 32) + nodes[:, 1]) > 0)  # sorted by (lo, hi), as lookups search it
        assert (
            table.min_count == fmt.read_json(s.marker)["context_min_count"] == MIN <= (nodes[:, 1] - nodes[:, 0]).min()
        )  # recorded, not read off
        with pytest.MonkeyPatch.context() as mp:  # the build streamed through buffers of 3 rows: the same table
            mp.setattr(contexts, "MIN_COUNT", MIN)
            small = contexts.build(np.asarray(s.tok), s.sa.words, s.sa.width, s.sa.count, rows=3)
        assert np.array_equal(small[0], nodes) and np.array_equal(small[1], table.hist)
    assert stored_total > 50


def test_lookups_and_bulk_equal_with_and_without_the_table(small_table_index, monkeypatch):
    """Next-token distributions and bulk features (summaries of frequent contexts and the bulk
    kernel) give the same answers read from the table as enumerated, and the oracle's."""
    from teragram.index.shard import Shard

    path, docs = small_table_index
    orc = Oracle(docs, Index(path).eos_id)
    rng = np.random.default_rng(3)
    queries = [docs[rng.integers(len(docs))][:k].tolist() for k in (1, 1, 2, 2, 3, 5)] + [[int(docs[0][0])]]
    held = [docs[3][:30], docs[-1], rng.integers(3, 9, size=40)]
    starts = np.cumsum([0] + [len(x) for x in held])

    def answers():
        idx = Index(path)
        ntd = [{t: c for t, (c, _) in idx.ntd(q).result_by_token_id.items()} for q in queries]
        f = continuations(idx, np.concatenate(held), starts, (0, 1, 2, 4), top_k=3)
        return ntd, {c: (f[c].count, f[c].target_cnt, f[c].topk_ids, f[c].topk_cnt, f[c].cont) for c in f}

    with_table = answers()
    for q, got in zip(queries, with_table[0], strict=True):
        assert got == orc.next_tokens(q), q
    monkeypatch.setattr(Shard, "contexts", None)
    without = answers()
    assert with_table[0] == without[0]
    for c in with_table[1]:
        for x, y in zip(with_table[1][c], without[1][c], strict=True):
            assert np.array_equal(x, y), c


def test_rebuild_adds_the_table_to_an_older_index(tmp_path, corpus_dir, tokenizer_model, monkeypatch):
    """An index built before the table existed gets it, recorded in each shard's marker, when
    its build is run again, and so does one whose table was stored at another threshold; the
    answers do not change and `verify` passes."""
    from teragram.builder.build import build
    from teragram.builder.build_state import BuildConfig, completed_shards
    from teragram.index.verify import verify

    out = tmp_path / "idx"
    cfg = BuildConfig(
        inputs=(str(corpus_dir),), out=str(out), tokenizer=str(tokenizer_model), workers=1, shard_tokens=30000, progress=False
    )
    monkeypatch.setattr(contexts, "MIN_COUNT", 50)
    build(cfg)
    markers = sorted(out.glob("shards/*.done"))
    assert len(markers) >= 2
    for m in markers:  # as built before: no table, none recorded
        rec = fmt.read_json(m)
        d = fmt.shard_dir(out, rec["shard"], rec.get("dir"))
        (d / contexts.NODES_FILE).unlink()
        (d / contexts.HIST_FILE).unlink()
        rec["files"] = [f for f in rec["files"] if "contexts" not in f["path"]]
        fmt.write_json(m, rec)
    q = Index(out).tokenizer.encode(" the")[-1:]
    assert all(s.contexts is None for s in Index(out).shards)
    before = Index(out).ntd(q).result_by_token_id
    keys = out / merged.KEYS_FILE  # the shards' summed histograms (index/merged.py): kept by a rerun
    assert fmt.read_json(out / "manifest.json")["contexts"]["min_count"] == 50
    built_at = keys.stat().st_mtime_ns
    build(cfg)
    assert keys.stat().st_mtime_ns == built_at and Index(out).merged is not None
    idx = Index(out)
    assert all(s.contexts is not None and len(s.contexts.nodes) for s in idx.shards)
    assert all(any("contexts.nodes" in f["path"] for f in fmt.read_json(m)["files"]) for m in markers)
    assert idx.ntd(q).result_by_token_id == before
    assert verify(out) == []
    # a table stored at another threshold than contexts.min_count's is written again at it; a
    # run stopped while it writes one leaves every shard complete, and the next run finishes
    monkeypatch.setattr(contexts, "MIN_COUNT", 20)
    write = contexts.write

    def stopped(d, *a):  # stopped between the two files: a new nodes file, the old histograms
        (d / contexts.NODES_FILE).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(contexts, "write", stopped)
    with pytest.raises(KeyboardInterrupt):
        build(cfg)
    assert len(completed_shards(out)) == len(markers)  # nothing to index again
    assert Index(out).ntd(q).result_by_token_id == before
    monkeypatch.setattr(contexts, "write", write)
    build(cfg)
    idx = Index(out)
    assert all(fmt.read_json(m)["context_min_count"] == 20 for m in markers)
    assert all(s.contexts.min_count >= 20 and len(s.contexts.nodes) for s in idx.shards)
    assert min(s.contexts.min_count for s in idx.shards) < 50
    assert idx.ntd(q).result_by_token_id == before
    assert fmt.read_json(out / "manifest.json")["contexts"]["min_count"] == 20 and idx.merged is not None  # rebuilt at it
    assert verify(out) == []
