import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from teragram.builder.build import BuildConfig, build
from teragram.builder.sa import suffix_array
from teragram.index import format as fmt
from teragram.index.engine import Index
from teragram.index.errors import BuildError
from teragram.index.meta import MetaStore

from tests.builder.helpers import REPO, brute_sa, built_files, run_and_kill


def _docs_of(idx: Index):
    for s in idx.shards:
        tok = np.asarray(s.tok)
        st = np.asarray(s.starts)
        for k in range(len(st) - 1):
            yield s, k, tok[st[k] : st[k + 1] - 1]


def test_round_trip_every_document(real_index, corpus_dir):
    idx = Index(real_index)
    assert len(idx.shards) > 1
    texts = {}
    for s, k, ids in _docs_of(idx):
        m = idx.meta.doc(s.first_doc + k)
        assert m["shard"] == s.id and m["length"] == len(ids)
        texts[m["source"]] = texts.get(m["source"], "") + idx.decode(ids)
    on_disk = {str(p): p.read_text() for p in corpus_dir.iterdir() if not p.name.startswith("zz_")}
    assert texts == on_disk


def test_separators_and_dtype(real_index):
    idx = Index(real_index)
    for s in idx.shards:
        tok = np.asarray(s.tok)
        st = np.asarray(s.starts).astype(np.int64)
        assert tok.dtype == np.uint16 and len(tok) == st[-1] <= 40000
        assert (tok[st[1:] - 1] == 0xFFFF).all() and (tok == 0xFFFF).sum() == len(st) - 1


def test_suffix_array_against_sorted_suffixes(tmp_path, tokenizer_model):
    from teragram.builder.build import build_from_ids

    from tests.conftest import random_docs

    docs = random_docs(np.random.default_rng(0), 60, 5, 40, 1000)
    build_from_ids(docs, tmp_path / "i", tokenizer_model, shard_tokens=700)
    idx = Index(tmp_path / "i")
    assert len(idx.shards) > 1
    for s in idx.shards:
        tok = np.asarray(s.tok)
        brute = brute_sa(tok, idx.sep)
        assert s.sa.to_numpy().tolist() == brute
        sa = np.asarray(brute)
        bm = np.asarray(s.samax)
        assert bm[: len(sa[::64])].tolist() == [int(sa[i : i + 64].max()) for i in range(0, len(sa), 64)]


def test_suffix_array_u32_tokens():
    rng = np.random.default_rng(1)
    sep = 0xFFFFFFFF
    tok = rng.integers(70000, 70004, size=300).astype(np.uint32)
    tok[[50, 120, 299]] = sep
    sa = suffix_array(tok, sep)
    assert sa.tolist() == brute_sa(tok, sep)
    assert fmt.token_dtype(65535) == np.uint16 and fmt.token_dtype(65536) == np.uint32


def test_report_counts_skips(real_index):
    m = fmt.read_json(real_index / "manifest.json")
    assert m["skipped"]["counts"] == {"binary": 1, "empty": 1, "invalid-utf8": 1}
    assert any(e.endswith("zz_binary.dat") for e in m["skipped"]["examples"]["binary"])
    ms = MetaStore(real_index)
    assert ms.manifest() == m
    assert m["counts"]["docs"] == sum(s["n_docs"] for s in m["shards"])


def test_long_document_split_into_parts(tmp_path, tokenizer_model, corpus_dir):
    big = "\n".join(p.read_text() for p in sorted(corpus_dir.iterdir()) if not p.name.startswith("zz_"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "big.txt").write_text(big)
    out = tmp_path / "i"
    build(
        BuildConfig(
            inputs=(str(tmp_path / "c"),), out=str(out), tokenizer=str(tokenizer_model), shard_tokens=5000, workers=1, progress=False
        )
    )
    idx = Index(out)
    parts = [(idx.meta.doc(s.first_doc + k)["part"], ids) for s, k, ids in _docs_of(idx)]
    assert [p for p, _ in parts] == list(range(len(parts))) and len(parts) > 3
    assert idx.decode(np.concatenate([ids for _, ids in parts])) == big


def test_errors(tmp_path, corpus_dir, tokenizer_model):
    with pytest.raises(BuildError, match="input not found"):
        build(BuildConfig(inputs=(str(tmp_path / "missing"),), out=str(tmp_path / "o1"), progress=False))
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(BuildError, match="unreadable tokenizer model"):
        build(BuildConfig(inputs=(str(corpus_dir),), out=str(tmp_path / "o2"), tokenizer=str(bad), progress=False))
    with pytest.raises(BuildError, match="cannot read tokenizer model"):
        build(BuildConfig(inputs=(str(corpus_dir),), out=str(tmp_path / "o3"), tokenizer=str(tmp_path / "nope.model"), progress=False))
    out = tmp_path / "o4"
    build(
        BuildConfig(inputs=(str(corpus_dir),), out=str(out), tokenizer=str(tokenizer_model), shard_tokens=100000, workers=1, progress=False)
    )
    with pytest.raises(BuildError, match="holds a different index"):
        build(
            BuildConfig(
                inputs=(str(corpus_dir),), out=str(out), tokenizer=str(tokenizer_model), shard_tokens=5000, workers=1, progress=False
            )
        )
    (tmp_path / "o5").mkdir()
    (tmp_path / "o5" / "x").write_text("x")
    with pytest.raises(BuildError, match="not empty"):
        build(BuildConfig(inputs=(str(corpus_dir),), out=str(tmp_path / "o5"), progress=False))


def test_cli_one_line_errors(tmp_path, corpus_dir):
    r = subprocess.run(
        [sys.executable, "-m", "teragram.builder.cli", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 2 and r.stderr.strip() == f"build-index: error: input not found: {tmp_path / 'nope'}"


def test_resume_after_sigkill_is_byte_identical(tmp_path, corpus_dir):
    def args(out):
        return [str(corpus_dir), "--out", str(out), "--vocab-size", "600", "--shard-tokens", "30000", "--workers", "2", "--quiet"]

    ref = tmp_path / "ref"
    subprocess.run([sys.executable, "-m", "teragram.builder.cli", *args(ref)], cwd=REPO, check=True)
    reference = built_files(ref)
    n_shards = fmt.read_json(ref / "manifest.json")["counts"]["shards"]
    assert n_shards >= 3
    milestones = {
        "state written": lambda o: (o / "build-state.json").exists(),
        "tokenizer written": lambda o: (o / "tokenizer.model").exists(),
        "tokens of shard 1": lambda o: (o / "shards/000001/tokens.bin").exists(),
        "suffix array of shard 1": lambda o: (o / "shards/000001/sa.bin").exists(),
        "shard 2 done": lambda o: (o / "shards/000002.done").exists(),
        "metadata": lambda o: (o / ".meta.lmdb.tmp").exists() or (o / "meta.lmdb").exists(),
    }
    kills = 0
    for name, when in milestones.items():
        out = tmp_path / name.replace(" ", "_")
        killed = run_and_kill(args(out), out, when)
        kills += killed
        # a second kill during the resumed run, at the same milestone or later
        if killed:
            run_and_kill(args(out), out, lambda o: (o / "shards/000002.done").exists())
        subprocess.run([sys.executable, "-m", "teragram.builder.cli", *args(out)], cwd=REPO, check=True)
        assert built_files(out) == reference, name
        shutil.rmtree(out)
    assert kills >= len(milestones) - 1  # the build was really interrupted (a fast one may finish first)


def _no_writes_beyond(limit: int):
    """preexec_fn: files of this process and its children cannot grow past limit bytes (EFBIG,
    what a full disk is to the writer), SIGXFSZ ignored so that the write fails instead."""
    import resource

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_write_that_fails_is_one_line_and_a_rerun_completes_the_same_index(tmp_path, corpus_dir):
    """A build whose writes start failing part way (no room for a file) stops with one line
    naming the cause and the file; the same command, once writes succeed, completes the index
    byte for byte as a build that never failed."""

    def args(out):
        return [str(corpus_dir), "--out", str(out), "--vocab-size", "600", "--shard-tokens", "60000", "--workers", "1", "--quiet"]

    ref, out = tmp_path / "ref", tmp_path / "out"
    subprocess.run([sys.executable, "-m", "teragram.builder.cli", *args(ref)], cwd=REPO, check=True)
    big = max(p.stat().st_size for p in ref.rglob("*") if p.is_file())
    r = subprocess.run(
        [sys.executable, "-m", "teragram.builder.cli", *args(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        preexec_fn=_no_writes_beyond(big // 2),
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"build-index: error: File too large: {out}/"), r.stderr
    assert "rerun the same command" in lines[0]
    subprocess.run([sys.executable, "-m", "teragram.builder.cli", *args(out)], cwd=REPO, check=True)
    assert built_files(out) == built_files(ref)


def test_a_second_build_of_the_same_output_is_refused_while_one_runs(tmp_path, corpus_dir, tokenizer_model):
    """Two builds of one --out would delete each other's temporary files: while a build holds
    the output (its state locked), another is refused in one line and removes nothing; once it
    ends, the same command resumes."""
    from teragram.builder.build_state import prepare_out

    cfg = BuildConfig(inputs=(str(corpus_dir),), out=str(tmp_path / "idx"), tokenizer=str(tokenizer_model), workers=1, progress=False)
    out, held = prepare_out(cfg)  # a build that is running
    tmp = out / "shards" / ".tokens.bin.tmp-1"
    tmp.write_bytes(b"being written")
    with pytest.raises(BuildError, match="another build-index is writing"):
        build(cfg)
    assert tmp.read_bytes() == b"being written"
    held.close()
    assert build(cfg)["counts"]["docs"] > 0
    assert not tmp.exists()
