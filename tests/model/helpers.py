"""What several test modules of tests/model share: the tiny training settings and the runs on
conftest's dup_setup and data_root, random index features, the oracles of the evaluation tests,
and the check that the joint gate's live mixture is the bulk one."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from teragram.index.features import Features
from teragram.model.mixture import joint
from teragram.model.training.train import TrainConfig

REPO = Path(__file__).resolve().parents[2]
TINY = dict(preset="tiny", block_size=64, batch_size=8, log_every=1, progress=False, warmup=5, lr=3e-3, min_lr=3e-4)
SMALL = TINY | {"block_size": 32, "batch_size": 4}


def rand_feats(B, T, V, k, g) -> Features:
    """Random index features (B, T) over a vocabulary of V with top-k lists of k."""
    length = torch.randint(0, 10, (B, T), generator=g)
    cont = torch.randint(-1, V, (B, T), generator=g)
    ids = torch.randint(-1, V, (B, T, k), generator=g)
    cnt = torch.randint(0, 50, (B, T, k), generator=g) * (ids >= 0)
    count = cnt.sum(-1) + torch.randint(0, 5, (B, T), generator=g)
    return Features(length, cont, count, ids, cnt)


def dup_config(root, name, **kw) -> TrainConfig:
    """A tiny training run on dup_setup's index, features and held-out features (kw: overrides)."""
    base = TINY | {"index": str(root / "idx"), "features": str(root / "feats"), "heldout": str(root / "held"), "out": str(root / name)}
    return TrainConfig(**(base | kw))


def small_config(root, name, **kw) -> TrainConfig:
    """A small resumable training run on data_root's index and features (kw: overrides)."""
    base = SMALL | {"index": str(root / "idx"), "features": str(root / "feats"), "out": str(root / name), "resume": True}
    return TrainConfig(**(base | kw))


def logged_losses(root, name) -> dict[int, float]:
    """step -> training loss, from run `name`'s log."""
    rows = map(json.loads, (root / name / "log.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def token_eval_of(model, idx, ids: np.ndarray, out, **kw) -> dict:
    """The oracle: token_eval of one document (ids) as held-out text, its held-out features
    written from the ids themselves (kw: token_eval's, e.g. knn)."""
    from teragram.index import features as ff
    from teragram.index import format as fmt
    from teragram.index.heldout import write_held_out
    from teragram.model.evaluation.perplexity import token_eval

    cfg = ff.FeatureConfig("held-out", 64, 1)
    ident = ff.begin(idx.path, out, cfg, [])
    write_held_out(idx, out, cfg, [ids], [{}])
    ff.finish(out, ident, [fmt.read_json(out / "000000.done")], len(ids) + 1, {})
    return token_eval(model, out, idx.eos_id, idx.sep, index=idx, **kw)


def completion_rows(r: dict, n_ctx: int, n: int) -> dict:
    """token_eval's rows of the completion's targets (ids[n_ctx:n]), in order."""
    rows = np.nonzero((r["pos"] >= n_ctx) & (r["pos"] < n))[0]
    return {k: r[k][rows[np.argsort(r["pos"][rows])]] for k in ("nll", "nll_model")}


def accuracy_by_hand(examples, nll) -> tuple[float, float]:
    """acc and acc_norm counted by hand from per-candidate completion nll."""
    k, hit, hit_norm = 0, 0, 0
    for ex in examples:
        ll = [-float(nll[k + j].sum()) for j in range(len(ex.completions))]
        norm = [x / len(c) for x, c in zip(ll, ex.completions, strict=True)]
        hit += int(np.argmax(ll)) == ex.label
        hit_norm += int(np.argmax(norm)) == ex.label
        k += len(ex.completions)
    return hit / len(examples), hit_norm / len(examples)


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
