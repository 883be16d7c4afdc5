"""Real corpora from Debian packages: fetched with `apt-get download`, unpacked with `dpkg -x`.

    python -m tools.corpora fetch linux-source-6.1 linux-doc-6.1
    python -m tools.corpora export linux-source-6.1 --max-mb 200 --out /tmp/linux.jsonl.zst
    python -m tools.corpora make-default          # regenerates data/default/

Each corpus yields documents, one per source file (a file of the kernel tarball, a man page,
a book of the bible, a fortune file); the few single-file corpora (the Jargon File, GCIDE)
are cut into chunks at entry boundaries so that a train/held-out split by path has
something to split. `split_of(path)` puts a document in train or held-out by a hash of its
path, never by position inside a document. The packages are fetched, unpacked and cached under
$TERAGRAM_CACHE (default ~/.cache/teragram/corpora) by tools/debian/archive.py; the files of the
larger corpora are read as documents by tools/debian/documents.py.

The large corpus (EXTRA_CODE, EXTRA_ENGLISH: > 2B tokens with linux-source-6.1 and ENGLISH),
its held-out sets (EVAL_ONLY corpora: never exported into train) and the nested indexes over it
are made by benchmarks/index_size_data.py, one command per step (see its docstring):

    python -m benchmarks.index_size_data export  --data DATA   # DATA/extra/NAME/bNN.jsonl.zst + copyright
    python -m benchmarks.index_size_data heldout --data DATA   # DATA/heldout/{indist,timeshift,prose,packages}
    python -m benchmarks.index_size_data index   --data DATA --name idx-2b --all

No Linux kernel newer than 6.1 is ever exported into a train split: linux-source-6.12 is read
only as the evaluation-only corpus linux-source-6.12-new. Packages beyond the named corpora (the
package pool of tools/package_pool.py) are split whole by a hash of the package name
(heldout_package): the held-out ones are refused in a train split as the evaluation-only corpora are.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

from tools.debian.archive import cache_dir, copyright_file, fetch, version_mismatch, versions
from tools.debian.documents import EXTRA_SOURCES, chunks, everyday_documents, extra_documents, read_file, tar_files

CODE = ("linux-source-6.1",)
ENGLISH = ("linux-doc-6.1", "dict-gcide", "manpages", "manpages-dev", "jargon-text", "fortunes", "bible-kjv-text")
# The large corpus of the scale and index-size benchmarks, beyond CODE and ENGLISH: one document
# per source (or HTML) file. Licenses, as the packages' Debian copyright files state them (each
# file is copied next to the package's export by export_buckets; mixed trees name the main ones):
#   gcc-12-source, gcc-11-source     GPL-3+ with the GCC runtime library exception; docs GFDL-1.3
#   openjdk-17-source, -doc          GPL-2 with the Classpath exception
#   glibc-source                     LGPL-2.1+ (some files GPL-2+, BSD)
#   binutils-source, gdb-source      GPL-3+ (some files LGPL, GPL-2+)
#   golang-1.19-src                  BSD-3-clause
#   rust-src, rust-doc               MIT or Apache-2.0
#   libboost1.74-dev, 1.81-dev, doc  BSL-1.0
#   erlang-src, erlang-doc           Apache-2.0
#   emacs-el                         GPL-3+
#   emscripten                       Expat (MIT), Zlib, BSD-3-clause; bundled libc++ Apache-2.0 with LLVM exception
#   fpc-source-3.2.2                 GPL-2+; runtime library LGPL-2.1+ with a static-linking exception
#   lazarus-src-2.2                  GPL-2+; LCL LGPL-2+ with a static-linking exception
#   gnulib                           LGPL-2+, GPL-3+ or LGPL-3+/GPL-2+ per module
#   vim-runtime                      the Vim license; some files Expat, public domain
#   sbcl-source                      public domain and BSD-3-clause
#   golang-github-aws-aws-sdk-go-dev Apache-2.0
#   golang-github-azure-...-go-dev   Apache-2.0
#   golang-google-api-dev            BSD-3-clause
#   mediawiki                        GPL-2+; bundled libraries Expat, BSD-3-clause, Apache-2.0
#   wordpress                        GPL-2+; bundled libraries LGPL-2+, BSD-3-clause, Expat
#   racket-common                    MIT or Apache-2.0 (some LGPL-2.1+)
#   gap-libs                         GPL-2+
#   texlive-latex-extra, -pictures   LPPL-1.3c mostly, per package (some GPL, public domain)
#   libcgal-dev                      GPL-3+ / LGPL-3+
#   perl-doc                         GPL-1+ or Artistic
#   git-doc                          GPL-2
#   ghc-doc                          BSD-3-clause
#   qtbase5-doc-html                 GFDL-1.3 (documentation); code LGPL-3 or GPL-2
#   libstdc++-12-doc                 GPL-3+ with the runtime library exception; docs GFDL-1.3
#   llvm-15-doc                      Apache-2.0 with the LLVM exception
EXTRA_CODE = (
    "gcc-12-source",
    "gcc-11-source",
    "openjdk-17-source",
    "glibc-source",
    "binutils-source",
    "gdb-source",
    "golang-1.19-src",
    "rust-src",
    "libboost1.74-dev",
    "erlang-src",
    "emacs-el",
    "emscripten",
    "fpc-source-3.2.2",
    "lazarus-src-2.2",
    "gnulib",
    "vim-runtime",
    "sbcl-source",
    "golang-github-aws-aws-sdk-go-dev",
    "golang-github-azure-azure-sdk-for-go-dev",
    "golang-google-api-dev",
    "libboost1.81-dev",
    "mediawiki",
    "wordpress",
    "racket-common",
    "gap-libs",
    "texlive-latex-extra",
    "texlive-pictures",
    "libcgal-dev",
)
# English API documentation, as the HTML files the packages ship
EXTRA_ENGLISH = (
    *("perl-doc", "git-doc", "rust-doc", "openjdk-17-doc", "ghc-doc", "qtbase5-doc-html"),
    *("erlang-doc", "libstdc++-12-doc", "libboost1.74-doc", "llvm-15-doc"),
)
# Everyday English for the multiple-choice evals (issue 18): how-to pages, definitions with
# example sentences, narrative descriptions; markup stripped (tools/debian/documents.py). Licenses, as the
# packages' Debian copyright files state them:
#   wordnet-base            WordNet 3.0 (Princeton's permissive license): every synset's words,
#                           gloss and example sentences ("breathe: draw air into ...; "I can
#                           breathe better when the air is clean"")
#   gnome-user-docs         CC-BY-SA-3.0: GNOME's desktop help, its English (C) Mallard pages
#   libreoffice-help-en-us  MPL-2.0: LibreOffice's help pages
#   debian-handbook         GPL-2+ or CC-BY-SA-3.0: The Debian Administrator's Handbook, en-US
#   crawl-common            GPL-2+: Dungeon Crawl Stone Soup's descriptions of its monsters,
#                           items, places and gods (with their quotes), and its FAQ
EVERYDAY = ("wordnet-base", "gnome-user-docs", "libreoffice-help-en-us", "debian-handbook", "crawl-common")
# Evaluation-only corpora: never exported into a train split, never indexed.
#   linux-source-6.12-new  C, header and rst files of linux-source-6.12 (GPL-2) whose path does
#                          not exist in linux-source-6.1, nor its parent/name (moved files):
#                          files new in the later release
#   python3.11-doc         the reStructuredText sources of Python's documentation (PSF-2.0)
EVAL_ONLY = ("linux-source-6.12-new", "python3.11-doc")
# Debian package of a corpus whose name is not a package name
_SOURCE_EXT = (".c", ".h", ".S", ".rs", ".py", ".sh", ".pl", ".rst", ".txt", ".yaml", "Kconfig", "Makefile")

_TIMESHIFT_EXT = (".c", ".h", ".rst")


def _strip_top(path: str) -> str:
    return path.split("/", 1)[1] if "/" in path else path


def _tail(path: str) -> str:
    return "/".join(path.split("/")[-2:])


def tar_paths(name: str) -> set[str]:
    """Paths of every member of a kernel tarball, its top directory stripped (cached)."""
    cached = cache_dir() / "paths" / f"{name}.txt"
    if not cached.exists():
        root = fetch(name)
        (tarball,) = root.glob("usr/src/linux-source-*.tar.xz")
        with tarfile.open(tarball, "r|xz") as tar:
            paths = sorted(_strip_top(m.name) for m in tar)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tmp.write_text("\n".join(paths) + "\n")
        os.replace(tmp, cached)
    return set(cached.read_text().splitlines())


def documents(name: str) -> Iterator[tuple[str, str]]:
    """(path, text) of each document of a corpus, in a fixed order."""
    root = fetch(name)
    if name in EXTRA_SOURCES:
        yield from extra_documents(name, root)
    elif name == "linux-source-6.12-new":
        # new: neither the path nor its last two components (a file moved to another directory,
        # e.g. Documentation/arm/x.rst -> Documentation/arch/arm/x.rst) exist in 6.1
        old = tar_paths("linux-source-6.1")
        old_tails = {_tail(p) for p in old}
        (tarball,) = root.glob("usr/src/linux-source-6.12.tar.xz")

        def new(path: str) -> bool:
            return path.endswith(_TIMESHIFT_EXT) and _strip_top(path) not in old and _tail(path) not in old_tails

        yield from tar_files(tarball, new)
    elif name == "python3.11-doc":
        base = root / "usr/share/doc/python3.11/html/_sources"
        for p in sorted(base.rglob("*.rst.txt")):
            text = read_file(p) if p.is_file() else None
            if text and text.strip():
                yield str(p.relative_to(root)), text
    elif name == "linux-source-6.1":
        with tarfile.open(root / "usr/src/linux-source-6.1.tar.xz", "r|xz") as tar:
            for m in tar:
                if m.isfile() and m.name.endswith(_SOURCE_EXT):
                    f = tar.extractfile(m)
                    try:
                        text = f.read().decode("utf-8") if f else None
                    except UnicodeDecodeError:
                        continue
                    if text and text.strip():
                        yield m.name, text
    elif name == "linux-doc-6.1":
        base = root / "usr/share/doc/linux-doc-6.1/Documentation"
        for p in sorted(base.rglob("*")):
            if p.is_file() and "translations" not in p.parts and p.name.endswith((".rst.gz", ".txt.gz", ".rst", ".txt")):
                text = read_file(p)
                if text and text.strip():
                    yield str(p.relative_to(root)), text
    elif name in ("manpages", "manpages-dev"):
        for p in sorted((root / "usr/share/man").rglob("*.gz")):
            text = read_file(p)
            if text and text.strip():
                yield str(p.relative_to(root)), text
    elif name == "jargon-text":
        p = root / "usr/share/doc/jargon-text/jargon.txt.gz"
        yield from chunks(read_file(p) or "", str(p.relative_to(root)), sep="\n\n:")
    elif name == "dict-gcide":
        p = root / "usr/share/dictd/gcide.dict.dz"  # dictzip is gzip-compatible
        yield from chunks(gzip.open(p).read().decode("utf-8", errors="replace"), str(p.relative_to(root)))
    elif name == "fortunes":
        for p in sorted((root / "usr/share/games/fortunes").glob("*")):
            if p.is_file() and not p.name.endswith(".dat") and not p.is_symlink():
                text = read_file(p)
                if text and text.strip():
                    yield str(p.relative_to(root)), text
    elif name in EVERYDAY:
        yield from everyday_documents(name, root)
    elif name == "bible-kjv-text":
        for book in _BOOKS:
            out = subprocess.run(
                [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib") + "/", f"{book}1:1-{book}999:999"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            yield f"bible-kjv/{book}", out
    else:
        raise SystemExit(f"unknown corpus {name!r}; known: {', '.join(CODE + ENGLISH + EVERYDAY + EXTRA_CODE + EXTRA_ENGLISH + EVAL_ONLY)}")


_BOOKS = (
    "Gen Exo Lev Num Deu Jos Jdg Rut 1Sa 2Sa 1Ki 2Ki 1Ch 2Ch Ezr Neh Est Job Ps Pro Ecc Son Isa Jer Lam Eze Dan "
    "Hos Joe Amo Oba Jon Mic Nah Hab Zep Hag Zec Mal Mat Mar Luk Joh Act Rom 1Co 2Co Gal Eph Phi Col 1Th 2Th 1Ti "
    "2Ti Tit Phm Heb Jam 1Pe 2Pe 1Jo 2Jo 3Jo Jude Rev"
).split()


def split_of(path: str, heldout_percent: int = 5, salt: str = "teragram-split-v1") -> str:
    """'train' or 'heldout' by a hash of the document path."""
    h = int.from_bytes(hashlib.blake2b(f"{salt}:{path}".encode(), digest_size=8).digest(), "big")
    return "heldout" if h % 100 < heldout_percent else "train"


def corpus_split(name: str, path: str, heldout_percent: int = 5) -> str:
    """split_of, except that every document of an evaluation-only corpus or of a held-out
    package (heldout_package) is held-out."""
    return "heldout" if name in EVAL_ONLY or heldout_package(name) else split_of(path, heldout_percent)


# The corpora named above; any other Debian package (the package pool of tools/package_pool.py)
# is split whole by a hash of its split key (package_pool.split_key: the name of its Debian source
# package less a version suffix, so that a project's binary packages and versioned copies go
# together): PACKAGE_HELDOUT_PERCENT of them are held out of every index, so that held-out text
# comes from projects no index holds. The salt fixes the split.
NAMED = (*CODE, *ENGLISH, *EVERYDAY, *EXTRA_CODE, *EXTRA_ENGLISH, *EVAL_ONLY)
PACKAGE_HELDOUT_PERCENT = 5
PACKAGE_SALT = "teragram-package-split-v1"


def heldout_package(key: str) -> bool:
    """Whether a package of split key `key` (outside the named corpora) is held out of every index."""
    if key in NAMED:
        return False
    h = int.from_bytes(hashlib.blake2b(f"{PACKAGE_SALT}:{key}".encode(), digest_size=8).digest(), "big")
    return h % 100 < PACKAGE_HELDOUT_PERCENT


class EvalOnlyError(ValueError):
    """An evaluation-only corpus or a held-out package was asked for in a split that may be
    trained on or indexed."""


def _refuse_eval_only(names, split: str | None) -> None:
    bad = [n for n in names if n in EVAL_ONLY]
    if bad and split != "heldout":
        raise EvalOnlyError(f"{', '.join(bad)} is evaluation-only: export it with split='heldout', never into train")
    refuse_heldout_packages({n: n for n in names}, split)


def refuse_heldout_packages(keys: dict[str, str], split: str | None) -> None:
    """EvalOnlyError unless split is "heldout" when a package (name -> split key) is held out."""
    held = [n for n, k in keys.items() if heldout_package(k)]
    if held and split != "heldout":
        raise EvalOnlyError(f"{', '.join(held)} is a held-out package (corpora.heldout_package): never exported into train")


def sample_bucket(path: str, buckets: int = 100, salt: str = "teragram-sample-v1") -> int:
    """Bucket 0..buckets-1 of a document by a hash of its path, independent of split_of: the
    documents of buckets < k are a uniform sample that grows (and nests) with k."""
    h = int.from_bytes(hashlib.blake2b(f"{salt}:{path}".encode(), digest_size=8).digest(), "big")
    return h % buckets


def export_buckets(
    name: str,
    outdir: Path,
    *,
    exclude: frozenset[str] = frozenset(),
    buckets: int = 100,
    heldout_percent: int = 5,
    level: int = 3,
) -> dict:
    """One pass over a corpus: its train-split documents, less the paths in `exclude`, written to
    outdir/name/bNN.jsonl.zst by sample_bucket(path), with the package's copyright file beside
    them and manifest.json (docs and bytes per bucket) written last, so that a finished export
    is one with a manifest."""
    import zstandard

    _refuse_eval_only([name], "train")
    d = outdir / name
    done = d / "manifest.json"
    if done.exists():
        manifest = json.loads(done.read_text())
        if line := version_mismatch(manifest.get("packages", {}), [name]):
            print(line, flush=True)
        return manifest
    d.mkdir(parents=True, exist_ok=True)
    # one compressor per writer: stream writers sharing a compressor corrupt each other's frames
    writers = [zstandard.ZstdCompressor(level=level).stream_writer(open(d / f"b{k:02d}.jsonl.zst.tmp", "wb")) for k in range(buckets)]
    docs, nbytes = [0] * buckets, [0] * buckets
    skipped = {"heldout": 0, "excluded": 0}
    for path, text in documents(name):
        if split_of(path, heldout_percent) != "train":
            skipped["heldout"] += 1
            continue
        if path in exclude:
            skipped["excluded"] += 1
            continue
        k = sample_bucket(path, buckets)
        writers[k].write((json.dumps({"text": text, "path": path, "corpus": name}) + "\n").encode())
        docs[k] += 1
        nbytes[k] += len(text.encode())
    for k, w in enumerate(writers):
        w.close()  # closes the file too
        os.replace(d / f"b{k:02d}.jsonl.zst.tmp", d / f"b{k:02d}.jsonl.zst")
    shutil.copy(copyright_file(name), d / "copyright")
    manifest = {"corpus": name, "buckets": buckets, "docs": docs, "bytes": nbytes, "skipped": skipped, "packages": versions([name])}
    tmp = d / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, done)
    return manifest


def export(
    names: list[str],
    out: Path,
    *,
    max_bytes: int | None = None,
    per_corpus: dict[str, int] | None = None,
    split: str | None = None,
    heldout_percent: int = 5,
    level: int = 19,
) -> dict:
    """Write documents as JSON lines {"text", "path", "corpus"} (zstd-compressed if out ends in
    .zst): at most max_bytes in all, and per_corpus[name] bytes of a corpus named there.
    Evaluation-only corpora are all held-out: exported with split="heldout" only."""
    import zstandard

    _refuse_eval_only(names, split)
    out.parent.mkdir(parents=True, exist_ok=True)
    n_docs = n_bytes = 0
    raw = open(out, "wb")
    f = zstandard.ZstdCompressor(level=level, threads=-1).stream_writer(raw) if out.suffix == ".zst" else raw
    with io.TextIOWrapper(f, encoding="utf-8") as w:
        for name in names:
            cap = (per_corpus or {}).get(name)
            mine = 0
            for path, text in documents(name):
                if split is not None and corpus_split(name, path, heldout_percent) != split:
                    continue
                w.write(json.dumps({"text": text, "path": path, "corpus": name}) + "\n")
                size = len(text.encode())
                n_docs, n_bytes, mine = n_docs + 1, n_bytes + size, mine + size
                if (max_bytes is not None and n_bytes >= max_bytes) or (cap is not None and mine >= cap):
                    break
            if max_bytes is not None and n_bytes >= max_bytes:
                break
    return {"docs": n_docs, "bytes": n_bytes, "file_bytes": out.stat().st_size, "packages": versions(names)}


# The embedded default corpus: the Jargon File and a slice of the kernel documentation.
_DEFAULT_DOC_DIRS = ("process", "admin-guide", "core-api", "filesystems", "RCU", "locking", "scheduler", "mm")


def make_default(dst: Path) -> None:
    """data/default/{train,heldout/valid,heldout/test}/...: files go to held-out by a hash of
    their path (5%), and held-out files to validation or test by another."""
    shutil.rmtree(dst, ignore_errors=True)
    jroot = fetch("jargon-text")
    droot = fetch("linux-doc-6.1")
    base = droot / "usr/share/doc/linux-doc-6.1/Documentation"
    files = [(jroot / "usr/share/doc/jargon-text/jargon.txt.gz", Path("jargon") / "jargon.txt.gz")]
    for d in _DEFAULT_DOC_DIRS:
        files += [(p, Path("linux-doc") / p.relative_to(base)) for p in sorted((base / d).rglob("*.gz"))]
    for src, rel in files:
        q = dst / split_of(str(rel)) / rel
        if split_of(str(rel)) == "heldout":
            valid = hashlib.blake2b(str(rel).encode(), digest_size=8).digest()[0] % 2 == 0
            q = dst / "heldout" / ("valid" if valid else "test") / rel
        q.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, q)
    lic = dst / "LICENSES"
    lic.mkdir()
    shutil.copy(jroot / "usr/share/doc/jargon-text/copyright", lic / "jargon-text.copyright")
    shutil.copy(droot / "usr/share/doc/linux-doc-6.1/copyright", lic / "linux-doc-6.1.copyright")
    size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    n_held = sum(1 for p in (dst / "heldout").rglob("*") if p.is_file())
    print(f"{dst}: {size / 1e6:.1f} MB, {len(files)} files ({n_held} held out)")


def smoke() -> int:
    """The parsers and exporters on a local fixture, nothing downloaded: the embedded corpus's
    Jargon File laid out as its unpacked package (and a .deb name for its version) in a
    temporary cache; an export, a bucketed export, and a rerun against another version."""
    import tempfile

    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="teragram-smoke-") as tmp:
        os.environ["TERAGRAM_CACHE"] = str(Path(tmp) / "corpora")
        root = cache_dir() / "root" / "jargon-text"
        (root / "usr/share/doc/jargon-text").mkdir(parents=True)
        shutil.copy(repo / "data/default/train/jargon/jargon.txt.gz", root / "usr/share/doc/jargon-text/jargon.txt.gz")
        shutil.copy(repo / "data/default/LICENSES/jargon-text.copyright", root / "usr/share/doc/jargon-text/copyright")
        (root / ".done").touch()
        (cache_dir() / "debs").mkdir()
        (cache_dir() / "debs" / "jargon-text_4.4.7-1_all.deb").touch()
        print(json.dumps(export(["jargon-text"], Path(tmp) / "j.jsonl.zst", max_bytes=200_000, split="train")))
        print(json.dumps(export_buckets("jargon-text", Path(tmp) / "extra", buckets=4)["docs"]))
        os.replace(cache_dir() / "debs" / "jargon-text_4.4.7-1_all.deb", cache_dir() / "debs" / "jargon-text_4.4.7-2_all.deb")
        export_buckets("jargon-text", Path(tmp) / "extra", buckets=4)  # prints the one-line note
    return 0


def main(argv: list[str] | None = None) -> int:
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):
        return smoke()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("names", nargs="+")
    e = sub.add_parser("export")
    e.add_argument("names", nargs="+")
    e.add_argument("--out", required=True)
    e.add_argument("--max-mb", type=float)
    e.add_argument("--split", choices=["train", "heldout"])
    m = sub.add_parser("make-default")
    m.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "data" / "default"))
    args = p.parse_args(argv)
    if args.cmd == "fetch":
        for n in args.names:
            print(fetch(n))
    elif args.cmd == "export":
        mb = None if args.max_mb is None else int(args.max_mb * 1e6)
        print(json.dumps(export(args.names, Path(args.out), max_bytes=mb, split=args.split)))
    else:
        make_default(Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
