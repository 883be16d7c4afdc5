"""The Ray executor builds the same index as the local one, byte for byte, also when a
worker dies mid-task; shards spread over several directories open and verify."""

import os
from pathlib import Path

import pytest
from teragram.builder.build import BuildConfig, build
from teragram.builder.ray_executor import RayExecutor

ray = pytest.importorskip("ray")


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in ("build-report.json", "build-state.json")
    }


def _die_once(marker: str, fn, *args):
    """Kill the worker process the first time (no exception: the process just ends)."""
    if not os.path.exists(marker):
        Path(marker).touch()
        os._exit(1)
    return fn(*args)


class _FlakyRay(RayExecutor):
    def __init__(self, marker: str):
        super().__init__(num_cpus=2)
        self.marker = marker
        self.n = 0

    def submit(self, fn, *args):
        self.n += 1
        if self.n == 2:  # the second shard's worker dies once
            return super().submit(_die_once, self.marker, fn, *args)
        return super().submit(fn, *args)


@pytest.fixture(scope="module")
def local_build(tmp_path_factory, corpus_dir, tokenizer_model):
    out = tmp_path_factory.mktemp("local") / "idx"
    build(
        BuildConfig(inputs=(str(corpus_dir),), out=str(out), tokenizer=str(tokenizer_model), shard_tokens=30000, workers=2, progress=False)
    )
    return out


def test_ray_build_identical_and_retries_a_dead_worker(local_build, tmp_path, corpus_dir, tokenizer_model, monkeypatch):
    out = tmp_path / "ray"
    build(
        BuildConfig(
            inputs=(str(corpus_dir),),
            out=str(out),
            tokenizer=str(tokenizer_model),
            shard_tokens=30000,
            workers=2,
            executor="ray",
            progress=False,
        )
    )
    assert _files(out) == _files(local_build)

    import teragram.builder.build as B

    marker = tmp_path / "died"
    monkeypatch.setattr(B, "make_executor", lambda kind, par, addr: _FlakyRay(str(marker)))
    out2 = tmp_path / "ray-flaky"
    build(
        BuildConfig(inputs=(str(corpus_dir),), out=str(out2), tokenizer=str(tokenizer_model), shard_tokens=30000, workers=2, progress=False)
    )
    assert marker.exists()  # a worker really died
    assert _files(out2) == _files(local_build)


def test_shards_spread_over_directories(local_build, tmp_path, corpus_dir, tokenizer_model):
    from teragram.index.engine import Index
    from teragram.index.verify import verify

    disks = [tmp_path / "disk0", tmp_path / "disk1"]
    out = tmp_path / "spread"
    build(
        BuildConfig(
            inputs=(str(corpus_dir),),
            out=str(out),
            tokenizer=str(tokenizer_model),
            shard_tokens=30000,
            workers=1,
            shard_dirs=tuple(map(str, disks)),
            progress=False,
        )
    )
    assert (disks[0] / "000000" / "sa.bin").exists() and (disks[1] / "000001" / "sa.bin").exists()
    assert not (out / "shards" / "000000").exists()
    assert verify(out) == []
    a, b = Index(out), Index(local_build)
    q = [int(x) for x in b.shards[0].tok[100:104]]
    assert a.count(q) == b.count(q) and a.infgram_ntd(q) == b.infgram_ntd(q)
