"""Suffix arrays built in parts and merged from disk: identical to one part, to brute force,
and resumable after SIGKILL mid-merge."""

import subprocess
import sys

import numpy as np
import pytest
from teragram.builder import sa as sa_mod
from teragram.builder.build import build_from_ids
from teragram.index import format as fmt
from teragram.index import packed
from teragram.index.engine import Index
from teragram.index.errors import BuildError

from tests.builder.helpers import REPO, brute_sa, built_files, docs_with_duplicates, run_and_kill


def _shard_arrays(root) -> dict[str, bytes]:
    return {k: v for k, v in built_files(root).items() if k.endswith(("sa.bin", "samax.bin", "unigram.bin"))}


@pytest.mark.parametrize("seed", [0, 1])
def test_parts_give_the_same_bytes_as_one_part(tmp_path, tokenizer_model, monkeypatch, seed):
    docs = docs_with_duplicates(seed)
    whole = tmp_path / "whole"
    build_from_ids(docs, whole, tokenizer_model, shard_tokens=3000)
    sorted_parts = []
    real_sort = sa_mod.sort_part
    monkeypatch.setattr(sa_mod, "sort_part", lambda d, plan, i, *a: sorted_parts.append(plan.n_parts) or real_sort(d, plan, i, *a))
    parted = tmp_path / "parted"
    build_from_ids(docs, parted, tokenizer_model, shard_tokens=3000, sa_part_tokens=150)
    assert max(sorted_parts) >= 8  # the small cap really cut shards into many parts
    assert _shard_arrays(parted) == _shard_arrays(whole)
    idx = Index(parted)
    assert len(idx.shards) >= 2
    for s in idx.shards:
        tok = np.asarray(s.tok)
        assert s.sa.to_numpy().tolist() == brute_sa(tok, idx.sep)
        assert not (fmt.shard_dir(parted, s.id) / sa_mod.PARTS_DIR).exists()


def test_budget_errors(tmp_path, tokenizer_model):
    docs = docs_with_duplicates(2)
    with pytest.raises(BuildError, match="cannot merge a shard of .* positions"):
        build_from_ids(docs, tmp_path / "i", tokenizer_model, memory_gb=0.01)
    starts = np.array([0, 10, 500, 520], dtype=np.uint64)
    assert sa_mod.plan_parts(starts, 500).bounds == (0, 500, 520)
    with pytest.raises(BuildError, match="a document of 490 tokens does not fit"):
        sa_mod.plan_parts(starts, 400)


@pytest.mark.parametrize("width", [31, 32, 33, 36, 40])
def test_packing_wide_pointers(width):
    rng = np.random.default_rng(width)
    vals = rng.integers(0, 2**width, size=1000, dtype=np.int64)
    vals[:3] = [0, 2**width - 1, 2**width - 2]
    words = packed.pack(vals, width)
    assert len(words) == packed.n_words(len(vals), width)
    assert packed.unpack(words, width, len(vals)).tolist() == vals.tolist()
    assert packed.unpack(words, width, len(vals), 500, 503).tolist() == vals[500:503].tolist()


def test_resume_with_parts_after_sigkill_is_byte_identical(tmp_path, corpus_dir):
    def args(out, *extra):
        return [str(corpus_dir), "--out", str(out), "--vocab-size", "600", "--shard-tokens", "60000", "--workers", "1", "--quiet", *extra]

    ref = tmp_path / "ref"  # one part per shard
    subprocess.run([sys.executable, "-m", "teragram.builder.cli", *args(ref)], cwd=REPO, check=True)
    reference = built_files(ref)
    parts = ("--sa-part-tokens", "14000")
    s1 = "shards/000001"
    milestones = {
        "parts of shard 1": lambda o: (o / s1 / "sa.parts/000002.done").exists(),
        "merging shard 1": lambda o: any((o / s1).glob(".sa.bin.tmp-*")),
        "samax of shard 1": lambda o: (o / s1 / "samax.bin").exists(),
    }
    kills = 0
    for name, when in milestones.items():
        out = tmp_path / name.replace(" ", "_")
        kills += run_and_kill(args(out, *parts), out, when)
        subprocess.run([sys.executable, "-m", "teragram.builder.cli", *args(out, *parts)], cwd=REPO, check=True)
        assert built_files(out) == reference, name
    assert kills >= 2


def test_corrupt_part_is_a_one_line_error_and_a_truncated_one_is_redone(tmp_path, tokenizer_model):
    from teragram.builder import shard_index
    from teragram.index.errors import IndexFormatError

    docs = docs_with_duplicates(3)
    build_from_ids(docs, tmp_path / "i", tokenizer_model, shard_tokens=1 << 20)
    d = fmt.shard_dir(tmp_path / "i", 0)
    reference = (d / "sa.bin").read_bytes()
    starts = np.asarray(fmt.open_array(d / "docs.bin", "docs"))
    plan = sa_mod.plan_parts(starts, 300)
    sa_mod.prepare_parts(d, plan)
    for i in range(plan.n_parts):
        sa_mod.sort_part(d, plan, i, fmt.separator(np.dtype(np.uint16)), "uint32")
    with open(sa_mod.part_path(d, 0), "r+b") as f:  # truncated: no longer done, sorted again
        f.truncate(100)
    assert not sa_mod.part_done(d, 0)
    shard_index.write_shard_arrays(d, fmt.separator(np.dtype(np.uint16)), 1000, 1 << 40, part_positions=300)
    assert (d / "sa.bin").read_bytes() == reference
    with open(sa_mod.part_path(d, 1), "r+b") as f:  # right size, bad header
        f.seek(30)
        f.write(b"\x7f")
    with pytest.raises(IndexFormatError, match=r"000001\.bin: header checksum mismatch"):
        shard_index.write_shard_arrays(d, fmt.separator(np.dtype(np.uint16)), 1000, 1 << 40, part_positions=300)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_merged_parts_against_brute_force_both_token_widths(tmp_path, dtype):
    """Merge keys hold 3 tokens of 16 bits or 1 of 32: both widths, with duplicated documents."""
    from teragram.builder import shard_index

    rng = np.random.default_rng(4)
    sep = int(np.iinfo(dtype).max)
    low = 70000 if dtype == np.uint32 else 10
    docs = [rng.integers(low, low + 4, size=int(rng.integers(1, 30))).astype(dtype) for _ in range(60)]
    docs += docs[:15]
    tokens = np.concatenate([np.append(d, dtype(sep)) for d in docs])
    starts = np.concatenate([[0], np.cumsum([len(d) + 1 for d in docs])]).astype(np.uint64)
    fmt.write_array(tmp_path / "tokens.bin", "tokens", tokens)
    fmt.write_array(tmp_path / "docs.bin", "docs", starts)
    shard_index.write_shard_arrays(tmp_path, sep, low + 4, 1 << 40, part_positions=100)
    assert fmt.open_packed(tmp_path / "sa.bin", "sa").to_numpy().tolist() == brute_sa(tokens, sep)
    assert (
        np.asarray(fmt.open_array(tmp_path / "unigram.bin", "unigram"))[low:].tolist() == np.bincount(tokens[tokens != sep] - low).tolist()
    )


def test_long_duplicates_across_parts_saturate_the_merge_lcp(tmp_path):
    """A document longer than the lcp values can hold (LCP_MAX), repeated in three parts: the
    merged order equals one part's (whose order is checked against brute force above)."""
    from teragram.builder import shard_index

    rng = np.random.default_rng(6)
    sep = 0xFFFF
    long_doc = rng.integers(10, 14, size=sa_mod.LCP_MAX + 5000).astype(np.uint16)
    docs = [long_doc, rng.integers(10, 14, size=300).astype(np.uint16)] * 3
    tokens = np.concatenate([np.append(d, np.uint16(sep)) for d in docs])
    starts = np.concatenate([[0], np.cumsum([len(d) + 1 for d in docs])]).astype(np.uint64)
    arrays = {}
    for name, cap in (("whole", None), ("parts", len(long_doc) + 400)):
        d = tmp_path / name
        d.mkdir()
        fmt.write_array(d / "tokens.bin", "tokens", tokens)
        fmt.write_array(d / "docs.bin", "docs", starts)
        shard_index.write_shard_arrays(d, sep, 20, 1 << 40, part_positions=cap)
        arrays[name] = (d / "sa.bin").read_bytes()
    assert arrays["parts"] == arrays["whole"]
