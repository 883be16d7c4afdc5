"""Joint training (model/mixture/joint.py): the training positions' estimates against a brute-force
exclude-doc oracle, the mixture a distribution whose live computation equals the bulk
evaluation, generation, and training that uses the index."""

import numpy as np
import pytest
import torch
from teragram.builder.features import compute_features
from teragram.index import format as fmt
from teragram.index.engine import Index
from teragram.index.errors import TeragramError, TokenizerMismatch
from teragram.index.features import FeatureConfig
from teragram.model.checkpoint import load_model
from teragram.model.config import ConfigError
from teragram.model.evaluation.perplexity import token_eval
from teragram.model.generation.sample import generate
from teragram.model.mixture import joint, knn
from teragram.model.mixture.estimates import cache_estimates, heldout_docs
from teragram.model.mixture.gate import LEN_EDGES, SHARE_EDGES
from teragram.model.training.train import TrainConfig, model_config

from tests.model.conftest import TINY, joint_kw, train_tiny
from tests.model.helpers import assert_live_is_bulk


def _docs(idx: Index) -> list[tuple[int, int, np.ndarray]]:
    """(shard, start, ids) of every indexed document."""
    out = []
    for s in idx.shards:
        tok = np.asarray(s.tok).astype(np.int64)
        ends = np.nonzero(tok == idx.sep)[0]
        for a, e in zip(np.concatenate([[0], ends + 1])[: len(ends)], ends, strict=True):
            out.append((s.id, int(a), tok[a:e]))
    return out


def _oracle(docs, own: int, ctx: np.ndarray, cap: int, eos: int, k: int = 4):
    """Exclude-doc estimate by brute force: the longest suffix of ctx (<= cap tokens) found in
    another document, its occurrences and the k most frequent next tokens (count desc, id asc)."""
    for L in range(min(cap, len(ctx)), 0, -1):
        s = ctx[len(ctx) - L :]
        hist: dict[int, int] = {}
        for i, (_, _, d) in enumerate(docs):
            if i == own or len(d) < L:
                continue
            w = np.lib.stride_tricks.sliding_window_view(d, L)
            for p in np.nonzero((w == s).all(1))[0]:
                nxt = int(d[p + L]) if p + L < len(d) else eos
                hist[nxt] = hist.get(nxt, 0) + 1
        if hist:
            top = sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
            return L, sum(hist.values()), hist, top
    return 0, 0, {}, []


def test_train_estimates_equal_brute_force(joint_root):
    idx = Index(joint_root / "idx")
    docs = _docs(idx)
    shards, cols = joint.open_train_estimates(joint_root / "est", joint_root / "idx", joint.COMPONENTS, 4)
    comps = joint.COMPONENTS
    rng = np.random.default_rng(1)
    checked = 0
    for di in rng.choice(len(docs), 8, replace=False):
        sid, a, ids = docs[di]
        e = shards[[s.id for s in idx.shards].index(sid)]
        cache = cache_estimates(ids, idx.eos_id)  # rows: targets ids[0], ..., EOS
        for j in rng.choice(len(ids), 5, replace=False):  # position a + j: context ids[:j + 1]
            y = int(ids[j + 1]) if j + 1 < len(ids) else idx.eos_id
            row = e.rows(a + j, a + j + 1, cols)
            for m, c in enumerate(comps):
                if c.startswith("cache"):
                    n = cache[f"count_{c}"][j + 1]
                    assert row.q[0, m] == pytest.approx(cache[f"p_{c}"][j + 1] if n else 0.0, rel=1e-6), c
                    assert row.rest[0, m] == (0.0 if n else 1.0)
                    continue
                L, n, hist, top = _oracle(docs, int(di), ids[: j + 1], joint.cap(c), idx.eos_id)
                if L == 0:
                    continue  # no suffix elsewhere: the unigram case, not this oracle's
                tk = dict(top)
                assert row.count[0, m] == min(int(np.floor(np.log2(n + 1))), joint.N_COUNT - 1), c
                assert row.q[0, m] == pytest.approx(tk.get(y, 0) / n, rel=1e-6, abs=1e-9), c
                assert row.rest[0, m] == pytest.approx(1 - sum(tk.values()) / n, rel=1e-5, abs=1e-6), c
                assert row.top[0, m] == top[0][0], c
                assert row.share[0, m] == np.searchsorted(SHARE_EDGES, top[0][1] / n, side="right")
                if c == "index_infgram":
                    assert row.length[0] == np.searchsorted(LEN_EDGES, L, side="right")
                checked += 1
            assert row.clen[0] == np.searchsorted(LEN_EDGES, cache["cache_length"][j + 1], side="right")
    assert checked > 100


def test_joint_training_uses_the_index(joint_root):
    """On held-out near-copies of indexed text, the jointly trained model's mixture is far
    better than the same model trained alone, and the gate learns to leave the model."""
    plain = train_tiny(joint_root, "plain", max_steps=120)
    mixed = train_tiny(joint_root, "joint", max_steps=120, **joint_kw(joint_root))
    assert mixed["eval"]["loss"] < 0.8 * plain["eval"]["loss"], (mixed["eval"], plain["eval"])
    model, meta = load_model(joint_root / "joint")
    assert model.cfg.joint == joint.COMPONENTS and meta["train"]["gate"] == "joint"
    assert float(model.joint_gate.bias[0].detach()) < 2.0  # moved away from the model-only start


def _tiny_joint_batch(joint_root):
    """A tiny joint model's config over three estimates, and one training batch (x, y, estimates)."""
    from dataclasses import replace

    from teragram.model.training.data import TrainData

    comps = ("index_infgram", "index_3gram", "cache_longest")
    data = TrainData(joint_root / "idx", None, 32, joint.open_train_estimates(joint_root / "est", joint_root / "idx", comps, 4))
    x, y, _, e = data.batch(0, 4)
    cfg = replace(
        model_config(TrainConfig(**(TINY | {"index": "x", "out": "x"})), Index(joint_root / "idx").vocab_size, 0),
        joint=comps,
        block_size=32,
    )
    return cfg, x, y, e


def test_lm_weight_adds_the_models_own_loss_in_training(joint_root):
    from dataclasses import replace

    from teragram.model.gpt import GPT

    cfg, x, y, e = _tiny_joint_batch(joint_root)
    torch.manual_seed(0)
    model = GPT(replace(cfg, joint_lm_weight=0.5))
    loss, _ = model(x, y, None, e)
    h, _ = model.hidden(x)
    mix, logp = model.head_losses(h, y, None, e)
    own = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(loss, mix + 0.5 * own, atol=1e-5) and float(own.mean().detach()) > 0
    model.eval()
    assert torch.allclose(model(x, y, None, e)[0], mix, atol=1e-5)  # evaluation: the mixture's alone
    with pytest.raises(ConfigError, match="joint_lm_weight"):
        train_tiny(joint_root, "bad", max_steps=1, joint_lm_weight=1.0)


def test_detached_gate_shapes_the_trunk_only_through_the_models_probabilities(joint_root):
    """joint_detach: the same mixture, the same gradient on the gate, and on the trunk the
    gradient of the mixture's loss with the gate's weights held fixed (so its hidden-state
    input passes no gradient back); without it, the gate's own loss reaches the trunk too."""
    from dataclasses import replace

    from teragram.model.gpt import GPT

    cfg, x, y, e = _tiny_joint_batch(joint_root)
    torch.manual_seed(0)
    plain = GPT(cfg)
    with torch.no_grad():  # a gate that reads the hidden state (its init: zero)
        plain.joint_gate.hidden.weight.normal_(0, 0.5)
    detached = GPT(replace(cfg, joint_detach=True))
    detached.load_state_dict(plain.state_dict())
    grads, losses = {}, {}
    for name, m in (("plain", plain), ("detached", detached)):
        loss = m(x, y, None, e)[0].mean()
        loss.backward()
        losses[name] = loss.detach()
        grads[name] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert torch.equal(losses["plain"], losses["detached"])
    gate = [n for n in grads["plain"] if n.startswith("joint_gate.")]
    assert gate and all(torch.allclose(grads["plain"][n], grads["detached"][n], atol=1e-6) for n in gate)
    trunk = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.allclose(grads["plain"][trunk], grads["detached"][trunk], atol=1e-6)  # the gate's loss shapes it
    # the oracle: the mixture's loss with the gate's weights computed once and held as constants
    detached.zero_grad()
    h, _ = detached.hidden(x)
    lp_y, maxlp, top = detached._model_logp(h, y)
    logw = detached.joint_gate(h.float(), e, maxlp.exp(), top).detach()
    joint.mixture_nll(logw, lp_y, e).mean().backward()
    assert torch.allclose(detached.get_parameter(trunk).grad, grads["detached"][trunk], atol=1e-6)
    with pytest.raises(ConfigError, match="joint_detach"):
        train_tiny(joint_root, "bad", max_steps=1, **joint_kw(joint_root), joint_hidden=False, joint_detach=True)


def test_live_mixture_equals_bulk_and_is_a_distribution(joint_root):
    train_tiny(
        joint_root,
        "joint-live",
        max_steps=10,
        **joint_kw(joint_root, joint_components=("index_infgram", "index_3gram", "cache_longest", "cache_2gram")),
    )
    model, _ = load_model(joint_root / "joint-live")
    torch.manual_seed(0)
    with torch.no_grad():  # a gate that mixes everything, with every kind of feature
        for p in model.joint_gate.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.eval()
    idx = Index(joint_root / "idx")
    r = token_eval(model, joint_root / "held", idx.eos_id, idx.sep, index=idx)
    docs = heldout_docs(joint_root / "held")
    assert_live_is_bulk(model, idx, docs, r, (0, 3), 60)


def test_generation_with_the_joint_gate(joint_root):
    if not (joint_root / "joint-live" / "latest.json").exists():
        train_tiny(
            joint_root,
            "joint-live",
            max_steps=10,
            **joint_kw(joint_root, joint_components=("index_infgram", "index_3gram", "cache_longest", "cache_2gram")),
        )
    model, _ = load_model(joint_root / "joint-live")
    idx = Index(joint_root / "idx")
    prompt = idx.tokenize("The kernel")
    plain = generate(model, idx, prompt, max_new_tokens=30, temperature=0)
    drafted = generate(model, idx, prompt, max_new_tokens=30, temperature=0, draft=4)
    assert plain.ids == drafted.ids and len(plain.ids) > len(prompt)


def test_an_index_of_another_tokenizer_is_refused(joint_root, tmp_path):
    """Same vocabulary size, other pieces: the gate's estimates would be of other tokens."""
    from teragram.builder.build import BuildConfig, build
    from teragram.index import tokenizer

    from tests.conftest import real_texts

    if not (joint_root / "joint-live" / "latest.json").exists():
        train_tiny(joint_root, "joint-live", max_steps=1, **joint_kw(joint_root, joint_components=("index_infgram", "cache_longest")))
    model, _ = load_model(joint_root / "joint-live")
    (tmp_path / "tok.model").write_bytes(tokenizer.train((t.upper() for _, t in real_texts(60)), model.cfg.vocab_size, threads=1))
    build(
        BuildConfig(
            inputs=(str(joint_root / "train"),), out=str(tmp_path / "idx"), tokenizer=str(tmp_path / "tok.model"), workers=1, progress=False
        )
    )
    other = Index(tmp_path / "idx")
    assert other.vocab_size == model.cfg.vocab_size
    with pytest.raises(TokenizerMismatch, match="joint gate was trained with"):
        token_eval(model, joint_root / "held", other.eos_id, other.sep, index=other)
    with pytest.raises(TokenizerMismatch, match="joint gate was trained with"):
        generate(model, other, other.tokenize("The kernel"), max_new_tokens=3, temperature=0)
    from teragram.serve.app import ServeConfig, create_app

    with pytest.raises(TokenizerMismatch, match="joint gate was trained with"):
        create_app(ServeConfig(index=str(tmp_path / "idx"), checkpoint=str(joint_root / "joint-live")))


def test_refusals(joint_root, tmp_path):
    with pytest.raises(ConfigError, match="joint_features"):
        train_tiny(joint_root, "bad", max_steps=1, gate="joint")
    with pytest.raises(TeragramError, match="distinct names"):
        train_tiny(joint_root, "bad", max_steps=1, **joint_kw(joint_root, joint_components=("index_7gram",)))
    with pytest.raises(TeragramError, match="needs"):
        joint.open_train_estimates(joint_root / "est", joint_root / "idx", ("index_infgram",), 8)
    joint.write_train_estimates(joint_root / "idx", [joint_root / "len-1"], tmp_path / "e", 4, progress=False)
    assert fmt.read_json(tmp_path / "e" / "manifest.json")["components"][0] == "index_2gram"
    with pytest.raises(TeragramError, match="the model needs index_infgram"):
        joint.open_train_estimates(tmp_path / "e", joint_root / "idx", ("index_infgram",), 4)
    compute_features(joint_root / "idx", tmp_path / "causal", FeatureConfig("causal", 4, 4), progress=False)
    with pytest.raises(TeragramError, match="exclude-doc"):
        joint.write_train_estimates(joint_root / "idx", [tmp_path / "causal"], tmp_path / "e2", 4, progress=False)


def test_knn_key_states_and_their_choice_on_validation(joint_root):
    """model/mixture/knn.key_states: "final" is GPT.hidden's output, "ffn_in" the last block's ln_2 output
    computed by hand; build(every=3) keeps every third window's positions; choose_key picks the
    kind whose kNN-LM has the lower validation loss and reports both."""
    from benchmarks import knnlm

    train_tiny(joint_root, "keys-choice", max_steps=2, use_index=False, heldout=None)
    model, _ = load_model(joint_root / "keys-choice")
    model.eval()
    idx = Index(joint_root / "idx")
    x = torch.from_numpy(np.asarray(idx.shards[0].tok[:64], np.int64)[None])
    x[x == idx.sep] = idx.eos_id
    h, _ = model.hidden(x)
    assert torch.equal(knn.states(model, x, "final"), h)
    with torch.no_grad():  # by hand: every block but the last, then the last one's attention and its ln_2
        y = model.transformer.drop(model.transformer.wte(x) + model.transformer.wpe(torch.arange(64)))
        for b in model.transformer.h[:-1]:
            y = b(y)[0]
        last = model.transformer.h[-1]
        y = y + last.attn(last.ln_1(y))[0]
        want = last.ln_2(y)
    torch.testing.assert_close(knn.states(model, x, "ffn_in"), want)
    assert not torch.allclose(want, h)
    with pytest.raises(TeragramError, match="one of final, ffn_in"):
        knn.states(model, x, "attn")
    full, _, mu = knn.build(model, joint_root / "idx", "cpu", batch=8, key="ffn_in")
    third, _, mu3 = knn.build(model, joint_root / "idx", "cpu", batch=8, key="ffn_in", every=3)
    T = model.cfg.block_size
    assert len(full) / 3 - 2 * T <= len(third) <= len(full) / 3 + 2 * T
    torch.testing.assert_close(
        third[:T].float() + mu3, full[:T].float() + mu, atol=2e-2, rtol=0
    )  # the first window, each centred on its own mean
    key, res = knnlm.choose_key(
        model, joint_root / "idx", joint_root / "held", idx, "cpu", batch=8, eval_batch=8, k=8, centroids=4, nprobe=4
    )
    assert set(res) == set(knn.KEY_STATES) and key == min(res, key=lambda x: res[x]["valid_nll"])
    assert all(r["keys"] == len(third) and r["valid_nll"] <= r["model_nll"] for r in res.values())


def test_knn_estimate_columns_at_each_temperature():
    """knn.estimate_columns against a hand computation per temperature: p_knn(target), the
    nearest token's share bucket (the top one, exactly, where every neighbour agrees), a query
    without neighbours deferring to the model."""
    inf = float("inf")
    d = torch.tensor([[0.11, 0.13, 0.29, 0.31, inf], [0.1, 0.2, 0.3, 0.4, 0.5], [inf] * 5, [0.18, 0.26, 0.61, 0.99, 1.54]])
    nb = torch.tensor([[7, 7, 7, 7, -1], [3, 5, 3, 3, 5], [-1] * 5, [4] * 5])  # the last row's float32 weights sum below 1 at 0.03
    target, temps = torch.tensor([7, 5, 2, 4]), [0.03, 0.1, 1.0]
    c = knn.estimate_columns(d, nb, target, temps, 0.2)
    for j, t in enumerate(temps):
        for i in (0, 1, 3):
            fin = np.isfinite(d[i].numpy())
            w = np.exp(-d[i].numpy()[fin].astype(np.float64) / t)
            w /= w.sum()
            v = nb[i].numpy()[fin]
            assert c["q"][i, j] == pytest.approx((w * (v == int(target[i]))).sum(), rel=1e-5)
            share = 1.0 if (v == v[0]).all() else (w * (v == v[0])).sum()
            assert c["share"][i, j] == np.searchsorted(SHARE_EDGES, share, side="right")
    assert (c["share"][[0, 3]] == len(SHARE_EDGES)).all() and np.allclose(c["q"][[0, 3]], 1.0)
    assert (c["top"][:2] == np.array([[7], [3]])).all() and (c["rest"][:2] == 0).all()
    assert (c["count"][:2] == 1 + np.searchsorted(knn.DIST_EDGES, np.array([[0.11], [0.1]]) / 0.2, side="right")).all()
    assert (c["rest"][2] == 1).all() and (c["q"][2] == 0).all() and (c["top"][2] == -1).all() and (c["count"][2] == 0).all()
    assert c["q"][1, 0] < c["q"][1, 2]  # the target 5 is the 2nd and 5th neighbour: a broad vote gives it more
