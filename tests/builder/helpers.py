"""What several test modules of tests/builder share: the brute-force suffix array, a build's
files, a build-index run killed at a milestone, and random documents with duplicates."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.conftest import random_docs

REPO = Path(__file__).resolve().parents[2]


def brute_sa(tok: np.ndarray, sep: int) -> list[int]:
    """Non-separator positions sorted by their tokens through the document's SEP, then by
    position (the shard order of builder/sa.py), by sorting Python tuples."""
    ends = np.flatnonzero(tok == sep)
    keys = {}
    for p in np.flatnonzero(tok != sep):
        e = ends[np.searchsorted(ends, p)]
        keys[int(p)] = (tuple(tok[p : e + 1].tolist()), int(p))
    return sorted(keys, key=keys.__getitem__)


def built_files(root: Path) -> dict[str, bytes]:
    """Every file of a build (path -> bytes), the report with its timings left out."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != "build-report.json"}


def run_and_kill(args: list[str], out: Path, when) -> bool:
    """Start build-index, SIGKILL it as soon as when(out) holds; True if it was killed. Its
    worker processes must not outlive it."""
    import psutil

    proc = subprocess.Popen(
        [sys.executable, "-m", "teragram.builder.cli", *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    while proc.poll() is None:
        if out.exists() and when(out):
            try:
                workers = psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                workers = []
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            _, alive = psutil.wait_procs(workers, timeout=10)
            assert not alive, f"orphaned workers: {alive}"
            return True
        time.sleep(0.002)
    return False


def docs_with_duplicates(seed: int) -> list[np.ndarray]:
    """Random documents over a tiny alphabet, some repeated whole (equal tails through SEP)."""
    rng = np.random.default_rng(seed)
    docs = random_docs(rng, 80, 3, 60, 1000)
    for i in rng.integers(0, len(docs), size=25):
        docs.insert(int(rng.integers(0, len(docs))), docs[int(i)])
    return docs
