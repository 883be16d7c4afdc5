"""Fixtures shared by the tests of the gates (test_cont_cache.py): one small index with held-out
near-copies of its documents, built once per session; and the corpora that the training tests run
on (dup_setup, data_root: built once per test module)."""

from __future__ import annotations

import pytest
from teragram.builder.features import compute_features
from teragram.index.features import FeatureConfig
from teragram.model.training.train import TrainConfig, train

TINY = dict(preset="tiny", block_size=64, batch_size=8, log_every=5, progress=False, warmup=5, lr=3e-3, min_lr=3e-4, seed=3)


def make_held_root(root, tokenizer_model, n_docs: int = 30, max_chars: int = 5000, n_held: int = 6, shard_tokens: int = 40000):
    """Real text with duplicated documents in several shards and held-out near-copies (held-text/,
    their held-out features in held/), under root."""
    from teragram.builder.build import BuildConfig, build

    from tests.conftest import write_dup_corpus

    tr, held = root / "train", root / "held-text"
    root.mkdir(parents=True, exist_ok=True)
    write_dup_corpus(tr, held, n_docs, max_chars, n_held)
    build(
        BuildConfig(
            inputs=(str(tr),), out=str(root / "idx"), tokenizer=str(tokenizer_model), shard_tokens=shard_tokens, workers=1, progress=False
        )
    )
    compute_features(root / "idx", root / "held", FeatureConfig("held-out", 64, 1), corpus=[str(held)], progress=False)
    return root


@pytest.fixture(scope="session")
def held_root(tmp_path_factory, tokenizer_model):
    """make_held_root's, built once per session."""
    return make_held_root(tmp_path_factory.mktemp("held"), tokenizer_model)


def train_tiny(root, name, **kw) -> dict:
    """Train the tiny plain model on the root's index into ROOT/NAME (kw: TrainConfig fields)."""
    base = TINY | {"index": str(root / "idx"), "heldout": str(root / "held"), "out": str(root / name)}
    return train(TrainConfig(**(base | kw)))


@pytest.fixture(scope="module")
def dup_setup(tmp_path_factory, tokenizer_model):
    """A real-text corpus with duplicated documents, and held-out near-copies of some of them."""
    from tests.conftest import write_dup_corpus

    root = tmp_path_factory.mktemp("dup")
    train_dir, held_dir = root / "train", root / "held"
    write_dup_corpus(train_dir, held_dir, 40, 6000, 8)
    from teragram.builder.build import BuildConfig, build

    build(
        BuildConfig(
            inputs=(str(train_dir),), out=str(root / "idx"), tokenizer=str(tokenizer_model), shard_tokens=60000, workers=1, progress=False
        )
    )
    compute_features(root / "idx", root / "feats", FeatureConfig("exclude-doc", 64, 4), progress=False)
    compute_features(root / "idx", root / "held", FeatureConfig("held-out", 64, 4), corpus=[str(held_dir)], progress=False)
    return root


@pytest.fixture(scope="module")
def data_root(tmp_path_factory, tokenizer_model):
    """A small real-text index and its exclude-doc features."""
    from teragram.builder.build import BuildConfig, build

    from tests.conftest import real_texts

    root = tmp_path_factory.mktemp("trainfeat")
    (root / "txt").mkdir()
    for i, (_, t) in enumerate(real_texts(12, 4000)):
        (root / "txt" / f"{i:03d}.txt").write_text(t)
    build(BuildConfig(inputs=(str(root / "txt"),), out=str(root / "idx"), tokenizer=str(tokenizer_model), workers=1, progress=False))
    compute_features(root / "idx", root / "feats", FeatureConfig("exclude-doc", 64, 4), progress=False)
    return root
