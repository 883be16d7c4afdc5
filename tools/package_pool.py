"""A pool of Debian packages that ship source or text, beyond the named corpora of tools/corpora.py,
split whole into packages held out of every index and indexable ones before anything is exported.

    python -m tools.package_pool select   --out DATA/extra2/pool.json    # from the local apt lists
    python -m tools.package_pool download --pool DATA/extra2/pool.json [--split heldout]
    python -m tools.package_pool export   --pool DATA/extra2/pool.json --out DATA/extra2 [GROUP...]

The pool is every package of the local apt lists (`apt-cache pkgnames`, bookworm here) whose name
matches a group's pattern (GROUPS: Rust crates, Go modules, Node.js, Perl, pure-Python, PHP, Ruby
and Emacs Lisp packages, TeX Live, and `-doc` packages), less the named corpora, every package of
the evaluation-only corpora's Debian sources (`linux`: no kernel newer than 6.1 comes in through
the pool; `python3.11`) and every `linux-*` package. A package belongs to the first group whose
pattern matches it; Python packages only of Architecture all (their source is what they ship);
`-doc` packages only up to DOC_MAX_INSTALLED_KB installed (larger ones are mostly PDF and images).
`r-cran-*` packages are left out: they ship their R code byte-compiled (R/*.rdb).

Each package is split whole, never by its files, by a salted hash of a package name: its split key
(split_key: its Debian source package's name less a version suffix, so that the binary packages of
one project and its versioned copies, librust-nom-dev and librust-nom-3-dev, go together;
corpora.heldout_package: 5% held out). The held-out packages are projects no index holds: their
code is the fourth held-out set (index_size_data's `heldout` step), and export_group refuses them. The
indexable packages of a group are exported into DATA/extra2/GROUP/bNN.jsonl.zst by
corpora.sample_bucket(path), their in-distribution held-out files (corpora.split_of) skipped as
for every corpus, one document per source or text file of the package (path: PACKAGE/path in the
package), read from the .deb without unpacking it. Each package's Debian copyright file is kept
under GROUP/copyright/PACKAGE, and its version and the license names its (machine-readable)
copyright file states are recorded in GROUP/manifest.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import unquote

from tools import corpora
from tools.debian import archive, documents

# group -> package-name pattern; a package belongs to the first group that matches
GROUPS = {
    "pool-doc": r"-doc$",
    "pool-rust": r"^librust-.+-dev$",
    "pool-go": r"^golang-.+-dev$",
    "pool-node": r"^node-",
    "pool-perl": r"^lib.+-perl$",
    "pool-python": r"^python3-",
    "pool-php": r"^php-",
    "pool-ruby": r"^ruby-",
    "pool-elpa": r"^elpa-",
    "pool-tex": r"^texlive-",
}
# groups whose packages are code (the held-out packages' code set draws on these only)
CODE_GROUPS = tuple(g for g in GROUPS if g != "pool-doc")
DOC_MAX_INSTALLED_KB = 20_000
# Debian source packages of the evaluation-only corpora: none of their packages enters the pool
_EVAL_SOURCES = ("linux", "python3.11")
# text files of a package kept as documents: the extra corpora's source and text files and more
# languages; Debian's packaging files and directories of generated or other-purpose text left out
POOL_EXT = (*documents.EXTRA_EXT, ".rb", ".ts", ".mjs", ".cjs", ".jsx", ".tsx", ".pyi", ".lua", ".proto", ".sql", ".t", ".xs")
_DEBIAN_FILES = ("changelog", "copyright", "NEWS.Debian", "README.Debian", "README.source")
_GENERATED = (".min.js", ".min.css", ".min.mjs")  # minified bundles
_SKIP_PREFIXES = ("usr/share/man/", "usr/share/lintian/", "usr/share/bug/", "usr/lib/emacsen-common/", "usr/share/doc-base/")
# documentation and prose files, not code: left out of the held-out packages' code set
DOC_EXT = (".md", ".txt", ".rst", ".html", ".htm", ".texi", ".texinfo", ".pod")
_DOC_NAMES = ("ChangeLog", "README", "NEWS", "TODO")


def _stanzas(text: str) -> Iterator[dict[str, str]]:
    """The fields of each stanza of apt-cache show's output (continuation lines dropped)."""
    cur: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if cur:
                yield cur
            cur = {}
        elif not line[0].isspace():
            k, _, v = line.partition(":")
            cur[k] = v.strip()
    if cur:
        yield cur


def split_key(source: str) -> str:
    """The key a package is split by: its Debian source package's name less a trailing version
    (rust-nom-3 and rust-nom, golang-foo-v2 and golang-foo, are one project)."""
    return re.sub(r"(-v?[0-9]+(\.[0-9]+)*)+$", "", source) or source


def group_of(name: str) -> str | None:
    return next((g for g, pat in GROUPS.items() if re.search(pat, name)), None)


def select(apt_show: str) -> list[dict]:
    """The pool from apt-cache show's stanzas of candidate packages: one record per package
    (name, group, version, architecture, source, installed_kb, deb_bytes, split_key, split), by name."""
    named = {archive.PACKAGE.get(n, n) for n in corpora.NAMED} | {p for ps in archive.NEEDS.values() for p in ps}
    out = {}
    for st in _stanzas(apt_show):
        name = st["Package"]
        group = group_of(name)
        source = st.get("Source", name).split(" ")[0]
        arch = st.get("Architecture", "")
        kb = int(st.get("Installed-Size", 0))
        if group is None or name in named or name.startswith("linux-") or source in _EVAL_SOURCES or name in out:
            continue
        if (group == "pool-python" and arch != "all") or (group == "pool-doc" and kb > DOC_MAX_INSTALLED_KB):
            continue
        key = split_key(source)
        split = "heldout" if corpora.heldout_package(key) else "indexable"
        out[name] = {"name": name, "group": group, "version": st["Version"], "architecture": arch, "source": source}
        out[name] |= {"installed_kb": kb, "deb_bytes": int(st.get("Size", 0)), "split_key": key, "split": split}
    return [out[n] for n in sorted(out)]


def select_from_apt() -> list[dict]:
    """select() over the local apt lists: every package name a group's pattern matches."""
    names = subprocess.run(["apt-cache", "pkgnames"], check=True, capture_output=True, text=True).stdout.split()
    names = sorted(n for n in set(names) if group_of(n))
    shown = []
    for i in range(0, len(names), 2000):
        r = subprocess.run(["apt-cache", "show", "--no-all-versions", *names[i : i + 2000]], capture_output=True, text=True)
        shown.append(r.stdout)  # a virtual name has no stanza (and makes apt-cache exit non-zero)
    return select("\n\n".join(shown))


def deb_path(pkg: dict) -> Path | None:
    """The pool package's .deb in the corpus cache, at the version and of the size the pool records
    (a download cut short is not taken). apt-get download names it NAME_VERSION_ARCH.deb with the
    epoch's colon as %3a; a record without its architecture is looked for by name."""
    debs = archive.cache_dir() / "debs"
    if "architecture" in pkg:
        named = debs / f"{pkg['name']}_{pkg['version'].replace(':', '%3a')}_{pkg['architecture']}.deb"
        found = [named] if named.exists() else []
    else:
        found = list(debs.glob(f"{pkg['name']}_*.deb"))
    for deb in found:
        if unquote(deb.name[len(pkg["name"]) + 1 :].rsplit("_", 1)[0]) == pkg["version"]:
            if pkg.get("deb_bytes", deb.stat().st_size) == deb.stat().st_size:
                return deb
    return None


def download(pool: list[dict], *, batch: int = 200, jobs: int = 6) -> list[str]:
    """`apt-get download` the pool packages missing from the cache, many to a call and `jobs`
    calls at once (each package costs apt a round trip: one call at a time fetched 18k packages
    at ~5 per second); a batch that fails is retried one package at a time. Returns the names
    that could not be downloaded."""
    debs = archive.cache_dir() / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    todo = [p for p in pool if deb_path(p) is None]

    def fetch(chunk: list[dict]) -> list[str]:
        args = [f"{p['name']}={p['version']}" for p in chunk]
        if not subprocess.run(["apt-get", "download", *args], cwd=debs, capture_output=True).returncode:
            return []
        return [
            p["name"]
            for a, p in zip(args, chunk, strict=True)
            if deb_path(p) is None and subprocess.run(["apt-get", "download", a], cwd=debs, capture_output=True).returncode
        ]

    chunks = [todo[i : i + batch] for i in range(0, len(todo), batch)]
    failed, done = [], 0
    with ThreadPoolExecutor(jobs) as ex:
        for chunk, f in zip(chunks, ex.map(fetch, chunks), strict=True):
            failed += f
            done += len(chunk)
            print(f"download: {done}/{len(todo)} packages", flush=True)
    return failed


def deb_files(deb: Path) -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of each regular file of a .deb's data (path without its leading ./), streamed;
    a .deb dpkg-deb cannot read is an error (a reader that stops early is not)."""
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
        try:
            for m in tar:
                if m.isfile():
                    f = tar.extractfile(m)
                    yield m.name.removeprefix("./"), f.read() if f else b""
        except GeneratorExit:
            proc.kill()
            proc.wait()
            raise
    proc.stdout.close()
    err = proc.stderr.read()
    if proc.wait():
        raise RuntimeError(f"dpkg-deb --fsys-tarfile {deb} failed: {err.decode(errors='replace').strip()}")


def _kept(path: str) -> bool:
    base = path.rsplit("/", 1)[-1].removesuffix(".gz")
    if path.startswith(_SKIP_PREFIXES) or base.startswith(_DEBIAN_FILES) or base.endswith(_GENERATED):
        return False
    return base.endswith(POOL_EXT) or base.startswith(documents.EXTRA_NAMES)


def is_code(path: str) -> bool:
    """A kept file that is code, not documentation or prose."""
    base = path.rsplit("/", 1)[-1].removesuffix(".gz")
    return _kept(path) and not base.endswith(DOC_EXT) and not base.startswith(_DOC_NAMES) and "/usr/share/doc/" not in f"/{path}"


def package_documents(deb: Path, name: str) -> Iterator[tuple[str, str]]:
    """(NAME/path, text) of each kept text file of a package's .deb, and ("", copyright text) for
    its Debian copyright file (the caller keeps it apart)."""
    for path, raw in deb_files(deb):
        if path == f"usr/share/doc/{name}/copyright":
            yield "", raw.decode("utf-8", errors="replace")
            continue
        if not _kept(path) or len(raw) > documents.MAX_DOC:
            continue
        if path.endswith(".gz"):
            try:
                raw = gzip.decompress(raw)
            except (OSError, EOFError):
                continue
            if len(raw) > documents.MAX_DOC:
                continue
        text = documents.decode_text(raw)
        if text:
            yield f"{name}/{path}", text


def copyright_text(pkg: dict) -> str:
    """The Debian copyright file of a downloaded pool package ("" if it ships none)."""
    want = f"usr/share/doc/{pkg['name']}/copyright"
    return next((raw.decode("utf-8", errors="replace") for path, raw in deb_files(deb_path(pkg)) if path == want), "")


def licenses(copyright_text: str) -> list[str]:
    """License names of a machine-readable (DEP-5) Debian copyright file, sorted; ["see copyright"]
    for a free-form one."""
    found = {m.group(1).strip() for m in re.finditer(r"(?m)^License:[ \t]*(\S[^\n]*)$", copyright_text)}
    return sorted(found) or ["see copyright"]


def export_group(pool: list[dict], group: str, outdir: Path, *, buckets: int = 100, level: int = 3) -> dict:
    """The indexable packages of a group into outdir/group/bNN.jsonl.zst (corpora.sample_bucket
    of the path; split_of's held-out files skipped), copyright files under outdir/group/copyright/,
    manifest.json last (docs and bytes per bucket, versions, licenses, docs per package). A held-out
    package is refused (corpora.EvalOnlyError); a package without its .deb is an error."""
    import zstandard

    d = outdir / group
    done = d / "manifest.json"
    if done.exists():
        return json.loads(done.read_text())
    pkgs = [p for p in pool if p["group"] == group and p["split"] == "indexable"]
    corpora.refuse_heldout_packages({p["name"]: p["split_key"] for p in pkgs}, "train")
    missing = [p["name"] for p in pkgs if deb_path(p) is None]
    if missing:
        raise SystemExit(f"{group}: {len(missing)} packages not downloaded ({', '.join(missing[:5])}, ...): run download first")
    (d / "copyright").mkdir(parents=True, exist_ok=True)
    writers = [zstandard.ZstdCompressor(level=level).stream_writer(open(d / f"b{k:02d}.jsonl.zst.tmp", "wb")) for k in range(buckets)]
    docs, nbytes = [0] * buckets, [0] * buckets
    skipped = {"heldout": 0}
    per_package, lic = {}, {}
    for i, p in enumerate(pkgs):
        n = 0
        for path, text in package_documents(deb_path(p), p["name"]):
            if not path:
                (d / "copyright" / p["name"]).write_text(text)
                lic[p["name"]] = licenses(text)
                continue
            if corpora.split_of(path) != "train":
                skipped["heldout"] += 1
                continue
            k = corpora.sample_bucket(path, buckets)
            writers[k].write((json.dumps({"text": text, "path": path, "corpus": group}) + "\n").encode())
            docs[k] += 1
            nbytes[k] += len(text.encode())
            n += 1
        per_package[p["name"]] = n
        if (i + 1) % 200 == 0:
            print(f"{group}: {i + 1}/{len(pkgs)} packages, {sum(docs):,} docs, {sum(nbytes) / 1e6:,.0f} MB", flush=True)
    for k, w in enumerate(writers):
        w.close()
        os.replace(d / f"b{k:02d}.jsonl.zst.tmp", d / f"b{k:02d}.jsonl.zst")
    manifest = {"corpus": group, "buckets": buckets, "docs": docs, "bytes": nbytes, "skipped": skipped}
    manifest |= {"packages": {p["name"]: p["version"] for p in pkgs}, "licenses": lic, "docs_per_package": per_package}
    tmp = d / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, done)
    return manifest


def heldout_code(pool: list[dict], *, max_doc: int) -> Iterator[dict]:
    """Records (text, path, corpus, package) of the code files (is_code, at most max_doc bytes) of
    the held-out packages of the code groups, package by package in name order."""
    for p in pool:
        if not corpora.heldout_package(p["split_key"]) or p["group"] not in CODE_GROUPS:
            continue
        deb = deb_path(p)
        if deb is None:
            raise SystemExit(f"held-out package {p['name']} not downloaded: run download --split heldout first")
        for path, text in package_documents(deb, p["name"]):
            if path and is_code(path) and len(text.encode()) <= max_doc:
                yield {"text": text, "path": path, "corpus": p["group"], "package": p["name"]}


def read_pool(path: Path) -> list[dict]:
    return json.loads(Path(path).read_text())["packages"]


def write_pool(path: Path, pool: list[dict]) -> None:
    """The pool with the rules that chose it, by a temporary name."""
    info = {"patterns": GROUPS, "doc_max_installed_kb": DOC_MAX_INSTALLED_KB, "heldout_percent": corpora.PACKAGE_HELDOUT_PERCENT}
    info |= {"salt": corpora.PACKAGE_SALT, "packages": pool}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info, indent=0))
    os.replace(tmp, path)


def ensure_pool(path: Path) -> list[dict]:
    """The pool recorded at path, selected from the local apt lists and recorded there first if absent:
    the apt lists move on, so every later step reads the recorded pool."""
    if not path.exists():
        write_pool(path, select_from_apt())
    return read_pool(path)


def smoke() -> int:
    """select, export and the held-out code set on local fixtures, nothing downloaded: apt-cache
    show stanzas of four made-up packages (one Rust crate held out by its split key, one -doc
    package over the size cap), their .debs built with dpkg-deb in a temporary cache."""
    import tempfile

    held = next(f"rust-smoke{i}" for i in range(10_000) if corpora.heldout_package(f"rust-smoke{i}"))
    kept = next(f"rust-smoke{i}" for i in range(10_000) if not corpora.heldout_package(f"rust-smoke{i}"))
    files = {"src/lib.rs": "pub fn add(a: u32, b: u32) -> u32 { a + b }\n", "README.md": "# a crate\n"}
    debs = {f"librust-{held}-dev": (held, files), f"librust-{kept}-dev": (kept, files)}
    debs["smoke-doc"] = ("smoke-doc", {"usr/share/doc/smoke-doc/guide.txt": "A guide to nothing.\n" * 20})
    stanzas = [f"Package: {n}\nSource: {src}\nVersion: 1.0-1\nArchitecture: all\nInstalled-Size: 4\n" for n, (src, _) in debs.items()]
    stanzas.append("Package: big-doc\nVersion: 1\nArchitecture: all\nInstalled-Size: 999999\n")
    with tempfile.TemporaryDirectory(prefix="teragram-smoke-") as tmp:
        os.environ["TERAGRAM_CACHE"] = str(Path(tmp) / "corpora")
        (archive.cache_dir() / "debs").mkdir(parents=True)
        sizes = {}
        for name, (_, tree) in debs.items():
            root = Path(tmp) / "build" / name
            for rel, text in tree.items():
                f = root / (rel if rel.startswith("usr/") else f"usr/share/{name}/{rel}")
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(text)
            (root / "DEBIAN").mkdir()
            (root / "DEBIAN/control").write_text(
                f"Package: {name}\nVersion: 1.0-1\nArchitecture: all\nMaintainer: smoke <s@example.org>\nDescription: smoke\n"
            )
            deb = archive.cache_dir() / "debs" / f"{name}_1.0-1_all.deb"
            subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)], check=True, capture_output=True)
            sizes[name] = deb.stat().st_size
        stanzas = [s + f"Size: {sizes.get(s.split()[1], 0)}\n" for s in stanzas]
        pool = select("\n".join(stanzas))
        print(json.dumps({p["name"]: (p["group"], p["split"]) for p in pool}))
        assert {p["name"] for p in pool} == set(debs), pool
        for g in ("pool-rust", "pool-doc"):
            m = export_group(pool, g, Path(tmp) / "extra", buckets=4)
            print(f"{g}: {sum(m['docs'])} docs from {len(m['packages'])} packages")
        print(json.dumps([r["path"] for r in heldout_code(pool, max_doc=1 << 20)]))
    return 0


def main(argv: list[str] | None = None) -> int:
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):
        return smoke()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("select")
    s.add_argument("--out", required=True)
    d = sub.add_parser("download")
    d.add_argument("--pool", required=True)
    d.add_argument("--split", choices=["heldout", "indexable"])
    d.add_argument("groups", nargs="*")
    e = sub.add_parser("export")
    e.add_argument("--pool", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("groups", nargs="*")
    args = ap.parse_args(argv)
    if args.cmd == "select":
        pool = select_from_apt()
        write_pool(Path(args.out), pool)
        for g in GROUPS:
            mine = [p for p in pool if p["group"] == g]
            held = sum(p["split"] == "heldout" for p in mine)
            print(f"{g}: {len(mine)} packages ({held} held out), {sum(p['deb_bytes'] for p in mine) / 1e9:.2f} GB of .debs")
        return 0
    pool = read_pool(Path(args.pool))
    groups = args.groups or list(GROUPS)
    if args.cmd == "download":
        todo = [p for p in pool if p["group"] in groups and (args.split is None or p["split"] == args.split)]
        failed = download(todo)
        print(json.dumps({"packages": len(todo), "failed": failed}))
        return 1 if failed else 0
    for g in groups:
        m = export_group(pool, g, Path(args.out))
        print(f"{g}: {sum(m['docs']):,} docs, {sum(m['bytes']) / 1e6:,.1f} MB of text from {len(m['packages'])} packages", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
