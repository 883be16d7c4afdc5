"""Debian packages as the corpora's source: fetched with `apt-get download` into
$TERAGRAM_CACHE/debs (default ~/.cache/teragram/corpora), unpacked with `dpkg -x` under
$TERAGRAM_CACHE/root, their versions read back from the .deb names and their copyright files found."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# Debian package of a corpus whose name is not a package name
PACKAGE = {"linux-source-6.12-new": "linux-source-6.12"}
# extra packages a corpus needs unpacked beside it
NEEDS = {"bible-kjv-text": ("bible-kjv",)}
# packages of a Debian suite that a stock bookworm machine's apt sources do not list: fetched
# through an apt state of the cache's own (its sources list, package lists and archive cache)
_SUITE = {"linux-source-6.12": "bookworm-backports"}
_MIRROR = "http://deb.debian.org/debian"
_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


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
    name = PACKAGE.get(name, name)
    root = cache_dir() / "root" / name
    if (root / ".done").exists():
        return root
    debs = cache_dir() / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    for pkg in (name, *NEEDS.get(name, ())):
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
        n = PACKAGE.get(n, n)
        for pkg in (n, *NEEDS.get(n, ())):
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


def copyright_file(name: str) -> Path:
    """The Debian copyright file of a corpus's package (or of the package it shares its docs with)."""
    doc = fetch(name) / "usr/share/doc"
    own = doc / PACKAGE.get(name, name)
    for _ in range(4):  # e.g. manpages-dev -> manpages: another package's docs (followed package by package)
        if not own.is_symlink() or (own / "copyright").is_file():
            break
        other = os.readlink(own)
        own = fetch(other) / "usr/share/doc" / other
    found = [own / "copyright"] if (own / "copyright").is_file() else sorted(doc.glob("*/copyright"))
    if not found:
        raise FileNotFoundError(f"{name}: no copyright file under {doc}")
    return found[0]
