"""Shared fixtures: real text from the embedded corpus, small tokenizers, indexes built once."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "data" / "default"


def real_texts(n_docs: int = 30, max_chars: int = 20000) -> list[tuple[str, str]]:
    """(relative path, text) of real documents from the embedded corpus, deterministic."""
    out = []
    for p in sorted((DEFAULT / "train" / "linux-doc").rglob("*.gz")):
        text = gzip.open(p, "rt", encoding="utf-8").read()[:max_chars]
        out.append((str(p.relative_to(DEFAULT)), text))
        if len(out) >= n_docs:
            break
    jargon = gzip.open(DEFAULT / "train" / "jargon" / "jargon.txt.gz", "rt", encoding="utf-8").read()
    out.append(("jargon/jargon.txt", jargon[200000 : 200000 + max_chars]))
    return out


def write_dup_corpus(train_dir: Path, held_dir: Path, n_docs: int, max_chars: int, n_held: int) -> None:
    """Real text with every third document copied (a few words' case changed) into train_dir,
    and held-out near-copies of n_held documents (every 25th word upper-cased) into held_dir."""
    train_dir.mkdir()
    held_dir.mkdir()
    texts = [t for _, t in real_texts(n_docs, max_chars)]
    for i, t in enumerate(texts):
        (train_dir / f"{i:03d}.txt").write_text(t)
        if i % 3 == 0:
            (train_dir / f"{i:03d}-copy.txt").write_text(t.replace("the ", "The ", 3))
    rng = np.random.default_rng(0)
    for i in rng.choice(len(texts), n_held, replace=False):
        words = texts[i].split(" ")
        for j in rng.choice(len(words), len(words) // 25, replace=False):
            words[j] = words[j].upper()
        (held_dir / f"h{i:03d}.txt").write_text(" ".join(words))


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """A small real corpus as plain files, plus one file of each kind the builder must skip."""
    d = tmp_path_factory.mktemp("corpus")
    for rel, text in real_texts():
        p = d / rel.replace("/", "__").removesuffix(".gz")
        p.write_text(text)
    (d / "zz_binary.dat").write_bytes(b"\x00\x01\x02 binary")
    (d / "zz_bad.txt").write_bytes(b"\xff\xfe not utf-8")
    (d / "zz_empty.txt").write_text("  \n")
    return d


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory) -> Path:
    """A 1000-piece tokenizer trained on real text (shared by index tests)."""
    from teragram.index import tokenizer

    d = tmp_path_factory.mktemp("tok")
    model = tokenizer.train((t for _, t in real_texts(60)), 1000, threads=1)
    p = d / "tok.model"
    p.write_bytes(model)
    return p


def train_bpe(texts, vocab: int, path: Path, *, lowercase: bool = False, special: tuple[str, ...] = ("<|endoftext|>",)) -> Path:
    """A byte-level BPE (GPT-2's scheme) trained with `tokenizers` on the texts, saved as a
    tokenizer.json; lowercase: with a normalizer that lowercases (it does not round-trip)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(special), initial_alphabet=alphabet, show_progress=False)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def tiny_hf_model(out: Path, texts, vocab: int = 1200, eos: str = "<|endoftext|>") -> Path:
    """A model directory as a user brings one (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json): a tiny GPT-2 of random weights made with `transformers`, and a
    byte-level BPE trained with `tokenizers` on the texts, its EOS `eos`."""
    import torch
    import transformers

    train_bpe(texts, vocab, out / "tokenizer.json", special=(eos,))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), eos_token=eos)
    cfg = transformers.GPT2Config(
        vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory) -> Path:
    """A 2000-id byte-level BPE trained with `tokenizers` on real text (its tokenizer.json)."""
    return train_bpe((t for _, t in real_texts(60)), 2000, tmp_path_factory.mktemp("hf") / "tokenizer.json")


@pytest.fixture(scope="session")
def real_index(tmp_path_factory, corpus_dir, tokenizer_model) -> Path:
    """The small real corpus indexed in several shards."""
    from teragram.builder.build import BuildConfig, build

    out = tmp_path_factory.mktemp("idx") / "real"
    build(
        BuildConfig(inputs=(str(corpus_dir),), out=str(out), tokenizer=str(tokenizer_model), shard_tokens=40000, workers=1, progress=False)
    )
    return out


def random_docs(rng: np.random.Generator, n_docs: int, alphabet: int, max_len: int, vocab: int) -> list[np.ndarray]:
    """Random documents over a small alphabet of real ids (so n-grams repeat a lot)."""
    ids = rng.choice(np.arange(3, vocab), size=alphabet, replace=False)
    return [ids[rng.integers(0, alphabet, size=int(rng.integers(1, max_len)))] for _ in range(n_docs)]


def random_cnf(rng, docs, vocab) -> list[list[list[int]]]:
    """An AND/OR query (index/cnf.py) of 1-3 clauses of 1-3 terms: n-grams of 1-3 tokens from the
    documents, a few (random ids) absent."""
    out = []
    for _ in range(int(rng.integers(1, 4))):
        clause = []
        for _ in range(int(rng.integers(1, 4))):
            if rng.random() < 0.1:
                clause.append([int(x) for x in rng.integers(3, vocab, size=int(rng.integers(2, 4)))])
                continue
            d = docs[rng.integers(len(docs))]
            m = int(rng.integers(1, 4))
            p = int(rng.integers(0, max(1, len(d) - m + 1)))
            clause.append([int(x) for x in d[p : p + m]] or [int(rng.integers(3, vocab))])
        out.append(clause)
    return out


def copytree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def torchrun(script: Path, nproc: int = 2, timeout: float = 900) -> None:
    """Run `script` on `nproc` local processes under torchrun (gloo; a free port from --standalone).
    On failure the test fails with every rank's own output, not only the launcher's."""
    logs = script.parent / f"{script.stem}-logs"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--log-dir={logs}",
        "--redirects=3",
        str(script),
    ]
    r = subprocess.run(
        cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1"), capture_output=True, text=True, timeout=timeout
    )
    if r.returncode:
        ranks = "\n".join(f"--- {p.relative_to(logs)}\n{p.read_text()[-2000:]}" for p in sorted(logs.rglob("std*.log")))
        pytest.fail(f"torchrun exited {r.returncode}\n{ranks}\n--- launcher\n{r.stderr[-1000:]}", pytrace=False)


# `make test` runs the suite on two processes (pytest-xdist, --dist loadgroup): each test file is
# one group (its module-scoped indexes and models are built once), but for the benchmarks' smoke
# runs, which share only a session fixture and go one by one; the files that start Ray share one
# group, so that no two Ray instances run at once. The longest files go first, so that neither
# process is left with a long one at the end (ordered by their time on the 2-core VM).
RAY_FILES = {"test_ray.py", "test_cluster.py"}
ONE_BY_ONE = {"tests/benchmarks/test_smoke.py"}
LONGEST_FIRST = [
    "tests/test_readme.py",
    "tests/model/test_model.py",
    "tests/index/test_widths.py",
    "tests/serve/test_page.py",
    "tests/model/test_own_model.py",
    "tests/model/test_hf.py",
    "tests/index/test_cluster.py",
    "tests/builder/test_ray.py",
    "tests/model/test_sample.py",
    "tests/benchmarks/test_smoke.py",
    "tests/model/test_cont_cache.py",
    "tests/model/test_distributed.py",
    "tests/builder/test_features.py",
    "tests/builder/test_build.py",
]


if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":  # the workers share the cores: torch on one thread each, not oversubscribed
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Under --dist loadgroup, pytest-xdist suffixes each grouped test's id with its group; where a
    pytest release stops that (9.2 with xdist 3.8), every module fixture is built on both workers
    and Ray files run at once: refuse to run rather than run slowly."""
    if getattr(session.config.option, "loadgroup", False) and session.items and not any("@" in i.nodeid for i in session.items):
        raise pytest.UsageError(
            f"pytest-xdist's loadgroup does not group under pytest {pytest.__version__}; install what pyproject.toml pins"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = str(item.path.relative_to(REPO))
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a file's tests stay together and in order
    for item in items:
        path = str(item.path.relative_to(REPO))
        group = "ray" if item.path.name in RAY_FILES else item.nodeid if path in ONE_BY_ONE else path
        item.add_marker(pytest.mark.xdist_group(group))
