"""Token widths: an index of a vocabulary over 65,535 ids holds uint32 tokens and answers every
query as brute force does, across shards (queries, scoring, bulk estimates, the builder's
features, held-out features; AND/OR queries as a 16-bit index of the same text); an index of
format version 1 still opens. (infini-gram's u32 indexer is no oracle here: it allocates 32 GiB.)"""

import struct
import zlib

import numpy as np
import pytest
from teragram.builder.build import build_from_ids
from teragram.builder.features import compute_features
from teragram.index import contexts
from teragram.index import format as fmt
from teragram.index.bulk import continuations
from teragram.index.engine import Index
from teragram.index.features import FeatureConfig, open_features
from teragram.index.heldout import compute_held_out

from tests.oracle import Oracle

VOCAB = 70_000  # words w0..w69999, then <|endoftext|>: 70,001 ids
ALPHABET = [5, 65_533, 65_534, 65_535, 65_536, 65_537, 69_999]  # around the 16-bit separator (65,535)


def word_tokenizer(path):
    """A word-level tokenizer (`tokenizers`) of VOCAB words "w<id>" and an EOS: text "w65536 w7" is ids [65536, 7]."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Random documents over ALPHABET (n-grams repeat a lot) in 5 or more shards, with long repeats across shards."""
    rng = np.random.default_rng(29)
    alphabet = np.array(ALPHABET)
    docs = [alphabet[rng.integers(0, len(alphabet), size=int(rng.integers(1, 60)))] for _ in range(100)]
    docs += [np.concatenate([docs[3], docs[4]]), docs[9][:40].copy()]
    root = tmp_path_factory.mktemp("wide")
    tok = word_tokenizer(root / "tok" / "tokenizer.json")
    with pytest.MonkeyPatch.context() as mp:  # the frequent contexts' stored histograms in use (index/contexts.py)
        mp.setattr(contexts, "MIN_COUNT", 2)
        build_from_ids(docs, root / "idx", tok, shard_tokens=700)
    idx = Index(root / "idx")
    return idx, Oracle(docs, idx.eos_id), docs, root


def _queries(rng, orc, n):
    qs = []
    for i in range(n):
        d = orc.docs[rng.integers(len(orc.docs))]
        m = int(rng.integers(1, 34))
        p = int(rng.integers(0, max(1, len(d) - m + 1)))
        q = d[p : p + m].copy()
        if i % 4 == 1 and len(q):
            q[rng.integers(len(q))] = rng.integers(0, VOCAB)
        elif i % 4 == 2:
            q = rng.choice(ALPHABET + [1, 65_538], size=m)
        qs.append([int(x) for x in q])
    return qs


def test_a_large_vocabulary_makes_a_u32_index(wide):
    idx, _, docs, _ = wide
    m = idx.manifest
    assert (m["token_dtype"], m["separator"], m["tokenizer"]["vocab_size"], m["tokenizer"]["kind"]) == (
        "uint32",
        2**32 - 1,
        VOCAB + 1,
        "hf",
    )
    assert len(idx.shards) >= 5 and all(s.tok.dtype == np.uint32 for s in idx.shards)
    assert fmt.read_header(idx.shards[0].dir / "tokens.bin").width == 32 and "contexts" in m
    assert idx.eos_id == VOCAB and idx.decode([65_536, 7]) == "w65536 w7" and idx.tokenize("w65535 w69999") == [65_535, 69_999]


def test_every_query_against_brute_force(wide):
    idx, orc, docs, root = wide
    rng = np.random.default_rng(31)
    queries = _queries(rng, orc, 100)
    for q in queries + [[]]:
        c = int(rng.choice(ALPHABET)) if rng.random() < 0.8 else int(rng.integers(0, VOCAB))
        assert idx.count(q).count == orc.count(q), q
        r = idx.prob(q, c)
        assert (r.prompt_cnt, r.cont_cnt, r.prob) == pytest.approx(orc.prob(q, c)), q
        assert {t: n for t, (n, _) in idx.ntd(q).result_by_token_id.items()} == orc.next_tokens(q), q
        sl = orc.suffix_len(q)
        inn = idx.infgram_ntd(q)
        assert inn.suffix_len == sl and {t: n for t, (n, _) in inn.result_by_token_id.items()} == orc.next_tokens(q[len(q) - sl :]), q
        if q:
            ip = idx.infgram_prob(q, c)
            assert ip.suffix_len == sl and (ip.prompt_cnt, ip.cont_cnt) == orc.prob(q[len(q) - sl :], c)[:2], q
            lm = idx.longest_match(q)
            assert (lm.length, lm.cont, lm.count) == orc.feature_at(q, len(q) - 1, len(q), 1)[:3], q
            assert [h.doc_id for h in idx.docs(q, max=5).docs] == sorted({d for d, _ in orc.occurrences(q)})[:5], q
    assert max(orc.suffix_len(q) for q in queries) >= 30


def test_cnf_queries_equal_those_of_a_u16_index_of_the_same_text(wide, tokenizer_model):
    """AND/OR queries against a 16-bit index of the same documents, their ids mapped in order to
    small ones (the same shards; tests/index/test_cnf.py holds 16-bit CNF to infini-gram's)."""
    idx, orc, docs, root = wide
    small = {a: 10 + i for i, a in enumerate(sorted(ALPHABET))}
    build_from_ids([np.array([small[int(x)] for x in d]) for d in docs], root / "u16", tokenizer_model, shard_tokens=700)
    u16 = Index(root / "u16")
    assert u16.manifest["token_dtype"] == "uint16" and len(u16.shards) == len(idx.shards)
    rng = np.random.default_rng(37)
    for _ in range(60):
        cnf = []
        for _ in range(int(rng.integers(1, 4))):
            terms = []
            for _ in range(int(rng.integers(1, 3))):
                d = orc.docs[rng.integers(len(orc.docs))]
                p = int(rng.integers(0, len(d)))
                terms.append([int(x) for x in d[p : p + int(rng.integers(1, 4))]])
            cnf.append(terms)
        mapped = [[[small[x] for x in t] for t in clause] for clause in cnf]
        assert idx.count_cnf(cnf) == u16.count_cnf(mapped), cnf
        a, b = idx.search_docs_cnf(cnf, maxnum=3), u16.search_docs_cnf(mapped, maxnum=3)
        assert a.count == b.count and [h.doc_id for h in a.docs] == [h.doc_id for h in b.docs], cnf


def _check_features(f, ids_of_doc, orc, max_len, k, allowed=None, none=None):
    """Stored or returned features of each document's positions against the per-position oracle."""
    for d, (ids, rows) in enumerate(ids_of_doc):
        for t in range(len(ids)):
            L, cont, cnt, top = orc.feature_at(ids, t, max_len, k, allowed(d, t) if allowed else None)
            r = rows + t
            got_cont = int(f.cont[r])
            got_top = [(int(a), int(b)) for a, b in zip(f.topk_ids[r], f.topk_cnt[r]) if int(a) not in (-1, none)]
            assert (int(f.length[r]), -1 if got_cont == none else got_cont, int(f.count[r]), got_top) == (L, cont, cnt, top), (d, t)


def test_scoring_and_bulk_estimates_across_shards(wide):
    idx, orc, docs, _ = wide
    rng = np.random.default_rng(41)
    e = docs[-2][:70].copy()  # a long match across shards, broken every 9 tokens
    e[::9] = rng.choice(ALPHABET, size=len(e[::9]))
    held = [docs[-2][:60], e, rng.choice(ALPHABET, size=30), docs[5][:25]]
    starts = np.cumsum([0] + [len(x) for x in held])
    for cap in (0, 3, 16):
        got = continuations(idx, np.concatenate(held), starts, (cap,), top_k=2)[cap]
        _check_features(got, [(h, int(starts[i])) for i, h in enumerate(held)], orc, cap or 10_000, 2)
    for h in held[:2]:
        r = idx.score(h, top_k=2, max_len=64)
        _check_features(r, [(h, 0)], orc, 64, 2)


@pytest.mark.parametrize("mode", ["causal", "exclude-doc"])
def test_the_builders_features(wide, tmp_path, mode):
    idx, orc, docs, _ = wide
    compute_features(idx.path, tmp_path / "f", FeatureConfig(mode=mode, max_len=64, top_k=2), progress=False)
    g = 0
    for s in idx.shards:
        f = open_features(tmp_path / "f" / f"{s.id:06d}", 2)
        st = np.asarray(s.starts, np.int64)
        for k in range(len(st) - 1):
            if k % 2:  # every other document (brute force is the slow part)
                g += 1
                continue
            if mode == "causal":
                allowed = lambda d, t, g=g: lambda dd, p, L: dd < g or (dd == g and p < t - L + 1)  # noqa: E731
            else:
                allowed = lambda d, t, g=g: lambda dd, p, L: dd != g  # noqa: E731
            _check_features(f, [(docs[g], int(st[k]))], orc, 64, 2, allowed=allowed, none=idx.sep)
            g += 1


def test_held_out_features_of_text(wide, tmp_path):
    """Held-out text tokenized with the index's tokenizer, its features against the whole index."""
    idx, orc, docs, _ = wide
    corpus = tmp_path / "held"
    corpus.mkdir()
    held = [docs[-1][:30], docs[7][::-1].copy(), np.array([65_535, 65_536, 65_535, 3])]
    for i, h in enumerate(held):
        (corpus / f"{i}.txt").write_text(" ".join(f"w{x}" for x in h))
    compute_held_out(idx, tmp_path / "f", FeatureConfig(max_len=64, top_k=2), [str(corpus)])
    tok = fmt.open_array(tmp_path / "f" / "000000" / "tokens.bin", "tokens")
    st = fmt.open_array(tmp_path / "f" / "000000" / "docs.bin", "docs").astype(np.int64)
    assert tok.dtype == np.uint32 and [tok[st[i] : st[i + 1] - 1].tolist() for i in range(len(held))] == [h.tolist() for h in held]
    f = open_features(tmp_path / "f" / "000000", 2)
    _check_features(f, [(h, int(st[i])) for i, h in enumerate(held)], orc, 64, 2, none=idx.sep)


def _as_version_1(root) -> None:
    """Rewrite an index as format version 1 wrote it: every binary header's version field, and a
    manifest without the tokenizer's kind and digest."""
    for p in root.rglob("*.bin"):
        with open(p, "r+b") as f:
            head = bytearray(f.read(fmt.HEADER_SIZE))
            if head[:8] != fmt.MAGIC:
                continue
            head[24:28] = struct.pack("<I", 1)
            head[60:64] = struct.pack("<I", zlib.crc32(bytes(head[:60])))
            f.seek(0)
            f.write(head)
    m = fmt.read_json(root / "manifest.json")
    m["format_version"] = 1
    for k in ("kind", "digest", "round_trip"):
        m["tokenizer"].pop(k, None)
    fmt.write_json(root / "manifest.json", m)


def test_an_index_of_format_version_1_still_opens(real_index, tmp_path):
    import shutil

    shutil.copytree(real_index, tmp_path / "v1")
    _as_version_1(tmp_path / "v1")
    assert fmt.read_header(tmp_path / "v1" / "shards" / "000000" / "tokens.bin") is not None
    old, new = Index(tmp_path / "v1"), Index(real_index)
    assert old.manifest["format_version"] == 1 and old.manifest["tokenizer"]["kind"] == "sentencepiece"
    assert old.manifest["tokenizer"]["digest"] == new.manifest["tokenizer"]["digest"]
    docs = [np.asarray(s.tok[: s.starts[1] - 1]) for s in new.shards]
    for d in docs:
        q = d[:6].tolist()
        assert old.count(q) == new.count(q) and old.infgram_ntd(q) == new.infgram_ntd(q) and old.docs(q) == new.docs(q)
    assert old.tokenize("the kernel") == new.tokenize("the kernel")
