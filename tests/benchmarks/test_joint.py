"""benchmarks/joint.py's replicate summary: each run of a replicated variant counted once, an
earlier result's only where this eval lacks the variant, and results of another index refused;
its bookkeeping of which runs and files are done or complete."""

import json
import math

import numpy as np
import pytest

from benchmarks import joint


def _res(index: str, rows: dict) -> dict:
    return {
        "index": index,
        "index_tokens": 100,
        "posthoc_results": "benchmarks/results/joint_posthoc_refit.json",
        "sets": {
            "indist": {"joint": {v: {"test_decontaminated": x} for v, x in rows.items()}, "posthoc": {"ppl_decontaminated": {"t": 20.0}}}
        },
    }


def test_replicates_mean_and_spread(tmp_path):
    prior = tmp_path / "earlier.json"
    prior.write_text(json.dumps(_res("idx", {"knnj3": 16.0, "knnj3r": 15.0, "lm1": 19.0})))
    res = _res("idx", {"knnj3s8": 17.0, "knnj3s8r": 16.0, "knnj3s9": 18.0})
    out = joint.replicates(res, [prior])
    assert out["knnj3"]["indist"]["runs"] == {"knnj3 (earlier)": 16.0, "knnj3s8": 17.0, "knnj3s9": 18.0}
    assert out["knnj3"]["indist"]["mean"] == pytest.approx(17.0)
    assert out["knnj3"]["indist"]["sd"] == pytest.approx(1.0)
    assert out["knnj3"]["indist"]["vs_t"] == pytest.approx(17.0 / 20.0)
    assert out["knnj3r"]["indist"]["runs"] == {"knnj3r (earlier)": 15.0, "knnj3s8r": 16.0}  # knnj3s9r absent: two runs
    here = joint.replicates(_res("idx", {"knnj3": 16.5, "knnj3s8": 17.0}), [prior])  # this eval's knnj3, not the earlier one's
    assert here["knnj3"]["indist"]["runs"] == {"knnj3 (this eval)": 16.5, "knnj3s8": 17.0}
    assert joint.replicates(_res("idx", {"knnj3": 16.5}), []) == {}  # one run: no spread
    both = joint.replicates(_res("idx", {"knnj3": 16.5, "knnj3s8": 17.0, "knnj3d": 15.0, "knnj3ds8": 15.5}), [])
    assert both["knnj3"]["indist"]["runs"] == {"knnj3 (this eval)": 16.5, "knnj3s8": 17.0}  # each base its own replicates
    assert both["knnj3d"]["indist"]["runs"] == {"knnj3d (this eval)": 15.0, "knnj3ds8": 15.5}
    assert joint.NAMES["knnj3ds8"].startswith("(j+lm+knn3+sg:s8) j+lm+knn3+sg again")
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_res("idx-2b", {"knnj3": 16.0})))
    with pytest.raises(SystemExit, match="another index"):
        joint.replicates(res, [other])


def test_rate_of_a_log_with_a_resumed_run():
    """The rate over the log's last run only: a resumed run appends rows whose step and clock
    start again (cumulative tokens/s over elapsed seconds, as model/training/train.py logs them)."""

    def rows(first: int, last: int, rate: float, start_s: float) -> list[dict]:
        out = []
        for step in range(first, last + 1, 25):
            el = start_s + (step - first) * 1000 / rate
            out.append({"step": step, "elapsed_s": el, "tokens_per_s": (step - first) * 1000 / el})
        return out

    log = rows(1, 1500, 100.0, 30.0) + [{"step": 1500, "loss": 4.2}] + rows(125, 1500, 200.0, 10.0)
    assert joint._rate(log) == pytest.approx(200.0)
    assert joint._rate(rows(1, 1500, 100.0, 30.0)) == pytest.approx(100.0)
    assert math.isnan(joint._rate(rows(1, 60, 100.0, 30.0)))  # too short to have a step after the first 100


def test_a_call_given_again_skips_what_an_earlier_call_finished(tmp_path):
    """The train stage resumes: a step counts as done only once its entry in OUT/joint_gpu.json
    is complete and its files exist (a variant trained but not evaluated, or evaluated without
    the refit now asked for, is not)."""
    work, out = tmp_path / "w", tmp_path / "o"
    out.mkdir()
    info = {"a": {"outputs_s": 1.0}, "knnest": {"search_only": True}, "knnj3": {"train_s": 1.0}, "knnj3s8": {"train_s": 1.0, "eval_s": 2.0}}
    assert not joint._done(info, "a", work, out, True)  # no outputs yet
    for n in joint.SETS:
        for h in joint.HALVES:
            (out / f"outputs-{n}-{h}.tgz").write_bytes(b"")
            (out / f"knnj3s8-{n}-{h}.npz").write_bytes(b"")
    assert joint._done(info, "a", work, out, True)
    assert not joint._done(info, "knnest", work, out, True)  # only searched, beside prep: the merge is still to do
    (work / joint.DENSE_ESTIMATES).mkdir(parents=True)
    (work / joint.DENSE_ESTIMATES / "manifest.json").write_text("{}")
    assert joint._done({"knnest": {"train_search_s": 3.0}}, "knnest", work, out, True)
    assert not joint._done(info, "knnj3", work, out, False)  # trained, not evaluated
    assert joint._done(info, "knnj3s8", work, out, False)
    assert not joint._done(info, "knnj3s8", work, out, True)  # evaluated without the refit
    (out / "knnj3s8-prose-test.npz").unlink()
    assert not joint._done(info | {"knnj3s8": info["knnj3s8"] | {"refit": {}}}, "knnj3s8", work, out, True)


def test_own_store_variants_resume_and_read_their_base(tmp_path):
    """--own-store: only the variants reading the dense components get an own-store variant (Vo,
    refit Vor, Vorh); a variant counts as done only once its own-store part is recorded and its
    files exist; a refit of it reads its LM's nll and targets from Vo's file; it needs --refit."""
    assert "knnj3o" in joint.NAMES and "knnj3s8or" in joint.NAMES and "knnj3orh" in joint.NAMES
    assert "lm1o" not in joint.NAMES and "joint" + "o" not in joint.NAMES
    assert joint.NAMES["knnj3or"].startswith("(j+lm+knn3/o/r) ")
    work, out = tmp_path / "w", tmp_path / "o"
    out.mkdir()
    for v in ("knnj3", "lm1"):
        for n in joint.SETS:
            for h in joint.HALVES:
                (out / f"{v}-{n}-{h}.npz").write_bytes(b"")
    info = {"knnj3": {"train_s": 1.0, "eval_s": 2.0, "refit": {}}, "lm1": {"train_s": 1.0, "eval_s": 2.0, "refit": {}}}
    assert joint._done(info, "knnj3", work, out, True) and joint._done(info, "lm1", work, out, True, True)
    assert not joint._done(info, "knnj3", work, out, True, True)  # its own store still to score
    info["knnj3"]["own"] = {}
    assert not joint._done(info, "knnj3", work, out, True, True)  # recorded, but no Vo files
    for n in joint.SETS:
        for h in joint.HALVES:
            np.savez(out / f"knnj3o-{n}-{h}.npz", nll=np.ones(3, np.float32), nll_model=np.full(3, 2.0, np.float32), target=np.arange(3))
    assert joint._done(info, "knnj3", work, out, True, True)
    np.savez(out / "knnj3or-indist-test.npz", nll=np.zeros(3, np.float32))
    z = joint.load_nll({"knnj3or": out}, "knnj3or", "indist", "test")
    assert (z["nll_model"] == 2.0).all() and (z["target"] == np.arange(3)).all() and (z["nll"] == 0).all()
    with pytest.raises(SystemExit, match="--refit"):
        joint.main(["gpu", "--carry", "c", "--work", str(work), "--out", str(out), "--own-store"])


def test_eval_leaves_out_a_set_whose_files_did_not_all_come_back(tmp_path):
    """A device run cut short: a variant is scored on the sets with both halves' files, and only those."""
    for n in joint.SETS:
        for h in joint.HALVES:
            (tmp_path / f"knnj3-{n}-{h}.npz").write_bytes(b"")
    (tmp_path / "knnj3o-indist-valid.npz").write_bytes(b"")
    (tmp_path / "knnj3o-indist-test.npz").write_bytes(b"")
    (tmp_path / "knnj3o-prose-test.npz").write_bytes(b"")  # its validation half missing
    whole = joint._complete({"knnj3": tmp_path, "knnj3o": tmp_path}, ["knnj3", "knnj3o"])
    assert whole == {"indist": ["knnj3", "knnj3o"], "timeshift": ["knnj3"], "prose": ["knnj3"]}
