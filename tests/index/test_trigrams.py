"""The shards' 3-token filters (index/trigrams.py): every string a shard holds passes its filter,
nearly every string it lacks does not, and bulk answers are the same without them."""

import numpy as np
import pytest
from teragram.builder.build import build_from_ids
from teragram.index import trigrams
from teragram.index.bulk import continuations
from teragram.index.engine import Index

from tests.conftest import random_docs


@pytest.fixture(scope="module")
def index(tmp_path_factory, tokenizer_model):
    rng = np.random.default_rng(5)
    docs = random_docs(rng, 120, 30, 40, 1000)  # 27,000 strings of 3 tokens, each shard holding < 900
    out = tmp_path_factory.mktemp("trigrams") / "idx"
    build_from_ids(docs, out, tokenizer_model, shard_tokens=900)
    idx = Index(out)
    assert len(idx.shards) >= 3 and idx.trigrams is not None
    return idx, docs


def _windows(tok: np.ndarray, sep: int) -> set[tuple[int, int, int]]:
    return {w for w in zip(tok[:-2].tolist(), tok[1:-1].tolist(), tok[2:].tolist()) if sep not in w}


def test_a_shard_lets_through_what_it_holds_and_little_else(index):
    idx, docs = index
    grams = idx.trigrams
    assert grams.shape == (len(idx.shards), trigrams.words(max(s.n for s in idx.shards)))
    alphabet = np.unique(np.concatenate(docs))
    rng = np.random.default_rng(0)
    others = {tuple(x) for x in rng.choice(alphabet, (3000, 3)).tolist()}
    for s, shard in enumerate(idx.shards):
        held = _windows(np.asarray(shard.tok), idx.sep)
        assert held and all(trigrams.holds(grams, np.array(w))[s] for w in held)
        absent = others - held
        passed = sum(bool(trigrams.holds(grams, np.array(w))[s]) for w in absent)
        assert len(absent) > 1000 and passed < 0.05 * len(absent), (s, passed, len(absent))


def test_bulk_answers_are_the_same_without_them(index):
    """The filters only skip searches that would find nothing; and they do skip some here."""
    idx, docs = index
    rng = np.random.default_rng(1)
    alphabet = np.unique(np.concatenate(docs))
    text = [np.concatenate([docs[k][5:30], alphabet[rng.integers(0, len(alphabet), 30)], docs[k + 1][:25]]) for k in range(8)]
    ids, starts = np.concatenate(text).astype(np.int64), np.cumsum([0] + [len(t) for t in text])
    grams = idx.trigrams
    assert sum(int((~trigrams.holds(grams, ids[j : j + 3])).sum()) for j in range(len(ids) - 2)) > 50
    caps = (0, 1, 2, 4, 8)
    got = continuations(idx, ids, starts, caps, top_k=3)
    plain = Index(idx.path)
    plain.__dict__["trigrams"] = None
    want = continuations(plain, ids, starts, caps, top_k=3)
    for c in caps:
        for name in ("length", "count", "target_cnt", "topk_ids", "topk_cnt", "cont"):
            assert np.array_equal(getattr(got[c], name), getattr(want[c], name)), (c, name)


def test_kept_by_a_rebuild_made_by_one_that_lacks_them(index, tmp_path, tokenizer_model):
    """Recorded in the manifest apart from the summed contexts (so a reader that predates them
    still reads those), checked by verify, and made by a build run again where they are missing;
    an index opened on some of its shards has none."""
    from teragram.index import format as fmt
    from teragram.index.verify import verify

    idx, docs = index
    assert idx.manifest["trigrams"]["words"] == idx.trigrams.shape[1]
    assert "trigrams.bin" not in {f["path"] for f in idx.manifest["contexts"]["files"]}
    assert verify(idx.path) == []
    assert Index(idx.path, shards=[0, 1]).trigrams is None
    out = tmp_path / "idx"
    build_from_ids(docs[:40], out, tokenizer_model, shard_tokens=300)
    want = np.asarray(Index(out).trigrams).copy()
    m = fmt.read_manifest(out)
    (out / trigrams.FILE).unlink()
    assert Index(out).trigrams is None
    from teragram.builder.build import _trigrams

    assert _trigrams(out, m)["words"] == want.shape[1] and np.array_equal(
        Index(out, manifest=m | {"trigrams": _trigrams(out, m)}).trigrams, want
    )
