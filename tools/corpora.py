"""Real corpora from Debian packages: fetched with `apt-get download`, unpacked with `dpkg -x`.

    python -m tools.corpora fetch linux-source-6.1 linux-doc-6.1
    python -m tools.corpora export linux-source-6.1 --max-mb 200 --out /tmp/linux.jsonl.zst
    python -m tools.corpora make-default          # regenerates data/default/

Each corpus yields documents, one per source file (a file of the kernel tarball, a man page,
a book of the bible, a fortune file); the few single-file corpora (the Jargon File, GCIDE)
are cut into chunks at entry boundaries so that a train/held-out split by path has
something to split. `split_of(path)` puts a document in train or held-out by a hash of its
path, never by position inside a document. Cached under $TERAGRAM_CACHE
(default ~/.cache/teragram/corpora).

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
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

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
# example sentences, narrative descriptions; markup stripped (_markup_text). Licenses, as the
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
_PACKAGE = {"linux-source-6.12-new": "linux-source-6.12"}
# extra packages a corpus needs unpacked beside it
_NEEDS = {"bible-kjv-text": ("bible-kjv",)}
# packages of a Debian suite that a stock bookworm machine's apt sources do not list: fetched
# through an apt state of the cache's own (its sources list, package lists and archive cache)
_SUITE = {"linux-source-6.12": "bookworm-backports"}
_MIRROR = "http://deb.debian.org/debian"
_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
_CHUNK = 32 << 10  # target size of chunks cut from single-file corpora
_SOURCE_EXT = (".c", ".h", ".S", ".rs", ".py", ".sh", ".pl", ".rst", ".txt", ".yaml", "Kconfig", "Makefile")


def cache_dir() -> Path:
    return Path(os.environ.get("TERAGRAM_CACHE", Path.home() / ".cache" / "teragram" / "corpora"))


def _apt_download(pkg: str, dst: Path) -> None:
    """`apt-get download pkg` into dst; a package of another suite (_SUITE) goes through an apt
    state under the cache that lists only that suite, updated once."""
    opts: list[str] = []
    suite = _SUITE.get(pkg)
    if suite:
        state = cache_dir() / "apt" / suite
        for d in ("lists/partial", "cache/archives/partial"):
            (state / d).mkdir(parents=True, exist_ok=True)
        (state / "sources.list").write_text(f"deb [signed-by={_KEYRING}] {_MIRROR} {suite} main\n")
        opts = [
            *("-o", f"Dir::Etc::SourceList={state / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null"),
            *("-o", f"Dir::State::Lists={state / 'lists'}", "-o", f"Dir::Cache={state / 'cache'}"),
        ]
        if not any((state / "lists").glob("*Packages*")):
            subprocess.run(["apt-get", *opts, "update"], check=True, capture_output=True)
    r = subprocess.run(["apt-get", *opts, "download", pkg], cwd=dst, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"apt-get download {pkg} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")


def fetch(name: str) -> Path:
    """Download and unpack a package (and what it needs); returns its unpacked root."""
    name = _PACKAGE.get(name, name)
    root = cache_dir() / "root" / name
    if (root / ".done").exists():
        return root
    debs = cache_dir() / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    for pkg in (name, *_NEEDS.get(name, ())):
        have = list(debs.glob(f"{pkg}_*.deb"))
        if not have:
            _apt_download(pkg, debs)
            have = list(debs.glob(f"{pkg}_*.deb"))
        subprocess.run(["dpkg", "-x", str(have[0]), str(root)], check=True)
    (root / ".done").touch()
    return root


def versions(names) -> dict[str, str]:
    """The Debian version of each package the named corpora are unpacked from (the .deb that
    fetch keeps): the archive moves on (point releases replace a version), so a corpus is
    reproducible only at the versions it records."""
    from urllib.parse import unquote

    out = {}
    for n in names:
        n = _PACKAGE.get(n, n)
        for pkg in (n, *_NEEDS.get(n, ())):
            for deb in sorted((cache_dir() / "debs").glob(f"{pkg}_*.deb")):
                out[pkg] = unquote(deb.name[len(pkg) + 1 :].rsplit("_", 1)[0])
    return out


def version_mismatch(recorded: dict[str, str], names) -> str | None:
    """One line saying which packages the cache now holds at versions other than an export
    recorded (`recorded`: its "packages"), or None when every recorded one is the same."""
    now = versions(names)
    diff = [f"{p} {v} -> {now[p]}" for p, v in sorted(recorded.items()) if p in now and now[p] != v]
    if not diff:
        return None
    return (
        f"note: packages differ from the export's ({'; '.join(diff)}): a new export of {', '.join(names)} would not give the same documents"
    )


def _chunks(text: str, base: str, sep: str = "\n\n") -> Iterator[tuple[str, str]]:
    """Cut a long text into ~_CHUNK pieces at `sep` boundaries: (base#k, piece)."""
    k, start = 0, 0
    while start < len(text):
        end = text.find(sep, start + _CHUNK)
        end = len(text) if end < 0 else end + len(sep)
        yield f"{base}#{k}", text[start:end]
        k, start = k + 1, end


def _read(path: Path) -> str | None:
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    if b"\0" in raw[:8192]:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


# Files of the extra corpora kept as documents (one per file), by extension or by name; files
# over _MAX_DOC (4 MiB) are generated data (tables, test vectors, intrinsics listings) and skipped.
_EXTRA_EXT = (
    *(".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".hxx", ".ipp", ".tcc", ".inc", ".def", ".md", ".S", ".s"),
    *(".f", ".f90", ".F90", ".ads", ".adb", ".d", ".go", ".rs", ".java", ".py", ".sh", ".pl", ".pm", ".pod", ".m4"),
    *(".ac", ".am", ".texi", ".txt", ".rst", ".el", ".erl", ".hrl", ".ml", ".mli", ".scm", ".awk", ".y", ".yrl"),
    *(".l", ".tcl", ".exp", ".js", ".toml", ".cmake", ".m", ".mm", ".lisp", ".asm", ".yaml", ".pp", ".pas", ".lpr"),
    *(".vim", ".texinfo", ".gperf", ".C", ".ada", ".html", ".htm", ".php", ".rkt", ".scrbl", ".gi", ".gd", ".g"),
    *(".sty", ".cls", ".dtx", ".tex", ".hs", ".tikz"),
)
_EXTRA_NAMES = ("ChangeLog", "README", "NEWS", "Makefile", "Kconfig", "TODO")
_MAX_DOC = 4 << 20
# where each extra corpus's files are: ("tar" | "zip" | "dir", glob under the unpacked package)
_EXTRA_SOURCES = {
    "gcc-12-source": ("tar", "usr/src/gcc-12/gcc-12*.tar.xz"),
    "gcc-11-source": ("tar", "usr/src/gcc-11/gcc-11*.tar.xz"),
    "openjdk-17-source": ("zip", "usr/lib/jvm/openjdk-17/lib/src.zip"),
    "glibc-source": ("tar", "usr/src/glibc/glibc-*.tar.xz"),
    "binutils-source": ("tar", "usr/src/binutils/binutils-*.tar.xz"),
    "gdb-source": ("tar", "usr/src/gdb.tar.xz"),
    "golang-1.19-src": ("dir", "usr/share/go-1.19"),
    "rust-src": ("dir", "usr/src/rustc-1.63.0"),
    "libboost1.74-dev": ("dir", "usr/include/boost"),
    "erlang-src": ("dir", "usr/lib/erlang/lib"),
    "emacs-el": ("dir", "usr/share/emacs/28.2/lisp"),
    "emscripten": ("dir", "usr/share/emscripten"),
    "fpc-source-3.2.2": ("dir", "usr/share/fpcsrc/3.2.2"),
    "lazarus-src-2.2": ("dir", "usr/lib/lazarus/2.2.6"),
    "gnulib": ("dir", "usr/share/gnulib"),
    "vim-runtime": ("dir", "usr/share/vim/vim90"),
    "sbcl-source": ("dir", "usr/share/sbcl-source"),
    "golang-github-aws-aws-sdk-go-dev": ("dir", "usr/share/gocode/src"),
    "golang-github-azure-azure-sdk-for-go-dev": ("dir", "usr/share/gocode/src"),
    "golang-google-api-dev": ("dir", "usr/share/gocode/src"),
    "libboost1.81-dev": ("dir", "usr/include/boost"),
    "mediawiki": ("dir", "usr/share/mediawiki"),
    "wordpress": ("dir", "usr/share/wordpress"),
    "racket-common": ("dir", "usr/share/racket"),
    "gap-libs": ("dir", "usr/share/gap"),
    "texlive-latex-extra": ("dir", "usr/share/texlive/texmf-dist/tex"),
    "rust-doc": ("dir", "usr/share/doc/rust-doc/html"),
    "openjdk-17-doc": ("dir", "usr/share/doc/openjdk-17-jre-headless"),
    "ghc-doc": ("dir", "usr/share/doc/ghc-doc/html"),
    "qtbase5-doc-html": ("dir", "usr/share/qt5/doc"),
    "texlive-pictures": ("dir", "usr/share/texlive/texmf-dist/tex"),
    "libcgal-dev": ("dir", "usr/include/CGAL"),
    "erlang-doc": ("dir", "usr/share/doc/erlang-doc"),
    "libstdc++-12-doc": ("dir", "usr/share/doc/gcc-12-base/libstdc++"),
    "libboost1.74-doc": ("dir", "usr/share/doc/libboost1.74-doc"),
    "llvm-15-doc": ("dir", "usr/share/doc/llvm-15-doc/html"),
    "perl-doc": ("dir", "usr/share/perl/5.36.0/pod"),
    "git-doc": ("dir", "usr/share/doc/git-doc"),
}
# directories of a dir corpus left out: emscripten's cache holds copies of its own system/ headers
_SKIP_DIRS = {"emscripten": ("cache",)}
_TIMESHIFT_EXT = (".c", ".h", ".rst")


def _is_source(path: str) -> bool:
    base = path.rsplit("/", 1)[-1].removesuffix(".gz")
    return base.endswith(_EXTRA_EXT) or base.startswith(_EXTRA_NAMES)


def _text(raw: bytes) -> str | None:
    if b"\0" in raw[:8192]:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


def _tar_files(tarball: Path, keep) -> Iterator[tuple[str, str]]:
    """(member name, text) of the regular files of a tarball that keep(name) accepts, streamed."""
    with tarfile.open(tarball, "r|*") as tar:
        for m in tar:
            if m.isfile() and m.size <= _MAX_DOC and keep(m.name):
                f = tar.extractfile(m)
                text = _text(f.read()) if f else None
                if text:
                    yield m.name, text


def _extra_documents(name: str, root: Path) -> Iterator[tuple[str, str]]:
    kind, pattern = _EXTRA_SOURCES[name]
    found = sorted(root.glob(pattern))
    if not found:
        raise FileNotFoundError(f"{name}: nothing matches {pattern} under {root}")
    src = found[0]
    if kind == "tar":
        yield from _tar_files(src, _is_source)
    elif kind == "zip":
        import zipfile

        with zipfile.ZipFile(src) as z:
            for info in z.infolist():
                if not info.is_dir() and info.file_size <= _MAX_DOC and _is_source(info.filename):
                    text = _text(z.read(info))
                    if text:
                        yield f"openjdk-17/{info.filename}", text
    else:
        skip = _SKIP_DIRS.get(name, ())
        for p in sorted(src.rglob("*")):
            if skip and any(part in skip for part in p.relative_to(src).parts):
                continue
            if p.is_file() and not p.is_symlink() and _is_source(p.name) and p.stat().st_size <= _MAX_DOC:
                raw = gzip.open(p).read() if p.suffix == ".gz" else p.read_bytes()
                text = _text(raw) if len(raw) <= _MAX_DOC else None
                if text:
                    yield f"{name}/{p.relative_to(root)}", text  # unique across packages (boost 1.74 and 1.81)


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
    if name in _EXTRA_SOURCES:
        yield from _extra_documents(name, root)
    elif name == "linux-source-6.12-new":
        # new: neither the path nor its last two components (a file moved to another directory,
        # e.g. Documentation/arm/x.rst -> Documentation/arch/arm/x.rst) exist in 6.1
        old = tar_paths("linux-source-6.1")
        old_tails = {_tail(p) for p in old}
        (tarball,) = root.glob("usr/src/linux-source-6.12.tar.xz")

        def new(path: str) -> bool:
            return path.endswith(_TIMESHIFT_EXT) and _strip_top(path) not in old and _tail(path) not in old_tails

        yield from _tar_files(tarball, new)
    elif name == "python3.11-doc":
        base = root / "usr/share/doc/python3.11/html/_sources"
        for p in sorted(base.rglob("*.rst.txt")):
            text = _read(p) if p.is_file() else None
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
                text = _read(p)
                if text and text.strip():
                    yield str(p.relative_to(root)), text
    elif name in ("manpages", "manpages-dev"):
        for p in sorted((root / "usr/share/man").rglob("*.gz")):
            text = _read(p)
            if text and text.strip():
                yield str(p.relative_to(root)), text
    elif name == "jargon-text":
        p = root / "usr/share/doc/jargon-text/jargon.txt.gz"
        yield from _chunks(_read(p) or "", str(p.relative_to(root)), sep="\n\n:")
    elif name == "dict-gcide":
        p = root / "usr/share/dictd/gcide.dict.dz"  # dictzip is gzip-compatible
        yield from _chunks(gzip.open(p).read().decode("utf-8", errors="replace"), str(p.relative_to(root)))
    elif name == "fortunes":
        for p in sorted((root / "usr/share/games/fortunes").glob("*")):
            if p.is_file() and not p.name.endswith(".dat") and not p.is_symlink():
                text = _read(p)
                if text and text.strip():
                    yield str(p.relative_to(root)), text
    elif name in EVERYDAY:
        yield from _everyday_documents(name, root)
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


# markup whose contents are not prose: page furniture, scripts, Mallard's <info> (credits,
# links, revisions); any element with a `hidden` attribute (LibreOffice's per-platform variants)
_NOT_PROSE = frozenset(("head", "script", "style", "header", "aside", "nav", "footer", "noscript", "info"))
_BLOCK = frozenset("p div br li item tr title h1 h2 h3 h4 h5 h6 pre code-block screen dt dd table section steps list terms note".split())
_VOID = frozenset(("img", "br", "meta", "link", "input", "hr", "base", "col", "area", "wbr", "source"))


def _markup_text(markup: str) -> str:
    """The prose of an HTML or Mallard (XML) page: the text outside _NOT_PROSE elements, each
    block element's text on its own paragraph, whitespace collapsed as a browser does (but
    inside <pre>, whose lines stay lines)."""
    from html.parser import HTMLParser

    brk = "\0"  # a block boundary (markup text holds no NUL: _read refuses binary files)
    out: list[str] = []
    stack: list[tuple[str, bool]] = []  # (tag, skipped) of the open elements

    class P(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag in _BLOCK:
                out.append(brk)
            if tag in _VOID:
                return
            skip = (stack[-1][1] if stack else False) or tag in _NOT_PROSE or any(k == "hidden" for k, _ in attrs)
            stack.append((tag, skip))

        def handle_startendtag(self, tag, attrs):
            if tag in _BLOCK:
                out.append(brk)

        def handle_endtag(self, tag):
            if tag in _BLOCK:
                out.append(brk)
            for i in range(len(stack) - 1, -1, -1):  # close it and whatever was left open inside it
                if stack[i][0] == tag:
                    del stack[i:]
                    break

        def handle_data(self, data):
            if not (stack and stack[-1][1]):
                out.append(data.replace("\n", brk) if any(t == "pre" for t, _ in stack) else data)

    p = P(convert_charrefs=True)
    p.feed(markup)
    p.close()
    blocks = (" ".join(b.split()) for b in "".join(out).split(brk))
    return "\n\n".join(b for b in blocks if b)


_WORDNET_POS = ("noun", "verb", "adj", "adv")  # data.POS, one file each


def _wordnet_documents(root: Path) -> Iterator[tuple[str, str]]:
    """One line per synset, "word, other word: gloss; "example"", grouped by WordNet's
    lexicographer file (noun.food, verb.motion, ...: its field 2) and cut into chunks."""
    for pos in _WORDNET_POS:
        groups: dict[int, list[str]] = {}
        for line in (root / f"usr/share/wordnet/data.{pos}").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("  ") or " | " not in line:  # the license header
                continue
            head, gloss = line.split(" | ", 1)
            f = head.split()
            n = int(f[3], 16)
            words = [w.replace("_", " ") for w in f[4 : 4 + 2 * n : 2]]
            words = [re.sub(r"\((a|p|ip)\)$", "", w) for w in words]  # adjective markers
            groups.setdefault(int(f[1]), []).append(f"{', '.join(words)}: {gloss.strip()}")
        for lex, lines in sorted(groups.items()):
            yield from _chunks("\n".join(lines) + "\n", f"wordnet/{pos}/{lex:02d}", sep="\n")


def _everyday_documents(name: str, root: Path) -> Iterator[tuple[str, str]]:
    if name == "wordnet-base":
        yield from _wordnet_documents(root)
        return
    if name == "crawl-common":  # entries between %%%% lines; # lines are comments
        base = root / "usr/share/crawl/dat"
        for p in [*sorted((base / "descript").glob("*.txt")), base / "database/FAQ.txt"]:
            raw = _read(p) or ""
            text = "\n".join(line for line in raw.splitlines() if not line.startswith("#"))
            text = re.sub(r"\n{3,}", "\n\n", text.replace("%%%%", "\n")).strip()
            if text:
                yield from _chunks(text + "\n", str(p.relative_to(root)))
        return
    pattern = {
        "gnome-user-docs": "usr/share/help/C/*/*.page",
        "libreoffice-help-en-us": "usr/share/libreoffice/help/en-US/**/*.html",
        "debian-handbook": "usr/share/doc/debian-handbook/html/en-US/*.html",
    }[name]
    for p in sorted(root.glob(pattern)):
        raw = _read(p) if p.is_file() and not p.is_symlink() else None
        text = _markup_text(raw) if raw else ""
        if len(text) >= 200:  # index pages, redirects, empty stubs
            yield str(p.relative_to(root)), text + "\n"


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


def copyright_file(name: str) -> Path:
    """The Debian copyright file of a corpus's package (or of the package it shares its docs with)."""
    doc = fetch(name) / "usr/share/doc"
    own = doc / _PACKAGE.get(name, name)
    for _ in range(4):  # e.g. manpages-dev -> manpages: another package's docs (followed package by package)
        if not own.is_symlink() or (own / "copyright").is_file():
            break
        other = os.readlink(own)
        own = fetch(other) / "usr/share/doc" / other
    found = [own / "copyright"] if (own / "copyright").is_file() else sorted(doc.glob("*/copyright"))
    if not found:
        raise FileNotFoundError(f"{name}: no copyright file under {doc}")
    return found[0]


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
