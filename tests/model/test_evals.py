"""Downstream multiple-choice evaluation: the task loaders, the batched scorer against a
per-candidate loop, the gated scoring against the live mixture, saved outputs, and the tasks
logged in training."""

import numpy as np
import pytest
import torch
from teragram.index.engine import Index
from teragram.model.evaluation.tasks import TASKS, Gate, accuracy, candidates, gated_nll, load_task, model_outputs
from teragram.model.gpt import GPT, GPTConfig
from teragram.model.mixture.estimates import COMPONENTS
from teragram.model.mixture.gate import gate_inputs, next_distribution

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
    equals the one on one machine."""
    from teragram.model.evaluation.tasks import run_task

    idx, model, _, _ = setup
    gate = Gate(np.random.default_rng(1).normal(scale=0.5, size=(_n_features(idx), len(COMPONENTS))))
    whole = run_task(model, idx, "winogrande", gate=gate, limit=6, save_dir=tmp_path)
    split = run_task(None, idx, "winogrande", gate=gate, limit=6, outputs_dir=tmp_path)
    assert split == whole and whole["examples"] == 6
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
