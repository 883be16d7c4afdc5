import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from teragram.index.engine import Index

REPO = Path(__file__).resolve().parents[2]


def _teragram(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "teragram.serve.main", *args], capture_output=True, text=True, cwd=REPO, input=stdin)


def test_tokenize_and_query_json(real_index):
    idx = Index(real_index)
    r = _teragram("tokenize", str(real_index), "the kernel", "--json")
    ids = json.loads(r.stdout)["ids"]
    assert ids == idx.tokenize("the kernel")
    pieces = [idx.tokenizer.id_to_piece(i) for i in ids]
    assert "".join(pieces).replace("\u2581", " ") == "the kernel"
    r = _teragram("query", str(real_index), "count", "the kernel", "--json")
    assert json.loads(r.stdout) == {"count": idx.count(ids).count, "approx": False, "token_ids": ids, "tokens": pieces}
    r = _teragram("query", str(real_index), "infgram-prob", "--ids", ",".join(map(str, ids)), "--cont", str(ids[0]), "--json")
    want = idx.infgram_prob(ids, ids[0]).to_json() | {"cont_token": pieces[0], "token_ids": ids, "tokens": pieces}
    assert json.loads(r.stdout) == want
    r = _teragram("query", str(real_index), "ntd", "the", "--json")
    got = json.loads(r.stdout)
    assert got["prompt_cnt"] == idx.count(idx.tokenize("the")).count
    assert got["tokens"] == [idx.tokenizer.id_to_piece(i) for i in idx.tokenize("the")]
    assert {int(k): v["cont_cnt"] for k, v in got["result_by_token_id"].items()} == {
        t: c for t, (c, _) in idx.ntd(idx.tokenize("the")).result_by_token_id.items()
    }
    assert all(v["token"] == idx.piece(int(k)) for k, v in got["result_by_token_id"].items())
    r = _teragram("query", str(real_index), "longest-match", "the kernel", "--json")
    got = json.loads(r.stdout)
    assert got["cont_token"] == idx.piece(got["cont"]) and got["token_ids"] == ids
    # text output: each id beside its text
    r = _teragram("query", str(real_index), "count", "the kernel")
    assert r.stdout.splitlines()[-1] == "tokens: " + " ".join(f"{i}:{t!r}" for i, t in zip(ids, pieces))


def test_batch_in_order_with_errors(real_index, tmp_path):
    idx = Index(real_index)
    rng = np.random.default_rng(0)
    lines, expect = [], []
    for i in range(40):
        ids = [int(x) for x in rng.integers(3, 200, size=int(rng.integers(1, 4)))]
        op = ["count", "prob", "ntd", "infgram_prob", "infgram-ntd", "longest-match"][i % 6]
        lines.append(json.dumps({"op": op, "ids": ids, "cont": 7}))
        fn = {
            "count": idx.count,
            "prob": lambda q: idx.prob(q, 7),
            "ntd": idx.ntd,
            "infgram_prob": lambda q: idx.infgram_prob(q, 7),
            "infgram-ntd": idx.infgram_ntd,
            "longest-match": idx.longest_match,
        }[op]
        expect.append(json.loads(json.dumps(fn(ids).to_json())))
    lines.insert(5, "{oops")
    expect.insert(5, None)
    lines.insert(9, json.dumps({"op": "frobnicate", "ids": [1]}))
    expect.insert(9, None)
    lines.insert(12, json.dumps({"op": "count", "ids": [10**9]}))
    expect.insert(12, None)
    f = tmp_path / "q.jsonl"
    f.write_text("\n".join(lines) + "\n")
    r = _teragram("query", str(real_index), "--batch", str(f))
    got = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(got) == len(expect)
    for g, e in zip(got, expect):
        if e is None:
            assert set(g) == {"error"}
        else:
            if "result_by_token_id" in g:  # each next token also carries its text
                for t, v in g["result_by_token_id"].items():
                    assert v.pop("token") == idx.piece(int(t))
            assert {k: g[k] for k in e} == e  # infini-gram's fields, unchanged
            assert [idx.piece(i) for i in g["token_ids"]] == g["tokens"]


def test_one_line_errors(real_index, tmp_path):
    for args, msg in [
        (("query", str(real_index), "bogus", "x"), "unknown op 'bogus'"),
        (("query", str(real_index), "count", "--ids", "1,99999999"), "outside the vocabulary"),
        (("query", str(real_index), "prob", "--ids", "1,2"), "needs a continuation token"),
        (("query", str(real_index), "count", "--ids", "1,x"), "comma-separated integers"),
        (("stats", str(tmp_path)), "manifest.json: missing"),
        (("query", str(tmp_path), "count", "x"), "not a teragram index"),
    ]:
        r = _teragram(*args)
        assert r.returncode == 2, args
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("teragram: error:") and msg in lines[0], (args, r.stderr)


def test_stats(real_index):
    r = _teragram("stats", str(real_index), "--json")
    s = json.loads(r.stdout)
    assert s["counts"]["tokens"] == Index(real_index).n_tokens
    assert 2.0 < s["bytes_per_token"]["tokens+sa"] < 6.0


def test_a_public_bind_needs_an_api_key(real_index, tmp_path):
    """serve refuses a public address without a key, in one line before any work; the key may come
    from $TERAGRAM_API_KEY (then the next problem met is the missing index's, not the key's)."""
    import os

    r = _teragram("serve", "--index", str(real_index), "--host", "0.0.0.0", "--port", "0")
    assert r.returncode != 0 and "needs --api-key" in r.stderr and "Traceback" not in r.stderr
    env = os.environ | {"TERAGRAM_API_KEY": "k"}
    missing = str(tmp_path / "none")
    r = subprocess.run(
        [sys.executable, "-m", "teragram.serve.main", "serve", "--index", missing, "--host", "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0 and "needs --api-key" not in r.stderr and "none" in r.stderr
