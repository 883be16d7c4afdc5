"""Documents read out of unpacked Debian packages: one per source or text file of a tarball, a
zip or a directory (the extra corpora: EXTRA_SOURCES says where each one's files are), the prose
of HTML and Mallard pages and WordNet's synsets (the everyday English corpora), and long single
files cut into chunks. Files that are binary, not UTF-8 or over MAX_DOC are skipped."""

from __future__ import annotations

import gzip
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path

_CHUNK = 32 << 10  # target size of chunks cut from single-file corpora


def chunks(text: str, base: str, sep: str = "\n\n") -> Iterator[tuple[str, str]]:
    """Cut a long text into ~_CHUNK pieces at `sep` boundaries: (base#k, piece)."""
    k, start = 0, 0
    while start < len(text):
        end = text.find(sep, start + _CHUNK)
        end = len(text) if end < 0 else end + len(sep)
        yield f"{base}#{k}", text[start:end]
        k, start = k + 1, end


def read_file(path: Path) -> str | None:
    """A file's text (gunzipped if it ends in .gz); None if it is binary or not UTF-8."""
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    if b"\0" in raw[:8192]:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


# Files of the extra corpora kept as documents (one per file), by extension or by name; files
# over MAX_DOC (4 MiB) are generated data (tables, test vectors, intrinsics listings) and skipped.
EXTRA_EXT = (
    *(".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".hxx", ".ipp", ".tcc", ".inc", ".def", ".md", ".S", ".s"),
    *(".f", ".f90", ".F90", ".ads", ".adb", ".d", ".go", ".rs", ".java", ".py", ".sh", ".pl", ".pm", ".pod", ".m4"),
    *(".ac", ".am", ".texi", ".txt", ".rst", ".el", ".erl", ".hrl", ".ml", ".mli", ".scm", ".awk", ".y", ".yrl"),
    *(".l", ".tcl", ".exp", ".js", ".toml", ".cmake", ".m", ".mm", ".lisp", ".asm", ".yaml", ".pp", ".pas", ".lpr"),
    *(".vim", ".texinfo", ".gperf", ".C", ".ada", ".html", ".htm", ".php", ".rkt", ".scrbl", ".gi", ".gd", ".g"),
    *(".sty", ".cls", ".dtx", ".tex", ".hs", ".tikz"),
)
EXTRA_NAMES = ("ChangeLog", "README", "NEWS", "Makefile", "Kconfig", "TODO")
MAX_DOC = 4 << 20
# where each extra corpus's files are: ("tar" | "zip" | "dir", glob under the unpacked package)
EXTRA_SOURCES = {
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


def is_source(path: str) -> bool:
    base = path.rsplit("/", 1)[-1].removesuffix(".gz")
    return base.endswith(EXTRA_EXT) or base.startswith(EXTRA_NAMES)


def decode_text(raw: bytes) -> str | None:
    """The text of a file's bytes; None if they are binary, not UTF-8 or blank."""
    if b"\0" in raw[:8192]:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


def tar_files(tarball: Path, keep) -> Iterator[tuple[str, str]]:
    """(member name, text) of the regular files of a tarball that keep(name) accepts, streamed."""
    with tarfile.open(tarball, "r|*") as tar:
        for m in tar:
            if m.isfile() and m.size <= MAX_DOC and keep(m.name):
                f = tar.extractfile(m)
                text = decode_text(f.read()) if f else None
                if text:
                    yield m.name, text


def extra_documents(name: str, root: Path) -> Iterator[tuple[str, str]]:
    """(path, text) of each source or text file of an extra corpus, where EXTRA_SOURCES says."""
    kind, pattern = EXTRA_SOURCES[name]
    found = sorted(root.glob(pattern))
    if not found:
        raise FileNotFoundError(f"{name}: nothing matches {pattern} under {root}")
    src = found[0]
    if kind == "tar":
        yield from tar_files(src, is_source)
    elif kind == "zip":
        import zipfile

        with zipfile.ZipFile(src) as z:
            for info in z.infolist():
                if not info.is_dir() and info.file_size <= MAX_DOC and is_source(info.filename):
                    text = decode_text(z.read(info))
                    if text:
                        yield f"openjdk-17/{info.filename}", text
    else:
        skip = _SKIP_DIRS.get(name, ())
        for p in sorted(src.rglob("*")):
            if skip and any(part in skip for part in p.relative_to(src).parts):
                continue
            if p.is_file() and not p.is_symlink() and is_source(p.name) and p.stat().st_size <= MAX_DOC:
                raw = gzip.open(p).read() if p.suffix == ".gz" else p.read_bytes()
                text = decode_text(raw) if len(raw) <= MAX_DOC else None
                if text:
                    yield f"{name}/{p.relative_to(root)}", text  # unique across packages (boost 1.74 and 1.81)


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

    brk = "\0"  # a block boundary (markup text holds no NUL: read_file refuses binary files)
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
            yield from chunks("\n".join(lines) + "\n", f"wordnet/{pos}/{lex:02d}", sep="\n")


def everyday_documents(name: str, root: Path) -> Iterator[tuple[str, str]]:
    """(path, text) of each document of an everyday English corpus (wordnet-base, crawl-common
    and the pages of gnome-user-docs, libreoffice-help-en-us, debian-handbook)."""
    if name == "wordnet-base":
        yield from _wordnet_documents(root)
        return
    if name == "crawl-common":  # entries between %%%% lines; # lines are comments
        base = root / "usr/share/crawl/dat"
        for p in [*sorted((base / "descript").glob("*.txt")), base / "database/FAQ.txt"]:
            raw = read_file(p) or ""
            text = "\n".join(line for line in raw.splitlines() if not line.startswith("#"))
            text = re.sub(r"\n{3,}", "\n\n", text.replace("%%%%", "\n")).strip()
            if text:
                yield from chunks(text + "\n", str(p.relative_to(root)))
        return
    pattern = {
        "gnome-user-docs": "usr/share/help/C/*/*.page",
        "libreoffice-help-en-us": "usr/share/libreoffice/help/en-US/**/*.html",
        "debian-handbook": "usr/share/doc/debian-handbook/html/en-US/*.html",
    }[name]
    for p in sorted(root.glob(pattern)):
        raw = read_file(p) if p.is_file() and not p.is_symlink() else None
        text = _markup_text(raw) if raw else ""
        if len(text) >= 200:  # index pages, redirects, empty stubs
            yield str(p.relative_to(root)), text + "\n"
