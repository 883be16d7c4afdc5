"""Every script under benchmarks/, experiments/ and tools/ runs its smoke mode (`python -m MODULE
--smoke`: tiny data, CPU, a temporary results folder) and exits 0, so that an import or argument
error in any of them fails here. A new script is picked up by the glob: without a smoke mode it
fails. A module that is not a script (no `__main__` block) must be one a script's smoke run
runs (COVERED): benchmarks/knnlm.py, the joint benchmark's kNN stage, is checked by the files
it wrote in the joint smoke run."""

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


# a module that is not a script -> what it writes in the joint smoke run (benchmarks/joint.py's
# smoke_stages, which runs it): knnlm.joint_estimates, its held-out part with the peer (d), own_store
COVERED = {
    "benchmarks.knnlm": ["out/knn_est.json", "out/knn_gpu.json", "out/knnest-indist-test.npz", "out/contcache-prose-valid.npz",
                         "work/est-knn/manifest.json", "work/own/knnj3/knn_est.json"],
}  # fmt: skip


@pytest.fixture(scope="session")
def smoke_joint(smoke_env, tmp_path_factory) -> Path:
    """The joint benchmark's GPU stages at smoke scale (benchmarks/joint.py smoke_stages), made
    once for the scripts that read such a run ($TERAGRAM_SMOKE_JOINT): in a process of its own,
    as its gate fits are shortened there."""
    root = tmp_path_factory.mktemp("smoke-joint")
    code = "import sys; from pathlib import Path; from benchmarks.joint import smoke_stages; smoke_stages(Path(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(root)], cwd=REPO, env=smoke_env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"the joint smoke run exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return root


def test_every_folder_has_scripts():
    assert {s.split(".")[0] for s in SCRIPTS} == {"benchmarks", "experiments", "tools"}


@pytest.mark.parametrize("module", SCRIPTS)
def test_smoke(module, smoke_env, request):
    source = (REPO / (module.replace(".", "/") + ".py")).read_text()
    if 'if __name__ == "__main__":' not in source:
        assert module in COVERED, f"{module} is not a script (no __main__ block), nor in COVERED"
        root = request.getfixturevalue("smoke_joint")
        assert not [f for f in COVERED[module] if not (root / f).exists()], f"the joint smoke run wrote not all of {module}'s files"
        return
    env = smoke_env
    if "smoke_joint(" in source:  # it reads the joint benchmark's smoke run
        env = env | {"TERAGRAM_SMOKE_JOINT": str(request.getfixturevalue("smoke_joint"))}
    cmd = [sys.executable, "-m", module, "--smoke"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd[1:])} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert not (REPO / "benchmarks" / "results" / "smoke").exists()
