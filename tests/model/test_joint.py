"""Joint training (model/mixture/joint.py): the training positions' estimates against a brute-force
exclude-doc oracle, the mixture a distribution whose live computation equals the bulk
evaluation, generation, and training that uses the index."""

import json

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

from tests.model.conftest import TINY, joint_kw, make_joint_root, train_tiny


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


def assert_live_is_bulk(model, idx, docs, r, which, n, knn=None):
    """joint.live's mixture at each of the first n positions of documents `which` is a distribution
    whose nll of the target is token_eval's (r) there; a dense component's mass is what it keeps."""
    for d in which:
        ids = docs[d]
        x = torch.tensor([[idx.eos_id, *ids[: model.cfg.block_size - 1]]])
        with torch.no_grad():
            h, _ = model.hidden(x)
        sel = np.nonzero(r["doc"] == d)[0]
        for t in range(min(n, x.shape[1])):
            e, dense = joint.live(idx, ids[:t], model.cfg.vocab_size, model.cfg.joint, model.cfg.joint_top_k, knn=knn)
            p = model.next_distribution(h[:, t], None, joint.to_torch(e), torch.from_numpy(dense[None]).float())[0]
            assert float(p.sum()) == pytest.approx(1.0, abs=1e-5)
            assert knn is None or dense[-1].sum() == pytest.approx(1.0 - e.rest[0, -1], abs=1e-6)  # the kNN's: all or nothing
            assert int(r["target"][sel[t]]) == (int(ids[t]) if t < len(ids) else idx.eos_id)
            assert float(-torch.log(p[int(r["target"][sel[t]])])) == pytest.approx(float(r["nll"][sel[t]]), abs=2e-4), (d, t)


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


def test_dense_knn_estimates_exclude_the_own_document(tokenizer_model, tmp_path, capsys):
    """benchmarks/knnlm.joint_estimates (every list probed: exact): each training position's kNN
    estimate is brute force's over every key but its own document's (its copies elsewhere are
    found), a held-out target's over every key; a model trains with it as one more component
    and is scored with the held-out estimates given; nothing else can supply them."""
    from teragram.model.gpt import GPT, GPTConfig

    from benchmarks import knnlm

    joint_root = make_joint_root(
        tmp_path / "small", tokenizer_model, 12, 2500, 3, shard_tokens=6000
    )  # a smaller one: every pair is searched
    idx = Index(joint_root / "idx")
    assert len(idx.shards) > 1
    train_tiny(joint_root, "keys", max_steps=2, use_index=False, heldout=None)  # the keys model, a checkpoint (--knn-keys)
    model, _ = load_model(joint_root / "keys")
    model.eval()
    held = {("indist", h): joint_root / "held" for h in ("valid", "test")}
    k = 8
    est_knn = tmp_path / "est-knn"
    args = (model, joint_root / "idx", held, joint_root / "est", est_knn, tmp_path, "cpu")
    info = knnlm.joint_estimates(*args, batch=8, eval_batch=8, k=k, centroids=4, nprobe=4, chunk=5000, key="ffn_in", peer=True)
    assert info["key"] == "ffn_in" and "key_choice" not in info
    temp, scale = info["temperature_factor"] * info["temperature_scale"], info["temperature_scale"]
    keys, vals, mu = knn.build(model, joint_root / "idx", "cpu", batch=8, key="ffn_in")  # centred on mu: held-out queries too
    K, V = keys.float().numpy().astype(np.float64), vals.numpy()
    doc, where, off = [], [], 0  # per key: its target's document (the one whose span holds it), its shard and row
    for s in idx.shards:
        tok = np.asarray(s.tok)
        ends = np.nonzero(tok == idx.sep)[0]
        doc.append(off + np.searchsorted(ends, np.arange(1, len(tok)), side="left"))
        where += [(s.id, r) for r in range(len(tok) - 1)]
        off += len(ends) + 1
    doc = np.concatenate(doc)
    comps = (*joint.COMPONENTS, *joint.DENSE)
    shards, cols = joint.open_train_estimates(est_knn, joint_root / "idx", comps, 4)
    ids = [s.id for s in idx.shards]
    base, _ = joint.open_train_estimates(joint_root / "est", joint_root / "idx", joint.COMPONENTS, 4)

    nd = len(knn.MULTIPLES)  # the nd columns before the last: the kNN estimate at each of its temperatures; the last dense_cache
    kn = slice(-nd - 1, -1)
    temps = np.array([temp * m for m in knn.MULTIPLES])
    assert joint.DENSE[-1] == "dense_cache" and len(joint.DENSE) == nd + 1 and info["temperature_multiples"] == list(knn.MULTIPLES)
    temp_c = info["cache_temperature"]
    assert (
        info["cache_factor"] in knnlm.CACHE_FIT and temp_c == pytest.approx(info["cache_factor"] * scale) and info["train_cache_mean_q"] > 0
    )

    def oracle(q, mask=None):
        d = ((K - q) ** 2).sum(1)
        if mask is not None:
            d[mask] = np.inf
        o = np.argsort(d, kind="stable")[: k + 1]
        w = np.exp(-(d[o[:k]] - d[o[0]])[None] / temps[:, None])  # (nd, k)
        return d[o], o, w / w.sum(1, keepdims=True)

    rng = np.random.default_rng(0)
    checked = copies = cached = 0
    for p in rng.choice(len(K), 300, replace=False):
        d, o, w = oracle(K[p], doc == doc[p])
        if d[k] - d[k - 1] < 1e-3:
            continue  # the k-th nearest tied with the next
        sid, r = where[p]
        row = shards[ids.index(sid)].rows(r, r + 1, cols)
        np.testing.assert_allclose(row.q[0, kn], (w * (V[o[:k]] == V[p])).sum(1), rtol=2e-3, atol=1e-5)
        assert all(row.top[0, kn] == row.top[0, -2]) and (row.rest[0, kn] == 0).all()
        assert row.top[0, -2] in V[o[d[: k + 1] - d[0] < 1e-3]]  # the nearest (or one tied with it)
        assert (row.count[0, kn] == 1 + np.searchsorted(knn.DIST_EDGES, d[0] / scale, side="right")).all()
        np.testing.assert_array_equal(row.q[0, : -nd - 1], base[ids.index(sid)].q[r])  # the index's and cache's columns kept
        checked += 1
        copies += d[0] < 1e-2  # the same context in a copy of the document
        before = np.flatnonzero((doc == doc[p]) & (np.arange(len(K)) < p))  # dense_cache: its own document's earlier keys
        if not len(before):
            assert row.rest[0, -1] == 1 and row.q[0, -1] == 0 and row.top[0, -1] == -1
            continue
        dc = ((K[before] - K[p]) ** 2).sum(1)
        oc = np.argsort(dc, kind="stable")[: k + 1]
        if len(oc) > k and dc[oc[k]] - dc[oc[k - 1]] < 1e-3:
            continue
        wc = np.exp(-(dc[oc[:k]] - dc[oc[0]]) / temp_c)
        assert row.q[0, -1] == pytest.approx((wc * (V[before[oc[:k]]] == V[p])).sum() / wc.sum(), rel=2e-3, abs=1e-5)
        assert row.rest[0, -1] == 0 and row.count[0, -1] == 1 + np.searchsorted(knn.DIST_EDGES, dc[oc[0]] / scale, side="right")
        cached += 1
    assert checked > 200 and copies > 20 and cached > 150, (checked, copies, cached)
    for e in shards:  # the last position of a shard predicts nothing indexed: it defers to the model
        assert (e.rest[-1, -nd - 1 :] == 1).all() and (e.q[-1, -nd - 1 :] == 0).all()
    r = token_eval(model, held["indist", "test"], idx.eos_id, idx.sep, "cpu", hidden="ffn_in")
    z = np.load(tmp_path / "knnest-indist-test.npz")
    zp = np.load(tmp_path / "knn-indist-test.npz")  # the peer (d) over the same store, k = 1024: every key here
    assert (zp["target"] == r["target"]).all() and np.allclose(zp["nll_a"], r["nll"], atol=1e-5)
    assert (z["target"] == r["target"]).all()
    Hr = r["hidden"].astype(np.float64)
    for j in rng.choice(len(r["target"]), 100, replace=False):
        d, o, w = oracle(Hr[j] - mu.numpy())
        if d[k] - d[k - 1] >= 1e-3:
            np.testing.assert_allclose(z["q"][j, :-1], (w * (V[o[:k]] == r["target"][j])).sum(1), rtol=2e-3, atol=1e-5)
        before = np.flatnonzero((r["doc"] == r["doc"][j]) & (np.arange(len(Hr)) < j))  # dense_cache: the document's earlier states
        dc = ((Hr[before] - Hr[j]) ** 2).sum(1)
        oc = np.argsort(dc, kind="stable")[: k + 1]
        if not len(before):
            assert z["q"][j, -1] == 0 and z["rest"][j, -1] == 1
        elif len(oc) <= k or dc[oc[k]] - dc[oc[k - 1]] >= 1e-3:
            wc = np.exp(-(dc[oc[:k]] - dc[oc[0]]) / temp_c)
            assert z["q"][j, -1] == pytest.approx(
                (wc * (r["target"][before[oc[:k]]] == r["target"][j])).sum() / wc.sum(), rel=2e-3, abs=1e-5
            )
        dp = ((K - (r["hidden"][j].astype(np.float64) - mu.numpy())) ** 2).sum(1)  # the peer's 1024 at the same temperature
        o2 = np.argsort(dp, kind="stable")[: knnlm.K_NEIGHBOURS + 1]
        if dp[o2[-1]] - dp[o2[-2]] >= 1e-3:
            wp = np.exp(-(dp[o2[:-1]] - dp[o2[0]]) / temp)
            c = knnlm.FACTORS.index(info["temperature_factor"])
            assert zp["p_knn"][j, c] == pytest.approx((wp * (V[o2[:-1]] == r["target"][j])).sum() / wp.sum(), rel=2e-3, abs=1e-5)
    zc = np.load(tmp_path / "contcache-indist-test.npz")  # the continuous cache over the same states: brute force's
    assert (zc["target"] == r["target"]).all() and list(zc["factors"]) == list(knnlm.CACHE_FACTORS)
    same = np.diff(r["doc"]) == 0
    assert (np.diff(r["doc"]) >= 0).all() and (np.diff(r["pos"])[same] > 0).all()  # a document's rows in one run, in order
    H, temps_c, seen = r["hidden"].astype(np.float64), np.array(knnlm.CACHE_FACTORS) * scale, 0
    for j in np.random.default_rng(1).choice(len(H), 100, replace=False):
        before = np.flatnonzero((r["doc"] == r["doc"][j]) & (np.arange(len(H)) < j))
        if not len(before):
            assert (zc["q"][j] == 0).all()
            continue
        d = ((H[before] - H[j]) ** 2).sum(1)
        w = np.exp(-(d - d.min())[None] / temps_c[:, None])
        np.testing.assert_allclose(
            zc["q"][j], (w * (r["target"][before] == r["target"][j])).sum(1) / w.sum(1), rtol=1e-3, atol=1e-4
        )  # float16
        seen += zc["q"][j, -1] > 0
    assert seen > 20, seen
    # a run cut short (TERAGRAM_KNN_PARTIAL): the chunks searched are merged, the rest defer to the model
    # dense_knn_broad, in memory (the files are rewritten); keys: every position but a shard's last
    q_all = np.concatenate([e.q[:-1, -2] for e in shards])
    top_all = np.concatenate([e.top[:-1, -2] for e in shards])
    cache_all = np.concatenate([e.q[:, -1] for e in shards])
    gone = sorted((est_knn / "searched").glob("*.npz"))[0]
    a, b = (int(x) for x in gone.name.split("-")[:2])
    gone.unlink()
    mp = pytest.MonkeyPatch()
    mp.setenv("TERAGRAM_KNN_PARTIAL", "1")
    held_z = {f: np.load(f) for f in sorted(tmp_path.glob("knnest-*.npz"))}
    part = knnlm.joint_estimates(*args, batch=8, eval_batch=8, k=k, centroids=4, nprobe=4, chunk=5000)
    mp.undo()
    assert part["unsearched"] == b - a and part["heldout_cached"] and "heldout_cached" not in info
    assert part["temperature_scale"] == scale and len(held_z) == 2
    for f, z0 in held_z.items():  # the held-out part reused, untouched
        assert all((np.load(f)[c] == z0[c]).all() for c in z0.files)
    cut, _ = joint.open_train_estimates(est_knn, joint_root / "idx", comps, 4)
    q_cut = np.concatenate([e.q[:-1, -2] for e in cut])
    rest_cut = np.concatenate([e.rest[:-1, -2] for e in cut])
    np.testing.assert_array_equal(np.concatenate([e.q[:, -1] for e in cut]), cache_all)  # the cache: all
    assert q_all[a:b].max() > 0 and (q_cut[a:b] == 0).all() and (rest_cut[a:b] == 1).all()
    keep = np.ones(len(q_all), bool)
    keep[a:b] = False
    np.testing.assert_array_equal(q_cut[keep], q_all[keep])
    # search only (benchmarks/joint.py's prep, before the estimates exist): the missing chunk searched
    # again, as it was, and nothing written but it
    mp.setenv("TERAGRAM_KNN_SEARCH_ONLY", "1")
    only = knnlm.joint_estimates(
        model,
        joint_root / "idx",
        held,
        tmp_path / "none",
        tmp_path / "only",
        tmp_path,
        "cpu",
        batch=8,
        eval_batch=8,
        k=k,
        centroids=4,
        nprobe=4,
        chunk=5000,
    )
    mp.undo()
    assert only["search_only"] and only["chunks_searched_now"] == len(list((est_knn / "searched").glob("*.npz"))) + 1
    assert [x.name for x in (tmp_path / "only").iterdir()] == ["searched"] and not (tmp_path / "none").exists()
    again = np.load(tmp_path / "only" / "searched" / gone.name)
    assert np.abs(again["q"][:, -1] - q_all[a:b]).max() < 1e-5 and (again["top"][:, -1] == top_all[a:b]).all()
    # a model trained with it; scored only with the held-out estimates given
    train_tiny(joint_root, "dense", max_steps=6, heldout=None, **joint_kw(joint_root, joint_estimates=str(est_knn)))
    m2, _ = load_model(joint_root / "dense")
    assert m2.cfg.joint == comps
    docs = heldout_docs(joint_root / "held")
    with pytest.raises(TeragramError, match="kNN datastore"):
        token_eval(m2, joint_root / "held", idx.eos_id, idx.sep, "cpu", index=idx)
    e = joint.heldout_est(idx, docs, m2.cfg.joint, 4, dense=knnlm.load_est(tmp_path, "indist", "test", m2.cfg.joint))
    got = token_eval(m2, joint_root / "held", idx.eos_id, idx.sep, "cpu", index=idx, estimates=e)
    assert np.isfinite(got["nll"]).all() and len(got["nll"]) == len(z["q"])
    # the same model over a store keyed by its own states (benchmarks/joint.py --own-store): brute
    # force's estimate over every training position under m2, at a temperature fit again against its LM
    own = knnlm.own_store(
        m2, joint_root / "idx", held, tmp_path / "own", "cpu",
        lambda name, h: joint.heldout_est(idx, docs, m2.cfg.joint, 4, dense=knnlm.load_est(tmp_path, name, h, m2.cfg.joint)),
        eval_batch=8,
    )  # fmt: skip
    k2, _, mu2 = knn.build(m2, joint_root / "idx", "cpu", batch=8, key="ffn_in")
    K2 = k2.float().numpy().astype(np.float64)
    assert own["keys"] == len(K) and own["key"] == "ffn_in" and own["mu_abs_sum"] != pytest.approx(info["mu_abs_sum"], rel=1e-3)
    r2 = token_eval(m2, held["indist", "test"], idx.eos_id, idx.sep, "cpu", hidden="ffn_in", index=idx, estimates=e)
    Q = r2["hidden"].astype(np.float64) - mu2.numpy()
    D = (Q**2).sum(1)[:, None] + (K2**2).sum(1)[None] - 2 * Q @ K2.T  # every query's squared distance to every key
    lower_median = float(np.sort(D.min(1))[(len(D) - 1) // 2])  # torch.median's; valid and test: the same text here
    assert own["temperature_scale"] == pytest.approx(lower_median, rel=1e-3)
    z2 = np.load(tmp_path / "own" / "knnest-indist-test.npz")
    temps2 = own["temperature_factor"] * own["temperature_scale"] * np.array(knn.MULTIPLES)
    assert (z2["target"] == r2["target"]).all() and not np.allclose(z2["q"], z["q"], atol=1e-3)
    checked = 0
    for j in rng.choice(len(r2["target"]), 300, replace=False):  # many tie at the k-th distance (copies of a document)
        o = np.argsort(D[j], kind="stable")[: k + 1]
        d = D[j, o]
        if d[k] - d[k - 1] >= 1e-3:
            w = np.exp(-(d[:k] - d[0])[None] / temps2[:, None])
            want = (w * (V[o[:k]] == r2["target"][j])).sum(1) / w.sum(1)
            np.testing.assert_allclose(z2["q"][j, :-1], want, rtol=2e-3, atol=1e-5)
            checked += 1
    assert checked > 60, checked
    with pytest.raises(TeragramError, match="no live source"):
        joint.live(idx, docs[0][:5], idx.vocab_size, m2.cfg.joint, 4)
    with pytest.raises(TeragramError, match="go last"):
        joint.check_components(("dense_knn", "index_infgram"))
    with pytest.raises(ConfigError, match="no kNN store"):
        train_tiny(
            joint_root,
            "dense-evals",
            max_steps=1,
            evals=("openbookqa",),
            **joint_kw(joint_root, joint_estimates=str(est_knn), joint_components=comps),
        )
    with pytest.raises(ConfigError, match="no source"):
        train_tiny(joint_root, "dense-bad", max_steps=1, **joint_kw(joint_root, joint_estimates=str(est_knn)))
    # outside training (teragram eval/sample/serve --knn-keys): the store rebuilt from the keys model
    # with the settings the checkpoint keeps gives the held-out estimates joint_estimates wrote, in bulk
    # and live, and the live mixture equals the bulk one
    kept = dict(m2.cfg.joint_knn)
    assert kept["temperature_factor"] == info["temperature_factor"] and kept["key"] == "ffn_in"
    with pytest.raises(TeragramError, match="another keys model"):  # settings written before "key": final states, not these
        knn.KnnSource(model, joint_root / "idx", [(f, v) for f, v in kept.items() if f != "key"], m2.cfg.joint)
    with pytest.raises(TeragramError, match="had dense_knn, dense_cache$"):  # settings written before the multiples: dense_knn only
        knn.KnnSource(model, joint_root / "idx", [(f, v) for f, v in kept.items() if f != "temperature_multiples"], m2.cfg.joint)
    with pytest.raises(TeragramError, match="dense_cache; its kNN estimates had dense_knn, dense_knn_sharp, dense_knn_broad$"):
        knn.KnnSource(model, joint_root / "idx", [(f, v) for f, v in kept.items() if f != "cache_temperature"], m2.cfg.joint)
    assert kept["cache_temperature"] == info["cache_temperature"]  # settings written before dense_cache: a gate reading it refused
    src = knn.KnnSource(model, joint_root / "idx", m2.cfg.joint_knn, m2.cfg.joint)
    bulk = src.documents(docs, idx.eos_id)
    assert len(bulk) == len(z["q"]) and bulk.q.shape[1] == nd + 1 and np.abs(bulk.q - z["q"]).max() < 1e-4
    assert (bulk.top == z["top"]).mean() > 0.99 and (bulk.count == z["count"]).mean() > 0.99
    one = ("index_infgram", "dense_knn_broad")  # a gate reading one of them: its column, in bulk and from the saved files
    np.testing.assert_array_equal(knnlm.load_est(tmp_path, "indist", "test", one).q[:, 0], z["q"][:, 2])
    sharp = knn.KnnSource(model, joint_root / "idx", m2.cfg.joint_knn, ("index_infgram", "dense_knn_sharp"))
    assert np.abs(sharp.documents(docs[:2], idx.eos_id).q[:, 0] - z["q"][: sum(len(x) + 1 for x in docs[:2]), 1]).max() < 1e-4
    via = token_eval(m2, joint_root / "held", idx.eos_id, idx.sep, "cpu", index=idx, knn=src)
    np.testing.assert_allclose(via["nll"], got["nll"], atol=1e-3)
    assert_live_is_bulk(m2, idx, docs, via, (0, 2), 30, knn=src)
    w = np.concatenate([[idx.eos_id], docs[1][:40]]).astype(np.int64)  # live's cached window state is the window's own,
    for n in (5, 6, 9, 9, 7, 12, 3):  # growing by one and by several, asked again, cut back (a rejected draft)
        torch.testing.assert_close(src._last_state(w[:n]), src._hidden([w[:n]], 1)[-1:], atol=1e-5, rtol=1e-5)
    g = generate(m2, idx, [int(i) for i in docs[0][:5]], max_new_tokens=4, knn=src)
    assert len(g.new_ids) == 4
    torch.manual_seed(1)
    other = GPT(GPTConfig.preset("tiny", vocab_size=idx.vocab_size, block_size=64, use_index=False, mixture=False)).eval()
    with pytest.raises(TeragramError, match="another keys model"):
        knn.KnnSource(other, joint_root / "idx", m2.cfg.joint_knn, m2.cfg.joint)
    with pytest.raises(TeragramError, match="reads no kNN estimate"):
        knn.source_for(other, "x", joint_root / "idx")  # a model that reads none
    # the CLI: eval with the store gives token_eval's mixture, without it a one-line refusal; sample runs
    from teragram.serve.main import main

    ev = ["eval", "--checkpoint", str(joint_root / "dense"), "--index", str(joint_root / "idx"), "--corpus", str(joint_root / "held-text")]
    assert main([*ev, "--knn-keys", str(joint_root / "keys"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["perplexity"] == pytest.approx(float(np.exp(via["nll"].mean())), rel=1e-3)
    assert main(ev) == 2 and "--knn-keys" in capsys.readouterr().err
    sa = ["sample", "--checkpoint", str(joint_root / "dense"), "--index", str(joint_root / "idx"), "The", "--max-tokens", "3"]
    assert main([*sa, "--knn-keys", str(joint_root / "keys")]) == 0 and capsys.readouterr().out.startswith("The")
    assert main(sa) == 2 and "no live source" in capsys.readouterr().err
    # evals: each candidate's mixture is token_eval's with the store; without it, one line before any work
    from teragram.model.evaluation.tasks import candidates, joint_estimates, load_task, model_outputs, run_task

    from tests.model.test_evals import _acc, _completion, _token_eval_of

    es = ["evals", "--checkpoint", str(joint_root / "dense"), "--index", str(joint_root / "idx"), "--tasks", "openbookqa"]
    es += ["--limit", "3", "--quiet"]
    assert main([*es, "--knn-keys", str(joint_root / "keys"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == [run_task(m2, idx, "openbookqa", limit=3, knn=src)]
    examples = load_task("openbookqa", 3)
    want = [
        _completion(_token_eval_of(m2, idx, d, tmp_path / f"cand{j}", knn=src), n, len(d))
        for j, (d, n) in enumerate(candidates(examples, idx.tokenize))
    ]  # fmt: skip
    cands = candidates(examples, idx.tokenize)
    outs = model_outputs(m2, cands, idx.eos_id, est=joint_estimates(m2, idx, cands, knn=src))
    assert all(len(d) <= m2.cfg.block_size for d, _ in cands)  # one window: the scorer's is token_eval's
    for o, w in zip(outs, want, strict=True):
        np.testing.assert_allclose(o["nll_joint"], w["nll"], atol=1e-4)
    acc, acc_norm = _acc(examples, [w["nll"] for w in want])
    assert (rows[0]["joint"]["acc"], rows[0]["joint"]["acc_norm"]) == (acc, acc_norm)
    assert main(es) == 2 and "give --knn-keys" in capsys.readouterr().err
    assert main([*es, "--model-only"]) == 0  # the model alone needs no store
    # serve: refused at start without the store; with it, /v1/score's gated logprobs are token_eval's
    from fastapi.testclient import TestClient
    from teragram.serve.app import ServeConfig, create_app

    with pytest.raises(TeragramError, match="give --knn-keys"):
        create_app(ServeConfig(index=str(joint_root / "idx"), checkpoint=str(joint_root / "dense")))
    app = create_app(ServeConfig(index=str(joint_root / "idx"), checkpoint=str(joint_root / "dense"), knn_keys=str(joint_root / "keys")))
    n = 40
    out = TestClient(app).post("/v1/score", json={"ids": [int(i) for i in docs[0][:n]]}).json()
    np.testing.assert_allclose(-np.array(out["logprobs_with_gate"]), via["nll"][np.nonzero(via["doc"] == 0)[0][:n]], atol=1e-3)
