import subprocess
import sys
from pathlib import Path

import pytest
from teragram.index.verify import verify

from tests.conftest import copytree

REPO = Path(__file__).resolve().parents[2]


def _teragram(*args):
    return subprocess.run([sys.executable, "-m", "teragram.serve.main", *args], capture_output=True, text=True, cwd=REPO)


def test_clean_index_verifies(real_index):
    assert verify(real_index) == []
    r = _teragram("verify", str(real_index))
    assert r.returncode == 0 and r.stdout.strip().endswith(": ok")


@pytest.mark.parametrize("name", ["tokens.bin", "sa.bin", "docs.bin", "samax.bin", "docs.jsonl"])
def test_flipped_byte_is_reported_by_name(real_index, tmp_path, name):
    idx = copytree(real_index, tmp_path / "i")
    p = idx / "shards" / "000001" / name
    data = bytearray(p.read_bytes())
    data[-3] ^= 0x10  # in the body of every file
    p.write_bytes(bytes(data))
    problems = verify(idx)
    assert len(problems) == 1 and problems[0].startswith(f"shards/000001/{name}: checksum mismatch")
    r = _teragram("verify", str(idx))
    assert r.returncode == 1 and f"shards/000001/{name}" in r.stderr


def test_truncated_file_is_reported_by_name(real_index, tmp_path):
    idx = copytree(real_index, tmp_path / "i")
    p = idx / "shards" / "000000" / "sa.bin"
    p.write_bytes(p.read_bytes()[:-100])
    (problem,) = verify(idx)
    assert "shards/000000/sa.bin" in problem and "truncated" in problem


def test_header_damage_is_reported(real_index, tmp_path):
    idx = copytree(real_index, tmp_path / "i")
    p = idx / "shards" / "000000" / "tokens.bin"
    data = bytearray(p.read_bytes())
    data[41] ^= 1  # the element count
    p.write_bytes(bytes(data))
    (problem,) = verify(idx)
    assert "shards/000000/tokens.bin" in problem and "header checksum" in problem


def test_suffix_order_check_catches_a_consistent_but_wrong_array(real_index, tmp_path):
    """A suffix array rewritten out of order, with the manifest updated to match, is still caught."""
    import json

    import numpy as np
    from teragram.index import format as fmt
    from teragram.index import packed

    idx = copytree(real_index, tmp_path / "i")
    sa = fmt.open_packed(idx / "shards/000000/sa.bin", "sa")
    vals = sa.to_numpy()
    vals[10:20] = vals[10:20][::-1].copy()
    fmt.write_packed(idx / "shards/000000/sa.bin", "sa", packed.pack(vals, sa.width), sa.width, sa.count)
    m = json.loads((idx / "manifest.json").read_text())
    for f in m["shards"][0]["files"]:
        if f["path"].endswith("sa.bin"):
            f.update(size=(idx / f["path"]).stat().st_size, blake2b=fmt.file_digest(idx / f["path"]))
    (idx / "manifest.json").write_text(json.dumps(m))
    problems = verify(idx, samples=100000)
    assert any("out of order" in p for p in problems)
    assert not np.array_equal(vals, fmt.open_packed(real_index / "shards/000000/sa.bin", "sa").to_numpy())


def test_a_kind_longer_than_its_header_field_is_refused(tmp_path):
    import numpy as np
    import pytest
    from teragram.index import format as fmt

    with pytest.raises(ValueError, match="over 16 bytes"):
        fmt.write_array(tmp_path / "x.bin", "out.cont_cache_0.05x", np.zeros(3, np.float32))
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary file
    fmt.write_array(tmp_path / "x.bin", "sixteen-bytes-ok", np.zeros(3, np.float32))
    assert fmt.open_array(tmp_path / "x.bin", "sixteen-bytes-ok").shape == (3,)
