"""Searches of many shards in one call, advanced in lockstep.

A query over S shards makes S independent binary searches (two per count). Each step of one
search waits on cache misses -- the suffix-array word, then the token it points at -- so
searching the shards one after another costs S times one shard's latency (about ten such
steps per bound once a shard's in-memory samples are done). Here the searches of all shards
take their steps together, one step of every search per round: a round first reads each
search's suffix-array word (asked for a round earlier) and asks for the token it points at and
for the words of the next round's two candidates, then compares. The misses of a round are
independent and the memory system serves them at once, so a round costs about one miss
whatever S is. One numba call per query also replaces S calls from Python.

A search starts inside the block of ranks whose suffixes begin with the pattern's first token:
the suffix array sorts by first token, so the running sum of the shard's unigram counts gives
every block's start. The smaller the shard, the more tokens' blocks are shorter than the gap
between two in-memory samples, and their searches skip the samples.

The longest suffix (the ∞-gram's) is searched over its length, galloping up from 1 then
bisecting, one probe of the shards per length. A shard that lacks a suffix lacks every longer
one, so once a length is found, the shards that failed at it are not searched again; the
intervals (and the continuation's) are then found only in the shards holding the longest.

The kernels reach the shards' memory-mapped arrays through their addresses (ShardSet.table);
a ShardSet holds the arrays themselves too, so the addresses stay valid while it lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import contexts
from .errors import IndexFormatError
from .packed import get

_NB = dict(cache=True, nogil=True)

# columns of ShardSet.table
TOK, TOK_LEN, WORDS, WORDS_LEN, WIDTH, N, FIRST_SAMPLE = range(7)

# columns of a search's state (one row per bound search)
SHARD, START, END, LO, HI, UPPER, L, R, LLCP, RLCP, P = range(11)
N_STATE = 11


@intrinsic
def _address(typingctx, addr):
    """An integer address as a pointer, for nb.carray."""

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.int64), codegen


@intrinsic
def _prefetch(typingctx, addr):
    """Ask for the cache line at an integer address without waiting for it (llvm.prefetch)."""

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # a read, kept in every cache level, of data
        builder.call(fn, [builder.inttoptr(args[0], cgutils.voidptr_t), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


@nb.njit(inline="always")
def _tokens(table, s, dtype):
    return nb.carray(_address(table[s, TOK]), table[s, TOK_LEN], dtype)


@nb.njit(inline="always")
def _words(table, s):
    return nb.carray(_address(table[s, WORDS]), table[s, WORDS_LEN], np.uint64)


@nb.njit(**_NB)
def search_bounds(table, first_rank, pos, prefix, step_log2, pat, st, J):
    """Run the bound searches st[:J] to their ends, all in lockstep.

    Row j: the first rank in [LO, HI) of shard SHARD whose suffix's first m tokens are >=
    pat[START:END] (> if UPPER; m = END - START), HI if none, is left in column L. Every
    suffix in [LO, HI) must share the pattern's first LLCP (= RLCP) tokens. Afterwards LO and
    HI may be narrower, and RLCP is the suffix at L's common prefix with the pattern (when
    L < HI), so a lower bound L < HI with RLCP == m is an occurrence.

    A search with nothing known (LLCP = 0) starts inside the block of ranks whose suffixes
    start with the pattern's first token (first_rank). Then the shard's in-memory samples
    (every 2^step_log2-th rank, top_cache) narrow the range to one gap between two samples, and
    the memory-mapped suffix array is searched inside it; each narrows by the common prefixes
    with both ends (Manber-Myers).
    """
    _first_token_blocks(first_rank, pat, st, J)
    _search_samples(table, pos, prefix, step_log2, pat, st, J)
    _gaps_as_ranks(step_log2, st, J)
    _search_suffix_arrays(table, prefix, pat, st, J)


@nb.njit(**_NB)
def _first_token_blocks(first_rank, pat, st, J):
    """Narrow each search with nothing known to the ranks whose suffixes start with the
    pattern's first token; one token of common prefix is then known at both ends."""
    for j in range(J):
        if st[j, LLCP] == 0 and st[j, RLCP] == 0 and st[j, END] > st[j, START]:
            s = st[j, SHARD]
            t0 = pat[st[j, START]]
            a = min(max(first_rank[s, t0], st[j, LO]), st[j, HI])
            st[j, HI] = max(min(first_rank[s, t0 + 1], st[j, HI]), a)
            st[j, LO] = a
            st[j, LLCP] = 1
            st[j, RLCP] = 1


@nb.njit(**_NB)
def _search_samples(table, pos, prefix, step_log2, pat, st, J):
    """Binary searches over the in-memory samples inside each [LO, HI), all in lockstep: leaves
    in L the index (in the shard's samples) of the first sample at or past the bound, and the
    common prefixes with the samples around it in LLCP, RLCP."""
    dtype = prefix.dtype
    width = prefix.shape[1]
    mask = (1 << step_log2) - 1
    for j in range(J):  # the samples inside [LO, HI): indexes [L, R) of the shard's samples
        st[j, L] = (st[j, LO] + mask) >> step_log2
        st[j, R] = (st[j, HI] + mask) >> step_log2
    active = True
    while active:
        active = False
        for j in range(J):
            a = st[j, L]
            b = st[j, R]
            if a >= b:
                continue
            active = True
            ps = st[j, START]
            m = st[j, END] - ps
            k = min(st[j, LLCP], st[j, RLCP])
            if k >= m:  # every suffix left starts with the pattern: the bound is at an end
                if st[j, UPPER]:
                    st[j, L] = b
                else:
                    st[j, R] = a
                continue
            mid = (a + b) >> 1
            s = st[j, SHARD]
            row = table[s, FIRST_SAMPLE] + mid
            t = np.int64(0)
            while k < m:
                t = np.int64(prefix[row, k]) if k < width else np.int64(_tokens(table, s, dtype)[pos[row] + k])
                if t != pat[ps + k]:
                    break
                k += 1
            ge = st[j, UPPER] == 0 if k == m else t > pat[ps + k]
            if ge:
                st[j, R] = mid
                st[j, RLCP] = k
            else:
                st[j, L] = mid + 1
                st[j, LLCP] = k


@nb.njit(**_NB)
def _gaps_as_ranks(step_log2, st, J):
    """The gap between the two samples each sample search ended at, as ranks [L, R) (clipped
    to [LO, HI)); the common prefixes carry over."""
    mask = (1 << step_log2) - 1
    for j in range(J):
        a = st[j, L]
        if a > (st[j, LO] + mask) >> step_log2:
            st[j, L] = ((a - 1) << step_log2) + 1
        else:
            st[j, L] = st[j, LO]
        if a < (st[j, HI] + mask) >> step_log2:
            st[j, R] = a << step_log2
        else:
            st[j, R] = st[j, HI]


@nb.njit(**_NB)
def _search_suffix_arrays(table, prefix, pat, st, J):
    """Binary searches of the memory-mapped suffix arrays inside each [L, R), all in lockstep,
    to their ends (the bound in L)."""
    dtype = prefix.dtype
    itemsize = prefix.itemsize
    while True:
        # two passes a round: first each search's suffix-array word (asked for a round earlier),
        # a request for the token it points at, and requests for the words of the next round's
        # two candidates; then the comparisons, whose token misses overlap
        active = False
        for j in range(J):
            a = st[j, L]
            b = st[j, R]
            if a >= b:
                continue
            active = True
            k = min(st[j, LLCP], st[j, RLCP])
            if k >= st[j, END] - st[j, START]:
                if st[j, UPPER]:
                    st[j, L] = b
                else:
                    st[j, R] = a
                continue
            s = st[j, SHARD]
            w = table[s, WIDTH]
            mid = (a + b) >> 1
            p = get(_words(table, s), w, mid)
            st[j, P] = p
            _prefetch(table[s, TOK] + (p + k) * itemsize)
            _prefetch(table[s, WORDS] + ((((a + mid) >> 1) * w) >> 6) * 8)
            _prefetch(table[s, WORDS] + ((((mid + 1 + b) >> 1) * w) >> 6) * 8)
        if not active:
            return
        for j in range(J):
            if st[j, L] >= st[j, R]:
                continue
            tok = _tokens(table, st[j, SHARD], dtype)
            ps = st[j, START]
            m = st[j, END] - ps
            p = st[j, P]
            k = min(st[j, LLCP], st[j, RLCP])
            t = np.int64(0)
            while k < m:
                t = np.int64(tok[p + k])
                if t != pat[ps + k]:
                    break
                k += 1
            mid = (st[j, L] + st[j, R]) >> 1
            ge = st[j, UPPER] == 0 if k == m else t > pat[ps + k]
            if ge:
                st[j, R] = mid
                st[j, RLCP] = k
            else:
                st[j, L] = mid + 1
                st[j, LLCP] = k


@nb.njit(inline="always")
def set_search(st, j, s, start, end, lo, hi, d, upper):
    """Row j of a search state: the lower (upper: the upper) bound of pat[start:end] in ranks
    [lo, hi) of shard s, whose suffixes all share the pattern's first d tokens."""
    st[j, SHARD] = s
    st[j, START] = start
    st[j, END] = end
    st[j, LO] = lo
    st[j, HI] = hi
    st[j, LLCP] = d
    st[j, RLCP] = d
    st[j, UPPER] = upper


@nb.njit(**_NB)
def find(table, first_rank, pos, prefix, step_log2, q, out_lo, out_hi):
    """Every shard's suffix-array interval of q: out_lo[s], out_hi[s]."""
    S = table.shape[0]
    if q.shape[0] == 0:
        for s in range(S):
            out_lo[s] = 0
            out_hi[s] = table[s, N]
        return
    st = np.empty((2 * S, N_STATE), np.int64)
    for s in range(S):
        set_search(st, 2 * s, s, 0, q.shape[0], 0, table[s, N], 0, 0)
        set_search(st, 2 * s + 1, s, 0, q.shape[0], 0, table[s, N], 0, 1)
    search_bounds(table, first_rank, pos, prefix, step_log2, q, st, 2 * S)
    for s in range(S):
        out_lo[s] = st[2 * s, L]
        out_hi[s] = st[2 * s + 1, L]


@nb.njit(**_NB)
def narrow(table, first_rank, pos, prefix, step_log2, pat, lo, hi, out_lo, out_hi):
    """Inside every shard's interval [lo[s], hi[s]) of pat[:d] (d = len(pat) - 1), the interval
    of pat: the suffixes whose token at offset d is pat[d]."""
    S = table.shape[0]
    d = pat.shape[0] - 1
    st = np.empty((2 * S, N_STATE), np.int64)
    J = np.int64(0)  # an int64, not a literal 0: the kernels it is passed to compile once (a literal compiles its own)
    for s in range(S):
        out_lo[s] = 0
        out_hi[s] = 0
        if lo[s] < hi[s]:
            set_search(st, J, s, 0, d + 1, lo[s], hi[s], d, 0)
            set_search(st, J + 1, s, 0, d + 1, lo[s], hi[s], d, 1)
            J += 2
    search_bounds(table, first_rank, pos, prefix, step_log2, pat, st, J)
    for j in range(0, J, 2):
        s = st[j, SHARD]
        out_lo[s] = st[j, L]
        out_hi[s] = st[j + 1, L]


@nb.njit(**_NB)
def longest_suffix(table, first_rank, pos, prefix, step_log2, q, cont, out):
    """Length l of the longest suffix of q that occurs in any shard; out[0, s], out[1, s]: each
    shard's interval of q[m-l:] (empty where the shard's match is shorter; every rank when l
    is 0); out[2, s], out[3, s]: the interval of q[m-l:] + [cont] (empty if cont < 0).

    A search over l, galloping up from 1 then bisecting, with one probe (a lower bound, which
    tells whether the suffix occurs) of the shards that may still hold the suffix: one that
    lacks a suffix lacks every longer one, so after a success at l the shards that failed are
    done. Then one round of searches finds the intervals in the shards that hold the longest.
    """
    S = table.shape[0]
    m = q.shape[0]
    pat = np.empty(m + 1, np.int64)  # q + [cont]
    pat[:m] = q
    pat[m] = cont
    fails_at = np.full(S, m + 1, np.int64)  # shortest length known absent in the shard
    st = np.empty((3 * S, N_STATE), np.int64)
    lo_l = 0  # longest length found
    hi_l = m  # longest length possible
    gallop = True
    while lo_l < hi_l:
        n_tok = min(max(2 * lo_l, 1), hi_l) if gallop else (lo_l + hi_l + 1) >> 1
        J = np.int64(0)
        for s in range(S):
            if fails_at[s] > n_tok:
                set_search(st, J, s, m - n_tok, m, 0, table[s, N], 0, 0)
                J += 1
        search_bounds(table, first_rank, pos, prefix, step_log2, pat, st, J)
        found = False
        for j in range(J):
            if st[j, L] < st[j, HI] and st[j, RLCP] == n_tok:
                found = True
                out[0, st[j, SHARD]] = st[j, L]
            else:
                fails_at[st[j, SHARD]] = n_tok
        if found:
            lo_l = n_tok
        else:
            hi_l = n_tok - 1
            gallop = False
    sl = lo_l
    J = np.int64(0)
    for s in range(S):
        if sl == 0:
            out[0, s] = 0
            out[1, s] = table[s, N]
        elif fails_at[s] > sl:  # out[0, s] is its lower bound
            set_search(st, J, s, m - sl, m, out[0, s], table[s, N], 0, 1)
            J += 1
        else:
            out[0, s] = 0
            out[1, s] = 0
        out[2, s] = 0
        out[3, s] = 0
        if cont >= 0 and out[0, s] < table[s, N] and (sl == 0 or fails_at[s] > sl):
            set_search(st, J, s, m - sl, m + 1, out[0, s], table[s, N], 0, 0)
            set_search(st, J + 1, s, m - sl, m + 1, out[0, s], table[s, N], 0, 1)
            J += 2
    search_bounds(table, first_rank, pos, prefix, step_log2, pat, st, J)
    for j in range(J):
        s = st[j, SHARD]
        if st[j, END] == m:
            out[1, s] = st[j, L]
        else:
            out[2 + st[j, UPPER], s] = st[j, L]
    return sl


@dataclass(frozen=True, eq=False)
class ShardSet:
    """Shards searched together: their arrays' addresses and in-memory samples side by side.

    table (S, 7) int64: per shard the address and length of its tokens and of its packed
    suffix array's words, the pointer width, the number of suffixes, and where its samples
    start in pos/prefix, which hold every shard's samples (top_cache.TopCache) one after
    another. first_rank (S, vocab + 1) int64: the first rank whose suffix starts with each
    token, from the shard's unigram counts (the suffix array sorts by first token, and holds
    every position but the document ends). arrays: the arrays whose addresses table holds,
    referenced so they stay mapped. contexts: the shards' stored histograms of frequent
    contexts (index/contexts.py) as the kernels take them: nodes and histograms (numba lists,
    one array per shard, empty for a shard without) and each shard's smallest stored context.
    Pattern tokens must be < vocab.
    """

    table: np.ndarray
    first_rank: np.ndarray
    pos: np.ndarray
    prefix: np.ndarray
    step_log2: int
    arrays: tuple
    contexts: tuple

    @classmethod
    def of(cls, shards, vocab: int) -> ShardSet:
        """shards: shard.Shard objects (their top caches are built here if not yet)."""
        tops = [s.top for s in shards]
        first_rank = np.zeros((len(shards), vocab + 1), np.int64)
        for row, s in zip(first_rank, shards):
            u = np.asarray(s.unigram[:vocab], np.int64)
            row[1 : len(u) + 1] = np.cumsum(u)
            row[len(u) + 1 :] = row[len(u)]
            if row[-1] != s.n:
                raise IndexFormatError(f"shard {s.id}: its unigram counts sum to {row[-1]}, not its {s.n} suffixes")
        if len({t.step_log2 for t in tops}) > 1:
            raise ValueError("the shards' samples must have one step")
        toks = [np.asarray(s.tok) for s in shards]
        words = [np.asarray(s.sa.words) for s in shards]
        first = np.cumsum([0] + [len(t.pos) for t in tops])
        table = np.array(
            [[t.ctypes.data, len(t), w.ctypes.data, len(w), s.sa.width, s.n, f] for t, w, s, f in zip(toks, words, shards, first)],
            dtype=np.int64,
        ).reshape(len(shards), 7)
        pos = np.concatenate([t.pos for t in tops]) if tops else np.zeros(0, np.int64)
        prefix = np.concatenate([t.prefix for t in tops]) if tops else np.zeros((0, 1), np.uint16)
        tables = [s.contexts or contexts.NONE for s in shards]
        wide = len({t.hist.dtype for t in tables}) > 1  # a shard of more than 2^32 positions among smaller ones
        ctx = (
            nb.typed.List([np.asarray(t.nodes) for t in tables]),
            nb.typed.List([np.asarray(t.hist, np.uint64) if wide else np.asarray(t.hist) for t in tables]),
            np.array([t.min_count for t in tables], np.int64),
        )
        return cls(table, first_rank, pos, prefix, tops[0].step_log2 if tops else 0, tuple(toks + words), ctx)

    def __len__(self) -> int:
        return self.table.shape[0]

    def find(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each shard's interval of q (int64 (m,)): (lo, hi), both (S,) int64."""
        lo = np.empty(len(self), np.int64)
        hi = np.empty(len(self), np.int64)
        find(self.table, self.first_rank, self.pos, self.prefix, self.step_log2, q, lo, hi)
        return lo, hi

    def narrow(self, pat: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each shard's interval of pat (m + 1,), given its intervals [lo, hi) of pat[:m]."""
        out_lo = np.empty(len(self), np.int64)
        out_hi = np.empty(len(self), np.int64)
        narrow(self.table, self.first_rank, self.pos, self.prefix, self.step_log2, pat, lo, hi, out_lo, out_hi)
        return out_lo, out_hi

    def longest_suffix(self, q: np.ndarray, cont: int = -1) -> tuple[int, np.ndarray]:
        """(l, intervals): the longest suffix of q that occurs in any of the shards, and (4, S)
        int64: each shard's interval of it, lo then hi (empty where it does not occur; every
        rank when l is 0), then the interval of the suffix + [cont] (empty if cont < 0)."""
        out = np.empty((4, len(self)), np.int64)
        sl = longest_suffix(self.table, self.first_rank, self.pos, self.prefix, self.step_log2, q, cont, out)
        return int(sl), out
