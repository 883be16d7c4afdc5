"""An index built with a Hugging Face tokenizer: a byte-level BPE trained with `tokenizers` on the
embedded corpus inside the test (nothing downloaded). Its documents are the tokenizers library's own
encoding of each text (special tokens' text included), it answers every query as an index built
from the same ids does, as brute force and as infini-gram on those ids; a tokenizer that does not
round-trip is named in one line with the share of documents; a model directory's
tokenizer_config.json names the EOS."""

import hashlib
import json
import shutil

import numpy as np
import pytest
from teragram.builder import cli as build_cli
from teragram.builder.build import BuildConfig, build, build_from_ids
from teragram.index import readers
from teragram.index import tokenizer as tok_mod
from teragram.index.engine import Index
from teragram.index.errors import BuildError
from teragram.model.training.shards import documents
from tokenizers import Tokenizer

from tests.conftest import real_texts, train_bpe
from tests.oracle import Oracle, infinigram_engine

SPECIAL_DOC = "<|endoftext|>A document that writes <|endoftext|> out, twice:<|endoftext|>"


def _docs(idx: Index) -> list[np.ndarray]:
    return [d.astype(np.int64) for d in documents(idx)]


@pytest.fixture(scope="module")
def hf_corpus(tmp_path_factory, corpus_dir):
    """The small real corpus, plus a document that writes the EOS token's text out."""
    d = tmp_path_factory.mktemp("hf-corpus")
    for p in corpus_dir.iterdir():
        shutil.copy(p, d / p.name)
    (d / "special.txt").write_text(SPECIAL_DOC)
    return d


@pytest.fixture(scope="module")
def hf_index(tmp_path_factory, hf_corpus, hf_tokenizer):
    out = tmp_path_factory.mktemp("hf-idx") / "idx"
    build(BuildConfig(inputs=(str(hf_corpus),), out=str(out), tokenizer=str(hf_tokenizer), shard_tokens=40000, workers=1, progress=False))
    return Index(out)


def _texts(corpus) -> list[str]:
    """The readable documents' texts, in the build's order."""
    return [item.text for f in readers.walk([str(corpus)]) for item in readers.read_file(f) if isinstance(item, readers.Doc)]


def test_documents_are_the_tokenizers_encoding(hf_index, hf_corpus, hf_tokenizer):
    hf = Tokenizer.from_file(str(hf_tokenizer))
    texts = _texts(hf_corpus)
    docs = _docs(hf_index)
    assert len(hf_index.shards) >= 3 and len(docs) == len(texts)
    eos = hf.token_to_id("<|endoftext|>")
    assert hf_index.eos_id == eos
    for d, text in zip(docs, texts):
        assert d.tolist() == _plain_ids(hf, text)
        assert hf_index.decode(d) == text
        assert eos not in d  # a special token's text is text: no document holds EOS, its end is the separator
    special = docs[texts.index(SPECIAL_DOC)]
    assert hf_index.ntd(special.tolist()).result_by_token_id.keys() == {eos}  # its end is reported as EOS
    m = hf_index.manifest
    data = hf_tokenizer.read_bytes()
    assert (hf_index.path / "tokenizer.json").read_bytes() == data and not (hf_index.path / "tokenizer.model").exists()
    tk = m["tokenizer"]
    assert (tk["kind"], tk["digest"], tk["file"]["path"]) == ("hf", hashlib.blake2b(data, digest_size=16).hexdigest(), "tokenizer.json")
    assert tk["digest"] == hf_index.tokenizer.digest == tok_mod.digest(hf_tokenizer) and tk["vocab_size"] == hf.get_vocab_size() == 2000
    assert m["format_version"] == 2 and m["token_dtype"] == "uint16" and m["separator"] == 0xFFFF
    assert tk["round_trip"] == {"docs": len(texts), "failed": 0, "example": None}
    assert hf_index.tokenize(texts[0][:200]) == _plain_ids(hf, texts[0][:200])
    assert hf_index.piece(int(docs[0][0])) == hf.id_to_token(int(docs[0][0]))


def _plain_ids(hf: Tokenizer, text: str) -> list[int]:
    """The tokenizers library's plain encoding: no special tokens added, a special token's text
    encoded as text (its encode_special_tokens)."""
    hf.encode_special_tokens = True
    return hf.encode(text, add_special_tokens=False).ids


def test_worker_processes_write_the_same_tokens(hf_index, hf_corpus, hf_tokenizer, tmp_path):
    """Encoded by a pool of two worker processes: the same token files as in one process."""
    build(
        BuildConfig(
            inputs=(str(hf_corpus),), out=str(tmp_path / "w2"), tokenizer=str(hf_tokenizer), shard_tokens=40000, workers=2, progress=False
        )
    )
    two = Index(tmp_path / "w2")
    assert [s["files"] for s in two.manifest["shards"]] == [s["files"] for s in hf_index.manifest["shards"]]


def _queries(rng, docs, n, vocab):
    qs = []
    for i in range(n):
        d = docs[rng.integers(len(docs))]
        m = int(rng.integers(1, 24))
        p = int(rng.integers(0, max(1, len(d) - m + 1)))
        q = d[p : p + m].copy()
        if i % 4 == 1 and len(q):
            q[rng.integers(len(q))] = rng.integers(0, vocab)
        elif i % 4 == 2:
            q = rng.integers(0, vocab, size=m)
        qs.append([int(x) for x in q])
    return qs + [[]]


def test_every_query_equals_the_index_of_the_same_ids(hf_index, hf_tokenizer, tmp_path):
    """The same documents' ids given to the builder (one shard instead of several): every query's
    answer is the same; counts and next tokens are brute force's, and infini-gram's on the ids."""
    docs = _docs(hf_index)
    build_from_ids(docs, tmp_path / "ids", hf_tokenizer)
    ids = Index(tmp_path / "ids")
    assert len(ids.shards) == 1 and ids.manifest["tokenizer"] == {
        k: v for k, v in hf_index.manifest["tokenizer"].items() if k != "round_trip"
    }
    orc = Oracle(docs, hf_index.eos_id)
    ig = infinigram_engine(docs, tmp_path / "ig", hf_index.eos_id)
    rng = np.random.default_rng(5)
    for q in _queries(rng, docs, 150, hf_index.vocab_size):
        c = int(rng.integers(0, hf_index.vocab_size)) if rng.random() < 0.3 else int(docs[0][0])
        for op in ("count", "ntd", "infgram_ntd"):
            assert getattr(hf_index, op)(q) == getattr(ids, op)(q), (op, q)
        for op in ("prob", "infgram_prob"):
            assert getattr(hf_index, op)(q, c) == getattr(ids, op)(q, c), (op, q)
        assert hf_index.count(q).count == orc.count(q) and {
            t: n for t, (n, _) in hf_index.ntd(q).result_by_token_id.items()
        } == orc.next_tokens(q)
        if q:
            assert hf_index.count(q).to_json() == ig.count(q) and hf_index.infgram_prob(q, c).to_json() == ig.infgram_prob(q, c), q
            assert hf_index.longest_match(q) == ids.longest_match(q)
            a, b = hf_index.docs(q, max=4), ids.docs(q, max=4)
            assert a.count == b.count and [(h.doc_id, h.snippet) for h in a.docs] == [(h.doc_id, h.snippet) for h in b.docs]
    cnf = [[docs[2][:2].tolist(), docs[5][3:4].tolist()], [docs[2][2:3].tolist()]]
    assert hf_index.count_cnf(cnf) == ids.count_cnf(cnf)
    s = docs[4][:60]
    a, b = hf_index.score(s, top_k=3), ids.score(s, top_k=3)
    for name in ("length", "cont", "count", "topk_ids", "topk_cnt"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_a_tokenizer_that_does_not_round_trip_is_named_in_one_line(tmp_path, capsys):
    """A lowercasing tokenizer: a warning (the build goes on) naming it, with the documents whose
    text has an upper-case letter (every document is in the sample) as the share affected."""
    lower = train_bpe((t for _, t in real_texts(10)), 400, tmp_path / "lower" / "tokenizer.json", lowercase=True)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, (_, t) in enumerate(real_texts(6, 3000)):
        (corpus / f"{i}.txt").write_text(t.lower() if i % 3 == 0 else t)
    rc = build_cli.main([str(corpus), "--out", str(tmp_path / "idx"), "--tokenizer", str(lower), "--workers", "1", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    texts = _texts(corpus)
    failed = sum(t.lower() != t for t in texts)
    assert rc == 0 and 0 < failed < len(texts) and len(err) == 1
    assert err[0].startswith(f"build-index: warning: tokenizer {lower} does not round-trip")
    assert f"{failed:,} of {len(texts):,} sampled documents ({100 * failed / len(texts):.1f}%" in err[0]
    assert Index(tmp_path / "idx").manifest["tokenizer"]["round_trip"]["failed"] == failed


def test_sentencepiece_indexes_record_kind_digest_and_round_trip(real_index):
    tk = Index(real_index).manifest["tokenizer"]
    assert tk["kind"] == "sentencepiece" and tk["digest"] == tk["file"]["blake2b"] == tok_mod.digest(real_index / "tokenizer.model")
    assert tk["round_trip"]["failed"] == 0 and tk["round_trip"]["docs"] > 0


def test_a_model_directory_names_its_eos(tmp_path):
    """tokenizer_config.json's eos_token, else a special token named like an EOS, else an id past
    the vocabulary; a directory and its tokenizer.json have one digest."""
    texts = [t for _, t in real_texts(5)]
    path = train_bpe(texts, 300, tmp_path / "m" / "tokenizer.json", special=("<|endoftext|>", "<|im_end|>"))
    hf = Tokenizer.from_file(str(path))
    assert tok_mod.load(path).eos_id == hf.token_to_id("<|endoftext|>")
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert tok_mod.load(path.parent).eos_id == hf.token_to_id("<|im_end|>") and tok_mod.digest(path.parent) == tok_mod.digest(path)
    build_from_ids([np.array([5, 6, 7])], tmp_path / "idx", path.parent)
    assert Index(tmp_path / "idx").eos_id == hf.token_to_id("<|im_end|>")
    bare = train_bpe(texts, 300, tmp_path / "bare" / "tokenizer.json", special=("<pad>",))
    assert tok_mod.load(bare).eos_id == 300


def test_bad_tokenizers_are_one_line_errors(hf_corpus, tmp_path, capsys):
    (tmp_path / "not.json").write_text('{"version": "1.0", "model": 3}')
    (tmp_path / "empty").mkdir()
    for bad, msg in ((tmp_path / "not.json", "not a Hugging Face tokenizer.json"), (tmp_path / "empty", "without tokenizer.json")):
        with pytest.raises(BuildError, match=msg):
            tok_mod.load(bad)
        assert build_cli.main([str(hf_corpus), "--out", str(tmp_path / "o"), "--tokenizer", str(bad), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("build-index: error:") and msg in err[0]
