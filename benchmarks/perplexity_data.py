"""Export the perplexity benchmark's corpora (train and held-out, code and English) as
zstd JSON lines, small enough to copy to another machine (< 50 MB compressed).

    python -m benchmarks.perplexity_data --out DIR [--scale gpu|cpu] [--parts code,english,everyday]

train-everyday / heldout-everyday (issue 18): everyday English for the multiple-choice evals
(corpora.EVERYDAY: WordNet's glosses and example sentences, GNOME's and LibreOffice's help, the
Debian Administrator's Handbook, Crawl's descriptions) and the English packages the gpu scale's
train-english leaves out (the Jargon File, fortunes, the King James Bible). The 125M headline of
the evals trains on all three files; the perplexity and index-size benchmarks (and the retired
joint one) keep the first two (their held-out sets are heldout-code and heldout-english), so their results stand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools import corpora

MB = 1_000_000
SCALES = {
    # ~50M training tokens: ~36M of kernel C, ~14M of English from all seven packages
    "gpu": {
        "code": 90 * MB,
        "english": {"linux-doc-6.1": 15 * MB, "dict-gcide": 12 * MB, "manpages": 8 * MB, "manpages-dev": 3 * MB},
        "heldout": 3 * MB,
        "everyday": ("jargon-text", "fortunes", "bible-kjv-text"),  # all of each, beside corpora.EVERYDAY
    },
    # ~5M training tokens for the CPU run
    "cpu": {
        "code": 9 * MB,
        "english": {
            "linux-doc-6.1": 2 * MB,
            "dict-gcide": 1 * MB,
            "manpages": 1 * MB,
            "manpages-dev": MB // 2,
            "jargon-text": MB,
            "fortunes": MB // 2,
            "bible-kjv-text": MB,
        },
        "heldout": MB // 2,
        "everyday": (),
    },
}


def smoke() -> int:
    """Every part at the cpu scale into a temporary folder, each corpus's documents the embedded
    corpus's files (corpora.documents and versions replaced: nothing is downloaded)."""
    from benchmarks.common import REPO, smoke_context

    def documents(name: str):
        import gzip

        root = REPO / "data" / "default"
        for p in sorted(root.rglob("*.rst.gz"))[:40]:
            yield f"{name}/{p.relative_to(root / p.relative_to(root).parts[0])}", gzip.open(p, "rt", encoding="utf-8").read()

    corpora.documents, corpora.versions = documents, lambda names: {n: "smoke" for n in names}
    with smoke_context(True) as tmp:
        sys.argv = [sys.argv[0], "--out", str(tmp / "data"), "--scale", "cpu"]
        return main()


def main() -> int:
    if "--smoke" in sys.argv[1:]:
        return smoke()
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", choices=list(SCALES), default="gpu")
    ap.add_argument("--parts", default="code,english,everyday", help="which files to (re)write")
    args = ap.parse_args()
    s = SCALES[args.scale]
    out = Path(args.out)
    parts = args.parts.split(",")
    if bad := set(parts) - {"code", "english", "everyday"}:
        raise SystemExit(f"unknown --parts {','.join(sorted(bad))}; known: code, english, everyday")
    everyday = [*corpora.EVERYDAY, *s["everyday"]]
    info = json.loads((out / "export.json").read_text()) if (out / "export.json").exists() else {}
    if "code" in parts:
        info["train-code"] = corpora.export(["linux-source-6.1"], out / "train-code.jsonl.zst", max_bytes=s["code"], split="train")
        info["heldout-code"] = corpora.export(["linux-source-6.1"], out / "heldout-code.jsonl.zst", max_bytes=s["heldout"], split="heldout")
    if "english" in parts:
        info["train-english"] = corpora.export(
            list(corpora.ENGLISH), out / "train-english.jsonl.zst", per_corpus=s["english"], split="train"
        )
        info["heldout-english"] = corpora.export(
            list(corpora.ENGLISH),
            out / "heldout-english.jsonl.zst",
            per_corpus={n: s["heldout"] // 4 for n in corpora.ENGLISH},
            split="heldout",
        )
    if "everyday" in parts:
        info["train-everyday"] = corpora.export(everyday, out / "train-everyday.jsonl.zst", split="train")
        info["heldout-everyday"] = corpora.export(everyday, out / "heldout-everyday.jsonl.zst", split="heldout")
    out.mkdir(parents=True, exist_ok=True)
    (out / "export.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
