"""Every `teragram` verb: its --help, and one small real invocation, in process (the verbs'
detailed behaviour is tested beside each subsystem)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
from teragram.index.engine import Index
from teragram.serve.main import build_parser, main

VERBS = (
    "build",
    "features",
    "verify",
    "warm",
    "stats",
    "tokenize",
    "query",
    "train",
    "eval",
    "evals",
    "sample",
    "dense",
    "export",
    "serve",
)


def test_every_verb_is_registered_with_help(capsys):
    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    assert sorted(sub.choices) == sorted(VERBS)
    for verb in VERBS:
        with pytest.raises(SystemExit) as e:
            main([verb, "--help"])
        assert e.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: teragram {verb}")


def _run(capsys, *args) -> str:
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def test_every_verb_runs(capsys, tmp_path, corpus_dir, tokenizer_model, real_index):
    idx_dir = tmp_path / "idx"
    assert "built" in _run(capsys, "build", corpus_dir, "--out", idx_dir, "--tokenizer", tokenizer_model, "--workers", 1, "--quiet")
    assert _run(capsys, "verify", idx_dir).strip() == f"{idx_dir}: ok"
    idx = Index(idx_dir)
    assert json.loads(_run(capsys, "stats", idx_dir, "--json"))["counts"]["tokens"] == idx.n_tokens
    ids = json.loads(_run(capsys, "tokenize", idx_dir, "the kernel", "--json"))["ids"]
    assert ids == idx.tokenize("the kernel")
    assert json.loads(_run(capsys, "query", idx_dir, "count", "the kernel", "--json"))["count"] == idx.count(ids).count
    feats = tmp_path / "feats"
    assert "features" in _run(capsys, "features", idx_dir, "--out", feats, "--workers", 1, "--quiet")
    run = tmp_path / "run"
    cfg = [f"--index={idx_dir}", f"--features={feats}", f"--out={run}", "--preset=tiny", "--block_size=32", "--batch_size=4"]
    assert "trained" in _run(capsys, "train", *cfg, "--max_steps=2", "--progress=false", "--eval_every=0")
    held = tmp_path / "held"
    held.mkdir()
    (held / "a.txt").write_text("The kernel is the core of the operating system.\n")
    ev = ["--checkpoint", run, "--index", idx_dir, "--corpus", held, "--quiet", "--json"]
    assert json.loads(_run(capsys, "eval", *ev))["tokens"] == len(idx.tokenize((held / "a.txt").read_text())) + 1
    assert _run(capsys, "sample", "--checkpoint", run, "--index", idx_dir, "The", "--max-tokens", 3).startswith("The")
    sample = ["sample", "--checkpoint", run, "--index", idx_dir, "The kernel is the core", "--max-tokens", 12, "--temperature", 0]
    assert main([str(a) for a in sample] + ["--draft", "4", "--provenance", "--verbose"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("The kernel") and "provenance (tokens whose context" in out.out and "forward passes" in out.err
    with pytest.raises(SystemExit):
        main([str(a) for a in sample] + ["--draft", "-1"])
    assert "expected 0 (no drafts)" in capsys.readouterr().err
    plain = tmp_path / "plain"
    assert "trained" in _run(
        capsys, "train", *cfg[:1], f"--out={plain}", *cfg[3:], "--use_index=false", "--max_steps=2", "--progress=false"
    )
    r = json.loads(
        _run(capsys, "evals", "--checkpoint", plain, "--index", idx_dir, "--tasks", "piqa,winogrande", "--limit", 3, "--quiet", "--json")
    )
    assert [x["task"] for x in r] == ["piqa", "winogrande"] and all(x["model"]["n"] == 3 for x in r)
    assert main(["evals", "--checkpoint", str(run), "--index", str(idx_dir), "--limit", "1", "--quiet"]) == 2
    assert "without index inputs" in capsys.readouterr().err
    assert "dense store of 512 keys" in _run(capsys, "dense", idx_dir, "--checkpoint", run, "--features", feats, "--positions", 512)
    # evaluation options: decontamination, the peers' interpolations (fit, then loaded)
    dc = json.loads(_run(capsys, "eval", *ev, "--decontaminate"))["decontaminated"]
    assert dc["docs"] == 1 and dc["dropped_docs"] in (0, 1)
    lam = tmp_path / "lam.json"
    fit = json.loads(_run(capsys, "eval", *ev, "--baseline", "infini-gram", "--fit-lambdas", lam))
    again = json.loads(_run(capsys, "eval", *ev, "--baseline", "infini-gram", "--lambdas", lam))
    assert again["loss"] == fit["loss"] and again["lambdas"] == fit["lambdas"] and again["model"] == fit["model"]
    cc = json.loads(_run(capsys, "eval", *ev, "--baseline", "infini-gram+cache", "--fit-lambdas", tmp_path / "cc.json"))
    cc2 = json.loads(_run(capsys, "eval", *ev, "--baseline", "infini-gram+cache", "--lambdas", tmp_path / "cc.json"))
    assert cc2["loss"] == pytest.approx(cc["loss"]) and cc2["weights"] == cc["weights"]
    assert all(sum(w.values()) == pytest.approx(1.0) for w in cc["weights"].values())
    assert cc["loss"] <= fit["loss"] + 1e-6  # infini-gram's λ are one of its choices (no cache), on the text both were fit on
    knn = json.loads(_run(capsys, "eval", *ev, "--baseline", "knn", "--fit-lambdas", tmp_path / "knn.json"))
    assert knn["model"] == fit["model"] and 0 <= knn["knn"]["lambda"] < 1
    assert main(["eval", *map(str, ev), "--baseline", "knn", "--lambdas", str(lam)]) == 2
    assert "parameters of the infini-gram baseline, not knn" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "teragram.serve.main", "serve", "--index", str(real_index), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(300):
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health")
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert r.json()["status"] == "ok"
    finally:
        proc.terminate()
        proc.wait(10)
