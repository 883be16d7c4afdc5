"""Generation with drafts from exact matches: the same greedy tokens as without drafts, the
model's own distribution when sampling, and per-token provenance."""

import math

import numpy as np
import pytest
import torch
from teragram.index.engine import Index
from teragram.model.checkpoint import load_model
from teragram.model.generation.draft import Drafter, cache_match
from teragram.model.generation.sample import _target, generate
from teragram.model.training.train import train

from tests.model.helpers import dup_config


def test_cache_match_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        q = rng.integers(0, 3, size=int(rng.integers(1, 40)))
        n = len(q)
        want = (0, -1)
        for L in range(1, min(10, n - 1) + 1):
            ends = [e for e in range(L, n) if np.array_equal(q[e - L : e], q[n - L :])]
            if ends:
                want = (L, ends[-1])
        assert cache_match(q, 10) == want, q


@pytest.fixture(scope="module")
def models(dup_setup):
    """Tiny models with a short context (48), so that generation also slides its window."""
    out = {}
    for arch, use_index in (("gpt2", True), ("modern", False)):
        name = f"draft-{arch}-{use_index}"
        kw = {} if use_index else {"features": None, "use_index": False}
        train(dup_config(dup_setup, name, max_steps=60, arch=arch, block_size=48, **kw))
        out[arch] = load_model(dup_setup / name)[0]
    return out


def _prompts(idx, dup_setup):
    train_text = (dup_setup / "train" / "003.txt").read_text()
    held = sorted((dup_setup / "held").glob("h*.txt"))[0].read_text()
    return [idx.tokenize(train_text[:60]), idx.tokenize(held[200:300]), []]


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_greedy_with_drafts_equals_plain_greedy(dup_setup, models, arch):
    model = models[arch]
    idx = Index(dup_setup / "idx")
    accepted = forwards = tokens = 0
    for prompt in _prompts(idx, dup_setup):
        plain = generate(model, idx, prompt, max_new_tokens=70, temperature=0)
        drafter = Drafter(max_tokens=6, min_prob=0.0)  # always draft as far as the match goes
        fast = generate(model, idx, prompt, max_new_tokens=70, temperature=0, draft=drafter)
        assert fast.ids == plain.ids
        for a, b in zip(fast.features, plain.features, strict=True):
            assert all(np.array_equal(x, y) for x, y in zip(a.map(np.asarray).__dict__.values(), b.map(np.asarray).__dict__.values()))
        st = fast.stats.to_json()
        accepted, forwards, tokens = accepted + st["accepted"], forwards + st["forward_passes"], tokens + st["tokens"]
        assert plain.stats.to_json()["forward_passes"] == len(plain.new_ids)
    assert accepted > 0 and forwards < tokens  # drafts were taken, so the test compares something


def test_sampling_with_drafts_draws_from_the_model(dup_setup, models):
    """The first two sampled tokens (top-3, temperature 0.8), drawn 1,200 times with drafts
    that are sometimes right and sometimes wrong, against their exact probabilities."""
    model = models["modern"]
    idx = Index(dup_setup / "idx")
    kw = dict(temperature=0.8, top_k=3, top_p=1.0)

    def q(ids):
        with torch.no_grad():
            h, _ = model.hidden(torch.tensor([ids]))
            return _target(model.next_distribution(h[:, -1], None)[0], **kw).double()

    def first_draft(ids):
        sc = idx.scorer()
        for t in ids:
            sc.append(t)
        d = Drafter(max_tokens=1, min_prob=0.0).propose(sc, sc.occurrence(), ids, 1)
        return d.tokens[0] if d else None

    # a prompt from the training text whose first draft token the model gives a middling chance
    text = idx.tokenize((dup_setup / "train" / "003.txt").read_text())
    prompt = next(text[:k] for k in range(8, 40) if first_draft(text[:k]) is not None and 0.2 < q(text[:k])[first_draft(text[:k])] < 0.8)
    q1 = q(prompt)
    exact = {}
    for a in torch.nonzero(q1).flatten().tolist():
        q2 = q(prompt + [a])
        for b in torch.nonzero(q2).flatten().tolist():
            exact[(a, b)] = float(q1[a] * q2[b])
    n = 1200
    seen: dict = {}
    drafter = Drafter(max_tokens=4, min_prob=0.0)
    for seed in range(n):
        g = generate(model, idx, prompt, max_new_tokens=2, seed=seed, draft=drafter, **kw)
        key = tuple(g.new_ids)
        seen[key] = seen.get(key, 0) + 1
    st = drafter.stats.to_json()
    assert 0 < st["accepted"] < st["drafted"], st  # drafts both kept and refused
    assert set(seen) <= set(exact)
    cells = [k for k in exact if exact[k] * n >= 5]
    rest = 1.0 - sum(exact[k] for k in cells)
    chi2 = sum((seen.get(k, 0) - n * exact[k]) ** 2 / (n * exact[k]) for k in cells)
    if rest * n >= 5:
        other = n - sum(seen.get(k, 0) for k in cells)
        chi2 += (other - n * rest) ** 2 / (n * rest)
        cells.append(None)
    df = len(cells) - 1
    assert df >= 3
    z = 3.09  # chi-square quantile at 0.999 (Wilson-Hilferty)
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < limit, (chi2, limit, df)


def test_provenance_points_at_the_matching_text(dup_setup, models):
    model = models["gpt2"]
    idx = Index(dup_setup / "idx")
    prompt = _prompts(idx, dup_setup)[0]
    g = generate(model, idx, prompt, max_new_tokens=40, temperature=0, draft=4, provenance=True)
    assert len(g.provenance) == len(g.new_ids)
    found = 0
    for j, p in enumerate(g.provenance):
        i = g.n_prompt + j  # the token's position
        L = int(g.features[i].length[0])
        assert (p is not None) == (L >= 8)
        if p is None:
            continue
        found += 1
        m = idx.meta.doc(p.doc_id)
        s = next(s for s in idx.shards if s.id == m["shard"])
        a = int(m["start"]) + p.offset
        assert p.length == L and p.source == m["source"]
        assert np.array_equal(np.asarray(s.tok[a : a + L], np.int64), np.asarray(g.ids[i - L + 1 : i + 1]))
    assert found > 0


def test_greedy_with_drafts_and_a_gate_equals_plain_greedy(dup_setup, models):
    """The gated mixture's greedy tokens are the same with drafts (each verified position's
    estimates computed for its own prefix)."""
    from teragram.model.mixture.estimates import COMPONENTS, estimates
    from teragram.model.mixture.gate import Gate, gate_inputs

    model = models["modern"]
    idx = Index(dup_setup / "idx")
    est = estimates(idx, [5, 6, 7])
    F = gate_inputs(est, np.full(4, 0.5), np.zeros(4, np.int64)).shape[1]
    gate = Gate(np.random.default_rng(2).normal(scale=0.5, size=(F, len(COMPONENTS))))
    prompt = _prompts(idx, dup_setup)[0]
    plain = generate(model, idx, prompt, max_new_tokens=30, temperature=0, gate=gate)
    fast = generate(model, idx, prompt, max_new_tokens=30, temperature=0, gate=gate, draft=Drafter(max_tokens=6, min_prob=0.0))
    assert fast.ids == plain.ids
    st = fast.stats.to_json()
    assert st["accepted"] > 0 and st["forward_passes"] < len(fast.new_ids)
