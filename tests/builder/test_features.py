"""Bulk features against brute force, against the live score, and for leakage."""

import numpy as np
import pytest
from teragram.builder.build import build_from_ids
from teragram.builder.features import compute_features, shard_features
from teragram.index.engine import Index
from teragram.index.features import FeatureConfig, open_features

from tests.conftest import random_docs
from tests.oracle import Oracle


def _allowed(mode, g, t):
    if mode == "causal":
        return lambda dd, p, L: dd < g or (dd == g and p < t - L + 1)
    return lambda dd, p, L: dd != g


def _check_against_oracle(idx, orc, mode, max_len, k, sample=None):
    """Compare every position (or `sample` random ones) with brute force."""
    cfg = FeatureConfig(mode=mode, max_len=max_len, top_k=k)
    feats = [shard_features(idx, sh, cfg)[0] for sh in range(len(idx.shards))]
    where = []  # (global doc, shard, row of its first token)
    for sh, s in enumerate(idx.shards):
        st = np.asarray(s.starts)
        where += [(sh, int(st[d]), int(st[d + 1]) - 1) for d in range(len(st) - 1)]
    todo = [(g, t) for g, (_, a, b) in enumerate(where) for t in range(b - a)]
    if sample is not None:
        rng = np.random.default_rng(0)
        todo = [todo[i] for i in rng.choice(len(todo), size=min(sample, len(todo)), replace=False)]
    for g, t in todo:
        sh, a, b = where[g]
        f = feats[sh]
        L, cont, cnt, top = orc.feature_at(orc.docs[g], t, max_len, k, allowed=_allowed(mode, g, t))
        assert (f.length[a + t], f.cont[a + t]) == (L, cont), (mode, sh, g, t)
        if k:
            got = [(int(x), int(y)) for x, y in zip(f.topk_ids[a + t], f.topk_cnt[a + t]) if x >= 0]
            assert (f.count[a + t], got) == (cnt, top), (mode, sh, g, t)
    for sh, _, b in where:
        assert feats[sh].length[b] == 0 and feats[sh].cont[b] == -1 and feats[sh].count[b] == 0


@pytest.mark.parametrize("mode", ["causal", "exclude-doc"])
@pytest.mark.parametrize("shard_tokens", [100000, 700])
def test_random_text_against_brute_force(tmp_path, tokenizer_model, mode, shard_tokens):
    rng = np.random.default_rng(shard_tokens)
    docs = random_docs(rng, 70, 4, 50, 1000)
    docs += [docs[3].copy(), docs[7][:20].copy()]  # duplicates: long matches
    build_from_ids(docs, tmp_path / "i", tokenizer_model, shard_tokens=shard_tokens)
    idx = Index(tmp_path / "i")
    orc = Oracle(docs, idx.eos_id)
    for max_len, k in ((64, 3), (5, 2), (64, 0)):
        _check_against_oracle(idx, orc, mode, max_len, k)


@pytest.mark.parametrize("mode", ["causal", "exclude-doc"])
def test_large_intervals_against_brute_force(tmp_path, tokenizer_model, mode):
    """Suffix-array intervals of up to ~300k entries (a 2-letter alphabet, ~600k tokens, short
    matches) go through every level of the block structures; positions are sampled."""
    rng = np.random.default_rng(1)
    docs = random_docs(rng, 200, 2, 6000, 1000)
    build_from_ids(docs, tmp_path / "i", tokenizer_model)
    idx = Index(tmp_path / "i")
    assert idx.n_tokens > 500_000
    orc = Oracle(docs, idx.eos_id)
    for max_len, k in ((1, 2), (3, 2), (12, 0)):
        _check_against_oracle(idx, orc, mode, max_len, k, sample=12)


@pytest.mark.parametrize("mode", ["causal", "exclude-doc"])
def test_real_text_against_brute_force(real_index, mode):
    idx = Index(real_index)
    docs = []
    for s in idx.shards:
        tok, st = np.asarray(s.tok), np.asarray(s.starts)
        docs += [tok[st[k] : st[k + 1] - 1].astype(np.int64) for k in range(len(st) - 1)]
    _check_against_oracle(idx, Oracle(docs, idx.eos_id), mode, 64, 4, sample=120)


def test_held_out_bulk_equals_live_score(real_index, tmp_path, corpus_dir):
    held = tmp_path / "held"
    held.mkdir()
    texts = sorted(p.read_text() for p in corpus_dir.iterdir() if not p.name.startswith("zz_"))
    (held / "a.txt").write_text(texts[0][:3000].replace("the", "teh"))  # near-duplicate of indexed text
    (held / "b.txt").write_text("Completely new text about quantum gardening, unlike the corpus.")
    compute_features(real_index, tmp_path / "f", FeatureConfig(max_len=64, top_k=4), corpus=[str(held)], progress=False)
    idx = Index(real_index)
    fa = open_features(tmp_path / "f" / "000000", 4)
    from teragram.index import format as fmt

    tok = fmt.open_array(tmp_path / "f" / "000000" / "tokens.bin", "tokens")
    starts = fmt.open_array(tmp_path / "f" / "000000" / "docs.bin", "docs")
    for d in range(len(starts) - 1):
        a, b = int(starts[d]), int(starts[d + 1]) - 1
        r = idx.score(np.asarray(tok[a:b]), top_k=4, max_len=64)

        def none(x):  # the separator value stored for "none" -> -1, as score returns it
            x = np.asarray(x).astype(np.int64)
            return np.where(x == idx.sep, -1, x)

        assert np.array_equal(fa.length[a:b], r.length)
        assert np.array_equal(none(fa.cont[a:b]), r.cont)
        assert np.array_equal(fa.count[a:b], r.count)
        assert np.array_equal(none(fa.topk_ids[a:b]), r.topk_ids)
        assert np.array_equal(fa.topk_cnt[a:b], r.topk_cnt)
    assert fa.length[: int(starts[1]) - 1].mean() > 3  # the near-duplicate matches long stretches


def test_causal_features_do_not_depend_on_later_text(tmp_path, tokenizer_model):
    rng = np.random.default_rng(4)
    docs = random_docs(rng, 60, 5, 80, 1000)
    docs[30:] = [d.copy() for d in docs[3:33]]  # later documents repeat earlier ones
    changed = [d.copy() for d in docs]
    cut_doc = next(i for i in range(20, 30) if len(docs[i]) > 40)
    cut = 25
    changed[cut_doc][cut:] = rng.integers(3, 1000, size=len(changed[cut_doc]) - cut)
    for d in changed[cut_doc + 1 :]:
        d[:] = rng.integers(3, 1000, size=len(d))
    for name, ds in (("a", docs), ("b", changed)):
        build_from_ids(ds, tmp_path / name, tokenizer_model, shard_tokens=1500)
    fa = [shard_features(Index(tmp_path / "a"), s, FeatureConfig("causal", 64, 4))[0] for s in range(len(Index(tmp_path / "a").shards))]
    fb = [shard_features(Index(tmp_path / "b"), s, FeatureConfig("causal", 64, 4))[0] for s in range(len(Index(tmp_path / "b").shards))]
    cat = lambda fs, name: np.concatenate([np.asarray(getattr(f, name)) for f in fs])  # noqa: E731
    limit = sum(len(d) + 1 for d in docs[:cut_doc]) + cut  # positions before the first changed token
    for name in ("length", "cont", "count", "topk_ids", "topk_cnt"):
        a, b = cat(fa, name), cat(fb, name)
        assert np.array_equal(a[:limit], b[:limit]), name
        assert not np.array_equal(a, b)  # later features do change: the test can fail
    # exclude-doc is not causal: earlier positions see the later documents
    ea = shard_features(Index(tmp_path / "a"), 0, FeatureConfig("exclude-doc", 64, 4))[0]
    eb = shard_features(Index(tmp_path / "b"), 0, FeatureConfig("exclude-doc", 64, 4))[0]
    assert not np.array_equal(ea.length, eb.length)


def test_cli_and_resume(real_index, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "f"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "teragram.serve.main",
            "features",
            str(real_index),
            "--out",
            str(out),
            "--mode",
            "causal",
            "--workers",
            "2",
            "--quiet",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    first = {p.name: p.read_bytes() for p in out.rglob("*.bin")}
    (out / "000001.done").unlink()
    r = subprocess.run(
        [sys.executable, "-m", "teragram.serve.main", "features", str(real_index), "--out", str(out), "--mode", "causal", "--quiet"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and {p.name: p.read_bytes() for p in out.rglob("*.bin")} == first
    r = subprocess.run(
        [sys.executable, "-m", "teragram.serve.main", "features", str(real_index), "--out", str(out), "--mode", "exclude-doc", "--quiet"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "holds features of another" in r.stderr


def test_exclude_doc_length_cont_files_equal_pairwise(real_index, tmp_path):
    """compute_features writes every shard's exclude-doc length + continuation in one merged
    pass; the files hold what the merge-join per pair of shards gives, and resume keeps them."""
    cfg = FeatureConfig(mode="exclude-doc", max_len=64, top_k=0)
    rep = compute_features(real_index, tmp_path / "f", cfg, progress=False)
    idx = Index(real_index)
    assert len(idx.shards) > 1 and [r["merged_shards"] for r in rep["shards"]] == [list(range(len(idx.shards)))]
    for sh in range(len(idx.shards)):
        got = open_features(tmp_path / "f" / f"{sh:06d}", 0)
        want = shard_features(idx, sh, cfg, pairwise=True)[0]
        assert np.array_equal(got.length, want.length)
        assert np.array_equal(np.where(got.cont == idx.sep, -1, got.cont.astype(np.int64)), want.cont)
    (tmp_path / "f" / "000001.done").unlink()
    rep = compute_features(real_index, tmp_path / "f", cfg, progress=False)
    assert [r["merged_shards"] for r in rep["shards"]] == [[1]]


def test_an_index_too_large_for_the_merge_takes_the_pairwise_path(real_index, tmp_path, monkeypatch):
    """When the whole index's arrays of the merged path would leave no room for its chunks in
    the memory available, the features go pair by pair, with the same length + continuation."""
    from teragram.builder import features as bf

    cfg = FeatureConfig(mode="exclude-doc", max_len=64, top_k=0)
    monkeypatch.setattr(bf, "MERGED_MEMORY_SHARE", 1e-9)
    rep = compute_features(real_index, tmp_path / "f", cfg, progress=False)
    assert all("merged_shards" not in r for r in rep["shards"])
    monkeypatch.undo()
    idx = Index(real_index)
    merged = bf.merged_exclude_doc_features(idx, cfg)
    for sh in range(len(idx.shards)):
        got = open_features(tmp_path / "f" / f"{sh:06d}", 0)
        assert np.array_equal(got.length, merged[sh].length)
        assert np.array_equal(np.where(got.cont == idx.sep, -1, got.cont.astype(np.int64)), merged[sh].cont)
