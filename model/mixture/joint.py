"""Joint training: the LM learns with the index gate's mixture in its loss.

    p(y) = w_0 p_model(y) + sum_k w_k p_k(y),   w = softmax(gate(h, statistics of the p_k))

The p_k are the estimates of model/mixture/estimates.py (the index's ∞-gram and fixed-order ones, the
document cache's), and the gate is a small network over the final hidden state h and each
estimate's statistics (its context count, its top continuation's share and whether that is the
model's most likely token, the suffix lengths, the model's confidence): the post-hoc gate of
model/mixture/gate.py plus h, trained with the LM so that the LM can specialise in what the index and
the cache do not predict.

An index estimate keeps its top K continuations (count desc, id asc) and leaves the rest of
its mass to the model: p_k = sum_i (c_i / n) [y = t_i] + (1 - sum_i c_i / n) p_model. It is a
proper distribution, its probability of the target is exact in training from the top K alone,
and generation needs only those K. The cache's estimates are exact (the document is at hand).
An estimate whose context never occurred defers wholly to the model.

Training positions see what held-out text will see: index estimates in exclude-doc mode (every
document but their own; `teragram features --mode exclude-doc --max-len N --top-k K`, one
directory per context length) and cache estimates from their own document's earlier text.
`write_train_estimates` turns them into per-position arrays (`Est`, .npy memmaps beside the
index's shards); `heldout_est` computes the same for held-out documents in bulk against the
whole index, and `live` for one context during generation: the three agree (tested).
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from teragram.index import format as fmt
from teragram.index.errors import TeragramError, TokenizerMismatch
from teragram.index.features import open_features
from teragram.model.mixture.estimates import CACHE, COMPONENTS, INDEX, cache_estimates, cache_live, context_length
from teragram.model.mixture.gate import LEN_EDGES, MAXP_EDGES, SHARE_EDGES

INFGRAM_CAP = 255  # the ∞-gram's match length cap (the builder's largest --max-len)
N_COUNT = 21  # floor(log2(count + 1)) buckets, the last one open
NL, NS, NM = len(LEN_EDGES) + 1, len(SHARE_EDGES) + 1, len(MAXP_EDGES) + 1
KIND = "joint-estimates"
# estimates from a kNN datastore over a model's states (model/mixture/knn.py), at the temperature fit on
# validation and at sharper and broader multiples of it (model/mixture/knn.MULTIPLES), and dense_cache, the
# continuous cache: the same estimate over the document's own earlier states (model/mixture/knn.doc_neighbours,
# its temperature fit on validation too): written in bulk for training positions (exclude-doc) and
# held-out text by the joint recipe's kNN stage (not yet a library verb); outside training, from the store rebuilt by
# model/mixture/knn.KnnSource (live and bulk); the index itself has none
DENSE = ("dense_knn", "dense_knn_sharp", "dense_knn_broad", "dense_cache")


def cap(name: str) -> int:
    """The match-length cap of an index component (its context length; the ∞-gram's INFGRAM_CAP)."""
    return INFGRAM_CAP if name == "index_infgram" else context_length(name)


@dataclass(frozen=True)
class Est:
    """Per position (rows) and component (columns, in the model's order): the mass the estimate
    gives the target (q) and the mass it leaves to the model (rest), its count and share
    buckets and top continuation (-1: none); per position the buckets of the ∞-gram's suffix
    length and of the cache's longest match, and whether the ∞-gram is sparse. numpy arrays
    on disk and in evaluation, torch tensors in the model (`to_torch`)."""

    q: np.ndarray  # (n, M) float32
    rest: np.ndarray  # (n, M) float32
    count: np.ndarray  # (n, M) uint8
    share: np.ndarray  # (n, M) uint8
    top: np.ndarray  # (n, M) int32
    length: np.ndarray  # (n,) uint8
    sparse: np.ndarray  # (n,) uint8
    clen: np.ndarray  # (n,) uint8

    def map(self, fn) -> Est:
        return Est(*(fn(getattr(self, f.name)) for f in fields(self)))

    @classmethod
    def combine(cls, parts: list[Est], join=np.concatenate) -> Est:
        return cls(*(join([getattr(p, f.name) for p in parts]) for f in fields(cls)))

    def __len__(self) -> int:
        return len(self.length)

    def rows(self, a: int, b: int, cols=None) -> Est:
        """Rows a..b, with only the given component columns (all by default)."""
        return self.map(lambda x: x[a:b] if x.ndim == 1 or cols is None else x[a:b][:, cols])


def empty(n: int, M: int) -> Est:
    """n positions where no estimate has anything (each defers to the model)."""
    z = np.zeros((n, M), np.uint8)
    return Est(
        np.zeros((n, M), np.float32), np.ones((n, M), np.float32), z, z, np.full((n, M), -1, np.int32), *(np.zeros(n, np.uint8),) * 3
    )


def _stats(count, topk_ids, topk_cnt, target) -> tuple[np.ndarray, ...]:
    """q, rest, count bucket, share bucket and top of one estimate from its context counts (n,),
    its top continuations (n, K) and the targets (n,)."""
    c = np.asarray(count, np.float64)
    has = c > 0
    cd = np.maximum(c, 1.0)
    ids, cnt = np.asarray(topk_ids, np.int64), np.asarray(topk_cnt, np.float64) * (np.asarray(topk_ids) >= 0)
    q = np.where(has, (cnt * (ids == np.asarray(target)[:, None])).sum(1) / cd, 0.0)
    rest = np.where(has, 1.0 - cnt.sum(1) / cd, 1.0)
    share = np.where(has, cnt[:, 0] / cd, 0.0)
    return (
        q.astype(np.float32),
        rest.astype(np.float32),
        np.clip(np.floor(np.log2(c + 1)), 0, N_COUNT - 1).astype(np.uint8),
        np.searchsorted(SHARE_EDGES, share, side="right").astype(np.uint8),
        np.where(has, ids[:, 0], -1).astype(np.int32),
    )


def assemble(index: dict, cache: dict | None, target: np.ndarray, components) -> Est:
    """Est from the index components' (count, topk_ids, topk_cnt, length) by name and the cache
    estimates (model.estimates.cache_estimates' dict, rows aligned with target)."""
    cols = []
    for c in components:
        if c in INDEX:
            n, ids, cnt, _ = index[c]
            cols.append(_stats(n, ids, cnt, target))
        else:
            k = np.asarray(cache[f"count_{c}"])
            cols.append(_stats(k, np.asarray(cache[f"top_{c}"])[:, None], (k * cache[f"share_{c}"])[:, None], target))
            cols[-1] = (np.where(k > 0, cache[f"p_{c}"], 0).astype(np.float32), np.where(k > 0, 0, 1).astype(np.float32), *cols[-1][2:])
    n = len(target)
    q, rest, cnt, share, top = (np.stack([col[i] for col in cols], 1).reshape(n, len(cols)) for i in range(5))
    if "index_infgram" in index:
        n_inf, ids, cn, length = index["index_infgram"]
        lb = np.searchsorted(LEN_EDGES, length, side="right")
        sparse = (np.asarray(n_inf) > 0) & (np.asarray(cn)[:, 0] >= np.asarray(n_inf)) & (np.asarray(ids)[:, 0] >= 0)
    else:
        lb, sparse = np.zeros(n, np.int64), np.zeros(n, bool)
    clb = np.searchsorted(LEN_EDGES, cache["cache_length"], side="right") if cache is not None else np.zeros(n, np.int64)
    return Est(q, rest, cnt, share, top, lb.astype(np.uint8), sparse.astype(np.uint8), np.asarray(clb, np.uint8))


def check_components(components) -> tuple[str, ...]:
    """Distinct component names; the dense ones last, after at least one of the index or cache."""
    comps = tuple(components)
    bad = [c for c in comps if c not in COMPONENTS + DENSE]
    if bad or not comps or len(set(comps)) != len(comps):
        raise TeragramError(f"joint components must be distinct names of {', '.join(COMPONENTS + DENSE)}; got {', '.join(comps) or 'none'}")
    own = [c for c in comps if c not in DENSE]
    if not own or comps[: len(own)] != tuple(own):
        raise TeragramError(
            f"joint components: {', '.join(DENSE)} go last, after at least one index or cache estimate; got {', '.join(comps)}"
        )
    return comps


def with_columns(e: Est, more: Est) -> Est:
    """e with more's component columns appended (its per-position fields are e's)."""
    if len(more) != len(e):
        raise TeragramError(f"{len(more)} rows of dense estimates given for {len(e)} targets")
    cols = ("q", "rest", "count", "share", "top")
    return Est(
        *(np.concatenate([getattr(e, f.name), getattr(more, f.name)], 1) if f.name in cols else getattr(e, f.name) for f in fields(Est))
    )


# ---- training positions: exclude-doc features + the document cache, written once ------------


def _feature_dirs(index_dir: Path, feature_dirs, components, top_k: int) -> dict[str, Path]:
    """The exclude-doc feature directory of each index component (by its --max-len)."""
    by_cap = {}
    digest = fmt.file_digest(index_dir / "manifest.json")
    for d in map(Path, feature_dirs):
        m = fmt.read_json(d / "manifest.json")
        if m["index_manifest"] != digest:
            raise TeragramError(f"{d}: features of another index")
        if m["mode"] != "exclude-doc" or m["top_k"] != top_k:
            raise TeragramError(f"{d}: joint training reads exclude-doc features with top_k = {top_k} (this has {m['mode']}, {m['top_k']})")
        by_cap[m["max_len"]] = d
    missing = [c for c in components if c in INDEX and cap(c) not in by_cap]
    if missing:
        need = " ".join(f"--max-len {cap(c)}" for c in missing)
        raise TeragramError(f"no exclude-doc features for {', '.join(missing)}: run teragram features --mode exclude-doc {need}")
    return {c: by_cap[cap(c)] for c in components if c in INDEX}


def _cache_rows(args) -> list[dict]:
    docs, eos = args
    return [cache_estimates(d, eos) for d in docs]


def _shard_cache(tok: np.ndarray, sep: int, eos: int, workers: int) -> dict:
    """The document cache's estimates for every position of a shard's stream (position t
    predicts t+1; a separator predicts the next document's first token, from no context)."""
    ends = np.nonzero(tok == sep)[0]
    starts = np.concatenate([[0], ends + 1])[: len(ends)]
    docs = [tok[a:e].astype(np.int64) for a, e in zip(starts, ends, strict=True)]
    jobs = [(docs[i : i + 256], eos) for i in range(0, len(docs), 256)]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(workers) as pool:
            parts = [r for rs in pool.map(_cache_rows, jobs) for r in rs]
    else:
        parts = [r for j in jobs for r in _cache_rows(j)]
    n = len(tok)
    keys = list(parts[0]) if parts else []
    out = {k: np.zeros(n, np.float64 if k.startswith(("p_", "share_")) else np.int64) for k in keys}
    for k in (k for k in keys if k.startswith("top_")):
        out[k][:] = -1
    for a, e, r in zip(starts, ends, parts, strict=True):
        # rows: targets ids[0], ..., ids[-1], EOS = the positions a - 1 .. e - 1 of the stream
        lo = a - 1
        for k in keys:
            out[k][max(lo, 0) : e] = r[k][1:] if lo < 0 else r[k]
    return out


def write_train_estimates(index_dir, feature_dirs, out, top_k: int = 4, workers: int = 1, progress: bool = True) -> Path:
    """Est of every position of an index's shards, as .npy files OUT/NNNNNN/FIELD.npy, for
    every component the feature directories allow (the index's whose --max-len is among them,
    all the cache's); resumable per shard (a shard is marked done after its files)."""
    from tqdm import tqdm

    index_dir, out = Path(index_dir), Path(out)
    caps = {fmt.read_json(Path(d) / "manifest.json")["max_len"] for d in feature_dirs}
    components = tuple(c for c in COMPONENTS if c in CACHE or cap(c) in caps)
    m = fmt.read_json(index_dir / "manifest.json")
    dirs = _feature_dirs(index_dir, feature_dirs, components, top_k)
    ident = {
        "kind": KIND,
        "index_manifest": fmt.file_digest(index_dir / "manifest.json"),
        "components": list(components),
        "top_k": top_k,
        "infgram_cap": INFGRAM_CAP,
    }
    if (out / "manifest.json").exists():
        have = fmt.read_json(out / "manifest.json")
        have["components"] = [c for c in have["components"] if c not in DENSE]  # dense columns added later (the kNN stage)
        if {k: v for k, v in have.items() if k in ident} == ident:
            return out
        raise TeragramError(f"{out}: joint estimates of another index or other components; give another directory")
    sep, eos = m["separator"], m["tokenizer"]["eos_id"]
    for s in tqdm(m["shards"], desc="joint estimates", unit="shard", disable=not progress):
        d = out / f"{s['shard']:06d}"
        if (out / f"{s['shard']:06d}.done").exists():
            continue
        tok = np.asarray(fmt.open_array(fmt.shard_dir(index_dir, s["shard"], s.get("dir")) / "tokens.bin", "tokens")).astype(np.int64)
        target = np.append(tok[1:], sep)
        target[target == sep] = eos
        index = {}
        for c, fd in dirs.items():
            f = open_features(fd / f"{s['shard']:06d}", top_k).decoded(sep)
            index[c] = (f.count, f.topk_ids, f.topk_cnt, f.length)
        cache = _shard_cache(tok, sep, eos, workers) if any(c in CACHE for c in components) else None
        e = assemble(index, cache, target, components)
        d.mkdir(parents=True, exist_ok=True)
        for f in fields(Est):
            np.save(d / f"{f.name}.npy", getattr(e, f.name))
        fmt.write_json(out / f"{s['shard']:06d}.done", {"shard": s["shard"], "positions": len(tok)})
    fmt.write_json(out / "manifest.json", ident | {"shards": [s["shard"] for s in m["shards"]]})
    return out


def open_train_estimates(out, index_dir, components, top_k: int) -> tuple[list[Est], list[int]]:
    """The memmapped Est of each shard, checked against the index, and the columns of the
    model's components in them."""
    out = Path(out)
    try:
        m = fmt.read_json(out / "manifest.json")
    except (OSError, ValueError) as e:
        raise TeragramError(f"{out}: no joint estimates ({e})") from e
    if m.get("kind") != KIND or m["index_manifest"] != fmt.file_digest(Path(index_dir) / "manifest.json"):
        raise TeragramError(f"{out}: not joint estimates of {index_dir}")
    missing = [c for c in components if c not in m["components"]]
    if missing or m["top_k"] != top_k or m["infgram_cap"] != INFGRAM_CAP:
        raise TeragramError(
            f"{out}: estimates of {', '.join(m['components'])} (top {m['top_k']}); the model needs {', '.join(components)} (top {top_k})"
        )
    shards = [Est(*(np.load(out / f"{s:06d}" / f"{f.name}.npy", mmap_mode="r") for f in fields(Est))) for s in m["shards"]]
    return shards, [m["components"].index(c) for c in components]


# ---- held-out text (bulk) and generation (live) -----------------------------------------------


def check_index(cfg, idx) -> None:
    """Refuse an index whose estimates a jointly trained model cannot read: another tokenizer."""
    have = idx.manifest["tokenizer"]["file"]["blake2b"]
    if cfg.vocab_size != idx.vocab_size or (cfg.joint_tokenizer and cfg.joint_tokenizer != have):
        raise TokenizerMismatch(
            f"{idx.path}: its tokenizer ({have}, {idx.vocab_size} ids) is not the one the model's joint gate was trained with"
            f" ({cfg.joint_tokenizer or '?'}, {cfg.vocab_size} ids)"
        )


def heldout_est(idx, docs: list[np.ndarray], components, top_k: int, threads: int = 1, dense: Est | None = None, knn=None) -> Est:
    """Est of every target of the documents, each read as EOS + ids predicting ids + EOS
    (model.evaluate.token_eval's order), against the whole index; the DENSE components' columns
    are `dense`'s (a kNN datastore's, written beside the training estimates), appended, or else `knn`'s
    (model/mixture/knn.KnnSource) of these documents."""
    from teragram.index.bulk import continuations

    components = check_components(components)
    want = [c for c in components if c in DENSE]
    if want and dense is None and knn is not None:
        dense = knn.documents(docs, idx.eos_id)
    if want and (dense is None or dense.q.shape[1] != len(want)):
        raise TeragramError(
            f"{', '.join(want)}: a kNN datastore's estimates, given in bulk (--knn-keys: the store rebuilt from its keys model); the index has none"
        )
    if want:
        return with_columns(heldout_est(idx, docs, components[: -len(want)], top_k, threads), dense)
    lens = np.array([len(d) for d in docs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)])
    ids = np.concatenate([np.asarray(d, np.int64) for d in docs]) if len(docs) else np.zeros(0, np.int64)
    caps = sorted({cap(c) for c in components if c in INDEX})
    cont = continuations(idx, ids, starts, caps, top_k=top_k, threads=threads) if caps else {}
    n = len(ids) + len(docs)
    first = starts[:-1] + np.arange(len(docs))  # each document's first target: no context
    rest = np.ones(n, bool)
    rest[first] = False

    def col(v: np.ndarray, fill) -> np.ndarray:
        o = np.full((n, *v.shape[1:]), fill, v.dtype)
        o[rest] = v
        return o

    index = {}
    for c in components:
        if c in INDEX:
            f = cont[cap(c)]
            index[c] = (col(f.count, 0), col(f.topk_ids, -1), col(f.topk_cnt, 0), col(f.length, 0))
    target = np.concatenate([np.append(np.asarray(d, np.int64), idx.eos_id) for d in docs]) if len(docs) else np.zeros(0, np.int64)
    cache = None
    if any(c in CACHE for c in components):
        parts = [cache_estimates(d, idx.eos_id) for d in docs]
        cache = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return assemble(index, cache, target, components)


def live(idx, context, V: int, components, top_k: int, knn=None) -> tuple[Est, np.ndarray]:
    """For the next token after `context` (a document's ids so far): its Est row (target
    fields unused) and each component's truncated distribution (M, V) -- the mass it gives
    each token besides what it leaves to the model. A gate that reads dense_knn takes it from
    `knn` (model/mixture/knn.KnnSource)."""
    if any(c in DENSE for c in components):
        if knn is None:
            raise TeragramError(
                f"the gate reads {', '.join(c for c in components if c in DENSE)}: a kNN datastore's estimates; without the"
                " store (--knn-keys: the checkpoint whose hidden states key it) generation has no live source for them"
            )
        e, dist = live(idx, context, V, tuple(c for c in components if c not in DENSE), top_k)
        ek, dk = knn.live(context, idx.eos_id)  # dense components go last (check_components), in the gate's order
        return with_columns(e, ek), np.vstack([dist, dk])
    q = np.asarray(context, np.int64)
    dense = np.zeros((len(components), V))
    index = {}
    length = idx.infgram_ntd(q).suffix_len if len(q) and any(c in INDEX for c in components) else 0
    for i, c in enumerate(components):
        if c not in INDEX:
            continue
        ids, cnt, n = np.full((1, top_k), -1, np.int64), np.zeros((1, top_k), np.int64), 0
        if len(q):
            k = min(length, cap(c))
            r = idx.ntd(q[len(q) - k :] if k else q[:0])
            n = r.prompt_cnt
            if r.result_by_token_id:
                t = np.fromiter(r.result_by_token_id, np.int64)
                c_ = np.array([v[0] for v in r.result_by_token_id.values()], np.int64)
                o = np.lexsort((t, -c_))[:top_k]
                ids[0, : len(o)], cnt[0, : len(o)] = t[o], c_[o]
                dense[i, t[o]] = c_[o] / n
        index[c] = (np.array([n]), ids, cnt, np.array([min(length, INFGRAM_CAP)]))
    cache = None
    if any(c in CACHE for c in components):
        dists, clen = cache_live(q, V, (*components, "cache_longest"))  # clen: the longest match, always
        cache = {"cache_length": np.array([clen])}
        for i, c in enumerate(components):
            if c in CACHE:
                d, n = dists[c]
                cache |= {f"p_{c}": np.zeros(1), f"count_{c}": np.array([n]), f"share_{c}": np.array([d.max()])}
                cache[f"top_{c}"] = np.array([int(np.argmax(d)) if n else -1])
                dense[i] = d if n else 0.0
    return assemble(index, cache, np.zeros(1, np.int64), components), dense


def to_torch(e: Est, device=None) -> Est:
    """Est as tensors (float32 masses, int64 buckets and ids) on device."""
    t = Est(*(torch.as_tensor(np.asarray(getattr(e, f.name), np.float32 if f.name in ("q", "rest") else np.int64)) for f in fields(Est)))
    return t if device is None else t.map(lambda x: x.to(device, non_blocking=True))


# ---- the gate -------------------------------------------------------------------------------


class JointGate(nn.Module):
    """Mixture log-weights (B, T, 1 + M) over the model and M estimates: a linear function of the
    final hidden state (hidden=True) plus, as in model/mixture/gate.py, a weight per bucket of each
    estimate's count and share, per agreement of its top continuation with the model's, per
    bucket of the ∞-gram's suffix length (and again where it is sparse), of the cache's longest
    match and of the model's top probability. Starts on the model alone (a bias of 2 for it).
    detach: the hidden state is read without its gradient, so that the gate's loss reaches the
    LM only through the model's own probabilities and does not shape the trunk's states."""

    def __init__(self, n_embd: int, M: int, hidden: bool = True, *, detach: bool = False):
        super().__init__()
        self.M = M
        self.detach = detach
        # one table for every categorical feature: [length | length if sparse (+ none) | clen | maxp | per component: count, share]
        self.offsets = (0, NL, 2 * NL + 1, 3 * NL + 1, 3 * NL + 1 + NM)
        self.table = nn.Embedding(3 * NL + 1 + NM + M * (N_COUNT + NS), M + 1)
        self.agree = nn.Parameter(torch.zeros(M, M + 1))
        self.bias = nn.Parameter(torch.zeros(M + 1))
        self.hidden = nn.Linear(n_embd, M + 1, bias=False) if hidden else None
        self.reset()

    def reset(self) -> None:
        """Every weight zero, the model's bias 2 (the GPT's own init would draw them at random)."""
        for p in self.parameters():
            nn.init.zeros_(p)
        with torch.no_grad():
            self.bias[0] = 2.0

    def forward(self, h: torch.Tensor, e: Est, maxp: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        o = self.offsets
        base = o[4] + torch.arange(self.M, device=h.device) * (N_COUNT + NS)
        sparse_len = torch.where(e.sparse > 0, e.length, NL)
        mb = torch.bucketize(maxp, torch.as_tensor(MAXP_EDGES, dtype=maxp.dtype, device=maxp.device), right=True)
        idx = torch.cat(
            [
                torch.stack([e.length + o[0], sparse_len + o[1], e.clen + o[2], mb + o[3]], -1),
                e.count + base,
                e.share + base + N_COUNT,
            ],
            -1,
        )
        z = self.table(idx).sum(-2) + self.bias + (e.top == top.unsqueeze(-1)).to(h.dtype) @ self.agree
        if self.hidden is not None:
            z = z + self.hidden(h.detach() if self.detach else h)
        return torch.log_softmax(z.float(), -1)


def mixture_nll(logw: torch.Tensor, lp_y: torch.Tensor, e: Est) -> torch.Tensor:
    """-log p(y) of the mixture: (w_0 + sum_k w_k rest_k) p_model(y) + sum_k w_k q_k."""
    on_model = torch.logsumexp(torch.cat([logw[..., :1], logw[..., 1:] + torch.log(e.rest.clamp_min(1e-30))], -1), -1)
    on_target = torch.logsumexp(logw[..., 1:] + torch.log(e.q.clamp_min(1e-30)), -1)
    return -torch.logaddexp(on_model + lp_y, on_target)


def mixture_probs(logw: torch.Tensor, p_model: torch.Tensor, e: Est, dense: torch.Tensor) -> torch.Tensor:
    """The mixture's whole distribution (B, V) from one position's weights (B, 1 + M), the
    model's probabilities (B, V) and each estimate's truncated distribution (B, M, V)."""
    w = logw.exp()
    on_model = w[:, 0] + (w[:, 1:] * e.rest).sum(-1)
    return on_model.unsqueeze(-1) * p_model + torch.einsum("bm,bmv->bv", w[:, 1:], dense)
