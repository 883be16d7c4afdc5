"""The package pool: chosen by name patterns, split whole by package, held-out packages never
exported into train, documents read from real .deb files."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess

import pytest
import zstandard

from benchmarks.lib import heldout_sets
from tools import corpora
from tools import package_pool as pp

needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")


def _stanza(name, *, source=None, arch="all", kb=100, version="1.0-1"):
    src = f"Source: {source}\n" if source else ""
    return f"Package: {name}\n{src}Version: {version}\nArchitecture: {arch}\nInstalled-Size: {kb}\nSize: {kb * 300}\nDescription: x\n continued\n"


def _keys(held: bool, n: int, prefix: str = "proj") -> list[str]:
    return [k for k in (f"{prefix}{i}" for i in range(10_000)) if corpora.heldout_package(k) == held][:n]


def test_select_keeps_patterns_and_leaves_out_named_eval_and_kernel_packages():
    stanzas = [
        _stanza("librust-nom-dev", source="rust-nom"),
        _stanza("librust-nom-3-dev", source="rust-nom-3"),
        _stanza("golang-github-aws-aws-sdk-go-dev"),  # a named corpus
        _stanza("python3.11-doc", source="python3.11"),  # evaluation-only
        _stanza("linux-doc-6.12", source="linux"),  # a newer kernel
        _stanza("linux-headers-doc"),
        _stanza("python3-six"),
        _stanza("python3-numpy", arch="amd64"),  # compiled: not pure source
        _stanza("big-doc", kb=pp.DOC_MAX_INSTALLED_KB + 1),
        _stanza("small-doc", source="small (1.0)"),
        _stanza("r-cran-foo"),
        _stanza("node-acorn-doc"),  # -doc before node-: the first group wins
    ]
    pool = pp.select("\n".join(stanzas))
    names = [p["name"] for p in pool]
    assert names == ["librust-nom-3-dev", "librust-nom-dev", "node-acorn-doc", "python3-six", "small-doc"]
    by = {p["name"]: p for p in pool}
    assert by["node-acorn-doc"]["group"] == "pool-doc" and by["python3-six"]["group"] == "pool-python"
    assert by["small-doc"]["source"] == "small" and by["librust-nom-3-dev"]["split_key"] == by["librust-nom-dev"]["split_key"] == "rust-nom"
    for p in pool:
        assert p["split"] == ("heldout" if corpora.heldout_package(p["split_key"]) else "indexable")


def test_split_key_joins_versioned_copies_of_a_project():
    assert pp.split_key("rust-nom-3") == pp.split_key("rust-nom") == "rust-nom"
    assert pp.split_key("golang-github-foo-bar-v2") == "golang-github-foo-bar"
    assert pp.split_key("rust-winapi-0.2") == "rust-winapi"
    assert pp.split_key("libjson-perl") == "libjson-perl"


def test_package_split_is_whole_packages_at_about_five_percent():
    keys = [f"pkg{i}" for i in range(20_000)]
    share = sum(map(corpora.heldout_package, keys)) / len(keys)
    assert 0.04 < share < 0.06
    assert not any(corpora.heldout_package(n) for n in corpora.NAMED)  # the named corpora keep their own split
    held = _keys(True, 1)[0]
    assert {corpora.corpus_split(held, f"{held}/f{i}.c") for i in range(200)} == {"heldout"}


@pytest.mark.parametrize("split", ["train", None])
def test_export_refuses_heldout_package_like_eval_only(tmp_path, split):
    held = _keys(True, 1)[0]
    with pytest.raises(corpora.EvalOnlyError, match="held-out package"):
        corpora.export([held], tmp_path / "x.jsonl", split=split)
    assert not (tmp_path / "x.jsonl").exists()
    with pytest.raises(corpora.EvalOnlyError, match="held-out package"):
        corpora.export_buckets(held, tmp_path)


def _deb(tmp_path, name: str, files: dict[str, bytes], version: str = "1.0-1") -> None:
    """A real .deb of `files` in the corpus cache, named as apt-get download names it."""
    root = tmp_path / "build" / name
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: t <t@t>\nDescription: t\n")
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    debs = corpora.cache_dir() / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["dpkg-deb", "--build", "-Zgzip", str(root), str(debs / f"{name}_{version.replace(':', '%3a')}_all.deb")],
        check=True,
        capture_output=True,
    )


def _files(name: str, n: int = 30) -> dict[str, bytes]:
    files = {f"usr/share/gocode/src/{name}/f{i}.go": f"package p\n\nfunc F{i}() int {{ return {i} }}\n".encode() for i in range(n)}
    files[f"usr/share/doc/{name}/copyright"] = b"Format: x\n\nFiles: *\nLicense: Expat\n\nFiles: a/*\nLicense: GPL-2+\n text\n"
    files[f"usr/share/doc/{name}/README.md.gz"] = gzip.compress(b"# Read me\n")
    files[f"usr/share/doc/{name}/changelog.Debian.gz"] = gzip.compress(b"pkg (1.0-1) unstable\n")
    files[f"usr/share/man/man1/{name}.1.gz"] = gzip.compress(b".TH X 1\n")
    files[f"usr/share/nodejs/{name}/dist/x.min.js"] = b"var a=1;"
    files[f"usr/share/gocode/src/{name}/blob.go"] = b"\x00\x01binary"
    return files


@needs_dpkg
def test_package_documents_from_a_real_deb(tmp_path, monkeypatch):
    monkeypatch.setenv("TERAGRAM_CACHE", str(tmp_path / "cache"))
    _deb(tmp_path, "golang-foo-dev", _files("golang-foo-dev", n=2))
    pkg = {"name": "golang-foo-dev", "version": "1.0-1"}
    docs = dict(pp.package_documents(pp.deb_path(pkg), "golang-foo-dev"))
    assert sorted(docs) == [
        "",
        "golang-foo-dev/usr/share/doc/golang-foo-dev/README.md.gz",
        "golang-foo-dev/usr/share/gocode/src/golang-foo-dev/f0.go",
        "golang-foo-dev/usr/share/gocode/src/golang-foo-dev/f1.go",
    ]
    assert docs["golang-foo-dev/usr/share/doc/golang-foo-dev/README.md.gz"] == "# Read me\n"
    assert pp.licenses(docs[""]) == ["Expat", "GPL-2+"] == pp.licenses(pp.copyright_text(pkg))
    assert [pp.is_code(p) for p in sorted(docs)[1:]] == [False, True, True]
    assert pp.deb_path({"name": "golang-foo-dev", "version": "2.0-1"}) is None


@needs_dpkg
def test_export_group_buckets_indexable_packages_and_refuses_heldout(tmp_path, monkeypatch):
    monkeypatch.setenv("TERAGRAM_CACHE", str(tmp_path / "cache"))
    keys = _keys(False, 2) + _keys(True, 1)
    pool = []
    for i, key in enumerate(keys):
        name = f"golang-p{i}-dev"
        _deb(tmp_path, name, _files(name), version="1:1.0-1")
        split = "heldout" if corpora.heldout_package(key) else "indexable"
        pool.append({"name": name, "group": "pool-go", "version": "1:1.0-1", "split_key": key, "split": split})
    m = pp.export_group(pool, "pool-go", tmp_path / "out", buckets=4)
    d = tmp_path / "out" / "pool-go"
    seen = {}
    for k in range(4):
        with zstandard.open(d / f"b{k:02d}.jsonl.zst", "rt", encoding="utf-8") as f:
            for r in map(json.loads, f):
                assert corpora.sample_bucket(r["path"], 4) == k and r["corpus"] == "pool-go"
                seen[r["path"]] = r["text"]
    kept = {p for p in seen if p.startswith(("golang-p0-dev/", "golang-p1-dev/"))}
    assert kept == set(seen) and not any(p.startswith("golang-p2-dev/") for p in seen)  # the held-out package is not there
    assert all(corpora.split_of(p) == "train" for p in seen) and m["skipped"]["heldout"] > 0
    assert sum(m["docs"]) == len(seen) and m["packages"] == {"golang-p0-dev": "1:1.0-1", "golang-p1-dev": "1:1.0-1"}
    assert m["licenses"]["golang-p0-dev"] == ["Expat", "GPL-2+"] and (d / "copyright" / "golang-p1-dev").exists()
    # a pool record marked indexable whose key is held out is refused before anything is written
    lying = [p | {"split": "indexable"} for p in pool]
    with pytest.raises(corpora.EvalOnlyError, match="golang-p2-dev"):
        pp.export_group(lying, "pool-go", tmp_path / "out2", buckets=4)
    assert not (tmp_path / "out2").exists()
    # the held-out package's code is what the packages set draws on
    held = list(pp.heldout_code(pool, max_doc=10_000))
    assert held and {r["package"] for r in held} == {"golang-p2-dev"} and all(pp.is_code(r["path"]) for r in held)


def test_package_halves_keep_each_package_in_one_half():
    recs = [{"path": f"pkg{p}/src/f{i}.py", "text": "x = 1\n" * (i + 1), "corpus": "pool-python"} for p in range(100) for i in range(5)]
    halves = heldout_sets.package_halves(recs)
    pk = {h: {r["path"].split("/", 1)[0] for r in v} for h, v in halves.items()}
    assert not pk["valid"] & pk["test"] and len(pk["valid"]) >= 20 and len(pk["test"]) >= 20
    assert sorted(map(id, halves["valid"] + halves["test"])) == sorted(map(id, recs))
    few = recs[:15]  # 3 packages: not enough, split by path
    assert heldout_sets.package_halves(few) == heldout_sets.split_halves(few)
    sample = heldout_sets._sample_capped(recs, budget=300, per_package=20)
    per = {}
    for r in sample:
        per[r["path"].split("/", 1)[0]] = per.get(r["path"].split("/", 1)[0], 0) + len(r["text"])
    assert max(per.values()) <= 20 and 300 <= sum(per.values()) < 320


def test_download_fetches_in_parallel_batches_and_names_what_failed(tmp_path, monkeypatch):
    """Against a fake apt-get on PATH that writes NAME_VERSION_all.deb for each NAME=VERSION and
    fails the whole call if one is unknown: every package lands once, a failed batch is retried
    one by one, and only the unknown one is reported."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(
        f'#!/bin/sh\nshift\necho "$@" >> {tmp_path}/calls\nfor a in "$@"; do case $a in missing=*) exit 100;; esac; done\n'
        'for a in "$@"; do printf x > "${a%%=*}_${a#*=}_all.deb"; done\n'
    )
    (bin_dir / "apt-get").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("TERAGRAM_CACHE", str(tmp_path / "cache"))
    pool = [{"name": f"pkg{i}", "version": "1.0-1", "architecture": "all", "deb_bytes": 1} for i in range(11)]
    pool.insert(5, {"name": "missing", "version": "2", "architecture": "all", "deb_bytes": 1})
    assert pp.download(pool, batch=3, jobs=3) == ["missing"]
    assert all(pp.deb_path(p) is not None for p in pool if p["name"] != "missing")
    assert len(list((tmp_path / "cache" / "debs").iterdir())) == 11
    (tmp_path / "calls").unlink()
    assert pp.download(pool, batch=3, jobs=3) == ["missing"]
    assert (tmp_path / "calls").read_text().split() == ["missing=2", "missing=2"]  # the rest is not asked for again
