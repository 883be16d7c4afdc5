"""The corpus exports of the index-size data: evaluation-only corpora refused, buckets nest."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import zstandard

from tools import corpora
from tools.debian import archive, documents


def _fake_corpus(monkeypatch, tmp_path, n: int = 400):
    docs = [(f"pkg-1.0/src/file{i}.c", f"int f{i}(void) {{ return {i}; }}\n") for i in range(n)]
    root = tmp_path / "root"
    (root / "usr/share/doc/fake-src").mkdir(parents=True)
    (root / "usr/share/doc/fake-src/copyright").write_text("License: MIT\n")
    monkeypatch.setattr(corpora, "documents", lambda name: iter(docs))
    monkeypatch.setattr(archive, "fetch", lambda name: root)  # the copyright file's package
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
        "top/d.c": b"x" * (documents.MAX_DOC + 1),
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
    got = list(documents.tar_files(tb, documents.is_source))
    assert got == [("top/a.c", "int a;\n"), ("top/g.h", "#define G 1\n")]


def test_markup_text_keeps_prose_only():
    html = (
        "<html><head><title>T</title><script>var x = 1;</script></head><body><header>Menu</header>"
        "<h1>Find Bar</h1><p>The <span>Find</span> toolbar &amp; its\n  options.</p>"
        '<span hidden="true"><span>Command</span></span><span>Ctrl</span><img src="a.svg" alt="icon">'
        "<aside>Contents</aside><p>Last<br>line</p></body></html>"
    )
    assert documents._markup_text(html) == "Find Bar\n\nThe Find toolbar & its options.\n\nCtrl\n\nLast\n\nline"
    page = (
        '<page xmlns="http://projectmallard.org/1.0/" id="x"><info><link type="guide" xref="a11y"/>'
        "<credit><name>Shaun</name></credit><desc>Short.</desc></info><title>Turn on slow keys</title>"
        "<steps><item><p>Open the <gui>Activities</gui> overview.</p></item></steps></page>"
    )
    assert documents._markup_text(page) == "Turn on slow keys\n\nOpen the Activities overview."


def test_wordnet_documents_group_synsets_by_lexicographer_file(tmp_path):
    d = tmp_path / "usr/share/wordnet"
    d.mkdir(parents=True)
    header = "  1 This software and database is being provided to you, the LICENSEE, by\n"
    lines = {
        "noun": [
            '00021265 13 n 02 food 0 solid_food 0 001 @ 00021939 n 0000 | any solid substance; "food and drink"  ',
            "00000001 03 n 01 entity 0 000 | that which is perceived  ",
        ],
        "verb": ["00001740 29 v 02 breathe 0 take_a_breath 0 000 01 + 02 00 | draw air into the lungs  "],
        "adj": ["00001740 00 a 01 able(a) 0 000 | having the necessary means  "],
        "adv": [],
    }
    for pos, ls in lines.items():
        (d / f"data.{pos}").write_text(header + "".join(x + "\n" for x in ls))
    docs = dict(documents._wordnet_documents(tmp_path))
    assert docs == {
        "wordnet/noun/03#0": "entity: that which is perceived\n",
        "wordnet/noun/13#0": 'food, solid food: any solid substance; "food and drink"\n',
        "wordnet/verb/29#0": "breathe, take a breath: draw air into the lungs\n",
        "wordnet/adj/00#0": "able: having the necessary means\n",
    }


def test_everyday_documents_skip_stubs_and_comments(tmp_path):
    root = tmp_path / "crawl"
    (root / "usr/share/crawl/dat/descript").mkdir(parents=True)
    (root / "usr/share/crawl/dat/database").mkdir(parents=True)
    (root / "usr/share/crawl/dat/descript/monsters.txt").write_text("%%%%\n# Uniques\nAgnes\n\nThis spriggan is aged.\n%%%%\n")
    (root / "usr/share/crawl/dat/database/FAQ.txt").write_text("Q: What?\nA: That.\n")
    assert list(documents.everyday_documents("crawl-common", root)) == [
        ("usr/share/crawl/dat/descript/monsters.txt#0", "Agnes\n\nThis spriggan is aged.\n"),
        ("usr/share/crawl/dat/database/FAQ.txt#0", "Q: What?\nA: That.\n"),
    ]
    root = tmp_path / "hb"
    (root / "usr/share/doc/debian-handbook/html/en-US").mkdir(parents=True)
    (root / "usr/share/doc/debian-handbook/html/en-US/index.html").write_text("<p>Next</p>")
    (root / "usr/share/doc/debian-handbook/html/en-US/apt.html").write_text("<p>" + "APT installs packages. " * 20 + "</p>")
    assert [p for p, _ in documents.everyday_documents("debian-handbook", root)] == ["usr/share/doc/debian-handbook/html/en-US/apt.html"]


def test_versions_of_the_packages_a_corpus_is_unpacked_from(monkeypatch, tmp_path):
    monkeypatch.setenv("TERAGRAM_CACHE", str(tmp_path))
    (tmp_path / "debs").mkdir()
    for deb in (
        "fortunes_1%3a1.99.1-7.3_all.deb",
        "bible-kjv-text_4.38_all.deb",
        "bible-kjv_4.38_amd64.deb",
        "linux-source-6.12_6.12.95-1~bpo12+1_all.deb",
    ):
        (tmp_path / "debs" / deb).touch()
    got = corpora.versions(["fortunes", "bible-kjv-text", "linux-source-6.12-new", "linux-source-6.1"])
    # the epoch unquoted, a package's dependency's too, and no 6.12 .deb taken for linux-source-6.1
    assert got == {"fortunes": "1:1.99.1-7.3", "bible-kjv-text": "4.38", "bible-kjv": "4.38", "linux-source-6.12": "6.12.95-1~bpo12+1"}


def test_rerun_against_other_package_versions_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TERAGRAM_CACHE", str(tmp_path / "cache"))
    _fake_corpus(monkeypatch, tmp_path, n=40)
    debs = corpora.cache_dir() / "debs"
    debs.mkdir(parents=True)
    (debs / "fake-src_1.0-1_all.deb").touch()
    first = corpora.export_buckets("fake-src", tmp_path / "out", buckets=2)
    assert first["packages"] == {"fake-src": "1.0-1"}
    corpora.export_buckets("fake-src", tmp_path / "out", buckets=2)  # same versions: silent
    assert capsys.readouterr().out == ""
    (debs / "fake-src_1.0-1_all.deb").rename(debs / "fake-src_1.0-2_all.deb")
    again = corpora.export_buckets("fake-src", tmp_path / "out", buckets=2)
    out = capsys.readouterr().out.splitlines()
    assert again == first and len(out) == 1 and "fake-src 1.0-1 -> 1.0-2" in out[0]
    assert corpora.version_mismatch({"fake-src": "1.0-2"}, ["fake-src"]) is None
