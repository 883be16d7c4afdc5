"""The decontamination rule against brute force: a held-out document is left out of evaluation
when at least 80% of its 13-grams occur in the index (infini-gram's criterion). The oracle is
the set of every 13-gram inside one indexed document (none spans a document boundary), read
straight from the shards' token streams, on fresh random ids and on real text from
data/default; then evaluation's use of the rule (mix_report's decontaminated figures)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from teragram.builder.build import build_from_ids
from teragram.index import features as ff
from teragram.index import format as fmt
from teragram.index.engine import Index
from teragram.index.errors import BuildError
from teragram.index.heldout import contamination, write_held_out
from teragram.model.evaluation.perplexity import EvalOptions, mix_report, summarize

from tests.conftest import DEFAULT, real_texts

N, SHARE = 13, 0.8  # infini-gram's criterion, stated here independently of the code


def _shard_docs(idx: Index) -> list[list[np.ndarray]]:
    """Per shard, its documents' ids in stream order."""
    out = []
    for s in idx.shards:
        tok, st = np.asarray(s.tok), np.asarray(s.starts)
        out.append([tok[st[k] : st[k + 1] - 1].astype(np.int64) for k in range(len(st) - 1)])
    return out


def _indexed_docs(idx: Index) -> list[np.ndarray]:
    return [d for shard in _shard_docs(idx) for d in shard]


def _wide(d: np.ndarray) -> bool:
    """A document over the wide alphabet (random_case's), not the two ids."""
    return len(set(d.tolist())) > 2


def _grams(docs: list[np.ndarray]) -> set[tuple[int, ...]]:
    return {tuple(d[i : i + N].tolist()) for d in docs for i in range(len(d) - N + 1)}


def _brute_share(doc: np.ndarray, grams: set) -> float:
    windows = [tuple(doc[i : i + N].tolist()) for i in range(len(doc) - N + 1)]
    return sum(w in grams for w in windows) / len(windows) if windows else 0.0


def _held_out(idx: Index, out: Path, docs: list[np.ndarray], max_len: int) -> Path:
    """A held-out features directory of `docs` (token ids) against idx, match lengths capped at max_len."""
    cfg = ff.FeatureConfig("held-out", max_len, 2)
    ident = ff.begin(idx.path, out, cfg, [])
    write_held_out(idx, out, cfg, [np.asarray(d, np.int64) for d in docs], [{} for _ in docs])
    ff.finish(out, ident, [fmt.read_json(out / "000000.done")], sum(len(d) + 1 for d in docs), {})
    return out


def _check(idx: Index, docs: list[np.ndarray], tmp: Path) -> np.ndarray:
    """contamination of docs, from stored lengths and scored against the index, equals brute force."""
    grams = _grams(_indexed_docs(idx))
    want = np.array([_brute_share(d, grams) for d in docs])
    stored = contamination(_held_out(idx, tmp / "h64", docs, 64))
    np.testing.assert_array_equal(stored, want)
    capped = _held_out(idx, tmp / "h8", docs, 8)  # lengths capped below 13: scored against the index
    np.testing.assert_array_equal(contamination(capped, idx.path), want)
    with pytest.raises(BuildError, match="give the index"):
        contamination(capped)
    return want


# ---- fresh random ids ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_case(tmp_path_factory, tokenizer_model):
    """An index of several shards: documents over two ids (so random held-out text over the
    same two ids has some but not all of its 13-grams there) and over 40 ids (where a 13-gram
    occurs only where it was copied); ids that no indexed document holds."""
    rng = np.random.default_rng(47)
    ids = rng.permutation(np.arange(3, 1000))
    binary, wide, fresh = ids[:2], ids[2:42], ids[42:]
    docs = [binary[rng.integers(0, 2, int(rng.integers(5, 200)))] for _ in range(80)]
    docs += [wide[rng.integers(0, 40, int(rng.integers(40, 90)))] for _ in range(40)]
    rng.shuffle(docs)
    out = tmp_path_factory.mktemp("heldout") / "idx"
    build_from_ids(docs, out, tokenizer_model, shard_tokens=700)
    idx = Index(out)
    assert len(idx.shards) >= 4
    return idx, binary, fresh


def test_contamination_of_random_ids_against_brute_force(random_case, tmp_path):
    idx, binary, fresh = random_case
    rng = np.random.default_rng(1)
    shards = _shard_docs(idx)
    a = next(d for d in shards[0] if _wide(d))  # in the first shard
    b = next(d for d in shards[-1] if _wide(d))  # and in the last
    pair = next((x, y) for s in shards for x, y in zip(s, s[1:]) if _wide(x) and _wide(y))  # adjacent in a shard
    docs = {
        "copy": a.copy(),
        "exactly 80%": np.concatenate([a[:20], fresh[:2]]),  # 10 13-grams, the last 2 hold a new id
        "4 of 5": np.concatenate([b[:16], fresh[:1]]),
        "7 of 9": np.concatenate([b[5:24], fresh[:2]]),
        "81.8%: 9 of 11": np.concatenate([a[:21], fresh[:2]]),
        "two shards": np.concatenate([a[:20], b[-20:]]),  # 8 + 8 of 28 13-grams, none across the join
        "across a document boundary": np.concatenate([pair[0][-12:], pair[1][:12]]),
        "one new id in ten": np.where(np.arange(len(b)) % 10 == 9, fresh[0], b),
        "12 tokens": a[:12].copy(),
        "13 tokens": a[:13].copy(),
        "1 token": a[:1].copy(),
    }
    docs |= {f"random over two ids {i}": binary[rng.integers(0, 2, int(rng.integers(14, 40)))] for i in range(30)}
    share = dict(zip(docs, _check(idx, list(docs.values()), tmp_path), strict=True))
    assert share["copy"] == share["13 tokens"] == 1.0
    assert share["exactly 80%"] == 0.8 and share["4 of 5"] == 0.8 and share["7 of 9"] == 7 / 9
    assert share["81.8%: 9 of 11"] == 9 / 11 and share["two shards"] == 16 / 28 and share["across a document boundary"] == 0.0
    assert share["12 tokens"] == share["1 token"] == 0.0
    binary_shares = [v for name, v in share.items() if name.startswith("random")]
    assert min(binary_shares) < SHARE <= max(binary_shares)  # both sides of the threshold


# ---- real text ----------------------------------------------------------------------------------


def _heldout_texts(n: int) -> list[str]:
    """Real held-out documents of the embedded corpus (never indexed here)."""
    paths = sorted((DEFAULT / "heldout").rglob("*.rst.gz"))[:n]
    return [gzip.open(p, "rt", encoding="utf-8").read()[:3000] for p in paths]


def test_contamination_of_real_text_against_brute_force(real_index, tmp_path):
    """Copies, partial copies, text across two indexed documents' boundary, the corpus's own
    held-out documents and very short ones, tokenized as evaluation tokenizes them."""
    idx = Index(real_index)
    texts = [t for _, t in real_texts(8, 1500)]
    mixed = []
    for i, t in enumerate(texts[:4]):
        words = t.split(" ")
        mixed.append(" ".join(w.upper() if j % (3 + i) == 0 else w for j, w in enumerate(words)))
    strings = [texts[1][:800], texts[2][100:700] + " " + _heldout_texts(1)[0][:400], *mixed]
    strings += [texts[5][-300:] + texts[6][:300], "The kernel", *_heldout_texts(6)]
    docs = [np.asarray(idx.tokenizer.encode(s), np.int64) for s in strings]
    x, y = next((x, y) for s in _shard_docs(idx) for x, y in zip(s, s[1:]) if len(x) >= 30 and len(y) >= 30)
    docs.append(np.concatenate([x[-30:], y[:30]]))  # ids across a document boundary: at most 36 of 48
    share = _check(idx, docs, tmp_path)
    assert share[0] >= SHARE and share[-1] < SHARE and share[len(strings) - 7] == 0.0  # a copy, the boundary, "The kernel"
    assert (share < SHARE).sum() >= 6


# ---- its use in evaluation ----------------------------------------------------------------------


def test_evaluation_leaves_out_exactly_the_contaminated_documents(random_case, tmp_path):
    """mix_report with decontaminate: every figure (tokens, loss, bytes) over the documents
    whose brute-force share is below 80% and no other, the 80% document left out."""
    idx, binary, fresh = random_case
    rng = np.random.default_rng(2)
    wide = [d for d in _indexed_docs(idx) if _wide(d)]
    docs = [np.concatenate([wide[0][:20], fresh[:2]]), np.concatenate([wide[1][:19], fresh[:2]]), wide[2][:9].copy()]
    docs += [binary[rng.integers(0, 2, int(rng.integers(14, 40)))] for _ in range(20)]
    held = _held_out(idx, tmp_path / "held", docs, 64)
    grams = _grams(_indexed_docs(idx))
    keep = np.array([_brute_share(d, grams) < SHARE for d in docs])
    assert list(keep[:3]) == [False, True, True] and keep[3:].any() and not keep[3:].all()
    doc = np.concatenate([np.full(len(d) + 1, k) for k, d in enumerate(docs)])  # each document's targets, EOS included
    r = {"nll": rng.exponential(2.0, len(doc)), "doc": doc.astype(np.int32)}
    per_doc = rng.integers(10, 500, len(docs))
    got, fitted = mix_report(r, per_doc, idx.path, held, EvalOptions(decontaminate=True))
    rows = keep[doc]
    assert fitted is None and got["decontaminated"] == {"dropped_docs": int((~keep).sum()), "docs": len(docs)}
    assert got["tokens"] == sum(len(d) + 1 for d, k in zip(docs, keep, strict=True) if k) == rows.sum()
    assert got["bytes"] == per_doc[keep].sum()
    assert got["loss"] == pytest.approx(r["nll"][rows].mean(), rel=1e-12)
    assert {k: v for k, v in got.items() if k not in ("decontaminated", "stages_s")} == summarize(r["nll"][rows], int(per_doc[keep].sum()))
    everything, _ = mix_report(r, per_doc, idx.path, held, EvalOptions())
    assert "decontaminated" not in everything and everything["tokens"] == len(doc)


def test_held_out_features_over_other_shardings_and_orders(tmp_path, tokenizer_model):
    """The same documents indexed in one shard, in several, and in another order: held-out
    features are equal but for cont, the continuation of the most recent occurrence, which
    follows the order of the index's documents (what benchmarks/heldout_speed checks)."""
    from teragram.index.heldout import held_out_features

    rng = np.random.default_rng(3)
    alphabet = rng.choice(np.arange(3, 1000), 12, replace=False)
    docs = [alphabet[rng.integers(0, 12, int(rng.integers(5, 200)))] for _ in range(60)]
    made = {}
    for name, order, shard_tokens in (("one", docs, 1 << 20), ("several", docs, 1500), ("reversed", docs[::-1], 1500)):
        build_from_ids(order, tmp_path / name, tokenizer_model, shard_tokens=shard_tokens)
        made[name] = Index(tmp_path / name)
    assert len(made["one"].shards) == 1 and len(made["several"].shards) >= 3
    held = [alphabet[rng.integers(0, 12, 150)] for _ in range(6)]
    cfg = ff.FeatureConfig("held-out", 64, 4)
    got = {n: held_out_features(idx, held, cfg) for n, idx in made.items()}
    for name in ff.FIELDS:
        a, b, c = (getattr(got[n], name) for n in ("one", "several", "reversed"))
        assert np.array_equal(a, b), name  # same order, other sharding: every field
        assert np.array_equal(a, c) == (name != "cont"), name  # other order: all but cont
