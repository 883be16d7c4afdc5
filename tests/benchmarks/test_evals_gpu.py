"""The evals benchmark's everyday held-out halves: only held-out documents, none twice."""

from __future__ import annotations

import pytest

from benchmarks import evals_gpu
from benchmarks.common import read_jsonl, write_jsonl
from benchmarks.perplexity import in_valid_half
from tools import corpora


def _docs(split: str, n: int, prefix: str) -> list[dict]:
    paths = [f"{prefix}/doc{i}.txt" for i in range(10 * n) if corpora.split_of(f"{prefix}/doc{i}.txt") == split][:n]
    return [{"text": f"text of {p}\n", "path": p, "corpus": "wordnet-base"} for p in paths]


def test_prepare_halves_the_parts_heldout_documents(tmp_path):
    ppl = tmp_path / "ppl"
    held = _docs("heldout", 40, "everyday")
    shared = held[:5]  # also in heldout-english (jargon, fortunes, bible are in both exports)
    write_jsonl(ppl / "heldout-code.jsonl.zst", _docs("heldout", 3, "code"))
    write_jsonl(ppl / "heldout-english.jsonl.zst", shared)
    write_jsonl(ppl / "heldout-everyday.jsonl.zst", held)
    write_jsonl(ppl / "train-everyday.jsonl.zst", _docs("train", 30, "everyday"))
    carry = tmp_path / "carry"
    info = evals_gpu.prepare(tmp_path, carry)
    got = {h: [r["path"] for r in read_jsonl(carry / "everyday" / f"{h}.jsonl.zst")] for h in ("valid", "test")}
    want = [r["path"] for r in held[5:]]
    assert sorted(got["valid"] + got["test"]) == sorted(want)
    assert all(in_valid_half(p) for p in got["valid"]) and not any(in_valid_half(p) for p in got["test"])
    assert got["valid"] and got["test"] and info["valid"]["docs"] == len(got["valid"])
    assert [r["path"] for r in read_jsonl(carry / "train-everyday.jsonl.zst")] == [r["path"] for r in _docs("train", 30, "everyday")]
    write_jsonl(ppl / "heldout-everyday.jsonl.zst", held + _docs("train", 1, "everyday"))
    with pytest.raises(SystemExit, match="train-split document"):
        evals_gpu.prepare(tmp_path, carry)
