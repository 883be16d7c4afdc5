"""Every command in README.md runs as written (issue 47's bar), read from the README at test time.

Each fenced ```bash line (comments and blank lines skipped, backslash continuations joined, `&&`
chains split) must fall under one of the rules below, or the test fails, so a new README command
without a test fails CI:

- `make demo` / `make test`: the Makefile has the target (`make -n`); the demo runs here at smoke
  scale (10 training steps, a few held-out documents); the suite is `make test` itself.
- `build-index ...` / `teragram ...` (the quick start): run for real, in README order, in a temp
  directory, at tiny scale: the README's placeholders mapped onto the embedded corpus
  (`my_corpus/` -> data/default/train; `heldout/valid`, `heldout/test` -> a few documents of
  data/default/heldout/valid and .../test, copied under those relative names), `--vocab-size 4000`,
  train capped with `--max_steps` and gate fits with `--fit-rows` (appended overrides), each
  `serve` in the background on a free port. The commands naming `my-model/` ("Your own model") run in a directory of their own, where
  `my-model/` is a tiny random GPT-2 made with `transformers` with a byte-level BPE trained with
  `tokenizers` on the embedded corpus (tests/conftest.py tiny_hf_model).
- `python -m benchmarks.X ...` / `python -m experiments.X ...`: the module exists and its --help
  (and its subcommand's, when the README names one) exits 0; their --smoke modes run in
  tests/benchmarks/test_smoke.py.

The ```python blocks run in a subprocess against the quick start's index.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DEFAULT = REPO / "data" / "default"
HELD_DOCS = 6  # documents of each held-out half the quick start reads (the whole halves take minutes)
TRAIN_OVERRIDES = ["--max_steps=10", "--progress=false", "--batch_size=8"]
FIT_OVERRIDES = ["--fit-rows", "1000"]  # each of --fit-gate's three fits on 1,000 tokens, not eval's 200,000
TIMEOUT = 300  # seconds per command
OWN_MODEL = "my-model"  # the README's "Your own model": commands naming it run in OWN_DIR, beside it
OWN_DIR = "own"


def fenced_blocks(lang: str) -> list[str]:
    """The bodies of README.md's ```lang blocks."""
    return re.findall(rf"^```{lang}[ \t]*\n(.*?)^```", README.read_text(), re.S | re.M)


def bash_commands() -> list[str]:
    """Every command line of the README's ```bash blocks: continuations joined, comments and blank
    lines skipped, `a && b` split into its commands."""
    out = []
    for block in fenced_blocks("bash"):
        block = re.sub(r"\\\n\s*", " ", block)
        for line in block.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            out += [c.strip() for c in line.split("&&") if c.strip()]
    return out


def classify(cmd: str) -> str | None:
    argv = shlex.split(cmd, comments=True)
    if argv[:1] == ["make"] and len(argv) == 2:
        return "make"
    if argv[:1] in (["build-index"], ["teragram"]):
        return "quickstart"
    if argv[:2] == ["python", "-m"] and len(argv) > 2 and argv[2].split(".")[0] in ("benchmarks", "experiments"):
        return "module"
    return None


def commands(kind: str) -> list[list[str]]:
    return [shlex.split(c, comments=True) for c in bash_commands() if classify(c) == kind]


def test_every_readme_command_is_tested():
    cmds = bash_commands()
    assert cmds, "no ```bash block found in README.md"
    unknown = [c for c in cmds if classify(c) is None]
    assert not unknown, f"README commands no rule of tests/test_readme.py covers: {unknown}"
    assert len(README.read_text().splitlines()) <= 300


def test_make_targets():
    targets = commands("make")
    assert ["make", "demo"] in targets and ["make", "test"] in targets
    for argv in targets:
        r = subprocess.run(["make", "-n", argv[1]], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{shlex.join(argv)}: {r.stderr}"


def test_make_demo_at_smoke_scale(tmp_path):
    """`make demo` runs the product path end to end (build-index, train a plain LM, fit the gate
    on validation text, report it on test text, sample with it), here with this interpreter's
    environment, 10 training steps and a few held-out documents: the gate is fit with the
    continuous cache among its candidates, and helps on the test half."""
    _held_out(tmp_path)
    venv = Path(sys.prefix)
    cmd = ["make", "-o", f"{venv}/.installed", "demo", f"VENV={venv}", f"RUN={tmp_path / 'run'}"]
    cmd += [f"DEMO_TRAIN={' '.join(TRAIN_OVERRIDES)}", f"DEMO_VALID={tmp_path / 'heldout/valid'}", f"DEMO_TEST={tmp_path / 'heldout/test'}"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=2 * TIMEOUT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{shlex.join(cmd)}:\n{out[-4000:]}"
    gated = [ln for ln in out.splitlines() if "with the index gate" in ln]
    assert len(gated) == 2, out[-4000:]
    assert "gate+cont_cache" in gated[0] and "decontaminated" in gated[1]
    mixed, alone = (float(x) for x in re.search(r"perplexity ([0-9.]+),.*the model alone: perplexity ([0-9.]+)", gated[1]).groups())
    assert mixed < alone
    gate = json.loads((tmp_path / "run" / "gate.json").read_text())
    assert gate["components"][0] == "index_infgram"
    assert "index lookups per token: median" in out


def _entry(name: str) -> list[str]:
    """The console script next to the interpreter, else its module."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", {"teragram": "teragram.serve.main", "build-index": "teragram.builder.cli"}[name]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _substitute(argv: list[str], port: int) -> list[str]:
    """The README's placeholders onto the embedded corpus and a tiny scale."""
    out = []
    for i, a in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if a.rstrip("/") == "my_corpus":
            a = str(DEFAULT / "train")
        elif prev == "--vocab-size":
            a = "4000"
        elif prev == "--port":
            a = str(port)
        elif "/" in a and (REPO / a).exists():  # a repository file (model/configs/...): the cwd is the temp dir
            a = str(REPO / a)
        out.append(a)
    if argv[:2] == ["teragram", "train"]:
        out += TRAIN_OVERRIDES
    if argv[:2] == ["teragram", "eval"] and "--fit-gate" in argv:
        out += FIT_OVERRIDES
    return _entry(out[0]) + out[1:]


def _held_out(root: Path) -> None:
    """heldout/valid and heldout/test: the first few mid-sized documents of each embedded half."""
    for half in ("valid", "test"):
        dst = root / "heldout" / half
        dst.mkdir(parents=True)
        docs = sorted(p for p in (DEFAULT / "heldout" / half).rglob("*.gz") if 1000 < p.stat().st_size < 6000)
        for p in docs[:HELD_DOCS]:
            (dst / p.name.removesuffix(".gz")).write_bytes(gzip.decompress(p.read_bytes()))


def _own_model(root: Path) -> Path:
    """The "Your own model" commands' directory: held-out text and `my-model/` (module doc)."""
    from tests.conftest import tiny_hf_model

    own = root / OWN_DIR
    _held_out(own)
    texts = (gzip.open(p, "rt", encoding="utf-8").read() for p in sorted((DEFAULT / "train").rglob("*.gz")))
    tiny_hf_model(own / OWN_MODEL, texts)
    return own


def _names_own_model(argv: list[str]) -> bool:
    return any(a.rstrip("/") == OWN_MODEL for a in argv)


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory):
    """The README's quick start and its "Your own model", run in order in a temp directory (serve
    excepted: test_serve); yields (the directory, [(argv, stdout + stderr)], [(serve command, the
    directory it runs in)])."""
    root = tmp_path_factory.mktemp("quickstart")
    _held_out(root)
    own = _own_model(root)
    ran, serves = [], []
    for argv in commands("quickstart"):
        cwd = own if _names_own_model(argv) else root
        if argv[:2] == ["teragram", "serve"]:
            serves.append((argv, cwd))
            continue
        real = _substitute(argv, 0)
        t = time.perf_counter()
        r = subprocess.run(real, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 0, (
            f"README command failed: {shlex.join(argv)}\nran: {shlex.join(real)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        )
        ran.append((argv, r.stdout + r.stderr))
        print(f"{time.perf_counter() - t:6.1f} s  {shlex.join(argv)}")  # seen with pytest -s
    return root, ran, serves


def test_quick_start(quick_start):
    root, ran, _ = quick_start
    verbs = [tuple(a[:2]) for a, _ in ran]
    for verb in (("build-index",), ("teragram", "query"), ("teragram", "train"), ("teragram", "eval"), ("teragram", "sample")):
        assert any(v[: len(verb)] == verb for v in verbs), f"the README's quick start has no {' '.join(verb)}"
    assert any(_names_own_model(a) and "--hf-model" in a for a, _ in ran), "the README shows no --hf-model command"
    for argv, out in ran:
        if argv[:2] == ["teragram", "eval"]:
            assert "perplexity" in out, f"{shlex.join(argv)} printed no perplexity:\n{out[-2000:]}"
        if "--fit-gate" in argv:
            assert ((root / OWN_DIR) if _names_own_model(argv) else root).joinpath(argv[argv.index("--fit-gate") + 1]).is_file()
        if argv[:2] == ["teragram", "query"] and "--json" in argv:
            json.loads(out.strip().splitlines()[-1])


def _request(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return json.loads(r.read())


def test_serve(quick_start):
    """Each README `serve` (the quick start's, and the one of "Your own model" through --hf-model)
    answers queries, and scores text with its model and gate."""
    _, _, serves = quick_start
    assert serves, "the README's quick start has no teragram serve"
    for serve, cwd in serves:
        _serve_answers(serve, cwd)


def _serve_answers(serve: list[str], cwd: Path) -> None:
    port = _free_port()
    real = _substitute(serve, port)
    proc = subprocess.Popen(real, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    has_model = "--checkpoint" in serve or "--hf-model" in serve
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, f"{shlex.join(serve)} exited {proc.returncode}:\n{proc.stdout.read()[-3000:]}"
            try:
                health = _request(f"{base}/health")
                break
            except OSError:
                assert time.time() < deadline, f"{shlex.join(serve)}: no /health answer in 120 s"
                time.sleep(0.5)
        assert health["status"] == "ok" and health["model"] is has_model
        count = _request(f"{base}/", {"query_type": "count", "query": "static int"})
        assert count["count"] > 0
        if has_model:
            score = _request(f"{base}/v1/score", {"text": "static int main(void)"})
            n = len(score["token_ids"])
            assert n and len(score["logprobs_with_index"]) == n
            if "--gate" in serve:
                assert len(score["logprobs_with_gate"]) == n
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_python_blocks(quick_start):
    root = quick_start[0]
    blocks = fenced_blocks("python")
    assert blocks
    for code in blocks:
        code = code.replace('"runs/default/idx"', repr(str(root / "idx")))
        r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 0, f"README python block failed:\n{code}\n{r.stderr[-3000:]}"


def test_module_commands_have_help():
    """`python -m benchmarks.X` / `experiments.X`: the module exists and its --help (and its
    subcommand's) exits 0. Their --smoke runs are tests/benchmarks/test_smoke.py's."""
    mods = commands("module")
    assert mods
    seen = set()
    env = os.environ | {"PYTHONPATH": str(REPO)}
    for argv in mods:
        mod = argv[2]
        assert (REPO / (mod.replace(".", "/") + ".py")).is_file(), f"{shlex.join(argv)}: no module {mod}"
        helps = [[mod, "--help"]]
        if len(argv) > 3 and not argv[3].startswith("-"):
            helps.append([mod, argv[3], "--help"])
        for h in helps:
            if tuple(h) in seen:
                continue
            seen.add(tuple(h))
            r = subprocess.run([sys.executable, "-m", *h], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, f"python -m {shlex.join(h)} (from the README's {shlex.join(argv)}):\n{r.stderr[-3000:]}"
