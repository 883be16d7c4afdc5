"""The next-token histograms of an index's short, frequent contexts, summed over its shards.

Each shard stores the histograms of its own frequent contexts (index/contexts.py). Over S shards
a short, frequent context (`the`, `) {`, a newline) has S of them, each repeating the common
continuations, and bulk scoring (index/bulk.py) read and summed all S at every chunk: at 2.43B
tokens in 12 shards, 21M stored entries per 63k tokens of held-out code for its 13k contexts of
one or two tokens, half of the histograms' time. Here the histogram of every context of at most
max_len(vocab) tokens (4 with a 32k vocabulary: its tokens packed into one 64-bit key) with at
least contexts.min_count(N) occurrences in the whole index of N positions (2,320 at 2.43B) is
summed over the shards once, at the end of the build, and read in one place. The contexts are
found from the shortest: a context's histogram gives the counts of the contexts one token
longer, whose intervals are narrowed from its own (fanout.narrow). Longest matches read it too:
where it shows that a context is never followed by a token, no longer match ends there
(longest_bound). Each context's interval in every shard, found on the way, is kept beside its
histogram (spans), so the matching kernels read it instead of searching every shard for a summed
context (summed_row; 52 MB at 2.43B in 12 shards; kept down to 290 occurrences, 169 MB, they
sped bulk scoring up by ~3% more: not kept). A lower threshold is faster for bulk scoring
and costs memory: at one occurrence per 2^23 positions (290 at 2.43B; 1.6M contexts, 1.5 GB
instead of 0.77) held-out estimates ran at 45.7k instead of 39.6k tokens/s/core in 12 shards,
75.3k instead of 65.9k in 3, but serving the 2.43B index on a 24 GB machine, whose page cache
barely holds it, the extra 0.8 GB took a count's p99 under 64 clients from 43-47 to 51-53 ms
(bar 50 ms).

Files (at the index's root): contexts.keys.bin, uint64 keys in ascending order (a context's
tokens packed first-highest, below a 1 bit that marks its length, so shorter contexts sort
first); contexts.ends.bin, int64, where each key's run ends in contexts.hist.bin, which holds
int64 rows (token, count), tokens ascending, a document's end counted as EOS as bulk scoring
counts it; contexts.spans.bin, int64 (key, shard, lo/hi): each key's interval in every shard,
(0, 0) where the shard lacks it. The manifest records them ("contexts") with what they were
built from: the number of shards and positions, the digest of the shards' recorded tokens and
suffix arrays (format.shards_digest), the threshold and the longest context. An index
of one shard has its shard's table and none of these; an index opened on some of its shards does
not use them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numba as nb
import numpy as np

from . import contexts
from . import format as fmt
from .fanout import narrow

KEYS_FILE, ENDS_FILE, HIST_FILE, SPANS_FILE = "contexts.keys.bin", "contexts.ends.bin", "contexts.hist.bin", "contexts.spans.bin"
FILES = (KEYS_FILE, ENDS_FILE, HIST_FILE, SPANS_FILE)
BATCH_ROWS = 1 << 24  # histogram rows computed per kernel call at most


def key_bits(vocab: int) -> int:
    """Bits per token in a key."""
    return max(1, (vocab - 1).bit_length())


def max_len(vocab: int) -> int:
    """The longest context whose key fits 63 bits (and its length bit)."""
    return 63 // key_bits(vocab)


def keys_of(ids: np.ndarray, ends: np.ndarray, d: np.ndarray, vocab: int) -> np.ndarray:
    """The keys of the contexts ids[e - d + 1 : e + 1] (e of ends, d of d, 1 <= d <= max_len)."""
    bits = np.uint64(key_bits(vocab))
    key = np.ones(len(ends), np.uint64)
    for i in range(int(d.max(initial=0))):
        m = i < d
        tok = ids[np.where(m, ends - d + 1 + i, 0)].astype(np.uint64)
        key = np.where(m, (key << bits) | tok, key)
    return key


def tables(m: Merged | None, grams: np.ndarray | None = None) -> tuple:
    """The summed histograms as the matching kernels take them (longest_bound, summed_row):
    keys, ends, rows, bits per token and each context's interval in every shard, then the
    shards' 3-token filters (grams: index/trigrams.py); empty for an index without them."""
    grams = np.zeros((0, 0), np.uint64) if grams is None else grams
    if m is None:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros((0, 2), np.int64), 1, np.zeros((0, 1, 2), np.int64), grams
    return m.keys, m.ends, m.hist, key_bits(m.vocab), m.spans, grams


@nb.njit(cache=True, nogil=True)
def summed_row(known, ids, start, end):
    """The row of ids[start:end] among the summed contexts (known: tables), -1 if it is not one:
    then known[4][row] holds its interval in every shard ((0, 0) where a shard lacks it)."""
    keys, bits = known[0], known[3]
    m = end - start
    if keys.shape[0] == 0 or m < 1 or m * bits > 63:
        return -1
    key = np.uint64(1)
    for k in range(start, end):
        if ids[k] < 0 or ids[k] >> bits:
            return -1
        key = (key << np.uint64(bits)) | np.uint64(ids[k])
    r = np.searchsorted(keys, key)
    if r < keys.shape[0] and keys[r] == key:
        return r
    return -1


@nb.njit(cache=True, nogil=True)
def longest_bound(known, ids, i, t):
    """The most tokens the longest match ending at t can have, given that ids[i:t] occurs: m if
    the m tokens before t are a summed context (known: tables) whose histogram, over every shard,
    lacks ids[t] -- then ids[t - m : t + 1] occurs nowhere -- for the smallest such m, else
    t - i + 1. A context too rare to be summed has no longer one that is, so the search stops at
    the first. Exact; it spares the probes of matches that cannot be (index/matching.py)."""
    keys, ends, hist, bits = known[0], known[1], known[2], known[3]
    p = np.uint64(0)
    for m in range(1, min(t - i, 63 // bits) + 1):  # the context ids[t-m:t], inside the match
        p |= np.uint64(ids[t - m]) << np.uint64((m - 1) * bits)
        key = (np.uint64(1) << np.uint64(m * bits)) | p
        r = np.searchsorted(keys, key)
        if r >= keys.shape[0] or keys[r] != key:
            break
        a = ends[r - 1] if r > 0 else 0
        b = ends[r]
        while a < b:  # the first row of a token >= ids[t]
            c = (a + b) >> 1
            if hist[c, 0] < ids[t]:
                a = c + 1
            else:
                b = c
        if a == ends[r] or hist[a, 0] != ids[t]:
            return m
    return t - i + 1


@nb.njit(cache=True, nogil=True)
def _histograms(toks, words, widths, nodes, hists, mins, sep, eos, lo, hi, d, scratch, touched, out, ends):
    """The histogram over the shards of each d-token context (rows of lo, hi: its interval per
    shard) into out, rows (token, count) in token order; ends[u]: where context u's rows end."""
    e = 0
    for u in range(lo.shape[0]):
        nt = np.int64(0)  # an int64, not a literal 0: the kernels it is passed to compile once (a literal compiles its own)
        for s in range(len(toks)):
            if hi[u, s] > lo[u, s]:
                nt = contexts.count_shard(
                    toks[s], words[s], widths[s], nodes[s], hists[s], mins[s], sep, eos, lo[u, s], hi[u, s], d, scratch, touched, nt
                )
        for c in np.sort(touched[:nt]):
            out[e, 0] = c
            out[e, 1] = scratch[c]
            scratch[c] = 0
            e += 1
        ends[u] = e


@nb.njit(cache=True, nogil=True)
def _narrow_all(table, first_rank, pos, prefix, step_log2, pats, lo, hi, parent, y, out_lo, out_hi):
    """Every shard's interval of pats[parent[c]] + [y[c]], narrowed from its parent's."""
    d = pats.shape[1]
    pat = np.empty(d + 1, np.int64)
    for c in range(parent.shape[0]):
        p = parent[c]
        pat[:d] = pats[p]
        pat[d] = y[c]
        narrow(table, first_rank, pos, prefix, step_log2, pat, lo[p], hi[p], out_lo[c], out_hi[c])


def build(idx) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """(keys, ends, hist, spans, min_count) of an opened index (engine.Index over all its shards)."""
    ss = idx.shard_set
    V, eos = idx.vocab_size, idx.eos_id
    least = contexts.min_count(idx.n_positions)
    sh = idx.shards
    toks = nb.typed.List([np.asarray(s.tok) for s in sh])
    words = nb.typed.List([np.asarray(s.sa.words) for s in sh])
    widths = np.array([s.sa.width for s in sh], np.int64)
    nodes, hists, mins = ss.contexts
    W = max(V, eos + 1)
    scratch, touched = np.zeros(W, np.int64), np.zeros(W, np.int64)
    uni = idx.unigram[:V].copy()
    if 0 <= eos < V:
        uni[eos] = 0  # document ends: no context
    pats = np.nonzero(uni >= least)[0].astype(np.int64)[:, None]
    lo = np.ascontiguousarray(ss.first_rank[:, pats[:, 0]].T)
    hi = np.ascontiguousarray(ss.first_rank[:, pats[:, 0] + 1].T)
    keys, ends, hist, spans, e0 = [], [], [], [], 0
    for d in range(1, max_len(V) + 1):
        if len(pats) == 0:
            break
        held = hi > lo
        spans.append(np.stack([np.where(held, lo, 0), np.where(held, hi, 0)], axis=2))
        bound = np.minimum((hi - lo).sum(1), W)  # a context's histogram has at most this many rows
        cuts = np.searchsorted(np.cumsum(bound), np.arange(BATCH_ROWS, int(bound.sum()), BATCH_ROWS))
        parts, part_ends = [], []
        for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(pats)]):
            out = np.empty((int(bound[a:b].sum()), 2), np.int64)
            pe = np.empty(b - a, np.int64)
            _histograms(toks, words, widths, nodes, hists, mins, idx.sep, eos, lo[a:b], hi[a:b], d, scratch, touched, out, pe)
            part_ends.append(pe + sum(len(p) for p in parts))
            parts.append(out[: pe[-1] if len(pe) else 0].copy())
        h = np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)
        he = np.concatenate(part_ends) if part_ends else np.zeros(0, np.int64)
        keys.append(keys_of(pats.reshape(-1), np.arange(d - 1, pats.size, d), np.full(len(pats), d), V))
        ends.append(he + e0)
        hist.append(h)
        e0 += len(h)
        if d == max_len(V):
            break
        parent = np.repeat(np.arange(len(pats)), np.diff(he, prepend=0))
        take = (h[:, 1] >= least) & (h[:, 0] != eos)  # the contexts one token longer, frequent enough
        parent, y = parent[take], h[take, 0]
        lo2, hi2 = np.zeros((len(y), len(sh)), np.int64), np.zeros((len(y), len(sh)), np.int64)
        _narrow_all(ss.table, ss.first_rank, ss.pos, ss.prefix, ss.step_log2, pats, lo, hi, parent, y, lo2, hi2)
        pats, lo, hi = np.column_stack([pats[parent], y]), lo2, hi2
    keys = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
    if len(keys) > 1 and not (keys[1:] > keys[:-1]).all():
        raise AssertionError("merged contexts: keys out of order")
    return (
        keys,
        np.concatenate(ends) if ends else np.zeros(0, np.int64),
        np.concatenate(hist) if hist else np.zeros((0, 2), np.int64),
        np.concatenate(spans) if spans else np.zeros((0, len(sh), 2), np.int64),
        least,
    )


def write(root, idx) -> dict:
    """Build and write the index's merged histograms (idx: the index at root, opened); returns
    the manifest's record of them. Until the manifest records them, an index whose files are
    missing or of other sizes than its record's does not use them (current). idx must be opened
    on all its shards."""
    root = Path(root)
    keys, ends, hist, spans, least = build(idx)
    for n in FILES:  # old ones first: a run stopped while writing leaves none, not a mix
        (root / n).unlink(missing_ok=True)
    fmt.write_array(root / KEYS_FILE, "contexts.keys", keys)
    fmt.write_array(root / ENDS_FILE, "contexts.ends", ends)
    fmt.write_array(root / HIST_FILE, "contexts.merged", hist.reshape(-1))
    fmt.write_array(root / SPANS_FILE, "contexts.spans", spans.reshape(-1))
    return {
        "shards": len(idx.shards),
        "positions": idx.n_positions,
        "built_from": fmt.shards_digest(idx.manifest["shards"]),
        "min_count": least,
        "max_len": max_len(idx.vocab_size),
        "contexts": len(keys),
        "entries": len(hist),
        "files": [asdict(fmt.file_record(root, root / n)) for n in FILES],
    }


def current(root, rec: dict | None, shards: list[dict], vocab: int, least: int | None = None) -> dict | None:
    """rec (a manifest's "contexts" record) if the merged histograms were built from these shards
    (a manifest's shard entries: their positions and recorded digests, fmt.shards_digest; at
    threshold `least` if given) and their files are there; else None: never used, rebuilt by
    build-index."""
    if not rec:
        return None
    want = {"shards": len(shards), "positions": sum(s["n_positions"] for s in shards), "max_len": max_len(vocab)}
    want |= {"built_from": fmt.shards_digest(shards)} | ({} if least is None else {"min_count": least})
    if any(rec.get(k) != v for k, v in want.items()):
        return None
    if sorted(Path(f["path"]).name for f in rec["files"]) != sorted(FILES):  # built before the spans
        return None
    if not all((Path(root) / f["path"]).exists() and (Path(root) / f["path"]).stat().st_size == f["size"] for f in rec["files"]):
        return None
    return rec


@dataclass(frozen=True)
class Merged:
    """An index's merged histograms (memory-mapped)."""

    keys: np.ndarray  # (M,) uint64, ascending
    ends: np.ndarray  # (M,) int64
    hist: np.ndarray  # (E, 2) int64: token, count
    spans: np.ndarray  # (M, S, 2) int64: each context's interval in every shard, (0, 0) where it lacks it
    vocab: int

    def runs(self, ids: np.ndarray, at: np.ndarray, d: np.ndarray) -> np.ndarray:
        """(n, 2) int64: the rows [a, b) of hist for the contexts ids[e - d + 1 : e + 1] (e of
        at), or (-1, -1) where none is stored (too long, or too rare)."""
        out = np.full((len(at), 2), -1, np.int64)
        short = np.nonzero((d >= 1) & (d <= max_len(self.vocab)))[0]
        k = keys_of(ids, at[short], d[short], self.vocab)
        i = np.minimum(np.searchsorted(self.keys, k), max(len(self.keys) - 1, 0))
        hit = (self.keys[i] == k) if len(self.keys) else np.zeros(len(k), bool)
        i, rows = i[hit], short[hit]
        out[rows, 0] = np.where(i > 0, self.ends[np.maximum(i - 1, 0)], 0)
        out[rows, 1] = self.ends[i]
        return out


def load(root, manifest: dict, vocab: int) -> Merged | None:
    """The index's merged histograms, if built from its shards as they are (current)."""
    if current(root, manifest.get("contexts"), manifest["shards"], vocab) is None:
        return None
    root = Path(root)
    n_shards = len(manifest["shards"])
    keys = np.asarray(fmt.open_array(root / KEYS_FILE, "contexts.keys"))
    ends = np.asarray(fmt.open_array(root / ENDS_FILE, "contexts.ends"))
    hist = np.asarray(fmt.open_array(root / HIST_FILE, "contexts.merged")).reshape(-1, 2)
    spans = np.asarray(fmt.open_array(root / SPANS_FILE, "contexts.spans")).reshape(len(keys), n_shards, 2)
    return Merged(keys, ends, hist, spans, vocab)
