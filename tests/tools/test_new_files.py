"""The time-shifted held-out set's filter (tools/corpora.py, corpus linux-source-6.12-new): of
the later kernel release, only C, header and rst files whose path is absent from the earlier
release are kept, a file moved to another directory (the same last two path components) counting
as present. Checked on two fake releases, fresh random trees written as the tarballs the
Debian packages unpack to, against what each file was made as; nothing is downloaded."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

from tools import corpora

OLD, NEW = "linux-source-6.1", "linux-source-6.12"


def _tarball(path, top: str, files: dict[str, bytes], dirs: list[str]) -> None:
    """An xz tarball of files (and directory entries) under top/, as the package ships it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:xz", preset=0) as tar:
        for d in dirs:
            info = tarfile.TarInfo(f"{top}/{d}")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _text(rng, what: str) -> bytes:
    return f"/* {what} {rng.integers(1 << 62)} */\nint f(void) {{ return {rng.integers(100)}; }}\n".encode()


@pytest.fixture
def releases(tmp_path, monkeypatch):
    """Two releases in a fake corpus cache: (old files, new files, the paths that must be kept)."""
    rng = np.random.default_rng(12)
    monkeypatch.setenv("TERAGRAM_CACHE", str(tmp_path / "cache"))
    words = ["drivers", "net", "fs", "mm", "kernel", "arch", "arm", "x86", "Documentation", "core", "usb", "sound"]
    ext = [".c", ".h", ".rst", ".txt", ".S", ".py"]

    def path(depth: int, stem: str) -> str:
        parts = [str(rng.choice(words)) for _ in range(depth)]
        return "/".join(parts + [f"{stem}{rng.integers(1 << 30)}{rng.choice(ext)}"])

    old = {path(int(rng.integers(2, 5)), "f"): None for _ in range(300)}
    old = {p: _text(rng, "old " + p) for p in old}
    new: dict[str, bytes] = {}
    keep: set[str] = set()
    for p, data in old.items():
        fate = rng.integers(4)
        if fate == 0:  # unchanged
            new[p] = data
        elif fate == 1:  # edited in place
            new[p] = data + b"/* edited */\n"
        elif fate == 2:  # moved under another directory, its last two components kept
            top = p.split("/")
            new["/".join(["moved", *top[:-2], *top[-2:]])] = data
        # else removed
    for i in range(200):  # new files: new names, some in directories the old release has
        p = path(int(rng.integers(1, 5)), f"new{i}_") if i % 2 else f"newdir{i}/n{i}{rng.choice(ext)}"
        new[p] = _text(rng, "new " + p)
        if p.endswith((".c", ".h", ".rst")):
            keep.add(p)
    # at the top of the tree: an old file kept as it was, and a new one
    old["top_old.rst"] = new["top_old.rst"] = _text(rng, "old top")
    new["top_new.c"] = _text(rng, "new top")
    # an old file's name in a directory the old release does not have: new
    reused = next(p for p in old if p.endswith(".h")).rsplit("/", 1)[1]
    new[f"newdir/{reused}"] = _text(rng, "new reused name")
    keep |= {"top_new.c", f"newdir/{reused}"}
    # a new name whose last two components an old file has: taken for a moved file, left out
    clash = next(p for p in old if p.endswith(".c") and p.count("/") >= 1)
    new["elsewhere/" + clash] = _text(rng, "new clash")
    # new files of the kept kinds that are not text, empty or too large: left out
    new["drivers/blob_new.c"] = b"\x00\x01 binary"
    new["drivers/latin1_new.h"] = "caf\xe9".encode("latin-1")
    new["drivers/empty_new.rst"] = b" \n"
    new["drivers/huge_new.c"] = b"/* big */" + b"a" * (4 << 20)
    dirs = sorted({p.rsplit("/", 1)[0] for p in new if "/" in p})
    root = tmp_path / "cache" / "root"
    _tarball(root / OLD / "usr/src/linux-source-6.1.tar.xz", OLD, old, sorted({p.rsplit("/", 1)[0] for p in old}))
    _tarball(root / NEW / "usr/src/linux-source-6.12.tar.xz", NEW, new, dirs)
    for r in (OLD, NEW):
        (root / r / ".done").touch()
    return old, new, keep


def test_only_files_absent_from_the_older_release_are_kept(releases):
    old, new, keep = releases
    got = dict(corpora.documents("linux-source-6.12-new"))
    assert all(p.startswith(NEW + "/") for p in got)
    got = {p.removeprefix(NEW + "/"): t for p, t in got.items()}
    assert set(got) == keep and len(keep) > 50
    assert all(got[p] == new[p].decode() for p in keep)
    # nothing of the older release: no path of it, no file moved from it, no text of it
    tails = {"/".join(p.split("/")[-2:]) for p in old}
    assert not set(got) & set(old) and not {"/".join(p.split("/")[-2:]) for p in got} & tails
    assert not {t.encode() for t in got.values()} & set(old.values())
    # and the new files' paths are what the held-out split keeps: every one held out
    assert {corpora.corpus_split("linux-source-6.12-new", NEW + "/" + p) for p in got} == {"heldout"}
