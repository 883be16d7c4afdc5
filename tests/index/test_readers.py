import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from teragram.index.errors import BuildError
from teragram.index.readers import Doc, Skip, read_file, walk


def _items(path):
    return list(read_file(path))


def test_plain_gz_zst_round_trip(tmp_path):
    text = "int main(void)\n{\n\treturn 0;\n}\n"
    (tmp_path / "a.c").write_text(text)
    (tmp_path / "b.c.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "c.c.zst").write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    for name in ("a.c", "b.c.gz", "c.c.zst"):
        assert _items(tmp_path / name) == [Doc(str(tmp_path / name), 0, text)]


def test_jsonl_records_and_bad_lines(tmp_path):
    lines = [
        json.dumps({"text": "first"}),
        "{not json",
        json.dumps({"id": 3}),
        "",
        json.dumps({"text": "  "}),
        json.dumps({"text": "last"}),
    ]
    p = tmp_path / "x.jsonl.gz"
    p.write_bytes(gzip.compress("\n".join(lines).encode()))
    items = _items(p)
    assert [i.text for i in items if isinstance(i, Doc)] == ["first", "last"]
    assert sorted(i.reason for i in items if isinstance(i, Skip)) == ["bad-json", "empty", "no-text-field"]
    assert [i.record for i in items] == [0, 1, 2, 4, 5]


def test_jsonl_zst(tmp_path):
    p = tmp_path / "x.jsonl.zst"
    p.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "a"}\n{"text": "b"}\n'))
    assert [i.text for i in _items(p)] == ["a", "b"]


def test_parquet_and_corrupt_parquet(tmp_path):
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["alpha", "beta", None], "id": [1, 2, 3]}), p)
    items = _items(p)
    assert [i.text for i in items if isinstance(i, Doc)] == ["alpha", "beta"]
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(p.read_bytes()[:-40])  # footer cut off
    (item,) = _items(bad)
    assert isinstance(item, Skip) and item.reason.startswith("corrupt-parquet")


def test_binary_invalid_empty(tmp_path):
    (tmp_path / "bin").write_bytes(b"ELF\x00\x01")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("\n\n")
    reasons = {p.name: _items(p)[0].reason for p in tmp_path.iterdir()}
    assert reasons == {"bin": "binary", "latin1.txt": "invalid-utf8", "empty.txt": "empty"}


def test_truncated_gzip_is_a_counted_skip(tmp_path):
    p = tmp_path / "t.txt.gz"
    p.write_bytes(gzip.compress(b"hello world " * 1000)[:-30])
    (item,) = _items(p)
    assert isinstance(item, Skip) and item.reason.startswith("unreadable")


def test_walk_sorted_recursive_and_missing(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("x")
    (tmp_path / "a.txt").write_text("x")
    assert [p.relative_to(tmp_path).as_posix() for p in walk([str(tmp_path)])] == ["a.txt", "b/2.txt"]
    with pytest.raises(BuildError, match="input not found"):
        walk([str(tmp_path / "nope")])
