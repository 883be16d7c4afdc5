"""Documents longer than a chunk, read in pieces (model/evaluation/stream.py): every figure is the
one of the same stream with each long document read whole (the oracle), and no chunk holds more
than chunk_tokens targets."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from teragram.index.engine import Index
from teragram.model.evaluation.mixing import EvalOptions, mix_stream, needs_states
from teragram.model.evaluation.perplexity import model_chunks
from teragram.model.evaluation.stream import corpus_chunks
from teragram.model.gpt import GPT, GPTConfig
from teragram.model.mixture import cont_cache as cc

CHUNK = 300  # targets per chunk: the long documents below are 4-15 chunks
T = 64  # the models' context: pieces are cut at multiples of it


@pytest.fixture(scope="module")
def setup(held_root, tmp_path_factory):
    """The index, a corpus of short documents and long ones (two new documents end to end; three
    indexed documents end to end, which decontamination drops), and two untrained tiny
    models: plain, and one that reads index features (their match capped at 8 tokens)."""
    from tests.conftest import real_texts

    idx = Index(held_root / "idx")
    new = [t for _, t in real_texts(40, 3000)[34:40]]  # documents the index does not hold (nor near-copies of them)
    train = [p.read_text()[:2500] for p in sorted((held_root / "train").iterdir())]
    texts = [new[0][:500], new[1] + "\n" + new[2], new[3][:300], "\n".join(train[:2]), new[4][:800], new[5][:2000]]
    corpus = tmp_path_factory.mktemp("long") / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    torch.manual_seed(0)
    base = dict(vocab_size=idx.vocab_size, block_size=T, mixture=False)
    plain = GPT(GPTConfig.preset("tiny", use_index=False, **base))
    fed = GPT(GPTConfig.preset("tiny", use_index=True, max_match=8, top_k=2, **base))
    return idx, corpus, plain, fed


@pytest.fixture
def quick_fits(monkeypatch):
    """Gate fits of 5 L-BFGS iterations: every comparison is between two paths of one fit."""
    from teragram.model.mixture import gate as gate_mod

    monkeypatch.setitem(gate_mod.fit_weights.__kwdefaults__, "steps", 5)
    monkeypatch.setitem(gate_mod.Gate.fit.__func__.__kwdefaults__, "steps", 5)


def _chunks(setup, model, opts, split: bool):
    idx, corpus, _, _ = setup
    hidden = "final" if opts.baseline == "knn" else needs_states(opts) and cc.KEY
    chunks = corpus_chunks(idx, [str(corpus)], opts.chunk_tokens, split=T if split else None)
    return model_chunks(model, idx, chunks, hidden=hidden, batch=1)  # a window at a time: the same arithmetic in both


def _both(setup, model, opts):
    """(report, fitted) of the stream read in pieces and with long documents whole."""
    return [mix_stream(_chunks(setup, model, opts, split), setup[0], opts) for split in (True, False)]


def _close(a, b, rel):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            if k != "stages_s":
                _close(a[k], b[k], rel)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=rel)
    else:
        assert a == b


def test_pieces_are_bounded_and_cover_each_document(setup):
    """The long documents come in pieces of at most CHUNK targets, cut at multiples of T, with
    their earlier tokens; read whole they are chunks of thousands."""
    idx, corpus, plain, _ = setup
    split = list(corpus_chunks(idx, [str(corpus)], CHUNK, split=T))
    whole = list(corpus_chunks(idx, [str(corpus)], CHUNK))
    assert max(ch.targets for ch in split) <= CHUNK < max(ch.targets for ch in whole) // 4
    assert sum(ch.targets for ch in split) == sum(ch.targets for ch in whole)
    docs = {ch.first: ch.docs[0] for ch in whole if len(ch.docs) == 1}
    for ch in split:
        if ch.piece:
            assert ch.offset % T == 0 and len(ch.prefix) == ch.offset
            np.testing.assert_array_equal(np.concatenate([ch.prefix, ch.docs[0]]), docs[ch.first][: ch.offset + len(ch.docs[0])])
    assert sum(ch.piece for ch in split) >= 10


def test_the_model_and_a_gate_with_the_continuous_cache(setup, quick_fits):
    """The model alone, a fitted gate (the continuous cache among its candidates: the scale fit on
    the first chunk, whole in both), that gate applied with decontamination (one long document
    dropped), and the gate fit on decontaminated text: the same figures read in pieces."""
    plain = setup[2]
    (a, _), (b, _) = _both(setup, plain, EvalOptions(chunk_tokens=CHUNK))
    _close(a, b, 1e-9)
    (a, g1), (b, g2) = _both(setup, plain, EvalOptions(fit_gate=True, chunk_tokens=CHUNK))
    _close(a, b, 1e-9)
    assert g1.cont_cache == g2.cont_cache and g1.components == g2.components
    np.testing.assert_allclose(g1.W, g2.W, rtol=1e-9)
    gate = g1 if g1.cont_cache is not None else None
    if gate is None:  # the fit chose (t): a gate that reads the cache at the scale fit
        from teragram.model.mixture.gate import Gate

        W = np.random.default_rng(0).normal(0, 0.1, (g1.W.shape[0], g1.W.shape[1] + len(cc.FACTORS)))
        gate = Gate(W, g1.components + cc.component_names(), cc.ContCache(1.0))
    (a, _), (b, _) = _both(setup, plain, EvalOptions(gate=gate, decontaminate=True, chunk_tokens=CHUNK))
    assert a["decontaminated"] == {"dropped_docs": 1, "docs": 6}
    _close(a, b, 1e-9)
    (a, g1), (b, g2) = _both(setup, plain, EvalOptions(fit_gate=True, decontaminate=True, chunk_tokens=CHUNK))
    _close(a, b, 1e-9)


def test_baselines_and_a_model_reading_index_features(setup, quick_fits):
    """infini-gram's and infini-gram+cache's fitted interpolations, and a model whose inputs are
    the index's features (a piece's read the tokens before it): the same figures in pieces."""
    plain, fed = setup[2], setup[3]
    for name in ("infini-gram", "infini-gram+cache"):
        (a, pa), (b, pb) = _both(setup, plain, EvalOptions(baseline=name, chunk_tokens=CHUNK))
        _close(a, b, 1e-9)
    (a, _), (b, _) = _both(setup, fed, EvalOptions(chunk_tokens=CHUNK))
    _close(a, b, 1e-9)
