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
from tests.model.conftest import train_tiny

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def short_gate_fits(monkeypatch):
    """Gate fits of 40 L-BFGS iterations: both paths fit the same way, and the fits are the slow part."""
    monkeypatch.setitem(gate_mod.fit_weights.__kwdefaults__, "steps", 40)
    monkeypatch.setitem(gate_mod.Gate.fit.__func__.__kwdefaults__, "steps", 40)


@pytest.fixture(scope="module")
def exported(held_root, tmp_path_factory):
    """(native run, its export): the tiny plain model, a few steps trained, written by `teragram export --hf`."""
    train_tiny(held_root, "hf-plain", max_steps=8)
    out = tmp_path_factory.mktemp("hf") / "tiny"
    assert main(["export", "--hf", str(out), "--checkpoint", str(held_root / "hf-plain")]) == 0
    return held_root / "hf-plain", out


@pytest.fixture(scope="module")
def held(held_root, tmp_path_factory):
    """(text, held-out features) of two of held_root's held-out documents: enough for two gate fits, quick."""
    from teragram.builder.features import compute_features
    from teragram.index.features import FeatureConfig

    d = tmp_path_factory.mktemp("hfheld")
    (d / "text").mkdir()
    for p in sorted((held_root / "held-text").iterdir())[:2]:
        (d / "text" / p.name).write_text(p.read_text())
    compute_features(held_root / "idx", d / "feats", FeatureConfig("held-out", 64, 1), corpus=[str(d / "text")], progress=False)
    return d / "text", d / "feats"


def _run(capsys, *args) -> str:
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def test_export_loads_in_transformers_alone_with_the_native_numbers(held_root, exported):
    from teragram.model.evaluation.perplexity import token_eval
    from teragram.model.hf.adapter import HFModel

    run, out = exported
    idx = Index(held_root / "idx")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    texts = [gzip.open(p, "rt").read() for p in sorted((DEFAULT / "heldout" / "valid").rglob("*.gz"))[:40]]
    assert len(texts) >= 10 and all(tok.encode(t) == idx.tokenize(t) for t in texts)  # real text, no special tokens added
    lm = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    native = load_model(run)[0].eval()
    x = torch.tensor([idx.tokenize(texts[0])[:64]])
    with torch.no_grad():
        torch.testing.assert_close(lm(input_ids=x).logits, native(x), atol=1e-4, rtol=0)
    a = token_eval(native, held_root / "held", idx.eos_id, idx.sep)
    b = token_eval(HFModel(lm, name=str(out)), held_root / "held", idx.eos_id, idx.sep)
    assert np.array_equal(a["target"], b["target"]) and len(a["nll"]) > 1000
    assert np.abs(a["nll"] - b["nll"]).max() < 1e-4


@pytest.mark.parametrize("cont_cache", [True, False])
def test_gated_perplexity_through_hf_model_equals_native(held_root, exported, held, cont_cache):
    from teragram.model.evaluation.perplexity import gated_eval
    from teragram.model.hf.adapter import load_hf

    run, out = exported
    idx = Index(held_root / "idx")
    native = load_model(run)[0]
    hf = load_hf(str(out), index=idx)[0]
    g1, _, mixed1 = gated_eval(native, idx, held[1], cont_cache=cont_cache)
    g2, _, mixed2 = gated_eval(hf, idx, held[1], cont_cache=cont_cache)
    assert (g1.cont_cache is not None) == (g2.cont_cache is not None)
    if cont_cache:
        assert g2.cont_cache.key == "ffn_in" and g2.cont_cache.scale == pytest.approx(g1.cont_cache.scale, rel=1e-4)
    p1, p2 = np.exp(mixed1.mean()), np.exp(mixed2.mean())
    assert np.isfinite(p1) and f"{p1:.4g}" == f"{p2:.4g}" and abs(p1 - p2) < 1e-4 * p1


def test_eval_sample_and_serve_run_through_hf_model(held_root, exported, held, tmp_path, capsys):
    from fastapi.testclient import TestClient
    from teragram.serve.app import ServeConfig, create_app

    run, out = exported
    ix, text = held_root / "idx", held[0]
    ev = ["eval", "--hf-model", out, "--index", ix, "--quiet", "--json"]
    fit = json.loads(_run(capsys, *ev, "--corpus", text, "--fit-gate", tmp_path / "gate.json", "--save-outputs", tmp_path / "outs"))
    again = json.loads(_run(capsys, *ev, "--corpus", text, "--gate", tmp_path / "gate.json", "--decontaminate", "--batch-size", 3))
    assert again["decontaminated"]["docs"] == 2 and again["tokens"] <= fit["tokens"]
    saved = json.loads(
        _run(capsys, "eval", "--outputs", tmp_path / "outs", "--index", ix, "--gate", tmp_path / "gate.json", "--quiet", "--json")
    )
    assert saved["perplexity"] == pytest.approx(fit["perplexity"], rel=1e-6)
    # a gate fit on the native model's outputs is another model's: refused
    _run(capsys, "eval", "--checkpoint", run, "--index", ix, "--corpus", text, "--fit-gate", tmp_path / "native.json", "--quiet")
    assert main([*map(str, ev), "--corpus", str(text), "--gate", str(tmp_path / "native.json")]) == 2
    assert "another model" in capsys.readouterr().err
    # greedy sampling with drafts (the cache cropped after a rejected draft) gives the native model's tokens
    sa = ["sample", "--index", ix, "The kernel is the core", "--max-tokens", 24, "--temperature", 0, "--draft", 4]
    assert _run(capsys, *sa, "--hf-model", out) == _run(capsys, *sa, "--checkpoint", run)
    gated = _run(capsys, *sa, "--hf-model", out, "--gate", tmp_path / "gate.json", "--provenance", "--verbose")
    assert gated.startswith("The kernel is the core") and "provenance" in gated
    # the server's endpoints: scores equal the native model's
    with TestClient(create_app(ServeConfig(index=str(ix), hf_model=str(out), gate=str(tmp_path / "gate.json"), max_tokens=16))) as c:
        r = c.post("/v1/completions", json={"prompt": "The kernel", "max_tokens": 8, "draft": 2, "provenance": True})
        assert r.status_code == 200 and len(r.json()["provenance"]) >= 1
        s = c.post("/v1/score", json={"text": "The kernel is the core of the system."}).json()
        assert c.get("/stats").json()["model"]["config"]["class"] == "GPT2LMHeadModel"
    with TestClient(create_app(ServeConfig(index=str(ix), checkpoint=str(run)))) as c:
        n = c.post("/v1/score", json={"text": "The kernel is the core of the system."}).json()
    assert np.abs(np.array(s["logprobs_with_index"]) - n["logprobs_with_index"]).max() < 1e-4
    assert len(s["logprobs_with_gate"]) == len(s["token_ids"])


def _tiny_gpt2(out, tokenizer, vocab: int) -> None:
    """A tiny random GPT-2 made with transformers' GPT2Config, saved with `tokenizer`."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=48, n_embd=32, n_layer=2, n_head=2, bos_token_id=2, eos_token_id=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)


def test_a_transformers_gpt2_runs_and_another_tokenizer_is_refused_before_its_weights(held_root, exported, held, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    ix, text = held_root / "idx", held[0]
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
