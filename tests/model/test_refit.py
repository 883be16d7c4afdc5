"""The joint gate refit on validation text (model/mixture/refit.py): it lowers the validation nll it is
fit on and the nll of other held-out documents, leaves the LM alone, scores test text exactly
as token_eval does with the refit gate in the model, and refuses a gate of another model."""

import copy
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from teragram.builder.features import compute_features
from teragram.index.engine import Index
from teragram.index.errors import TeragramError
from teragram.index.features import FeatureConfig
from teragram.model.checkpoint import load_model
from teragram.model.evaluation.perplexity import token_eval
from teragram.model.gpt import GPT
from teragram.model.mixture import joint, refit

from tests.model.conftest import joint_kw, other_tokenizer_checkpoint, train_tiny

COMPONENTS = ("index_infgram", "index_3gram", "cache_longest", "cache_2gram")


@pytest.fixture(scope="module")
def run(joint_root):
    """A joint model trained briefly (its gate still near its start: on the model), the held-out
    near-copies split by document into a validation and a test half, the gate's inputs on each
    (with token_eval's result under the trained gate), the model's parameters before any refit,
    and the gate refit on validation: by default and with the hidden projection too."""
    train_tiny(joint_root, "refit", max_steps=10, heldout=None, **joint_kw(joint_root, joint_components=COMPONENTS))
    files = sorted((joint_root / "held-text").iterdir())
    for h, fs in (("valid", files[::2]), ("test", files[1::2])):
        cfg = FeatureConfig("held-out", 64, 1)
        compute_features(joint_root / "idx", joint_root / f"refit-{h}", cfg, corpus=[str(f) for f in fs], progress=False)
    model, _ = load_model(joint_root / "refit")
    idx = Index(joint_root / "idx")
    out = {"root": joint_root, "model": model, "idx": idx}
    for h in ("valid", "test"):
        out[h], out[f"r_{h}"] = refit.gate_inputs(model, joint_root / f"refit-{h}", idx)
    out["before"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out | {"gate": refit.refit_gate(model, out["valid"]), "gate_hidden": refit.refit_gate(model, out["valid"], hidden=True)}


def test_refit_lowers_nll_on_validation_and_other_documents_and_leaves_the_lm(run):
    model, valid, test = run["model"], run["valid"], run["test"]
    # the cached inputs reproduce token_eval with the trained gate
    assert np.allclose(refit.gated_nll(model.joint_gate, valid), run["r_valid"]["nll"], atol=1e-5)
    gate, both = run["gate"], run["gate_hidden"]
    v0, v1 = run["r_valid"]["nll"].mean(), refit.gated_nll(gate, valid).mean()
    t0, t1 = run["r_test"]["nll"].mean(), refit.gated_nll(gate, test).mean()
    assert v1 < v0 - 0.1, (v0, v1)  # near-copies of indexed text: the estimates deserve far more weight than 10 steps gave them
    assert t1 < t0 - 0.1, (t0, t1)  # and so they do on documents the fit never saw
    before, after = run["before"], model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the LM, its head and its own gate untouched
    assert torch.equal(gate.hidden.weight, model.joint_gate.hidden.weight)  # by default the hidden projection stays
    assert not torch.equal(gate.table.weight, model.joint_gate.table.weight)
    assert not torch.equal(both.hidden.weight, model.joint_gate.hidden.weight)
    assert refit.gated_nll(both, valid).mean() < v0 - 0.1


def _objective_grad(gate, inputs, start, l2) -> float:
    """The norm of the refit objective's gradient in the statistics' weights at `gate`."""
    g = copy.deepcopy(gate).requires_grad_(True)
    free = {n: p for n, p in g.named_parameters() if not n.startswith("hidden.")}
    nll = joint.mixture_nll(g(inputs.hidden, inputs.est, inputs.maxp, inputs.top), inputs.lp_target, inputs.est).mean()
    loss = nll + l2 * sum(((p - start[n]) ** 2).sum() for n, p in free.items())
    grads = torch.autograd.grad(loss, list(free.values()))
    return float(torch.sqrt(sum((x**2).sum() for x in grads)))


def test_refit_is_a_minimum_of_its_objective(run):
    """First-order optimality, measured apart from the optimizer: the gradient of the penalised
    validation nll nearly vanishes at the refit gate, unlike at the trained one."""
    trained = run["model"].joint_gate
    start = {n: p.detach().clone() for n, p in trained.named_parameters()}
    g0 = _objective_grad(trained, run["valid"], start, refit.L2)
    g1 = _objective_grad(run["gate"], run["valid"], start, refit.L2)
    assert g1 < 0.01 * g0, (g0, g1)


def test_the_saved_refit_gate_scores_test_text_as_token_eval_does(run, tmp_path):
    root, idx = run["root"], run["idx"]
    refit.save_gate(tmp_path / "gate.safetensors", run["model"], run["gate"], {"targets": len(run["valid"])})
    fresh, _ = load_model(root / "refit")
    refit.install_gate(fresh, refit.load_gate(tmp_path / "gate.safetensors", fresh))
    r = token_eval(fresh, root / "refit-test", idx.eos_id, idx.sep, index=idx)
    assert np.array_equal(r["target"], run["r_test"]["target"])
    assert np.allclose(r["nll"], refit.gated_nll(run["gate"], run["test"]), atol=1e-5, rtol=0)
    assert np.abs(r["nll"] - run["r_test"]["nll"]).max() > 0.1  # not the trained gate's numbers


def test_a_gate_of_another_model_or_no_gate_is_refused(run, tmp_path):
    model, idx, valid, root = run["model"], run["idx"], run["valid"], run["root"]
    path = refit.save_gate(tmp_path / "gate.safetensors", model, run["gate"])
    other = load_model(root / "refit")[0]
    with torch.no_grad():
        other.transformer.h[0].mlp.c_fc.weight[0, 0] += 1e-3  # another LM of the same shape
    with pytest.raises(TeragramError, match="refit for another model"):
        refit.load_gate(path, other)
    with pytest.raises(TeragramError, match="a gate over"):
        refit.load_gate(path, GPT(replace(model.cfg, joint=("index_infgram", "cache_longest"))))
    plain = GPT(replace(model.cfg, joint=()))
    with pytest.raises(TeragramError, match="for a jointly trained model"):
        refit.load_gate(path, plain)
    with pytest.raises(TeragramError, match="only a jointly trained model"):
        refit.gate_inputs(plain, root / "refit-valid", idx)
    for bad in (root / "refit" / "latest.json", next((root / "refit" / "checkpoints").iterdir()) / "model.safetensors"):
        with pytest.raises(TeragramError, match="not a refit joint gate"):
            refit.load_gate(bad, model)
    with pytest.raises(TeragramError, match="no validation targets"):
        refit.refit_gate(model, valid.select(np.zeros(len(valid), bool)))
    with pytest.raises(TeragramError, match="targets x"):  # estimates of other text
        token_eval(model, root / "refit-test", idx.eos_id, idx.sep, index=idx, estimates=valid.est.map(lambda x: x.numpy()))


def test_eval_refits_on_validation_and_applies_the_gate_on_test(run, tmp_path, capsys):
    """The CLI path gives the library's numbers: --refit-gate on the validation half's text, then
    --joint-gate on the test half's."""
    from teragram.serve.main import main

    root, out = run["root"], tmp_path / "gate.safetensors"
    text = sorted((root / "held-text").iterdir())
    ev = ["eval", "--checkpoint", str(root / "refit"), "--index", str(root / "idx"), "--json"]
    assert main([*ev, "--corpus", *map(str, text[::2]), "--refit-gate", str(out)]) == 0
    fit = json.loads(capsys.readouterr().out)
    assert fit["perplexity"] == pytest.approx(float(np.exp(refit.gated_nll(run["gate"], run["valid"]).mean())), rel=1e-4)
    assert fit["refit"]["perplexity_trained_gate"] == pytest.approx(float(np.exp(run["r_valid"]["nll"].mean())), rel=1e-5)
    assert main([*ev, "--corpus", *map(str, text[1::2]), "--joint-gate", str(out)]) == 0
    test = json.loads(capsys.readouterr().out)
    gate = refit.load_gate(out, run["model"])
    assert test["tokens"] == len(run["test"]) and test["joint_gate"] == str(out)
    assert test["perplexity"] == pytest.approx(float(np.exp(refit.gated_nll(gate, run["test"]).mean())), rel=1e-5)
    assert test["perplexity"] < float(np.exp(run["r_test"]["nll"].mean()))
    # a gate trained on another tokenizer's estimates: refused in one line, before any work
    bad = other_tokenizer_checkpoint(root / "refit", tmp_path)
    assert main(["eval", "--checkpoint", str(bad), "--index", str(root / "idx"), "--corpus", str(text[0])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "joint gate was trained with" in err
    combined = [*ev, "--corpus", str(text[0]), "--refit-gate", str(tmp_path / "x"), "--fit-gate", str(tmp_path / "y")]
    assert main(combined) == 2 and "--refit-gate refits" in capsys.readouterr().err


def test_serve_scores_with_the_models_own_gate_or_a_refit_one_as_token_eval(run, tmp_path):
    """/v1/score of a jointly trained model gives its own gate's mixture (logprobs_with_gate),
    token_eval's numbers for the same text; with --joint-gate, those of the refit gate."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from teragram.model.mixture.estimates import heldout_docs
    from teragram.serve.app import ServeConfig, create_app

    root, idx = run["root"], run["idx"]
    path = refit.save_gate(tmp_path / "gate.safetensors", run["model"], run["gate"])
    refitted = load_model(root / "refit")[0]
    refit.install_gate(refitted, run["gate"])
    docs, B = heldout_docs(root / "refit-test"), run["model"].cfg.block_size
    for gate_file, model in ((None, load_model(root / "refit")[0]), (path, refitted)):
        r = token_eval(model, root / "refit-test", idx.eos_id, idx.sep, index=idx)
        cfg = ServeConfig(index=str(root / "idx"), checkpoint=str(root / "refit"), joint_gate=gate_file and str(gate_file))
        client = TestClient(create_app(cfg))
        for d in (0, 2):
            ids = [int(t) for t in docs[d][:B]]  # one window: the model reads what token_eval's first window reads
            got = client.post("/v1/score", json={"ids": ids}).json()
            sel = np.nonzero(r["doc"] == d)[0][: len(ids)]
            assert np.array_equal(r["target"][sel], ids)
            assert np.allclose(got["logprobs_with_gate"], -r["nll"][sel], atol=2e-4), (gate_file, d)
            assert np.abs(np.array(got["logprobs_with_gate"]) - got["logprobs_with_index"]).max() > 0.01  # not the LM's own
    with pytest.raises(TeragramError, match="needs --checkpoint"):
        create_app(ServeConfig(index=str(root / "idx"), joint_gate=str(path)))
    with pytest.raises(TeragramError, match="no post-hoc --gate"):
        create_app(ServeConfig(index=str(root / "idx"), checkpoint=str(root / "refit"), gate=str(path)))


def test_sample_with_a_refit_gate_generates_what_the_installed_gate_does(run, tmp_path, capsys):
    from teragram.model.generation.sample import generate
    from teragram.serve.main import main

    root, idx = run["root"], run["idx"]
    path = refit.save_gate(tmp_path / "gate.safetensors", run["model"], run["gate"])
    refitted = load_model(root / "refit")[0]
    refit.install_gate(refitted, run["gate"])
    prompt = "The kernel"
    kw = dict(max_new_tokens=30, temperature=1.0, top_p=0.95, seed=1)  # sampled: the distributions, not only their argmax
    want = idx.decode(generate(refitted, idx, idx.tokenize(prompt), **kw).ids)
    own = idx.decode(generate(load_model(root / "refit")[0], idx, idx.tokenize(prompt), **kw).ids)
    args = ["sample", "--checkpoint", str(root / "refit"), "--index", str(root / "idx"), prompt, "--max-tokens", "30", "--temperature", "1"]
    args += ["--top-p", "0.95", "--seed", "1"]
    assert want != own  # the refit gate changes what is generated
    assert main(args + ["--joint-gate", str(path)]) == 0
    assert capsys.readouterr().out[:-1] == want  # print's newline
    assert main(args) == 0
    assert capsys.readouterr().out[:-1] == own


def test_inputs_from_estimates_given_and_kept_for_the_next_variant(run, tmp_path):
    """gate_inputs over estimates computed once (benchmarks/joint.py keeps each half's for the
    next variant with the same components) gives the inputs it computes itself; estimates of
    other text are refused."""
    from dataclasses import fields

    from benchmarks import joint as bench

    model, idx, root = run["model"], run["idx"], run["root"]
    made = bench._heldout_est(tmp_path, idx, model, root / "refit-valid", "s", "valid", None, 1)
    assert len(list((tmp_path / "heldest").iterdir())) == 1
    kept = bench._heldout_est(tmp_path, idx, model, root / "refit-valid", "s", "valid", None, 1)  # read back
    assert all(np.array_equal(getattr(made, f.name), getattr(kept, f.name)) for f in fields(joint.Est))
    inputs, r = refit.gate_inputs(model, root / "refit-valid", idx, est=kept)
    assert np.array_equal(r["nll"], run["r_valid"]["nll"])
    assert all(torch.equal(getattr(inputs.est, f.name), getattr(run["valid"].est, f.name)) for f in fields(joint.Est))
    with pytest.raises(TeragramError, match="targets x"):
        refit.gate_inputs(model, root / "refit-test", idx, est=kept)
    # prep computes them before any variant is trained, keyed by what the variant's config will name
    from teragram.model.mixture.estimates import COMPONENTS as ALL
    from teragram.model.mixture.estimates import INDEX

    assert bench._own_components("knnj3") == bench._own_components("joint") == ALL  # the dense ones left out
    assert bench._own_components("nocache") == tuple(c for c in INDEX if c in bench.VARIANTS["nocache"][0])
    bench._heldest(tmp_path / "prep", idx, root / "refit-valid", "s", "valid", COMPONENTS, model.cfg.joint_top_k, 1)
    read = bench._heldout_est(tmp_path / "prep", idx, model, root / "refit-valid", "s", "valid", None, 1)
    assert len(list((tmp_path / "prep" / "heldest").iterdir())) == 1  # read, not computed again
    assert all(np.array_equal(getattr(made, f.name), getattr(read, f.name)) for f in fields(joint.Est))
