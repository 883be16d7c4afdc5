"""The README's "Your own model" commands, end to end, on a model whose tokenizer is not
sentencepiece: a tiny random GPT-2 made with `transformers` and a byte-level BPE trained with
`tokenizers` on the embedded corpus, saved as a model directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json). `build-index --tokenizer DIR`, `eval --hf-model DIR
--fit-gate`, `eval --gate --decontaminate`, `--save-outputs` then `--outputs`, `sample` and the
server's /v1/score, each in this process through the CLI's own `main`."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from teragram.index.engine import Index
from teragram.index.errors import TokenizerMismatch
from teragram.serve.main import main

from tests.conftest import DEFAULT, tiny_hf_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def short_gate_fits(monkeypatch):
    """Gate fits of 20 L-BFGS iterations: the commands are what is tested here, and the fits are the slow part."""
    from teragram.model.mixture import gate as gate_mod

    monkeypatch.setitem(gate_mod.fit_weights.__kwdefaults__, "steps", 20)
    monkeypatch.setitem(gate_mod.Gate.fit.__func__.__kwdefaults__, "steps", 20)


def _copy_gz(files, out):
    out.mkdir(parents=True)
    for i, f in enumerate(files):
        (out / f"{i:02d}-{f.name.removesuffix('.gz')}").write_text(gzip.open(f, "rt", encoding="utf-8").read())
    return out


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """(model directory, its index, valid text, test text): the model's BPE trained on the corpus
    the index holds (part of data/default/train), the index built by `build-index --tokenizer DIR`."""
    root = tmp_path_factory.mktemp("own")
    train = sorted((DEFAULT / "train" / "linux-doc").glob("[lps]*/**/*.rst.gz"))[:40]  # locking/, process/, scheduler/
    corpus = _copy_gz(train, root / "corpus")
    model = tiny_hf_model(root / "model", (p.read_text() for p in sorted(corpus.iterdir())))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in model.iterdir()}
    assert main(["build", str(corpus), "--out", str(root / "idx"), "--tokenizer", str(model), "--workers", "1", "--quiet"]) == 0
    held = sorted((DEFAULT / "heldout").rglob("*.rst.gz"))
    valid = _copy_gz([p for p in held if "/valid/" in str(p)][:3], root / "valid")
    test = _copy_gz([p for p in held if "/test/" in str(p)][:3], root / "test")
    return model, root / "idx", valid, test


def _run(capsys, *args) -> str:
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def test_the_index_speaks_the_models_tokenizer(own):
    model, ix, valid, _ = own
    idx = Index(ix)
    m = idx.manifest["tokenizer"]
    assert m["kind"] == "hf" and (ix / "tokenizer.json").is_file() and not (ix / "tokenizer.model").exists()
    tok = transformers.AutoTokenizer.from_pretrained(model)
    assert idx.eos_id == tok.eos_token_id and idx.vocab_size == len(tok)
    text = next(valid.iterdir()).read_text()
    assert idx.tokenize(text) == tok.encode(text, add_special_tokens=False) and idx.decode(idx.tokenize(text)) == text


def test_the_readme_commands_on_a_bpe_gpt2(own, tmp_path, capsys):
    from fastapi.testclient import TestClient
    from teragram.model.evaluation.outputs import load_outputs
    from teragram.serve.app import ServeConfig, create_app

    model, ix, valid, test = own
    gate, outs = tmp_path / "gate.json", tmp_path / "outs"
    ev = ["eval", "--hf-model", model, "--index", ix, "--quiet", "--json"]
    fit = json.loads(_run(capsys, *ev, "--corpus", valid, "--fit-gate", gate, "--fit-rows", 2000, "--save-outputs", outs))
    assert fit["tokens"] > 1000 and fit["perplexity"] < fit["model"]["perplexity"]  # a random model: the index gate helps
    saved = load_outputs(outs)
    assert (outs / "tokenizer.json").read_bytes() == (ix / "tokenizer.json").read_bytes()
    assert saved.manifest["tokenizer"] == Index(ix).manifest["tokenizer"]["digest"]
    again = json.loads(_run(capsys, "eval", "--outputs", outs, "--index", ix, "--gate", gate, "--quiet", "--json"))
    assert again["perplexity"] == pytest.approx(fit["perplexity"], rel=1e-6)
    r = json.loads(_run(capsys, *ev, "--corpus", test, "--gate", gate, "--decontaminate"))
    assert r["decontaminated"]["docs"] == 3 and np.isfinite(r["perplexity"]) and r["perplexity"] < r["model"]["perplexity"]
    out = _run(capsys, "sample", "--hf-model", model, "--index", ix, "static int", "--gate", gate, "--draft", 8, "--max-tokens", 30)
    assert out.startswith("static int")
    with TestClient(create_app(ServeConfig(index=str(ix), hf_model=str(model), gate=str(gate), max_tokens=8))) as c:
        s = c.post("/v1/score", json={"text": "The lock is held by the scheduler."})
        assert s.status_code == 200, s.text
        s = s.json()
    ids = Index(ix).tokenize("The lock is held by the scheduler.")
    assert s["token_ids"] == ids and len(s["logprobs_with_gate"]) == len(ids)
    assert all(lp <= 0 for lp in s["logprobs_with_gate"])


def test_saved_outputs_are_refused_by_an_index_of_another_tokenizer_file(own, tmp_path, capsys):
    """The identity rule: the tokenizer file's digest. The same BPE re-serialized (the same ids,
    another file) is another tokenizer for saved outputs; an HF model is checked by its ids."""
    from teragram.index import tokenizer
    from teragram.model.evaluation.outputs import check_tokenizer, load_outputs

    model, ix, valid, _ = own
    outs = tmp_path / "outs"
    _run(capsys, "eval", "--hf-model", model, "--index", ix, "--corpus", valid, "--save-outputs", outs, "--quiet")
    other = tmp_path / "idx2"
    other.mkdir()
    data = json.loads((ix / "tokenizer.json").read_text())
    (other / "tokenizer.json").write_text(json.dumps(data, indent=1))  # the same tokenizer, written another way
    assert tokenizer.load(other).encode("The lock") == tokenizer.load(ix).encode("The lock")
    check_tokenizer(load_outputs(outs), ix)
    with pytest.raises(TokenizerMismatch, match="another tokenizer"):
        check_tokenizer(load_outputs(outs), other)


def test_a_native_model_of_a_bpe_index_exports_with_the_indexs_tokenizer_json(own, tmp_path):
    """export --hf of an index whose tokenizer is a tokenizer.json writes that file byte for byte
    (its digest, its EOS), and transformers loads it giving the index's ids."""
    from teragram.index import tokenizer

    from tests.model.conftest import train_tiny

    _, ix, valid, _ = own
    root = ix.parent
    train_tiny(root, "native", max_steps=2, heldout=None, out=str(tmp_path / "native"))
    assert main(["export", "--hf", str(tmp_path / "hf"), "--checkpoint", str(tmp_path / "native")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (ix / "tokenizer.json").read_bytes()
    assert tokenizer.digest(tmp_path / "hf") == Index(ix).manifest["tokenizer"]["digest"]
    assert tokenizer.load(tmp_path / "hf").eos_id == Index(ix).eos_id
    text = next(valid.iterdir()).read_text()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok(text, add_special_tokens=False)["input_ids"] == Index(ix).tokenize(text)
