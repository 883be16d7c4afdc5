"""Every script under benchmarks/, experiments/ and tools/ runs its smoke mode (`python -m MODULE
--smoke`: tiny data, CPU, a temporary results folder) and exits 0, so that an import or argument
error in any of them fails here. A new script is picked up by the glob: without a smoke mode it
fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    p.relative_to(REPO).with_suffix("").as_posix().replace("/", ".")
    for folder in ("benchmarks", "experiments", "tools")
    for p in (REPO / folder).glob("*.py")
    if p.stem not in ("__init__", "common")
)


@pytest.fixture(scope="session")
def smoke_env(tmp_path_factory) -> dict:
    """The environment of every smoke run: one tiny index, its exclude-doc features and a tiny
    model trained a few steps on it, for the scripts that take them ($TERAGRAM_SMOKE_INDEX,
    _FEATURES, _MODEL, made once), results and caches under a temporary folder."""
    sys.path.insert(0, str(REPO))
    from benchmarks.common import smoke_features, smoke_index, smoke_model

    tmp = tmp_path_factory.mktemp("smoke")
    return os.environ | {
        "TERAGRAM_SMOKE_INDEX": str(smoke_index(tmp)),
        "TERAGRAM_SMOKE_FEATURES": str(smoke_features(tmp)),
        "TERAGRAM_SMOKE_MODEL": str(smoke_model(tmp)),
        "TERAGRAM_RESULTS": str(tmp / "results"),
        "TERAGRAM_CACHE": str(tmp / "cache" / "corpora"),
        "OMP_NUM_THREADS": "1",
    }


def test_the_glob_finds_scripts():
    """benchmarks/ and tools/ hold scripts (experiments/ may hold none: its studies' results stay)."""
    assert {"benchmarks", "tools"} <= {s.split(".")[0] for s in SCRIPTS}


@pytest.mark.parametrize("module", SCRIPTS)
def test_smoke(module, smoke_env):
    source = (REPO / (module.replace(".", "/") + ".py")).read_text()
    assert 'if __name__ == "__main__":' in source, f"{module} is not a script (no __main__ block)"
    cmd = [sys.executable, "-m", module, "--smoke"]
    r = subprocess.run(cmd, cwd=REPO, env=smoke_env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd[1:])} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert not (REPO / "benchmarks" / "results" / "smoke").exists()
