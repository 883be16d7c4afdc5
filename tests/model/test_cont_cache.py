"""The continuous cache in the post-hoc gate, (t+cc): its estimate against brute force, live equal
to bulk, the gate's candidates chosen on held-out validation documents, old gates loading as
before, and generation, scoring and saved outputs giving the bulk numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from teragram.index.engine import Index
from teragram.index.errors import TeragramError
from teragram.model.checkpoint import load_model
from teragram.model.mixture import cont_cache as cc
from teragram.model.mixture import estimates
from teragram.model.mixture import gate as gate_mod
from teragram.model.mixture.cont_cache import key_states

from tests.model.conftest import train_tiny


def brute_target_probs(h, target, doc, temps, window=10**9):
    out = np.zeros((len(target), len(temps)))
    for i in range(len(target)):
        js = [j for j in range(max(0, i - window), i) if doc[j] == doc[i]]
        if not js:
            continue
        d = np.array([((h[i] - h[j]) ** 2).sum() for j in js])
        for c, t in enumerate(temps):
            w = np.exp(-(d - d.min()) / t)
            w /= w.sum()
            out[i, c] = sum(wj for wj, j in zip(w, js, strict=True) if target[j] == target[i])
    return out


def test_target_probs_equal_brute_force_and_the_live_cache():
    rng = np.random.default_rng(5)
    n, C, V = 60, 7, 9
    h = rng.normal(size=(n, C))
    target = rng.integers(0, V, n)
    doc = np.repeat([0, 1, 2], [25, 1, 34])
    temps = [0.5, 2.0, 9.0]
    want = brute_target_probs(h, target, doc, temps)
    got = cc.target_probs(h, target, doc, temps)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    assert (got[cc.first_rows(doc)] == 0).all() and cc.first_rows(doc).sum() == 3
    # in blocks smaller than a document: the same
    old = cc.BLOCK
    try:
        cc.BLOCK = 4
        np.testing.assert_allclose(cc.target_probs(h, target, doc, temps), want, rtol=1e-9, atol=1e-12)
    finally:
        cc.BLOCK = old
    # live, one position at a time: the same distribution at the target, summing to one
    spec = cc.ContCache(scale=1.0, factors=tuple(temps))
    for a, b in ((0, 25), (26, 60)):
        live = cc.LiveCache(spec, V)
        assert live.distributions(h[a]) is None  # no history: the cache defers to the model
        live.add(a, h[a], target[a])
        for i in range(a + 1, b):
            dist = live.distributions(h[i])
            np.testing.assert_allclose(dist.sum(1), 1.0)
            np.testing.assert_allclose(dist[:, target[i]], want[i], rtol=1e-9, atol=1e-12)
            live.add(i, h[i], target[i])
        live.truncate(a + 3)
        assert live.end == a + 3 and live.distributions(h[a + 5], upto=a + 1).shape == (3, V)
    with pytest.raises(ValueError):
        live.add(a + 7, h[0], 1)  # a gap
    # a window of the last 5 positions: bulk in blocks, and live, against brute force
    want5 = brute_target_probs(h, target, doc, temps, window=5)
    np.testing.assert_allclose(cc.target_probs(h, target, doc, temps, window=5, block=3), want5, rtol=1e-9, atol=1e-12)
    live = cc.LiveCache(cc.ContCache(scale=1.0, factors=tuple(temps), window=5), V)
    live.add(26, h[26], target[26])
    for i in range(27, 60):
        np.testing.assert_allclose(live.distributions(h[i])[:, target[i]], want5[i], rtol=1e-9, atol=1e-12)
        live.add(i, h[i], target[i])
    assert not np.allclose(want5[26:], want[26:])  # the window matters in the 34-row document


def test_scale_is_the_median_nearest_earlier_distance():
    rng = np.random.default_rng(1)
    h = rng.normal(size=(30, 4))
    doc = np.repeat([0, 1], 15)
    near = [min(((h[i] - h[j]) ** 2).sum() for j in range(i) if doc[j] == doc[i]) for i in range(30) if i not in (0, 15)]
    assert cc.fit_scale(h, doc) == pytest.approx(float(np.median(near)), rel=1e-9)


def test_gate_files_old_and_new(tmp_path):
    F = 10
    old = gate_mod.Gate(np.zeros((F, len(estimates.COMPONENTS))))
    old.save(tmp_path / "old.json")
    d = json.loads((tmp_path / "old.json").read_text())
    assert "cont_cache" not in d  # a gate without the cache is written as before this change
    assert gate_mod.Gate.load(tmp_path / "old.json").cont_cache is None
    spec = cc.ContCache(scale=3.5)
    new = gate_mod.Gate(np.ones((F, len(estimates.COMPONENTS) + 5)), estimates.COMPONENTS + spec.names, spec)
    new.save(tmp_path / "new.json")
    back = gate_mod.Gate.load(tmp_path / "new.json")
    assert back.cont_cache == spec and back.components == new.components and back.exact_components == estimates.COMPONENTS
    with pytest.raises(TeragramError):  # cache components without its settings
        gate_mod.Gate(np.ones((F, len(estimates.COMPONENTS) + 5)), estimates.COMPONENTS + spec.names)
    with pytest.raises(TeragramError, match="continuous cache"):  # a gate reading it, given no states
        gate_mod.component_logp({}, np.zeros(0), back.components)


@pytest.fixture(autouse=True)
def short_gate_fits(monkeypatch):
    """Gate fits of 40 L-BFGS iterations, not 300: every comparison here is between two paths
    that fit the same way, and the fits are the slow part."""
    monkeypatch.setitem(gate_mod.fit_weights.__kwdefaults__, "steps", 40)
    monkeypatch.setitem(gate_mod.Gate.fit.__func__.__kwdefaults__, "steps", 40)


@pytest.fixture(scope="module")
def plain(held_root):
    train_tiny(held_root, "cc-plain", max_steps=40)
    return load_model(held_root / "cc-plain")[0]


def test_key_states_are_the_final_states_or_the_last_feed_forwards_input(held_root, plain):
    """key_states: "final" is GPT.hidden's output, "ffn_in" the last block's ln_2 output computed
    by hand; any other name is refused."""
    idx = Index(held_root / "idx")
    x = torch.from_numpy(np.asarray(idx.shards[0].tok[:64], np.int64)[None])
    x[x == idx.sep] = idx.eos_id
    with torch.no_grad():
        with key_states(plain, "final") as final, key_states(plain, "ffn_in") as ffn_in:
            h, _ = plain.hidden(x)
        y = plain.transformer.drop(plain.transformer.wte(x) + plain.transformer.wpe(torch.arange(64)))
        for b in plain.transformer.h[:-1]:  # by hand: every block but the last, then the last one's attention and its ln_2
            y = b(y)[0]
        last = plain.transformer.h[-1]
        y = y + last.attn(last.ln_1(y))[0]
        want = last.ln_2(y)
    assert torch.equal(final[-1], h)
    torch.testing.assert_close(ffn_in[-1], want)
    assert not torch.allclose(want, h)
    with pytest.raises(TeragramError, match="one of final, ffn_in"), key_states(plain, "attn"):
        pass


def test_fit_gate_compares_the_candidates_and_live_equals_bulk(held_root, plain):
    from teragram.model.evaluation.mixing import EvalOptions, cont_cache_of, gated, halves
    from teragram.model.evaluation.perplexity import token_eval

    idx = Index(held_root / "idx")
    r = token_eval(plain, held_root / "held", idx.eos_id, idx.sep, hidden=cc.KEY)
    keep = np.ones(len(r["nll"]), bool)
    fit_on, held = halves(r["doc"], keep)
    assert fit_on.any() and held.any() and not (fit_on & held).any() and (fit_on | held).all()
    assert not np.isin(r["doc"][fit_on], r["doc"][held]).any()  # split by document
    r["cont_cache"] = cont_cache_of(r, None, fit_rows=fit_on)
    spec, q = r["cont_cache"]
    assert spec.scale == pytest.approx(cc.fit_scale(r["hidden"][fit_on], r["doc"][fit_on]))  # the fitting half's documents alone
    assert spec.scale != pytest.approx(cc.fit_scale(r["hidden"], r["doc"]))
    est = estimates.heldout_estimates(held_root / "idx", held_root / "held")
    mixed, gate, info = gated(r, est, keep, EvalOptions(fit_gate=True))
    ch = info["gate_choice"]
    assert set(ch["held_out_half_perplexity"]) == {"gate", "gate+cont_cache"}
    assert ch["chosen"] == min(ch["held_out_half_perplexity"], key=ch["held_out_half_perplexity"].get)
    assert np.exp(mixed.mean()) < np.exp(r["nll"].mean())
    # the (t+cc) gate, applied: the bulk mixture per target ...
    X = gate_mod.gate_inputs(est, r["maxp"], r["top"])
    g = gate_mod.Gate.fit(
        X, gate_mod.component_logp(est, r["nll"], estimates.COMPONENTS + spec.names, (q, cc.first_rows(r["doc"]))), cont_cache=spec
    )
    bulk, _, _ = gated(r, est, keep, EvalOptions(gate=g))
    # ... equals generation's live distribution at the actual next token, document by document
    docs = estimates.heldout_docs(held_root / "held")
    for k, doc in enumerate(docs[:2]):
        doc = doc.tolist()[: plain.cfg.block_size - 1]
        x = torch.tensor([[idx.eos_id, *doc]])
        with torch.no_grad(), key_states(plain, spec.key) as got:
            logits = plain(x)[0]
        keys = got[-1][0].double().numpy()
        p_model = torch.softmax(logits.double(), -1).numpy()
        live = cc.LiveCache(spec, plain.cfg.vocab_size)
        rows = np.flatnonzero(r["doc"] == k)[: len(doc)]
        for t, tgt in enumerate(doc):
            p = gate_mod.next_distribution(idx, doc[:t], p_model[t], g, None, live.distributions(keys[t]))
            assert p.sum() == pytest.approx(1.0, abs=1e-9)
            assert -np.log(p[tgt]) == pytest.approx(bulk[rows[t]], rel=2e-5, abs=1e-6), t
            live.add(t, keys[t], tgt)


def test_generation_with_a_cont_cache_gate_drafts_the_same_text(held_root, plain, tmp_path):
    """Greedy generation through a (t+cc) gate: with drafts (the cache keeps only accepted
    positions) the same tokens as without."""
    from teragram.model.evaluation.perplexity import token_eval
    from teragram.model.generation.sample import generate

    idx = Index(held_root / "idx")
    r = token_eval(plain, held_root / "held", idx.eos_id, idx.sep, hidden=cc.KEY)
    spec = cc.ContCache(cc.fit_scale(r["hidden"], r["doc"]), window=16)  # a window shorter than the text: it slides
    n_features = gate_mod.gate_inputs(estimates.heldout_estimates(held_root / "idx", held_root / "held"), r["maxp"], r["top"]).shape[1]
    W = np.random.default_rng(0).normal(size=(n_features, len(estimates.COMPONENTS) + len(spec.names)))
    g = gate_mod.Gate(W, estimates.COMPONENTS + spec.names, spec)  # every component weighs in
    prompt = [idx.eos_id, *estimates.heldout_docs(held_root / "held")[0][:12].tolist()]
    plain_text = generate(plain, idx, prompt, max_new_tokens=30, temperature=0, gate=g).ids
    drafted = generate(plain, idx, prompt, max_new_tokens=30, temperature=0, gate=g, draft=4)
    assert drafted.ids == plain_text
    assert drafted.stats.proposed.sum() > 0  # drafts were made, and the cache dropped the rejected ones


def test_saved_outputs_keep_the_cache_and_give_the_same_figures(held_root, plain, tmp_path):
    from teragram.model.evaluation.outputs import load_outputs, outputs_report, save_model_outputs, truncate_outputs
    from teragram.model.evaluation.perplexity import EvalOptions, heldout_report

    idx = Index(held_root / "idx")
    from teragram.model.evaluation.perplexity import cont_cache_of, token_eval

    spec = save_model_outputs(tmp_path / "out", plain, held_root / "held", idx, meta={"step": 1}, source="x")
    o = load_outputs(tmp_path / "out")
    r = token_eval(plain, held_root / "held", idx.eos_id, idx.sep, hidden=cc.KEY)  # in memory
    assert o.cont_cache[0] == spec == cont_cache_of(r, None)[0] and len(o.manifest["docs"]) > 1
    np.testing.assert_array_equal(o.cont_cache[1][:], cont_cache_of(r, spec)[1])
    np.testing.assert_array_equal(o.nll, r["nll"].astype(np.float32))
    # saved a few documents at a time (at that scale): the same files
    save_model_outputs(tmp_path / "out2", plain, held_root / "held", idx, meta={"step": 1}, source="x", cont_cache=spec, chunk_tokens=100)
    for f in sorted(p.name for p in (tmp_path / "out" / "000000").iterdir()):
        assert (tmp_path / "out2" / "000000" / f).read_bytes() == (tmp_path / "out" / "000000" / f).read_bytes(), f
    direct, gate = heldout_report(plain, held_root / "idx", held_root / "held", opts=EvalOptions(fit_gate=True))
    split, gate2 = outputs_report(o, held_root / "idx", EvalOptions(fit_gate=True))
    assert split["perplexity"] == pytest.approx(direct["perplexity"], rel=1e-9)
    assert split["gate_choice"] == direct["gate_choice"]
    # a gate of another scale is refused for these outputs
    if gate.cont_cache is not None:
        other = gate_mod.Gate(gate.W, gate.components, cc.ContCache(gate.cont_cache.scale * 2))
        with pytest.raises(TeragramError, match="scale"):
            outputs_report(o, held_root / "idx", EvalOptions(gate=other))
    t = truncate_outputs(o, tmp_path / "short", 50)
    np.testing.assert_array_equal(t.cont_cache[1], o.cont_cache[1][: len(t.nll)])


def test_a_gate_is_refused_by_another_model_or_index(held_root, real_index, plain, tmp_path):
    from teragram.model.checkpoint import weights_digest

    g = gate_mod.Gate(np.zeros((10, len(estimates.COMPONENTS))))
    g.check(model="anything", index_dir=real_index)  # a gate saved without its identity: taken as it is
    g.fit_for = {"model": weights_digest(plain), "index": gate_mod.index_digest(held_root / "idx")}
    g.save(tmp_path / "g.json")
    back = gate_mod.Gate.load(tmp_path / "g.json")
    back.check(model=weights_digest(plain), index_dir=held_root / "idx")
    with pytest.raises(TeragramError, match="another index: refit it"):
        back.check(model=weights_digest(plain), index_dir=real_index)
    with pytest.raises(TeragramError, match="another model"):
        back.check(model="0" * 32, index_dir=held_root / "idx")
