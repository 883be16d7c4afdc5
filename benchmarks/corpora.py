"""Real corpora from Debian packages: fetched with `apt-get download`, unpacked with `dpkg -x`.

    python -m benchmarks.corpora fetch linux-source-6.1 linux-doc-6.1
    python -m benchmarks.corpora export linux-source-6.1 --max-mb 200 --out /tmp/linux.jsonl.zst
    python -m benchmarks.corpora make-default          # regenerates data/default/

Each corpus yields documents, one per source file (a file of the kernel tarball, a man page,
a book of the bible, a fortune file); the few single-file corpora (the Jargon File, GCIDE)
are cut into chunks at entry boundaries so that a train/held-out split by path has
something to split. `split_of(path)` puts a document in train or held-out by a hash of its
path, never by position inside a document. Cached under $TERAGRAM_CACHE
(default ~/.cache/teragram/corpora).
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

CODE = ("linux-source-6.1",)
ENGLISH = ("linux-doc-6.1", "dict-gcide", "manpages", "manpages-dev", "jargon-text", "fortunes", "bible-kjv-text")
# extra packages a corpus needs unpacked beside it
_NEEDS = {"bible-kjv-text": ("bible-kjv",)}
_CHUNK = 32 << 10  # target size of chunks cut from single-file corpora
_SOURCE_EXT = (".c", ".h", ".S", ".rs", ".py", ".sh", ".pl", ".rst", ".txt", ".yaml", "Kconfig", "Makefile")


def cache_dir() -> Path:
    return Path(os.environ.get("TERAGRAM_CACHE", Path.home() / ".cache" / "teragram" / "corpora"))


def fetch(name: str) -> Path:
    """Download and unpack a package (and what it needs); returns its unpacked root."""
    root = cache_dir() / "root" / name
    if (root / ".done").exists():
        return root
    debs = cache_dir() / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    for pkg in (name, *_NEEDS.get(name, ())):
        have = list(debs.glob(f"{pkg}_*.deb"))
        if not have:
            subprocess.run(["apt-get", "download", pkg], cwd=debs, check=True, capture_output=True)
            have = list(debs.glob(f"{pkg}_*.deb"))
        subprocess.run(["dpkg", "-x", str(have[0]), str(root)], check=True)
    (root / ".done").touch()
    return root


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


def documents(name: str) -> Iterator[tuple[str, str]]:
    """(path, text) of each document of a corpus, in a fixed order."""
    root = fetch(name)
    if name == "linux-source-6.1":
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
        raise SystemExit(f"unknown corpus {name!r}; known: {', '.join(CODE + ENGLISH)}")


_BOOKS = (
    "Gen Exo Lev Num Deu Jos Jdg Rut 1Sa 2Sa 1Ki 2Ki 1Ch 2Ch Ezr Neh Est Job Ps Pro Ecc Son Isa Jer Lam Eze Dan "
    "Hos Joe Amo Oba Jon Mic Nah Hab Zep Hag Zec Mal Mat Mar Luk Joh Act Rom 1Co 2Co Gal Eph Phi Col 1Th 2Th 1Ti "
    "2Ti Tit Phm Heb Jam 1Pe 2Pe 1Jo 2Jo 3Jo Jude Rev"
).split()


def split_of(path: str, heldout_percent: int = 5, salt: str = "teragram-split-v1") -> str:
    """'train' or 'heldout' by a hash of the document path."""
    h = int.from_bytes(hashlib.blake2b(f"{salt}:{path}".encode(), digest_size=8).digest(), "big")
    return "heldout" if h % 100 < heldout_percent else "train"


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
    .zst): at most max_bytes in all, and per_corpus[name] bytes of a corpus named there."""
    import zstandard

    out.parent.mkdir(parents=True, exist_ok=True)
    n_docs = n_bytes = 0
    raw = open(out, "wb")
    f = zstandard.ZstdCompressor(level=level, threads=-1).stream_writer(raw) if out.suffix == ".zst" else raw
    with io.TextIOWrapper(f, encoding="utf-8") as w:
        for name in names:
            cap = (per_corpus or {}).get(name)
            mine = 0
            for path, text in documents(name):
                if split is not None and split_of(path, heldout_percent) != split:
                    continue
                w.write(json.dumps({"text": text, "path": path, "corpus": name}) + "\n")
                size = len(text.encode())
                n_docs, n_bytes, mine = n_docs + 1, n_bytes + size, mine + size
                if (max_bytes is not None and n_bytes >= max_bytes) or (cap is not None and mine >= cap):
                    break
            if max_bytes is not None and n_bytes >= max_bytes:
                break
    return {"docs": n_docs, "bytes": n_bytes, "file_bytes": out.stat().st_size}


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


def main(argv: list[str] | None = None) -> int:
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
