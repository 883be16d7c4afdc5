"""Tables derived from several shards (index/merged.py's summed histograms, index/trigrams.py's
filters) are used only while they were built from the shards as they are: a shard rebuilt with
other text of the same length gets them rebuilt by build-index, and an index whose shard was
replaced after its manifest was written is refused in one line."""

import shutil

import numpy as np
import pytest
from teragram.builder.build import BuildConfig, build
from teragram.index import format as fmt
from teragram.index import tokenizer as tok_mod
from teragram.index.bulk import continuations
from teragram.index.engine import Index
from teragram.index.errors import IndexFormatError

from tests.conftest import real_texts

SHARD_TOKENS = 3000


def _same_length_rewrite(text: str, model) -> str:
    """Other text of the same token count: its lines but the first in another order (the first
    order found whose encoding is as long)."""
    lines, n = text.split("\n"), len(model.encode(text))
    for seed in range(50):
        other = "\n".join([lines[0], *np.random.default_rng(seed).permutation(lines[1:]).tolist()])
        if other != text and len(model.encode(other)) == n:
            return other
    raise AssertionError("no reordering of the lines keeps the token count")


def _build(corpus, out, tokenizer_model):
    cfg = BuildConfig(
        inputs=(str(corpus),), out=str(out), tokenizer=str(tokenizer_model), shard_tokens=SHARD_TOKENS, workers=1, progress=False
    )
    return build(cfg)


def _answers(idx: Index, probe: np.ndarray) -> dict:
    got = continuations(idx, probe, np.array([0, len(probe)]), (0, 2, 4), top_k=3)
    return {(c, k): getattr(got[c], k) for c in got for k in ("length", "count", "topk_ids", "topk_cnt")}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, tokenizer_model):
    """The same corpus twice, but for its last document, rewritten to other text of the same
    token count; each built into an index of several shards."""
    root = tmp_path_factory.mktemp("stale")
    texts = [t[:3000] for _, t in real_texts(8)]
    model = tok_mod.load(tokenizer_model)
    old, new = root / "old", root / "new"
    for d, last in ((old, texts[-1]), (new, _same_length_rewrite(texts[-1], model))):
        d.mkdir()
        for i, t in enumerate(texts[:-1]):
            (d / f"{i:02d}.txt").write_text(t)
        (d / "zz.txt").write_text(last)
    _build(old, root / "idx-old", tokenizer_model)
    _build(new, root / "idx-new", tokenizer_model)
    a, b = Index(root / "idx-old"), Index(root / "idx-new")
    assert len(a.shards) >= 3 and a.merged is not None and a.trigrams is not None
    assert [s.n for s in a.shards] == [s.n for s in b.shards]  # the same lengths ...
    assert not np.array_equal(np.asarray(a.shards[-1].tok), np.asarray(b.shards[-1].tok))  # ... other text
    probe = np.concatenate([np.asarray(b.shards[-1].tok[:200]), np.asarray(a.shards[-1].tok[:200])]).astype(np.int64)
    probe = probe[probe != b.sep]
    return root, new, probe


def test_a_rebuilt_shard_gets_its_tables_rebuilt(corpora, tokenizer_model, tmp_path):
    """build-index run again after a shard was rebuilt from other text of the same length: the
    tables equal those of a fresh build of that text, and so do the answers."""
    root, new, probe = corpora
    corpus, idx = shutil.copytree(root / "old", tmp_path / "corpus"), tmp_path / "idx"
    _build(corpus, idx, tokenizer_model)
    shutil.copyfile(new / "zz.txt", corpus / "zz.txt")  # the corpus's last document rewritten
    last = len(fmt.read_manifest(idx)["shards"]) - 1
    fmt.shard_marker(idx, last).unlink()  # its shard built again, by the same command
    report = _build(corpus, idx, tokenizer_model)
    assert report["resumed_from_shard"] == last
    got, want = Index(idx), Index(root / "idx-new")
    assert np.array_equal(np.asarray(got.shards[-1].tok), np.asarray(want.shards[-1].tok))
    assert np.array_equal(got.trigrams, want.trigrams)
    for name in ("keys", "ends", "hist", "spans"):
        assert np.array_equal(getattr(got.merged, name), getattr(want.merged, name)), name
    a, b = _answers(got, probe), _answers(want, probe)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_a_shard_replaced_under_a_manifest_is_refused_in_one_line(corpora, tmp_path):
    root, _, _ = corpora
    idx = shutil.copytree(root / "idx-old", tmp_path / "idx", symlinks=True)
    last = len(fmt.read_manifest(idx)["shards"]) - 1
    shutil.rmtree(fmt.shard_dir(idx, last))
    shutil.copytree(fmt.shard_dir(root / "idx-new", last), fmt.shard_dir(idx, last))
    shutil.copyfile(fmt.shard_marker(root / "idx-new", last), fmt.shard_marker(idx, last))
    with pytest.raises(IndexFormatError, match="rebuilt after") as e:
        Index(idx)
    assert "\n" not in str(e.value)


def test_tables_of_other_shards_are_not_used(corpora, tmp_path):
    """The old index's tables under the new one's manifest (the same count and positions): never
    read; the answers are those of the shards themselves."""
    root, _, probe = corpora
    idx = shutil.copytree(root / "idx-new", tmp_path / "idx")
    old = fmt.read_manifest(root / "idx-old")
    for rec in (old["contexts"], old["trigrams"]):
        for f in rec.get("files", [rec.get("file")]):
            shutil.copyfile(root / "idx-old" / f["path"], idx / f["path"])
    manifest = fmt.read_manifest(idx) | {"contexts": old["contexts"], "trigrams": old["trigrams"]}
    fmt.write_json(idx / "manifest.json", manifest)
    got = Index(idx)
    assert got.merged is None and got.trigrams is None
    plain = Index(root / "idx-new")
    plain.__dict__["merged"] = plain.__dict__["trigrams"] = None
    a, b = _answers(got, probe), _answers(plain, probe)
    assert all(np.array_equal(a[k], b[k]) for k in a)
