"""The GPT with index inputs: forward/mixture math, training, resume, DDP, sampling."""

import json
import math
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from teragram.index.engine import Index
from teragram.index.features import Features
from teragram.model.checkpoint import load_model
from teragram.model.config import ConfigError
from teragram.model.generation.sample import generate
from teragram.model.gpt import GPT, GPTConfig
from teragram.model.training.train import train

from tests.conftest import torchrun
from tests.model.helpers import REPO, dup_config, rand_feats


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_mixture_is_a_distribution_and_matches_the_loss(arch):
    g = torch.Generator().manual_seed(0)
    cfg = GPTConfig.preset("tiny", vocab_size=50, block_size=16, arch=arch)
    m = GPT(cfg)
    with torch.no_grad():
        m.gate.bias.fill_(0.3)
        m.gate_len.weight.normal_()
    x = torch.randint(0, 50, (2, 16), generator=g)
    y = torch.randint(0, 50, (2, 16), generator=g)
    f = rand_feats(2, 16, 50, 4, g)
    loss, _ = m(x, y, f)
    h, _ = m.hidden(x, f)
    for b in range(2):
        for t in range(16):
            fb = f.map(lambda a, b=b, t=t: a[b : b + 1, t : t + 1])
            p = m.next_distribution(h[b : b + 1, t], fb)[0]
            assert float(p.sum()) == pytest.approx(1.0, abs=1e-5)
            assert float(-torch.log(p[y[b, t]])) == pytest.approx(float(loss[b, t].detach()), abs=1e-4)


@pytest.mark.parametrize("use_index", [False, True])
def test_head_stats_equal_the_whole_log_softmax(use_index, monkeypatch):
    """Evaluation's blockwise head (numpy reductions on a CPU, a block smaller than the rows here)
    against the (B, T, V) log-softmax: the loss, the targets' and the top token's log-probability."""
    import teragram.model.gpt as gpt

    monkeypatch.setattr(gpt, "HEAD_EVAL_ROWS", 7)
    g = torch.Generator().manual_seed(1)
    m = GPT(GPTConfig.preset("tiny", vocab_size=300, block_size=16, use_index=use_index))
    with torch.no_grad():
        m.lm_head.weight.mul_(4)  # sharper distributions than at initialization: a wrong max or normalizer shows
    x, y = torch.randint(0, 300, (3, 16), generator=g), torch.randint(0, 300, (3, 16), generator=g)
    f = rand_feats(3, 16, 300, 4, g) if use_index else None
    with torch.inference_mode():
        h, _ = m.hidden(x, f)
        nll, logp = m.head_losses(h, y, f)
        got_nll, lp_y, lp_max, top = m.head_stats(h, y, f)
    torch.testing.assert_close(got_nll, nll, rtol=0, atol=1e-4)
    torch.testing.assert_close(lp_y, logp.gather(-1, y[..., None])[..., 0], rtol=0, atol=1e-4)
    want_max, want_top = logp.max(-1)
    torch.testing.assert_close(lp_max, want_max, rtol=0, atol=1e-4)
    assert torch.equal(top, want_top)
    assert float(logp.exp().max(-1).values.min()) < 0.9  # not every row is certain: the test can tell the tokens apart


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_kv_cache_matches_full_forward(arch):
    g = torch.Generator().manual_seed(1)
    m = GPT(GPTConfig.preset("tiny", vocab_size=50, block_size=32, arch=arch)).eval()
    x = torch.randint(0, 50, (1, 20), generator=g)
    f = rand_feats(1, 20, 50, 4, g)
    full, _ = m.hidden(x, f)
    sl = lambda a, b: f.map(lambda v: v[:, a:b])  # noqa: E731
    for chunk in (1, 3):  # one token at a time (decoding), or several (verifying drafts)
        h, kv = m.hidden(x[:, :12], sl(0, 12))
        steps = [h]
        for t in range(12, 20, chunk):
            e = min(t + chunk, 20)
            h, kv = m.hidden(x[:, t:e], sl(t, e), kv, pos0=t)
            steps.append(h)
        assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5), chunk


def test_checkpoints_saved_before_the_joint_recipe_was_retired(tmp_path, capsys):
    """A plain model's checkpoint that holds the retired joint recipe's GPTConfig fields loads
    as before (the same weights, the same digest a gate was fit for); one trained with the joint
    gate is refused in one line naming the last commit that has the recipe."""
    from teragram.index.errors import TeragramError
    from teragram.model.checkpoint import JOINT_RETIRED_AT, save_checkpoint, weights_digest
    from teragram.model.training.train import TrainConfig
    from teragram.serve.main import main

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=50, block_size=16, use_index=False))
    ck = save_checkpoint(tmp_path / "run", model, {}, 1, TrainConfig())
    meta = json.loads((ck / "config.json").read_text())
    meta["model"] |= {"joint": [], "joint_top_k": 4, "joint_hidden": True, "joint_detach": False, "joint_tokenizer": ""}
    meta["model"] |= {"joint_lm_weight": 0.0, "joint_knn": []}  # as a plain model's config.json held them
    (ck / "config.json").write_text(json.dumps(meta))
    back, _ = load_model(tmp_path / "run")
    assert weights_digest(back) == weights_digest(model) and back.cfg == model.cfg
    meta["model"] |= {"joint": ["index_infgram", "cache_longest"], "joint_lm_weight": 1.0}
    (ck / "config.json").write_text(json.dumps(meta))
    with pytest.raises(TeragramError, match=f"joint gate.*retired after commit {JOINT_RETIRED_AT}"):
        load_model(tmp_path / "run")
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--index", str(tmp_path), "--corpus", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and JOINT_RETIRED_AT in err, err


def test_index_model_beats_baseline_on_duplicated_text(dup_setup):
    base = train(dup_config(dup_setup, "base", features=None, max_steps=150))
    idx = train(dup_config(dup_setup, "idxm", max_steps=150))
    logs = [json.loads(x) for x in (dup_setup / "idxm" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in logs if "loss" in r]
    assert np.mean(losses[-10:]) < np.mean(losses[:5]) - 1.0  # the loss falls
    # the index model predicts held-out near-duplicates far better than the same model without it
    assert idx["eval"]["loss"] < 0.8 * base["eval"]["loss"], (idx["eval"], base["eval"])
    assert (dup_setup / "idxm" / "loss.png").exists()


def test_resume_continues_the_same_loss_curve(dup_setup):
    full = dup_config(dup_setup, "full", max_steps=8)
    train(full)
    part = dup_config(dup_setup, "part", max_steps=4)
    train(part)
    train(replace(part, max_steps=8))
    read = lambda n: {r["step"]: r["loss"] for r in map(json.loads, (dup_setup / n / "log.jsonl").read_text().splitlines()) if "loss" in r}  # noqa: E731
    a, b = read("full"), read("part")
    assert [a[s] for s in range(5, 9)] == [b[s] for s in range(5, 9)]
    # a resume with other settings of what the run learns is refused, and the run's record kept
    saved = (dup_setup / "part" / "config.json").read_text()
    with pytest.raises(ConfigError, match=r"other settings \(seed 1337 -> 3, lr"):
        train(replace(part, max_steps=8, seed=3, lr=part.lr * 2))
    assert (dup_setup / "part" / "config.json").read_text() == saved
    assert train(replace(part, max_steps=8, resume=False, out=str(dup_setup / "part2")))["step"] == 8


def test_ddp_two_gloo_processes_match_single_process_gradients(dup_setup, tmp_path):
    script = tmp_path / "ddp_grad.py"
    script.write_text(
        f"""
import os, sys, torch, torch.distributed as dist
from teragram.model.training.data import TrainData
from teragram.model.config import ConfigError
from teragram.model.gpt import GPT, GPTConfig
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
data = TrainData({str(dup_setup / "idx")!r}, {str(dup_setup / "feats")!r}, 32)
torch.manual_seed(0)
m = GPT(GPTConfig.preset("tiny", vocab_size=data.vocab_size, block_size=32))
ddp = torch.nn.parallel.DistributedDataParallel(m)
x, y, f = data.batch(0, 4, seed=3, rank=rank)
loss, _ = ddp(x, y, f)
loss.mean().backward()
if rank == 0:
    torch.save({{n: p.grad for n, p in m.named_parameters()}}, {str(tmp_path / "ddp.pt")!r})
del ddp, loss  # the reducer and its hooks go before the group
dist.barrier()  # leave together: a rank that tears gloo down while its peer still talks aborts
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # the gradients are saved; gloo's threads at interpreter exit once aborted a rank (SIGABRT, 1 run in many)
"""
    )
    torchrun(script)
    from teragram.model.training.data import TrainData

    data = TrainData(dup_setup / "idx", dup_setup / "feats", 32)
    torch.manual_seed(0)
    m = GPT(GPTConfig.preset("tiny", vocab_size=data.vocab_size, block_size=32))
    parts = [data.batch(0, 4, seed=3, rank=k) for k in range(2)]
    x = torch.cat([p[0] for p in parts])
    y = torch.cat([p[1] for p in parts])
    f = Features.combine([p[2] for p in parts], torch.cat)
    loss, _ = m(x, y, f)
    loss.mean().backward()
    ddp = torch.load(tmp_path / "ddp.pt")
    for n, p in m.named_parameters():
        assert torch.allclose(p.grad, ddp[n], atol=1e-6, rtol=1e-4), n


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_generation_features_equal_bulk_score(dup_setup, arch):
    train(dup_config(dup_setup, "gen-" + arch, max_steps=20, arch=arch))
    model, _ = load_model(dup_setup / ("gen-" + arch))
    idx = Index(dup_setup / "idx")
    prompt = idx.tokenize("The kernel")
    g = generate(model, idx, prompt, max_new_tokens=40, temperature=1.0, top_p=0.9, seed=1)
    assert len(g.ids) > len(prompt)
    r = idx.score(g.ids, top_k=model.cfg.top_k, max_len=model.cfg.max_match)
    for t, row in enumerate(g.features):
        assert (row.length[0], row.cont[0], row.count[0]) == (r.length[t], r.cont[t], r.count[t]), t
        assert np.array_equal(row.topk_ids[0], r.topk_ids[t]) and np.array_equal(row.topk_cnt[0], r.topk_cnt[t])
    # the same seed gives the same text; greedy decoding is deterministic
    assert generate(model, idx, prompt, max_new_tokens=40, temperature=1.0, top_p=0.9, seed=1).ids == g.ids


def test_cli_train_eval_sample(dup_setup, tmp_path):
    cfgf = tmp_path / "t.toml"
    cfgf.write_text(
        f'index = "{dup_setup / "idx"}"\nfeatures = "{dup_setup / "feats"}"\npreset = "tiny"\nblock_size = 32\nmax_steps = 5\nbatch_size = 4\nprogress = false\n'
    )
    run = lambda *a: subprocess.run([sys.executable, "-m", "teragram.serve.main", *a], cwd=REPO, capture_output=True, text=True)  # noqa: E731
    r = run("train", "--config", str(cfgf), f"--out={tmp_path / 'run'}", "--lr=0.002")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["lr"] == 0.002
    common = [
        "--checkpoint",
        str(tmp_path / "run"),
        "--index",
        str(dup_setup / "idx"),
        "--corpus",
        str(dup_setup / "held"),
        "--json",
        "--quiet",
    ]
    r = run("eval", *common)
    assert r.returncode == 0, r.stderr
    ev = json.loads(r.stdout)
    assert ev["perplexity"] == pytest.approx(math.exp(ev["loss"])) and ev["bits_per_byte"] > 0
    r = run("sample", "--checkpoint", str(tmp_path / "run"), "--index", str(dup_setup / "idx"), "The", "--max-tokens", "5")
    assert r.returncode == 0 and r.stdout.startswith("The")
    # the index gate: fit on one text, applied on it, used in generation
    r = run("eval", *common, "--fit-gate", str(tmp_path / "gate.json"))
    assert r.returncode == 0, r.stderr
    fit = json.loads(r.stdout)
    assert fit["loss"] < fit["model"]["loss"] and fit["model"]["loss"] == pytest.approx(ev["loss"], rel=1e-5)
    r = run("eval", *common, "--gate", str(tmp_path / "gate.json"))
    assert r.returncode == 0 and json.loads(r.stdout)["loss"] == pytest.approx(fit["loss"], rel=1e-9)
    # split evaluation: the model's outputs saved once, mixed with the index later, the same figures
    r = run("eval", *common, "--save-outputs", str(tmp_path / "outputs"))
    assert r.returncode == 0 and json.loads(r.stdout)["loss"] == pytest.approx(ev["loss"], rel=1e-9), r.stderr
    split = ["--outputs", str(tmp_path / "outputs"), "--index", str(dup_setup / "idx"), "--json", "--quiet"]
    r = run("eval", *split, "--gate", str(tmp_path / "gate.json"))
    assert r.returncode == 0 and json.loads(r.stdout)["loss"] == pytest.approx(fit["loss"], rel=1e-9), r.stderr
    r = run("eval", *split, "--baseline", "knn", "--fit-lambdas", str(tmp_path / "l.json"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "hidden states" in r.stderr
    r = run(
        "sample",
        "--checkpoint",
        str(tmp_path / "run"),
        "--index",
        str(dup_setup / "idx"),
        "The",
        "--max-tokens",
        "5",
        "--gate",
        str(tmp_path / "gate.json"),
    )
    assert r.returncode == 0 and r.stdout.startswith("The"), r.stderr
    r = run("train", "--config", str(cfgf), "--nonsense=1")
    assert r.returncode == 2 and "unknown config key(s): nonsense" in r.stderr


def test_index_gate_helps_and_its_live_mixture_equals_bulk(dup_setup):
    from teragram.model.evaluation.perplexity import gated_eval
    from teragram.model.mixture import estimates
    from teragram.model.mixture import gate as gate_mod

    train(dup_config(dup_setup, "gbase", features=None, max_steps=60))
    model, _ = load_model(dup_setup / "gbase")
    gate, nll_model, nll_gated = gated_eval(
        model, dup_setup / "idx", dup_setup / "held", cont_cache=False
    )  # (t): live below without states
    assert nll_gated.mean() < 0.7 * nll_model.mean()  # held-out near-duplicates: the index's estimates help
    # generation's distribution gives each actual next token the bulk mixture's probability
    idx = Index(dup_setup / "idx")
    doc = np.asarray(idx.tokenize((dup_setup / "held").parent.joinpath("train", "003.txt").read_text()[:400]))[:40].tolist()
    doc += doc[5:25]  # the document repeats itself: the cache's estimates take part
    targets = [*doc, idx.eos_id]
    with torch.no_grad():
        p_model = torch.softmax(model(torch.tensor([[idx.eos_id, *doc]]))[0].double(), -1).numpy()
    nll_m = -np.log(p_model[np.arange(len(targets)), targets])
    est = estimates.estimates(idx, doc)
    bulk = gate_mod.mix_nll_multi(gate_mod.component_logp(est, nll_m), gate(gate_mod.gate_inputs(est, p_model.max(-1), p_model.argmax(-1))))
    assert est["count_cache_longest"][45:].min() > 0 and est["cache_length"][-1] >= 16
    sc = idx.scorer()  # generation's incremental estimates give the same distributions
    sc.append(idx.eos_id)
    for t in range(len(targets)):
        p = gate_mod.next_distribution(idx, doc[:t], p_model[t], gate)
        assert p.sum() == pytest.approx(1.0, abs=1e-9), t
        assert -np.log(p[targets[t]]) == pytest.approx(bulk[t], rel=1e-6, abs=1e-9), t
        live = gate_mod.next_distribution(idx, doc[:t], p_model[t], gate, index_estimates=sc.estimates(gate_mod.index_lengths(gate)))
        assert np.array_equal(live, p), t
        if t < len(doc):
            sc.append(doc[t])


def test_heldout_estimates_follow_the_index_asked_for(dup_setup, real_index):
    """Estimates for the same held-out text against two indexes, in one process: each equals a
    fresh computation against its own index (no stale index kept between calls)."""
    from teragram.index import format as fmt
    from teragram.model.mixture import estimates

    d = dup_setup / "held" / "000000"
    tok = np.asarray(fmt.open_array(d / "tokens.bin", "tokens")).astype(np.int64)
    st = np.asarray(fmt.open_array(d / "docs.bin", "docs")).astype(np.int64)
    docs = [tok[st[k] : st[k + 1] - 1] for k in range(len(st) - 1)]
    got = {}
    for root in (dup_setup / "idx", real_index, dup_setup / "idx"):
        est = estimates.heldout_estimates(root, dup_setup / "held")
        want = [estimates.estimates(Index(root), x) for x in docs]
        for key in (
            "p_index_infgram",
            "count_index_infgram",
            "p_index_5gram",
            "share_index_17gram",
            "p_cache_longest",
            "count_cache_5gram",
        ):
            np.testing.assert_array_equal(est[key], np.concatenate([w[key] for w in want]), err_msg=f"{root} {key}")
        got[str(root)] = est["count_index_infgram"]
    assert not np.array_equal(got[str(dup_setup / "idx")], got[str(real_index)])


def test_split_evaluation_equals_the_whole(dup_setup, tmp_path):
    """The model's saved per-token outputs, mixed with the index later, give exactly the gated
    evaluation in one go; outputs are refused with an index of another tokenizer or when their
    targets are not their documents' tokens."""
    import shutil

    from teragram.index.errors import IndexFormatError, TokenizerMismatch
    from teragram.model.evaluation.outputs import gated_outputs, load_outputs, outputs_estimates, save_outputs
    from teragram.model.evaluation.perplexity import doc_bytes, gated_eval, token_eval
    from teragram.model.training.data import EvalData

    train(dup_config(dup_setup, "gbase", features=None, max_steps=60))  # trained once per module; a rerun returns at once
    model, meta = load_model(dup_setup / "gbase")
    held, root = dup_setup / "held", dup_setup / "idx"
    idx = Index(root)
    gate, nll_model, nll_whole = gated_eval(model, root, held, cont_cache=False)  # outputs saved below hold no cache

    r = token_eval(model, held, idx.eos_id, idx.sep)
    ev = EvalData(held, model.cfg.block_size, idx.eos_id, idx.sep)
    save_outputs(tmp_path / "out", r, held, checkpoint="gbase", step=meta["step"], docs_bytes=doc_bytes(ev, idx.decode).tolist())
    out = load_outputs(tmp_path / "out")
    np.testing.assert_array_equal(out.nll, nll_model)
    est = outputs_estimates(out, root)
    fitted, nll_split = gated_outputs(out, est)
    np.testing.assert_array_equal(fitted.W, gate.W)
    np.testing.assert_array_equal(nll_split, nll_whole)
    np.testing.assert_array_equal(gated_outputs(out, est, gate)[1], nll_whole)

    other = tmp_path / "other-index"
    other.mkdir()
    (other / "tokenizer.model").write_bytes((root / "tokenizer.model").read_bytes() + b"\0")
    with pytest.raises(TokenizerMismatch, match="another tokenizer"):
        outputs_estimates(out, other)
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "out", bad)
    from teragram.index import format as fmt

    t = np.asarray(fmt.open_array(bad / "000000" / "out.target.bin", "out.target")).copy()
    t[3] = (t[3] + 1) % idx.vocab_size
    fmt.write_array(bad / "000000" / "out.target.bin", "out.target", t)
    with pytest.raises(IndexFormatError, match="not the documents' tokens"):
        load_outputs(bad)
