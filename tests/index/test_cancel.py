"""Cooperative cancellation (index/cancel.py): check_cancelled raises only inside a cancellable()
whose event is set, in that thread alone; and a query whose event is set while it runs stops at
its next shard instead of reading the rest (docs, ntd, AND/OR counts and documents)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from teragram.index import cnf
from teragram.index.cancel import cancellable, check_cancelled
from teragram.index.engine import Index
from teragram.index.errors import Cancelled, TeragramError

from tests.conftest import copytree


def test_check_cancelled_raises_only_inside_a_set_cancellable():
    check_cancelled()  # no cancellable: nothing
    outer, inner = threading.Event(), threading.Event()
    with cancellable(outer):
        check_cancelled()
        with cancellable(inner):
            outer.set()
            check_cancelled()  # the innermost event rules
            inner.set()
            with pytest.raises(Cancelled):
                check_cancelled()
        with pytest.raises(Cancelled):
            check_cancelled()
        with ThreadPoolExecutor(1) as ex:  # another thread has a context of its own
            assert ex.submit(check_cancelled).result() is None
    check_cancelled()  # reset on leaving
    assert issubclass(Cancelled, TeragramError)


@pytest.fixture(scope="module")
def idx(real_index, tmp_path_factory):  # a copy: an index's LMDB opens once in a process, and other tests' may hold it
    i = Index(copytree(real_index, tmp_path_factory.mktemp("cancel") / "idx"))
    assert len(i.shards) >= 3
    return i


def _stopped_after_first(monkeypatch, owner, name: str, call):
    """call() with cancellation set from inside the first call of owner.name: (raised, calls)."""
    ev, calls = threading.Event(), []
    original = getattr(owner, name)

    def first_cancels(*a, **kw):
        calls.append(1)
        ev.set()
        return original(*a, **kw)

    monkeypatch.setattr(owner, name, first_cancels)
    with cancellable(ev):
        try:
            call()
        except Cancelled:
            return True, len(calls)
    return False, len(calls)


def test_a_cancelled_query_stops_at_its_next_shard(idx, monkeypatch):
    the = idx.tokenize("the")
    common = [[[int(t)]] for t in np.argsort(idx.unigram[: idx.vocab_size])[-2:]]  # the two most frequent tokens, ANDed
    held = sum(b > a for a, b in idx.count_intervals(np.asarray(the))[1])
    assert held >= 3  # every query below reads several shards
    with monkeypatch.context() as m:
        assert _stopped_after_first(m, Index, "shard_docs", lambda: idx.docs(the, max=1000)) == (True, 1)
    with monkeypatch.context() as m:
        idx._dist_cache.clear()
        assert _stopped_after_first(m, Index, "shard_dist", lambda: idx.ntd(the)) == (True, 1)
    with monkeypatch.context() as m:
        assert _stopped_after_first(m, cnf, "_shard_ranges", lambda: idx.count_cnf(common)) == (True, 1)
    with monkeypatch.context() as m:
        assert _stopped_after_first(m, cnf, "_shard_ranges", lambda: cnf.search_docs_cnf(idx, common, maxnum=5)) == (True, 1)
    ev, docs, ntd = threading.Event(), idx.docs(the, max=5), idx.ntd(the)
    with cancellable(ev):  # not set: the same answers as without
        assert idx.docs(the, max=5) == docs and idx.ntd(the) == ntd and idx.count_cnf(common).count > 0
        ev.set()
        for query in (lambda: idx.count(the), lambda: idx.infgram_ntd(the), lambda: idx.prob(the, 5)):
            with pytest.raises(Cancelled):
                query()
