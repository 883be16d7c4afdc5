"""Documents longer than a chunk, read in pieces (model/evaluation/stream.py): every figure is the
one of the same stream with each long document read whole (the oracle), and no chunk holds more
than chunk_tokens targets."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from teragram.index.engine import Index
from teragram.model.evaluation.mixing import EvalOptions, mix_stream
from teragram.model.evaluation.perplexity import model_chunks
from teragram.model.evaluation.stream import corpus_chunks
from teragram.model.gpt import GPT, GPTConfig
from teragram.model.mixture import cont_cache as cc

CHUNK = 300  # targets per chunk: the long documents below are 2-5 chunks
T = 64  # the models' context: pieces are cut at multiples of it


@pytest.fixture(scope="module")
def setup(held_root, tmp_path_factory):
    """The index, a corpus of short documents and long ones (two new documents end to end; three
    indexed documents end to end, which decontamination drops), and two untrained one-layer
    models: plain, and one that reads index features (their match capped at 8 tokens)."""
    from tests.conftest import real_texts

    idx = Index(held_root / "idx")
    new = [t for _, t in real_texts(40, 1500)[34:40]]  # documents the index does not hold (nor near-copies of them)
    train = [p.read_text()[:1500] for p in sorted((held_root / "train").iterdir())]
    texts = [new[0][:500], new[1] + "\n" + new[2], new[3][:300], "\n".join(train[:2]), new[4][:800], new[5]]
    corpus = tmp_path_factory.mktemp("long") / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    torch.manual_seed(0)
    base = dict(vocab_size=idx.vocab_size, block_size=T, n_layer=1, n_head=2, n_embd=64, mixture=False)
    plain = GPT(GPTConfig.preset("tiny", use_index=False, **base))
    fed = GPT(GPTConfig.preset("tiny", use_index=True, max_match=8, top_k=2, **base))
    return idx, corpus, plain, fed


@pytest.fixture
def quick_fits(monkeypatch):
    """Gate fits of 3 L-BFGS iterations: every comparison is between two paths of one fit."""
    from teragram.model.mixture import gate as gate_mod

    monkeypatch.setitem(gate_mod.fit_weights.__kwdefaults__, "steps", 3)
    monkeypatch.setitem(gate_mod.Gate.fit.__func__.__kwdefaults__, "steps", 3)


BATCH = 2  # windows run at a time: pieces are cut at multiples of T * BATCH (2 pieces of a chunk), the model's batches are the same


def _chunks(setup, model, split: bool, chunk_tokens: int = CHUNK):
    idx, corpus, _, _ = setup
    chunks = corpus_chunks(idx, [str(corpus)], chunk_tokens, split=T * BATCH if split else None)
    return model_chunks(model, idx, chunks, hidden=cc.KEY, batch=BATCH)


@pytest.fixture(scope="module")
def run(setup):
    """The plain model's chunks (its outputs and key states), read in pieces and whole, once."""
    return {split: list(_chunks(setup, setup[2], split)) for split in (True, False)}


def _both(setup, run, opts):
    """(report, fitted) of the stream read in pieces and with long documents whole."""
    from dataclasses import replace

    return [mix_stream([replace(ch, r=dict(ch.r)) for ch in run[split]], setup[0], opts) for split in run]


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
    split = list(corpus_chunks(idx, [str(corpus)], CHUNK, split=T * BATCH))
    whole = list(corpus_chunks(idx, [str(corpus)], CHUNK))
    assert max(ch.targets for ch in split) <= CHUNK < max(ch.targets for ch in whole) // 4
    assert sum(ch.targets for ch in split) == sum(ch.targets for ch in whole)
    docs = {ch.first: ch.docs[0] for ch in whole if len(ch.docs) == 1}
    for ch in split:
        if ch.piece:
            assert ch.offset % (T * BATCH) == 0 and len(ch.prefix) == ch.offset
            np.testing.assert_array_equal(np.concatenate([ch.prefix, ch.docs[0]]), docs[ch.first][: ch.offset + len(ch.docs[0])])
    assert sum(ch.piece for ch in split) >= 10


def test_the_model_and_a_gate_with_the_continuous_cache(setup, run, quick_fits):
    """A gate fit on decontaminated text (the continuous cache among its candidates, its scale fit
    on the first chunk, whole in both; one long document dropped: its keep known at its last
    piece; the model alone and all documents reported too): the same figures, the same fit."""
    (a, g1), (b, g2) = _both(setup, run, EvalOptions(fit_gate=True, decontaminate=True, chunk_tokens=CHUNK))
    assert a["decontaminated"] == {"dropped_docs": 1, "docs": 6}
    _close(a, b, 1e-9)
    assert g1.cont_cache == g2.cont_cache is not None and g1.components == g2.components
    np.testing.assert_allclose(g1.W, g2.W, rtol=1e-9)


def _cache_gate(spec):
    """A gate over every estimate and the continuous cache at spec's scale, of fixed random weights."""
    from teragram.model.mixture.estimates import COMPONENTS
    from teragram.model.mixture.gate import Gate, gate_features

    z = np.zeros(0)
    width = gate_features(z, z, [z] * len(COMPONENTS), [z] * len(COMPONENTS), [z] * len(COMPONENTS), z).width
    W = np.random.default_rng(0).normal(0, 0.1, (width, len(COMPONENTS) + len(spec.factors)))
    return Gate(W, COMPONENTS + spec.names, spec)


def test_baselines_and_a_model_reading_index_features(setup, run, quick_fits):
    """infini-gram's and infini-gram+cache's fitted interpolations, and a model whose inputs are
    the index's features (a piece's read the tokens before it): the same figures in pieces."""
    for name in ("infini-gram", "infini-gram+cache"):
        (a, pa), (b, pb) = _both(setup, run, EvalOptions(baseline=name, chunk_tokens=CHUNK))
        _close(a, b, 1e-9)
    fed = {split: list(_chunks(setup, setup[3], split)) for split in (True, False)}
    (a, _), (b, _) = _both(setup, fed, EvalOptions(chunk_tokens=CHUNK))
    _close(a, b, 1e-9)


def test_saved_outputs_in_pieces(setup, run, tmp_path):
    """Outputs saved a piece at a time are the outputs saved with each document whole (tokens,
    documents, bytes, every target's numbers and the continuous cache's); a gate reading the
    continuous cache, applied to them in pieces (eval --outputs), gives the figures of one chunk."""
    from dataclasses import replace

    from teragram.model.evaluation.outputs import OutputsWriter, load_outputs, outputs_report, saving

    idx = setup[0]
    saved = []
    for split in (True, False):
        w = OutputsWriter(tmp_path / str(split), idx, checkpoint="untrained", step=0)
        for _ in saving((replace(ch, r=dict(ch.r)) for ch in run[split]), w):
            pass
        saved.append(load_outputs(tmp_path / str(split)))
    a, b = saved
    assert a.manifest == b.manifest | {"checkpoint": a.manifest["checkpoint"]}
    for name in ("nll", "maxp", "top", "target", "doc", "pos"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    np.testing.assert_array_equal(a.cont_cache[1], b.cont_cache[1])
    for name in ("tokens.bin", "docs.bin"):
        assert (a.path / "000000" / name).read_bytes() == (b.path / "000000" / name).read_bytes()
    gate = _cache_gate(a.cont_cache[0])
    pieces, _ = outputs_report(a, idx, EvalOptions(gate=gate, decontaminate=True, chunk_tokens=CHUNK))
    whole, _ = outputs_report(b, idx, EvalOptions(gate=gate, decontaminate=True, chunk_tokens=1 << 40))
    assert pieces["decontaminated"]["dropped_docs"] == 1
    _close(pieces, whole, 1e-9)


def test_chunks_looked_up_at_once(setup, run, quick_fits):
    """With 8 estimate workers the index's side looks 4 chunks up at once (a later piece waiting
    for the one before it): a fit with decontamination and a given gate's mixture (its weights
    computed beside the lookups) give the figures of one chunk at a time, on one thread."""
    from dataclasses import replace

    from teragram.model.evaluation.mixing import inflight

    assert inflight(8) == (4, 2) and inflight(1) == inflight(2)[:1] + (1,)
    split = {True: run[True]}
    opts = EvalOptions(fit_gate=True, decontaminate=True, chunk_tokens=CHUNK)
    (one, g1), (many, g2) = (_both(setup, split, replace(opts, workers=w))[0] for w in (1, 8))
    _close(one, many, 1e-12)
    np.testing.assert_array_equal(g1.W, g2.W)
    gate = _cache_gate(g1.cont_cache)
    one, many = (_both(setup, split, EvalOptions(gate=gate, decontaminate=True, workers=w))[0][0] for w in (1, 8))
    _close(one, many, 1e-12)
