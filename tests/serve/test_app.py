"""The HTTP server: a real uvicorn process on a free loopback port, plus TestClient for the
fine-grained bad-input cases."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from teragram.builder.features import compute_features
from teragram.index.engine import Index
from teragram.index.features import FeatureConfig
from teragram.model.training.train import TrainConfig, train
from teragram.serve.app import ServeConfig, create_app

from tests.conftest import real_texts

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(real_index, tmp_path_factory):
    d = tmp_path_factory.mktemp("srv")
    compute_features(real_index, d / "feats", FeatureConfig("exclude-doc", 64, 4), progress=False)
    train(
        TrainConfig(
            index=str(real_index),
            features=str(d / "feats"),
            out=str(d / "run"),
            preset="tiny",
            block_size=64,
            batch_size=4,
            max_steps=10,
            progress=False,
        )
    )
    return d / "run"


@pytest.fixture(scope="module")
def client(real_index, checkpoint):
    return TestClient(create_app(ServeConfig(index=str(real_index), checkpoint=str(checkpoint), max_tokens=64)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(real_index, checkpoint):
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "teragram.serve.main",
            "serve",
            "--index",
            str(real_index),
            "--checkpoint",
            str(checkpoint),
            "--port",
            str(port),
            "--api-key",
            "s3cret",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", headers={"Authorization": "Bearer s3cret"}).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError(proc.stderr.read().decode())
    yield url
    proc.terminate()
    proc.wait(10)


H = {"Authorization": "Bearer s3cret"}


def test_real_server_every_endpoint(server, real_index):
    idx = Index(real_index)
    ids = idx.tokenize(" of the")
    assert idx.count(ids).count >= 2
    assert httpx.get(server + "/health", headers=H).json()["status"] == "ok"
    r = httpx.post(server + "/", json={"index": "whatever", "query_type": "count", "query": " of the"}, headers=H).json()
    assert r["count"] == idx.count(ids).count and r["token_ids"] == ids and "latency" in r
    r = httpx.post(server + "/", json={"query_type": "infgram_prob", "query_ids": ids}, headers=H).json()
    assert {k: r[k] for k in ("prompt_cnt", "cont_cnt", "prob", "suffix_len")} == idx.infgram_prob(ids[:-1], ids[-1]).to_json()
    r = httpx.post(server + "/", json={"query_type": "ntd", "query": "the"}, headers=H).json()
    assert {int(k): v["cont_cnt"] for k, v in r["result_by_token_id"].items()} == {
        t: c for t, (c, _) in idx.ntd(idx.tokenize("the")).result_by_token_id.items()
    }
    r = httpx.post(server + "/", json={"query_type": "search_docs", "query": " of the", "maxnum": 2}, headers=H).json()
    assert r["cnt"] == idx.count(ids).count and len(r["documents"]) == 2
    r = httpx.post(server + "/v1/completions", json={"prompt": "The kernel", "max_tokens": 8, "temperature": 0}, headers=H).json()
    assert r["object"] == "text_completion" and r["usage"]["completion_tokens"] <= 8 and "long_match_tokens" in r["index_matches"]
    r = httpx.post(server + "/v1/score", json={"text": "The kernel is"}, headers=H).json()
    n = len(idx.tokenize("The kernel is"))
    assert len(r["logprobs_with_index"]) == len(r["logprobs_without_index"]) == len(r["features"]) == n
    assert all(x <= 0 for x in r["logprobs_with_index"])
    s = httpx.get(server + "/stats", headers=H).json()
    assert s["index"]["tokens"] == idx.n_tokens and s["endpoints"]["/"]["requests"] >= 4 and s["model"]["params"] > 0
    assert s["endpoints"]["/ (count)"]["requests"] == 1 and s["endpoints"]["/ (search_docs)"]["requests"] == 1


def test_streaming(server):
    with httpx.stream(
        "POST", server + "/v1/completions", json={"prompt": "The", "max_tokens": 6, "stream": True, "seed": 3}, headers=H
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    full = httpx.post(server + "/v1/completions", json={"prompt": "The", "max_tokens": 6, "seed": 3}, headers=H).json()
    assert streamed == full["choices"][0]["text"]


def test_drafts_and_provenance(server, real_index):
    """Greedy completions with drafts equal those without; streamed provenance per token names
    indexed text that really ends with the token; /stats counts the drafts."""
    idx = Index(real_index)
    text = real_texts(1)[0][1]
    prompt = text[:80]
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
    plain = httpx.post(server + "/v1/completions", json=body, headers=H).json()
    fast = httpx.post(server + "/v1/completions", json=body | {"draft": 6}, headers=H).json()
    assert fast["choices"][0]["text"] == plain["choices"][0]["text"]
    with httpx.stream("POST", server + "/v1/completions", json=body | {"draft": 6, "provenance": True, "stream": True}, headers=H) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    prov = [c["provenance"] for c in chunks if "provenance" in c]
    assert len(prov) == plain["usage"]["completion_tokens"]
    ids = idx.tokenize(prompt) + [p["token"] for p in prov]
    for j, p in enumerate(prov):
        if p["document"] is None:
            continue
        d = p["document"]
        m = idx.meta.doc(d["doc_id"])
        s = next(s for s in idx.shards if s.id == m["shard"])
        a = int(m["start"]) + d["offset"]
        end = len(ids) - len(prov) + j + 1
        assert d["length"] >= 8 and list(np.asarray(s.tok[a : a + d["length"]])) == ids[end - d["length"] : end]
    st = httpx.get(server + "/stats", headers=H).json()["drafts"]
    assert st["forward_passes"] > 0 and st["tokens"] >= st["forward_passes"]


def test_auth(server):
    assert httpx.get(server + "/health").status_code == 401
    r = httpx.post(server + "/", json={"query_type": "count", "query": "x"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "API key" in r.json()["error"]


@pytest.mark.parametrize(
    "path,body,status,msg",
    [
        ("/", b"{not json", 400, "malformed JSON"),
        ("/", {"query_type": "frobnicate", "query": "x"}, 400, "unknown query_type"),
        ("/", {"query_type": "count", "query_ids": [1, 10**9]}, 400, "outside the vocabulary"),
        ("/", {"query_type": "count"}, 400, "exactly one of"),
        ("/", {"query_type": "count", "query_ids": ["a"]}, 400, "query_ids"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "over the cap"),
        ("/v1/completions", {"prompt": "word " * 200, "max_tokens": 1}, 400, "does not fit the context"),
        ("/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus"),
        ("/v1/completions", {"prompt": "x", "draft": -1}, 400, "draft"),
        ("/v1/completions", {"prompt": "x", "draft": 100000}, 400, "draft"),
        ("/v1/score", {"ids": []}, 400, "nothing to score"),
        ("/", {"query_type": "count", "query": "x " * 5000}, 400, "over the cap"),
    ],
)
def test_bad_input_is_a_4xx_with_one_line(client, path, body, status, msg):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = client.post(path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert msg in err and "\n" not in err


def test_wrong_content_type_and_size(client):
    r = client.post("/", content=b"query_type=count", headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415
    r = client.post("/", content=b"{" + b" " * (2 << 20) + b"}", headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_index_only_server_has_no_model(real_index):
    c = TestClient(create_app(ServeConfig(index=str(real_index))))
    assert c.post("/", json={"query_type": "count", "query": "kernel"}).status_code == 200
    r = c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 404 and "no model" in r.json()["error"]


def test_concurrent_index_queries(client, real_index):
    from concurrent.futures import ThreadPoolExecutor

    idx = Index(real_index)
    rng = np.random.default_rng(0)
    qs = [[int(x) for x in rng.integers(3, 300, size=2)] for _ in range(64)]
    with ThreadPoolExecutor(16) as ex:
        res = list(ex.map(lambda q: client.post("/", json={"query_type": "count", "query_ids": q}).json()["count"], qs))
    assert res == [idx.count(q).count for q in qs]


def test_searches_are_answered_while_the_model_is_busy(real_index, checkpoint):
    """More requests waiting for the model than the server has worker threads (anyio's 40),
    streamed and not: a count still comes back at once (its lane has threads of its own; it
    timed out before lanes), and every waiting request completes once the model is free."""
    from concurrent.futures import ThreadPoolExecutor

    app = create_app(
        ServeConfig(index=str(real_index), checkpoint=str(checkpoint), max_tokens=64, max_streams_per_client=12)
    )  # its 12 streams come from one client
    idx, lock = app.state.served.idx, app.state.served.model_lock
    gen = {"prompt": "The", "max_tokens": 4, "seed": 1}
    with TestClient(app) as c, ThreadPoolExecutor(64) as ex:  # one event loop, as under uvicorn
        with lock:  # the model busy
            waiting = [ex.submit(c.post, "/v1/score", json={"text": "The kernel is"}) for _ in range(24)]
            waiting += [ex.submit(c.post, "/v1/completions", json=gen | {"stream": i % 2 == 0}) for i in range(24)]
            time.sleep(1.0)
            count = ex.submit(c.post, "/", json={"query_type": "count", "query": "kernel"})
            assert count.result(timeout=20).json()["count"] == idx.count(idx.tokenize("kernel")).count
            assert not any(w.done() for w in waiting)
        assert all(w.result(timeout=120).status_code == 200 for w in waiting)


def test_gate_in_score_equals_bulk_gated_eval_and_completions_run(real_index, checkpoint, tmp_path):
    from teragram.model.checkpoint import load_model
    from teragram.model.evaluation.perplexity import gated_eval
    from teragram.model.mixture.estimates import COMPONENTS
    from teragram.model.mixture.gate import Gate, gate_features

    text = "The kernel is the core of the operating system"
    X = gate_features(np.zeros(1), np.ones(1), *[[np.ones(1)] * len(COMPONENTS)] * 3, np.zeros(1))
    W = np.random.default_rng(0).normal(0, 0.5, (X.shape[1], len(COMPONENTS)))
    Gate(W).save(tmp_path / "gate.json")
    c = TestClient(create_app(ServeConfig(index=str(real_index), checkpoint=str(checkpoint), gate=str(tmp_path / "gate.json"))))
    r = c.post("/v1/score", json={"text": text})
    assert r.status_code == 200, r.text
    got = np.array(r.json()["logprobs_with_gate"])
    # oracle: the bulk path (held-out features, token_eval, estimates) on the same text as a document
    (tmp_path / "doc").mkdir()
    (tmp_path / "doc" / "a.txt").write_text(text)
    compute_features(real_index, tmp_path / "held", FeatureConfig("held-out", 64, 4), corpus=[str(tmp_path / "doc")], progress=False)
    model, _ = load_model(checkpoint)
    _, _, nll = gated_eval(model, real_index, tmp_path / "held", gate=Gate.load(tmp_path / "gate.json"))
    assert len(got) == len(nll) - 1  # the bulk path also predicts the final EOS
    np.testing.assert_allclose(got, -nll[:-1], rtol=1e-4, atol=1e-4)
    r = c.post("/v1/completions", json={"prompt": "The kernel", "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    with pytest.raises(Exception, match="needs --checkpoint"):
        create_app(ServeConfig(index=str(real_index), gate=str(tmp_path / "gate.json")))


WARMED = """
import json, sys
import numba
from fastapi.testclient import TestClient
from teragram.serve.app import ServeConfig, create_app

def loaded():
    return {f"{m}.{n}": len(f.signatures) for m, mod in list(sys.modules.items()) if m.startswith("teragram.")
            for n, f in vars(mod).items() if isinstance(f, numba.core.registry.CPUDispatcher)}

c = TestClient(create_app(ServeConfig(index=sys.argv[1], checkpoint=sys.argv[2], max_tokens=64)))
before, stats = loaded(), c.get("/stats").json()
for qt in ("count", "prob", "ntd", "infgram_prob", "infgram_ntd", "search_docs"):
    assert c.post("/", json={"query_type": qt, "query": "The kernel is a"}).status_code == 200
assert c.post("/v1/score", json={"text": "The kernel is a program"}).status_code == 200
for body in ({"prompt": "The kernel", "max_tokens": 8}, {"prompt": "The kernel", "max_tokens": 8, "temperature": 0.8, "top_p": 0.95, "draft": 4, "provenance": True}):
    assert c.post("/v1/completions", json=body).status_code == 200
after = loaded()
print(json.dumps({"new": sorted(k for k in after if after[k] > before.get(k, 0)), "warmed": sum(v > 0 for v in before.values()), "stats": stats}))
"""


def test_the_server_is_warm_before_it_answers(real_index, checkpoint):
    """create_app answers one request of each kind before it returns (serve.app.warm): in a fresh
    server process, no compiled kernel is loaded by the first real requests of any kind (the
    model's process warms itself the same way, warm_model), and the warm-up's requests are not
    in /stats."""
    r = subprocess.run([sys.executable, "-c", WARMED, str(real_index), str(checkpoint)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["new"] == [] and out["warmed"] >= 10
    assert out["stats"]["endpoints"] == {} and out["stats"]["drafts"]["forward_passes"] == 0 == out["stats"]["drafts"]["drafted"]


def test_model_process_ending_is_a_503_and_the_index_still_answers(real_index, checkpoint):
    """The model runs in a process of its own (serve/model_worker.py): the server's own process
    holds no model; if that process ends, a model request is a one-line 503 and index queries
    are still answered."""
    app = create_app(ServeConfig(index=str(real_index), checkpoint=str(checkpoint), max_tokens=64))
    s = app.state.served
    assert s.model is None and s.worker is not None and s.worker.proc.is_alive()
    with TestClient(app) as c:
        ok = c.post("/v1/score", json={"text": "The kernel is"})
        assert ok.status_code == 200 and len(ok.json()["token_ids"]) > 0
        assert c.get("/stats").json()["model"]["params"] > 0
        s.worker.proc.kill()
        s.worker.proc.join(10)
        r = c.post("/v1/completions", json={"prompt": "The", "max_tokens": 4})
        assert r.status_code == 503 and "model's process has ended" in r.json()["error"] and "\n" not in r.json()["error"]
        assert c.post("/", json={"query_type": "count", "query": "kernel"}).status_code == 200
