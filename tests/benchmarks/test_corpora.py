"""The corpus exports of the index-size data: evaluation-only corpora refused, buckets nest."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import zstandard

from benchmarks import corpora


def _fake_corpus(monkeypatch, tmp_path, n: int = 400):
    docs = [(f"pkg-1.0/src/file{i}.c", f"int f{i}(void) {{ return {i}; }}\n") for i in range(n)]
    root = tmp_path / "root"
    (root / "usr/share/doc/fake-src").mkdir(parents=True)
    (root / "usr/share/doc/fake-src/copyright").write_text("License: MIT\n")
    monkeypatch.setattr(corpora, "documents", lambda name: iter(docs))
    monkeypatch.setattr(corpora, "fetch", lambda name: root)
    return docs


def _records(path):
    with zstandard.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("split", ["train", None])
def test_export_refuses_eval_only_corpus_outside_heldout(tmp_path, split):
    with pytest.raises(corpora.EvalOnlyError, match="evaluation-only"):
        corpora.export(["linux-source-6.12-new"], tmp_path / "x.jsonl", split=split)
    assert not (tmp_path / "x.jsonl").exists()
    with pytest.raises(corpora.EvalOnlyError):
        corpora.export_buckets("python3.11-doc", tmp_path)


def test_eval_only_documents_are_all_heldout():
    paths = [f"linux-source-6.12/drivers/x{i}.c" for i in range(400)]
    assert {corpora.corpus_split("linux-source-6.12-new", p) for p in paths} == {"heldout"}
    assert {corpora.corpus_split("linux-source-6.1", p) for p in paths} == {"train", "heldout"}


def test_export_buckets_partitions_train_documents_by_path_hash(monkeypatch, tmp_path):
    docs = _fake_corpus(monkeypatch, tmp_path)
    excluded = docs[3][0]
    m = corpora.export_buckets("fake-src", tmp_path / "out", exclude=frozenset({excluded}), buckets=8)
    d = tmp_path / "out" / "fake-src"
    seen = {}
    for k in range(8):
        for r in _records(d / f"b{k:02d}.jsonl.zst"):
            assert corpora.sample_bucket(r["path"], 8) == k
            assert r["corpus"] == "fake-src"
            seen[r["path"]] = r["text"]
    want = {p: t for p, t in docs if corpora.split_of(p) == "train" and p != excluded}
    assert seen == want
    assert sum(m["docs"]) == len(want)
    assert m["skipped"]["heldout"] == sum(corpora.split_of(p) == "heldout" for p, _ in docs) > 0
    assert m["skipped"]["excluded"] == (corpora.split_of(excluded) == "train")
    assert (d / "copyright").read_text() == "License: MIT\n"
    # a finished export is not redone
    assert corpora.export_buckets("fake-src", tmp_path / "out", buckets=8) == m


def test_tar_files_skips_binary_invalid_large_and_unwanted(tmp_path):
    members = {
        "top/a.c": b"int a;\n",
        "top/b.c": b"\x00\x01binary",
        "top/c.c": b"\xff\xfe not utf-8",
        "top/d.c": b"x" * (corpora._MAX_DOC + 1),
        "top/e.bin": b"text but unwanted",
        "top/f.h": b"   \n",
        "top/g.h": b"#define G 1\n",
    }
    tb = tmp_path / "t.tar.gz"
    with tarfile.open(tb, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    got = list(corpora._tar_files(tb, corpora._is_source))
    assert got == [("top/a.c", "int a;\n"), ("top/g.h", "#define G 1\n")]
