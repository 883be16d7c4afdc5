"""index/matching.py's grouping of the capped suffixes: each distinct string once, in order."""

import numpy as np
import pytest
from teragram.index.matching import distinct_starts


@pytest.mark.parametrize("vocab", [3, 300, 70_000, 2**40])
def test_distinct_starts_are_the_distinct_strings_in_order(vocab):
    """Against np.unique over the rows of tokens: the same strings, sorted, and each start mapped
    to its string; for tokens packed 1 to 32 to a key and strings spanning several keys."""
    rng = np.random.default_rng(vocab % 1000)
    ids = rng.integers(0, vocab, 4000).astype(np.int64)
    ids[2000:2600] = ids[:600]  # repeated text
    for c in (1, 2, 5, 16, 33):
        js = np.sort(rng.choice(len(ids) - c, 1500, replace=False)).astype(np.int64)
        reps, which = distinct_starts(ids, js, c)
        grams = ids[js[:, None] + np.arange(c)]
        want, inverse = np.unique(grams, axis=0, return_inverse=True)
        assert np.array_equal(ids[reps[:, None] + np.arange(c)], want)
        assert np.array_equal(which, inverse.reshape(-1))
    assert [len(x) for x in distinct_starts(ids, np.zeros(0, np.int64), 4)] == [0, 0]
