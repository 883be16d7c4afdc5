"""Evaluation streamed a chunk of documents at a time (model/evaluation/stream.py, mixing.py):
the figures do not depend on the chunk size; each path against its in-memory oracle."""

from __future__ import annotations

import json

import numpy as np
import pytest
from teragram.index.engine import Index
from teragram.model.checkpoint import load_model

from tests.model.conftest import train_tiny


@pytest.fixture(scope="module")
def plain(held_root):
    train_tiny(held_root, "stream-plain", max_steps=30)
    return load_model(held_root / "stream-plain")[0]


@pytest.fixture
def quick_fits(monkeypatch):
    """Gate fits of 40 L-BFGS iterations: every comparison is between two paths of one fit."""
    from teragram.model.mixture import gate as gate_mod

    monkeypatch.setitem(gate_mod.fit_weights.__kwdefaults__, "steps", 40)
    monkeypatch.setitem(gate_mod.Gate.fit.__func__.__kwdefaults__, "steps", 40)


def _figures(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in ("stages_s", "gate_fit_rows")}


def _close(a, b, rel=1e-9):
    """Two reports equal in every count and within rel in every float (sums in another order)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _close(a[k], b[k], rel)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=rel)
    else:
        assert a == b


def test_the_figures_do_not_depend_on_the_chunk_size(held_root, plain, quick_fits):
    """Plain, a fitted gate (t), that gate applied with decontamination, and infini-gram's
    interpolation, each evaluated in one chunk and in chunks of ~100 tokens: the same figures,
    the same gate (its fit rows spilled to disk and read back in the same order)."""
    from teragram.model.evaluation.perplexity import EvalOptions, heldout_report

    held, idx = held_root / "held", held_root / "idx"
    n_docs = len(json.loads((held / "000000.done").read_text())["docs"])
    assert n_docs >= 6
    out = {}
    for chunk in (1 << 30, 100):
        plain_r, _ = heldout_report(plain, idx, held, opts=EvalOptions(chunk_tokens=chunk))
        fit_r, gate = heldout_report(plain, idx, held, opts=EvalOptions(fit_gate=True, cont_cache=False, chunk_tokens=chunk))
        dec_r, _ = heldout_report(plain, idx, held, opts=EvalOptions(gate=gate, decontaminate=True, chunk_tokens=chunk))
        inf_r, lams = heldout_report(plain, idx, held, opts=EvalOptions(baseline="infini-gram", chunk_tokens=chunk))
        out[chunk] = (_figures(plain_r), _figures(fit_r), gate.W, _figures(dec_r), _figures(inf_r), lams)
    one, many = out.values()
    for a, b in zip(one, many, strict=True):
        if isinstance(a, np.ndarray):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        else:
            _close(a, b, rel=1e-6)
    assert one[0]["tokens"] == one[1]["tokens"] > n_docs


def test_the_fit_on_a_sample_is_the_fit_on_those_rows(held_root, plain, quick_fits):
    """--fit-rows N: each candidate is fit on a fixed random sample of N tokens; with N at least
    the kept tokens, on all of them (the in-memory fit of `gated`)."""
    from teragram.model.evaluation.mixing import gated
    from teragram.model.evaluation.perplexity import EvalOptions, cont_cache_of, heldout_report, token_eval
    from teragram.model.mixture import cont_cache as cc
    from teragram.model.mixture.estimates import heldout_estimates

    held, idx = held_root / "held", Index(held_root / "idx")
    r = token_eval(plain, held, idx.eos_id, idx.sep, hidden=cc.KEY)
    r["cont_cache"] = cont_cache_of(r, None)
    mixed, gate, info = gated(r, heldout_estimates(idx, held), np.ones(len(r["nll"]), bool), EvalOptions(fit_gate=True))
    rep, gate2 = heldout_report(plain, idx, held, opts=EvalOptions(fit_gate=True))
    _close(rep["gate_choice"], info["gate_choice"], rel=1e-6)
    assert gate2.components == gate.components
    assert rep["perplexity"] == pytest.approx(float(np.exp(mixed.mean())), rel=1e-6)
    small, _ = heldout_report(plain, idx, held, opts=EvalOptions(fit_gate=True, fit_rows=500))
    assert small["gate_fit_rows"] == {"fit_on": 500, "kept": len(r["nll"])}
    assert abs(small["perplexity"] / rep["perplexity"] - 1) < 0.2  # a sample of 500 tokens: near, not equal


def test_decontamination_reads_the_estimates_lengths(held_root):
    """The share of each document's 13-grams in the index from the estimates' ∞-gram lengths
    (what the stream computes anyway) equals the one from the held-out features' match lengths."""
    from teragram.index.heldout import contamination
    from teragram.model.evaluation.mixing import doc_shares
    from teragram.model.mixture.estimates import heldout_docs, infgram_lengths

    held, idx = held_root / "held", Index(held_root / "idx")
    docs = heldout_docs(held)
    shares = doc_shares(infgram_lengths(idx, docs), docs)
    np.testing.assert_array_equal(shares, contamination(held, idx))
    assert shares.max() > 0.5  # the held-out text holds near-copies of indexed documents


def test_a_corpus_is_read_in_chunks_with_the_cli(held_root, plain, tmp_path, capsys):
    """`teragram eval --corpus` streams the text (no features directory is written): the same
    figures with --chunk-tokens 100 as in one chunk; bad --chunk-tokens is refused in one line."""
    from teragram.serve.main import main

    run = held_root / "stream-plain"
    base = ["eval", "--checkpoint", str(run), "--index", str(held_root / "idx"), "--corpus", str(held_root / "held-text"), "--json"]
    got = []
    for chunk in ("1000000", "100"):
        assert main([*base, "--chunk-tokens", chunk, "--decontaminate"]) == 0
        got.append(_figures(json.loads(capsys.readouterr().out)))
    _close(got[0], got[1])
    with pytest.raises(SystemExit):
        main([*base, "--chunk-tokens", "0"])
    assert "expected at least 1" in capsys.readouterr().err


def test_out_of_memory_names_the_setting(held_root, plain, monkeypatch, capsys):
    """A failure to allocate while evaluating is one line naming --chunk-tokens."""
    from teragram.model.evaluation import perplexity
    from teragram.serve.main import main

    def oom(*a, **kw):
        raise MemoryError

    monkeypatch.setattr(perplexity, "forward_docs", oom)
    args = [
        "eval",
        "--checkpoint",
        str(held_root / "stream-plain"),
        "--index",
        str(held_root / "idx"),
        "--corpus",
        str(held_root / "held-text"),
    ]
    assert main([*args, "--chunk-tokens", "5000", "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["teragram: error: out of memory with --chunk-tokens 5,000: lower it"]


def test_prefetch_hands_on_the_producers_error():
    from teragram.model.evaluation.stream import prefetch

    def items():
        yield 1
        raise ValueError("bad chunk")

    it = prefetch(items())
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad chunk"):
        next(it)
