"""Fixtures shared by the joint-training tests (test_joint.py, test_refit.py): one small index
with its exclude-doc features and training estimates, built once per session (it is the slow part);
and the corpora that the training tests run on (dup_setup, data_root: built once per test module)."""

from __future__ import annotations

import pytest
from teragram.builder.features import compute_features
from teragram.index.features import FeatureConfig
from teragram.model.mixture import joint
from teragram.model.training.train import TrainConfig, train

CAPS = (1, 2, 4, 8, 16, joint.INFGRAM_CAP)
TINY = dict(preset="tiny", block_size=64, batch_size=8, log_every=5, progress=False, warmup=5, lr=3e-3, min_lr=3e-4, seed=3)


def make_joint_root(root, tokenizer_model, n_docs: int = 30, max_chars: int = 5000, n_held: int = 6, shard_tokens: int = 40000):
    """Real text with duplicated documents in several shards, held-out near-copies (held-text/,
    their features in held/), exclude-doc features at every cap, and the joint estimates of the
    training positions, under root."""
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
    for c in CAPS:
        compute_features(root / "idx", root / f"len-{c}", FeatureConfig("exclude-doc", c, 4), progress=False)
    compute_features(root / "idx", root / "held", FeatureConfig("held-out", 64, 1), corpus=[str(held)], progress=False)
    joint.write_train_estimates(root / "idx", [root / f"len-{c}" for c in CAPS], root / "est", 4, workers=2, progress=False)
    return root


@pytest.fixture(scope="session")
def joint_root(tmp_path_factory, tokenizer_model):
    """make_joint_root's, built once per session."""
    return make_joint_root(tmp_path_factory.mktemp("joint"), tokenizer_model)


def train_tiny(root, name, **kw) -> dict:
    """Train the tiny model on the joint root's index into ROOT/NAME (kw: TrainConfig fields)."""
    base = TINY | {"index": str(root / "idx"), "heldout": str(root / "held"), "out": str(root / name)}
    return train(TrainConfig(**(base | kw)))


def joint_kw(root, **kw) -> dict:
    """TrainConfig fields of a jointly trained model over the joint root's estimates."""
    return dict(gate="joint", joint_features=tuple(str(root / f"len-{c}") for c in CAPS), joint_estimates=str(root / "est")) | kw


def other_tokenizer_checkpoint(run, tmp_path):
    """A copy of RUN's checkpoint (its files linked) whose joint gate claims estimates of
    another tokenizer: what a refusal is tested with."""
    import json

    ck = next((run / "checkpoints").iterdir())
    bad = tmp_path / "other-tokenizer" / ck.name
    bad.mkdir(parents=True)
    for f in ck.iterdir():
        if f.name != "config.json":
            (bad / f.name).symlink_to(f)
    meta = json.loads((ck / "config.json").read_text())
    meta["model"]["joint_tokenizer"] = "0" * 32
    (bad / "config.json").write_text(json.dumps(meta))
    return bad


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
