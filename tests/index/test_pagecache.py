"""`teragram warm`: every array file of an index read back into the page cache, its contents
unchanged and the index answering as before; an index larger than memory refused in one line."""

import hashlib

import numpy as np
import pytest
from teragram.index import pagecache
from teragram.index.engine import Index
from teragram.index.errors import TeragramError
from teragram.serve.main import main


def _digests(files):
    return {f.name + str(f.parent): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def test_warm_reads_every_array_file(real_index, capsys):
    files = pagecache.index_files(real_index)
    assert any(f.name == "sa.bin" for f in files) and any(f.name == "tokens.bin" for f in files)
    before = _digests(files)
    q = np.asarray(Index(real_index).tokenize("the kernel"), np.int64)
    want = Index(real_index).count(q)
    seen = []
    rep = pagecache.warm(real_index, progress=seen.append)
    assert rep["files"] == len(files) and rep["bytes"] == sum(seen) == sum(f.stat().st_size for f in files)
    assert _digests(files) == before and Index(real_index).count(q) == want
    assert main(["warm", str(real_index), "--quiet"]) == 0
    assert f"{real_index}: " in capsys.readouterr().out


def test_linked_shards_are_warmed(real_index, tmp_path):
    """An index whose shards are links to other indexes' (benchmarks' composed indexes) has
    their files warmed too, each once."""
    comp = tmp_path / "composed"
    (comp / "shards").mkdir(parents=True)
    shards = sorted((real_index / "shards").iterdir())
    for i, d in enumerate(shards + shards[:1]):  # one shard linked twice
        (comp / "shards" / f"{i:06d}").symlink_to(d.resolve())
    want = {f for f in pagecache.index_files(real_index) if (real_index / "shards").resolve() in f.parents}
    assert want and pagecache.index_files(comp) == sorted(want)


def test_an_index_larger_than_memory_is_refused(real_index, monkeypatch, capsys):
    monkeypatch.setattr(pagecache, "meminfo", lambda: {"MemTotal": 1 << 20})
    with pytest.raises(TeragramError, match="do not fit"):
        pagecache.warm(real_index)
    assert main(["warm", str(real_index), "--quiet"]) == 2
    assert "do not fit this machine" in capsys.readouterr().err
