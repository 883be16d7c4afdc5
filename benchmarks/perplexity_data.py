"""Export the perplexity benchmark's corpora (train and held-out, code and English) as
zstd JSON lines, small enough to copy to another machine (< 50 MB compressed).

    python -m benchmarks.perplexity_data --out DIR [--scale gpu|cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import corpora

MB = 1_000_000
SCALES = {
    # ~50M training tokens: ~36M of kernel C, ~14M of English from all seven packages
    "gpu": {
        "code": 90 * MB,
        "english": {"linux-doc-6.1": 15 * MB, "dict-gcide": 12 * MB, "manpages": 8 * MB, "manpages-dev": 3 * MB},
        "heldout": 3 * MB,
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
    },
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", choices=list(SCALES), default="gpu")
    args = ap.parse_args()
    s = SCALES[args.scale]
    out = Path(args.out)
    info = {
        "train-code": corpora.export(["linux-source-6.1"], out / "train-code.jsonl.zst", max_bytes=s["code"], split="train"),
        "train-english": corpora.export(list(corpora.ENGLISH), out / "train-english.jsonl.zst", per_corpus=s["english"], split="train"),
        "heldout-code": corpora.export(["linux-source-6.1"], out / "heldout-code.jsonl.zst", max_bytes=s["heldout"], split="heldout"),
        "heldout-english": corpora.export(
            list(corpora.ENGLISH),
            out / "heldout-english.jsonl.zst",
            per_corpus={n: s["heldout"] // 4 for n in corpora.ENGLISH},
            split="heldout",
        ),
    }
    (out / "export.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
