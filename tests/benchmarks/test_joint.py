"""benchmarks/joint.py's replicate summary: each run of a replicated variant counted once, an
earlier result's only where this eval lacks the variant, and results of another index refused."""

import json

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
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_res("idx-2b", {"knnj3": 16.0})))
    with pytest.raises(SystemExit, match="another index"):
        joint.replicates(res, [other])
