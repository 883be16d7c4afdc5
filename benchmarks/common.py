"""Shared helpers for benchmark scripts: measured subprocesses, machine/commit info, results,
smoke runs.

Every benchmark prints a short table last and writes benchmarks/results/NAME.{json,md,png}
(an experiment: experiments/results/) with the command line, the git commit and the machine it
ran on. Every script has a `--smoke` mode (tiny data, CPU, seconds) that writes under a
temporary folder only (smoke_context); tests/benchmarks/test_smoke.py runs them all.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"  # a product benchmark's results
EXPERIMENT_RESULTS = REPO / "experiments" / "results"  # a study's (experiments/)


def results_dir(default: Path = RESULTS) -> Path:
    """Where results go: $TERAGRAM_RESULTS when set (a smoke run sets it), else `default`."""
    return Path(os.environ.get("TERAGRAM_RESULTS") or default)


def commit() -> str:
    """The commit measured: $TERAGRAM_COMMIT when set (for a copy of the working tree whose git
    metadata can be stale), else git's HEAD (-dirty with local changes)."""
    if os.environ.get("TERAGRAM_COMMIT"):
        return os.environ["TERAGRAM_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info = {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem, 1), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
    except ImportError:
        pass
    return info


def sh(*cmd) -> None:
    """Run a command (echoed first), failing on a non-zero exit."""
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


def read_jsonl(path: Path):
    """The records of a .jsonl.zst file, one at a time."""
    import zstandard

    with zstandard.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def write_jsonl(path: Path, records: list[dict]) -> dict:
    """Write records (text, path, corpus) as zstd JSON lines, by a temporary name; their count and sizes."""
    import zstandard

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with zstandard.open(tmp, "wt", encoding="utf-8", cctx=zstandard.ZstdCompressor(level=19)) as f:
        for r in records:
            f.write(json.dumps({"text": r["text"], "path": r["path"], "corpus": r["corpus"]}) + "\n")
    tmp.replace(path)
    return {"docs": len(records), "bytes": sum(len(r["text"].encode()) for r in records), "file_bytes": path.stat().st_size}


def note_ready(data: Path, line: str) -> None:
    """Append a dated line to DATA/READY.md (the index-size data's record of what each step made), and print it."""
    with open(data / "READY.md", "a") as f:
        f.write(f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} {line}\n")
    print(line, flush=True)


def run_measured(cmd: list[str], **kw) -> dict:
    """Run a command; its wall time and peak RSS (MiB: ru_maxrss is KiB; the child and its waited-for children)."""
    t = time.time()
    p = subprocess.Popen(cmd, **kw)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, cmd)
    return {"wall_s": time.time() - t, "peak_rss_mb": ru.ru_maxrss / 1024}


def library_at(commit: str, tmp: Path) -> Path:
    """A folder to put first on PYTHONPATH so that `teragram` is the library at `commit` (a
    `git archive` of its packages under tmp): a benchmark's baseline measured in the same run."""
    src, shim = tmp / "src", tmp / "shim" / "teragram"
    src.mkdir(parents=True)
    shim.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit, "index", "builder", "model", "serve"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    for d in ("index", "builder", "model", "serve"):
        (shim / d).symlink_to(src / d)
    (shim / "__init__.py").write_text("")
    return shim.parent


def library_env(library: Path | None) -> dict:
    """This process's environment, with `library` (library_at's folder) first on PYTHONPATH when given."""
    env = dict(os.environ)
    if library is not None:
        env["PYTHONPATH"] = f"{library}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def table(rows: list[dict], cols: list[str]) -> str:
    """A markdown table of rows (dicts) in the given columns."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def save(name: str, data: dict, markdown: str, fig=None, *, results: Path = RESULTS, checks: dict[str, bool] | None = None) -> None:
    """Write NAME.json (data + provenance), NAME.md (provenance + table), NAME.png (fig) under
    results_dir(results). checks: the equalities the figures rest on (a description each, e.g.
    "idx-2b: incremental text == from scratch"); if any is false nothing is written, and the
    run exits non-zero naming them."""
    failed = [k for k, ok in (checks or {}).items() if not ok]
    if failed:
        print(markdown)
        raise SystemExit(f"{name}: not saved, these checks failed: {'; '.join(failed)}")
    out = results_dir(results)
    out.mkdir(parents=True, exist_ok=True)
    prov = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "commit": commit(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    (out / f"{name}.json").write_text(json.dumps(prov | data, indent=1, default=float) + "\n")
    head = f"`{prov['command']}` at commit `{prov['commit']}` on {prov['machine']['cpu']} ({prov['machine']['cores']} cores, {prov['machine']['mem_gib']} GiB), {prov['date']}\n\n"
    (out / f"{name}.md").write_text(head + markdown + "\n")
    if fig is not None:
        fig.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")
    print(markdown)


def linux_corpus(workdir: Path, mb: float, split: str) -> Path:
    """The first `mb` MB of the train or held-out split of linux-source-6.1, as JSON lines (zstd)."""
    from tools import corpora

    out = Path(workdir) / f"linux-{split}-{mb:g}mb.jsonl.zst"
    if not out.exists():
        print("exporting", out, corpora.export(["linux-source-6.1"], out, max_bytes=int(mb * 1e6), split=split, level=3), flush=True)
    return out


def default_workdir() -> Path:
    from tools import corpora

    return corpora.cache_dir().parent / "bench"


@contextmanager
def smoke_context(on: bool) -> Iterator[Path | None]:
    """For a script's --smoke mode: a temporary folder (removed after) under which results
    ($TERAGRAM_RESULTS, for this process and its children) and corpus caches ($TERAGRAM_CACHE)
    go, so a smoke run writes nothing into the repository or the user's cache. None when off."""
    if not on:
        yield None
        return
    keys = ("TERAGRAM_RESULTS", "TERAGRAM_CACHE")
    old = {k: os.environ.get(k) for k in keys}
    with tempfile.TemporaryDirectory(prefix="teragram-smoke-") as tmp:
        tmp = Path(tmp)
        os.environ["TERAGRAM_RESULTS"] = str(tmp / "results")
        os.environ["TERAGRAM_CACHE"] = str(tmp / "cache" / "corpora")
        try:
            yield tmp
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


SMOKE_DOCS = 8  # documents of the embedded corpus in a smoke corpus: a ~100k-token index


def smoke_corpus(tmp: Path, *, heldout: bool = False) -> Path:
    """A tiny corpus of the embedded one's files (kept once under tmp): `SMOKE_DOCS` training
    files, or a held-out folder with valid/ and test/ of 3 files each."""
    import shutil

    src = REPO / "data" / "default"
    out = tmp / ("smoke-heldout" if heldout else "smoke-train")
    if out.exists():
        return out
    if heldout:
        for half in ("valid", "test"):
            for i, f in enumerate(sorted((src / "heldout" / half).rglob("*.rst.gz"))[:3]):
                (out / half).mkdir(parents=True, exist_ok=True)
                shutil.copy(f, out / half / f"{i:02d}-{f.name}")
    else:
        out.mkdir(parents=True)
        for i, f in enumerate(sorted((src / "train" / "linux-doc").rglob("*.rst.gz"))[:SMOKE_DOCS]):
            shutil.copy(f, out / f"{i:02d}-{f.name}")
    return out


def smoke_index(tmp: Path, vocab: int = 512) -> Path:
    """A tiny index of smoke_corpus: $TERAGRAM_SMOKE_INDEX when set (the smoke test builds one
    for every script), else built under tmp."""
    if os.environ.get("TERAGRAM_SMOKE_INDEX"):
        return Path(os.environ["TERAGRAM_SMOKE_INDEX"])
    out = tmp / "smoke-idx"
    if not (out / "manifest.json").exists():
        sh(sys.executable, "-m", "teragram.builder.cli", smoke_corpus(tmp), "--out", out, "--vocab-size", vocab, "--quiet")
    return out


def smoke_jsonl(tmp: Path, *, heldout: bool = False) -> Path:
    """smoke_corpus's training files (or its held-out files, both halves) as one JSON-lines file
    (zstd), the format linux_corpus gives."""
    import gzip

    import zstandard

    out = tmp / ("smoke-heldout.jsonl.zst" if heldout else "smoke-train.jsonl.zst")
    if not out.exists():
        with zstandard.open(out, "wt", encoding="utf-8") as f:
            for p in sorted(smoke_corpus(tmp, heldout=heldout).rglob("*.gz")):
                f.write(json.dumps({"text": gzip.open(p, "rt", encoding="utf-8").read(), "path": p.name}) + "\n")
    return out


def smoke_imports(*modules: str) -> None:
    """Import the modules a script loads only inside the stages its smoke run cannot reach (a GPU,
    a large corpus): an import error there still fails the smoke run."""
    import importlib

    for m in modules:
        importlib.import_module(m)


SMOKE_HELP = "tiny data on CPU, in seconds; results under a temporary folder (tests/benchmarks/test_smoke.py runs it)"


def _write_records(path: Path, records: list[dict]) -> None:
    import zstandard

    path.parent.mkdir(parents=True, exist_ok=True)
    with zstandard.open(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _embedded(part: str, n: int, skip: int = 0) -> list[dict]:
    """Records {text, path, corpus} of the embedded corpus's .rst files: `part` train (paths
    relative to train/) or heldout (relative to heldout/valid|test/: held-out paths by
    corpora.split_of), the n after the first `skip`."""
    import gzip

    root = REPO / "data" / "default" / part
    files = sorted(root.rglob("*.rst.gz"), key=lambda p: p.relative_to(root).parts[1:] if part == "heldout" else p.parts)
    files = [f for f in files if f.stat().st_size > 2500][skip : skip + n]
    rel = (lambda f: f.relative_to(root).parts[1:]) if part == "heldout" else (lambda f: f.relative_to(root).parts)
    return [{"text": gzip.open(f, "rt", encoding="utf-8").read(), "path": "/".join(rel(f)), "corpus": "linux-doc-6.1"} for f in files]


def smoke_data(tmp: Path) -> Path:
    """A tiny DATA folder in the layout benchmarks/index_size_data.py makes (kept once under tmp),
    of the embedded corpus's files: ppl/{train,heldout}-{code,english,everyday}.jsonl.zst,
    idx-050m (smoke_index, a link) and heldout/{indist,timeshift,prose}/{valid,test}.jsonl.zst
    (the same held-out documents in each set, split by the perplexity benchmark's rule)."""
    out = tmp / "smoke-data"
    if (out / "ready").exists():
        return out
    train, held = _embedded("train", 10), _embedded("heldout", 12)
    ppl = out / "ppl"
    for name, recs in (("code", train[:4]), ("english", train[4:8]), ("everyday", train[8:])):
        _write_records(ppl / f"train-{name}.jsonl.zst", recs)
    for name, recs in (("code", held[0:8:2]), ("english", held[1:8:2]), ("everyday", held[8:])):
        _write_records(ppl / f"heldout-{name}.jsonl.zst", recs)
    from benchmarks.perplexity import in_valid_half

    for s in ("indist", "timeshift", "prose"):
        for half in ("valid", "test"):
            _write_records(out / "heldout" / s / f"{half}.jsonl.zst", [r for r in held if in_valid_half(r["path"]) == (half == "valid")])
    (out / "idx-050m").symlink_to(smoke_index(tmp).resolve())
    (out / "ready").touch()
    return out


SMOKE_TRAIN = dict(preset="tiny", block_size=128, batch_size=2, max_steps=3, warmup=1, lr=3e-3, min_lr=3e-4, log_every=1, progress=False)


def smoke_model(tmp: Path) -> Path:
    """A tiny model (no index inputs: the benchmarks' (a)) trained a few steps on smoke_index:
    $TERAGRAM_SMOKE_MODEL when set (the smoke test trains one for every script), else under tmp."""
    if os.environ.get("TERAGRAM_SMOKE_MODEL"):
        return Path(os.environ["TERAGRAM_SMOKE_MODEL"])
    out = tmp / "smoke-run"
    if not (out / "latest.json").exists():
        from teragram.model.training.train import TrainConfig, train

        train(TrainConfig(index=str(smoke_index(tmp)), out=str(out), use_index=False, **SMOKE_TRAIN))
    return out


def smoke_features(tmp: Path) -> Path:
    """Exclude-doc features (top 4) of smoke_index: $TERAGRAM_SMOKE_FEATURES when set, else under tmp."""
    if os.environ.get("TERAGRAM_SMOKE_FEATURES"):
        return Path(os.environ["TERAGRAM_SMOKE_FEATURES"])
    out = tmp / "smoke-feats"
    if not (out / "manifest.json").exists():
        from teragram.builder.features import compute_features
        from teragram.index.features import FeatureConfig

        compute_features(smoke_index(tmp), out, FeatureConfig("exclude-doc", 64, 4), progress=False)
    return out


def smoke_short_fits(steps: int = 15) -> None:
    """For a smoke run: every gate fit (model/mixture/gate: Gate.fit, fit_weights) takes `steps`
    L-BFGS iterations by default, not 300 (the same code path; on tiny data the fits are the slow part)."""
    from teragram.model.mixture import gate

    for f in (gate.fit_weights, gate.Gate.fit.__func__):
        f.__kwdefaults__["steps"] = steps
