"""Indexes composed of parts answer exactly as one index built over all their documents."""

from __future__ import annotations

import numpy as np
import pytest
from teragram.builder.build import build_from_ids
from teragram.index.engine import Index
from teragram.index.meta import MetaStore
from teragram.index.verify import verify

from benchmarks import index_size_data
from tests.conftest import random_docs


def test_composed_index_equals_one_build(tmp_path, tokenizer_model):
    rng = np.random.default_rng(7)
    docs = random_docs(rng, 120, alphabet=6, max_len=60, vocab=1000)
    whole = tmp_path / "whole"
    build_from_ids(docs, whole, tokenizer_model, shard_tokens=1500)
    parts = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for p, chunk in zip(parts, (docs[:30], docs[30:95], docs[95:]), strict=True):
        build_from_ids(chunk, p, tokenizer_model, shard_tokens=1200)
    out = tmp_path / "composed"
    manifest = index_size_data.compose(out, parts)
    assert verify(out) == []
    one, comp = Index(whole), Index(out)
    assert manifest["counts"]["docs"] == one.n_docs == comp.n_docs == len(docs)
    assert comp.n_tokens == one.n_tokens
    mo, mc = one.merged, comp.merged  # the summed histograms, as one build gives them
    assert mo is not None and mc is not None and len(mc.keys) > 0
    assert all(np.array_equal(getattr(mo, k), getattr(mc, k)) for k in ("keys", "ends", "hist"))
    for _ in range(300):
        d = docs[int(rng.integers(len(docs)))]
        i = int(rng.integers(len(d)))
        q = d[i : i + int(rng.integers(1, 8))]
        assert comp.count(q).count == one.count(q).count
    q = np.array([docs[0][0], docs[0][0], docs[0][0]])
    assert comp.count(q).count == one.count(q).count
    ms_one, ms_comp = MetaStore(whole), MetaStore(out)
    for doc_id in (0, 29, 30, 94, 95, len(docs) - 1):
        assert ms_comp.doc(doc_id)["length"] == ms_one.doc(doc_id)["length"]
    # composing again replaces the composed index and leaves its parts intact
    index_size_data.compose(out, parts)
    assert verify(out) == [] and all(verify(p) == [] for p in parts)


def test_compose_refuses_parts_with_different_tokenizers(tmp_path, tokenizer_model):
    a, b = tmp_path / "a", tmp_path / "b"
    build_from_ids([np.array([5, 6, 7])], a, tokenizer_model)
    build_from_ids([np.array([5, 6, 7])], b, tokenizer_model)
    (b / "tokenizer.model").write_bytes((b / "tokenizer.model").read_bytes() + b"\0")
    with pytest.raises(SystemExit, match="different tokenizers"):
        index_size_data.compose(tmp_path / "c", [a, b])


def test_overlap_finds_indexed_documents_and_not_new_ones(tmp_path, real_index):
    import json

    import zstandard

    from tests.conftest import real_texts

    indexed = real_texts()[3][1][:3000]
    novel = " ".join(f"zq{i * 7919 % 1000}x" for i in range(600))
    d = tmp_path / "heldout" / "s"
    d.mkdir(parents=True)
    for half, text in (("valid", indexed), ("test", novel)):
        with zstandard.open(d / f"{half}.jsonl.zst", "wt") as f:
            f.write(json.dumps({"text": text, "path": half, "corpus": "c"}) + "\n")
    res = index_size_data.overlap(real_index, tmp_path)
    assert res["s/valid"]["mean_share"] == 1.0 and res["s/valid"]["docs_ge_80pct"] == 1
    assert res["s/test"]["mean_share"] < 0.05 and res["s/test"]["docs_ge_80pct"] == 0
