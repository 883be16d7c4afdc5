"""transformers models under the index (model/hf/): the tiny native model exported with
`teragram export --hf` loads in transformers alone and gives the native path's per-token
log-probabilities and gated perplexities (with and without the continuous cache) through
`--hf-model`; eval, sample and serve run through it; a model of another tokenizer is refused in
one line before its weights are read."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch
from teragram.index.engine import Index
from teragram.index.errors import TeragramError, TokenizerMismatch
from teragram.model.checkpoint import load_model
from teragram.model.gpt import GPTConfig
from teragram.model.mixture import gate as gate_mod
from teragram.serve.main import main

from tests.conftest import DEFAULT
from tests.model.conftest import make_held_root, train_tiny

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def short_gate_fits(monkeypatch):
    """Gate fits of 20 L-BFGS iterations: both paths fit the same way, and the fits are the slow part."""
    monkeypatch.setitem(gate_mod.fit_weights.__kwdefaults__, "steps", 20)
    monkeypatch.setitem(gate_mod.Gate.fit.__func__.__kwdefaults__, "steps", 20)


@pytest.fixture(scope="module")
def root(tmp_path_factory, tokenizer_model):
    """A small index of real text with duplicated documents, held-out near-copies of 2 of them
    (held-text/, their held-out features in held/), and the tiny plain model trained a few steps
    on it (plain/)."""
    r = make_held_root(tmp_path_factory.mktemp("hf"), tokenizer_model, n_docs=10, max_chars=2000, n_held=2)
    train_tiny(r, "plain", max_steps=4, heldout=None)
    return r


@pytest.fixture(scope="module")
def exported(root, tmp_path_factory):
    """(native run, its export): the tiny plain model written by `teragram export --hf`."""
    out = tmp_path_factory.mktemp("hf") / "tiny"
    assert main(["export", "--hf", str(out), "--checkpoint", str(root / "plain")]) == 0
    return root / "plain", out


def _run(capsys, *args) -> str:
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def test_export_loads_in_transformers_alone_with_the_native_numbers(root, exported):
    from teragram.model.evaluation.perplexity import token_eval
    from teragram.model.hf.adapter import HFModel

    run, out = exported
    idx = Index(root / "idx")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    texts = [gzip.open(p, "rt").read() for p in sorted((DEFAULT / "heldout" / "valid").rglob("*.gz"))[:20]]
    assert len(texts) >= 10 and all(tok.encode(t) == idx.tokenize(t) for t in texts)  # real text, no special tokens added
    lm = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    native = load_model(run)[0].eval()
    x = torch.tensor([idx.tokenize(texts[0])[:64]])
    with torch.no_grad():
        torch.testing.assert_close(lm(input_ids=x).logits, native(x), atol=1e-4, rtol=0)
    a = token_eval(native, root / "held", idx.eos_id, idx.sep)
    b = token_eval(HFModel(lm, name=str(out)), root / "held", idx.eos_id, idx.sep)
    assert np.array_equal(a["target"], b["target"]) and len(a["nll"]) > 500
    assert np.abs(a["nll"] - b["nll"]).max() < 1e-4


def test_gated_perplexity_through_hf_model_equals_native(root, exported):
    """The gate over the exact-match estimates (t, as `--fit-gate --no-cont-cache` fits it) and the
    same gate with the continuous cache read from the model's own states (t+cc, its scale fit on
    each path's states), on the same estimates. The native path's gates applied to the transformers
    path's outputs give its gated perplexities to 1e-6; each path's own fit gives them to 1e-4 (a
    fit stopped after 20 L-BFGS steps moves by more than its inputs do: inputs equal to 1e-6 here
    gave fits 4e-5 apart, so a comparison of 4 rounded digits would fail wherever the two straddle
    a rounding boundary)."""
    from teragram.model.evaluation.mixing import EvalOptions, _mixed, cont_cache_of, fit_inputs, gated
    from teragram.model.evaluation.perplexity import token_eval
    from teragram.model.hf.adapter import load_hf
    from teragram.model.mixture import cont_cache as cc
    from teragram.model.mixture.estimates import COMPONENTS, heldout_estimates
    from teragram.model.mixture.gate import Gate

    run, out = exported
    idx = Index(root / "idx")
    est = heldout_estimates(idx, root / "held")
    keep = None
    paths = {}
    for name, model in (("native", load_model(run)[0]), ("hf", load_hf(str(out), index=idx)[0])):
        r = token_eval(model, root / "held", idx.eos_id, idx.sep, hidden=cc.KEY)
        keep = np.ones(len(r["nll"]), bool)
        mixed, gate_t, _ = gated(r, est, keep, EvalOptions(fit_gate=True, cont_cache=False))
        assert gate_t.cont_cache is None
        r["cont_cache"] = cont_cache_of(r, None)
        X, lp, spec = fit_inputs(r, est)
        gate_cc = Gate.fit(X, lp, components=COMPONENTS, cont_cache=spec)
        assert spec.key == "ffn_in" and gate_cc.components[-len(spec.names) :] == spec.names
        own = (np.exp(mixed.mean()), np.exp(_mixed(gate_cc, X, lp).mean()))
        paths[name] = (r, X, lp, spec, gate_t, gate_cc, own)
    (_, _, _, s1, native_t, native_cc, (t1, tcc1)), (r2, X2, lp2, s2, _, _, (t2, tcc2)) = paths["native"], paths["hf"]
    assert s2.scale == pytest.approx(s1.scale, rel=1e-6) and np.isfinite([t1, tcc1]).all() and tcc1 != t1
    same_gate = (np.exp(gated(r2, est, keep, EvalOptions(gate=native_t))[0].mean()), np.exp(_mixed(native_cc, X2, lp2).mean()))
    for p1, p2 in zip((t1, tcc1), same_gate):
        assert abs(p1 - p2) < 1e-6 * p1
    for p1, p2 in ((t1, t2), (tcc1, tcc2)):
        assert abs(p1 - p2) < 1e-4 * p1


def test_eval_sample_and_serve_run_through_hf_model(root, exported, tmp_path, capsys):
    from fastapi.testclient import TestClient
    from teragram.serve.app import ServeConfig, create_app

    run, out = exported
    ix, text = root / "idx", root / "held-text"
    ev = ["eval", "--hf-model", out, "--index", ix, "--quiet", "--json"]
    fit = json.loads(
        _run(capsys, *ev, "--corpus", text, "--fit-gate", tmp_path / "gate.json", "--fit-rows", 2000, "--save-outputs", tmp_path / "outs")
    )
    again = json.loads(_run(capsys, *ev, "--corpus", text, "--gate", tmp_path / "gate.json", "--decontaminate", "--batch-size", 3))
    assert again["decontaminated"]["docs"] == 2 and again["tokens"] <= fit["tokens"]
    saved = json.loads(
        _run(capsys, "eval", "--outputs", tmp_path / "outs", "--index", ix, "--gate", tmp_path / "gate.json", "--quiet", "--json")
    )
    assert saved["perplexity"] == pytest.approx(fit["perplexity"], rel=1e-6)
    # a gate fit on the native model's outputs is another model's: refused
    _run(
        capsys,
        "eval",
        "--checkpoint",
        run,
        "--index",
        ix,
        "--corpus",
        text,
        "--fit-gate",
        tmp_path / "native.json",
        "--fit-rows",
        1000,
        "--no-cont-cache",
        "--quiet",
    )
    assert main([*map(str, ev), "--corpus", str(text), "--gate", str(tmp_path / "native.json")]) == 2
    assert "another model" in capsys.readouterr().err
    # greedy sampling with drafts (the cache cropped after a rejected draft) gives the native model's tokens
    sa = ["sample", "--index", ix, "The kernel is the core", "--max-tokens", 24, "--temperature", 0, "--draft", 4]
    assert _run(capsys, *sa, "--hf-model", out) == _run(capsys, *sa, "--checkpoint", run)
    gated = _run(capsys, *sa, "--hf-model", out, "--gate", tmp_path / "gate.json", "--provenance", "--verbose")
    assert gated.startswith("The kernel is the core") and "provenance" in gated
    # the server's endpoints (the model in a process of its own): scores equal the native model's
    with TestClient(create_app(ServeConfig(index=str(ix), hf_model=str(out), gate=str(tmp_path / "gate.json"), max_tokens=16))) as c:
        r = c.post("/v1/completions", json={"prompt": "The kernel", "max_tokens": 8, "draft": 2, "provenance": True})
        assert r.status_code == 200 and len(r.json()["provenance"]) >= 1
        s = c.post("/v1/score", json={"text": "The kernel is the core of the system."}).json()
        assert c.get("/stats").json()["model"]["config"]["class"] == "GPT2LMHeadModel"
    idx = Index(ix)
    ids = idx.tokenize("The kernel is the core of the system.")
    assert s["token_ids"] == ids and len(s["logprobs_with_gate"]) == len(ids)
    with torch.no_grad():  # the text read as a document: EOS, then its tokens
        logp = torch.log_softmax(load_model(run)[0].eval()(torch.tensor([[idx.eos_id, *ids[:-1]]])), -1)[0]
    native = logp[torch.arange(len(ids)), torch.tensor(ids)].numpy()
    assert np.abs(np.array(s["logprobs_with_index"]) - native).max() < 1e-4


def _tiny_gpt2(out, tokenizer, vocab: int) -> None:
    """A tiny random GPT-2 made with transformers' GPT2Config, saved with `tokenizer`."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=48, n_embd=32, n_layer=2, n_head=2, bos_token_id=2, eos_token_id=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)


def test_a_transformers_gpt2_runs_and_another_tokenizer_is_refused_before_its_weights(root, exported, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    ix, text = root / "idx", root / "held-text"
    _, out = exported
    same = tmp_path / "gpt2"
    _tiny_gpt2(same, transformers.AutoTokenizer.from_pretrained(out), Index(ix).vocab_size)
    r = json.loads(_run(capsys, "eval", "--hf-model", same, "--index", ix, "--corpus", text, "--quiet", "--json"))
    assert r["tokens"] > 500 and r["perplexity"] > 100  # a random model: about the vocabulary's size
    assert _run(capsys, "sample", "--hf-model", same, "--index", ix, "The", "--max-tokens", 40).startswith("The")  # past its 48 positions
    # a byte-level BPE of its own, trained on real text: refused in one line, before the (broken) weights are read
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator((t.read_text() for t in sorted(text.iterdir())), trainers.BpeTrainer(vocab_size=1000, special_tokens=["</s>"]))
    other = tmp_path / "other"
    _tiny_gpt2(other, transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>"), 1000)
    (other / "model.safetensors").write_bytes(b"not weights")
    capsys.readouterr()
    for argv in (["eval", "--corpus", str(text), "--quiet"], ["sample", "The"]):
        assert main([*argv, "--hf-model", str(other), "--index", str(ix)]) == 2
        err = capsys.readouterr().err.strip()
        assert "its tokenizer is not the index's" in err and len(err.splitlines()) == 1


def test_export_refuses_what_no_standard_architecture_holds():
    from teragram.model.hf.export import refuse_unmappable

    refuse_unmappable(GPTConfig(use_index=False))
    with pytest.raises(TeragramError, match="ReLU²"):
        refuse_unmappable(GPTConfig(use_index=False, arch="modern"))
    with pytest.raises(TeragramError, match="index inputs"):
        refuse_unmappable(GPTConfig(use_index=True))
    assert issubclass(TokenizerMismatch, TeragramError)


def test_sentencepiece_merges_are_those_transformers_ranks(tokenizer_model):
    """spm_merges (made for transformers < 5.2x, which builds a sentencepiece BPE with no merges)
    equals what a transformers that builds them itself makes, and encodes as sentencepiece does."""
    import inspect

    from teragram.index import tokenizer
    from teragram.model.hf.export import spm_merges
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    proto = import_protobuf().ModelProto()
    proto.ParseFromString(tokenizer_model.read_bytes())
    assert proto.trainer_spec.model_type == 2  # BPE, what build-index trains
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    build = SpmConverter.build_tokenizer_from_spm_proto
    if "legacy" not in inspect.signature(build).parameters:
        pytest.skip("this transformers builds no merges itself: nothing to compare with")
    ours, theirs = build(proto, vocab, merges=spm_merges(proto), legacy=False), build(proto, vocab, legacy=False)
    assert len(spm_merges(proto)) > 100 and ours.to_str() == theirs.to_str()
    text = "The kernel's scheduler picks the next task: static int foo(struct bar *b) { return b->x[42]; }"
    assert ours.encode(text, add_special_tokens=False).ids == list(tokenizer.load(tokenizer_model).encode(text))
