"""Held-out features (`teragram features IDX --corpus`) of documents longer than a run, written in
pieces of at most HELD_OUT_CHUNK rows (index/heldout.py): the files of the documents read whole,
byte for byte, also after an interruption and a rerun; no run computes more rows than that."""

from __future__ import annotations

import numpy as np
import pytest
from teragram.index import format as fmt
from teragram.index import heldout
from teragram.index.engine import Index
from teragram.index.features import FeatureConfig

from tests.conftest import real_texts


def _files(d) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != "features-report.json"}


@pytest.mark.parametrize("max_len", [64, 255])
def test_long_documents_in_pieces_are_the_documents_read_whole(real_index, tmp_path, monkeypatch, max_len):
    """Indexed text copied whole (matches of hundreds of tokens, longer than a piece: the cap
    of 255 reaches back over several pieces) between new text, and short documents around it."""
    idx = Index(real_index)
    texts = [t for _, t in real_texts(8, 3000)]
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text(texts[0][:300])
    (text / "b.txt").write_text("Nothing here was indexed: qzx vvk jjq. " + texts[3] + " " + texts[5][:1500] + " zzq kkv.")
    (text / "c.txt").write_text(texts[6][:200])
    n_long = len(idx.tokenize((text / "b.txt").read_text()))
    cfg = FeatureConfig("held-out", max_len, 3)
    monkeypatch.setattr(heldout, "HELD_OUT_CHUNK", 1 << 30)
    heldout.compute_held_out(idx, tmp_path / "whole", cfg, [str(text)])
    rows = []
    compute = heldout.held_out_features

    def counted(i, docs, c, threads=1):
        rows.append(sum(len(d) + 1 for d in docs))
        return compute(i, docs, c, threads)

    monkeypatch.setattr(heldout, "HELD_OUT_CHUNK", 100)
    monkeypatch.setattr(heldout, "held_out_features", counted)
    heldout.compute_held_out(idx, tmp_path / "pieces", cfg, [str(text)])
    assert _files(tmp_path / "pieces") == _files(tmp_path / "whole")
    assert (
        n_long > 1000 and len(rows) > 10 and max(rows) <= 100 + max_len + 1
    )  # a piece reads back at most its carried match (and its separator row)
    L = np.asarray(fmt.open_array(tmp_path / "whole" / "000000" / "length.bin", "feat.length"))
    assert (L == max_len).sum() > 100  # matches as long as the cap, across pieces

    calls = []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return counted(*a, **kw)

    monkeypatch.setattr(heldout, "held_out_features", interrupted)
    with pytest.raises(KeyboardInterrupt):
        heldout.compute_held_out(idx, tmp_path / "again", cfg, [str(text)])
    heldout.compute_held_out(idx, tmp_path / "again", cfg, [str(text)])
    assert _files(tmp_path / "again") == _files(tmp_path / "whole")
