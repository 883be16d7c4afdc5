"""The held-out sets of the index-size data (`python -m benchmarks.index_size_data heldout`),
under DATA/heldout/SET/{valid,test}.jsonl.zst: documents that never enter an index.

  indist     the perplexity benchmark's held-out documents (corpora.split_of == heldout, which
             every export skips)
  timeshift  files new in linux-source-6.12 (the evaluation-only corpus linux-source-6.12-new)
  prose      the reStructuredText sources of Python's documentation (python3.11-doc,
             evaluation-only)
  packages   code of whole packages of the package pool held out of every index
             (corpora.heldout_package)

Each set is split into valid/test halves by the perplexity benchmark's rule (a second hash of
the path; the packages set by a hash of the package name), and the halves of all but indist are
sampled down to HELDOUT_HALF_BYTES of text in the order of a hash of the path.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from benchmarks.common import note_ready, read_jsonl, write_jsonl
from tools import corpora, package_pool

HELDOUT_HALF_BYTES = 2_500_000  # target size of each valid/test half of the timeshift and prose sets
HELDOUT_MAX_DOC = 200_000  # one document must not dominate a held-out half


def _hash(salt: str, path: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{salt}:{path}".encode(), digest_size=8).digest(), "big")


def split_halves(records: list[dict]) -> dict[str, list[dict]]:
    """valid/test by the perplexity benchmark's rule (a second hash of the path)."""
    from benchmarks.perplexity import in_valid_half

    out: dict[str, list[dict]] = {"valid": [], "test": []}
    for r in records:
        out["valid" if in_valid_half(r["path"]) else "test"].append(r)
    return out


def _sample(records: list[dict], budget: int) -> list[dict]:
    """Documents in the order of a hash of their path until `budget` bytes, then back in input order."""
    keep, used = [], 0
    for r in sorted(records, key=lambda r: _hash("teragram-heldout-order", r["path"])):
        if used >= budget:
            break
        keep.append(r)
        used += len(r["text"].encode())
    order = {r["path"]: i for i, r in enumerate(records)}
    return sorted(keep, key=lambda r: order[r["path"]])


HELDOUT_SETS = ("indist", "timeshift", "prose", "packages")


def heldout(data: Path, sets: tuple[str, ...] = HELDOUT_SETS, *, pool: Path) -> dict:
    """The held-out sets named in `sets` under DATA/heldout/SET/{valid,test}.jsonl.zst; each
    set's numbers in DATA/heldout/SET/info.json (and all of them in heldout.json when every set
    is made). pool: the package pool's record (DATA/extra2/pool.json), for the packages set."""
    info: dict = {}
    sets_made: dict[str, dict[str, list[dict]]] = {}
    if "indist" in sets:
        ppl = [r for name in ("heldout-code.jsonl.zst", "heldout-english.jsonl.zst") for r in read_jsonl(data / "ppl" / name)]
        if any(corpora.split_of(r["path"]) != "heldout" for r in ppl):
            raise SystemExit("ppl held-out files hold a train-split document")
        sets_made["indist"] = split_halves(ppl)
    for set_name, corpus in (("timeshift", "linux-source-6.12-new"), ("prose", "python3.11-doc")):
        if set_name not in sets:
            continue
        docs = [
            {"text": t, "path": p, "corpus": corpus}
            for p, t in corpora.documents(corpus)
            if len(t.encode()) <= HELDOUT_MAX_DOC and corpora.corpus_split(corpus, p) == "heldout"
        ]
        sets_made[set_name] = {k: _sample(v, HELDOUT_HALF_BYTES) for k, v in split_halves(docs).items()}
        info[f"{set_name}_available"] = {"docs": len(docs), "bytes": sum(len(r["text"].encode()) for r in docs)}
    if "packages" in sets:
        sets_made["packages"], info["packages_available"] = heldout_packages(data, pool)
    for set_name, halves in sets_made.items():
        mine = {k: v for k, v in info.items() if k == f"{set_name}_available"}
        for half, recs in halves.items():
            st = write_jsonl(data / "heldout" / set_name / f"{half}.jsonl.zst", recs)
            if set_name == "packages":
                st["packages"] = len({r["path"].split("/", 1)[0] for r in recs})
            info[f"{set_name}/{half}"] = mine[half] = st
            note_ready(data, f"heldout/{set_name}/{half}.jsonl.zst: {st['docs']:,} docs, {st['bytes'] / 1e6:.2f} MB of text")
        (data / "heldout" / set_name / "info.json").write_text(json.dumps(mine, indent=1))
    for pkg, set_name in (("linux-source-6.12", "timeshift"), ("python3.11-doc", "prose")):
        if set_name in sets:
            src = corpora.fetch(pkg) / "usr/share/doc" / pkg / "copyright"
            (data / "heldout" / f"{pkg}.copyright").write_bytes(src.read_bytes())
    if set(sets) == set(HELDOUT_SETS):
        (data / "heldout" / "heldout.json").write_text(json.dumps(info, indent=1))
    return info


# The fourth set: code of whole packages held out of every index (corpora.heldout_package, chosen
# by a hash of the package name before any export), split into valid/test by a hash of the package
# name, so that no package is in both halves; by path (split_halves) if there are fewer than
# MIN_PACKAGES_PER_HALF packages per half. A package gives a half at most HELDOUT_PACKAGE_BYTES.
HELDOUT_PACKAGE_BYTES = HELDOUT_HALF_BYTES // 20
MIN_PACKAGES_PER_HALF = 20


def package_halves(records: list[dict]) -> dict[str, list[dict]]:
    """valid/test by a hash of each record's package (the first component of its path)."""
    pkgs = sorted({r["path"].split("/", 1)[0] for r in records})
    valid = {p for p in pkgs if _hash("teragram-package-half-v1", p) % 2 == 0}
    if min(len(valid), len(pkgs) - len(valid)) < MIN_PACKAGES_PER_HALF:
        return split_halves(records)
    out: dict[str, list[dict]] = {"valid": [], "test": []}
    for r in records:
        out["valid" if r["path"].split("/", 1)[0] in valid else "test"].append(r)
    return out


def _sample_capped(records: list[dict], budget: int, per_package: int) -> list[dict]:
    """_sample, with at most per_package bytes of any one package (a document that would pass it is skipped)."""
    keep, used, mine = [], 0, {}
    for r in sorted(records, key=lambda r: _hash("teragram-heldout-order", r["path"])):
        if used >= budget:
            break
        pkg, size = r["path"].split("/", 1)[0], len(r["text"].encode())
        if mine.get(pkg, 0) + size > per_package:
            continue
        keep.append(r)
        used, mine[pkg] = used + size, mine.get(pkg, 0) + size
    order = {r["path"]: i for i, r in enumerate(records)}
    return sorted(keep, key=lambda r: order[r["path"]])


def heldout_packages(data: Path, pool_file: Path) -> tuple[dict[str, list[dict]], dict]:
    """The packages set's halves from the held-out code packages of the pool (pool_file,
    DATA/extra2/pool.json: selected and their .debs downloaded if missing), with their copyright
    files kept beside it."""
    pool = package_pool.ensure_pool(pool_file)
    held = [p for p in pool if p["split"] == "heldout" and p["group"] in package_pool.CODE_GROUPS]
    if failed := package_pool.download(held):
        raise SystemExit(f"held-out packages not downloaded: {', '.join(failed)}")
    recs = [{k: r[k] for k in ("text", "path", "corpus")} for r in package_pool.heldout_code(pool, max_doc=HELDOUT_MAX_DOC)]
    halves = {k: _sample_capped(v, HELDOUT_HALF_BYTES, HELDOUT_PACKAGE_BYTES) for k, v in package_halves(recs).items()}
    lic = data / "heldout" / "packages" / "copyright"
    lic.mkdir(parents=True, exist_ok=True)
    for name in sorted({r["path"].split("/", 1)[0] for v in halves.values() for r in v}):
        (lic / name).write_text(package_pool.copyright_text(next(p for p in pool if p["name"] == name)))
    avail = {
        "packages": len({r["path"].split("/", 1)[0] for r in recs}),
        "docs": len(recs),
        "bytes": sum(len(r["text"].encode()) for r in recs),
    }
    return halves, avail
