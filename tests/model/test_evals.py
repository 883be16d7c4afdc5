"""Downstream multiple-choice evaluation: the task loaders, the batched scorer against a
per-candidate loop, the gated scoring against the live mixture, and a jointly trained model's
scoring against token_eval of each candidate as held-out text."""

import numpy as np
import pytest
import torch
from teragram.index.engine import Index
from teragram.model.evaluation.tasks import TASKS, Gate, accuracy, candidates, gated_nll, load_task, model_outputs
from teragram.model.gpt import GPT, GPTConfig
from teragram.model.mixture.estimates import COMPONENTS
from teragram.model.mixture.gate import gate_inputs, next_distribution

from tests.model.helpers import accuracy_by_hand, completion_rows, token_eval_of

COUNTS = {  # validation examples, as published with each set
    "hellaswag": (10042, {4}),
    "arc_easy": (570, {3, 4, 5}),
    "arc_challenge": (299, {3, 4, 5}),
    "piqa": (1838, {2}),
    "winogrande": (1267, {2}),
    "sciq": (1000, {4}),
    "openbookqa": (500, {4}),
    "boolq": (3270, {2}),
    "social_iqa": (1954, {3}),
}


def test_every_task_loads_whole():
    assert set(COUNTS) == set(TASKS)
    for name, (n, sizes) in COUNTS.items():
        ex = load_task(name)
        assert len(ex) == n, name
        for e in ex:
            assert len(e.contexts) == len(e.completions) in sizes and 0 <= e.label < len(e.completions), (name, e)
            assert all(c.strip() for c in e.completions) and all(c.strip() for c in e.contexts), (name, e)
    h = load_task("hellaswag", 1)[0]
    assert h.contexts[0].startswith("Roof shingle removal: A man is sitting on a roof. He") and h.label == 3


@pytest.fixture(scope="module")
def setup(real_index):
    idx = Index(real_index)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=idx.vocab_size, block_size=64, use_index=False)).eval()
    examples = load_task("hellaswag", 4) + load_task("winogrande", 3) + load_task("boolq", 2)
    return idx, model, examples, candidates(examples, idx.tokenize)


def test_batched_scores_equal_one_candidate_at_a_time(setup):
    idx, model, examples, docs = setup
    outs = model_outputs(model, docs, idx.eos_id, batch=5)
    assert any(len(d) + 1 > 64 for d, _ in docs)  # some are cut on the left to the context
    for (d, n_ctx), o in zip(docs, outs, strict=True):
        seq = np.concatenate([[idx.eos_id], d])[-65:]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([seq[:-1]]))[0], -1)
        want = -logp[torch.arange(len(seq) - 1), torch.tensor(seq[1:])].numpy()[-(len(d) - n_ctx) :]
        assert np.allclose(o["nll"], want, atol=1e-4)
        assert len(o["nll"]) == len(d) - n_ctx >= 1
    # acc is the argmax of the summed log-probabilities, per example
    r = accuracy(examples, [o["nll"] for o in outs])
    k, hits = 0, 0
    for ex in examples:
        ll = [-outs[k + j]["nll"].sum() for j in range(len(ex.completions))]
        hits += int(np.argmax(ll)) == ex.label
        k += len(ex.completions)
    assert r["acc"] == hits / len(examples) and r["n"] == len(examples)


def test_gated_scores_equal_the_live_mixture(setup):
    idx, model, examples, docs = setup
    docs = docs[:6]
    outs = model_outputs(model, docs, idx.eos_id)
    from teragram.model.mixture.estimates import estimates

    est = estimates(idx, docs[0][0])
    X = gate_inputs(est, np.full(len(docs[0][0]) + 1, 0.5), np.zeros(len(docs[0][0]) + 1, np.int64))
    gate = Gate(np.random.default_rng(0).normal(scale=0.5, size=(X.shape[1], len(COMPONENTS))))
    bulk = gated_nll(idx, docs, outs, gate)
    for (d, n_ctx), g in zip(docs, bulk, strict=True):
        seq = np.concatenate([[idx.eos_id], d])[-65:]
        with torch.no_grad():
            p = torch.softmax(model(torch.tensor([seq[:-1]]))[0], -1).double().numpy()
        off = len(seq) - 1 - len(d)  # rows of p before the document's first target
        assert off + n_ctx >= 0  # the model saw every completion token's context row
        for j, t in enumerate(range(n_ctx, len(d))):
            q = next_distribution(idx, d[:t], p[off + t], gate)
            assert g[j] == pytest.approx(-np.log(q[d[t]]), rel=1e-6, abs=1e-9)


def test_saved_outputs_give_the_same_results(setup, tmp_path):
    """The split evaluation (model outputs saved on one machine, the index side on another)
    equals the joint one."""
    from teragram.model.evaluation.tasks import run_task

    idx, model, _, _ = setup
    gate = Gate(np.random.default_rng(1).normal(scale=0.5, size=(_n_features(idx), len(COMPONENTS))))
    joint = run_task(model, idx, "winogrande", gate=gate, limit=6, save_dir=tmp_path)
    split = run_task(None, idx, "winogrande", gate=gate, limit=6, outputs_dir=tmp_path)
    assert split == joint and joint["examples"] == 6
    with pytest.raises(Exception, match="not of this task"):
        run_task(None, idx, "winogrande", gate=gate, limit=5, outputs_dir=tmp_path)


def _n_features(idx) -> int:
    from teragram.model.mixture.estimates import estimates

    est = estimates(idx, [5, 6, 7])
    return gate_inputs(est, np.full(4, 0.5), np.zeros(4, np.int64)).shape[1]


def test_training_logs_the_tasks_on_a_fixed_subset(real_index, tmp_path):
    """evals = (...) in training: each evaluation logs every task's accuracy on its first
    evals_limit examples, equal to `teragram evals` on the saved checkpoint, and plots it;
    a model with index inputs or an unknown task is refused at start."""
    from teragram.model.checkpoint import load_model
    from teragram.model.config import ConfigError
    from teragram.model.evaluation.tasks import run_task
    from teragram.model.training.train import TrainConfig, train

    cfg = TrainConfig(
        index=str(real_index), out=str(tmp_path / "run"), preset="tiny", block_size=64, batch_size=4, max_steps=4, eval_every=2,
        evals=("hellaswag", "piqa"), evals_limit=6, progress=False, log_every=1,
    )  # fmt: skip
    result = train(cfg)
    import json

    rows = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    ev = [r for r in rows if "evals" in r]
    assert [r["step"] for r in ev] == [2, 4] and all(r["evals"][t]["n"] == 6 for r in ev for t in ("hellaswag", "piqa"))
    model, _ = load_model(tmp_path / "run")
    for t in ("hellaswag", "piqa"):
        assert result["evals"][t] == run_task(model, Index(real_index), t, limit=6, index_side=False)["model"]
    assert (tmp_path / "run" / "loss.png").exists()
    for bad, msg in [({"evals": ("nope",)}, "unknown evals task"), ({"features": str(real_index)}, "without index inputs")]:
        with pytest.raises(ConfigError, match=msg):
            train(TrainConfig(**{**cfg.__dict__, **bad}))


# ---- a jointly trained model: scored through its own mixture and alone, in one pass ----------

JOINT_COMPONENTS = ("index_infgram", "index_3gram", "cache_longest", "cache_2gram")


@pytest.fixture(scope="module")
def joint_run(joint_root):
    """A joint model trained a few steps with the LM's own loss beside the mixture's
    (joint_lm_weight = 1), and its index."""
    from teragram.model.checkpoint import load_model

    from tests.model.conftest import joint_kw, train_tiny

    kw = joint_kw(joint_root, joint_components=JOINT_COMPONENTS, joint_lm_weight=1.0)
    train_tiny(joint_root, "evals-joint", max_steps=4, heldout=None, **kw)
    return joint_root, load_model(joint_root / "evals-joint")[0], Index(joint_root / "idx")


def test_joint_scores_equal_token_eval_of_each_candidate(joint_run, tmp_path):
    """Per completion token, the scorer's joint mixture and the LM alone are token_eval's numbers
    for the candidate as one held-out document, where the model's window is the same (the
    candidate fits in the context, or is a multiple of it: read in the last window whole); the
    LM alone is the plain scorer's everywhere, cut on the left included."""
    from teragram.model.evaluation.tasks import joint_estimates

    _, model, idx = joint_run
    B = model.cfg.block_size
    examples = load_task("winogrande", 2) + load_task("arc_easy", 2)
    docs = [c for c in candidates(examples, idx.tokenize) if len(c[0]) <= B]
    long, n_ctx = candidates(load_task("boolq", 1), idx.tokenize)[0]
    assert len(long) > 2 * B + 10
    n_comp = len(long) - n_ctx
    docs += [(long[-2 * B :], 2 * B - n_comp), (long[-(B + 10) :], B + 10 - n_comp)]  # cut on the left: by 2B, and not by a multiple
    outs = model_outputs(model, docs, idx.eos_id, batch=3, est=joint_estimates(model, idx, docs))
    plain = model_outputs(model, docs, idx.eos_id, batch=3)
    checked, moved = 0, 0.0
    for k, ((d, n), o, p) in enumerate(zip(docs, outs, plain, strict=True)):
        assert len(o["nll_joint"]) == len(d) - n >= 1
        for f in ("nll", "maxp", "top"):
            assert np.array_equal(o[f], p[f]), f
        if len(d) <= B or len(d) % B == 0:
            want = completion_rows(token_eval_of(model, idx, d, tmp_path / f"doc{k}"), n, len(d))
            assert np.allclose(o["nll_joint"], want["nll"], atol=1e-5, rtol=0)
            assert np.allclose(o["nll"], want["nll_model"], atol=1e-5, rtol=0)
            checked += 1
        moved = max(moved, float(np.abs(o["nll_joint"] - o["nll"]).max()))
    assert checked == len(docs) - 1 and len(docs) >= 8
    assert moved > 0.05  # the mixture is not the LM alone


def test_joint_task_accuracies_are_those_of_token_eval(joint_run, tmp_path):
    """run_task of a joint model: the model's and the mixture's acc and acc_norm equal those
    counted from token_eval's nll of each candidate document, and the contamination columns
    are there for both."""
    from teragram.model.evaluation.tasks import run_task

    _, model, idx = joint_run
    examples = load_task("openbookqa", 5)
    docs = candidates(examples, idx.tokenize)
    assert all(len(d) <= model.cfg.block_size for d, _ in docs)
    want = [completion_rows(token_eval_of(model, idx, d, tmp_path / f"doc{k}"), n, len(d)) for k, (d, n) in enumerate(docs)]
    r = run_task(model, idx, "openbookqa", limit=5, batch=6)
    for col, field in (("model", "nll_model"), ("joint", "nll")):
        acc, acc_norm = accuracy_by_hand(examples, [w[field] for w in want])
        assert (r[col]["acc"], r[col]["acc_norm"], r[col]["n"]) == (acc, acc_norm, 5), col
    assert r["model"] != r["joint"]  # the two columns can be told apart here
    assert {"contaminated_share", "model_clean", "joint_clean"} <= set(r) and "gated" not in r
    assert run_task(model, idx, "openbookqa", limit=5, index_side=False) == {k: r[k] for k in ("task", "examples", "model")}


def test_training_a_joint_model_logs_its_mixtures_accuracy_too(joint_root):
    """evals in training of a jointly trained model: each evaluation logs the model's and its
    own mixture's accuracy, run_task's on the saved checkpoint."""
    import json

    from teragram.model.checkpoint import load_model
    from teragram.model.evaluation.tasks import run_task

    from tests.model.conftest import joint_kw, train_tiny

    kw = joint_kw(joint_root, joint_components=JOINT_COMPONENTS, joint_lm_weight=1.0)
    result = train_tiny(joint_root, "evals-joint-log", max_steps=4, eval_every=2, heldout=None, evals=("openbookqa",), evals_limit=5, **kw)
    rows = [json.loads(x) for x in (joint_root / "evals-joint-log" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "evals" in r] == [2, 4]
    model, idx = load_model(joint_root / "evals-joint-log")[0], Index(joint_root / "idx")
    r = run_task(model, idx, "openbookqa", limit=5)
    logged = result["evals"]["openbookqa"]
    assert {k: logged[k] for k in ("acc", "acc_norm", "n")} == r["model"] and logged["joint"] == r["joint"]


def test_evals_verb_scores_a_joint_checkpoint_and_refuses_what_it_cannot_do(joint_run, tmp_path, capsys):
    """`teragram evals` on a joint checkpoint gives run_task's rows (with --joint-gate: those of the
    model with that gate installed); a post-hoc gate, saved outputs, or an index of another
    tokenizer are refused in one line."""
    import copy
    import json

    from teragram.model.checkpoint import load_model
    from teragram.model.evaluation.tasks import run_task
    from teragram.model.mixture import refit
    from teragram.serve.main import main

    from tests.model.conftest import other_tokenizer_checkpoint

    root, model, idx = joint_run
    run = root / "evals-joint"
    es = ["evals", "--checkpoint", str(run), "--index", str(idx.path), "--tasks", "arc_easy,winogrande", "--limit", "3", "--quiet"]
    assert main([*es, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == [run_task(model, idx, t, limit=3) for t in ("arc_easy", "winogrande")]
    assert main(es) == 0
    table = capsys.readouterr().out
    assert "| joint acc | joint acc_norm |" in table and "joint acc_norm (clean)" in table
    # a refit gate (here: the trained one with other weights) is installed before scoring
    gate = copy.deepcopy(model.joint_gate)
    with torch.no_grad():
        gate.bias[0] = -6.0  # the estimates trusted over the model
    path = refit.save_gate(tmp_path / "gate.safetensors", model, gate)
    assert main([*es, "--json", "--joint-gate", str(path)]) == 0
    refit_rows = json.loads(capsys.readouterr().out)
    fresh = load_model(run)[0]
    refit.install_gate(fresh, gate)
    assert refit_rows == [run_task(fresh, idx, t, limit=3) for t in ("arc_easy", "winogrande")]
    assert refit_rows[0]["joint"] != rows[0]["joint"] and refit_rows[0]["model"] == rows[0]["model"]  # the gate was used
    # refusals, each in one line before any work
    Gate(np.zeros((_n_features(idx), len(COMPONENTS)))).save(tmp_path / "posthoc.json")
    bad = other_tokenizer_checkpoint(run, tmp_path)
    other = [a if a != str(run) else str(bad) for a in es]
    cases = [
        ([*es, "--gate", str(tmp_path / "posthoc.json")], "no post-hoc --gate"),
        ([*es, "--save-outputs", str(tmp_path / "out")], "no --save-outputs"),
        (other, "joint gate was trained with"),
        (["evals", "--outputs", str(tmp_path), "--index", str(idx.path), "--joint-gate", str(path)], "--joint-gate goes with"),
    ]
    for argv, msg in cases:
        assert main(argv) == 2, msg
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and msg in err, err
    assert not (tmp_path / "out").exists()
