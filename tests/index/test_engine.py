import numpy as np
import pytest
from teragram.builder.build import build_from_ids
from teragram.index import contexts
from teragram.index.engine import Index
from teragram.index.errors import QueryError

from tests.conftest import random_docs
from tests.oracle import Oracle


@pytest.fixture(scope="module")
def random_index(tmp_path_factory, tokenizer_model):
    docs = random_docs(np.random.default_rng(7), 120, 6, 60, 1000)
    out = tmp_path_factory.mktemp("rnd") / "idx"
    with pytest.MonkeyPatch.context() as mp:  # the frequent contexts' stored histograms in use (index/contexts.py)
        mp.setattr(contexts, "MIN_COUNT", 2)
        build_from_ids(docs, out, tokenizer_model, shard_tokens=900)
    idx = Index(out)
    assert len(idx.shards) >= 3
    return idx, Oracle(docs, idx.eos_id)


def _docs(idx):
    out = []
    for s in idx.shards:
        tok, st = np.asarray(s.tok), np.asarray(s.starts)
        out += [tok[st[k] : st[k + 1] - 1].astype(np.int64) for k in range(len(st) - 1)]
    return out


@pytest.fixture(scope="module")
def real(real_index):
    idx = Index(real_index)
    return idx, Oracle(_docs(idx), idx.eos_id)


def _queries(rng, oracle, n, vocab, max_len=12):
    """n-grams sampled from the corpus, perturbed ones, and absent ones."""
    qs = []
    for i in range(n):
        d = oracle.docs[rng.integers(len(oracle.docs))]
        m = int(rng.integers(1, max_len))
        p = int(rng.integers(0, max(1, len(d) - m + 1)))
        q = d[p : p + m].copy()
        if i % 4 == 1 and len(q):
            q[rng.integers(len(q))] = rng.integers(3, vocab)
        elif i % 4 == 2:
            q = rng.integers(3, vocab, size=m)
        qs.append([int(x) for x in q])
    return qs + [[]]


def _ntd_counts(r):
    return {t: c for t, (c, _) in r.result_by_token_id.items()}


@pytest.mark.parametrize("which", ["random_index", "real"])
def test_ops_against_brute_force(which, request):
    idx, orc = request.getfixturevalue(which)
    rng = np.random.default_rng(3)
    for q in _queries(rng, orc, 150, idx.vocab_size):
        assert idx.count(q).count == orc.count(q), q
        c = int(rng.integers(3, idx.vocab_size)) if rng.random() < 0.3 else int(orc.docs[0][0])
        r = idx.prob(q, c)
        assert (r.prompt_cnt, r.cont_cnt, r.prob) == pytest.approx(orc.prob(q, c)), q
        n = idx.ntd(q)
        assert _ntd_counts(n) == orc.next_tokens(q) and n.prompt_cnt == orc.count(q) and not n.approx
        if n.prompt_cnt:
            assert sum(p for _, p in n.result_by_token_id.values()) == pytest.approx(1.0)
        sl = orc.suffix_len(q)
        ip = idx.infgram_prob(q, c)
        assert ip.suffix_len == sl and (ip.prompt_cnt, ip.cont_cnt) == orc.prob(q[len(q) - sl :], c)[:2]
        inn = idx.infgram_ntd(q)
        assert inn.suffix_len == sl and _ntd_counts(inn) == orc.next_tokens(q[len(q) - sl :])
        if q:
            lm = idx.longest_match(q)
            (L, cont, cnt, _) = orc.feature_at(q, len(q) - 1, len(q), 1)
            assert (lm.length, lm.cont, lm.count) == (L, cont, cnt)


@pytest.mark.parametrize("which", ["random_index", "real"])
def test_score_against_brute_force(which, request):
    idx, orc = request.getfixturevalue(which)
    rng = np.random.default_rng(5)
    # a document from the index, a perturbed copy, and random ids: held-out-like text
    d = orc.docs[3][:80].copy()
    e = d.copy()
    e[::7] = rng.integers(3, idx.vocab_size, size=len(e[::7]))
    f = rng.integers(3, idx.vocab_size, size=40)
    g = d[:30].copy()
    g[9] = idx.eos_id  # EOS inside the text: a document's end
    for ids in (d, e, f, g):
        for max_len in (64, 5):
            r = idx.score(ids, top_k=3, max_len=max_len, targets=True)
            for t, (L, cont, cnt, top) in enumerate(orc.features(ids, max_len, 3)):
                assert (r.length[t], r.cont[t], r.count[t]) == (L, cont, cnt), (t, max_len)
                nxt = int(ids[t + 1]) if t + 1 < len(ids) else orc.eos
                assert r.target_cnt[t] == orc.next_tokens(ids[t - L + 1 : t + 1] if L else []).get(nxt, 0)
                assert [(int(a), int(b)) for a, b in zip(r.topk_ids[t], r.topk_cnt[t]) if a >= 0] == top, t


def _check_bulk(got: dict, docs: list, starts: np.ndarray, orc, k: int) -> None:
    """Bulk features per cap (continuations) against the per-position oracle: match length, most
    recent continuation, count, how often the next token follows, top k."""
    for cap, r in got.items():
        for d, ids in enumerate(docs):
            for t, (L, cont, cnt, top) in enumerate(orc.features(ids, cap if cap else len(ids) + 1, k)):
                p = starts[d] + t
                nxt = int(ids[t + 1]) if t + 1 < len(ids) else orc.eos
                assert (r.length[p], r.cont[p], r.count[p]) == (L, cont, cnt), (cap, d, t)
                assert r.target_cnt[p] == orc.next_tokens(ids[t - L + 1 : t + 1] if L else []).get(nxt, 0), (cap, d, t)
                assert [(int(a), int(b)) for a, b in zip(r.topk_ids[p], r.topk_cnt[p]) if a >= 0] == top, (cap, d, t)


@pytest.mark.parametrize("which", ["random_index", "real"])
def test_bulk_features_against_brute_force(which, request):
    """Many documents at once, several caps, one or two threads: the per-position oracle's
    features (match length, most recent continuation, count, top 3) and how often the next
    token follows."""
    from teragram.index.bulk import continuations

    idx, orc = request.getfixturevalue(which)
    rng = np.random.default_rng(11)
    d = orc.docs[3][:80].copy()
    e = d.copy()
    e[::7] = rng.integers(3, idx.vocab_size, size=len(e[::7]))
    docs = [d, e, rng.integers(3, idx.vocab_size, size=40), np.zeros(0, np.int64), orc.docs[5][:30], d[:20].copy()]
    docs[-1][4] = idx.eos_id  # EOS inside the text: a document's end
    starts = np.cumsum([0] + [len(x) for x in docs])
    for threads in (1, 2):
        got = continuations(idx, np.concatenate(docs), starts, (0, 1, 3, 16), top_k=3, threads=threads)
        _check_bulk(got, docs, starts, orc, 3)


def test_docs_returns_matching_documents(real):
    idx, orc = real
    q = [int(x) for x in orc.docs[2][5:9]]
    r = idx.docs(q, max=5)
    assert r.count == orc.count(q)
    occ_docs = sorted({d for d, _ in orc.occurrences(q)})
    assert [h.doc_id for h in r.docs] == occ_docs[:5]
    for h in r.docs:
        assert h.metadata["source"] and idx.decode(q) in h.snippet


def test_query_errors(random_index):
    idx, _ = random_index
    with pytest.raises(QueryError, match="outside the vocabulary"):
        idx.count([1, idx.vocab_size])
    with pytest.raises(QueryError, match="outside the vocabulary"):
        idx.count([-1])
    with pytest.raises(QueryError, match="must not be empty"):
        idx.longest_match([])
    with pytest.raises(QueryError, match="must not be empty"):
        idx.docs([])
    with pytest.raises(QueryError, match="integer"):
        idx.prob([1], "x")
    with pytest.raises(QueryError, match="list of integers"):
        idx.count(["a"])


@pytest.mark.parametrize("threads, step_log2", [(1, 10), (1, 1), (3, 2), (3, 0)])
def test_top_cache_and_threads_against_brute_force(random_index, monkeypatch, threads, step_log2):
    """Searches through the in-memory samples (every 2^k-th rank, down to every rank) and over
    shards in parallel give the brute-force answers."""
    from teragram.index import top_cache

    monkeypatch.setattr(top_cache, "STEP_LOG2", step_log2)
    idx0, orc = random_index
    idx = Index(idx0.path, threads=threads)
    assert (idx._pool is None) == (threads == 1)
    for s in idx.shards:
        t = s.top
        assert t.step_log2 == step_log2 and len(t.pos) == -(-s.n // (1 << step_log2))
    rng = np.random.default_rng(11)
    for q in _queries(rng, orc, 150, idx.vocab_size, max_len=16):
        assert idx.count(q).count == orc.count(q), q
        if q:
            assert idx.longest_match(q).length == orc.suffix_len(q), q


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory, tokenizer_model):
    """A few thousand tokens in 16 or more shards."""
    docs = random_docs(np.random.default_rng(13), 110, 5, 50, 1000)
    docs += [docs[7][:30].copy(), np.concatenate([docs[3], docs[4]])]  # long repeats, across shards
    out = tmp_path_factory.mktemp("many") / "idx"
    build_from_ids(docs, out, tokenizer_model, shard_tokens=180)
    assert len(Index(out).shards) >= 16
    return out, Oracle(docs, Index(out).eos_id)


@pytest.mark.parametrize("threads, step_log2", [(1, 10), (1, 2), (1, 0), (4, 1)])
def test_many_shards_against_brute_force(many_shards, monkeypatch, threads, step_log2):
    """All shards searched in one call (index/fanout.py), or in runs of shards on threads, with
    samples every rank, every few ranks or none inside a shard: count, prob, the ∞-gram's
    suffix and counts, and the longest match, of contexts up to 32 tokens, against brute force."""
    from teragram.index import top_cache

    monkeypatch.setattr(top_cache, "STEP_LOG2", step_log2)
    path, orc = many_shards
    idx = Index(path, threads=threads)
    rng = np.random.default_rng(17)
    queries = _queries(rng, orc, 100, idx.vocab_size, max_len=33) + [[int(x) for x in orc.docs[-1][:32]]]
    for q in queries:
        c = int(rng.choice(orc.docs[0])) if rng.random() < 0.8 else int(rng.integers(3, idx.vocab_size))
        assert idx.count(q).count == orc.count(q), q
        r = idx.prob(q, c)
        assert (r.prompt_cnt, r.cont_cnt, r.prob) == pytest.approx(orc.prob(q, c)), q
        sl = orc.suffix_len(q)
        ip = idx.infgram_prob(q, c)
        assert ip.suffix_len == sl and (ip.prompt_cnt, ip.cont_cnt, ip.prob) == pytest.approx(orc.prob(q[len(q) - sl :], c)), q
        inn = idx.infgram_ntd(q)
        assert inn.suffix_len == sl and _ntd_counts(inn) == orc.next_tokens(q[len(q) - sl :]), q
        if q:
            lm = idx.longest_match(q)
            assert (lm.length, lm.cont, lm.count) == orc.feature_at(q, len(q) - 1, len(q), 1)[:3], q
    assert max(orc.suffix_len(q) for q in queries) == 32


@pytest.mark.parametrize("threads, step_log2, caps", [(1, 10, (1, 2, 4, 8, 16)), (3, 2, (0, 5, 40)), (1, 0, (0, 2)), (2, 10, (0, 1, 3))])
def test_bulk_over_many_shards_against_brute_force(many_shards, monkeypatch, threads, step_log2, caps):
    """Bulk features of documents whose matches cross shards and run long (index/matching.py:
    every shard searched together, the capped matches narrowed from the suffixes that start at
    each position), with samples every rank, every few or none; a token the index cannot hold
    matches nothing. Against the per-position oracle."""
    from teragram.index import top_cache
    from teragram.index.bulk import continuations

    monkeypatch.setattr(top_cache, "STEP_LOG2", step_log2)
    path, orc = many_shards
    idx = Index(path)
    rng = np.random.default_rng(19)
    e = orc.docs[-1][:70].copy()  # a long match broken every 9 tokens: it restarts from a suffix of itself
    e[::9] = rng.choice(np.unique(orc.flat[orc.flat >= 0]), size=len(e[::9]))
    odd = orc.docs[2][:25].copy()
    odd[10] = idx.vocab_size + 3
    docs = [orc.docs[-1][:60], orc.docs[-2], e, odd, rng.integers(3, idx.vocab_size, size=30)]
    starts = np.cumsum([0] + [len(x) for x in docs])
    got = continuations(idx, np.concatenate(docs), starts, caps, top_k=2, threads=threads)
    assert max(int(got[caps[0]].length.max()), int(got[caps[-1]].length.max())) >= min(c for c in caps if c)
    _check_bulk(got, docs, starts, orc, 2)


def test_scorer_estimates_over_many_shards_against_brute_force(many_shards):
    """The incremental scorer's longest match and the gates' estimates after every prefix (the
    continuations of the last min(L, k) tokens, summed over the shards), through restarts,
    a snapshot and restore, against brute force."""
    path, orc = many_shards
    idx = Index(path)
    rng = np.random.default_rng(23)
    seq = np.concatenate([orc.docs[-1][:40], rng.choice(orc.docs[0], 10), orc.docs[-2][:20]])
    lengths = {"inf": 0, "one": 1, "three": 3, "eight": 8}
    sc = idx.scorer(top_k=2, max_len=6)
    for t, tok in enumerate(seq):
        f = sc.append(int(tok))
        if t == 30:
            snap = sc.snapshot()
            sc.append(int(seq[0]))
            sc.restore(snap)
        L = orc.suffix_len(seq[: t + 1])
        assert f.length[0] == min(L, 6), t
        got_L, est = sc.estimates(lengths)
        assert got_L == L, t
        for name, k in lengths.items():
            k = min(L, k) if k else L
            ctx = seq[t + 1 - k : t + 1] if k else []
            n, toks, cnts = est[name]
            assert n == orc.count(ctx), (t, name)
            assert dict(zip(toks.tolist(), cnts.tolist())) == orc.next_tokens(ctx), (t, name)
    assert len(sc.lookup_s) == len(seq) + 1


@pytest.mark.parametrize("which", ["random_index", "real"])
def test_draft_continuations_against_brute_force(which, request):
    """The scorer's occurrence / following / top_continuation (drafts for speculative
    decoding) against brute force: the most recent occurrence of the longest match and the
    tokens after it; the ∞-gram's argmax, extended one token at a time."""
    idx, orc = request.getfixturevalue(which)
    rng = np.random.default_rng(11)
    for _ in range(40):
        d = orc.docs[rng.integers(len(orc.docs))]
        q = [int(x) for x in d[: int(rng.integers(1, min(len(d), 30) + 1))]]
        if rng.random() < 0.3:
            q[-1] = int(rng.integers(3, idx.vocab_size))
        sc = idx.scorer(max_len=64)
        for t in q:
            sc.append(t)
        L = orc.suffix_len(q)
        occ = sc.occurrence()
        if L == 0:
            assert occ is None and len(sc.top_continuation(5)) == 0
            continue
        suf = q[len(q) - L :]
        where = orc.occurrences(suf)
        doc, start = where[-1]  # corpus order: the last is the most recent
        assert occ.length == L
        s = idx.shards[occ.shard]
        got_doc = s.first_doc + s.doc_of(occ.pos)
        assert (got_doc, occ.pos - int(s.starts[s.doc_of(occ.pos)])) == (doc, start)
        after = orc.docs[doc][start + L : start + L + 7]
        assert list(idx.following(occ, 7)) == [int(x) for x in after]
        want, ctx = [], list(suf)
        for _ in range(6):
            nt = orc.next_tokens(ctx)
            top = min(nt, key=lambda t: (-nt[t], t)) if nt else None
            if top is None or top == idx.eos_id:
                break
            want.append(top)
            ctx.append(top)
        assert list(sc.top_continuation(6)) == want


def _vmflags(arr) -> set[str]:
    """The VmFlags of the mapping that holds this memory-mapped array's data (/proc/self/smaps; by
    address, not by file name: another Index of the same files may still be mapped)."""
    addr = arr.__array_interface__["data"][0]
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        span = line.split(" ", 1)[0]
        if "-" in span and all(c in "0123456789abcdef-" for c in span):
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                for rest in lines[i + 1 :]:
                    if rest.startswith("VmFlags:"):
                        return set(rest.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_searched_arrays_are_advised_random_unless_scanned(real_index):
    """access="random" (queries) marks the tokens and the suffix array MADV_RANDOM ("rr" in
    smaps), and the answers do not change; "normal" (the builder's scans) leaves read-ahead on;
    building the top-level cache, a strided scan, and bulk work (readahead()) do not leave the
    advice off."""
    rnd, nrm = Index(real_index), Index(real_index, access="normal")
    q = [int(t) for t in rnd.shards[0].tok[:2]]  # the first document's first two tokens
    assert rnd.count(q).count == nrm.count(q).count > 0
    sa, tok = rnd.shards[0].sa.words, rnd.shards[0].tok
    del nrm
    import gc

    gc.collect()
    assert "rr" in _vmflags(sa) and "rr" in _vmflags(tok)
    with rnd.readahead():  # bulk work: read-ahead on for its duration
        assert "rr" not in _vmflags(sa)
    assert "rr" in _vmflags(sa)
    del rnd, sa, tok
    gc.collect()
    nrm = Index(real_index, access="normal")
    nrm.count(q)
    assert "rr" not in _vmflags(nrm.shards[0].sa.words) and "rr" not in _vmflags(nrm.shards[0].tok)


def test_stored_top_samples_are_used_checked_and_optional(tmp_path, tokenizer_model, monkeypatch):
    """The builder stores each shard's samples (top.*.bin); an index opens with them, without
    reading its suffix arrays; stored samples that do not fit the shard, or none (an index built
    before they existed), make the engine build them, with the same answers."""
    import shutil

    from teragram.index import format as fmt
    from teragram.index import top_cache

    docs = random_docs(np.random.default_rng(3), 60, 6, 50, 1000)
    out = tmp_path / "idx"
    build_from_ids(docs, out, tokenizer_model, shard_tokens=600)
    orc = Oracle(docs, Index(out).eos_id)
    qs = _queries(np.random.default_rng(5), orc, 60, 1000)
    want = [orc.count(q) for q in qs]
    for s in Index(out).shards:
        t = top_cache.build(s.tok, s.sa.words, s.sa.width, s.n, top_cache.STEP_LOG2)
        stored = top_cache.load(s.dir, s.tok, s.sa.words, s.sa.width, s.n)
        assert np.array_equal(stored.pos, t.pos) and np.array_equal(stored.prefix, t.prefix)
    built = []
    real_build = top_cache.build
    monkeypatch.setattr(top_cache, "build", lambda *a: built.append(1) or real_build(*a))
    idx = Index(out)
    assert [idx.count(q).count for q in qs] == want and not built  # the stored samples, no strided read
    d = fmt.shard_dir(out, 0)
    pos = np.array(fmt.open_array(d / top_cache.POS_FILE, "top.pos"))
    pos[0] += 1
    fmt.write_array(d / top_cache.POS_FILE, "top.pos", pos)  # a sample that is not the suffix array's
    idx = Index(out)
    assert [idx.count(q).count for q in qs] == want and len(built) == 1
    for s in range(len(Index(out).shards)):  # an index without stored samples
        for name in (top_cache.POS_FILE, top_cache.PREFIX_FILE):
            (fmt.shard_dir(out, s) / name).unlink()
    built.clear()
    idx = Index(out)
    assert [idx.count(q).count for q in qs] == want and len(built) == len(idx.shards)
    shutil.rmtree(out)


def test_answer_json_is_the_json_of_the_answer(real):
    """The server's body (results.answer_json, next tokens written from arrays) equals, byte for
    byte, Starlette's JSONResponse of the answer's dict with the token texts: every query type,
    and the empty prompt's histogram, which holds every piece of the vocabulary (quotes,
    backslashes and non-ASCII text among them)."""
    from fastapi.responses import JSONResponse
    from teragram.index.results import answer_json, with_tokens

    idx, orc = real
    with pytest.raises(ValueError):  # the engine's kept histogram is not the caller's to change
        idx.ntd([]).counts[0] = 0
    special = [any(ch in p for ch in '"\\') or not p.isascii() for p in map(idx.piece, idx.ntd([]).tokens)]
    assert sum(special) > 10  # the empty prompt's next tokens: pieces that JSON escapes
    for q in _queries(np.random.default_rng(5), orc, 40, idx.vocab_size, max_len=4):
        answers = [idx.count(q), idx.ntd(q), idx.infgram_ntd(q)]
        if q:
            answers += [idx.prob(q[:-1], q[-1]), idx.infgram_prob(q[:-1], q[-1]), idx.docs(q)]
        for a in answers:
            r = a.to_json()
            if "result_by_token_id" in r:
                r["result_by_token_id"] = {str(k): v for k, v in r["result_by_token_id"].items()}
            want = JSONResponse(with_tokens(idx, r, q) | {"latency": 0.25}).body
            assert answer_json(idx, a, q, latency=0.25) == want, (q, type(a).__name__)
